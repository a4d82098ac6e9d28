// XLA FFI handlers (platform "CUDA") for the in-graph transfer ops, with the same operands,
// results and attributes as the CPU handlers in ffi/xla/cpu_ops.cc:
//   start(passthrough, segments, tag, retire, owner, target, *deps) -> (passthrough, ticket)
//   wait(dst, ticket, segments, tag, owner, target, *deps) -> dst
//   write_back(src, segments, tag, owner, target, *deps) -> token
//   mark(x, tag, *deps) -> x
//
// The guarantee is the CPU handlers' one: no transfer writes an XLA buffer outside the op
// that holds it. XLA may copy, free or reuse a buffer between two ops (and a state may be
// dropped with fetches in flight), so a start fetches into engine-owned host memory and only
// the matching wait moves bytes into its own dst, while the compute stream is held at it.
//
// The problem. On a GPU every operand is device memory, and the segment rows, tag, ticket,
// retire and owner are usually computed inside the graph (page tables, positions, the
// state). The host thread that runs a handler only *enqueues* work; when it calls
// tpusync_start the rows may not exist yet. Reading them on the host would need a stream
// sync (blocking the host until the GPU catches up), and a cudaMemcpyAsync per segment
// cannot be enqueued before its addresses are known. Plain "record an event at the op,
// cudaStreamWaitEvent later" does not work either: when the wait handler runs, the copy it
// must wait for has not been enqueued yet, and waiting on an event that was never recorded
// is a no-op.
//
// The design: one agent thread and one private DMA stream per device, fed in program order.
//   * Every op copies its small descriptor (rows, tag, ticket/retire, owner) device ->
//     pinned host on the compute stream and records a `ready` event right after it. The
//     copy runs exactly where XLA placed the op, so the rows are final and their buffer
//     cannot have been reused yet. The host does not wait for anything.
//   * The agent takes items in order and waits (itself) on each `ready` event. It then
//     checks the owner (Engine::CheckOwner: an op of a superseded state moves no byte; the
//     step's first op claims its generation, in program order) and decodes the rows.
//     - start: Engine::SubmitFetch reads the tier into the engine's landing memory (engine
//       worker threads, ordering, throttle and stats) and the agent moves on at once. No
//       device memory is touched; the CUDA ticket is mapped to the engine's.
//     - wait: Engine::CompleteFetch copies the landed bytes (a hit) or reads the tier (a
//       miss) into a pinned host mirror of dst, then the wanted segments are copied H2D
//       from the mirror into dst on the DMA stream.
//     - write_back: D2H on the DMA stream into pinned staging, then engine writes from
//       staging to the tier.
//   * Completion travels back to the GPU through a 32-bit sequence counter in device memory:
//     the agent enqueues cuStreamWriteValue32(counter, seq) on the DMA stream after the
//     item's copies, and an op that must not complete before the item (wait, write-back)
//     enqueues cuStreamWaitValue32(counter >= seq) on the compute stream at handler time.
//     This is the stream-side equivalent of cudaStreamWaitEvent for work that is enqueued
//     later than the wait itself; no event has to exist when the wait is enqueued. So a
//     wait's H2D runs after the compute stream reached the wait (its `ready` event) and
//     before it moves past it: while the wait holds dst, never earlier.
//   * tpusync_start does not stall the compute stream at all: compute placed between start
//     and wait overlaps the tier read. tpusync_wait stalls the compute stream (never the
//     host) until dst holds the rows. write_back stalls it until the source bytes are in
//     pinned staging (XLA may reuse `src` as soon as the op completes), not until the tier
//     write ends: the engine orders later fetches of those bytes after it.
//
// Semantics kept from the CPU handlers: tickets are assigned by the host at start time and
// written to the int32 ticket result; the engine decides hit or miss (CompleteFetch): a wait
// whose ticket fetched exactly the wanted tier bytes and offsets copies them, anything else
// (stale, mismatched, -1, retired, another engine's) is read by the wait itself, so a
// prefetch can never serve stale KV. `retire` discards the retired fetch in the engine.
// Region and bounds checks run in the agent (the rows are not known earlier); a start's
// offsets are checked against its dst_bytes attribute, a wait's against its dst.
//
// Errors. A failure found by the agent cannot fail the XLA execution that already ran
// past it. Instead: a wait's whole dst is filled with 0xFF (NaN in f32/bf16; a start has no
// buffer to fill), the counter is released anyway (the GPU never hangs on a failed
// transfer), and the error becomes sticky: every later tpusync op on that device fails with
// it, and AsyncError() reports it. That includes a refused owner: where the CPU fails only
// the call that passed a superseded state, on a GPU that device's ops stay failed.
//
// Tradeoffs (measured by examples/gpu_check.sh, not assumed):
//   * The H2D happens at the wait, on the critical path: even on a hit the compute stream
//     stalls for the landing -> mirror memcpy and the H2D of the wanted bytes; only the tier
//     read overlaps compute. This is the price of the guarantee: dst is ours only while the
//     wait holds it, and DMA between start and wait raced with XLA's copies of the buffer
//     and wrote into freed memory when a state was dropped. Restoring the overlap would need
//     device memory the context owns across start..wait (H2D at the start into it, a D2D
//     into dst at the wait).
//   * Two host copies per hit (tier -> landing in the engine, landing -> pinned mirror).
//     DMA straight from the landing buffer would save the second one, but needs them
//     registered with cudaHostRegister and kept alive by the engine until the H2D ran.
//   * The mirror is pinned, as large as the largest wait's dst, grown lazily and never
//     shrunk (offsets in it are dst offsets, so CompleteFetch needs no translation).
//   * Items are served one at a time per device and a wait blocks the agent until its fetch
//     landed, so a start behind it is submitted only then (its read still overlaps the
//     compute that follows it).
//   * Each wait costs one agent round trip (event wake-up + stream write) even on a hit.
//   * Marks (only when the engine records a timeline) run a host function on the compute
//     stream, which stalls it for the callback's latency.
//
// memory_kind="pinned_host" operands: these handlers assume every operand is device
// memory and never rely on host-resident operands (the descriptor is always copied out on
// the stream, which works for either). Whether XLA hands a CUDA custom call a host pointer
// for a pinned_host operand, inserts a copy, or rejects the program is not assumed; the
// `tpusync_pointer_kind` probe answers it on a real GPU (tests/cuda, examples/gpu_check.sh).
// If it is a host pointer, descriptors could be read without the D2H staging copy.
//
// The handlers do not declare the command-buffer trait: they must run on the host at every
// execution, so XLA must never capture them into a CUDA graph.
//
// Host-only C++ against the CUDA runtime (linked statically: no libcudart.so needed, and
// libcuda.so.1 is only loaded by the first CUDA call). Driver stream memory operations are
// fetched with cudaGetDriverEntryPointByVersion, so nothing links against libcuda.
#include "cuda/cuda_ops.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/regions.h"
#include "engine/registry.h"
#include "xla/ffi/api/ffi.h"
#include "xla/bindings.h"
#include "xla/status_adapter.h"

namespace tpusync {
namespace cuda {
namespace {

namespace ffi = xla::ffi;

// Pinned write-back staging: two buffers of this size per device, so the DMA engine fills
// one while the engine writes the other to the tier.
constexpr uint64_t kStagingBytes = 32ull << 20;
// Pinned descriptor ring per device; each op takes 32 + 16 * rows bytes (64-aligned) until
// the agent has served it.
constexpr uint64_t kRingBytes = 16ull << 20;
// `ready` events per device: the most ops that may be enqueued but not yet served.
constexpr int kNumEvents = 4096;
// Tag slots for marks (host functions read them once the compute stream gets there).
constexpr int kNumMarkSlots = 1 << 16;
// Fetch records kept for waits; the oldest unwaited ones are discarded beyond this.
constexpr size_t kMaxTicketRecords = 1 << 16;
// The pinned mirror of a wait's dst grows in steps of this.
constexpr uint64_t kMirrorGranule = 2ull << 20;

// Descriptor slot layout, in int32 words.
constexpr int kSlotTicket = 0;  // start: the ticket it returns; wait: its ticket operand.
constexpr int kSlotRetire = 1;  // start: its retire operand.
constexpr int kSlotTag = 2;     // layer, chunk.
constexpr int kSlotOwner = 4;   // stream, epoch, generation, claims.
constexpr int kSlotTarget = 8;  // engine id, tier, first block (see regions.h).
constexpr int kSlotRows = 12;   // then rows * 4 words.
constexpr int kOwnerWords = 4;
constexpr int kTargetWords = 3;

std::atomic<EngineRegistry*> g_registry{nullptr};

std::mutex g_stats_mu;
CudaStats g_stats;
Status g_async_error;  // Guarded by g_stats_mu.

void RecordAsyncError(const Status& status) {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  if (g_async_error.ok()) g_async_error = status;
}

Status CudaError(cudaError_t err, const std::string& what) {
  return Internal("CUDA " + what + " failed: " + cudaGetErrorName(err) + ": " +
                  cudaGetErrorString(err));
}

Status DriverError(CUresult err, const std::string& what) {
  return Internal("CUDA driver " + what + " failed with CUresult " + std::to_string(err));
}

#define TPUSYNC_CUDA_CHECK(expr, what)                           \
  do {                                                           \
    cudaError_t _err = (expr);                                   \
    if (_err != cudaSuccess) return CudaError(_err, (what));     \
  } while (0)

StatusOr<std::shared_ptr<Engine>> LookupEngine(int64_t engine_id) {
  EngineRegistry* registry = g_registry.load(std::memory_order_acquire);
  if (registry == nullptr) {
    return FailedPrecondition("the CUDA ops are not attached to the engine registry "
                              "(import jax_tpusync._cuda and call register())");
  }
  std::shared_ptr<Engine> engine = registry->Get(engine_id);
  if (!engine) {
    return FailedPrecondition("engine " + std::to_string(engine_id) +
                              " is closed or was never created (a jitted function outlived "
                              "its cache?)");
  }
  return engine;
}

enum class ItemKind { kFetch, kWait, kWriteBack };

// One op as the agent serves it. `slot` is pinned and holds the descriptor once `event`
// (the op's `ready` event) has completed.
struct Item {
  ItemKind kind = ItemKind::kFetch;
  std::shared_ptr<Engine> engine;  // Bound by the agent from the target words.
  int32_t tier = 0;
  int64_t first_block = 0;
  Regions regions;
  uint8_t* device = nullptr;  // dst (wait) or src (write-back); a fetch has none.
  uint64_t device_bytes = 0;  // Its size; a fetch: its dst_bytes attribute.
  int32_t* slot = nullptr;
  int64_t rows = 0;
  int32_t ticket = static_cast<int32_t>(kNoTicket);  // start: assigned at enqueue.
  int64_t stream = 0;  // The owner's stream, once the agent checked it.
  uint32_t seq = 0;
  int event = -1;
  uint64_t ring_end = 0;
  bool signalled = false;
};

// The engine fetch behind a CUDA ticket. Weak: a record must not keep a closed engine.
struct FetchRecord {
  std::weak_ptr<Engine> engine;
  Ticket ticket = kNoTicket;
};

// A FIFO ring of pinned memory. Allocation happens under the device's mutex in enqueue
// order and the agent releases in the same order, so a head and a tail suffice.
class PinnedRing {
 public:
  Status Init(uint64_t bytes) {
    TPUSYNC_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&base_), bytes,
                                     cudaHostAllocPortable),
                       "cudaHostAlloc (descriptor ring)");
    capacity_ = bytes;
    return Status::Ok();
  }

  // Null when full. `end` is what Release() must be given once the slot is consumed.
  uint8_t* Allocate(uint64_t bytes, uint64_t* end) {
    bytes = AlignUp(bytes, 64);
    if (bytes > capacity_) return nullptr;
    uint64_t head = head_;
    if (head % capacity_ + bytes > capacity_) head += capacity_ - head % capacity_;
    if (head + bytes - tail_.load(std::memory_order_acquire) > capacity_) return nullptr;
    head_ = head + bytes;
    *end = head_;
    return base_ + head % capacity_;
  }

  void Release(uint64_t end) { tail_.store(end, std::memory_order_release); }

 private:
  uint8_t* base_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t head_ = 0;  // Guarded by the owner's mutex.
  std::atomic<uint64_t> tail_{0};
};

// Per-device state: streams, events, the counter, pinned memory and the agent thread.
// Created on first use and never destroyed (like the engine registry), so no CUDA call
// runs during interpreter teardown.
class DeviceContext {
 public:
  static StatusOr<DeviceContext*> ForDevice(int device);
  static StatusOr<DeviceContext*> ForStream(cudaStream_t stream) {
    int device = -1;
    TPUSYNC_CUDA_CHECK(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice");
    return ForDevice(device);
  }

  // start: stages the descriptor on `compute` and queues the fetch, for a dst of
  // `dst_bytes` that the matching wait will name. Never stalls `compute`.
  Status EnqueueFetch(cudaStream_t compute, Regions regions, const int32_t* segments,
                      int64_t rows, const int32_t* tag, int64_t tag_count,
                      const int32_t* retire, const int32_t* owner, const int32_t* target,
                      uint64_t dst_bytes, int32_t* ticket_out);
  // wait: stages the descriptor and makes `compute` wait until `dst` holds the rows.
  Status EnqueueWait(cudaStream_t compute, Regions regions, const int32_t* segments,
                     int64_t rows, const int32_t* tag, int64_t tag_count,
                     const int32_t* ticket, const int32_t* owner, const int32_t* target,
                     uint8_t* dst, uint64_t dst_bytes);
  // write_back: makes `compute` wait until `src`'s bytes are in pinned staging.
  Status EnqueueWriteBack(cudaStream_t compute, Regions regions, const int32_t* segments,
                          int64_t rows, const int32_t* tag, int64_t tag_count,
                          const int32_t* owner, const int32_t* target, uint8_t* src,
                          uint64_t src_bytes);
  // mark: records an engine timeline mark when `compute` gets here.
  Status EnqueueMark(cudaStream_t compute, std::shared_ptr<Engine> engine, int32_t kind,
                     const int32_t* tag, int64_t tag_count);

  Status error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  explicit DeviceContext(int device) : device_(device) {}
  Status Init();  // On the agent thread.
  void AgentLoop(std::promise<Status> started);

  // Stages a descriptor and queues `item`; `signal`: `compute` waits for the item.
  // `ticket_out` (start only) receives the ticket the host assigned.
  Status Enqueue(std::unique_ptr<Item> item, cudaStream_t compute, const int32_t* segments,
                 const int32_t* tag, int64_t tag_count, const int32_t* ticket_or_retire,
                 const int32_t* owner, const int32_t* target, int32_t* ticket_out,
                 bool signal);
  void SetError(const Status& status);

  // Agent side.
  void Serve(Item& item);
  Status ServeFetch(Item& item);
  Status ServeWait(Item& item);
  Status ServeWriteBack(Item& item);
  // Binds the item's engine, tier and first block from its target words.
  Status BindTarget(Item& item);
  StatusOr<int64_t> CheckOwner(const Item& item);
  StatusOr<std::vector<FetchSegment>> Decode(const Item& item);
  // The engine ticket of a CUDA ticket, consumed; kNoTicket if unknown or `engine`'s not.
  Ticket TakeRecord(int32_t ticket, const Engine& engine);
  // Drops a CUDA ticket's record and discards its engine fetch (nobody will consume it).
  void ForgetRecord(int32_t ticket);
  Status WriteThroughStaging(Engine& engine, int32_t tier, TransferTag tag,
                             const std::vector<Segment>& segments, Item& item);
  Status EnsureStaging();
  Status EnsureMirror(uint64_t bytes);
  void Signal(Item& item);

  const int device_;
  PFN_cuStreamWaitValue32_v11070 wait_value_ = nullptr;
  PFN_cuStreamWriteValue32_v11070 write_value_ = nullptr;
  cudaStream_t dma_ = nullptr;
  uint32_t* counter_ = nullptr;  // Device memory: the last seq the agent released.
  std::vector<cudaEvent_t> events_;
  int32_t* mark_slots_ = nullptr;  // Pinned, kNumMarkSlots * 2.

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Item>> queue_;
  std::vector<int> free_events_;
  PinnedRing ring_;
  uint32_t next_seq_ = 0;
  int32_t next_ticket_ = 0;
  uint32_t next_mark_ = 0;
  Status error_;

  // Agent-only state.
  uint8_t* staging_[2] = {nullptr, nullptr};
  uint8_t* mirror_ = nullptr;  // Pinned; a wait's dst bytes at their dst offsets.
  uint64_t mirror_bytes_ = 0;
  cudaEvent_t mirror_free_ = nullptr;  // The last H2D out of the mirror.
  std::unordered_map<int32_t, FetchRecord> records_;
  std::deque<int32_t> record_order_;
  std::thread agent_;
};

StatusOr<DeviceContext*> DeviceContext::ForDevice(int device) {
  static std::mutex mu;
  static auto* contexts = new std::unordered_map<int, DeviceContext*>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = contexts->find(device);
  if (it != contexts->end()) return it->second;
  // Created once per device; a failed start leaves nothing behind to retry into.
  auto* ctx = new DeviceContext(device);
  std::promise<Status> started;
  std::future<Status> result = started.get_future();
  ctx->agent_ = std::thread([ctx, p = std::move(started)]() mutable {
    ctx->AgentLoop(std::move(p));
  });
  Status st = result.get();
  if (!st.ok()) {
    ctx->agent_.join();
    delete ctx;  // Only CUDA objects that Init created leak here; acceptable on failure.
    return st;
  }
  (*contexts)[device] = ctx;
  return ctx;
}

Status DeviceContext::Init() {
  // The agent thread owns device_ as its current device; handler threads never call
  // cudaSetDevice (that would change XLA's thread state).
  TPUSYNC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice");
  cudaDriverEntryPointQueryResult found;
  void* fn = nullptr;
  TPUSYNC_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000,
                                                      cudaEnableDefault, &found),
                     "cudaGetDriverEntryPointByVersion(cuStreamWaitValue32)");
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return Unavailable("the CUDA driver has no cuStreamWaitValue32");
  }
  wait_value_ = reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(fn);
  TPUSYNC_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000,
                                                      cudaEnableDefault, &found),
                     "cudaGetDriverEntryPointByVersion(cuStreamWriteValue32)");
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return Unavailable("the CUDA driver has no cuStreamWriteValue32");
  }
  write_value_ = reinterpret_cast<PFN_cuStreamWriteValue32_v11070>(fn);

  // Non-blocking: never implicitly synchronizes with the legacy default stream.
  TPUSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&dma_, cudaStreamNonBlocking),
                     "cudaStreamCreateWithFlags");
  TPUSYNC_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&counter_), sizeof(uint32_t)),
                     "cudaMalloc (counter)");
  TPUSYNC_CUDA_CHECK(cudaMemsetAsync(counter_, 0, sizeof(uint32_t), dma_), "cudaMemsetAsync");
  TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(dma_), "cudaStreamSynchronize");
  events_.resize(kNumEvents);
  for (int i = 0; i < kNumEvents; ++i) {
    // Blocking sync: the agent sleeps while XLA's stream is still far from the op.
    TPUSYNC_CUDA_CHECK(
        cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming | cudaEventBlockingSync),
        "cudaEventCreateWithFlags");
    free_events_.push_back(kNumEvents - 1 - i);
  }
  TPUSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&mirror_free_, cudaEventDisableTiming),
                     "cudaEventCreateWithFlags");
  TPUSYNC_RETURN_IF_ERROR(ring_.Init(kRingBytes));
  TPUSYNC_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&mark_slots_),
                                   kNumMarkSlots * 2 * sizeof(int32_t), cudaHostAllocPortable),
                     "cudaHostAlloc (mark slots)");
  return Status::Ok();
}

void DeviceContext::SetError(const Status& status) {
  RecordAsyncError(status);
  std::lock_guard<std::mutex> lock(mu_);
  if (error_.ok()) error_ = status;
}

Status DeviceContext::Enqueue(std::unique_ptr<Item> item, cudaStream_t compute,
                              const int32_t* segments, const int32_t* tag, int64_t tag_count,
                              const int32_t* ticket_or_retire, const int32_t* owner,
                              const int32_t* target, int32_t* ticket_out, bool signal) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.ok()) return error_;
  uint64_t end = 0;
  const uint64_t rows_bytes = static_cast<uint64_t>(item->rows) * 4 * sizeof(int32_t);
  auto* slot = reinterpret_cast<int32_t*>(
      ring_.Allocate(kSlotRows * sizeof(int32_t) + rows_bytes, &end));
  if (slot == nullptr) {
    return ResourceExhausted("too many segment rows in flight on GPU " +
                             std::to_string(device_) + " (the GPU is far behind the host)");
  }
  if (free_events_.empty()) {
    return ResourceExhausted("more than " + std::to_string(kNumEvents) +
                             " tpusync ops in flight on GPU " + std::to_string(device_));
  }
  item->slot = slot;
  item->ring_end = end;
  item->event = free_events_.back();
  item->seq = ++next_seq_;
  if (item->kind == ItemKind::kFetch) {
    next_ticket_ = next_ticket_ >= INT32_MAX ? 1 : next_ticket_ + 1;
    item->ticket = next_ticket_;
  }
  slot[kSlotTicket] = item->ticket;
  slot[kSlotRetire] = static_cast<int32_t>(kNoTicket);
  slot[kSlotTag] = slot[kSlotTag + 1] = -1;
  for (int i = 0; i < kOwnerWords; ++i) slot[kSlotOwner + i] = 0;
  for (int i = 0; i < kTargetWords; ++i) slot[kSlotTarget + i] = 0;

  // From here on a failure leaves copies into `slot` enqueued: the slot cannot be reused,
  // so the device is marked failed instead of rolling back.
  auto fail = [&](cudaError_t err, const char* what) {
    Status st = CudaError(err, what);
    RecordAsyncError(st);
    error_ = st;
    return st;
  };
  cudaError_t err = cudaSuccess;
  if (rows_bytes > 0) {
    err = cudaMemcpyAsync(slot + kSlotRows, segments, rows_bytes, cudaMemcpyDefault, compute);
    if (err != cudaSuccess) return fail(err, "cudaMemcpyAsync (segments)");
  }
  const int64_t tag_words = std::min<int64_t>(tag_count, 2);
  if (tag_words > 0) {
    err = cudaMemcpyAsync(slot + kSlotTag, tag, tag_words * sizeof(int32_t), cudaMemcpyDefault,
                          compute);
    if (err != cudaSuccess) return fail(err, "cudaMemcpyAsync (tag)");
  }
  if (ticket_or_retire != nullptr) {
    int32_t* to = slot + (item->kind == ItemKind::kFetch ? kSlotRetire : kSlotTicket);
    err = cudaMemcpyAsync(to, ticket_or_retire, sizeof(int32_t), cudaMemcpyDefault, compute);
    if (err != cudaSuccess) return fail(err, "cudaMemcpyAsync (ticket)");
  }
  err = cudaMemcpyAsync(slot + kSlotOwner, owner, kOwnerWords * sizeof(int32_t),
                        cudaMemcpyDefault, compute);
  if (err != cudaSuccess) return fail(err, "cudaMemcpyAsync (owner)");
  err = cudaMemcpyAsync(slot + kSlotTarget, target, kTargetWords * sizeof(int32_t),
                        cudaMemcpyDefault, compute);
  if (err != cudaSuccess) return fail(err, "cudaMemcpyAsync (target)");
  if (ticket_out != nullptr) {
    // Ordered before the `ready` event, so the slot outlives this copy.
    err = cudaMemcpyAsync(ticket_out, slot + kSlotTicket, sizeof(int32_t), cudaMemcpyDefault,
                          compute);
    if (err != cudaSuccess) return fail(err, "cudaMemcpyAsync (ticket result)");
  }
  err = cudaEventRecord(events_[item->event], compute);
  if (err != cudaSuccess) return fail(err, "cudaEventRecord");
  if (signal) {
    CUresult r = wait_value_(reinterpret_cast<CUstream>(compute),
                             reinterpret_cast<CUdeviceptr>(counter_), item->seq,
                             CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) {
      Status st = DriverError(r, "cuStreamWaitValue32");
      RecordAsyncError(st);
      error_ = st;
      return st;
    }
  }
  free_events_.pop_back();
  queue_.push_back(std::move(item));
  cv_.notify_one();
  return Status::Ok();
}


Status DeviceContext::EnqueueFetch(cudaStream_t compute, Regions regions,
                                   const int32_t* segments, int64_t rows, const int32_t* tag,
                                   int64_t tag_count, const int32_t* retire,
                                   const int32_t* owner, const int32_t* target,
                                   uint64_t dst_bytes, int32_t* ticket_out) {
  auto item = std::make_unique<Item>();
  item->kind = ItemKind::kFetch;
  item->regions = regions;
  item->device_bytes = dst_bytes;
  item->rows = rows;
  return Enqueue(std::move(item), compute, segments, tag, tag_count, retire, owner, target,
                 ticket_out, /*signal=*/false);
}

Status DeviceContext::EnqueueWait(cudaStream_t compute, Regions regions,
                                  const int32_t* segments, int64_t rows, const int32_t* tag,
                                  int64_t tag_count, const int32_t* ticket,
                                  const int32_t* owner, const int32_t* target, uint8_t* dst,
                                  uint64_t dst_bytes) {
  auto item = std::make_unique<Item>();
  item->kind = ItemKind::kWait;
  item->regions = regions;
  item->device = dst;
  item->device_bytes = dst_bytes;
  item->rows = rows;
  return Enqueue(std::move(item), compute, segments, tag, tag_count, ticket, owner, target,
                 /*ticket_out=*/nullptr, /*signal=*/true);
}

Status DeviceContext::EnqueueWriteBack(cudaStream_t compute, Regions regions,
                                       const int32_t* segments, int64_t rows,
                                       const int32_t* tag, int64_t tag_count,
                                       const int32_t* owner, const int32_t* target,
                                       uint8_t* src, uint64_t src_bytes) {
  auto item = std::make_unique<Item>();
  item->kind = ItemKind::kWriteBack;
  item->regions = regions;
  item->device = src;
  item->device_bytes = src_bytes;
  item->rows = rows;
  return Enqueue(std::move(item), compute, segments, tag, tag_count,
                 /*ticket_or_retire=*/nullptr, owner, target, /*ticket_out=*/nullptr,
                 /*signal=*/true);
}

struct MarkArgs {
  std::shared_ptr<Engine> engine;
  int32_t kind;
  const int32_t* tag;  // Pinned; filled by the compute stream before the host function.
};

void CUDART_CB MarkHostFn(void* data) {
  // Runs on a CUDA driver thread: no CUDA calls here, only the engine's timeline.
  std::unique_ptr<MarkArgs> args(static_cast<MarkArgs*>(data));
  args->engine->Mark(args->kind, {args->tag[0], args->tag[1]});
}

Status DeviceContext::EnqueueMark(cudaStream_t compute, std::shared_ptr<Engine> engine,
                                  int32_t kind, const int32_t* tag, int64_t tag_count) {
  int32_t* slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) return error_;
    // A slot is reused after kNumMarkSlots later marks; by then its host function has run
    // unless the GPU lags that many marks behind the host (the tag would then be wrong).
    slot = mark_slots_ + 2 * (next_mark_++ % kNumMarkSlots);
  }
  slot[0] = slot[1] = -1;
  const int64_t tag_words = std::min<int64_t>(tag_count, 2);
  if (tag_words > 0) {
    TPUSYNC_CUDA_CHECK(cudaMemcpyAsync(slot, tag, tag_words * sizeof(int32_t),
                                       cudaMemcpyDefault, compute),
                       "cudaMemcpyAsync (mark tag)");
  }
  auto* args = new MarkArgs{std::move(engine), kind, slot};
  cudaError_t err = cudaLaunchHostFunc(compute, &MarkHostFn, args);
  if (err != cudaSuccess) {
    delete args;
    return CudaError(err, "cudaLaunchHostFunc (mark)");
  }
  return Status::Ok();
}

void DeviceContext::AgentLoop(std::promise<Status> started) {
  Status init = Init();
  const bool ok = init.ok();
  started.set_value(std::move(init));
  if (!ok) return;
  while (true) {
    std::unique_ptr<Item> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return !queue_.empty(); });
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    const int64_t begin = MonotonicNs();
    Serve(*item);
    {
      std::lock_guard<std::mutex> lock(g_stats_mu);
      g_stats.agent_busy_ns += MonotonicNs() - begin;
    }
    ring_.Release(item->ring_end);
    std::lock_guard<std::mutex> lock(mu_);
    free_events_.push_back(item->event);
  }
}

void DeviceContext::Serve(Item& item) {
  // The compute stream reached the op: the descriptor is in the slot, and the device
  // memory the op names holds what the graph put there.
  cudaError_t err = cudaEventSynchronize(events_[item.event]);
  Status st = err == cudaSuccess ? error() : CudaError(err, "cudaEventSynchronize");
  if (st.ok()) st = BindTarget(item);
  if (st.ok()) {
    // Before any byte moves, as on the CPU: an op of a superseded state does nothing.
    StatusOr<int64_t> stream = CheckOwner(item);
    st = stream.status();
    if (st.ok()) item.stream = *stream;
  }
  if (st.ok()) {
    switch (item.kind) {
      case ItemKind::kFetch: st = ServeFetch(item); break;
      case ItemKind::kWait: st = ServeWait(item); break;
      case ItemKind::kWriteBack: st = ServeWriteBack(item); break;
    }
  }
  if (!st.ok()) {
    SetError(st);
    // NaN bytes in place of KV that could not be fetched: wrong results are loud, never
    // stale. The whole buffer: the rows themselves may be what was invalid. Enqueued on
    // dma_ before Signal, so it too lands while the wait holds dst.
    if (item.kind == ItemKind::kWait) {
      cudaMemsetAsync(item.device, 0xFF, item.device_bytes, dma_);
    }
  }
  // Always release the compute stream, even after a failure: a hung GPU hides the error.
  Signal(item);
}

void DeviceContext::Signal(Item& item) {
  if (item.signalled) return;
  item.signalled = true;
  // Ordered after every copy this agent enqueued on dma_ so far (a wait's H2D, a
  // write-back's D2H); the default flags include a memory barrier.
  CUresult r = write_value_(reinterpret_cast<CUstream>(dma_),
                            reinterpret_cast<CUdeviceptr>(counter_), item.seq,
                            CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS) SetError(DriverError(r, "cuStreamWriteValue32"));
}

Status DeviceContext::BindTarget(Item& item) {
  auto target = DecodeTarget(item.slot + kSlotTarget, kTargetWords);
  if (!target.ok()) return target.status();
  auto engine = LookupEngine(target->engine_id);
  if (!engine.ok()) return engine.status();
  item.engine = std::move(*engine);
  item.tier = target->tier;
  item.first_block = target->first_block;
  return Status::Ok();
}

StatusOr<int64_t> DeviceContext::CheckOwner(const Item& item) {
  const int32_t* o = item.slot + kSlotOwner;
  if (o[0] == 0) return 0;  // Unchecked.
  TPUSYNC_RETURN_IF_ERROR(item.engine->CheckOwner(o[0], o[1], o[2], o[3] != 0));
  return o[0];
}

// Rows as (tier offset, offset in the op's buffer, bytes), guard rows checked first (see
// DecodeRows).
StatusOr<std::vector<FetchSegment>> DeviceContext::Decode(const Item& item) {
  StatusOr<Tier*> tier = item.engine->GetTier(item.tier);
  if (!tier.ok()) return tier.status();
  return DecodeRows(item.slot + kSlotRows, item.rows, **tier, item.device_bytes, item.regions,
                    item.first_block);
}

Status DeviceContext::EnsureStaging() {
  for (uint8_t*& buffer : staging_) {
    if (buffer != nullptr) continue;
    TPUSYNC_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&buffer), kStagingBytes,
                                     cudaHostAllocPortable),
                       "cudaHostAlloc (staging)");
  }
  return Status::Ok();
}

// Pieces of segments, each inside one staging chunk.
struct Piece {
  uint64_t tier_offset;
  uint8_t* device;
  uint64_t bytes;
  uint64_t staging_offset;
};

std::vector<std::vector<Piece>> SplitIntoChunks(const std::vector<Segment>& segments,
                                                uint64_t chunk_bytes) {
  std::vector<std::vector<Piece>> chunks(1);
  uint64_t used = 0;
  for (const Segment& s : segments) {
    for (uint64_t done = 0; done < s.bytes;) {
      if (used == chunk_bytes) {
        chunks.emplace_back();
        used = 0;
      }
      const uint64_t n = std::min(s.bytes - done, chunk_bytes - used);
      chunks.back().push_back({s.tier_offset + done, s.memory + done, n, used});
      used += n;
      done += n;
    }
  }
  if (chunks.back().empty()) chunks.pop_back();
  return chunks;
}

TransferRequest StagingRequest(int32_t tier, Direction direction, TransferTag tag,
                               const std::vector<Piece>& pieces, uint8_t* staging) {
  TransferRequest request;
  request.tier = tier;
  request.direction = direction;
  request.tag = tag;
  for (const Piece& p : pieces) {
    request.segments.push_back({p.tier_offset, staging + p.staging_offset, p.bytes});
  }
  return request;
}

Status DeviceContext::WriteThroughStaging(Engine& engine, int32_t tier, TransferTag tag,
                                          const std::vector<Segment>& segments, Item& item) {
  TPUSYNC_RETURN_IF_ERROR(EnsureStaging());
  const std::vector<std::vector<Piece>> chunks = SplitIntoChunks(segments, kStagingBytes);
  Ticket writing[2] = {kNoTicket, kNoTicket};  // Engine writes still reading each buffer.
  Status status;
  auto retire = [&](int b) {
    if (writing[b] == kNoTicket) return;
    Status st = engine.Wait(writing[b]);
    writing[b] = kNoTicket;
    if (status.ok() && !st.ok()) status = st;
  };
  for (size_t c = 0; c < chunks.size() && status.ok(); ++c) {
    const int b = static_cast<int>(c % 2);
    retire(b);
    if (!status.ok()) break;
    for (const Piece& piece : chunks[c]) {
      cudaError_t err = cudaMemcpyAsync(staging_[b] + piece.staging_offset, piece.device,
                                        piece.bytes, cudaMemcpyDeviceToHost, dma_);
      if (err != cudaSuccess) {
        status = CudaError(err, "cudaMemcpyAsync (D2H)");
        break;
      }
    }
    if (!status.ok()) break;
    cudaError_t err = cudaStreamSynchronize(dma_);
    if (err != cudaSuccess) {
      status = CudaError(err, "cudaStreamSynchronize (D2H)");
      break;
    }
    StatusOr<Ticket> t = engine.Submit(
        StagingRequest(tier, Direction::kMemoryToTier, tag, chunks[c], staging_[b]));
    if (!t.ok()) {
      status = t.status();
      break;
    }
    writing[b] = *t;
    // `src` is free once the last D2H landed. Releasing the compute stream only after the
    // last Submit means that once a step's outputs are ready, its write-backs are known to
    // the engine: Engine.drain() and later engine reads of those bytes see them.
    if (c + 1 == chunks.size()) Signal(item);
  }
  retire(0);
  retire(1);
  return status;
}

TransferTag SlotTag(const Item& item) {
  return {item.slot[kSlotTag], item.slot[kSlotTag + 1]};
}

uint64_t TotalBytes(const std::vector<FetchSegment>& segments) {
  uint64_t total = 0;
  for (const FetchSegment& s : segments) total += s.bytes;
  return total;
}

FetchRequest MakeFetch(const Item& item, std::vector<FetchSegment> segments) {
  FetchRequest request;
  request.tier = item.tier;
  request.segments = std::move(segments);
  request.tag = SlotTag(item);
  request.stream = item.stream;
  return request;
}

Ticket DeviceContext::TakeRecord(int32_t ticket, const Engine& engine) {
  auto it = records_.find(ticket);
  if (it == records_.end()) return kNoTicket;
  FetchRecord record = std::move(it->second);
  records_.erase(it);
  std::shared_ptr<Engine> owner = record.engine.lock();
  if (owner.get() == &engine) return record.ticket;
  if (owner) owner->Discard(record.ticket);  // Another engine's fetch: nobody else wants it.
  return kNoTicket;
}

void DeviceContext::ForgetRecord(int32_t ticket) {
  auto it = records_.find(ticket);
  if (it == records_.end()) return;
  if (std::shared_ptr<Engine> engine = it->second.engine.lock()) {
    engine->Discard(it->second.ticket);
  }
  records_.erase(it);
}

Status DeviceContext::ServeFetch(Item& item) {
  const int32_t retire = item.slot[kSlotRetire];
  if (retire != static_cast<int32_t>(kNoTicket)) ForgetRecord(retire);
  StatusOr<std::vector<FetchSegment>> segments = Decode(item);
  if (!segments.ok()) return segments.status();
  const uint64_t bytes = TotalBytes(*segments);
  // Lands in engine memory: device memory is only written by the wait that holds it.
  StatusOr<Ticket> ticket = item.engine->SubmitFetch(MakeFetch(item, std::move(*segments)));
  if (!ticket.ok()) return ticket.status();
  records_[item.ticket] = FetchRecord{item.engine, *ticket};
  record_order_.push_back(item.ticket);
  while (record_order_.size() > kMaxTicketRecords) {
    ForgetRecord(record_order_.front());  // Waited ones are gone already: a no-op.
    record_order_.pop_front();
  }
  std::lock_guard<std::mutex> lock(g_stats_mu);
  g_stats.fetches += 1;
  g_stats.fetch_bytes += bytes;
  return Status::Ok();
}

Status DeviceContext::EnsureMirror(uint64_t bytes) {
  // The previous wait's H2D may still read the mirror. Usually long done: the compute
  // stream reached this wait past the previous wait, which that H2D released.
  TPUSYNC_CUDA_CHECK(cudaEventSynchronize(mirror_free_), "cudaEventSynchronize (mirror)");
  if (bytes <= mirror_bytes_) return Status::Ok();
  if (mirror_ != nullptr) {
    TPUSYNC_CUDA_CHECK(cudaFreeHost(mirror_), "cudaFreeHost (mirror)");
    mirror_ = nullptr;
    mirror_bytes_ = 0;
  }
  const uint64_t size = AlignUp(bytes, kMirrorGranule);
  TPUSYNC_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&mirror_), size,
                                   cudaHostAllocPortable),
                     "cudaHostAlloc (mirror of " + std::to_string(size) + " bytes)");
  mirror_bytes_ = size;
  return Status::Ok();
}

Status DeviceContext::ServeWait(Item& item) {
  // A ticket is consumed by its wait whatever happens next, as on the CPU.
  const Ticket ticket = TakeRecord(item.slot[kSlotTicket], *item.engine);
  StatusOr<std::vector<FetchSegment>> want = Decode(item);
  Status st = want.ok() ? EnsureMirror(item.device_bytes) : want.status();
  if (!st.ok()) {
    item.engine->Discard(ticket);
    return st;
  }
  const FetchRequest request = MakeFetch(item, std::move(*want));
  bool hit = false;
  // The mirror stands in for dst (same offsets): the engine writes host memory only.
  st = item.engine->CompleteFetch(ticket, request, mirror_, item.device_bytes, &hit);
  {
    std::lock_guard<std::mutex> lock(g_stats_mu);
    g_stats.waits += 1;
    (hit ? g_stats.prefetch_hits : g_stats.prefetch_misses) += 1;
  }
  if (!st.ok()) return st;
  // dst is written only here: the compute stream is held at this wait until Signal, which
  // follows these copies on dma_.
  for (const FetchSegment& s : request.segments) {
    cudaError_t err = cudaMemcpyAsync(item.device + s.dst_offset, mirror_ + s.dst_offset,
                                      s.bytes, cudaMemcpyHostToDevice, dma_);
    if (err != cudaSuccess) {
      st = CudaError(err, "cudaMemcpyAsync (H2D)");
      break;
    }
  }
  // Recorded even after a failure: copies already enqueued still read the mirror.
  cudaError_t err = cudaEventRecord(mirror_free_, dma_);
  if (st.ok() && err != cudaSuccess) st = CudaError(err, "cudaEventRecord (mirror)");
  return st;
}

Status DeviceContext::ServeWriteBack(Item& item) {
  StatusOr<std::vector<FetchSegment>> decoded = Decode(item);
  if (item.stream != 0) {
    // What this write-back's guards said, accepted or not (see Engine::RecordGuards).
    Engine::WriteGuards guards;
    guards.epoch = item.slot[kSlotOwner + 1];
    guards.generation = item.slot[kSlotOwner + 2];
    guards.layer = SlotTag(item).layer;
    guards.accepted = decoded.ok();
    GuardColumns(item.slot + kSlotRows, item.rows, &guards.lengths, &guards.counts);
    if (!guards.lengths.empty()) item.engine->RecordGuards(item.stream, std::move(guards));
  }
  if (!decoded.ok()) return decoded.status();
  std::vector<Segment> segments;
  segments.reserve(decoded->size());
  for (const FetchSegment& s : *decoded) {
    segments.push_back({s.tier_offset, item.device + s.dst_offset, s.bytes});
  }
  Status st = WriteThroughStaging(*item.engine, item.tier, SlotTag(item), segments, item);
  if (!st.ok()) {
    return Status(st.code(), "a write-back failed, so the tier no longer holds that KV: " +
                                 st.detail());
  }
  std::lock_guard<std::mutex> lock(g_stats_mu);
  g_stats.write_backs += 1;
  g_stats.write_back_bytes += TotalBytes(*decoded);
  return Status::Ok();
}

// ---- XLA FFI handlers ---------------------------------------------------------------

Status CheckRows(const ffi::Buffer<ffi::S32>& segments, int64_t* rows) {
  auto dims = segments.dimensions();
  if (dims.size() != 2 || dims[1] != 4) return InvalidArgument("segments must be int32[n, 4]");
  *rows = dims[0];
  return Status::Ok();
}

// Copies `from` into `to` on the stream when XLA did not alias them.
Status CarryOver(cudaStream_t stream, const ffi::AnyBuffer& from, ffi::AnyBuffer* to) {
  if (to->untyped_data() == from.untyped_data()) return Status::Ok();
  TPUSYNC_CUDA_CHECK(cudaMemcpyAsync(to->untyped_data(), from.untyped_data(), from.size_bytes(),
                                     cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync (carry over)");
  return Status::Ok();
}

// Owner words are copied to the descriptor as they are; only their count is known here.
Status CheckOwnerShape(const ffi::Buffer<ffi::S32>& owner,
                       const ffi::Buffer<ffi::S32>& target) {
  if (owner.element_count() != kOwnerWords) {
    return InvalidArgument("owner must be int32[4] (stream, epoch, generation, claims)");
  }
  if (target.element_count() != kTargetWords) {
    return InvalidArgument("target must be int32[3] (engine id, tier, first block)");
  }
  return Status::Ok();
}

Regions MakeRegions(int64_t base, int64_t bytes, int64_t count, int32_t block_rows) {
  return Regions{base, bytes, count, block_rows != 0};
}

ffi::Error StartImpl(cudaStream_t stream, ffi::AnyBuffer passthrough,
                     ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::S32> tag,
                     ffi::BufferR0<ffi::S32> retire, ffi::Buffer<ffi::S32> owner,
                     ffi::Buffer<ffi::S32> target, ffi::RemainingArgs /*deps*/,
                     ffi::Result<ffi::AnyBuffer> passthrough_out,
                     ffi::Result<ffi::BufferR0<ffi::S32>> ticket_out, int64_t region_base,
                     int64_t region_bytes, int64_t region_count, int32_t region_block_rows,
                     int64_t dst_bytes) {
  int64_t rows = 0;
  Status st = CheckRows(segments, &rows);
  if (st.ok()) st = CheckOwnerShape(owner, target);
  if (st.ok() && dst_bytes < 0) st = InvalidArgument("dst_bytes must be >= 0");
  if (!st.ok()) return ToFfiError(st);
  auto ctx = DeviceContext::ForStream(stream);
  if (!ctx.ok()) return ToFfiError(ctx.status());
  st = CarryOver(stream, passthrough, &*passthrough_out);
  if (!st.ok()) return ToFfiError(st);
  return ToFfiError((*ctx)->EnqueueFetch(
      stream, MakeRegions(region_base, region_bytes, region_count, region_block_rows),
      segments.typed_data(), rows, tag.typed_data(),
      static_cast<int64_t>(tag.element_count()), retire.typed_data(), owner.typed_data(),
      target.typed_data(), static_cast<uint64_t>(dst_bytes), ticket_out->typed_data()));
}

ffi::Error WaitImpl(cudaStream_t stream, ffi::AnyBuffer dst, ffi::BufferR0<ffi::S32> ticket,
                    ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::S32> tag,
                    ffi::Buffer<ffi::S32> owner, ffi::Buffer<ffi::S32> target,
                    ffi::RemainingArgs /*deps*/, ffi::Result<ffi::AnyBuffer> dst_out,
                    int64_t region_base, int64_t region_bytes, int64_t region_count,
                    int32_t region_block_rows) {
  int64_t rows = 0;
  Status st = CheckRows(segments, &rows);
  if (st.ok()) st = CheckOwnerShape(owner, target);
  if (!st.ok()) return ToFfiError(st);
  auto ctx = DeviceContext::ForStream(stream);
  if (!ctx.ok()) return ToFfiError(ctx.status());
  // Not aliased (XLA copied the operand): carry the other bytes over; the fetched ones are
  // written into whichever buffer this op was given.
  st = CarryOver(stream, dst, &*dst_out);
  if (!st.ok()) return ToFfiError(st);
  return ToFfiError((*ctx)->EnqueueWait(
      stream, MakeRegions(region_base, region_bytes, region_count, region_block_rows),
      segments.typed_data(), rows, tag.typed_data(),
      static_cast<int64_t>(tag.element_count()), ticket.typed_data(), owner.typed_data(),
      target.typed_data(), static_cast<uint8_t*>(dst_out->untyped_data()),
      dst_out->size_bytes()));
}

ffi::Error WriteBackImpl(cudaStream_t stream, ffi::AnyBuffer src,
                         ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::S32> tag,
                         ffi::Buffer<ffi::S32> owner, ffi::Buffer<ffi::S32> target,
                         ffi::RemainingArgs /*deps*/,
                         ffi::Result<ffi::BufferR0<ffi::S32>> token_out, int64_t region_base,
                         int64_t region_bytes, int64_t region_count,
                         int32_t region_block_rows) {
  int64_t rows = 0;
  Status st = CheckRows(segments, &rows);
  if (st.ok()) st = CheckOwnerShape(owner, target);
  if (!st.ok()) return ToFfiError(st);
  auto ctx = DeviceContext::ForStream(stream);
  if (!ctx.ok()) return ToFfiError(ctx.status());
  st = (*ctx)->EnqueueWriteBack(
      stream, MakeRegions(region_base, region_bytes, region_count, region_block_rows),
      segments.typed_data(), rows, tag.typed_data(), static_cast<int64_t>(tag.element_count()),
      owner.typed_data(), target.typed_data(), static_cast<uint8_t*>(src.untyped_data()),
      src.size_bytes());
  if (!st.ok()) return ToFfiError(st);
  cudaError_t err = cudaMemsetAsync(token_out->typed_data(), 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) return ToFfiError(CudaError(err, "cudaMemsetAsync (token)"));
  return ffi::Error::Success();
}

ffi::Error MarkImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> tag,
                    ffi::RemainingArgs /*deps*/, ffi::Result<ffi::AnyBuffer> x_out,
                    int64_t engine_id, int32_t kind) {
  auto engine = LookupEngine(engine_id);
  if (!engine.ok()) return ToFfiError(engine.status());
  Status st = CarryOver(stream, x, &*x_out);
  if (!st.ok()) return ToFfiError(st);
  // Without a timeline a mark records nothing; skip the host function and its stall.
  if (!(*engine)->options().record_timeline) return ffi::Error::Success();
  auto ctx = DeviceContext::ForStream(stream);
  if (!ctx.ok()) return ToFfiError(ctx.status());
  return ToFfiError((*ctx)->EnqueueMark(stream, std::move(*engine), kind, tag.typed_data(),
                                        static_cast<int64_t>(tag.element_count())));
}

ffi::Error PointerKindImpl(cudaStream_t stream, ffi::AnyBuffer x,
                           ffi::Result<ffi::BufferR0<ffi::U8>> kind_out) {
  cudaPointerAttributes attributes;
  int kind = 255;
  if (cudaPointerGetAttributes(&attributes, x.untyped_data()) == cudaSuccess) {
    kind = static_cast<int>(attributes.type);
  } else {
    cudaGetLastError();  // Clear it: this is a probe, not a failure.
  }
  // The result may itself live in host or device memory; cudaMemsetAsync handles both.
  cudaError_t err = cudaMemsetAsync(kind_out->typed_data(), kind, 1, stream);
  if (err != cudaSuccess) return ToFfiError(CudaError(err, "cudaMemsetAsync (probe)"));
  return ffi::Error::Success();
}

// ---- Benchmarks ---------------------------------------------------------------------

// Frees what a benchmark allocated on every return path.
struct BenchResources {
  ~BenchResources() {
    if (stream) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    for (void* p : device) cudaFree(p);
    for (void* p : host) cudaFreeHost(p);
  }
  cudaStream_t stream = nullptr;
  std::vector<void*> device;
  std::vector<void*> host;
};

double Gbps(uint64_t bytes, int64_t ns) { return ns > 0 ? static_cast<double>(bytes) / ns : 0; }

}  // namespace

void AttachRegistry(EngineRegistry* registry) {
  g_registry.store(registry, std::memory_order_release);
}

bool registry_attached() { return g_registry.load(std::memory_order_acquire) != nullptr; }

CudaStats GetStats() {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  return g_stats;
}

Status AsyncError() {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  return g_async_error;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

StatusOr<std::vector<double>> MemcpyH2DGbps(int device, const std::vector<uint64_t>& sizes,
                                            int iters) {
  if (sizes.empty() || iters < 1) return InvalidArgument("need sizes and iters >= 1");
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  TPUSYNC_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice");
  BenchResources r;
  void* src = nullptr;
  void* dst = nullptr;
  TPUSYNC_CUDA_CHECK(cudaHostAlloc(&src, max_size, cudaHostAllocPortable), "cudaHostAlloc");
  r.host.push_back(src);
  std::memset(src, 1, max_size);  // Fault the pages in before timing.
  TPUSYNC_CUDA_CHECK(cudaMalloc(&dst, max_size), "cudaMalloc");
  r.device.push_back(dst);
  TPUSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking),
                     "cudaStreamCreateWithFlags");
  std::vector<double> out;
  for (uint64_t size : sizes) {
    TPUSYNC_CUDA_CHECK(cudaMemcpyAsync(dst, src, size, cudaMemcpyHostToDevice, r.stream),
                       "cudaMemcpyAsync");
    TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    const int64_t begin = MonotonicNs();
    for (int i = 0; i < iters; ++i) {
      TPUSYNC_CUDA_CHECK(cudaMemcpyAsync(dst, src, size, cudaMemcpyHostToDevice, r.stream),
                         "cudaMemcpyAsync");
    }
    TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    out.push_back(Gbps(size * iters, MonotonicNs() - begin));
  }
  return out;
}

StatusOr<std::vector<double>> EngineH2DGbps(int device, int64_t engine_id, int32_t tier,
                                            uint64_t tier_offset,
                                            const std::vector<uint64_t>& sizes, int iters) {
  if (sizes.empty() || iters < 1) return InvalidArgument("need sizes and iters >= 1");
  auto engine = LookupEngine(engine_id);
  if (!engine.ok()) return engine.status();
  StatusOr<Tier*> t = (*engine)->GetTier(tier);
  if (!t.ok()) return t.status();
  const uint64_t block_bytes = (*t)->block_bytes();
  const uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
  if (max_size > static_cast<uint64_t>(INT32_MAX)) {
    return InvalidArgument("sizes must fit one int32 segment row");
  }
  TPUSYNC_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice");
  BenchResources r;
  TPUSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking),
                     "cudaStreamCreateWithFlags");
  auto ctx = DeviceContext::ForStream(r.stream);
  if (!ctx.ok()) return ctx.status();
  void* dst = nullptr;
  void* small = nullptr;  // int32: rows[4], tag[2], retire, ticket, owner[4], target[3].
  TPUSYNC_CUDA_CHECK(cudaMalloc(&dst, max_size), "cudaMalloc");
  r.device.push_back(dst);
  TPUSYNC_CUDA_CHECK(cudaMalloc(&small, 15 * sizeof(int32_t)), "cudaMalloc");
  r.device.push_back(small);
  auto* words = static_cast<int32_t*>(small);
  std::vector<double> out;
  for (uint64_t size : sizes) {
    const int32_t host[15] = {static_cast<int32_t>(tier_offset / block_bytes),
                              static_cast<int32_t>(tier_offset % block_bytes), 0,
                              static_cast<int32_t>(size), -1, -1,
                              static_cast<int32_t>(kNoTicket), 0, 0, 0, 0, 0,
                              static_cast<int32_t>(engine_id), tier, 0};
    TPUSYNC_CUDA_CHECK(cudaMemcpy(words, host, sizeof(host), cudaMemcpyHostToDevice),
                       "cudaMemcpy");
    auto one = [&]() -> Status {
      // start then wait, exactly as the handlers enqueue them: the ticket travels through
      // device memory (words[7]). Owner words[8..11] are zero: unchecked.
      TPUSYNC_RETURN_IF_ERROR((*ctx)->EnqueueFetch(r.stream, Regions{}, words, 1, words + 4,
                                                   2, words + 6, words + 8, words + 12,
                                                   max_size, words + 7));
      return (*ctx)->EnqueueWait(r.stream, Regions{}, words, 1, words + 4, 2, words + 7,
                                 words + 8, words + 12, static_cast<uint8_t*>(dst), max_size);
    };
    TPUSYNC_RETURN_IF_ERROR(one());  // Warm-up: mirror and landing allocation, page faults.
    TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    const int64_t begin = MonotonicNs();
    for (int i = 0; i < iters; ++i) TPUSYNC_RETURN_IF_ERROR(one());
    TPUSYNC_CUDA_CHECK(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    out.push_back(Gbps(size * iters, MonotonicNs() - begin));
    TPUSYNC_RETURN_IF_ERROR((*ctx)->error());
  }
  return out;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncStartCuda, StartImpl,
                              WithTransferAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR0<ffi::S32>>())
                                  .Attr<int64_t>("dst_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncWaitCuda, WaitImpl,
                              WithTransferAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncWriteBackCuda, WriteBackImpl,
                              WithTransferAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::BufferR0<ffi::S32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncMarkCuda, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("engine_id")
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncPointerKindCuda, PointerKindImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR0<ffi::U8>>());

}  // namespace cuda
}  // namespace tpusync
