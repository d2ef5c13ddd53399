// Library entry points: RegisterCustomOps (called by ORT's register_custom_ops_library) and the
// small ortlean_* C API read by custom_ops/__init__.py through ctypes. The ops of the library are
// the list kOps below: adding an op is one line here.
#include <cstring>
#include <string>

#include "attrs.h"
#include "blas.h"
#include "isa.h"
#include "metrics.h"
#include "op.h"
#include "ops/block_quant.h"
#include "ops/event_gated_matmul.h"
#include "ops/packed_attention.h"
#include "ops/proc_sparse.h"
#include "ops/tt_matmul.h"

#define ORTLEAN_EXPORT extern "C" __attribute__((visibility("default")))

#ifndef ORTLEAN_VERSION
#define ORTLEAN_VERSION "0.0.0"
#endif

namespace ortlean {
namespace {

constexpr const char* kDomain = "ai.ortlean";

struct OpEntry {
  const char* type;
  AttrTable attrs;
  OrtCustomOp* (*instance)();
};

// One OrtCustomOp per op for the life of the process (ORT keeps pointers to it).
template <class Kernel>
OrtCustomOp* op_instance() {
  static OpDef<Kernel>* op = new OpDef<Kernel>();
  return op;
}

template <class Kernel>
constexpr OpEntry op_entry() {
  return {Kernel::kOpType, AttrTable(Kernel::kAttrs), &op_instance<Kernel>};
}

constexpr OpEntry kOps[] = {
    op_entry<TTMatMulKernel>(),
    op_entry<ProcSparseMatMulKernel>(),
    op_entry<EventGatedMatMulKernel>(),
    op_entry<PackedAttentionKernel>(),
    op_entry<BlockQuantMatMulKernel>(),
    op_entry<BlockQuantGatherKernel>(),
};

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
    (void)isa();  // pick the ISA now (ORTLEAN_ISA is read once per process)
    // A domain per session options; never released (it must outlive every session using it).
    OrtCustomOpDomain* domain = nullptr;
    Ort::ThrowOnError(api->CreateCustomOpDomain(kDomain, &domain));
    for (const OpEntry& op : kOps) Ort::ThrowOnError(api->CustomOpDomain_Add(domain, op.instance()));
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
    auto* s = new std::string("{");
    try {
      for (const OpEntry& op : kOps) {
        if (s->size() > 1) *s += ", ";
        *s += std::string("\"") + op.type + "\": " + attr_defaults_json(op.attrs);
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

// The calling thread's "a later run continues this prompt" flag (PackedAttention: no exact prefill_tail
// in its runs; ortlean::prompt_continues). v >= 0 sets it (nonzero: on), v < 0 only reads; returns the
// value before. ORT runs a session's nodes on the thread that called Run (sequential execution), so a
// driver sets it around a run: custom_ops.prompt_continues().
ORTLEAN_EXPORT int ortlean_prompt_continues(int v) {
  const int old = ortlean::prompt_continues_flag;
  if (v >= 0) ortlean::prompt_continues_flag = v != 0;
  return old;
}

// The ISA level an op type's kernels run at on this CPU (under ORTLEAN_ISA): the process level,
// lowered for PackedAttention and the BlockQuant ops when the CPU lacks a feature their copy needs
// (PackedAttention's popcnt attribute may lower a node further: the node's pack.popcnt metric). Null
// for an op type this library lacks.
ORTLEAN_EXPORT const char* ortlean_op_isa(const char* op_type) {
  using namespace ortlean;
  if (!op_type) return nullptr;
  if (!std::strcmp(op_type, "PackedAttention")) return isa_name(isa_level(kAttnAvx2Needs, kAttnAvx512Needs));
  if (!std::strcmp(op_type, BlockQuantMatMulKernel::kOpType) || !std::strcmp(op_type, BlockQuantGatherKernel::kOpType))
    return isa_name(isa_level(kBqAvx2Needs, kBqAvx512Needs));
  for (const OpEntry& e : kOps)
    if (!std::strcmp(op_type, e.type)) return isa_name();
  return nullptr;
}

ORTLEAN_EXPORT const char* ortlean_version(void) { return ORTLEAN_VERSION; }
