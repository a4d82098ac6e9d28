#include "engine.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <utility>

namespace tpusync {
namespace {

// Bounds the timeline's memory on long runs; later events are dropped.
constexpr size_t kMaxTimelineEvents = 1 << 20;

int StatIndex(int tier, Direction d) { return tier * 2 + static_cast<int>(d); }

}  // namespace

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Engine::Job {
  enum class State { kQueued, kRunning, kDone };

  Ticket ticket = kNoTicket;
  TransferRequest request;
  Tier* tier = nullptr;
  uint64_t bytes = 0;  // Its footprint, while it is active, is in the scoreboard.
  State state = State::kQueued;
  Status status;
  std::atomic<bool> cancel{false};
  bool discarded = false;  // Nobody will consume it: recycle its landing buffer at the end.
  int64_t submit_ns = 0, start_ns = 0, end_ns = 0;
};

Engine::Engine(EngineOptions options) : options_(std::move(options)) {
  for (int i = 0; i < options_.num_workers; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(i); });
  }
  if (options_.split_read_bytes > 0) {
    copy_helper_ = std::make_unique<CopyHelper>(
        options_.worker_cpus.empty() ? -1 : options_.worker_cpus[0]);
  }
}

Engine::~Engine() { Shutdown(); }

StatusOr<std::unique_ptr<Engine>> Engine::Create(EngineOptions options) {
  if (options.num_workers < 1 || options.num_workers > 64) {
    return InvalidArgument("num_workers must be in [1, 64], got " +
                           std::to_string(options.num_workers));
  }
  if (options.io_depth < 2 || options.io_depth > 64) {
    return InvalidArgument("io_depth must be in [2, 64], got " +
                           std::to_string(options.io_depth));
  }
  if (options.io_chunk_bytes < kIoAlignment || options.io_chunk_bytes > (1ull << 30)) {
    return InvalidArgument("io_chunk_bytes must be in [4096, 1 GiB], got " +
                           std::to_string(options.io_chunk_bytes));
  }
  if (options.max_bytes_per_second < 0) {
    return InvalidArgument("max_bytes_per_second must be >= 0");
  }
  int ncpu = static_cast<int>(std::thread::hardware_concurrency());
  for (int cpu : options.worker_cpus) {
    if (cpu < 0 || (ncpu > 0 && cpu >= ncpu)) {
      return InvalidArgument("worker cpu " + std::to_string(cpu) + " does not exist (this "
                             "machine has " + std::to_string(ncpu) + " cpus)");
    }
  }
  return std::make_unique<Engine>(std::move(options));
}

StatusOr<int> Engine::AddTier(std::unique_ptr<Tier> tier) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return FailedPrecondition("engine is closed");
  tiers_.push_back(std::move(tier));
  stats_.tiers.emplace_back();
  busy_count_.resize(tiers_.size() * 2, 0);
  busy_since_ns_.resize(tiers_.size() * 2, 0);
  return static_cast<int>(tiers_.size() - 1);
}

StatusOr<Tier*> Engine::GetTier(int tier) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tier < 0 || tier >= static_cast<int>(tiers_.size())) {
    return InvalidArgument("no tier " + std::to_string(tier) + " (engine has " +
                           std::to_string(tiers_.size()) + ")");
  }
  return tiers_[tier].get();
}

int Engine::num_tiers() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(tiers_.size());
}

bool Engine::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return stopping_;
}

Status Engine::ValidateLocked(const TransferRequest& request) {
  if (stopping_) return FailedPrecondition("engine is closed");
  if (!sticky_error_.ok()) return sticky_error_;
  if (request.tier < 0 || request.tier >= static_cast<int>(tiers_.size())) {
    return InvalidArgument("no tier " + std::to_string(request.tier) + " (engine has " +
                           std::to_string(tiers_.size()) + ")");
  }
  const Tier& tier = *tiers_[request.tier];
  for (size_t i = 0; i < request.segments.size(); ++i) {
    const Segment& s = request.segments[i];
    if (s.bytes > 0 && s.memory == nullptr) {
      return InvalidArgument("segment " + std::to_string(i) + " has no memory");
    }
    Status st = tier.CheckRange(s.tier_offset, s.bytes);
    if (!st.ok()) return InvalidArgument("segment " + std::to_string(i) + ": " + st.detail());
  }
  return Status::Ok();
}

Ticket Engine::NextTicketLocked() {
  // Tickets travel through XLA as int32: wrap, skipping any still outstanding.
  do {
    last_ticket_ = last_ticket_ >= INT32_MAX ? 1 : last_ticket_ + 1;
  } while (tickets_.count(last_ticket_) != 0);
  return last_ticket_;
}

StatusOr<Ticket> Engine::Submit(TransferRequest request) {
  auto job = std::make_shared<Job>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    TPUSYNC_RETURN_IF_ERROR(ValidateLocked(request));
    job->tier = tiers_[request.tier].get();
  }
  if (options_.poison_fetches && request.direction == Direction::kTierToMemory &&
      !request.landing) {
    for (const Segment& s : request.segments) std::memset(s.memory, 0xFF, s.bytes);
  }
  job->request = std::move(request);
  Footprint footprint = Measure(*job);
  job->submit_ns = MonotonicNs();

  std::lock_guard<std::mutex> lock(mu_);
  TPUSYNC_RETURN_IF_ERROR(ValidateLocked(job->request));  // Closed meanwhile?
  job->ticket = NextTicketLocked();
  if (!job->request.detached) tickets_[job->ticket] = job;
  active_.push_back(job);
  board_.AddQueued(job.get(), std::move(footprint));
  work_cv_.notify_all();
  return job->request.detached ? kNoTicket : job->ticket;
}

Footprint Engine::Measure(Job& job) {
  Footprint footprint;
  footprint.resource = job.tier;
  footprint.write = job.request.direction == Direction::kMemoryToTier;
  const uint64_t g = job.tier->hazard_granularity();
  const uint64_t phase = job.tier->hazard_phase();
  for (const Segment& s : job.request.segments) {
    job.bytes += s.bytes;
    footprint.Add(s.tier_offset, s.bytes, g, phase);
  }
  footprint.Seal();
  return footprint;
}

void Engine::BeginRunLocked(Job& job) {
  job.state = Job::State::kRunning;
  board_.Start(&job);
  job.start_ns = MonotonicNs();
  inflight_bytes_ += job.bytes;
  stats_.inflight_bytes_peak = std::max(stats_.inflight_bytes_peak, inflight_bytes_);
  const int k = StatIndex(job.request.tier, job.request.direction);
  if (busy_count_[k]++ == 0) busy_since_ns_[k] = job.start_ns;
}

void Engine::EndRunLocked(Job& job) {
  inflight_bytes_ -= job.bytes;
  const int k = StatIndex(job.request.tier, job.request.direction);
  if (--busy_count_[k] == 0) {
    DirectionStats& d = job.request.direction == Direction::kTierToMemory
                            ? stats_.tiers[job.request.tier].fetch
                            : stats_.tiers[job.request.tier].write_back;
    d.busy_ns += MonotonicNs() - busy_since_ns_[k];
  }
}

std::shared_ptr<Engine::Job> Engine::NextRunnableLocked() {
  // The earliest queued job that no earlier active job conflicts with.
  Scoreboard::Key next = board_.FirstStartable();
  if (next == nullptr) return nullptr;
  auto it = std::find_if(active_.begin(), active_.end(),
                         [next](const auto& job) { return job.get() == next; });
  if (it == active_.end()) return nullptr;  // Not reached: the board mirrors active_.
  if (options_.max_inflight_bytes > 0 && inflight_bytes_ > 0 &&
      inflight_bytes_ + (*it)->bytes > options_.max_inflight_bytes) {
    return nullptr;  // FIFO under the cap: a big request is not starved by small ones.
  }
  return *it;
}

void Engine::WorkerLoop(int index) {
  if (!options_.worker_cpus.empty()) {
    PinThisThread(options_.worker_cpus[index % options_.worker_cpus.size()]);
  }
  IoContext io(options_.io_chunk_bytes, options_.io_depth, options_.huge_page_destinations);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    std::shared_ptr<Job> job;
    work_cv_.wait(lock, [&] {
      job = NextRunnableLocked();
      if (job || !stopping_) return job != nullptr;
      // Stopping: leave once nothing is queued (write-backs still queued are served).
      return std::none_of(active_.begin(), active_.end(), [](const auto& j) {
        return j->state == Job::State::kQueued;
      });
    });
    if (!job) return;
    BeginRunLocked(*job);
    lock.unlock();
    RunJob(*job, io);
    lock.lock();
    EndRunLocked(*job);
    FinishLocked(*job, job->status);
  }
}

namespace {

// Advises huge pages over where O_DIRECT reads land, as a whole: segments are often
// contiguous pieces of one buffer, each too small to hold a 2 MiB page itself. Destinations
// filled from a bounce buffer are left alone: their pages do not change the disk's speed,
// and a collapse stalls the copies into them.
void AdviseDestinations(const Tier& tier, const std::vector<Segment>& segments) {
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  ranges.reserve(segments.size());
  for (const Segment& s : segments) {
    auto begin = reinterpret_cast<uintptr_t>(s.memory);
    if (s.bytes > 0 && tier.ReadsInPlace(s.tier_offset, s.memory)) {
      ranges.emplace_back(begin, begin + s.bytes);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 0; i < ranges.size();) {
    uintptr_t begin = ranges[i].first, end = ranges[i].second;
    for (++i; i < ranges.size() && ranges[i].first <= end; ++i) {
      end = std::max(end, ranges[i].second);
    }
    AdviseHugePages(reinterpret_cast<void*>(begin), end - begin);
  }
}

}  // namespace

void Engine::RunJob(Job& job, IoContext& io) {
  if (options_.debug_delay_us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(options_.debug_delay_us));
  }
  io.cancelled = [&job] { return job.cancel.load(std::memory_order_relaxed); };
  io.before_chunk = [this](uint64_t n) { Pace(n); };
  if (io.huge_page_destinations() && job.tier->direct_io() && !job.request.landing &&
      job.request.direction == Direction::kTierToMemory) {
    AdviseDestinations(*job.tier, job.request.segments);
  }
  job.status = RunSegments(job, job.request.segments, io);
}

Status Engine::RunSegments(Job& job, const std::vector<Segment>& segments, IoContext& io) {
  for (const Segment& s : segments) {
    if (s.bytes == 0) continue;
    Status status = job.request.direction == Direction::kTierToMemory
                        ? job.tier->Read(s.tier_offset, s.memory, s.bytes, io)
                        : job.tier->Write(s.tier_offset, s.memory, s.bytes, io);
    if (!status.ok()) return status;
  }
  return Status::Ok();
}

void Engine::FinishLocked(Job& job, Status status) {
  job.status = std::move(status);
  job.state = Job::State::kDone;
  job.end_ns = MonotonicNs();
  if (job.status.ok()) {
    DirectionStats& d = job.request.direction == Direction::kTierToMemory
                            ? stats_.tiers[job.request.tier].fetch
                            : stats_.tiers[job.request.tier].write_back;
    d.bytes += job.bytes;
    d.requests += 1;
    d.segments += job.request.segments.size();
  }
  if (options_.record_timeline && timeline_.transfers.size() < kMaxTimelineEvents) {
    timeline_.transfers.push_back({job.ticket, job.request.tier, job.request.direction,
                                   job.request.tag, job.bytes, job.submit_ns,
                                   job.start_ns ? job.start_ns : job.end_ns, job.end_ns,
                                   job.status.ok()});
  }
  if (job.request.detached && !job.status.ok() && sticky_error_.ok()) {
    sticky_error_ = Status(job.status.code(),
                           "a write-back failed, so the tier no longer holds that KV: " +
                               job.status.detail());
  }
  job.request.owned_memory.reset();
  if (job.discarded) ReleaseLandingLocked(job);
  board_.Remove(&job);
  for (auto it = active_.begin(); it != active_.end(); ++it) {
    if (it->get() == &job) {
      active_.erase(it);
      break;
    }
  }
  done_cv_.notify_all();
  work_cv_.notify_all();  // Its ranges no longer block later requests.
}

void Engine::Pace(uint64_t bytes) {
  if (options_.max_bytes_per_second <= 0) return;
  int64_t now = MonotonicNs();
  int64_t start;
  {
    std::lock_guard<std::mutex> lock(pace_mu_);
    start = std::max(now, pace_next_ns_);
    pace_next_ns_ = start + static_cast<int64_t>(bytes * 1e9 / options_.max_bytes_per_second);
  }
  if (start > now) std::this_thread::sleep_for(std::chrono::nanoseconds(start - now));
}

Status Engine::Wait(Ticket ticket, int64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return NotFound("unknown ticket " + std::to_string(ticket) +
                    " (never issued by this engine, or already waited)");
  }
  std::shared_ptr<Job> job = it->second;
  const int64_t begin = MonotonicNs();
  auto done = [&] { return job->state == Job::State::kDone; };
  if (timeout_ns < 0) {
    done_cv_.wait(lock, done);
  } else if (!done_cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns), done)) {
    return DeadlineExceeded("ticket " + std::to_string(ticket) + " still running after " +
                            std::to_string(timeout_ns / 1000000) + " ms");
  }
  tickets_.erase(ticket);
  const int64_t end = MonotonicNs();
  stats_.waits += 1;
  stats_.wait_ns += end - begin;
  if (options_.record_timeline && timeline_.waits.size() < kMaxTimelineEvents) {
    timeline_.waits.push_back({ticket, job->request.tag, begin, end, true});
  }
  return job->status;
}

Status Engine::TakeTicket(Ticket ticket, std::shared_ptr<Job>* out) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return NotFound("unknown ticket " + std::to_string(ticket) +
                    " (never issued by this engine, or already waited)");
  }
  std::shared_ptr<Job> job = it->second;
  // Consumed before the wait: from here on no Discard, new epoch or closed stream can
  // reach the job (nor recycle its landing buffer); only this caller holds it.
  tickets_.erase(it);
  const int64_t begin = MonotonicNs();
  done_cv_.wait(lock, [&] { return job->state == Job::State::kDone; });
  const int64_t end = MonotonicNs();
  stats_.waits += 1;
  stats_.wait_ns += end - begin;
  if (options_.record_timeline && timeline_.waits.size() < kMaxTimelineEvents) {
    timeline_.waits.push_back({ticket, job->request.tag, begin, end, true});
  }
  *out = job;
  return job->status;
}

StatusOr<bool> Engine::Poll(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return NotFound("unknown ticket " + std::to_string(ticket) +
                    " (never issued by this engine, or already waited)");
  }
  return it->second->state == Job::State::kDone;
}

Status Engine::Cancel(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return NotFound("unknown ticket " + std::to_string(ticket) +
                    " (never issued by this engine, or already waited)");
  }
  Job& job = *it->second;
  if (job.state == Job::State::kQueued) {
    FinishLocked(job, Cancelled("transfer cancelled before it started"));
  } else if (job.state == Job::State::kRunning) {
    job.cancel.store(true, std::memory_order_relaxed);
  }
  return Status::Ok();
}

Status Engine::WaitFor(Ticket ticket, const TransferRequest& want, bool* hit) {
  *hit = false;
  if (ticket != kNoTicket) {
    bool matches;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = tickets_.find(ticket);
      if (it == tickets_.end()) {
        return NotFound("unknown ticket " + std::to_string(ticket) +
                        " (never issued by this engine, or already waited)");
      }
      const TransferRequest& have = it->second->request;
      matches = have.tier == want.tier && have.direction == want.direction &&
                have.segments == want.segments;
    }
    Status st = Wait(ticket);
    if (matches && st.ok()) {
      *hit = true;
      std::lock_guard<std::mutex> lock(mu_);
      stats_.prefetch_hits += 1;
      return st;
    }
    // A stale or failed prefetch: its bytes are not the ones wanted; fetch them now.
  }
  TransferRequest request = want;
  request.detached = false;
  StatusOr<Ticket> t = Submit(std::move(request));
  if (!t.ok()) return t.status();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.prefetch_misses += 1;
  }
  return Wait(*t);
}

namespace {

// Landing buffers are kept for reuse up to this many bytes; a cache needs a few units'
// worth (its prefetch depth), so steady decode allocates none.
constexpr uint64_t kMaxPooledLandingBytes = 512ull << 20;

}  // namespace

std::shared_ptr<HugePageBuffer> Engine::AcquireLanding(uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Smallest pooled buffer that fits: the pool is sorted by size.
    for (auto it = free_landing_.begin(); it != free_landing_.end(); ++it) {
      if ((*it)->size() >= bytes) {
        std::shared_ptr<HugePageBuffer> buffer = std::move(*it);
        free_landing_.erase(it);
        free_landing_bytes_ -= buffer->size();
        return buffer;
      }
    }
  }
  auto buffer = std::make_shared<HugePageBuffer>(bytes);  // Outside the lock: it faults pages.
  std::lock_guard<std::mutex> lock(mu_);
  landing_bytes_ += buffer->size();
  return buffer;
}

void Engine::ReleaseLandingLocked(Job& job) {
  std::shared_ptr<HugePageBuffer> buffer = std::move(job.request.landing);
  if (!buffer) return;
  if (free_landing_bytes_ + buffer->size() > kMaxPooledLandingBytes) {
    landing_bytes_ -= buffer->size();
    return;  // Unmapped when the last reference goes.
  }
  free_landing_bytes_ += buffer->size();
  auto at = std::lower_bound(
      free_landing_.begin(), free_landing_.end(), buffer->size(),
      [](const std::shared_ptr<HugePageBuffer>& b, uint64_t size) { return b->size() < size; });
  free_landing_.insert(at, std::move(buffer));
}

StatusOr<Ticket> Engine::SubmitFetch(FetchRequest request) {
  Tier* tier;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TransferRequest probe;
    probe.tier = request.tier;
    TPUSYNC_RETURN_IF_ERROR(ValidateLocked(probe));
    tier = tiers_[request.tier].get();
  }
  // Each segment lands at the phase that lets O_DIRECT read it in place.
  std::vector<FetchSegment> segments;
  std::vector<uint64_t> at;
  uint64_t end = 0;
  for (const FetchSegment& s : request.segments) {
    if (s.bytes == 0) continue;
    const uint64_t offset = AlignUp(end, kIoAlignment) + tier->InPlacePhase(s.tier_offset);
    segments.push_back(s);
    at.push_back(offset);
    end = offset + s.bytes;
  }
  TransferRequest transfer;
  transfer.tier = request.tier;
  transfer.direction = Direction::kTierToMemory;
  transfer.tag = request.tag;
  transfer.stream = request.stream;
  // Nothing to read ahead on a memory tier, nor for a fetch of no bytes (a two-level
  // cache's unit with nothing on this tier): recorded only, never queued, so that it
  // costs no worker handoff.
  if (tier->DefersFetches() || segments.empty()) {
    transfer.fetch = std::move(segments);
    transfer.deferred = true;
    return RecordDeferred(std::move(transfer));
  }
  if (!segments.empty()) {
    transfer.landing = AcquireLanding(end);
    if (options_.poison_fetches) std::memset(transfer.landing->data(), 0xFF, end);
    for (size_t i = 0; i < segments.size(); ++i) {
      transfer.segments.push_back(
          {segments[i].tier_offset, transfer.landing->data() + at[i], segments[i].bytes});
    }
  }
  transfer.fetch = std::move(segments);
  std::shared_ptr<HugePageBuffer> landing = transfer.landing;
  StatusOr<Ticket> ticket = Submit(std::move(transfer));
  if (!ticket.ok() && landing) {
    std::lock_guard<std::mutex> lock(mu_);
    landing_bytes_ -= landing->size();  // Never pooled: dropped with its last reference.
  }
  return ticket;
}

Status Engine::CompleteFetch(Ticket ticket, const FetchRequest& want, uint8_t* dst,
                             uint64_t dst_bytes, bool* hit) {
  *hit = false;
  std::vector<FetchSegment> wanted;
  for (const FetchSegment& s : want.segments) {
    if (s.bytes == 0) continue;
    if (s.dst_offset + s.bytes > dst_bytes) {
      return InvalidArgument("segment covers bytes [" + std::to_string(s.dst_offset) + ", " +
                             std::to_string(s.dst_offset + s.bytes) + ") of a " +
                             std::to_string(dst_bytes) + "-byte buffer");
    }
    wanted.push_back(s);
  }
  if (ticket != kNoTicket) {
    std::shared_ptr<Job> job;
    Status st = TakeTicket(ticket, &job);
    if (!job) return st;  // Unknown.
    const TransferRequest& have = job->request;
    const bool matches = have.tier == want.tier && have.fetch == wanted &&
                         (have.landing != nullptr || have.deferred || wanted.empty());
    if (matches && st.ok() && have.deferred) {
      *hit = true;  // As planned: read now, straight into the operand.
      {
        std::lock_guard<std::mutex> lock(mu_);
        stats_.prefetch_hits += 1;
      }
      AdviseOperand(wanted, dst);
      return ReadInto(want, wanted, dst);
    }
    if (matches && st.ok()) {
      AdviseOperand(wanted, dst);
      CopyLanded(wanted, have.segments, dst);
      std::lock_guard<std::mutex> lock(mu_);
      ReleaseLandingLocked(*job);
      stats_.prefetch_hits += 1;
      *hit = true;
      return Status::Ok();
    }
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseLandingLocked(*job);
    // A stale or failed prefetch: its bytes are not the ones wanted; fetch them now.
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.prefetch_misses += 1;
  }
  return ReadInto(want, wanted, dst);
}

void Engine::CopyLanded(const std::vector<FetchSegment>& wanted,
                        const std::vector<Segment>& landed, uint8_t* dst) {
  // The copy runs inside the wait, after the compute it was meant to overlap: all of it is
  // the step's time. The fetch has landed, so the engine's CPU is idle and a second thread
  // takes half (measured on a 2-core VM: a 64 MiB copy 6.0 ms on one thread, 4.1 on two).
  struct Run {
    uint8_t* to;
    const uint8_t* from;
    uint64_t bytes;
  };
  const int64_t begin = MonotonicNs();
  uint64_t total = 0;
  for (const FetchSegment& w : wanted) total += w.bytes;
  std::vector<Run> here, there;
  const uint64_t half = total / 2;
  uint64_t seen = 0;
  for (size_t i = 0; i < wanted.size(); ++i) {
    Run run{dst + wanted[i].dst_offset, landed[i].memory, wanted[i].bytes};
    if (seen >= half) {
      there.push_back(run);
    } else if (seen + run.bytes <= half) {
      here.push_back(run);
    } else {  // Straddles the middle: cut in two.
      const uint64_t k = half - seen;
      here.push_back({run.to, run.from, k});
      there.push_back({run.to + k, run.from + k, run.bytes - k});
    }
    seen += run.bytes;
  }
  auto copy = [](const std::vector<Run>& runs) {
    for (const Run& r : runs) CopyToDestination(r.to, r.from, r.bytes);
  };
  const bool split = copy_helper_ && options_.split_read_bytes > 0 &&
                     total >= options_.split_read_bytes &&
                     copy_helper_->TryStart([&] { copy(there); });
  copy(here);
  if (split) {
    copy_helper_->Join();
  } else {
    copy(there);
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.split_reads += split ? 1 : 0;
  stats_.wait_copy_bytes += total;
  stats_.wait_copy_ns += MonotonicNs() - begin;
}

void Engine::AdviseOperand(const std::vector<FetchSegment>& wanted, uint8_t* dst) {
  if (!options_.huge_page_destinations || wanted.empty()) return;
  // The copy into the operand and the attention after it run faster over huge pages
  // (fewer TLB misses; measured: a 32K decode step 122-133 ms with 4 KiB pages and plain
  // memcpy, 111-114 with huge pages and streaming stores). After the first call on a
  // buffer this is a syscall.
  uint64_t lo = wanted.front().dst_offset, hi = 0;
  for (const FetchSegment& w : wanted) {
    lo = std::min(lo, w.dst_offset);
    hi = std::max(hi, w.dst_offset + w.bytes);
  }
  AdviseHugePages(dst + lo, hi - lo);
}

Status Engine::ReadInto(const FetchRequest& want, const std::vector<FetchSegment>& wanted,
                        uint8_t* dst) {
  if (wanted.empty()) return Status::Ok();  // No bytes: nothing to order, nothing to wait.
  // Through the queue, so it is ordered after earlier write-backs of the same bytes.
  TransferRequest direct;
  direct.tier = want.tier;
  direct.direction = Direction::kTierToMemory;
  direct.tag = want.tag;
  for (const FetchSegment& s : wanted) {
    direct.segments.push_back({s.tier_offset, dst + s.dst_offset, s.bytes});
  }
  bool ran = false;
  Status here = ReadHere(direct, &ran);
  if (ran || !here.ok()) return here;
  StatusOr<Ticket> t = Submit(std::move(direct));
  if (!t.ok()) return t.status();
  return Wait(*t);
}

Status Engine::ReadHere(const TransferRequest& request, bool* ran) {
  // A memory tier's read (a deferred fetch, or any miss) would otherwise be a worker's
  // copy while the calling op only waits: here it costs no handoff and no wake-up, and
  // runs on a CPU that is idle anyway. It is registered as a running job, so the
  // scoreboard orders it exactly as a queued one: it runs only if no earlier transfer
  // conflicts with it (a write-back of the same bytes still queued or running), and
  // later writes of its bytes wait for it. Pacing and the debug delay keep the queue.
  *ran = false;
  if (options_.debug_delay_us > 0 || options_.max_bytes_per_second > 0) return Status::Ok();
  auto job = std::make_shared<Job>();
  job->request = request;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TPUSYNC_RETURN_IF_ERROR(ValidateLocked(job->request));
    job->tier = tiers_[job->request.tier].get();
    if (!job->tier->DefersFetches()) return Status::Ok();
  }
  Footprint footprint = Measure(*job);
  job->submit_ns = MonotonicNs();
  {
    std::lock_guard<std::mutex> lock(mu_);
    TPUSYNC_RETURN_IF_ERROR(ValidateLocked(job->request));  // Closed meanwhile?
    if (board_.ConflictsWithAny(footprint)) return Status::Ok();  // Queue behind it.
    job->ticket = NextTicketLocked();
    active_.push_back(job);
    board_.AddRunning(job.get(), std::move(footprint));
    BeginRunLocked(*job);
  }
  *ran = true;
  IoContext io(options_.io_chunk_bytes, options_.io_depth, options_.huge_page_destinations);
  RunSplit(*job, io);
  std::lock_guard<std::mutex> lock(mu_);
  EndRunLocked(*job);
  FinishLocked(*job, job->status);
  // Recorded as the wait it replaces: the calling op spent this time on its bytes.
  const int64_t end = MonotonicNs();
  stats_.waits += 1;
  stats_.wait_ns += end - job->submit_ns;
  if (options_.record_timeline && timeline_.waits.size() < kMaxTimelineEvents) {
    timeline_.waits.push_back({job->ticket, job->request.tag, job->submit_ns, end, true});
  }
  return job->status;
}

void Engine::RunSplit(Job& job, IoContext& io) {
  if (!copy_helper_ || job.bytes < options_.split_read_bytes) return RunJob(job, io);
  // The first half of the bytes here, the second on the helper; a segment that straddles
  // the middle is cut in two. Both halves are within the job's registered ranges.
  std::vector<Segment> here, there;
  const uint64_t half = job.bytes / 2;
  uint64_t seen = 0;
  for (const Segment& s : job.request.segments) {
    if (seen >= half) {
      there.push_back(s);
    } else if (seen + s.bytes <= half) {
      here.push_back(s);
    } else {
      const uint64_t n = half - seen;
      here.push_back({s.tier_offset, s.memory, n});
      there.push_back({s.tier_offset + n, s.memory + n, s.bytes - n});
    }
    seen += s.bytes;
  }
  Status helper_status;
  IoContext helper_io(options_.io_chunk_bytes, options_.io_depth,
                      options_.huge_page_destinations);
  helper_io.cancelled = [&job] { return job.cancel.load(std::memory_order_relaxed); };
  const bool split = copy_helper_->TryStart(
      [&] { helper_status = RunSegments(job, there, helper_io); });
  if (!split) return RunJob(job, io);  // Another wait holds the helper.
  io.cancelled = [&job] { return job.cancel.load(std::memory_order_relaxed); };
  Status status = RunSegments(job, here, io);
  copy_helper_->Join();
  job.status = status.ok() ? std::move(helper_status) : std::move(status);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.split_reads += 1;
}

Status Engine::ReadInPlace(const FetchRequest& want, const InPlaceVisitor& visit) {
  auto job = std::make_shared<Job>();
  std::vector<const uint8_t*> src;
  {
    std::unique_lock<std::mutex> lock(mu_);
    job->request.tier = want.tier;
    job->request.tag = want.tag;
    job->request.direction = Direction::kTierToMemory;
    TPUSYNC_RETURN_IF_ERROR(ValidateLocked(job->request));
    job->tier = tiers_[want.tier].get();
    if (job->tier->MappedAt(0) == nullptr) {
      return FailedPrecondition("tier " + std::to_string(want.tier) + " (" +
                                job->tier->Describe() +
                                ") is not in memory: only a memory tier is read in place");
    }
    for (const FetchSegment& f : want.segments) {
      const uint8_t* at = job->tier->MappedAt(f.tier_offset);  // Not read before the check.
      src.push_back(at);
      // The job's segments name the tier bytes it holds; nothing is copied into `memory`.
      job->request.segments.push_back({f.tier_offset, const_cast<uint8_t*>(at), f.bytes});
    }
    TPUSYNC_RETURN_IF_ERROR(ValidateLocked(job->request));  // Every segment in range.
    Footprint footprint = Measure(*job);
    job->submit_ns = MonotonicNs();
    // The transfers that must end first: every earlier one that writes these bytes. (A
    // later one waits for this read, which is registered below before the lock drops.)
    // Held, not just named: a key is only unique while its job is alive.
    const std::vector<Scoreboard::Key> keys = board_.Conflicting(footprint);
    std::vector<std::shared_ptr<Job>> earlier;
    for (const auto& other : active_) {
      if (std::find(keys.begin(), keys.end(), other.get()) != keys.end()) {
        earlier.push_back(other);
      }
    }
    done_cv_.wait(lock, [&] {
      return stopping_ || std::all_of(earlier.begin(), earlier.end(), [](const auto& e) {
               return e->state == Job::State::kDone;
             });
    });
    TPUSYNC_RETURN_IF_ERROR(ValidateLocked(job->request));  // Closed, or a write-back failed.
    job->ticket = NextTicketLocked();
    active_.push_back(job);
    board_.AddRunning(job.get(), std::move(footprint));
    BeginRunLocked(*job);
  }
  if (options_.debug_delay_us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(options_.debug_delay_us));
  }
  if (options_.max_bytes_per_second > 0) Pace(job->bytes);
  Status status = visit(src, copy_helper_.get());
  std::lock_guard<std::mutex> lock(mu_);
  EndRunLocked(*job);
  FinishLocked(*job, status);
  // The wait is the time blocked on earlier writes; the visit itself is the op's compute.
  stats_.waits += 1;
  stats_.wait_ns += job->start_ns - job->submit_ns;
  stats_.in_place_reads += 1;
  if (options_.record_timeline && timeline_.waits.size() < kMaxTimelineEvents) {
    timeline_.waits.push_back({job->ticket, job->request.tag, job->submit_ns, job->start_ns, true});
  }
  return job->status;
}

Status Engine::VisitLanded(Ticket ticket, const FetchRequest& want,
                           const InPlaceVisitor& visit, bool* hit) {
  *hit = false;
  std::vector<FetchSegment> wanted;
  for (const FetchSegment& s : want.segments) {
    if (s.bytes > 0) wanted.push_back(s);
  }
  bool defers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TransferRequest probe;
    probe.tier = want.tier;
    TPUSYNC_RETURN_IF_ERROR(ValidateLocked(probe));
    defers = tiers_[want.tier]->DefersFetches();
  }
  // The job whose landing buffer is visited. Held by this call alone: its ticket is
  // consumed before anything is read, so neither Discard nor a new epoch can recycle it.
  std::shared_ptr<Job> landed;
  if (ticket != kNoTicket) {
    std::shared_ptr<Job> job;
    Status st = TakeTicket(ticket, &job);  // Returns once the fetch has ended.
    if (!job) return st;  // Unknown.
    const TransferRequest& have = job->request;
    const bool matches = st.ok() && have.tier == want.tier && have.fetch == wanted &&
                         (have.landing != nullptr || have.deferred || wanted.empty());
    if (matches && (have.deferred || wanted.empty())) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.prefetch_hits += 1;
      *hit = true;
    } else if (matches) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.prefetch_hits += 1;
      *hit = true;
      landed = std::move(job);
    } else {
      // A stale, mismatched or failed prefetch: never trusted; its buffer goes back unread.
      std::lock_guard<std::mutex> lock(mu_);
      ReleaseLandingLocked(*job);
    }
  }
  if (defers) {  // A memory tier: its bytes are read where they lie (ordered as a fetch).
    if (!*hit) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.prefetch_misses += 1;
    }
    return ReadInPlace(want, visit);
  }
  if (!landed && !*hit) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.prefetch_misses += 1;
    }
    if (!wanted.empty()) {
      // Fetched now, into a fresh landing buffer, through the queue (so ordered after
      // every earlier write-back of the same bytes). Of no stream: a new epoch must not
      // discard a fetch that this call is about to read.
      FetchRequest now = want;
      now.segments = wanted;
      now.stream = 0;
      StatusOr<Ticket> t = SubmitFetch(std::move(now));
      if (!t.ok()) return t.status();
      Status st = TakeTicket(*t, &landed);
      if (!landed) return st;
      if (!st.ok() || !landed->request.landing) {
        std::lock_guard<std::mutex> lock(mu_);
        ReleaseLandingLocked(*landed);
        return st.ok() ? Internal("a fetch of file bytes landed nowhere") : st;
      }
    }
  }
  std::vector<const uint8_t*> src;
  if (landed) {
    for (const Segment& s : landed->request.segments) src.push_back(s.memory);
  }
  if (src.size() != wanted.size()) {
    if (landed) {
      std::lock_guard<std::mutex> lock(mu_);
      ReleaseLandingLocked(*landed);
    }
    return Internal("a landed fetch has " + std::to_string(src.size()) + " segments, " +
                    std::to_string(wanted.size()) + " were asked for");
  }
  {
    // Counted as running, so that Shutdown keeps the copy helper until the visit ends.
    std::lock_guard<std::mutex> lock(mu_);
    Status open = stopping_ ? FailedPrecondition("engine is closed") : Status::Ok();
    if (!open.ok()) {
      if (landed) ReleaseLandingLocked(*landed);
      return open;
    }
    visits_ += 1;
  }
  Status status = visit(src, copy_helper_.get());
  std::lock_guard<std::mutex> lock(mu_);
  if (landed) ReleaseLandingLocked(*landed);  // Only now may another fetch land in it.
  stats_.landed_reads += 1;
  visits_ -= 1;
  done_cv_.notify_all();
  return status;
}

StatusOr<Ticket> Engine::RecordDeferred(TransferRequest request) {
  auto job = std::make_shared<Job>();
  job->request = std::move(request);
  job->state = Job::State::kDone;
  job->submit_ns = job->start_ns = job->end_ns = MonotonicNs();
  std::lock_guard<std::mutex> lock(mu_);
  TPUSYNC_RETURN_IF_ERROR(ValidateLocked(job->request));
  job->tier = tiers_[job->request.tier].get();
  for (size_t i = 0; i < job->request.fetch.size(); ++i) {  // Refused now, as a read would be.
    const FetchSegment& f = job->request.fetch[i];
    Status st = job->tier->CheckRange(f.tier_offset, f.bytes);
    if (!st.ok()) return InvalidArgument("segment " + std::to_string(i) + ": " + st.detail());
  }
  job->ticket = NextTicketLocked();
  tickets_[job->ticket] = job;
  return job->ticket;
}

void Engine::DiscardLocked(Job& job) {
  job.discarded = true;
  tickets_.erase(job.ticket);
  if (job.state == Job::State::kQueued) {
    FinishLocked(job, Cancelled("fetch discarded before it started"));
  } else if (job.state == Job::State::kRunning) {
    job.cancel.store(true, std::memory_order_relaxed);
  } else {
    ReleaseLandingLocked(job);
  }
}

void Engine::Discard(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return;
  std::shared_ptr<Job> job = it->second;  // DiscardLocked erases the map's reference.
  DiscardLocked(*job);
}

int64_t Engine::OpenStream() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = ++last_stream_;
  streams_[id] = StreamState{};
  return id;
}

StatusOr<int32_t> Engine::BeginEpoch(int64_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end()) return NotFound("no stream " + std::to_string(stream));
  StreamState& s = it->second;
  s.epoch = s.epoch >= INT32_MAX ? 1 : s.epoch + 1;
  s.claimed = 0;
  std::vector<std::shared_ptr<Job>> orphans;
  for (const auto& [ticket, job] : tickets_) {
    if (job->request.stream == stream) orphans.push_back(job);
  }
  for (const auto& job : orphans) DiscardLocked(*job);
  return s.epoch;
}

Status Engine::CheckOwner(int64_t stream, int32_t epoch, int32_t generation, bool claim) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    return FailedPrecondition("state of cache stream " + std::to_string(stream) +
                              " does not belong to this engine (or its cache was closed)");
  }
  StreamState& s = it->second;
  const bool stale_epoch = epoch != s.epoch;
  const bool taken = claim && generation != s.claimed + 1;
  if (stale_epoch || taken) {
    return FailedPrecondition(
        std::string("this KVState is stale: ") +
        (stale_epoch ? "the cache was started over (init() or drain()) after it was made"
                     : "a step from the same state (or an older one) already ran: step " +
                           std::to_string(generation) + " of this state, last step " +
                           std::to_string(s.claimed)) +
        "; pass the state the last step returned, or start over with cache.init()");
  }
  if (claim) s.claimed = generation;
  return Status::Ok();
}

void Engine::RecordGuards(int64_t stream, WriteGuards guards) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end() || guards.epoch != it->second.epoch) return;
  it->second.last_write = std::move(guards);
}

bool Engine::LastGuards(int64_t stream, WriteGuards* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end() || it->second.last_write.epoch != it->second.epoch) return false;
  *out = it->second.last_write;
  return true;
}

void Engine::CloseStream(int64_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Job>> orphans;
  for (const auto& [ticket, job] : tickets_) {
    if (job->request.stream == stream) orphans.push_back(job);
  }
  for (const auto& job : orphans) DiscardLocked(*job);
  streams_.erase(stream);
}

Status Engine::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return active_.empty(); });
  return sticky_error_;
}

void Engine::Mark(int32_t kind, TransferTag tag) {
  if (!options_.record_timeline) return;
  int64_t now = MonotonicNs();
  std::lock_guard<std::mutex> lock(mu_);
  if (timeline_.marks.size() < kMaxTimelineEvents) timeline_.marks.push_back({kind, tag, now});
}

EngineStats Engine::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats out = stats_;
  out.landing_bytes = landing_bytes_;
  const int64_t now = MonotonicNs();
  for (size_t t = 0; t < tiers_.size(); ++t) {
    for (int d = 0; d < 2; ++d) {
      if (busy_count_[t * 2 + d] == 0) continue;
      DirectionStats& s = d == 0 ? out.tiers[t].fetch : out.tiers[t].write_back;
      s.busy_ns += now - busy_since_ns_[t * 2 + d];
    }
  }
  return out;
}

void Engine::ResetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = MonotonicNs();
  stats_ = EngineStats();
  stats_.tiers.resize(tiers_.size());
  for (int64_t& since : busy_since_ns_) since = now;
}

Timeline Engine::TakeTimeline() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(timeline_, Timeline());
}

void Engine::Shutdown() {
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    // Queued fetches are dropped; queued write-backs still run (they carry KV).
    std::vector<std::shared_ptr<Job>> queued;
    for (const auto& job : active_) {
      if (job->state == Job::State::kQueued &&
          job->request.direction == Direction::kTierToMemory) {
        queued.push_back(job);
      }
    }
    for (const auto& job : queued) {
      FinishLocked(*job, Cancelled("engine closed before the transfer started"));
    }
    workers.swap(workers_);
  }
  work_cv_.notify_all();
  done_cv_.notify_all();
  for (std::thread& w : workers) w.join();
  // Reads running on their callers' threads (ReadHere, ReadInPlace) and visits of landed
  // fetches (VisitLanded) end before the engine is closed.
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] {
    return visits_ == 0 &&
           std::none_of(active_.begin(), active_.end(),
                        [](const auto& job) { return job->state == Job::State::kRunning; });
  });
  lock.unlock();
  copy_helper_.reset();  // No read runs any more that could hand it a share.
}

}  // namespace tpusync
