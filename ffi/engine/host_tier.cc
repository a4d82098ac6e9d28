// The host DRAM tier: one page-aligned pool, anonymous or backed by a POSIX shm segment.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "persistent_header.h"
#include "store_guard.h"
#include "tier.h"

namespace tpusync {
namespace {

// Copies in chunks so the engine can throttle and cancel between them. Streaming stores:
// neither a fetch's destination nor the pool is read back by this thread.
void ChunkedCopy(uint8_t* dst, const uint8_t* src, uint64_t bytes, IoContext& io,
                 bool* cancelled) {
  for (uint64_t done = 0; done < bytes;) {
    if (io.cancelled()) {
      *cancelled = true;
      return;
    }
    uint64_t n = std::min<uint64_t>(io.chunk_bytes(), bytes - done);
    io.before_chunk(n);
    CopyToDestination(dst + done, src + done, n);
    done += n;
  }
}

class HostTier final : public Tier {
 public:
  HostTier(TierLayout layout, std::string shm_name, bool read_only)
      : Tier(layout), shm_name_(std::move(shm_name)) {
    read_only_ = read_only;
  }

  ~HostTier() override {
    if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
    if (fd_ >= 0) close(fd_);
  }

  Status Open() {
    if (layout_.block_bytes == 0 || layout_.num_blocks == 0) {
      return InvalidArgument("host tier needs block_bytes > 0 and num_blocks > 0");
    }
    if (capacity_bytes() / layout_.block_bytes != layout_.num_blocks) {
      return InvalidArgument("host tier size overflows");
    }
    // The data starts one header page in, so shm and anonymous pools share the layout.
    mapping_bytes_ = kHeaderBytes + AlignUp(capacity_bytes(), kIoAlignment);
    if (shm_name_.empty()) {
      if (read_only_) {
        return InvalidArgument("a read-only host tier needs shm_name: an anonymous pool has "
                               "nothing to attach to");
      }
      return MapAnonymous();
    }
    return MapShm();
  }

  const char* kind() const override { return "host"; }

  std::string Describe() const override {
    return shm_name_.empty() ? "host DRAM pool (anonymous)"
                             : "host DRAM pool (shm /" + shm_name_ +
                                   (read_only_ ? ", read-only)" : ")");
  }

  bool DefersFetches() const override { return true; }

  const uint8_t* MappedAt(uint64_t offset) const override { return data() + offset; }

  Status Read(uint64_t offset, void* dst, uint64_t bytes, IoContext& io) override {
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    bool cancelled = false;
    ChunkedCopy(static_cast<uint8_t*>(dst), data() + offset, bytes, io, &cancelled);
    return cancelled ? Cancelled("transfer cancelled") : Status::Ok();
  }

  Status Write(uint64_t offset, const void* src, uint64_t bytes, IoContext& io) override {
    if (read_only_) return ReadOnlyError(StoreName());
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    bool cancelled = false;
    ChunkedCopy(data() + offset, static_cast<const uint8_t*>(src), bytes, io, &cancelled);
    return cancelled ? Cancelled("transfer cancelled") : Status::Ok();
  }

 protected:
  Status SaveRegions(const std::vector<NamedRegion>& regions) override {
    if (shm_name_.empty()) return Status::Ok();
    if (read_only_) return ReadOnlyError(StoreName());  // The mapping is PROT_READ.
    return EncodeHeader(layout_, regions, mapping_);
  }

 private:
  uint8_t* data() const { return mapping_ + kHeaderBytes; }
  std::string StoreName() const { return "shm segment '/" + shm_name_ + "'"; }

  Status MapAnonymous() {
    // MAP_NORESERVE maps any size at once; without this check an oversized pool is
    // OOM-killed while it fills instead of failing here.
    const uint64_t available = MemAvailableBytes();
    if (available != 0 && mapping_bytes_ > available) {
      return ResourceExhausted(
          "a host pool of " + std::to_string(mapping_bytes_) + " bytes exceeds the memory "
          "available (MemAvailable " + std::to_string(available) + " bytes in /proc/meminfo); "
          "ask for fewer or smaller blocks, or use a file tier for KV larger than memory");
    }
    void* p = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return ErrnoStatus("cannot map a host pool of " + std::to_string(mapping_bytes_) +
                             " bytes",
                         errno);
    }
    mapping_ = static_cast<uint8_t*>(p);
    // Large pools are streamed sequentially; huge pages cut TLB misses and fault cost.
    madvise(mapping_, mapping_bytes_, MADV_HUGEPAGE);
    return Status::Ok();
  }

  Status MapShm() {
    if (shm_name_.find('/') != std::string::npos) {
      return InvalidArgument("shm name '" + shm_name_ + "' must not contain '/'");
    }
    const std::string path = "/" + shm_name_;
    bool created = false;
    if (read_only_) {
      fd_ = shm_open(path.c_str(), O_RDONLY, 0);
      if (fd_ < 0 && errno == ENOENT) {
        return NotFound(StoreName() + " does not exist; a read-only attach never creates one");
      }
    } else {
      fd_ = shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd_ >= 0) {
        created = true;
      } else if (errno == EEXIST) {
        fd_ = shm_open(path.c_str(), O_RDWR, 0600);
      }
    }
    if (fd_ < 0) return ErrnoStatus("cannot open " + StoreName(), errno);
    // Held until the tier closes: a second writer would overwrite this one's KV.
    TPUSYNC_RETURN_IF_ERROR(LockStore(fd_, read_only_, StoreName()));
    Status st = MapShmLocked();
    // A segment this call made and could not set up is of no use to anyone.
    if (!st.ok() && created) shm_unlink(path.c_str());
    return st;
  }

  Status MapShmLocked() {
    struct stat sb;
    if (fstat(fd_, &sb) != 0) return ErrnoStatus("cannot stat " + StoreName(), errno);
    const bool fresh = sb.st_size == 0;
    if (fresh && read_only_) {
      return FailedPrecondition(StoreName() + " is empty, not a tier yet; a read-only attach "
                                "never creates one");
    }
    if (!fresh && static_cast<uint64_t>(sb.st_size) < kHeaderBytes) {
      return FailedPrecondition(StoreName() + " is too small to be a tpusync tier");
    }
    if (!read_only_) {
      // Reserve every tmpfs page now (ENOSPC here, not SIGBUS on a later store). On a
      // re-attach this only backs what is missing; fallocate never changes bytes.
      const uint64_t size = fresh ? mapping_bytes_ : static_cast<uint64_t>(sb.st_size);
      TPUSYNC_RETURN_IF_ERROR(Preallocate(fd_, size, "/dev/shm", StoreName()));
    }
    const uint64_t map_bytes = fresh ? mapping_bytes_ : static_cast<uint64_t>(sb.st_size);
    const int prot = read_only_ ? PROT_READ : PROT_READ | PROT_WRITE;
    void* p = mmap(nullptr, map_bytes, prot, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) return ErrnoStatus("cannot map " + StoreName(), errno);
    mapping_ = static_cast<uint8_t*>(p);
    mapping_bytes_ = map_bytes;
    if (fresh || HeaderIsBlank(mapping_)) {
      // Blank: its creator died before writing the header.
      if (read_only_) {
        return FailedPrecondition(StoreName() + " has no tier header; a read-only attach "
                                  "never creates one");
      }
      return EncodeHeader(layout_, {}, mapping_);
    }
    std::vector<NamedRegion> regions;
    TPUSYNC_RETURN_IF_ERROR(
        DecodeHeader(mapping_, layout_, StoreName(), &regions, &layout_.alignment_offset));
    if (map_bytes < kHeaderBytes + capacity_bytes()) {
      return FailedPrecondition(StoreName() + " is truncated: it is " +
                                std::to_string(map_bytes) + " bytes, its header and capacity " +
                                "need " + std::to_string(kHeaderBytes + capacity_bytes()));
    }
    return AdoptRegions(std::move(regions));
  }

  std::string shm_name_;
  int fd_ = -1;
  uint8_t* mapping_ = nullptr;
  uint64_t mapping_bytes_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<Tier>> OpenHostTier(const HostTierOptions& options) {
  auto tier = std::make_unique<HostTier>(options.layout, options.shm_name, options.read_only);
  TPUSYNC_RETURN_IF_ERROR(tier->Open());
  return std::unique_ptr<Tier>(std::move(tier));
}

Status UnlinkShmSegment(const std::string& shm_name) {
  std::string path = "/" + shm_name;
  if (shm_unlink(path.c_str()) != 0) {
    return ErrnoStatus("cannot unlink shm segment '" + path + "'", errno);
  }
  return Status::Ok();
}

}  // namespace tpusync
