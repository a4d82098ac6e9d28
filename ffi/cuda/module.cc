// The private extension module `jax_tpusync._tpusync_cuda`: capsules of the CUDA FFI
// handlers, the attachment to `_tpusync`'s engine registry, stats and benchmarks.
//
// Why a separate module: `_tpusync` must keep importing on machines without CUDA, and this
// one is only built where a CUDA toolkit is found. It links its own copy of the engine code
// (built from the same sources with the same flags in the same CMake project, so object
// layouts agree), but never its own registry: attach() hands it `_tpusync`'s registry, so
// engine ids created through jax_tpusync.Engine resolve here too.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_ops.h"
#include "cuda/h2d_benchmark.h"

namespace nb = nanobind;

namespace tpusync {
namespace cuda {
namespace {

// Must match the name `_tpusync.engine_registry_capsule()` gives its capsule.
constexpr char kRegistryCapsuleName[] = "tpusync.EngineRegistry";

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  if (status.code() == StatusCode::kInvalidArgument) {
    throw nb::value_error(status.message().c_str());
  }
  throw std::runtime_error(status.message());
}

template <typename T>
T ValueOrThrow(StatusOr<T> s) {
  ThrowIfError(s.status());
  return std::move(*s);
}

void Attach(nb::capsule capsule) {
  const char* name = capsule.name();
  if (name == nullptr || std::strcmp(name, kRegistryCapsuleName) != 0) {
    ThrowIfError(InvalidArgument(std::string("expected a '") + kRegistryCapsuleName +
                                 "' capsule from _tpusync.engine_registry_capsule()"));
  }
  AttachRegistry(static_cast<EngineRegistry*>(capsule.data()));
}

nb::dict Stats() {
  CudaStats s = GetStats();
  nb::dict d;
  d["fetches"] = s.fetches;
  d["fetch_bytes"] = s.fetch_bytes;
  d["write_backs"] = s.write_backs;
  d["write_back_bytes"] = s.write_back_bytes;
  d["waits"] = s.waits;
  d["prefetch_hits"] = s.prefetch_hits;
  d["prefetch_misses"] = s.prefetch_misses;
  d["agent_busy_s"] = s.agent_busy_ns * 1e-9;
  return d;
}

nb::capsule HandlerCapsule(void* fn) { return nb::capsule(fn); }

}  // namespace
}  // namespace cuda
}  // namespace tpusync

NB_MODULE(_tpusync_cuda, m) {
  using namespace tpusync::cuda;
  m.doc() = "Private CUDA backend of jax_tpusync; use jax_tpusync.runtime._cuda.register() instead.";

  m.def("registrations", [] {
    nb::dict d;
    d["tpusync_start"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncStartCuda));
    d["tpusync_wait"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncWaitCuda));
    d["tpusync_write_back"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncWriteBackCuda));
    d["tpusync_mark"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncMarkCuda));
    d["tpusync_pointer_kind"] = HandlerCapsule(reinterpret_cast<void*>(TpusyncPointerKindCuda));
    return d;
  });
  m.def("attach", &Attach, nb::arg("registry_capsule"),
        "Resolves engine ids through _tpusync's registry (idempotent).");
  m.def("attached", &registry_attached);
  m.def("cuda_runtime_version", [] { return CUDART_VERSION; },
        "The CUDA runtime version this module was built against (e.g. 13000).");
  m.def("device_count", &DeviceCount, "CUDA devices visible here (0 without a driver).");
  m.def("stats", &Stats);
  m.def("async_error", []() -> nb::object {
    tpusync::Status st = AsyncError();
    if (st.ok()) return nb::none();
    return nb::str(st.message().c_str());
  }, "The first failure found after its op was enqueued, or None.");
  m.def(
      "memcpy_h2d_gbps",
      [](std::vector<uint64_t> sizes, int iters, int device) {
        tpusync::StatusOr<std::vector<double>> r = tpusync::Status();
        {
          nb::gil_scoped_release release;
          r = MemcpyH2DGbps(device, sizes, iters);
        }
        return ValueOrThrow(std::move(r));
      },
      nb::arg("sizes"), nb::arg("iters") = 20, nb::arg("device") = 0,
      "GB/s of plain cudaMemcpyAsync from pinned host memory, per size (the ceiling).");
  m.def(
      "engine_h2d_gbps",
      [](int64_t engine_id, int32_t tier, uint64_t tier_offset, std::vector<uint64_t> sizes,
         int iters, int device) {
        tpusync::StatusOr<std::vector<double>> r = tpusync::Status();
        {
          nb::gil_scoped_release release;
          r = EngineH2DGbps(device, engine_id, tier, tier_offset, sizes, iters);
        }
        return ValueOrThrow(std::move(r));
      },
      nb::arg("engine_id"), nb::arg("tier"), nb::arg("tier_offset"), nb::arg("sizes"),
      nb::arg("iters") = 20, nb::arg("device") = 0,
      "GB/s of the start/wait path (agent, engine, mirror, H2D) per size, outside XLA.");
}
