// Attribute tables: each op lists its attributes once (name, type, default); its kernel reads the
// node's values through that table (Attrs), and ortlean_op_schema_json() exports the defaults from
// the same table, so the defaults a kernel uses and the ones it reports cannot drift apart.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ort_api.h"

namespace ortlean {

enum class AttrType : uint8_t { Int, Float, String, Ints, Floats };

// Required: the node must carry it. Default: absent means `def`. Optional: may be absent and has
// no constant default (metadata, or a default derived from other values, e.g. params_dense = K*N):
// an absent Optional string or list reads as empty, an absent number must be checked with given().
enum class AttrNeed : uint8_t { Required, Default, Optional };

struct AttrSpec {
  const char* name;
  AttrType type;
  AttrNeed need;
  double num;       // default of an Int / Float (a Float's NaN means "not measured": JSON null)
  const char* str;  // default of a String (lists default to empty)
};

constexpr AttrSpec attr_int(const char* name, int64_t def) {
  return {name, AttrType::Int, AttrNeed::Default, static_cast<double>(def), nullptr};
}
constexpr AttrSpec attr_float(const char* name, float def) {
  return {name, AttrType::Float, AttrNeed::Default, static_cast<double>(def), nullptr};
}
constexpr AttrSpec attr_string(const char* name, const char* def) {
  return {name, AttrType::String, AttrNeed::Default, 0.0, def};
}
constexpr AttrSpec attr_list(const char* name, AttrType t) {  // default: the empty list
  return {name, t, AttrNeed::Default, 0.0, nullptr};
}
constexpr AttrSpec attr_required(const char* name, AttrType t) { return {name, t, AttrNeed::Required, 0.0, nullptr}; }
constexpr AttrSpec attr_optional(const char* name, AttrType t) { return {name, t, AttrNeed::Optional, 0.0, nullptr}; }

struct AttrTable {
  const AttrSpec* specs;
  size_t size;
  template <size_t N>
  constexpr AttrTable(const AttrSpec (&a)[N]) : specs(a), size(N) {}
  const AttrSpec* begin() const { return specs; }
  const AttrSpec* end() const { return specs + size; }
};

// One node's attribute values, read once at kernel construction through its op's table. Asking
// for a name the table does not list, or with another type, is a bug (std::logic_error).
class Attrs {
 public:
  Attrs(const Ort::ConstKernelInfo& info, AttrTable table);

  bool given(const char* name) const;  // the node carries it (else: default / absent)
  int64_t i(const char* name) const;
  float f(const char* name) const;
  const std::string& s(const char* name) const;
  const std::vector<int64_t>& ints(const char* name) const;
  const std::vector<float>& floats(const char* name) const;

 private:
  struct Value {
    const AttrSpec* spec;
    bool given = false;
    int64_t i = 0;
    float f = 0.0f;
    std::string s;
    std::vector<int64_t> ints;
    std::vector<float> floats;
  };
  const Value& get(const char* name, AttrType type, bool need_value) const;
  std::vector<Value> values_;
};

// {"<attr>": <default>, ...} of one table: Default entries only (NaN floats as null).
std::string attr_defaults_json(AttrTable table);

}  // namespace ortlean
