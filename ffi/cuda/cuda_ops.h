// The CUDA backend of the in-graph transfer ops: the handlers (cuda_ops.cc), the device
// agent behind them (device_context.h, which describes the design), the registry
// attachment and the stats. The H2D benchmarks are in h2d_benchmark.h.
//
// This header is host-only C++: it needs the CUDA runtime headers but no nvcc.
#ifndef TPUSYNC_CUDA_CUDA_OPS_H_
#define TPUSYNC_CUDA_CUDA_OPS_H_

#include <cstdint>
#include <vector>

#include "engine/registry.h"
#include "engine/status.h"
#include "xla/ffi/api/c_api.h"

namespace tpusync {
namespace cuda {

// The handlers resolve engine ids through the registry that lives in `_tpusync` (the module
// that creates engines), never through this module's own copy of EngineRegistry::Global().
// Until Attach is called, every handler fails with kFailedPrecondition.
void AttachRegistry(EngineRegistry* registry);
bool registry_attached();

// Counters of the GPU path (all devices together).
struct CudaStats {
  uint64_t fetches = 0;          // tpusync_start fetches the agents submitted to an engine.
  uint64_t fetch_bytes = 0;
  uint64_t write_backs = 0;
  uint64_t write_back_bytes = 0;
  uint64_t waits = 0;
  uint64_t prefetch_hits = 0;    // Waits whose ticket had fetched exactly the wanted bytes.
  uint64_t prefetch_misses = 0;  // Waits that fetched themselves (stale, mismatched or none).
  int64_t agent_busy_ns = 0;     // Wall time the agents spent serving items.
};
CudaStats GetStats();
// The first asynchronous failure on any device (Ok if none). Such a failure is also
// returned by every later op, so a failed transfer cannot go unnoticed.
Status AsyncError();

// The number of CUDA devices this process sees (0 without a driver or a GPU).
int DeviceCount();

extern "C" {
XLA_FFI_Error* TpusyncStartCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncWaitCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncWriteBackCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* TpusyncMarkCuda(XLA_FFI_CallFrame* call_frame);
// Diagnostics: writes cudaPointerGetAttributes(operand).type (0 unregistered host, 1 host,
// 2 device, 3 managed; 255 on error) into a uint8 scalar. Tells whether an operand with
// memory_kind="pinned_host" reaches a CUDA custom call as a host pointer.
XLA_FFI_Error* TpusyncPointerKindCuda(XLA_FFI_CallFrame* call_frame);
}

}  // namespace cuda
}  // namespace tpusync

#endif  // TPUSYNC_CUDA_CUDA_OPS_H_
