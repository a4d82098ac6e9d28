#include "engine/stream_copy.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define TPUSYNC_STREAM_SSE2 1
#endif

namespace tpusync {
namespace {

constexpr size_t kPieceBytes = 1 << 20;  // The unit that threads' shares are cut into.

bool Overlap(uintptr_t a, size_t a_bytes, uintptr_t b, size_t b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}

void CopyOne(const CopyRange& r) {
  if (r.bytes >= kStreamCopyMinBytes) {
    StreamCopy(r.dst, r.src, r.bytes);
  } else if (r.bytes > 0) {
    std::memcpy(r.dst, r.src, r.bytes);
  }
}

}  // namespace

void StreamCopy(void* dst, const void* src, size_t bytes) {
#ifdef TPUSYNC_STREAM_SSE2
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  // Up to the destination's first 16-byte boundary with memcpy (streaming stores need an
  // aligned address), then 64 bytes a step, the tail with memcpy.
  size_t head = std::min(bytes, static_cast<size_t>(-reinterpret_cast<uintptr_t>(d) & 15));
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  size_t body = bytes & ~static_cast<size_t>(63);
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, bytes - body);
  _mm_sfence();  // Streaming stores are weakly ordered: visible to others after the fence.
#else
  std::memcpy(dst, src, bytes);
#endif
}

Status CopyRanges(const CopyRange* ranges, size_t count, int threads) {
  if (threads < 1) {
    return InvalidArgument("copy ranges: threads=" + std::to_string(threads) + " must be >= 1");
  }
  if (count > 0 && ranges == nullptr) return InvalidArgument("copy ranges: ranges is null");
  size_t total = 0;
  std::vector<size_t> by_dst;
  by_dst.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const CopyRange& r = ranges[i];
    if (r.bytes == 0) continue;
    if (r.dst == nullptr || r.src == nullptr) {
      return InvalidArgument("copy ranges: range " + std::to_string(i) +
                             " has a null pointer and " + std::to_string(r.bytes) + " bytes");
    }
    auto dst = reinterpret_cast<uintptr_t>(r.dst);
    if (Overlap(dst, r.bytes, reinterpret_cast<uintptr_t>(r.src), r.bytes)) {
      return InvalidArgument("copy ranges: range " + std::to_string(i) +
                             " overlaps its own source");
    }
    by_dst.push_back(i);
    total += r.bytes;
  }
  // Destinations that overlap would make the result depend on the threads' order.
  std::sort(by_dst.begin(), by_dst.end(), [&](size_t a, size_t b) {
    return reinterpret_cast<uintptr_t>(ranges[a].dst) <
           reinterpret_cast<uintptr_t>(ranges[b].dst);
  });
  for (size_t k = 1; k < by_dst.size(); ++k) {
    const CopyRange& a = ranges[by_dst[k - 1]];
    const CopyRange& b = ranges[by_dst[k]];
    if (Overlap(reinterpret_cast<uintptr_t>(a.dst), a.bytes, reinterpret_cast<uintptr_t>(b.dst),
                b.bytes)) {
      return InvalidArgument("copy ranges: the destinations of ranges " +
                             std::to_string(by_dst[k - 1]) + " and " +
                             std::to_string(by_dst[k]) + " overlap");
    }
  }
  if (total == 0) return Status::Ok();
  // Each thread's share: consecutive pieces (ranges cut at kPieceBytes) of about
  // total / threads bytes.
  size_t workers = std::min<size_t>(static_cast<size_t>(threads),
                                    std::max<size_t>(1, total / kPieceBytes));
  std::vector<std::vector<CopyRange>> shares(workers);
  size_t share_bytes = (total + workers - 1) / workers, filled = 0, w = 0;
  for (size_t i = 0; i < count; ++i) {
    const CopyRange& r = ranges[i];
    for (size_t off = 0; off < r.bytes;) {
      size_t n = r.bytes - off;  // The last share takes the rest.
      if (w + 1 < workers) {
        // Up to the share's end, but no piece cut shorter than kPieceBytes.
        size_t room = share_bytes > filled ? share_bytes - filled : 0;
        if (n > room) n = std::max(room, std::min(n, kPieceBytes));
      }
      shares[w].push_back(
          {static_cast<char*>(r.dst) + off, static_cast<const char*>(r.src) + off, n});
      off += n;
      filled += n;
      if (filled >= share_bytes && w + 1 < workers) {
        ++w;
        filled = 0;
      }
    }
  }
  std::vector<std::thread> started;
  started.reserve(workers - 1);
  for (size_t t = 1; t < workers; ++t) {
    started.emplace_back([&shares, t] {
      for (const CopyRange& piece : shares[t]) CopyOne(piece);
    });
  }
  for (const CopyRange& piece : shares[0]) CopyOne(piece);
  for (std::thread& thread : started) thread.join();
  return Status::Ok();
}

}  // namespace tpusync
