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

#include "engine.h"
#include "status.h"

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

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_REGIONS_H_
