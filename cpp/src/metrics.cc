#include "metrics.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>

#include "json.h"

namespace ortlean {
namespace metrics {

struct Registry {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<Node>> nodes;  // sorted by name: stable JSON
};

namespace {
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: kernels may outlive static destructors
  return *r;
}

}  // namespace

Value* Node::metric(const std::string& key, bool counter) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& e : entries_)
    if (e.key == key) {
      e.counter = e.counter || counter;
      return &e.value;
    }
  entries_.emplace_back();
  entries_.back().key = key;
  entries_.back().counter = counter;
  return &entries_.back().value;
}

Node* node(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  auto& p = r.nodes[name];
  if (!p) p = std::make_unique<Node>();
  return p.get();
}

std::string to_json() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::string out = "{";
  bool first_node = true;
  for (auto& kv : r.nodes) {
    if (!first_node) out += ", ";
    first_node = false;
    json::string(out, kv.first);
    out += ": {";
    Node& n = *kv.second;
    std::lock_guard<std::mutex> lk2(n.mu_);
    for (size_t i = 0; i < n.entries_.size(); ++i) {
      if (i) out += ", ";
      json::string(out, n.entries_[i].key);
      out += ": ";
      json::number(out, n.entries_[i].value.load(std::memory_order_relaxed));
    }
    out += "}";
  }
  out += "}";
  return out;
}

void reset_counters() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (auto& kv : r.nodes) {
    Node& n = *kv.second;
    std::lock_guard<std::mutex> lk2(n.mu_);
    for (auto& e : n.entries_)
      if (e.counter) e.value.store(0.0, std::memory_order_relaxed);
  }
}

}  // namespace metrics
}  // namespace ortlean
