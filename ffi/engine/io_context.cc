#include "io_context.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace tpusync {

AlignedBuffer::AlignedBuffer(size_t bytes) : size_(bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kIoAlignment, AlignUp(bytes ? bytes : 1, kIoAlignment)) != 0) {
    throw std::bad_alloc();
  }
  data_ = static_cast<uint8_t*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

PipelineThread::PipelineThread() : thread_([this] { Loop(); }) {}

PipelineThread::~PipelineThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void PipelineThread::Start(std::function<Status()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
    has_job_ = true;
    done_ = false;
  }
  cv_.notify_all();
}

Status PipelineThread::Join() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  return std::exchange(result_, Status::Ok());
}

void PipelineThread::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return has_job_ || stop_; });
    if (stop_ && !has_job_) return;
    std::function<Status()> job = std::move(job_);
    has_job_ = false;
    lock.unlock();
    Status status = job();
    lock.lock();
    result_ = std::move(status);
    done_ = true;
    cv_.notify_all();
  }
}

uint8_t* IoContext::bounce(int i) {
  if (bounce_[i].data() == nullptr) {
    bounce_[i] = AlignedBuffer(chunk_bytes_);
    // Fault the pages in now rather than inside the first O_DIRECT reads.
    std::memset(bounce_[i].data(), 0, chunk_bytes_);
  }
  return bounce_[i].data();
}

PipelineThread& IoContext::helper() {
  if (!helper_) helper_ = std::make_unique<PipelineThread>();
  return *helper_;
}

}  // namespace tpusync
