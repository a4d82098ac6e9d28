// What an in-graph op addresses, and the bounds every one of its segments is checked against.
//
// An op's `target` operand is int32[3] (engine id, tier, first block): the cache's engine,
// its tier and the tier block its allocation starts at. They are operands, not attributes,
// so one compiled step serves every cache of the same configuration. Segment rows address
// blocks relative to `first block`.
//
// A cache carves its allocation into `count` regions of `bytes` from byte `base` (relative
// to its first block; a paged cache: one region of KV blocks per layer and K|V). A segment
// must lie inside one region, and with `block_rows` inside the one block its row names:
// a row is computed for one KV block of one sequence, so a row that reaches past its
// block's end would write into whatever block comes next (another sequence's KV).
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
  int64_t base = 0;  // Relative to the target's first block.
  int64_t bytes = 0;  // 0: unchecked.
  int64_t count = 0;
  bool block_rows = false;  // Each row must stay inside the block it names.
};

struct OpTarget {
  int64_t engine_id = 0;
  int32_t tier = 0;
  int64_t first_block = 0;
};

inline StatusOr<OpTarget> DecodeTarget(const int32_t* words, int64_t count) {
  if (count != 3) {
    return InvalidArgument("target must be int32[3] (engine id, tier, first block); got " +
                           std::to_string(count) + " values");
  }
  if (words[0] <= 0 || words[1] < 0 || words[2] < 0) {
    return InvalidArgument("target (engine " + std::to_string(words[0]) + ", tier " +
                           std::to_string(words[1]) + ", first block " +
                           std::to_string(words[2]) + ") has a field out of range");
  }
  return OpTarget{words[0], words[1], words[2]};
}

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
    return InvalidArgument(where + " runs past the end of region " + std::to_string(first) +
                           " (positions beyond the cache's layout)");
  }
  return Status::Ok();
}

// Leading rows (kCapacityGuard, length, count, capacity) of an op's segments are no
// transfers but guards: the op fails, before any byte moves, unless length + count <=
// capacity. A cache puts one per slot first in every write-back, so a sequence that
// would outgrow its reserved blocks is refused by name instead of writing into whatever
// lies next to them. Only a leading run counts: a guard-like row after a transfer is a bad
// row.
inline constexpr int32_t kCapacityGuard = -2;

// A row (kShardGuard, state_shard, device_shard, 0) ahead of the capacity guards: the op
// fails, before any byte moves, unless the state it carries is the shard of a mesh cache
// that the device running it owns. A mesh cache puts one in every write-back, computed from
// the device's place in the mesh (lax.axis_index), so a state handed to the wrong device
// (a shard_map whose state specs differ from the cache's) is refused by name instead of
// mixing one device's heads or sequences with another shard's KV.
inline constexpr int32_t kShardGuard = -3;

// A segment's block naming a position whose KV block lives on the other tier of a
// two-level cache (jax_tpusync.core.spill): a write-back may only write its own tier's blocks.
inline constexpr int32_t kOtherLevelBlock = -4;

// The leading guard rows of `rows` as (length, count) per slot, for Engine::RecordGuards.
inline void GuardColumns(const int32_t* rows, int64_t n, std::vector<int32_t>* lengths,
                         std::vector<int32_t>* counts) {
  int64_t i = 0;
  while (i < n && rows[4 * i] == kShardGuard) ++i;
  for (; i < n && rows[4 * i] == kCapacityGuard; ++i) {
    lengths->push_back(rows[4 * i + 1]);
    counts->push_back(rows[4 * i + 2]);
  }
}

// Decodes int32[n, 4] rows (block, offset_in_block, buffer_offset, bytes), blocks relative
// to `first_block`, into transfers of `tier`, checking every guard row first, then each
// transfer against the op's buffer (`buffer_bytes`), the caller's regions and blocks, and
// the tier's size. Rows that continue one another on the tier and in the buffer (a
// sequence's consecutive blocks) come out as one transfer.
inline StatusOr<std::vector<FetchSegment>> DecodeRows(const int32_t* rows, int64_t n,
                                                      const Tier& tier, uint64_t buffer_bytes,
                                                      const Regions& regions,
                                                      int64_t first_block = 0) {
  int64_t shard_guards = 0;
  for (; shard_guards < n && rows[4 * shard_guards] == kShardGuard; ++shard_guards) {
    const int32_t* r = rows + 4 * shard_guards;
    if (r[1] != r[2] || r[1] < 0) {
      return InvalidArgument(
          "this state is " + (r[1] < 0 ? std::string("no shard") : "shard " + std::to_string(r[1])) +
          " of its mesh cache but runs on the device of shard " + std::to_string(r[2]) +
          " (shard the state as cache.state_sharding says); nothing was written");
    }
  }
  int64_t guards = shard_guards;
  for (; guards < n && rows[4 * guards] == kCapacityGuard; ++guards) {
    const int32_t* r = rows + 4 * guards;
    if (r[1] < 0 || r[2] < 0 || static_cast<int64_t>(r[1]) + r[2] > r[3]) {
      return InvalidArgument("slot " + std::to_string(guards - shard_guards) + " holds " +
                             std::to_string(r[1]) + " tokens and cannot take " +
                             std::to_string(r[2]) + " more: its capacity is " +
                             std::to_string(r[3]) + " tokens; nothing was written");
    }
  }
  const uint64_t block_bytes = tier.block_bytes();
  Regions absolute = regions;
  absolute.base += first_block * static_cast<int64_t>(block_bytes);
  std::vector<FetchSegment> out;
  for (int64_t i = guards; i < n; ++i) {
    const int32_t* r = rows + 4 * i;
    if (r[0] < 0 || r[1] < 0 || r[2] < 0 || r[3] < 0) {
      return InvalidArgument("segment " + std::to_string(i) + " has a negative field" +
                             (r[0] == -1 ? " (block -1: a position with no KV block)"
                              : r[0] == kOtherLevelBlock
                                  ? " (block -4: a position whose KV block is on the other "
                                    "level of a two-level cache, or on no level; a "
                                    "write-back writes its own tier only)"
                                  : ""));
    }
    const FetchSegment s{
        (static_cast<uint64_t>(r[0]) + first_block) * block_bytes + static_cast<uint64_t>(r[1]),
        static_cast<uint64_t>(r[2]), static_cast<uint64_t>(r[3])};
    if (s.bytes == 0) continue;
    if (regions.block_rows && static_cast<uint64_t>(r[1]) + s.bytes > block_bytes) {
      return InvalidArgument("segment " + std::to_string(i) + " (bytes [" +
                             std::to_string(r[1]) + ", " + std::to_string(r[1] + s.bytes) +
                             ") of block " + std::to_string(r[0]) +
                             ") runs past the end of its " + std::to_string(block_bytes) +
                             "-byte KV block");
    }
    if (s.dst_offset + s.bytes > buffer_bytes) {
      return InvalidArgument("segment " + std::to_string(i) + " covers bytes [" +
                             std::to_string(s.dst_offset) + ", " +
                             std::to_string(s.dst_offset + s.bytes) + ") of a " +
                             std::to_string(buffer_bytes) + "-byte buffer");
    }
    TPUSYNC_RETURN_IF_ERROR(
        CheckRegion(absolute, i, Segment{s.tier_offset, nullptr, s.bytes}));
    Status range = tier.CheckRange(s.tier_offset, s.bytes);
    if (!range.ok()) return InvalidArgument("segment " + std::to_string(i) + ": " + range.detail());
    if (!out.empty() && out.back().tier_offset + out.back().bytes == s.tier_offset &&
        out.back().dst_offset + out.back().bytes == s.dst_offset) {
      out.back().bytes += s.bytes;
    } else {
      out.push_back(s);
    }
  }
  return out;
}

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_REGIONS_H_
