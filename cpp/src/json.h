// Minimal JSON writers shared by the metrics registry and the op schema export.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ortlean {
namespace json {

inline void string(std::string& out, const std::string& s) {
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

// Integers as integers, other values as the shortest decimal that reads back to the same double;
// non-finite values as null.
inline void number(std::string& out, double v) {
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  char buf[32];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    for (int prec = 15; prec <= 17; ++prec) {
      std::snprintf(buf, sizeof buf, "%.*g", prec, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
  }
  out += buf;
}

// A float-typed value: as number(), but an integral value keeps a decimal point (1.0, not 1).
inline void real(std::string& out, double v) {
  number(out, v);
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) out += ".0";
}

}  // namespace json
}  // namespace ortlean
