// The file tier: one file in a directory on local SSD or shared storage.
//
// Data moves with O_DIRECT so a long context streams from the device instead of evicting
// the page cache. O_DIRECT needs memory, file offsets and lengths aligned to the device's
// DIO alignment (512 B or 4 KiB). Reads keep `depth` requests queued on the device with
// Linux AIO, so the device stays busy even while compute threads hold every core:
// - straight into the destination when it sits at the same offset modulo the alignment as
//   the data in the file (the tier's alignment_offset shifts the data to make that the
//   common case for XLA's buffers), only the partial head and tail sectors bounced;
// - otherwise through a ring of huge-page bounce buffers, each copied out as it lands.
// Writes go through two bounce buffers, pipelined on a helper thread.
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

// One O_DIRECT read of a transfer: `bytes` at file offset `offset` into `memory`.
struct ChunkRead {
  uint8_t* memory;
  uint64_t bytes;
  uint64_t offset;
};

// Runs `count` reads keeping up to io.depth() of them queued on the device. `plan(i, slot)`
// names read i; `slot` in [0, depth) is free for its bounce buffer until `landed(i, slot)`,
// called once read i is complete, in completion order. Stops submitting at the first error
// or cancellation but always reaps what is in flight before returning: no read may land in
// a buffer after the caller has given it back.
template <typename Plan, typename Landed>
Status StreamReads(int fd, IoContext& io, uint64_t count, Plan&& plan, Landed&& landed) {
  const auto ctx = static_cast<aio_context_t>(io.aio());
  const int depth = io.depth();
  std::vector<ChunkRead> reads(depth);
  std::vector<uint64_t> index(depth);
  std::vector<struct iocb> cbs(depth);
  std::vector<struct io_event> events(depth);
  std::vector<int> free_slots;
  for (int s = depth - 1; s >= 0; --s) free_slots.push_back(s);
  Status status;
  int inflight = 0;
  uint64_t next = 0;
  while (true) {
    while (status.ok() && next < count && !free_slots.empty()) {
      if (io.cancelled()) {
        status = Cancelled("transfer cancelled");
        break;
      }
      const int slot = free_slots.back();
      const ChunkRead r = plan(next, slot);
      io.before_chunk(r.bytes);
      struct iocb& cb = cbs[slot];
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_data = static_cast<uint64_t>(slot);
      cb.aio_lio_opcode = IOCB_CMD_PREAD;
      cb.aio_fildes = static_cast<uint32_t>(fd);
      cb.aio_buf = reinterpret_cast<uint64_t>(r.memory);
      cb.aio_nbytes = r.bytes;
      cb.aio_offset = static_cast<int64_t>(r.offset);
      struct iocb* one = &cb;
      if (ctx == 0 || syscall(SYS_io_submit, ctx, 1, &one) != 1) {
        // No AIO (or the queue refused it): read synchronously, same result.
        status = PreadFull(fd, r.memory, r.bytes, r.offset);
        if (status.ok()) status = landed(next, slot);
        ++next;
        continue;
      }
      free_slots.pop_back();
      reads[slot] = r;
      index[slot] = next++;
      ++inflight;
    }
    if (inflight == 0) break;
    long n = syscall(SYS_io_getevents, ctx, 1, depth, events.data(), nullptr);
    if (n < 0) {
      if (errno == EINTR) continue;
      // Cannot happen with a valid context. Without events nothing says which reads landed:
      // tear the context down (io_destroy returns once every queued read has completed or
      // been cancelled, so none can land in a buffer after we return) and fail the transfer.
      const int err = errno;
      io.DropAio();
      return ErrnoStatus("waiting for file tier reads failed", err);
    }
    for (long e = 0; e < n; ++e) {
      const int slot = static_cast<int>(events[e].data);
      const ChunkRead& r = reads[slot];
      const int64_t res = events[e].res;
      Status st;
      if (res < 0) {
        st = ErrnoStatus("file tier read at offset " + std::to_string(r.offset) + " failed",
                         static_cast<int>(-res));
      } else if (static_cast<uint64_t>(res) < r.bytes) {
        // Short read (end of a sparse file, or an interrupted request): finish it in line.
        st = PreadFull(fd, r.memory + res, r.bytes - res, r.offset + res);
      }
      if (st.ok() && status.ok()) st = landed(index[slot], slot);
      if (!st.ok() && status.ok()) status = std::move(st);
      free_slots.push_back(slot);
      --inflight;
    }
  }
  return status;
}

// DIO alignment of an open file: the larger of what memory and file offsets need
// (statx STATX_DIOALIGN, Linux 6.1+); 4 KiB where the kernel does not say.
uint64_t DirectIoAlignment(int fd) {
#ifdef STATX_DIOALIGN
  struct statx sx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_mem_align != 0 && sx.stx_dio_offset_align != 0) {
    uint64_t a = std::max(sx.stx_dio_mem_align, sx.stx_dio_offset_align);
    if (a <= kIoAlignment && kIoAlignment % a == 0) return a;
  }
#endif
  (void)fd;
  return kIoAlignment;
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
    if (layout_.alignment_offset >= kIoAlignment) {
      return InvalidArgument("alignment_offset must be in [0, 4096), got " +
                             std::to_string(layout_.alignment_offset));
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
  uint64_t hazard_phase() const override { return layout_.alignment_offset; }
  uint64_t dio_alignment() const override { return direct_io() ? dio_alignment_ : 0; }
  uint64_t direct_read_bytes() const override { return direct_bytes_.load(); }
  uint64_t bounced_read_bytes() const override { return bounced_bytes_.load(); }

  std::string Describe() const override {
    if (!direct_io()) return "file " + path_ + " (buffered I/O: " + direct_refused_ + ")";
    return "file " + path_ + " (O_DIRECT, " + std::to_string(dio_alignment_) +
           " B alignment, data at +" + std::to_string(layout_.alignment_offset) + ")";
  }

  bool ReadsInPlace(uint64_t offset, const void* dst) const override {
    return direct_io() &&
           (reinterpret_cast<uintptr_t>(dst) - (data_start() + offset)) % dio_alignment_ == 0;
  }

  uint64_t InPlacePhase(uint64_t offset) const override {
    return direct_io() ? (data_start() + offset) % dio_alignment_ : 0;
  }

  Status Read(uint64_t offset, void* dst, uint64_t bytes, IoContext& io) override {
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    auto* out = static_cast<uint8_t*>(dst);
    const uint64_t pos = data_start() + offset;
    if (!direct_io()) {
      return ChunkLoop(bytes, io, [&](uint64_t done, uint64_t n) {
        return PreadFull(fd_, out + done, n, pos + done);
      });
    }
    const uint64_t align = dio_alignment_;
    const uint64_t chunk = io.chunk_bytes();
    const uint64_t lo = AlignUp(pos, align), hi = AlignDown(pos + bytes, align);
    if (ReadsInPlace(offset, out) && hi > lo) {
      // Same phase: the aligned interior goes straight to the destination.
      uint8_t* inner = out + (lo - pos);
      // A partial sector at either end: read it whole, keep file bytes [from, to) of it.
      auto edge = [&](uint64_t sector, uint64_t from, uint64_t to) -> Status {
        TPUSYNC_RETURN_IF_ERROR(PreadFull(direct_fd_, io.bounce(0), align, sector));
        std::memcpy(out + (from - pos), io.bounce(0) + (from - sector), to - from);
        return Status::Ok();
      };
      if (lo > pos) TPUSYNC_RETURN_IF_ERROR(edge(lo - align, pos, lo));
      if (hi < pos + bytes) TPUSYNC_RETURN_IF_ERROR(edge(hi, hi, pos + bytes));
      direct_bytes_.fetch_add(hi - lo, std::memory_order_relaxed);
      bounced_bytes_.fetch_add(bytes - (hi - lo), std::memory_order_relaxed);
      return StreamReads(
          direct_fd_, io, (hi - lo + chunk - 1) / chunk,
          [&](uint64_t i, int) {
            return ChunkRead{inner + i * chunk, std::min(chunk, hi - lo - i * chunk),
                             lo + i * chunk};
          },
          [](uint64_t, int) { return Status::Ok(); });
    }
    // Different phase: whole aligned chunks into the bounce ring, copied out as they land.
    const uint64_t first = AlignDown(pos, align), last = AlignUp(pos + bytes, align);
    bounced_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    return StreamReads(
        direct_fd_, io, (last - first + chunk - 1) / chunk,
        [&](uint64_t i, int slot) {
          uint64_t start = first + i * chunk;
          return ChunkRead{io.bounce(slot), std::min(chunk, last - start), start};
        },
        [&](uint64_t i, int slot) {
          uint64_t c0 = first + i * chunk, c1 = std::min(c0 + chunk, last);
          uint64_t from = std::max(c0, pos), to = std::min(c1, pos + bytes);
          CopyToDestination(out + (from - pos), io.bounce(slot) + (from - c0), to - from);
          return Status::Ok();
        });
  }

  Status Write(uint64_t offset, const void* src, uint64_t bytes, IoContext& io) override {
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    const auto* in = static_cast<const uint8_t*>(src);
    const uint64_t pos = data_start() + offset;
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
  uint64_t data_start() const { return kHeaderBytes + layout_.alignment_offset; }

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
      if (st.ok()) {
        st = DecodeHeader(header, layout_, "tier file '" + path_ + "'", &regions,
                          &layout_.alignment_offset);
      }
      if (st.ok()) st = AdoptRegions(std::move(regions));
    }
    flock(fd_, LOCK_UN);
    return st;
  }

  Status SizeFile() {
    // Sparse: blocks take disk space only once written. Rounded to a page for O_DIRECT.
    uint64_t size = AlignUp(data_start() + capacity_bytes(), kIoAlignment);
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
    dio_alignment_ = DirectIoAlignment(fd);
    return Status::Ok();
  }

  FileTierOptions options_;
  std::string path_;
  std::string direct_refused_;
  int fd_ = -1;
  int direct_fd_ = -1;
  uint64_t dio_alignment_ = kIoAlignment;
  std::atomic<uint64_t> direct_bytes_{0};
  std::atomic<uint64_t> bounced_bytes_{0};
};

}  // namespace

StatusOr<std::unique_ptr<Tier>> OpenFileTier(const FileTierOptions& options) {
  auto tier = std::make_unique<FileTier>(options);
  TPUSYNC_RETURN_IF_ERROR(tier->Open());
  return std::unique_ptr<Tier>(std::move(tier));
}

}  // namespace tpusync
