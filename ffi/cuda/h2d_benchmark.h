// Benchmarks of the CUDA backend, run outside XLA on a private stream of `device`. Each
// returns GB/s per size.
#ifndef TPUSYNC_CUDA_H2D_BENCHMARK_H_
#define TPUSYNC_CUDA_H2D_BENCHMARK_H_

#include <cstdint>
#include <vector>

#include "engine/status.h"

namespace tpusync {
namespace cuda {

// Plain cudaMemcpyAsync from one pinned host buffer into device memory: the ceiling.
StatusOr<std::vector<double>> MemcpyH2DGbps(int device, const std::vector<uint64_t>& sizes,
                                            int iters);
// The full start/wait path (descriptors staged on the stream, the agent, the engine's
// landing memory, the wait's copy into the pinned mirror and its H2D), fetching `size`
// bytes from tier byte `tier_offset`.
StatusOr<std::vector<double>> EngineH2DGbps(int device, int64_t engine_id, int32_t tier,
                                            uint64_t tier_offset,
                                            const std::vector<uint64_t>& sizes, int iters);

}  // namespace cuda
}  // namespace tpusync

#endif  // TPUSYNC_CUDA_H2D_BENCHMARK_H_
