#include "engine/stream_copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define TPUSYNC_STREAM_SSE2 1
#endif

namespace tpusync {
namespace {

constexpr size_t kPieceBytes = 1 << 20;  // The unit of work a thread takes at a time.

bool Overlap(uintptr_t a, size_t a_bytes, uintptr_t b, size_t b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}

// A part of one range, copied with StreamCopy where the whole range is long enough.
struct Piece {
  CopyRange range;
  bool stream;
};

void CopyOne(const Piece& p) {
  if (p.stream) {
    StreamCopy(p.range.dst, p.range.src, p.range.bytes);
  } else {
    std::memcpy(p.range.dst, p.range.src, p.range.bytes);
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
  // A destination over another range's source would make the result depend on the order
  // the pieces are copied in. Sources sorted by start with the running maximum of their
  // ends: a destination overlaps some source iff one that starts before its end reaches
  // past its start.
  std::vector<size_t> by_src = by_dst;
  std::sort(by_src.begin(), by_src.end(), [&](size_t a, size_t b) {
    return reinterpret_cast<uintptr_t>(ranges[a].src) <
           reinterpret_cast<uintptr_t>(ranges[b].src);
  });
  std::vector<uintptr_t> max_end(by_src.size());
  for (size_t k = 0; k < by_src.size(); ++k) {
    uintptr_t end = reinterpret_cast<uintptr_t>(ranges[by_src[k]].src) + ranges[by_src[k]].bytes;
    max_end[k] = k == 0 ? end : std::max(max_end[k - 1], end);
  }
  for (size_t i : by_dst) {
    auto dst = reinterpret_cast<uintptr_t>(ranges[i].dst);
    uintptr_t dst_end = dst + ranges[i].bytes;
    size_t before = std::partition_point(by_src.begin(), by_src.end(), [&](size_t j) {
                      return reinterpret_cast<uintptr_t>(ranges[j].src) < dst_end;
                    }) -
                    by_src.begin();
    if (before == 0 || max_end[before - 1] <= dst) continue;
    for (size_t k = before; k-- > 0;) {  // Name the source (its own was checked above).
      size_t j = by_src[k];
      auto src = reinterpret_cast<uintptr_t>(ranges[j].src);
      if (Overlap(dst, ranges[i].bytes, src, ranges[j].bytes)) {
        return InvalidArgument("copy ranges: the destination of range " + std::to_string(i) +
                               " overlaps the source of range " + std::to_string(j));
      }
    }
  }
  if (total == 0) return Status::Ok();
  // Pieces of at most kPieceBytes that the threads take one at a time from a shared
  // counter: a thread the scheduler holds back (on a busy host) leaves its pieces to the
  // others instead of making them wait at the end for a fixed share.
  std::vector<Piece> pieces;
  pieces.reserve(total / kPieceBytes + count);
  for (size_t i = 0; i < count; ++i) {
    const CopyRange& r = ranges[i];
    bool stream = r.bytes >= kStreamCopyMinBytes;  // By the range's length, not the piece's.
    for (size_t off = 0; off < r.bytes; off += kPieceBytes) {
      pieces.push_back({{static_cast<char*>(r.dst) + off, static_cast<const char*>(r.src) + off,
                         std::min(kPieceBytes, r.bytes - off)},
                        stream});
    }
  }
  std::atomic<size_t> next{0};
  auto work = [&pieces, &next] {
    for (size_t i = next.fetch_add(1); i < pieces.size(); i = next.fetch_add(1)) {
      CopyOne(pieces[i]);
    }
  };
  size_t workers = std::min<size_t>(static_cast<size_t>(threads), pieces.size());
  std::vector<std::thread> started;
  started.reserve(workers - 1);
  for (size_t t = 1; t < workers; ++t) {
    try {
      started.emplace_back(work);
    } catch (const std::system_error&) {  // No thread to be had: the others take its pieces.
      break;
    }
  }
  work();
  for (std::thread& thread : started) thread.join();
  return Status::Ok();
}

}  // namespace tpusync
