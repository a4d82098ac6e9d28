#include "cuda/device_context.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "cuda/cuda_ops.h"
#include "engine/registry.h"

namespace tpusync {
namespace cuda {
namespace {

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

std::atomic<EngineRegistry*> g_registry{nullptr};

std::mutex g_stats_mu;
CudaStats g_stats;
Status g_async_error;  // Guarded by g_stats_mu.

}  // namespace

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

StatusOr<std::shared_ptr<Engine>> LookupEngine(int64_t engine_id) {
  EngineRegistry* registry = g_registry.load(std::memory_order_acquire);
  if (registry == nullptr) {
    return FailedPrecondition("the CUDA ops are not attached to the engine registry "
                              "(import jax_tpusync.runtime._cuda and call register())");
  }
  std::shared_ptr<Engine> engine = registry->Get(engine_id);
  if (!engine) {
    return FailedPrecondition("engine " + std::to_string(engine_id) +
                              " is closed or was never created (a jitted function outlived "
                              "its cache?)");
  }
  return engine;
}

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

namespace {

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

}  // namespace

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
namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace cuda
}  // namespace tpusync
