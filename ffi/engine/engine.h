// The async transfer engine: a queue of batched transfer requests served by worker
// threads, with tickets, hazard ordering, throttling, stats and an optional timeline.
//
// Ordering contract: requests that touch overlapping tier bytes, at least one of them a
// write, run in submission order. So a read submitted after a write-back of the same bytes
// always sees the new data, and a write-back never clobbers bytes a queued read still needs.
#ifndef TPUSYNC_ENGINE_ENGINE_H_
#define TPUSYNC_ENGINE_ENGINE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "copy_helper.h"
#include "io_context.h"
#include "scoreboard.h"
#include "status.h"
#include "tier.h"

namespace tpusync {

using Ticket = int64_t;
inline constexpr Ticket kNoTicket = -1;

enum class Direction : uint8_t {
  kTierToMemory = 0,  // A fetch (read from the tier).
  kMemoryToTier = 1,  // A write-back.
};

struct Segment {
  uint64_t tier_offset = 0;
  uint8_t* memory = nullptr;
  uint64_t bytes = 0;

  bool operator==(const Segment& o) const {
    return tier_offset == o.tier_offset && memory == o.memory && bytes == o.bytes;
  }
};

// What a transfer is for, as recorded in the timeline. -1: not given.
struct TransferTag {
  int32_t layer = -1;
  int32_t chunk = -1;
};

// One piece of a fetch into a buffer the engine may only write while its consumer's wait
// runs (an XLA operand): `bytes` of tier bytes at `tier_offset`, for bytes
// [dst_offset, dst_offset + bytes) of that buffer.
struct FetchSegment {
  uint64_t tier_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;

  bool operator==(const FetchSegment& o) const {
    return tier_offset == o.tier_offset && dst_offset == o.dst_offset && bytes == o.bytes;
  }
};

// A fetch named by offsets, not addresses (see Engine::SubmitFetch).
struct FetchRequest {
  int tier = 0;
  std::vector<FetchSegment> segments;  // Zero-byte segments are dropped.
  TransferTag tag;
  int64_t stream = 0;  // The stream (one cache's state) it serves; 0: none.
};

struct TransferRequest {
  int tier = 0;
  Direction direction = Direction::kTierToMemory;
  std::vector<Segment> segments;
  TransferTag tag;
  // Memory the engine must keep alive until the transfer ends (a write-back's copy of
  // data whose original buffer the caller may reuse as soon as Submit returns).
  std::shared_ptr<AlignedBuffer> owned_memory;
  // Nobody will wait: completion frees the ticket, and a failure becomes the engine's
  // sticky error (returned by every later call), so lost KV can never go unnoticed.
  bool detached = false;
  // Set by SubmitFetch: the engine-owned buffer the fetch lands in, the offsets it was
  // asked for, and the stream it serves.
  std::shared_ptr<HugePageBuffer> landing;
  std::vector<FetchSegment> fetch;
  int64_t stream = 0;
  bool deferred = false;  // Recorded only; CompleteFetch reads it (DefersFetches()).
};

struct EngineOptions {
  int num_workers = 2;
  uint64_t io_chunk_bytes = 1 << 20;
  // O_DIRECT reads each worker keeps queued on the device (and its bounce ring size).
  int io_depth = 4;
  // Back the memory that direct reads land in with huge pages (see AdviseHugePages).
  bool huge_page_destinations = true;
  // Requests are admitted while the bytes of running requests stay under this cap (a
  // request larger than the cap runs alone). 0: no cap.
  uint64_t max_inflight_bytes = 0;
  // Paces every tier access to this rate. 0: unpaced.
  double max_bytes_per_second = 0;
  // Worker i is pinned to worker_cpus[i % size]. Empty: no pinning.
  std::vector<int> worker_cpus;
  // A memory tier's read at a wait of at least this many bytes, and a landed fetch's copy
  // into the waiting op's operand, are split between the calling thread and a copy helper
  // thread (pinned to worker_cpus[0] if set). 0: never.
  uint64_t split_read_bytes = 1ull << 20;
  // Debug: fill fetch destinations with 0xFF (NaN in f32 and bf16) at submission, so any
  // read of a buffer before its wait sees NaN rather than plausible stale data.
  bool poison_fetches = false;
  // Debug: every transfer sleeps this long before it starts.
  uint32_t debug_delay_us = 0;
  bool record_timeline = false;
};

struct DirectionStats {
  uint64_t bytes = 0;
  uint64_t requests = 0;
  uint64_t segments = 0;  // Contiguous tier ranges of those requests (after merging rows).
  int64_t busy_ns = 0;  // Wall time with at least one request of this kind running.
};

struct TierStats {
  DirectionStats fetch;
  DirectionStats write_back;
};

struct EngineStats {
  std::vector<TierStats> tiers;
  uint64_t waits = 0;
  uint64_t prefetch_hits = 0;    // Waits whose transfer had been started ahead.
  uint64_t prefetch_misses = 0;  // Waits that had to fetch (cold, or a stale prefetch).
  int64_t wait_ns = 0;           // Time callers spent blocked in waits.
  uint64_t split_reads = 0;      // Wait-time copies made half by the copy helper.
  uint64_t in_place_reads = 0;   // Memory-tier reads consumed where they lie (ReadInPlace).
  uint64_t landed_reads = 0;     // Fetches consumed where they landed (VisitLanded).
  // Landed fetches copied into their wait's operand: bytes and the time the wait spent.
  uint64_t wait_copy_bytes = 0;
  int64_t wait_copy_ns = 0;
  uint64_t inflight_bytes_peak = 0;
  uint64_t landing_bytes = 0;  // Engine-owned landing memory, in use or pooled.
};

struct TransferEvent {
  Ticket ticket;
  int tier;
  Direction direction;
  TransferTag tag;
  uint64_t bytes;
  int64_t submit_ns, start_ns, end_ns;
  bool ok;
};

struct WaitEvent {
  Ticket ticket;
  TransferTag tag;
  int64_t begin_ns, end_ns;
  bool prefetch_hit;
};

struct MarkEvent {
  int32_t kind;
  TransferTag tag;
  int64_t ns;
};

struct Timeline {
  std::vector<TransferEvent> transfers;
  std::vector<WaitEvent> waits;
  std::vector<MarkEvent> marks;
};

// CLOCK_MONOTONIC in ns: the same clock as Python's time.monotonic_ns().
int64_t MonotonicNs();

class Engine {
 public:
  explicit Engine(EngineOptions options);
  ~Engine();  // Shutdown().
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  static StatusOr<std::unique_ptr<Engine>> Create(EngineOptions options);

  const EngineOptions& options() const { return options_; }

  StatusOr<int> AddTier(std::unique_ptr<Tier> tier);
  StatusOr<Tier*> GetTier(int tier);
  int num_tiers();

  // Validates and queues a request; returns its ticket (kNoTicket when detached).
  StatusOr<Ticket> Submit(TransferRequest request);
  // Blocks until the ticket's transfer ends and consumes the ticket (exactly once).
  // timeout_ns < 0: no timeout.
  Status Wait(Ticket ticket, int64_t timeout_ns = -1);
  // True once the transfer has ended (the ticket stays valid for Wait).
  StatusOr<bool> Poll(Ticket ticket);
  // A queued transfer is dropped; a running one stops at its next chunk. Wait still
  // consumes the ticket and reports kCancelled.
  Status Cancel(Ticket ticket);
  // The consumer side of a prefetch: if `ticket` fetched exactly `want`, waits for it
  // (a hit); otherwise retires it and fetches `want` now (a miss). Never serves bytes
  // other than the ones asked for.
  Status WaitFor(Ticket ticket, const TransferRequest& want, bool* hit);

  // Prefetch into engine-owned memory. XLA owns the buffers of a compiled step and may
  // copy, free or reuse one between two ops, so nothing is ever written into an operand
  // outside the op that holds it: the fetch lands in a landing buffer of the engine, and
  // CompleteFetch, called by the consuming op, copies it into that op's buffer. A copy
  // of an in-flight buffer, a dropped state or an interrupted program therefore cannot
  // receive a late write. On a tier that DefersFetches() (memory) nothing is read ahead:
  // the ticket records the request and CompleteFetch reads it straight into the operand.
  // Returns the ticket.
  StatusOr<Ticket> SubmitFetch(FetchRequest request);
  // Fills `dst` (`dst_bytes`) with `want`: from `ticket`'s landing buffer if it fetched
  // exactly `want` (a hit), else (no ticket, a different fetch, a failed one) by reading
  // the tier into `dst` now (a miss; `dst` must stay valid until this returns, as it does
  // inside an op). Consumes the ticket either way.
  Status CompleteFetch(Ticket ticket, const FetchRequest& want, uint8_t* dst,
                       uint64_t dst_bytes, bool* hit);
  // Forgets a fetch nobody will consume (a slot's previous, unwaited prefetch): a queued
  // one is dropped, a running one stops at its next chunk, and its landing buffer is
  // recycled when it ends. Unknown tickets are ignored. Never blocks.
  void Discard(Ticket ticket);

  // A memory tier's read that copies nothing: hands `visit` the tier's own memory of each
  // of `want`'s segments (src[i] for segment i) while those bytes are registered as a
  // running read, so the visit starts only after every earlier transfer that writes them
  // has ended (a failed one fails this call), and later writes of them wait for it.
  // `helper`, null when the engine has none, may run a share of the visit's work. Counted
  // as a fetch of those bytes and as a wait.
  using InPlaceVisitor =
      std::function<Status(const std::vector<const uint8_t*>& src, CopyHelper* helper)>;
  Status ReadInPlace(const FetchRequest& want, const InPlaceVisitor& visit);
  // The consumer side of a prefetch that is read where it landed, with no copy into an
  // operand: waits for `ticket`'s fetch and, if it fetched exactly `want` (tier bytes and
  // offsets, as CompleteFetch compares them), hands `visit` its landing memory (src[i] for
  // want's segment i, zero-byte segments dropped) and holds that buffer until `visit`
  // returns: it is not pooled, freed or handed to another fetch meanwhile (the ticket is
  // consumed first, so no Discard or new epoch can reach it). Otherwise (no ticket, a
  // different fetch, a failed one) the prefetch's buffer is recycled unread and `want` is
  // fetched now into a fresh landing buffer, waited for and visited (a miss). Nothing is
  // visited before its fetch has ended. On a tier that DefersFetches() (memory) the bytes
  // are visited where the tier holds them (ReadInPlace). Consumes the ticket either way.
  Status VisitLanded(Ticket ticket, const FetchRequest& want, const InPlaceVisitor& visit,
                     bool* hit);

  // Streams: one per cache, so that only the newest state of a cache may drive it. Ops
  // carry (stream, epoch, generation): the epoch changes when the host starts the cache
  // over (init(), drain()), and the generation counts the steps of one state's chain.
  // The first op of a step *claims* its generation, which must be the successor of the
  // last claimed one: a second step from the same parent state claims a generation that
  // is taken and is refused before it moves a byte, and so is any op of an older epoch.
  // (Other ops of a step need no generation check: they all depend on the claiming op.)
  int64_t OpenStream();
  // Starts a new epoch of `stream` and returns it; the stream's unconsumed fetches are
  // discarded (a dropped state's prefetches). The epoch's first step claims generation 1.
  StatusOr<int32_t> BeginEpoch(int64_t stream);
  Status CheckOwner(int64_t stream, int32_t epoch, int32_t generation, bool claim);
  void CloseStream(int64_t stream);

  // The capacity guards (one (length, count) per slot) of a stream's latest write-back
  // whose owner passed, and whether it was accepted: a host that lost a state to a failed
  // step (its buffers donated) rebuilds the state's lengths from it.
  struct WriteGuards {
    int32_t epoch = 0;
    int32_t generation = 0;
    int32_t layer = -1;
    bool accepted = false;
    std::vector<int32_t> lengths;
    std::vector<int32_t> counts;
  };
  void RecordGuards(int64_t stream, WriteGuards guards);
  // False if the stream's current epoch has no write-back yet.
  bool LastGuards(int64_t stream, WriteGuards* out);

  // Blocks until every submitted transfer has ended (detached write-backs included).
  Status Drain();

  void Mark(int32_t kind, TransferTag tag);
  EngineStats Stats();
  void ResetStats();
  Timeline TakeTimeline();

  // Cancels queued fetches, lets write-backs and running transfers finish, joins workers.
  // Waiters wake; later calls fail with kFailedPrecondition. Idempotent.
  void Shutdown();
  bool closed();

 private:
  struct Job;

  Status ValidateLocked(const TransferRequest& request);
  std::shared_ptr<Job> NextRunnableLocked();
  void WorkerLoop(int index);
  void RunJob(Job& job, IoContext& io);
  // Reads or writes (as `job` does) `segments`, a subset of `job`'s; stops at the first error.
  Status RunSegments(Job& job, const std::vector<Segment>& segments, IoContext& io);
  void FinishLocked(Job& job, Status status);
  // Sets `job`'s bytes; returns its footprint (tier, direction and byte ranges widened to
  // the tier's hazard pages) as the scoreboard compares it.
  static Footprint Measure(Job& job);
  // Bookkeeping of a job that starts / stops running (in-flight bytes, busy time).
  void BeginRunLocked(Job& job);
  void EndRunLocked(Job& job);
  // Runs `request` (a read of a memory tier) on the calling thread if no earlier transfer
  // conflicts with it; *ran says whether it did (else nothing happened).
  Status ReadHere(const TransferRequest& request, bool* ran);
  // RunJob of a memory tier's read, its bytes split with the copy helper when it is free.
  void RunSplit(Job& job, IoContext& io);
  void Pace(uint64_t bytes);
  Ticket NextTicketLocked();
  // Consumes `ticket` (atomically with its lookup, so that no Discard or new epoch can
  // reach its job afterwards), waits for its transfer to end, and hands back the job and
  // its status (*out stays null for an unknown ticket). Counted as a wait.
  Status TakeTicket(Ticket ticket, std::shared_ptr<Job>* out);
  std::shared_ptr<HugePageBuffer> AcquireLanding(uint64_t bytes);
  void ReleaseLandingLocked(Job& job);
  void DiscardLocked(Job& job);
  void AdviseOperand(const std::vector<FetchSegment>& wanted, uint8_t* dst);
  // Copies a landed fetch's segments into the operand, half on the copy helper when free.
  void CopyLanded(const std::vector<FetchSegment>& wanted, const std::vector<Segment>& landed,
                  uint8_t* dst);
  Status ReadInto(const FetchRequest& want, const std::vector<FetchSegment>& wanted,
                  uint8_t* dst);
  StatusOr<Ticket> RecordDeferred(TransferRequest request);

  struct StreamState {
    int32_t epoch = 0;
    int32_t claimed = 0;  // The generation of this epoch's latest step.
    WriteGuards last_write;  // epoch 0: none yet.
  };

  EngineOptions options_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<std::unique_ptr<Tier>> tiers_;
  std::deque<std::shared_ptr<Job>> active_;  // Queued and running jobs, in submission order.
  Scoreboard board_;  // The footprints of active_'s jobs: which may run (see scoreboard.h).
  std::unordered_map<Ticket, std::shared_ptr<Job>> tickets_;  // Not yet consumed.
  Ticket last_ticket_ = 0;
  uint64_t inflight_bytes_ = 0;
  bool stopping_ = false;
  Status sticky_error_;
  EngineStats stats_;
  std::vector<int> busy_count_;        // [tier * 2 + direction]
  std::vector<int64_t> busy_since_ns_;  // [tier * 2 + direction]
  Timeline timeline_;
  std::unordered_map<int64_t, StreamState> streams_;
  int64_t last_stream_ = 0;
  std::vector<std::shared_ptr<HugePageBuffer>> free_landing_;  // Pooled, smallest first.
  uint64_t free_landing_bytes_ = 0;
  uint64_t landing_bytes_ = 0;
  int visits_ = 0;  // VisitLanded calls visiting landing memory now.
  std::mutex pace_mu_;
  int64_t pace_next_ns_ = 0;
  std::vector<std::thread> workers_;
  std::unique_ptr<CopyHelper> copy_helper_;  // Null when split_read_bytes is 0.
};

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_ENGINE_H_
