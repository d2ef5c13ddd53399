// Library entry points: RegisterCustomOps (called by ORT's register_custom_ops_library) and the
// small ortlean_* C API read by custom_ops/__init__.py through ctypes.
#include <cstring>
#include <mutex>
#include <vector>

#include "attrs.h"
#include "blas.h"
#include "isa.h"
#include "metrics.h"
#include "ort_common.h"
#include "proc_sparse.h"
#include "tt_matmul.h"
#include "event_gated_matmul.h"
#include "packed_attention.h"

#define ORTLEAN_EXPORT extern "C" __attribute__((visibility("default")))

#ifndef ORTLEAN_VERSION
#define ORTLEAN_VERSION "0.0.0"
#endif

namespace ortlean {

Scratch& outer_scratch() {
  thread_local Scratch s;
  return s;
}
Scratch& task_scratch() {
  thread_local Scratch s;
  return s;
}
Scratch& gemm_scratch() {
  thread_local Scratch s;
  return s;
}

namespace {

// One instance of each op for the life of the process (ORT keeps pointers to them).
TTMatMulOp& tt_matmul_op() {
  static TTMatMulOp* op = [] {
    auto* o = new TTMatMulOp();
    o->version = kOrtApiVersion;  // newer headers would announce a newer struct; ask for 1.21's
    return o;
  }();
  return *op;
}

ProcSparseMatMulOp& proc_sparse_matmul_op() {
  static ProcSparseMatMulOp* op = [] {
    auto* o = new ProcSparseMatMulOp();
    o->version = kOrtApiVersion;
    return o;
  }();
  return *op;
}

EventGatedMatMulOp& event_gated_matmul_op() {
  static EventGatedMatMulOp* op = [] {
    auto* o = new EventGatedMatMulOp();
    o->version = kOrtApiVersion;
    return o;
  }();
  return *op;
}

PackedAttentionOp& packed_attention_op() {
  static PackedAttentionOp* op = [] {
    auto* o = new PackedAttentionOp();
    o->version = kOrtApiVersion;
    return o;
  }();
  return *op;
}

constexpr const char* kDomain = "ai.ortlean";

}  // namespace
}  // namespace ortlean

ORTLEAN_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  using namespace ortlean;
  const OrtApi* api = api_base ? api_base->GetApi(kOrtApiVersion) : nullptr;
  if (!api) {
    const OrtApi* api1 = api_base ? api_base->GetApi(1) : nullptr;
    return api1 ? api1->CreateStatus(ORT_FAIL,
                                     "ortlean: this ONNX Runtime is older than 1.21 (C API 21 unavailable); "
                                     "libortlean_ops.so needs onnxruntime >= 1.21")
                : nullptr;
  }
  Ort::InitApi(api);
  return status_guard("ortlean: RegisterCustomOps: ", [&] {
    blas::init();
    (void)kernels();  // pick the ISA now (ORTLEAN_ISA is read once per process)
    // A domain per session options; never released (it must outlive every session using it).
    OrtCustomOpDomain* domain = nullptr;
    Ort::ThrowOnError(api->CreateCustomOpDomain(kDomain, &domain));
    Ort::ThrowOnError(api->CustomOpDomain_Add(domain, &tt_matmul_op()));
    Ort::ThrowOnError(api->CustomOpDomain_Add(domain, &proc_sparse_matmul_op()));
    Ort::ThrowOnError(api->CustomOpDomain_Add(domain, &event_gated_matmul_op()));
    Ort::ThrowOnError(api->CustomOpDomain_Add(domain, &packed_attention_op()));
    Ort::ThrowOnError(api->AddCustomOpDomain(options, domain));
  });
}

ORTLEAN_EXPORT size_t ortlean_metrics_json(char* buf, size_t cap) {
  try {
    const std::string s = ortlean::metrics::to_json();
    if (buf && cap > s.size()) {
      std::memcpy(buf, s.data(), s.size());
      buf[s.size()] = '\0';
    } else if (buf && cap > 0) {
      buf[0] = '\0';
    }
    return s.size();
  } catch (...) {
    if (buf && cap > 0) buf[0] = '\0';
    return 0;
  }
}

ORTLEAN_EXPORT void ortlean_metrics_reset(void) {
  try {
    ortlean::metrics::reset_counters();
  } catch (...) {
  }
}

// {"<OpType>": {"<attr>": <default>, ...}, ...}: every attribute default the kernels use, from the
// tables they read (attributes without a default are omitted; a float default NaN, "not measured",
// is null). The string lives for the life of the process.
ORTLEAN_EXPORT const char* ortlean_op_schema_json(void) {
  using namespace ortlean;
  static const std::string* json = [] {
    const struct {
      const char* op;
      AttrTable attrs;
    } ops[] = {{"TTMatMul", TTMatMulKernel::kAttrs},
               {"ProcSparseMatMul", ProcSparseMatMulKernel::kAttrs},
               {"EventGatedMatMul", EventGatedMatMulKernel::kAttrs},
               {"PackedAttention", PackedAttentionKernel::kAttrs}};
    auto* s = new std::string("{");
    try {
      for (const auto& o : ops) {
        if (s->size() > 1) *s += ", ";
        *s += std::string("\"") + o.op + "\": " + attr_defaults_json(o.attrs);
      }
      *s += "}";
    } catch (...) {
      *s = "{}";
    }
    return s;
  }();
  return json->c_str();
}

ORTLEAN_EXPORT const char* ortlean_isa(void) { return ortlean::isa_name(); }

ORTLEAN_EXPORT const char* ortlean_version(void) { return ORTLEAN_VERSION; }
