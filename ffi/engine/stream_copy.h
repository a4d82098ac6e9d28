// Copies of many disjoint host ranges at once, split over threads, large ones with
// non-temporal (streaming) stores.
//
// A weight publish copies every shard of the params into the store's mapped file: hundreds
// of ranges of 1-16 MiB. glibc's memcpy streams only copies above a threshold set from the
// cache size (192 MiB on the 2-core VM measured), so each shard copy read every destination
// line into the cache before writing it: 112 ms per GB where one 1 GB memcpy took 63 ms.
// Streaming stores write the destination without reading it, and a second thread uses the
// memory bandwidth one core leaves.

#ifndef TPUSYNC_ENGINE_STREAM_COPY_H_
#define TPUSYNC_ENGINE_STREAM_COPY_H_

#include <cstddef>
#include <cstdint>

#include "engine/status.h"

namespace tpusync {

struct CopyRange {
  void* dst;
  const void* src;
  size_t bytes;
};

// Ranges at least this long are copied with streaming stores (shorter ones with memcpy:
// their destination likely stays in the cache, where the next reader finds it).
inline constexpr size_t kStreamCopyMinBytes = 256 << 10;

// Copies `src` to `dst` (`bytes`, not overlapping) with streaming stores where the CPU has
// them (x86-64: SSE2), memcpy elsewhere; the stores are fenced before it returns.
void StreamCopy(void* dst, const void* src, size_t bytes);

// Copies every range (each with StreamCopy or memcpy by its length) on `threads` threads
// (the caller's and threads - 1 started for the call), which take the ranges' 1 MiB pieces
// one at a time until none is left. Returns
// InvalidArgument, having copied nothing, for threads < 1, a null pointer with bytes > 0,
// or a destination that overlaps another destination or any range's source.
Status CopyRanges(const CopyRange* ranges, size_t count, int threads);

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_STREAM_COPY_H_
