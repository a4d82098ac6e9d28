// H2D benchmarks of the CUDA backend, run outside XLA on a private stream (h2d_benchmark.h).
#include "cuda/h2d_benchmark.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "cuda/device_context.h"
#include "engine/engine.h"
#include "engine/regions.h"

namespace tpusync {
namespace cuda {
namespace {

// Frees what a benchmark allocated on every return path.
struct BenchResources {
  ~BenchResources() {
    if (stream) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    for (void* p : device) cudaFree(p);
    for (void* p : host) cudaFreeHost(p);
  }
  cudaStream_t stream = nullptr;
  std::vector<void*> device;
  std::vector<void*> host;
};

double Gbps(uint64_t bytes, int64_t ns) { return ns > 0 ? static_cast<double>(bytes) / ns : 0; }

}  // namespace

StatusOr<std::vector<double>> MemcpyH2DGbps(int device, const std::vector<uint64_t>& sizes,
                                            int iters) {
  if (sizes.empty() || iters < 1) return InvalidArgument("need sizes and iters >= 1");
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  TPUSYNC_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice");
  BenchResources r;
  void* src = nullptr;
  void* dst = nullptr;
  TPUSYNC_CUDA_CHECK(cudaHostAlloc(&src, max_size, cudaHostAllocPortable), "cudaHostAlloc");
  r.host.push_back(src);
  std::memset(src, 1, max_size);  // Fault the pages in before timing.
  TPUSYNC_CUDA_CHECK(cudaMalloc(&dst, max_size), "cudaMalloc");
  r.device.push_back(dst);
  TPUSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking),
                     "cudaStreamCreateWithFlags");
  std::vector<double> out;
  for (uint64_t size : sizes) {
    TPUSYNC_CUDA_CHECK(cudaMemcpyAsync(dst, src, size, cudaMemcpyHostToDevice, r.stream),
                       "cudaMemcpyAsync");
    TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    const int64_t begin = MonotonicNs();
    for (int i = 0; i < iters; ++i) {
      TPUSYNC_CUDA_CHECK(cudaMemcpyAsync(dst, src, size, cudaMemcpyHostToDevice, r.stream),
                         "cudaMemcpyAsync");
    }
    TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    out.push_back(Gbps(size * iters, MonotonicNs() - begin));
  }
  return out;
}

StatusOr<std::vector<double>> EngineH2DGbps(int device, int64_t engine_id, int32_t tier,
                                            uint64_t tier_offset,
                                            const std::vector<uint64_t>& sizes, int iters) {
  if (sizes.empty() || iters < 1) return InvalidArgument("need sizes and iters >= 1");
  auto engine = LookupEngine(engine_id);
  if (!engine.ok()) return engine.status();
  StatusOr<Tier*> t = (*engine)->GetTier(tier);
  if (!t.ok()) return t.status();
  const uint64_t block_bytes = (*t)->block_bytes();
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  if (max_size > static_cast<uint64_t>(INT32_MAX)) {
    return InvalidArgument("sizes must fit one int32 segment row");
  }
  TPUSYNC_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice");
  BenchResources r;
  TPUSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking),
                     "cudaStreamCreateWithFlags");
  auto ctx = DeviceContext::ForStream(r.stream);
  if (!ctx.ok()) return ctx.status();
  void* dst = nullptr;
  void* small = nullptr;  // int32: rows[4], tag[2], retire, ticket, owner[4], target[3].
  TPUSYNC_CUDA_CHECK(cudaMalloc(&dst, max_size), "cudaMalloc");
  r.device.push_back(dst);
  TPUSYNC_CUDA_CHECK(cudaMalloc(&small, 15 * sizeof(int32_t)), "cudaMalloc");
  r.device.push_back(small);
  auto* words = static_cast<int32_t*>(small);
  std::vector<double> out;
  for (uint64_t size : sizes) {
    const int32_t host[15] = {static_cast<int32_t>(tier_offset / block_bytes),
                              static_cast<int32_t>(tier_offset % block_bytes), 0,
                              static_cast<int32_t>(size), -1, -1,
                              static_cast<int32_t>(kNoTicket), 0, 0, 0, 0, 0,
                              static_cast<int32_t>(engine_id), tier, 0};
    TPUSYNC_CUDA_CHECK(cudaMemcpy(words, host, sizeof(host), cudaMemcpyHostToDevice),
                       "cudaMemcpy");
    auto one = [&]() -> Status {
      // start then wait, exactly as the handlers enqueue them: the ticket travels through
      // device memory (words[7]). Owner words[8..11] are zero: unchecked.
      TPUSYNC_RETURN_IF_ERROR((*ctx)->EnqueueFetch(r.stream, Regions{}, words, 1, words + 4,
                                                   2, words + 6, words + 8, words + 12,
                                                   max_size, words + 7));
      return (*ctx)->EnqueueWait(r.stream, Regions{}, words, 1, words + 4, 2, words + 7,
                                 words + 8, words + 12, static_cast<uint8_t*>(dst), max_size);
    };
    TPUSYNC_RETURN_IF_ERROR(one());  // Warm-up: mirror and landing allocation, page faults.
    TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    const int64_t begin = MonotonicNs();
    for (int i = 0; i < iters; ++i) TPUSYNC_RETURN_IF_ERROR(one());
    TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    out.push_back(Gbps(size * iters, MonotonicNs() - begin));
    TPUSYNC_RETURN_IF_ERROR((*ctx)->error());
  }
  return out;
}

}  // namespace cuda
}  // namespace tpusync
