// Attribute tables: each op lists its attributes once (name, type, default); its kernel reads the
// node's values through that table (Attrs), and ortlean_op_schema_json() exports the defaults from
// the same table, so the defaults a kernel uses and the ones it reports cannot drift apart.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "ort_api.h"

namespace ortlean {

enum class AttrType : uint8_t { Int, Float, String, Ints, Floats };

// Required: the node must carry it. Default: absent means `def`. Optional: may be absent and has
// no constant default (metadata, or a default derived from other values, e.g. params_dense = K*N):
// an absent Optional string or list reads as empty, an absent number must be checked with given().
enum class AttrNeed : uint8_t { Required, Default, Optional };

constexpr double kUnbounded = 1.0e300;

// An attribute: name, type, need, default, and its valid values. Every value a node gives (each
// element of a list) is checked at kernel construction: numbers must be finite (or NaN where
// nan_ok) and within
// [lo, hi] (an open end excludes it; integers are compared exactly below 2^53), strings one of
// `choices` ("a|b|c"; nullptr: any). Rules that involve other attributes or the inputs (a length
// of d + 1, block <= K, ...) are checked by the kernel.
struct AttrSpec {
  const char* name;
  AttrType type;
  AttrNeed need;
  double num;       // default of an Int / Float (a Float's NaN means "not measured": JSON null)
  const char* str;  // default of a String (lists default to empty)
  double lo = -kUnbounded, hi = kUnbounded;
  bool lo_open = false, hi_open = false;
  bool nan_ok = false;  // a Float may be NaN: "not measured" (metadata such as gap)
  const char* choices = nullptr;

  constexpr AttrSpec range(double l, double h) const {  // [l, h]
    AttrSpec s = *this;
    s.lo = l;
    s.hi = h;
    return s;
  }
  constexpr AttrSpec at_least(double l) const { return range(l, kUnbounded); }  // [l, inf)
  constexpr AttrSpec positive() const {  // (0, inf)
    AttrSpec s = at_least(0);
    s.lo_open = true;
    return s;
  }
  constexpr AttrSpec fraction() const {  // (0, 1]
    AttrSpec s = range(0, 1);
    s.lo_open = true;
    return s;
  }
  constexpr AttrSpec flag() const { return range(0, 1); }  // an Int 0 | 1
  constexpr AttrSpec or_nan() const {
    AttrSpec s = *this;
    s.nan_ok = true;
    return s;
  }
  constexpr AttrSpec one_of(const char* c) const {
    AttrSpec s = *this;
    s.choices = c;
    return s;
  }
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

// The metadata of the layer a weight op replaced (DESIGN.md: every node carries them; written by the
// rewriter, shown by `ortlean inspect`); TTMatMul, ProcSparseMatMul and EventGatedMatMul join it to
// their own table.
constexpr AttrSpec kLayerMetadata[] = {
    attr_optional("params_dense", AttrType::Int).at_least(0),
    attr_optional("params_stored", AttrType::Int).at_least(0),
    attr_optional("layer", AttrType::String),
    attr_optional("target", AttrType::String).one_of("mlp|attn|head"),
};

template <size_t A, size_t B>
constexpr std::array<AttrSpec, A + B> join(const AttrSpec (&a)[A], const AttrSpec (&b)[B]) {
  std::array<AttrSpec, A + B> r{};
  for (size_t i = 0; i < A; ++i) r[i] = a[i];
  for (size_t i = 0; i < B; ++i) r[A + i] = b[i];
  return r;
}

struct AttrTable {
  const AttrSpec* specs;
  size_t size;
  template <size_t N>
  constexpr AttrTable(const AttrSpec (&a)[N]) : specs(a), size(N) {}
  template <size_t N>
  constexpr AttrTable(const std::array<AttrSpec, N>& a) : specs(a.data()), size(N) {}
  const AttrSpec* begin() const { return specs; }
  const AttrSpec* end() const { return specs + size; }
};

// One node's attribute values, read once at kernel construction through its op's table. Asking
// for a name the table does not list, or with another type, is a bug (std::logic_error).
class Attrs {
 public:
  Attrs(const Ort::ConstKernelInfo& info, AttrTable table);

  // Where read() puts a value: the slot's type must match the attribute's (a flag may go to bool).
  struct Slot {
    const char* name;
    AttrType type;
    void* out;
    bool as_bool = false;
    Slot(const char* n, int64_t* p) : name(n), type(AttrType::Int), out(p) {}
    Slot(const char* n, bool* p) : name(n), type(AttrType::Int), out(p), as_bool(true) {}
    Slot(const char* n, float* p) : name(n), type(AttrType::Float), out(p) {}
    Slot(const char* n, std::string* p) : name(n), type(AttrType::String), out(p) {}
    Slot(const char* n, std::vector<int64_t>* p) : name(n), type(AttrType::Ints), out(p) {}
    Slot(const char* n, std::vector<float>* p) : name(n), type(AttrType::Floats), out(p) {}
  };
  // Copies each named value (the default when absent) to its slot; an absent Optional attribute
  // leaves the slot as it is (the caller's derived default).
  void read(std::initializer_list<Slot> slots) const;

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

// Throws OpError naming the attribute unless v (a given value, or a list element `index`) is
// valid for spec (see AttrSpec).
void check_number(const AttrSpec& spec, double v, long index = -1);
void check_string(const AttrSpec& spec, const std::string& v);

// {"<attr>": <default>, ...} of one table: Default entries only (NaN floats as null).
std::string attr_defaults_json(AttrTable table);

}  // namespace ortlean
