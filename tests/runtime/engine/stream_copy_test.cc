// Unit test of the multi-range streaming copy (ffi/engine/stream_copy.h) on its own: every
// byte lands for every destination alignment and length around the 16-byte store unit and
// the 64-byte step, ranges split over threads land whole, and refused arguments copy
// nothing. Prints "ok" and exits 0 when every check passes; otherwise prints each failed
// check and exits 1.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/stream_copy.h"

namespace {

using tpusync::CopyRange;
using tpusync::CopyRanges;
using tpusync::StatusCode;
using tpusync::StreamCopy;

int failures = 0;

#define CHECK(cond)                                                  \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond);  \
      ++failures;                                                    \
    }                                                                \
  } while (0)

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<uint8_t>(x);
  }
  return v;
}

// StreamCopy of `bytes` from source offset `s_off` to destination offset `d_off`: the bytes
// land, the guard bytes on either side stay.
void CheckOne(size_t d_off, size_t s_off, size_t bytes) {
  std::vector<uint8_t> src = Pattern(bytes + 64, static_cast<uint32_t>(bytes + s_off));
  std::vector<uint8_t> dst(bytes + 128, 0xA5);
  StreamCopy(dst.data() + 16 + d_off, src.data() + s_off, bytes);
  CHECK(std::memcmp(dst.data() + 16 + d_off, src.data() + s_off, bytes) == 0);
  for (size_t i = 0; i < 16 + d_off; ++i) CHECK(dst[i] == 0xA5);
  for (size_t i = 16 + d_off + bytes; i < dst.size(); ++i) CHECK(dst[i] == 0xA5);
}

void TestAlignmentsAndLengths() {
  for (size_t d_off = 0; d_off < 17; ++d_off) {
    for (size_t s_off : {0, 1, 15}) {
      for (size_t bytes : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 4096 + 3}) {
        CheckOne(d_off, s_off, bytes);
      }
    }
  }
}

// Many ranges, some longer than the streaming threshold and the 1 MiB piece, some empty,
// over 1, 2 and 3 threads: every destination holds its source, the gaps stay.
void TestRangesOverThreads() {
  const std::vector<size_t> lengths = {0, 7, 300 << 10, (3 << 20) + 5, 64, (1 << 20) - 1,
                                       (2 << 20) + 4096};
  size_t total = 0;
  for (size_t n : lengths) total += n + 64;
  for (int threads : {1, 2, 3}) {
    std::vector<uint8_t> src = Pattern(total, static_cast<uint32_t>(threads));
    std::vector<uint8_t> dst(total, 0x5A);
    std::vector<CopyRange> ranges;
    size_t off = 0;
    for (size_t n : lengths) {
      ranges.push_back({dst.data() + off + 1, src.data() + off, n});
      off += n + 64;
    }
    CHECK(CopyRanges(ranges.data(), ranges.size(), threads).ok());
    off = 0;
    for (size_t n : lengths) {
      CHECK(std::memcmp(dst.data() + off + 1, src.data() + off, n) == 0);
      CHECK(dst[off] == 0x5A);
      if (off + 1 + n < total) CHECK(dst[off + 1 + n] == 0x5A);
      off += n + 64;
    }
  }
}

// Refused: nothing copied, InvalidArgument naming the problem.
void TestRefused() {
  std::vector<uint8_t> src(4096, 1), dst(4096, 0);
  CopyRange one = {dst.data(), src.data(), 16};
  auto refused = [&](const std::vector<CopyRange>& ranges, int threads, const char* words) {
    tpusync::Status s = CopyRanges(ranges.data(), ranges.size(), threads);
    CHECK(!s.ok());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find(words) != std::string::npos);
    if (s.message().find(words) == std::string::npos) std::printf("  got: %s\n", s.message().c_str());
    for (uint8_t b : dst) CHECK(b == 0);
  };
  refused({one}, 0, "threads=0 must be >= 1");
  refused({{nullptr, src.data(), 1}}, 1, "range 0 has a null pointer and 1 bytes");
  // Destinations that share exactly one byte overlap; ones that only touch do not.
  refused({{dst.data(), src.data(), 16}, {dst.data() + 15, src.data(), 16}}, 2,
          "the destinations of ranges 0 and 1 overlap");
  refused({{src.data() + 8, src.data(), 16}}, 1, "range 0 overlaps its own source");
  // A destination over another range's source, by one byte; sources may overlap each other.
  refused({{dst.data(), src.data(), 16}, {src.data() + 100, dst.data() + 15, 8}}, 2,
          "the destination of range 0 overlaps the source of range 1");
  refused({{dst.data() + 100, src.data(), 64}, {dst.data(), src.data() + 8, 8},
           {src.data() + 63, dst.data() + 200, 4}},
          1, "the destination of range 2 overlaps the source of range 0");
  std::vector<CopyRange> shared_source = {{dst.data(), src.data(), 16},
                                          {dst.data() + 16, src.data() + 8, 16},
                                          {src.data() + 24, dst.data() + 64, 8}};
  CHECK(CopyRanges(shared_source.data(), shared_source.size(), 2).ok());
  CHECK(CopyRanges(nullptr, 0, 1).ok());
  CHECK(CopyRanges(&one, 1, 1).ok());
  std::vector<CopyRange> touching = {{dst.data(), src.data(), 16}, {dst.data() + 16, src.data(), 16}};
  CHECK(CopyRanges(touching.data(), touching.size(), 2).ok());
  CHECK(dst[31] == 1 && dst[32] == 0);
  CHECK(CopyRanges(nullptr, 0, 0).code() == StatusCode::kInvalidArgument);
  // A null pointer with no bytes copies nothing and is fine.
  CopyRange empty = {nullptr, nullptr, 0};
  CHECK(CopyRanges(&empty, 1, 1).ok());
}

}  // namespace

int main() {
  TestAlignmentsAndLengths();
  TestRangesOverThreads();
  TestRefused();
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
