// ONNX Runtime C++ API (headers only; the library never links libonnxruntime: the API table is
// set in RegisterCustomOps), the error type every op throws and the guard that turns it into an
// OrtStatus at the C boundary, and small formatting helpers for messages and metrics.
#pragma once
#ifndef ORT_API_MANUAL_INIT
#define ORT_API_MANUAL_INIT
#endif
#include <onnxruntime_cxx_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ortlean {

// The C API version the library asks for: that of ORT 1.21, so it loads in every runtime >= 1.21.
constexpr uint32_t kOrtApiVersion = 21;
static_assert(ORT_API_VERSION >= kOrtApiVersion, "ONNX Runtime headers older than 1.21");

// Error carrying an OrtErrorCode (validation failures use ORT_INVALID_ARGUMENT).
struct OpError : std::runtime_error {
  OrtErrorCode code;
  OpError(OrtErrorCode c, const std::string& msg) : std::runtime_error(msg), code(c) {}
};
[[noreturn]] inline void fail(const std::string& msg) { throw OpError(ORT_INVALID_ARGUMENT, msg); }

// Runs f() and turns any exception into an OrtStatus (nothing may cross the C boundary).
template <class F>
OrtStatus* status_guard(const std::string& prefix, F&& f) noexcept {
  const OrtApi& api = Ort::GetApi();
  try {
    f();
    return nullptr;
  } catch (const OpError& e) {
    return api.CreateStatus(e.code, (prefix + e.what()).c_str());
  } catch (const Ort::Exception& e) {
    return api.CreateStatus(e.GetOrtErrorCode(), (prefix + e.what()).c_str());
  } catch (const std::bad_alloc&) {
    return api.CreateStatus(ORT_FAIL, (prefix + "out of memory").c_str());
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_FAIL, (prefix + e.what()).c_str());
  } catch (...) {
    return api.CreateStatus(ORT_FAIL, (prefix + "unknown error").c_str());
  }
}

// "[2, 3, 4]": shapes in error messages.
inline std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

// The float attribute as the shortest decimal that rounds back to it (0.01f -> 0.01, not
// 0.009999999776), so metrics show what the rewriter wrote.
inline double float_attr_value(float f) {
  if (!std::isfinite(f)) return static_cast<double>(f);
  char buf[32];
  for (int prec = 6; prec <= 9; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) return std::strtod(buf, nullptr);
  }
  return static_cast<double>(f);
}

}  // namespace ortlean
