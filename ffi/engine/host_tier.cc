// The host DRAM tier: one page-aligned pool, anonymous or backed by a POSIX shm segment.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "persistent_header.h"
#include "tier.h"

namespace tpusync {
namespace {

// Copies in chunks so the engine can throttle and cancel between them.
void ChunkedCopy(uint8_t* dst, const uint8_t* src, uint64_t bytes, IoContext& io,
                 bool* cancelled) {
  for (uint64_t done = 0; done < bytes;) {
    if (io.cancelled()) {
      *cancelled = true;
      return;
    }
    uint64_t n = std::min<uint64_t>(io.chunk_bytes(), bytes - done);
    io.before_chunk(n);
    std::memcpy(dst + done, src + done, n);
    done += n;
  }
}

class HostTier final : public Tier {
 public:
  HostTier(TierLayout layout, std::string shm_name)
      : Tier(layout), shm_name_(std::move(shm_name)) {}

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
    if (shm_name_.empty()) return MapAnonymous();
    return MapShm();
  }

  const char* kind() const override { return "host"; }

  std::string Describe() const override {
    return shm_name_.empty() ? "host DRAM pool (anonymous)"
                             : "host DRAM pool (shm /" + shm_name_ + ")";
  }

  Status Read(uint64_t offset, void* dst, uint64_t bytes, IoContext& io) override {
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    bool cancelled = false;
    ChunkedCopy(static_cast<uint8_t*>(dst), data() + offset, bytes, io, &cancelled);
    return cancelled ? Cancelled("transfer cancelled") : Status::Ok();
  }

  Status Write(uint64_t offset, const void* src, uint64_t bytes, IoContext& io) override {
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    bool cancelled = false;
    ChunkedCopy(data() + offset, static_cast<const uint8_t*>(src), bytes, io, &cancelled);
    return cancelled ? Cancelled("transfer cancelled") : Status::Ok();
  }

 protected:
  Status SaveRegions(const std::vector<NamedRegion>& regions) override {
    if (shm_name_.empty()) return Status::Ok();
    return EncodeHeader(layout_, regions, mapping_);
  }

 private:
  uint8_t* data() const { return mapping_ + kHeaderBytes; }

  Status MapAnonymous() {
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
    std::string path = "/" + shm_name_;
    fd_ = shm_open(path.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd_ < 0) return ErrnoStatus("cannot open shm segment '" + path + "'", errno);
    // Serialize create-or-validate against another process opening the same segment.
    flock(fd_, LOCK_EX);
    Status st = MapShmLocked(path);
    flock(fd_, LOCK_UN);
    return st;
  }

  Status MapShmLocked(const std::string& path) {
    struct stat sb;
    if (fstat(fd_, &sb) != 0) return ErrnoStatus("cannot stat shm segment '" + path + "'", errno);
    const bool fresh = sb.st_size == 0;
    if (!fresh && static_cast<uint64_t>(sb.st_size) < kHeaderBytes) {
      return FailedPrecondition("shm segment '" + path + "' is too small to be a tpusync tier");
    }
    if (fresh && ftruncate(fd_, static_cast<off_t>(mapping_bytes_)) != 0) {
      return ErrnoStatus("cannot size shm segment '" + path + "'", errno);
    }
    const uint64_t map_bytes = fresh ? mapping_bytes_ : static_cast<uint64_t>(sb.st_size);
    void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) return ErrnoStatus("cannot map shm segment '" + path + "'", errno);
    mapping_ = static_cast<uint8_t*>(p);
    mapping_bytes_ = map_bytes;
    if (fresh || HeaderIsBlank(mapping_)) return EncodeHeader(layout_, {}, mapping_);
    std::vector<NamedRegion> regions;
    TPUSYNC_RETURN_IF_ERROR(
        DecodeHeader(mapping_, layout_, "shm segment '" + path + "'", &regions,
                     &layout_.alignment_offset));
    if (map_bytes < kHeaderBytes + capacity_bytes()) {
      return FailedPrecondition("shm segment '" + path + "' is truncated");
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
  auto tier = std::make_unique<HostTier>(options.layout, options.shm_name);
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
