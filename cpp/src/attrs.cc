#include "attrs.h"

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

}  // namespace

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
