// Per-worker I/O scratch: aligned bounce buffers and one helper thread, so a tier can keep
// the device busy (read chunk i+1) while the worker copies chunk i out.
#ifndef TPUSYNC_ENGINE_IO_CONTEXT_H_
#define TPUSYNC_ENGINE_IO_CONTEXT_H_

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

class IoContext {
 public:
  explicit IoContext(size_t chunk_bytes) : chunk_bytes_(AlignUp(chunk_bytes, kIoAlignment)) {}

  size_t chunk_bytes() const { return chunk_bytes_; }
  // Bounce buffer `i` (0 or 1), chunk_bytes long and 4 KiB aligned; allocated on first use.
  uint8_t* bounce(int i);
  // The helper thread; started on first use.
  PipelineThread& helper();

  // Hooks installed by the engine for the request being served.
  std::function<bool()> cancelled = [] { return false; };
  std::function<void(uint64_t)> before_chunk = [](uint64_t) {};

 private:
  size_t chunk_bytes_;
  AlignedBuffer bounce_[2];
  std::unique_ptr<PipelineThread> helper_;
};

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_IO_CONTEXT_H_
