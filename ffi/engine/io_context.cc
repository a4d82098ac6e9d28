#include "io_context.h"

#include <fcntl.h>
#include <linux/aio_abi.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

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

namespace {
constexpr size_t kHugePage = 2 << 20;
}  // namespace

HugePageBuffer::HugePageBuffer(size_t bytes) : size_(AlignUp(bytes ? bytes : 1, kHugePage)) {
  // Over-map by one huge page and trim, so the kept range starts on a 2 MiB boundary.
  const size_t span = size_ + kHugePage;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto* base = static_cast<uint8_t*>(p);
  uint8_t* aligned = reinterpret_cast<uint8_t*>(AlignUp(reinterpret_cast<uintptr_t>(base), kHugePage));
  if (aligned > base) munmap(base, aligned - base);
  if (uint8_t* end = aligned + size_; end < base + span) munmap(end, base + span - end);
  data_ = aligned;
#ifdef MADV_HUGEPAGE
  madvise(data_, size_, MADV_HUGEPAGE);  // A hint: without THP this is plain memory.
#endif
  // Fault the pages in now rather than inside the first O_DIRECT reads.
  std::memset(data_, 0, size_);
}

HugePageBuffer::~HugePageBuffer() {
  if (data_ != nullptr) munmap(data_, size_);
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

namespace {

constexpr size_t kNonTemporalMinBytes = 256 << 10;

#if defined(__x86_64__)
__attribute__((target("avx2"))) void CopyNonTemporalAvx2(uint8_t* dst, const uint8_t* src,
                                                         size_t bytes) {
  // Head up to a 32-byte boundary of dst; streaming stores need aligned addresses.
  size_t head = (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  std::memcpy(dst + i, src + i, bytes - i);
  _mm_sfence();  // Streaming stores are weakly ordered: publish them before completion.
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

}  // namespace

void CopyToDestination(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  if (bytes >= kNonTemporalMinBytes && HasAvx2()) {
    CopyNonTemporalAvx2(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

namespace {

#if defined(MADV_HUGEPAGE)
// The kernel's PAGEMAP_SCAN ioctl (Linux 6.7; older headers lack it): which pages of a range
// are mapped as huge pages, for one unprivileged ioctl on /proc/self/pagemap.
struct PageRegion {
  uint64_t start, end, categories;
};
struct PagemapScanArg {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted,
      category_mask, category_anyof_mask, return_mask;
};
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PagemapScanArg);
constexpr uint64_t kPageIsHuge = 1 << 6;
constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE (Linux 6.1); older kernels: EINVAL.
// Collapse attempts per 2 MiB address at most: a buffer freed and mapped again there is
// collapsed again, but a caller that maps a fresh destination for every read, or a page
// that keeps failing, would otherwise cost a synchronous collapse (~2 ms) on every read.
constexpr int kMaxCollapsesPerPage = 8;

// The 2 MiB pages of [begin, end) (both 2 MiB-aligned) that are mapped huge now, as a bit per
// page; false when the kernel cannot say.
bool HugePagesIn(uintptr_t begin, uintptr_t end, std::vector<bool>& huge) {
  // Opened once per process: a forked child must not read its parent's page tables.
  static std::mutex mu;
  static int fd = -1;
  static pid_t owner = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (owner != getpid()) {
      if (fd >= 0) close(fd);
      fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
      owner = getpid();
    }
  }
  if (fd < 0) return false;
  const size_t pages = (end - begin) / kHugePage;
  std::vector<PageRegion> regions(pages);
  PagemapScanArg arg{};
  arg.size = sizeof(arg);
  arg.start = begin;
  arg.end = end;
  arg.vec = reinterpret_cast<uint64_t>(regions.data());
  arg.vec_len = regions.size();
  arg.category_mask = kPageIsHuge;  // Only huge pages are reported...
  arg.return_mask = kPageIsHuge;
  const long n = ioctl(fd, kPagemapScan, &arg);
  if (n < 0) return false;
  huge.assign(pages, false);
  for (long i = 0; i < n; ++i) {  // ...as runs, each a whole number of 2 MiB pages here.
    for (uint64_t a = AlignUp(regions[i].start, kHugePage); a + kHugePage <= regions[i].end;
         a += kHugePage) {
      huge[(a - begin) / kHugePage] = true;
    }
  }
  return arg.walk_end >= end;  // A full vec ends the walk early: unknown past it.
}
#endif

}  // namespace

void AdviseHugePages(void* p, size_t bytes) {
#if defined(MADV_HUGEPAGE)
  // Every 2 MiB page at least half covered: a buffer split into slots that do not start on
  // 2 MiB boundaries then has its straddling pages advised by one slot or the other.
  const auto first = reinterpret_cast<uintptr_t>(p);
  const uintptr_t begin = AlignDown(first + kHugePage / 2 - 1, kHugePage);
  const uintptr_t end = AlignDown(first + bytes + kHugePage / 2, kHugePage);
  if (end <= begin) return;
  // Where the kernel says which pages are huge, only the others are collapsed, so a buffer
  // mapped at an address an earlier one held gets huge pages too (kMaxCollapsesPerPage
  // attempts per address). Elsewhere each address is advised once: a buffer mapped again
  // there keeps small pages (speed, never correctness).
  std::vector<bool> huge;
  const bool known = HugePagesIn(begin, end, huge);
  static std::mutex mu;
  static std::unordered_map<uintptr_t, int> collapses;
  for (uintptr_t a = begin; a < end; a += kHugePage) {
    if (known && huge[(a - begin) / kHugePage]) continue;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (collapses.size() > (1u << 16)) collapses.clear();
      int& attempts = collapses[a];
      if (attempts >= (known ? kMaxCollapsesPerPage : 1)) continue;
      ++attempts;
    }
    madvise(reinterpret_cast<void*>(a), kHugePage, MADV_HUGEPAGE);
    // May fail (EAGAIN) while another transfer writes into the page; a failure can cost as
    // much as a success (the copy is made first), hence the cap on attempts, not successes.
    madvise(reinterpret_cast<void*>(a), kHugePage, kMadvCollapse);
  }
#else
  (void)p;
  (void)bytes;
#endif
}

int64_t HugePageBytes(const void* p, size_t bytes) {
#if defined(MADV_HUGEPAGE)
  const auto first = reinterpret_cast<uintptr_t>(p);
  const uintptr_t begin = AlignDown(first, kHugePage);
  const uintptr_t end = AlignUp(first + bytes, kHugePage);
  if (bytes == 0) return 0;
  std::vector<bool> huge;
  if (!HugePagesIn(begin, end, huge)) return -1;
  int64_t total = 0;
  for (size_t i = 0; i < huge.size(); ++i) {
    if (!huge[i]) continue;
    const uintptr_t lo = std::max(begin + i * kHugePage, first);
    const uintptr_t hi = std::min(begin + (i + 1) * kHugePage, first + bytes);
    total += static_cast<int64_t>(hi - lo);
  }
  return total;
#else
  (void)p;
  (void)bytes;
  return -1;
#endif
}

IoContext::IoContext(size_t chunk_bytes, int depth, bool huge_page_destinations)
    : chunk_bytes_(AlignUp(chunk_bytes, kIoAlignment)),
      depth_(depth < 2 ? 2 : depth),
      huge_page_destinations_(huge_page_destinations) {}

IoContext::~IoContext() { DropAio(); }

uint8_t* IoContext::bounce(int i) {
  if (!bounce_) bounce_ = std::make_unique<HugePageBuffer>(depth_ * chunk_bytes_);
  return bounce_->data() + i * chunk_bytes_;
}

uint64_t IoContext::aio() {
  if (!aio_tried_) {
    aio_tried_ = true;
    aio_context_t ctx = 0;
    if (syscall(SYS_io_setup, std::max(depth_, ring_slots()), &ctx) == 0) aio_ = ctx;
  }
  return aio_;
}

void IoContext::DropAio() {
  if (aio_ != 0) syscall(SYS_io_destroy, static_cast<aio_context_t>(aio_));
  aio_ = 0;
  aio_tried_ = true;
}

PipelineThread& IoContext::helper() {
  if (!helper_) helper_ = std::make_unique<PipelineThread>();
  return *helper_;
}

}  // namespace tpusync
