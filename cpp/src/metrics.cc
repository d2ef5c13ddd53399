#include "metrics.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>

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

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void json_number(std::string& out, double v) {
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  char buf[32];
  if (v == std::floor(v) && std::fabs(v) < 1e15)
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else
    std::snprintf(buf, sizeof buf, "%.17g", v);
  out += buf;
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
    json_string(out, kv.first);
    out += ": {";
    Node& n = *kv.second;
    std::lock_guard<std::mutex> lk2(n.mu_);
    for (size_t i = 0; i < n.entries_.size(); ++i) {
      if (i) out += ", ";
      json_string(out, n.entries_[i].key);
      out += ": ";
      json_number(out, n.entries_[i].value.load(std::memory_order_relaxed));
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
