#include "attrs.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "json.h"

namespace ortlean {
namespace {

const char* type_name(AttrType t) {
  switch (t) {
    case AttrType::Int: return "int";
    case AttrType::Float: return "float";
    case AttrType::String: return "string";
    case AttrType::Ints: return "ints";
    default: return "floats";
  }
}

// Runs read() (a GetAttribute call); false when the node has no such attribute (any other error,
// e.g. a type mismatch, propagates and fails the node).
template <class F>
bool present(F&& read) {
  try {
    read();
    return true;
  } catch (const Ort::Exception& e) {
    if (std::strstr(e.what(), "No attribute")) return false;
    throw;
  }
}

std::string num_str(const AttrSpec& sp, double v) {
  char buf[40];
  if (sp.type == AttrType::Int || sp.type == AttrType::Ints)
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else
    std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string where(const AttrSpec& sp, long index) {
  return std::string("attribute ") + sp.name + (index >= 0 ? "[" + std::to_string(index) + "]" : std::string());
}

}  // namespace

void check_number(const AttrSpec& sp, double v, long index) {
  const bool is_int = sp.type == AttrType::Int || sp.type == AttrType::Ints;
  if (sp.nan_ok && std::isnan(v)) return;
  if (!std::isfinite(v)) fail(where(sp, index) + " must be finite, got " + num_str(sp, v));
  const bool lo_ok = sp.lo <= -kUnbounded || (sp.lo_open ? v > sp.lo : v >= sp.lo);
  const bool hi_ok = sp.hi >= kUnbounded || (sp.hi_open ? v < sp.hi : v <= sp.hi);
  if (lo_ok && hi_ok) return;
  std::string rule;
  if (is_int && sp.lo == 0 && sp.hi == 1 && !sp.lo_open && !sp.hi_open)
    rule = "0 or 1";
  else if (sp.hi >= kUnbounded)
    rule = std::string(sp.lo_open ? "> " : ">= ") + num_str(sp, sp.lo);
  else if (sp.lo <= -kUnbounded)
    rule = std::string(sp.hi_open ? "< " : "<= ") + num_str(sp, sp.hi);
  else
    rule = std::string("in ") + (sp.lo_open ? "(" : "[") + num_str(sp, sp.lo) + ", " + num_str(sp, sp.hi) +
           (sp.hi_open ? ")" : "]");
  fail(where(sp, index) + " must be " + rule + ", got " + num_str(sp, v));
}

void check_string(const AttrSpec& sp, const std::string& v) {
  if (!sp.choices) return;
  const char* c = sp.choices;
  while (true) {
    const char* bar = std::strchr(c, '|');
    const size_t len = bar ? static_cast<size_t>(bar - c) : std::strlen(c);
    if (v.size() == len && v.compare(0, len, c, len) == 0) return;
    if (!bar) break;
    c = bar + 1;
  }
  std::string opts = sp.choices;
  for (size_t p = 0; (p = opts.find('|', p)) != std::string::npos; p += 3) opts.replace(p, 1, " | ");
  fail(std::string("attribute ") + sp.name + " must be one of " + opts + ", got '" + v + "'");
}

Attrs::Attrs(const Ort::ConstKernelInfo& info, AttrTable table) {
  values_.reserve(table.size);
  for (const AttrSpec& sp : table) {
    Value v;
    v.spec = &sp;
    switch (sp.type) {
      case AttrType::Int:
        v.i = static_cast<int64_t>(sp.num);
        v.given = present([&] { v.i = info.GetAttribute<int64_t>(sp.name); });
        break;
      case AttrType::Float:
        v.f = static_cast<float>(sp.num);
        v.given = present([&] { v.f = info.GetAttribute<float>(sp.name); });
        break;
      case AttrType::String:
        v.s = sp.str ? sp.str : "";
        v.given = present([&] { v.s = info.GetAttribute<std::string>(sp.name); });
        break;
      case AttrType::Ints:
        v.given = present([&] { v.ints = info.GetAttributes<int64_t>(sp.name); });
        break;
      case AttrType::Floats:
        v.given = present([&] { v.floats = info.GetAttributes<float>(sp.name); });
        break;
    }
    if (!v.given && sp.need == AttrNeed::Required) fail(std::string("missing attribute '") + sp.name + "'");
    if (v.given) {
      switch (sp.type) {
        case AttrType::Int: check_number(sp, static_cast<double>(v.i)); break;
        case AttrType::Float: check_number(sp, v.f); break;
        case AttrType::String: check_string(sp, v.s); break;
        case AttrType::Ints:
          for (size_t k = 0; k < v.ints.size(); ++k) check_number(sp, static_cast<double>(v.ints[k]), static_cast<long>(k));
          break;
        case AttrType::Floats:
          for (size_t k = 0; k < v.floats.size(); ++k) check_number(sp, v.floats[k], static_cast<long>(k));
          break;
      }
    }
    values_.push_back(std::move(v));
  }
}

const Attrs::Value& Attrs::get(const char* name, AttrType type, bool need_value) const {
  for (const Value& v : values_) {
    if (std::strcmp(v.spec->name, name) != 0) continue;
    if (v.spec->type != type)
      throw std::logic_error(std::string("attribute '") + name + "' is declared " + type_name(v.spec->type) +
                             ", read as " + type_name(type));
    if (need_value && !v.given && v.spec->need == AttrNeed::Optional &&
        (type == AttrType::Int || type == AttrType::Float))
      throw std::logic_error(std::string("attribute '") + name + "' has no default: check given() first");
    return v;
  }
  throw std::logic_error(std::string("attribute '") + name + "' is not in the op's attribute table");
}

void Attrs::read(std::initializer_list<Slot> slots) const {
  for (const Slot& sl : slots) {
    const Value& v = get(sl.name, sl.type, false);
    if (!v.given && v.spec->need == AttrNeed::Optional) continue;
    switch (sl.type) {
      case AttrType::Int:
        if (sl.as_bool)
          *static_cast<bool*>(sl.out) = v.i != 0;
        else
          *static_cast<int64_t*>(sl.out) = v.i;
        break;
      case AttrType::Float: *static_cast<float*>(sl.out) = v.f; break;
      case AttrType::String: *static_cast<std::string*>(sl.out) = v.s; break;
      case AttrType::Ints: *static_cast<std::vector<int64_t>*>(sl.out) = v.ints; break;
      case AttrType::Floats: *static_cast<std::vector<float>*>(sl.out) = v.floats; break;
    }
  }
}

bool Attrs::given(const char* name) const {
  for (const Value& v : values_)
    if (std::strcmp(v.spec->name, name) == 0) return v.given;
  throw std::logic_error(std::string("attribute '") + name + "' is not in the op's attribute table");
}
int64_t Attrs::i(const char* name) const { return get(name, AttrType::Int, true).i; }
float Attrs::f(const char* name) const { return get(name, AttrType::Float, true).f; }
const std::string& Attrs::s(const char* name) const { return get(name, AttrType::String, true).s; }
const std::vector<int64_t>& Attrs::ints(const char* name) const { return get(name, AttrType::Ints, true).ints; }
const std::vector<float>& Attrs::floats(const char* name) const { return get(name, AttrType::Floats, true).floats; }

std::string attr_defaults_json(AttrTable table) {
  std::string out = "{";
  bool first = true;
  for (const AttrSpec& sp : table) {
    if (sp.need != AttrNeed::Default) continue;
    if (!first) out += ", ";
    first = false;
    json::string(out, sp.name);
    out += ": ";
    switch (sp.type) {
      case AttrType::Int: json::number(out, sp.num); break;
      case AttrType::Float: json::real(out, float_attr_value(static_cast<float>(sp.num))); break;
      case AttrType::String: json::string(out, sp.str ? sp.str : ""); break;
      default: out += "[]"; break;
    }
  }
  out += "}";
  return out;
}

}  // namespace ortlean
