// Process-wide runtime metrics, keyed by node name then metric name (values are doubles).
//
// A node entry is created on first use and never freed (kernels keep a pointer to it); several
// kernels with the same node name (e.g. two sessions of one model) share the entry. Values are
// either static ("set": rank, gap, ...) or counters ("add": calls, rows, ...).
// ortlean_metrics_reset() zeroes the counters only: nodes stay listed with their static values.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <mutex>
#include <string>

namespace ortlean {
namespace metrics {

using Value = std::atomic<double>;

inline void set(Value* v, double x) { v->store(x, std::memory_order_relaxed); }
inline void add(Value* v, double x) {
  double cur = v->load(std::memory_order_relaxed);
  while (!v->compare_exchange_weak(cur, cur + x, std::memory_order_relaxed)) {
  }
}

// Phase clocks: kernels constructed while ORTLEAN_PHASE_TIMES=1 is in the environment add their phases'
// wall times (time.*_us metrics, in microseconds: elapsed_us)
inline bool phase_times() {
  const char* v = std::getenv("ORTLEAN_PHASE_TIMES");
  return v && std::strcmp(v, "1") == 0;
}
inline double elapsed_us(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

class Node;
std::string to_json();
void reset_counters();

class Node {
 public:
  // The metric `key` of this node, created (value 0) if absent; the pointer stays valid for the
  // life of the process. Call at kernel construction, then use set()/add() lock-free.
  Value* metric(const std::string& key, bool counter);

  // A kernel's metrics at construction: static values, and the slots of the values it updates per
  // call (counters are summed over calls and zeroed by reset; gauges hold the last value).
  struct Static {
    const char* key;
    double value;
  };
  struct Slot {
    Value** slot;
    const char* key;
  };
  void set(std::initializer_list<Static> values) {
    for (const Static& v : values) metrics::set(metric(v.key, false), v.value);
  }
  void counters(std::initializer_list<Slot> slots) {
    for (const Slot& s : slots) *s.slot = metric(s.key, true);
  }
  void gauges(std::initializer_list<Slot> slots) {
    for (const Slot& s : slots) *s.slot = metric(s.key, false);
  }

 private:
  friend std::string to_json();
  friend void reset_counters();
  struct Entry {
    std::string key;
    bool counter = false;
    Value value{0.0};
  };
  std::mutex mu_;  // guards entries_ (a deque: element addresses stay valid on growth)
  std::deque<Entry> entries_;
};

// Get-or-create the entry of a node.
Node* node(const std::string& name);

// JSON object {"node": {"metric": value, ...}, ...}; non-finite values are written as null.
std::string to_json();
void reset_counters();

}  // namespace metrics
}  // namespace ortlean
