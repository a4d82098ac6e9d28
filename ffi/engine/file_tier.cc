// The file tier: one file in a directory on local SSD or shared storage.
//
// Data moves with O_DIRECT so a long context streams from the device instead of evicting
// the page cache. O_DIRECT needs 4 KiB-aligned memory, offsets and lengths, and XLA's CPU
// buffers are not 4 KiB-aligned, so unaligned transfers go through two bounce buffers and
// are pipelined: the helper thread reads chunk i+1 while this thread copies chunk i out.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "persistent_header.h"
#include "tier.h"

namespace tpusync {
namespace {

Status PreadFull(int fd, uint8_t* dst, uint64_t bytes, uint64_t offset) {
  while (bytes > 0) {
    ssize_t n = pread(fd, dst, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("file tier read at offset " + std::to_string(offset) + " failed", errno);
    }
    if (n == 0) {  // Past the end of a sparse file: the bytes were never written.
      std::memset(dst, 0, bytes);
      return Status::Ok();
    }
    dst += n;
    offset += n;
    bytes -= n;
  }
  return Status::Ok();
}

Status PwriteFull(int fd, const uint8_t* src, uint64_t bytes, uint64_t offset) {
  while (bytes > 0) {
    ssize_t n = pwrite(fd, src, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("file tier write at offset " + std::to_string(offset) + " failed",
                         errno);
    }
    src += n;
    offset += n;
    bytes -= n;
  }
  return Status::Ok();
}

class FileTier final : public Tier {
 public:
  explicit FileTier(const FileTierOptions& options)
      : Tier(options.layout), options_(options) {}

  ~FileTier() override {
    if (direct_fd_ >= 0) close(direct_fd_);
    if (fd_ >= 0) close(fd_);
  }

  Status Open() {
    if (layout_.block_bytes == 0 || layout_.num_blocks == 0) {
      return InvalidArgument("file tier needs block_bytes > 0 and num_blocks > 0");
    }
    if (capacity_bytes() / layout_.block_bytes != layout_.num_blocks) {
      return InvalidArgument("file tier size overflows");
    }
    const std::string& dir = options_.directory;
    struct stat sb;
    if (stat(dir.c_str(), &sb) != 0) {
      return NotFound("file tier directory '" + dir + "' does not exist");
    }
    if (!S_ISDIR(sb.st_mode)) {
      return InvalidArgument("file tier path '" + dir + "' is not a directory");
    }
    if (access(dir.c_str(), W_OK) != 0) {
      return FailedPrecondition("file tier directory '" + dir + "' is not writable");
    }
    const bool named = !options_.file_name.empty();
    if (named) {
      if (options_.file_name.find('/') != std::string::npos) {
        return InvalidArgument("file name '" + options_.file_name + "' must not contain '/'");
      }
      path_ = dir + "/" + options_.file_name + ".tpusync";
      fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    } else {
      std::string tmpl = dir + "/.tpusync-XXXXXX";
      fd_ = mkostemp(tmpl.data(), O_CLOEXEC);
      path_ = tmpl;
    }
    if (fd_ < 0) return ErrnoStatus("cannot create tier file in '" + dir + "'", errno);
    Status st = named ? OpenNamed() : Status::Ok();
    if (st.ok()) st = SizeFile();
    if (st.ok()) st = OpenDirect();
    if (!named) unlink(path_.c_str());  // Anonymous: the data dies with the descriptors.
    return st;
  }

  const char* kind() const override { return "file"; }
  bool direct_io() const override { return direct_fd_ >= 0; }
  uint64_t hazard_granularity() const override { return direct_io() ? kIoAlignment : 1; }

  std::string Describe() const override {
    return "file " + path_ + (direct_io() ? " (O_DIRECT, pipelined bounce buffers)"
                                          : " (buffered I/O: " + direct_refused_ + ")");
  }

  Status Read(uint64_t offset, void* dst, uint64_t bytes, IoContext& io) override {
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    auto* out = static_cast<uint8_t*>(dst);
    const uint64_t pos = kHeaderBytes + offset;
    if (!direct_io() || (IsAligned(pos, kIoAlignment) && IsAligned(out, kIoAlignment) &&
                         IsAligned(bytes, kIoAlignment))) {
      // Straight into the destination: no bounce needed.
      return ChunkLoop(bytes, io, [&](uint64_t done, uint64_t n) {
        return PreadFull(direct_io() ? direct_fd_ : fd_, out + done, n, pos + done);
      });
    }
    const uint64_t first = AlignDown(pos, kIoAlignment);
    const uint64_t last = AlignUp(pos + bytes, kIoAlignment);
    const uint64_t chunk = io.chunk_bytes();
    const uint64_t num_chunks = (last - first + chunk - 1) / chunk;
    auto read_chunk = [&](uint64_t i) {
      uint64_t start = first + i * chunk;
      uint64_t n = std::min(chunk, last - start);
      return [this, &io, i, start, n] { return PreadFull(direct_fd_, io.bounce(i % 2), n, start); };
    };
    io.bounce(0);
    io.bounce(1);
    io.before_chunk(std::min(chunk, last - first));
    io.helper().Start(read_chunk(0));
    for (uint64_t i = 0; i < num_chunks; ++i) {
      TPUSYNC_RETURN_IF_ERROR(io.helper().Join());
      if (io.cancelled()) return Cancelled("transfer cancelled");
      if (i + 1 < num_chunks) {
        io.before_chunk(std::min(chunk, last - (first + (i + 1) * chunk)));
        io.helper().Start(read_chunk(i + 1));
      }
      // Copy out the part of chunk i that lies inside [pos, pos + bytes).
      uint64_t c0 = first + i * chunk, c1 = std::min(c0 + chunk, last);
      uint64_t lo = std::max(c0, pos), hi = std::min(c1, pos + bytes);
      std::memcpy(out + (lo - pos), io.bounce(i % 2) + (lo - c0), hi - lo);
    }
    return Status::Ok();
  }

  Status Write(uint64_t offset, const void* src, uint64_t bytes, IoContext& io) override {
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    const auto* in = static_cast<const uint8_t*>(src);
    const uint64_t pos = kHeaderBytes + offset;
    if (!direct_io() || (IsAligned(pos, kIoAlignment) && IsAligned(in, kIoAlignment) &&
                         IsAligned(bytes, kIoAlignment))) {
      return ChunkLoop(bytes, io, [&](uint64_t done, uint64_t n) {
        return PwriteFull(direct_io() ? direct_fd_ : fd_, in + done, n, pos + done);
      });
    }
    // Read-modify-write of the partial head and tail pages; the engine keeps other writers
    // off those pages (hazard_granularity).
    const uint64_t first = AlignDown(pos, kIoAlignment);
    const uint64_t last = AlignUp(pos + bytes, kIoAlignment);
    const uint64_t chunk = io.chunk_bytes();
    const uint64_t num_chunks = (last - first + chunk - 1) / chunk;
    for (uint64_t i = 0; i < num_chunks; ++i) {
      if (io.cancelled()) {
        io.helper().Join();
        return Cancelled("transfer cancelled");
      }
      uint64_t c0 = first + i * chunk, c1 = std::min(c0 + chunk, last);
      uint8_t* buf = io.bounce(i % 2);
      // Buffer i % 2 was last used by the write of chunk i - 2, joined below in step i - 1.
      Status edge;
      if (c0 < pos) edge = PreadFull(direct_fd_, buf, kIoAlignment, c0);
      if (edge.ok() && c1 > pos + bytes && !(c0 < pos && c1 - c0 == kIoAlignment)) {
        edge = PreadFull(direct_fd_, buf + (c1 - c0 - kIoAlignment), kIoAlignment,
                         c1 - kIoAlignment);
      }
      if (!edge.ok()) {
        io.helper().Join();  // Never leave a write in flight on a buffer we give back.
        return edge;
      }
      uint64_t lo = std::max(c0, pos), hi = std::min(c1, pos + bytes);
      std::memcpy(buf + (lo - c0), in + (lo - pos), hi - lo);
      TPUSYNC_RETURN_IF_ERROR(io.helper().Join());
      io.before_chunk(c1 - c0);
      io.helper().Start([this, buf, c0, c1] { return PwriteFull(direct_fd_, buf, c1 - c0, c0); });
    }
    return io.helper().Join();
  }

 protected:
  Status SaveRegions(const std::vector<NamedRegion>& regions) override {
    if (options_.file_name.empty()) return Status::Ok();
    uint8_t header[kHeaderBytes];
    TPUSYNC_RETURN_IF_ERROR(EncodeHeader(layout_, regions, header));
    TPUSYNC_RETURN_IF_ERROR(PwriteFull(fd_, header, kHeaderBytes, 0));
    if (fdatasync(fd_) != 0) return ErrnoStatus("cannot sync tier header", errno);
    return Status::Ok();
  }

 private:
  template <typename Fn>
  static Status ChunkLoop(uint64_t bytes, IoContext& io, Fn&& fn) {
    for (uint64_t done = 0; done < bytes;) {
      if (io.cancelled()) return Cancelled("transfer cancelled");
      uint64_t n = std::min<uint64_t>(io.chunk_bytes(), bytes - done);
      io.before_chunk(n);
      TPUSYNC_RETURN_IF_ERROR(fn(done, n));
      done += n;
    }
    return Status::Ok();
  }

  Status OpenNamed() {
    flock(fd_, LOCK_EX);
    struct stat sb;
    Status st;
    if (fstat(fd_, &sb) != 0) {
      st = ErrnoStatus("cannot stat '" + path_ + "'", errno);
    } else if (sb.st_size == 0) {
      st = SaveRegions({});
    } else {
      uint8_t header[kHeaderBytes];
      st = PreadFull(fd_, header, kHeaderBytes, 0);
      std::vector<NamedRegion> regions;
      if (st.ok()) st = DecodeHeader(header, layout_, "tier file '" + path_ + "'", &regions);
      if (st.ok()) st = AdoptRegions(std::move(regions));
    }
    flock(fd_, LOCK_UN);
    return st;
  }

  Status SizeFile() {
    // Sparse: blocks take disk space only once written. Rounded to a page for O_DIRECT.
    uint64_t size = kHeaderBytes + AlignUp(capacity_bytes(), kIoAlignment);
    struct stat sb;
    if (fstat(fd_, &sb) == 0 && static_cast<uint64_t>(sb.st_size) >= size) return Status::Ok();
    if (ftruncate(fd_, static_cast<off_t>(size)) != 0) {
      return ErrnoStatus("cannot size tier file '" + path_ + "'", errno);
    }
    return Status::Ok();
  }

  Status OpenDirect() {
    if (!options_.allow_direct_io) {
      direct_refused_ = "O_DIRECT disabled by option";
      return Status::Ok();
    }
    std::string proc = "/proc/self/fd/" + std::to_string(fd_);
    int fd = open(proc.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
      direct_refused_ = std::string("O_DIRECT refused: ") + std::strerror(errno);
      return Status::Ok();
    }
    // Some filesystems accept the flag but fail the first aligned read.
    AlignedBuffer probe(kIoAlignment);
    if (pread(fd, probe.data(), kIoAlignment, 0) < 0) {
      direct_refused_ = std::string("O_DIRECT read failed: ") + std::strerror(errno);
      close(fd);
      return Status::Ok();
    }
    direct_fd_ = fd;
    return Status::Ok();
  }

  FileTierOptions options_;
  std::string path_;
  std::string direct_refused_;
  int fd_ = -1;
  int direct_fd_ = -1;
};

}  // namespace

StatusOr<std::unique_ptr<Tier>> OpenFileTier(const FileTierOptions& options) {
  auto tier = std::make_unique<FileTier>(options);
  TPUSYNC_RETURN_IF_ERROR(tier->Open());
  return std::unique_ptr<Tier>(std::move(tier));
}

}  // namespace tpusync
