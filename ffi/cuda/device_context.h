// The device agent of the CUDA ops: one DeviceContext per device, with its own thread, DMA
// stream, descriptor ring, events, completion counter and pinned staging. The handlers
// (cuda_ops.cc) only enqueue; the agent serves each op in program order.
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
// Host-only C++ against the CUDA runtime (linked statically: no libcudart.so needed, and
// libcuda.so.1 is only loaded by the first CUDA call). Driver stream memory operations are
// fetched with cudaGetDriverEntryPointByVersion, so nothing links against libcuda.
#ifndef TPUSYNC_CUDA_DEVICE_CONTEXT_H_
#define TPUSYNC_CUDA_DEVICE_CONTEXT_H_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"
#include "engine/regions.h"
#include "engine/status.h"

namespace tpusync {
namespace cuda {

// Descriptor slot layout, in int32 words.
constexpr int kSlotTicket = 0;  // start: the ticket it returns; wait: its ticket operand.
constexpr int kSlotRetire = 1;  // start: its retire operand.
constexpr int kSlotTag = 2;     // layer, chunk.
constexpr int kSlotOwner = 4;   // stream, epoch, generation, claims.
constexpr int kSlotTarget = 8;  // engine id, tier, first block (see regions.h).
constexpr int kSlotRows = 12;   // then rows * 4 words.
constexpr int kOwnerWords = 4;
constexpr int kTargetWords = 3;

Status CudaError(cudaError_t err, const std::string& what);
Status DriverError(CUresult err, const std::string& what);

#define TPUSYNC_CUDA_CHECK(expr, what)                           \
  do {                                                           \
    cudaError_t _err = (expr);                                   \
    if (_err != cudaSuccess) return CudaError(_err, (what));     \
  } while (0)

// The engine behind `engine_id`, through the registry attached with AttachRegistry.
StatusOr<std::shared_ptr<Engine>> LookupEngine(int64_t engine_id);
// Keeps the first asynchronous failure of any device (see AsyncError()).
void RecordAsyncError(const Status& status);

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

}  // namespace cuda
}  // namespace tpusync

#endif  // TPUSYNC_CUDA_DEVICE_CONTEXT_H_
