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
//
// The file is preallocated to its full size when it is made, so bytes never written read
// as zeros from inside the file; a read that ends early therefore means the file was
// truncated or replaced underneath the tier, and is an error rather than zeros.
#include <fcntl.h>
#include <linux/aio_abi.h>
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
#include "store_guard.h"
#include "tier.h"

namespace tpusync {
namespace {

// Whether the file behind `fd` ends before byte `end` (false when fstat fails).
bool FileEndsBefore(int fd, uint64_t end) {
  struct stat sb;
  return fstat(fd, &sb) == 0 && static_cast<uint64_t>(sb.st_size) < end;
}

Status ShortRead(int fd, const std::string& path, uint64_t offset, uint64_t want,
                 uint64_t got) {
  struct stat sb;
  const std::string now =
      fstat(fd, &sb) == 0 ? std::to_string(sb.st_size) + " bytes" : "of unknown size";
  return DataLoss("file tier read of " + std::to_string(want) +
                            " bytes at file offset " + std::to_string(offset) + " returned " +
                            std::to_string(got) + ": file '" + path + "' (now " + now +
                            ") is shorter than the tier (truncated or replaced?)");
}

// `path` names the file in messages.
Status PreadFull(int fd, uint8_t* dst, uint64_t bytes, uint64_t offset, const std::string& path) {
  while (bytes > 0) {
    ssize_t n = pread(fd, dst, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("file tier read of '" + path + "' at file offset " +
                             std::to_string(offset) + " failed",
                         errno);
    }
    // A read inside the file may stop early (a signal); one past its end never will finish.
    if (static_cast<uint64_t>(n) < bytes && (n == 0 || FileEndsBefore(fd, offset + bytes))) {
      return ShortRead(fd, path, offset, bytes, static_cast<uint64_t>(n));
    }
    dst += n;
    offset += n;
    bytes -= n;
  }
  return Status::Ok();
}

Status PwriteFull(int fd, const uint8_t* src, uint64_t bytes, uint64_t offset,
                  const std::string& path) {
  while (bytes > 0) {
    ssize_t n = pwrite(fd, src, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // Named in full: this becomes the engine's sticky write-back error (ENOSPC, EIO).
      const int err = n < 0 ? errno : EIO;
      return ErrnoStatus("file tier '" + path + "': write of " + std::to_string(bytes) +
                             " bytes at file offset " + std::to_string(offset) + " failed",
                         err);
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

// Runs `count` reads keeping up to `depth` of them queued on the device (at most the AIO
// context's size). `plan(i, slot)` names read i; `slot` in [0, depth) is free for its
// bounce buffer until `landed(i, slot)`,
// called once read i is complete, in completion order. Stops submitting at the first error
// or cancellation but always reaps what is in flight before returning: no read may land in
// a buffer after the caller has given it back.
template <typename Plan, typename Landed>
Status StreamReads(int fd, const std::string& path, IoContext& io, int depth, uint64_t count,
                   Plan&& plan, Landed&& landed) {
  const auto ctx = static_cast<aio_context_t>(io.aio());
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
        status = PreadFull(fd, r.memory, r.bytes, r.offset, path);
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
        st = ErrnoStatus("file tier read of '" + path + "' at file offset " +
                             std::to_string(r.offset) + " failed",
                         static_cast<int>(-res));
      } else if (static_cast<uint64_t>(res) < r.bytes) {
        // Past the end of the file: truncated underneath us. Otherwise an interrupted
        // request: finish it in line.
        st = FileEndsBefore(fd, r.offset + r.bytes)
                 ? ShortRead(fd, path, r.offset, r.bytes, static_cast<uint64_t>(res))
                 : PreadFull(fd, r.memory + res, r.bytes - res, r.offset + res, path);
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
      : Tier(options.layout), options_(options) {
    read_only_ = options.read_only;
  }

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
    if (!read_only_ && access(dir.c_str(), W_OK) != 0) {
      return FailedPrecondition("file tier directory '" + dir + "' is not writable");
    }
    Status st;
    if (!options_.file_name.empty()) {
      if (options_.file_name.find('/') != std::string::npos) {
        return InvalidArgument("file name '" + options_.file_name + "' must not contain '/'");
      }
      path_ = dir + "/" + options_.file_name + ".tpusync";
      st = read_only_ ? AttachReadOnly() : OpenNamed();
    } else {
      if (read_only_) {
        return InvalidArgument("a read-only file tier needs file_name: an anonymous file has "
                               "nothing to attach to");
      }
      std::string tmpl = dir + "/.tpusync-XXXXXX";
      fd_ = mkostemp(tmpl.data(), O_CLOEXEC);
      if (fd_ < 0) return ErrnoStatus("cannot create tier file in '" + dir + "'", errno);
      path_ = tmpl;
      unlink(path_.c_str());  // Anonymous: the data dies with the descriptors.
      st = Preallocate(fd_, FileBytes(), dir, "tier " + StoreName());
    }
    if (st.ok()) st = OpenDirect();
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
    const std::string ro = read_only_ ? ", read-only" : "";
    if (!direct_io()) return "file " + path_ + " (buffered I/O: " + direct_refused_ + ro + ")";
    return "file " + path_ + " (O_DIRECT, " + std::to_string(dio_alignment_) +
           " B alignment, data at +" + std::to_string(layout_.alignment_offset) + ro + ")";
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
        return PreadFull(fd_, out + done, n, pos + done, path_);
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
        TPUSYNC_RETURN_IF_ERROR(PreadFull(direct_fd_, io.bounce(0), align, sector, path_));
        std::memcpy(out + (from - pos), io.bounce(0) + (from - sector), to - from);
        return Status::Ok();
      };
      if (lo > pos) TPUSYNC_RETURN_IF_ERROR(edge(lo - align, pos, lo));
      if (hi < pos + bytes) TPUSYNC_RETURN_IF_ERROR(edge(hi, hi, pos + bytes));
      direct_bytes_.fetch_add(hi - lo, std::memory_order_relaxed);
      bounced_bytes_.fetch_add(bytes - (hi - lo), std::memory_order_relaxed);
      return StreamReads(
          direct_fd_, path_, io, io.depth(), (hi - lo + chunk - 1) / chunk,
          [&](uint64_t i, int) {
            return ChunkRead{inner + i * chunk, std::min(chunk, hi - lo - i * chunk),
                             lo + i * chunk};
          },
          [](uint64_t, int) { return Status::Ok(); });
    }
    // Different phase: whole aligned chunks into the bounce ring, copied out as they land.
    // The ring's reads are at most kRingReadBytes, kRingBytesInFlight of them in flight.
    // Measured on a 2-core VM, 512 MiB in 1-8 MiB requests against one plain O_DIRECT
    // reader: 4 reads of 1 MiB in flight ran at 0.6-1.2 of it, slow whenever both workers
    // were on one CPU; 4 of 256 KiB at 0.84-1.2, 6 or 8 of 256 KiB at 0.96-1.19, 16 of 256
    // KiB at 0.62-0.97 (a ring that stays in cache, likely).
    const uint64_t ring_chunk = io.ring_read_bytes();
    const uint64_t first = AlignDown(pos, align), last = AlignUp(pos + bytes, align);
    bounced_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    return StreamReads(
        direct_fd_, path_, io, io.ring_slots(), (last - first + ring_chunk - 1) / ring_chunk,
        [&](uint64_t i, int slot) {
          uint64_t start = first + i * ring_chunk;
          return ChunkRead{io.ring(slot), std::min(ring_chunk, last - start), start};
        },
        [&](uint64_t i, int slot) {
          uint64_t c0 = first + i * ring_chunk, c1 = std::min(c0 + ring_chunk, last);
          uint64_t from = std::max(c0, pos), to = std::min(c1, pos + bytes);
          CopyToDestination(out + (from - pos), io.ring(slot) + (from - c0), to - from);
          return Status::Ok();
        });
  }

  Status Write(uint64_t offset, const void* src, uint64_t bytes, IoContext& io) override {
    if (read_only_) return ReadOnlyError(StoreName());
    TPUSYNC_RETURN_IF_ERROR(CheckRange(offset, bytes));
    const auto* in = static_cast<const uint8_t*>(src);
    const uint64_t pos = data_start() + offset;
    if (!direct_io() || (IsAligned(pos, kIoAlignment) && IsAligned(in, kIoAlignment) &&
                         IsAligned(bytes, kIoAlignment))) {
      return ChunkLoop(bytes, io, [&](uint64_t done, uint64_t n) {
        return PwriteFull(direct_io() ? direct_fd_ : fd_, in + done, n, pos + done, path_);
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
      if (c0 < pos) edge = PreadFull(direct_fd_, buf, kIoAlignment, c0, path_);
      if (edge.ok() && c1 > pos + bytes && !(c0 < pos && c1 - c0 == kIoAlignment)) {
        edge = PreadFull(direct_fd_, buf + (c1 - c0 - kIoAlignment), kIoAlignment,
                         c1 - kIoAlignment, path_);
      }
      if (!edge.ok()) {
        io.helper().Join();  // Never leave a write in flight on a buffer we give back.
        return edge;
      }
      uint64_t lo = std::max(c0, pos), hi = std::min(c1, pos + bytes);
      std::memcpy(buf + (lo - c0), in + (lo - pos), hi - lo);
      TPUSYNC_RETURN_IF_ERROR(io.helper().Join());
      io.before_chunk(c1 - c0);
      io.helper().Start(
          [this, buf, c0, c1] { return PwriteFull(direct_fd_, buf, c1 - c0, c0, path_); });
    }
    return io.helper().Join();
  }

 protected:
  Status SaveRegions(const std::vector<NamedRegion>& regions) override {
    if (options_.file_name.empty()) return Status::Ok();
    if (read_only_) return ReadOnlyError(StoreName());
    uint8_t header[kHeaderBytes];
    TPUSYNC_RETURN_IF_ERROR(EncodeHeader(layout_, regions, header));
    TPUSYNC_RETURN_IF_ERROR(PwriteFull(fd_, header, kHeaderBytes, 0, path_));
    if (fdatasync(fd_) != 0) return ErrnoStatus("cannot sync the header of " + StoreName(), errno);
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

  std::string StoreName() const { return "file '" + path_ + "'"; }
  // The file's full size, rounded to a page for O_DIRECT.
  uint64_t FileBytes() const { return AlignUp(data_start() + capacity_bytes(), kIoAlignment); }

  // A writer: attach to the file, or create it. A file is created complete (preallocated,
  // header written) under a temporary name and linked into place, so a file under the
  // tier's name is never half made: one that is short or empty was truncated or replaced.
  Status OpenNamed() {
    for (int attempt = 0; attempt < 4; ++attempt) {
      fd_ = open(path_.c_str(), O_RDWR | O_CLOEXEC);
      if (fd_ >= 0) {
        // Held until the tier closes: a second writer would overwrite this one's KV.
        TPUSYNC_RETURN_IF_ERROR(LockStore(fd_, /*shared=*/false, "tier " + StoreName()));
        TPUSYNC_RETURN_IF_ERROR(AttachLocked());
        // Backs whatever an older, sparse file lacks; fallocate never changes bytes.
        return Preallocate(fd_, FileBytes(), options_.directory, "tier " + StoreName());
      }
      if (errno != ENOENT) return ErrnoStatus("cannot open " + StoreName(), errno);
      bool raced = false;
      TPUSYNC_RETURN_IF_ERROR(CreateNamed(&raced));
      if (!raced) return Status::Ok();
    }
    return Unavailable(StoreName() + " kept being created and removed while opening it");
  }

  // Sets *raced when another process linked the name first (then nothing is kept).
  Status CreateNamed(bool* raced) {
    std::string tmp = options_.directory + "/." + options_.file_name + ".tpusync.XXXXXX";
    fd_ = mkostemp(tmp.data(), O_CLOEXEC);
    if (fd_ < 0) {
      return ErrnoStatus("cannot create tier file in '" + options_.directory + "'", errno);
    }
    // Nobody else knows the inode yet: the lock cannot fail, and it travels with the link.
    Status st = LockStore(fd_, /*shared=*/false, "tier " + StoreName());
    if (st.ok()) st = Preallocate(fd_, FileBytes(), options_.directory, "tier " + StoreName());
    if (st.ok()) st = SaveRegions({});
    if (st.ok() && link(tmp.c_str(), path_.c_str()) != 0) {
      int err = errno;
      if (err == EEXIST) {
        *raced = true;
      } else if (err == EPERM || err == EOPNOTSUPP || err == ENOSYS) {
        // No hard links on this filesystem: rename (which replaces a racing creator's file).
        err = rename(tmp.c_str(), path_.c_str()) == 0 ? 0 : errno;
      }
      if (err != 0 && !*raced) st = ErrnoStatus("cannot create " + StoreName(), err);
    }
    unlink(tmp.c_str());  // Gone already where rename moved it.
    if (!st.ok() || *raced) {
      close(fd_);
      fd_ = -1;
    }
    return st;
  }

  Status AttachReadOnly() {
    fd_ = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0 && errno == ENOENT) {
      return NotFound(StoreName() + " does not exist; a read-only attach never creates one");
    }
    if (fd_ < 0) return ErrnoStatus("cannot open " + StoreName(), errno);
    TPUSYNC_RETURN_IF_ERROR(LockStore(fd_, /*shared=*/true, "tier " + StoreName()));
    return AttachLocked();
  }

  // Validates an existing file's header and size; adopts its regions.
  Status AttachLocked() {
    struct stat sb;
    if (fstat(fd_, &sb) != 0) return ErrnoStatus("cannot stat " + StoreName(), errno);
    const uint64_t size = static_cast<uint64_t>(sb.st_size);
    if (size < kHeaderBytes) {
      return FailedPrecondition("tier " + StoreName() + " is " + std::to_string(size) +
                                " bytes, shorter than its " + std::to_string(kHeaderBytes) +
                                "-byte header (truncated or replaced?); remove it to start "
                                "a new tier");
    }
    uint8_t header[kHeaderBytes];
    TPUSYNC_RETURN_IF_ERROR(PreadFull(fd_, header, kHeaderBytes, 0, path_));
    std::vector<NamedRegion> regions;
    TPUSYNC_RETURN_IF_ERROR(DecodeHeader(header, layout_, "tier " + StoreName(), &regions,
                                         &layout_.alignment_offset));
    if (size < FileBytes()) {
      return FailedPrecondition("tier " + StoreName() + " is " + std::to_string(size) +
                                " bytes but its header and capacity need " +
                                std::to_string(FileBytes()) +
                                " (truncated or replaced?); its KV is incomplete");
    }
    return AdoptRegions(std::move(regions));
  }

  Status OpenDirect() {
    if (!options_.allow_direct_io) {
      direct_refused_ = "O_DIRECT disabled by option";
      return Status::Ok();
    }
    std::string proc = "/proc/self/fd/" + std::to_string(fd_);
    int fd = open(proc.c_str(), (read_only_ ? O_RDONLY : O_RDWR) | O_DIRECT | O_CLOEXEC);
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
