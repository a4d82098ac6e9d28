// Storage tiers: a flat byte space of `num_blocks * block_bytes`, carved into blocks by an
// allocator. The engine moves bytes between a tier and plain memory; it never interprets them.
#ifndef TPUSYNC_ENGINE_TIER_H_
#define TPUSYNC_ENGINE_TIER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io_context.h"
#include "status.h"

namespace tpusync {

// First-fit allocator of contiguous block extents. Not thread-safe (Tier locks it).
class BlockAllocator {
 public:
  explicit BlockAllocator(uint64_t num_blocks);

  StatusOr<uint64_t> Allocate(uint64_t count);
  // Marks [first, first + count) used; fails if any of it is not free.
  Status Reserve(uint64_t first, uint64_t count);
  // Fails (and changes nothing) unless [first, first + count) is entirely allocated.
  Status Free(uint64_t first, uint64_t count);
  uint64_t free_blocks() const { return free_blocks_; }

 private:
  uint64_t num_blocks_;
  uint64_t free_blocks_;
  std::map<uint64_t, uint64_t> free_;  // first block -> length, coalesced.
};

// A named, persistent allocation, recorded in the tier's header so that another process
// opening the same shm segment or file finds it again.
struct NamedRegion {
  std::string name;
  uint64_t first_block = 0;
  uint64_t num_blocks = 0;
};

struct TierLayout {
  uint64_t block_bytes = 0;
  uint64_t num_blocks = 0;
  // File tier: the data starts this many bytes (< 4096) past the header's page, so that
  // O_DIRECT can read straight into buffers that start at that offset modulo the DIO
  // alignment (XLA CPU puts large buffers 64 bytes past a page). Recorded in the header.
  uint64_t alignment_offset = 0;
};

class Tier {
 public:
  virtual ~Tier() = default;

  virtual const char* kind() const = 0;
  // Human-readable description: backing store, I/O mode.
  virtual std::string Describe() const = 0;
  // Writes to a tier that does read-modify-write of whole pages must not race on a page.
  virtual uint64_t hazard_granularity() const { return 1; }
  // Hazard pages are [k * granularity - hazard_phase(), ...) in tier offsets.
  virtual uint64_t hazard_phase() const { return 0; }
  virtual bool direct_io() const { return false; }
  // O_DIRECT alignment in use (0: none).
  virtual uint64_t dio_alignment() const { return 0; }
  uint64_t alignment_offset() const { return layout_.alignment_offset; }
  // Whether a read of tier bytes at `offset` lands straight in `dst` (O_DIRECT in phase with
  // the destination), rather than through a bounce buffer.
  virtual bool ReadsInPlace(uint64_t /*offset*/, const void* /*dst*/) const { return false; }
  // The address modulo 4096 at which a read of tier bytes at `offset` lands in place
  // (0 where any address does).
  virtual uint64_t InPlacePhase(uint64_t /*offset*/) const { return 0; }
  // Whether a prefetch should wait for its consumer and read straight into the consumer's
  // buffer: true for memory, where a read costs the same at the wait as ahead of it, and a
  // read ahead would copy every byte twice (into landing memory, then into the operand).
  virtual bool DefersFetches() const { return false; }
  // The tier's bytes at `offset` where they lie in this process's memory (a memory tier),
  // for reads that copy nothing (Engine::ReadInPlace); null for any other tier.
  virtual const uint8_t* MappedAt(uint64_t /*offset*/) const { return nullptr; }
  // Fetched bytes that went straight to the destination / through a bounce buffer.
  virtual uint64_t direct_read_bytes() const { return 0; }
  virtual uint64_t bounced_read_bytes() const { return 0; }
  // True when the tier re-attached to existing persistent contents.
  bool attached() const { return attached_; }
  // True when attached read-only (shared lock): every Write fails.
  bool read_only() const { return read_only_; }

  uint64_t block_bytes() const { return layout_.block_bytes; }
  uint64_t num_blocks() const { return layout_.num_blocks; }
  uint64_t capacity_bytes() const { return layout_.block_bytes * layout_.num_blocks; }

  // Byte-addressed I/O over [0, capacity). Safe to call concurrently for ranges that do not
  // conflict at hazard_granularity().
  virtual Status Read(uint64_t offset, void* dst, uint64_t bytes, IoContext& io) = 0;
  virtual Status Write(uint64_t offset, const void* src, uint64_t bytes, IoContext& io) = 0;

  Status CheckRange(uint64_t offset, uint64_t bytes) const;

  // Allocates `count` contiguous blocks. A non-empty `name` makes the region persistent:
  // if the tier already holds a region of that name and size, it is returned as is.
  StatusOr<uint64_t> AllocateBlocks(uint64_t count, const std::string& name);
  Status FreeBlocks(uint64_t first, uint64_t count);
  uint64_t free_blocks();
  std::vector<NamedRegion> named_regions();

 protected:
  explicit Tier(TierLayout layout) : layout_(layout), allocator_(layout.num_blocks) {}

  // Loads regions found in an existing header (called by subclasses while attaching).
  Status AdoptRegions(std::vector<NamedRegion> regions);
  // Persists the region table; default: nothing to persist.
  virtual Status SaveRegions(const std::vector<NamedRegion>& /*regions*/) {
    return Status::Ok();
  }

  // The error every write to a read-only tier returns; `store` names its backing store.
  static Status ReadOnlyError(const std::string& store) {
    return FailedPrecondition("tier " + store + " is attached read-only; writes are refused");
  }

  TierLayout layout_;
  bool attached_ = false;
  bool read_only_ = false;

 private:
  std::mutex mu_;
  BlockAllocator allocator_;
  std::vector<NamedRegion> regions_;
};

// A named shm segment or file is owned by one writer at a time (flock LOCK_EX, held for the
// tier's lifetime; another attach fails naming the holder's pid) or shared by read-only
// attaches (LOCK_SH). Stores are preallocated when created, so a later fill can neither
// SIGBUS nor hit a full disk, and a read past the end of a store (one truncated or
// replaced underneath the tier) is an error, never zeros.
struct HostTierOptions {
  TierLayout layout;
  // Non-empty: back the pool by POSIX shm segment "/<shm_name>" so a restarted process
  // re-attaches to its blocks.
  std::string shm_name;
  // Attach an existing segment read-only (needs shm_name; never creates one).
  bool read_only = false;
};

struct FileTierOptions {
  TierLayout layout;
  std::string directory;
  // Non-empty: keep the data in "<directory>/<file_name>.tpusync" and re-attach to it.
  // Empty: an anonymous file, deleted when the tier closes.
  std::string file_name;
  // False: never try O_DIRECT (buffered I/O through the page cache).
  bool allow_direct_io = true;
  // Attach an existing file read-only (needs file_name; never creates one).
  bool read_only = false;
};

StatusOr<std::unique_ptr<Tier>> OpenHostTier(const HostTierOptions& options);
StatusOr<std::unique_ptr<Tier>> OpenFileTier(const FileTierOptions& options);
// Removes a persistent shm segment; NotFound if it does not exist.
Status UnlinkShmSegment(const std::string& shm_name);

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_TIER_H_
