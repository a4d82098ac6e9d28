#include "tier.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "persistent_header.h"

namespace tpusync {

// ---------------------------------------------------------------- BlockAllocator

BlockAllocator::BlockAllocator(uint64_t num_blocks)
    : num_blocks_(num_blocks), free_blocks_(num_blocks) {
  if (num_blocks > 0) free_[0] = num_blocks;
}

StatusOr<uint64_t> BlockAllocator::Allocate(uint64_t count) {
  if (count == 0) return InvalidArgument("cannot allocate 0 blocks");
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < count) continue;
    uint64_t first = it->first;
    uint64_t rest = it->second - count;
    free_.erase(it);
    if (rest > 0) free_[first + count] = rest;
    free_blocks_ -= count;
    return first;
  }
  return ResourceExhausted("tier full: no run of " + std::to_string(count) +
                           " free blocks (" + std::to_string(free_blocks_) + " of " +
                           std::to_string(num_blocks_) + " blocks free)");
}

Status BlockAllocator::Reserve(uint64_t first, uint64_t count) {
  if (count == 0 || first + count > num_blocks_ || first + count < first) {
    return InvalidArgument("block range [" + std::to_string(first) + ", " +
                           std::to_string(first + count) + ") is outside the tier");
  }
  auto it = free_.upper_bound(first);
  if (it == free_.begin()) return FailedPrecondition("blocks already in use");
  --it;
  uint64_t ext_first = it->first, ext_len = it->second;
  if (first + count > ext_first + ext_len) return FailedPrecondition("blocks already in use");
  free_.erase(it);
  if (first > ext_first) free_[ext_first] = first - ext_first;
  if (ext_first + ext_len > first + count) {
    free_[first + count] = ext_first + ext_len - (first + count);
  }
  free_blocks_ -= count;
  return Status::Ok();
}

Status BlockAllocator::Free(uint64_t first, uint64_t count) {
  if (count == 0 || first + count > num_blocks_ || first + count < first) {
    return InvalidArgument("block range [" + std::to_string(first) + ", " +
                           std::to_string(first + count) + ") is outside the tier");
  }
  // The range must not touch any free extent (that would be a double free).
  auto next = free_.lower_bound(first);
  if (next != free_.end() && next->first < first + count) {
    return FailedPrecondition("double free of blocks starting at " + std::to_string(first));
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > first) {
      return FailedPrecondition("double free of blocks starting at " + std::to_string(first));
    }
  }
  uint64_t new_first = first, new_len = count;
  if (next != free_.end() && next->first == first + count) {
    new_len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      new_first = prev->first;
      new_len += prev->second;
      free_.erase(prev);
    }
  }
  free_[new_first] = new_len;
  free_blocks_ += count;
  return Status::Ok();
}

// ---------------------------------------------------------------- Tier

Status Tier::CheckRange(uint64_t offset, uint64_t bytes) const {
  uint64_t cap = capacity_bytes();
  if (offset > cap || bytes > cap - offset) {
    return InvalidArgument("range [" + std::to_string(offset) + ", " +
                           std::to_string(offset + bytes) + ") is outside the " + kind() +
                           " tier of " + std::to_string(cap) + " bytes");
  }
  return Status::Ok();
}

StatusOr<uint64_t> Tier::AllocateBlocks(uint64_t count, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (name.size() > kMaxRegionNameBytes) {
    return InvalidArgument("region name '" + name + "' is longer than " +
                           std::to_string(kMaxRegionNameBytes) + " bytes");
  }
  if (!name.empty()) {
    for (const NamedRegion& r : regions_) {
      if (r.name != name) continue;
      if (r.num_blocks != count) {
        return FailedPrecondition("region '" + name + "' exists with " +
                                  std::to_string(r.num_blocks) + " blocks; asked for " +
                                  std::to_string(count));
      }
      return r.first_block;
    }
  }
  StatusOr<uint64_t> first = allocator_.Allocate(count);
  if (!first.ok()) return first;
  if (!name.empty()) {
    regions_.push_back({name, *first, count});
    Status saved = SaveRegions(regions_);
    if (!saved.ok()) {
      regions_.pop_back();
      allocator_.Free(*first, count);
      return saved;
    }
  }
  return first;
}

Status Tier::FreeBlocks(uint64_t first, uint64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  TPUSYNC_RETURN_IF_ERROR(allocator_.Free(first, count));
  auto it = std::find_if(regions_.begin(), regions_.end(), [&](const NamedRegion& r) {
    return r.first_block == first && r.num_blocks == count;
  });
  if (it != regions_.end()) {
    regions_.erase(it);
    return SaveRegions(regions_);
  }
  return Status::Ok();
}

uint64_t Tier::free_blocks() {
  std::lock_guard<std::mutex> lock(mu_);
  return allocator_.free_blocks();
}

std::vector<NamedRegion> Tier::named_regions() {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_;
}

Status Tier::AdoptRegions(std::vector<NamedRegion> regions) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const NamedRegion& r : regions) {
    Status st = allocator_.Reserve(r.first_block, r.num_blocks);
    if (!st.ok()) {
      return FailedPrecondition("header region '" + r.name + "' is corrupt: " + st.detail());
    }
  }
  regions_ = std::move(regions);
  attached_ = true;
  return Status::Ok();
}

// ---------------------------------------------------------------- Header

namespace {

constexpr char kMagic[8] = {'T', 'P', 'U', 'S', 'Y', 'N', 'C', '\0'};

struct RawRegion {
  char name[kMaxRegionNameBytes + 1];
  uint64_t first_block;
  uint64_t num_blocks;
};

struct RawHeader {
  char magic[8];
  uint32_t version;
  uint32_t num_regions;
  uint64_t block_bytes;
  uint64_t num_blocks;
  uint64_t alignment_offset;
  RawRegion regions[1];  // Followed by more, up to kHeaderBytes.
};

constexpr int kMaxRegions =
    (kHeaderBytes - offsetof(RawHeader, regions)) / sizeof(RawRegion);

}  // namespace

Status EncodeHeader(const TierLayout& layout, const std::vector<NamedRegion>& regions,
                    uint8_t* out) {
  if (regions.size() > static_cast<size_t>(kMaxRegions)) {
    return ResourceExhausted("a persistent tier holds at most " + std::to_string(kMaxRegions) +
                             " named regions");
  }
  std::memset(out, 0, kHeaderBytes);
  auto* h = reinterpret_cast<RawHeader*>(out);
  std::memcpy(h->magic, kMagic, sizeof(kMagic));
  h->version = kHeaderVersion;
  h->num_regions = static_cast<uint32_t>(regions.size());
  h->block_bytes = layout.block_bytes;
  h->num_blocks = layout.num_blocks;
  h->alignment_offset = layout.alignment_offset;
  for (size_t i = 0; i < regions.size(); ++i) {
    std::strncpy(h->regions[i].name, regions[i].name.c_str(), kMaxRegionNameBytes);
    h->regions[i].first_block = regions[i].first_block;
    h->regions[i].num_blocks = regions[i].num_blocks;
  }
  return Status::Ok();
}

Status DecodeHeader(const uint8_t* in, const TierLayout& expected, const std::string& what,
                    std::vector<NamedRegion>* regions, uint64_t* alignment_offset) {
  const auto* h = reinterpret_cast<const RawHeader*>(in);
  if (std::memcmp(h->magic, kMagic, sizeof(kMagic)) != 0) {
    return FailedPrecondition(what + " exists but is not a tpusync tier (bad magic); "
                              "refusing to reuse it");
  }
  if (h->version != kHeaderVersion) {
    return FailedPrecondition(what + " has format version " + std::to_string(h->version) +
                              "; this build reads version " + std::to_string(kHeaderVersion));
  }
  if (h->block_bytes != expected.block_bytes || h->num_blocks != expected.num_blocks) {
    return FailedPrecondition(
        what + " layout mismatch: it holds block_bytes=" + std::to_string(h->block_bytes) +
        ", num_blocks=" + std::to_string(h->num_blocks) + " but block_bytes=" +
        std::to_string(expected.block_bytes) + ", num_blocks=" +
        std::to_string(expected.num_blocks) + " was asked for; use another name or unlink it");
  }
  if (h->alignment_offset >= kIoAlignment) {
    return FailedPrecondition(what + " header is corrupt (alignment offset)");
  }
  *alignment_offset = h->alignment_offset;
  if (h->num_regions > static_cast<uint32_t>(kMaxRegions)) {
    return FailedPrecondition(what + " header is corrupt (region count)");
  }
  regions->clear();
  for (uint32_t i = 0; i < h->num_regions; ++i) {
    const RawRegion& r = h->regions[i];
    regions->push_back({std::string(r.name, strnlen(r.name, kMaxRegionNameBytes)),
                        r.first_block, r.num_blocks});
  }
  return Status::Ok();
}

bool HeaderIsBlank(const uint8_t* in) {
  for (uint64_t i = 0; i < kHeaderBytes; ++i) {
    if (in[i] != 0) return false;
  }
  return true;
}

}  // namespace tpusync
