// Bounds of a caller's carving of a tier, checked per segment by the in-graph ops.
//
// A cache carves its tier into `count` regions of `bytes` from byte `base` (one per layer,
// K/V and sequence). A segment must lie inside one region, so a position past a sequence's
// end (context overflow) or a layer out of range fails loudly instead of reading or
// overwriting a neighbour's KV.
#ifndef TPUSYNC_ENGINE_REGIONS_H_
#define TPUSYNC_ENGINE_REGIONS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include <vector>

#include "engine.h"
#include "status.h"
#include "tier.h"

namespace tpusync {

struct Regions {
  int64_t base = 0;
  int64_t bytes = 0;  // 0: unchecked.
  int64_t count = 0;
};

inline Status CheckRegion(const Regions& regions, size_t index, const Segment& s) {
  if (regions.bytes <= 0 || s.bytes == 0) return Status::Ok();
  const std::string where = "segment " + std::to_string(index) + " (tier bytes [" +
                            std::to_string(s.tier_offset) + ", " +
                            std::to_string(s.tier_offset + s.bytes) + "))";
  if (s.tier_offset < static_cast<uint64_t>(regions.base)) {
    return InvalidArgument(where + " starts before the cache's first region");
  }
  const uint64_t rel = s.tier_offset - regions.base;
  const uint64_t first = rel / regions.bytes, last = (rel + s.bytes - 1) / regions.bytes;
  if (first >= static_cast<uint64_t>(regions.count)) {
    return InvalidArgument(where + " addresses region " + std::to_string(first) + " of " +
                           std::to_string(regions.count) + " (layer out of range?)");
  }
  if (first != last) {
    return InvalidArgument(where + " runs past the end of its sequence's region "
                           "(context overflow: positions beyond max_len)");
  }
  return Status::Ok();
}

// Leading rows (kCapacityGuard, length, count, capacity) of an op's segments are no
// transfers but guards: the op fails, before any byte moves, unless length + count <=
// capacity. A cache puts one per sequence first in every write-back, so a sequence that
// would outgrow its room is refused by name instead of writing into whatever lies next to
// it. Only a leading run counts: a guard-like row after a transfer is a bad row.
inline constexpr int32_t kCapacityGuard = -2;

// Decodes int32[n, 4] rows (block, offset_in_block, buffer_offset, bytes) into transfers
// of `tier`, checking every guard row first, then each transfer against the op's buffer
// (`buffer_bytes`), the caller's regions and the tier's size.
inline StatusOr<std::vector<FetchSegment>> DecodeRows(const int32_t* rows, int64_t n,
                                                      const Tier& tier, uint64_t buffer_bytes,
                                                      const Regions& regions) {
  int64_t guards = 0;
  for (; guards < n && rows[4 * guards] == kCapacityGuard; ++guards) {
    const int32_t* r = rows + 4 * guards;
    if (r[1] < 0 || r[2] < 0 || static_cast<int64_t>(r[1]) + r[2] > r[3]) {
      return InvalidArgument("sequence " + std::to_string(guards) + " holds " +
                             std::to_string(r[1]) + " tokens and cannot take " +
                             std::to_string(r[2]) + " more: its capacity is " +
                             std::to_string(r[3]) + " tokens; nothing was written");
    }
  }
  std::vector<FetchSegment> out;
  for (int64_t i = guards; i < n; ++i) {
    const int32_t* r = rows + 4 * i;
    if (r[0] < 0 || r[1] < 0 || r[2] < 0 || r[3] < 0) {
      return InvalidArgument("segment " + std::to_string(i) + " has a negative field");
    }
    const FetchSegment s{
        static_cast<uint64_t>(r[0]) * tier.block_bytes() + static_cast<uint64_t>(r[1]),
        static_cast<uint64_t>(r[2]), static_cast<uint64_t>(r[3])};
    if (s.bytes == 0) continue;
    if (s.dst_offset + s.bytes > buffer_bytes) {
      return InvalidArgument("segment " + std::to_string(i) + " covers bytes [" +
                             std::to_string(s.dst_offset) + ", " +
                             std::to_string(s.dst_offset + s.bytes) + ") of a " +
                             std::to_string(buffer_bytes) + "-byte buffer");
    }
    TPUSYNC_RETURN_IF_ERROR(CheckRegion(regions, i, Segment{s.tier_offset, nullptr, s.bytes}));
    Status range = tier.CheckRange(s.tier_offset, s.bytes);
    if (!range.ok()) return InvalidArgument("segment " + std::to_string(i) + ": " + range.detail());
    out.push_back(s);
  }
  return out;
}

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_REGIONS_H_
