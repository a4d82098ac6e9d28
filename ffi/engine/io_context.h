// Per-worker I/O scratch: a ring of aligned bounce buffers, a Linux AIO context that keeps
// several O_DIRECT reads queued on the device, and one helper thread for pipelined writes.
#ifndef TPUSYNC_ENGINE_IO_CONTEXT_H_
#define TPUSYNC_ENGINE_IO_CONTEXT_H_

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "status.h"

namespace tpusync {

// 4 KiB: the alignment O_DIRECT asks of file offsets, lengths and memory.
inline constexpr uint64_t kIoAlignment = 4096;
// The largest read through a bounce ring, and the bytes of such reads kept in flight (see
// IoContext::ring).
inline constexpr uint64_t kRingReadBytes = 256 << 10;
inline constexpr uint64_t kRingBytesInFlight = 2 << 20;

inline uint64_t AlignDown(uint64_t x, uint64_t a) { return x - x % a; }
inline uint64_t AlignUp(uint64_t x, uint64_t a) { return AlignDown(x + a - 1, a); }
inline bool IsAligned(uint64_t x, uint64_t a) { return x % a == 0; }
inline bool IsAligned(const void* p, uint64_t a) {
  return reinterpret_cast<uintptr_t>(p) % a == 0;
}

// Owns page-aligned memory; freed on destruction.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Anonymous memory aligned to 2 MiB and marked for transparent huge pages, pre-faulted.
// O_DIRECT into huge pages is several times faster on virtualized block devices: a 1 MiB
// read is one physically contiguous segment instead of 256 pages (more than some queues
// accept in one request), and pinning it costs the kernel far less.
class HugePageBuffer {
 public:
  HugePageBuffer() = default;
  explicit HugePageBuffer(size_t bytes);
  ~HugePageBuffer();
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// A single background thread that runs one job at a time. Start() hands it a job; Join()
// waits for that job and returns its status. Used for two-stage pipelines.
class PipelineThread {
 public:
  PipelineThread();
  ~PipelineThread();
  PipelineThread(const PipelineThread&) = delete;
  PipelineThread& operator=(const PipelineThread&) = delete;

  // Requires that no job is outstanding (call Join() first).
  void Start(std::function<Status()> job);
  // Waits for the outstanding job, if any; returns its status (Ok when none).
  Status Join();

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<Status()> job_;
  bool has_job_ = false;
  bool done_ = true;
  bool stop_ = false;
  Status result_;
  std::thread thread_;
};

// Copies `bytes` from `src` to `dst`. Large copies use non-temporal stores where the CPU
// has them: the destination (a fetch landing zone) is not read back by this thread, so
// skipping the cache saves the read-for-ownership traffic (~1.6x on x86).
void CopyToDestination(void* dst, const void* src, size_t bytes);

// Asks the kernel to back every 2 MiB page that [p, p + bytes) covers at least half of
// (up to 1 MiB past either end) with huge pages (MADV_HUGEPAGE, then MADV_COLLAPSE for
// pages already there). O_DIRECT into huge pages is faster: a read into physically
// contiguous memory is a few large segments, not one per 4 KiB page (see HugePageBuffer;
// 2.0-2.5 vs 2.9 GB/s on a virtio disk). Pages the kernel reports huge already
// (PAGEMAP_SCAN, Linux 6.7) are skipped, so repeating the call costs a syscall; without
// that report each range is advised once. Contents are unchanged; failures are ignored (it
// is only a hint).
void AdviseHugePages(void* p, size_t bytes);

// Bytes of [p, p + bytes) mapped by huge pages now, or -1 where the kernel cannot say
// (PAGEMAP_SCAN is Linux 6.7+). A check that destinations got what AdviseHugePages asked.
int64_t HugePageBytes(const void* p, size_t bytes);

class IoContext {
 public:
  // `depth`: O_DIRECT reads kept in flight per transfer (and bounce buffers in the ring).
  // `huge_page_destinations`: AdviseHugePages() on memory that direct reads land in.
  explicit IoContext(size_t chunk_bytes, int depth = 4, bool huge_page_destinations = true);
  ~IoContext();
  IoContext(const IoContext&) = delete;
  IoContext& operator=(const IoContext&) = delete;

  size_t chunk_bytes() const { return chunk_bytes_; }
  int depth() const { return depth_; }
  bool huge_page_destinations() const { return huge_page_destinations_; }
  // Bounce buffer `i` in [0, depth), chunk_bytes long, 4 KiB aligned, backed by huge pages
  // where the kernel has them; the ring is allocated on first use.
  uint8_t* bounce(int i);
  // The bounce buffers' memory cut into ring_slots() slots of ring_read_bytes() for reads
  // through the ring (see FileTier::Read): reads of at most kRingReadBytes, at least depth
  // and up to kRingBytesInFlight of them in flight, as the memory allows.
  size_t ring_read_bytes() const { return std::min<size_t>(chunk_bytes_, kRingReadBytes); }
  int ring_slots() const {
    const size_t fit = depth_ * chunk_bytes_ / ring_read_bytes();
    const size_t want = std::max<size_t>(depth_, kRingBytesInFlight / ring_read_bytes());
    return static_cast<int>(std::min(fit, want));
  }
  uint8_t* ring(int i) { return bounce(0) + i * ring_read_bytes(); }
  // The helper thread; started on first use.
  PipelineThread& helper();
  // This worker's Linux AIO context (an aio_context_t), set up on first use; 0 where the
  // kernel refuses one (no CONFIG_AIO, aio-max-nr exhausted): reads are then synchronous.
  uint64_t aio();
  // Destroys the AIO context (waiting for its queued reads) and reads synchronously from
  // then on; for a context that has stopped reporting completions.
  void DropAio();

  // Hooks installed by the engine for the request being served.
  std::function<bool()> cancelled = [] { return false; };
  std::function<void(uint64_t)> before_chunk = [](uint64_t) {};

 private:
  size_t chunk_bytes_;
  int depth_;
  bool huge_page_destinations_;
  std::unique_ptr<HugePageBuffer> bounce_;
  std::unique_ptr<PipelineThread> helper_;
  uint64_t aio_ = 0;
  bool aio_tried_ = false;
};

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_IO_CONTEXT_H_
