// XLA FFI handlers (platform "cpu") for the in-graph transfer ops.
//
// start(passthrough, dst, segments, tag, retire, *deps) -> (passthrough, dst, ticket)
//   Queues a fetch of `segments` into `dst` and returns at once. `retire` (-1: none) is a
//   ticket of an earlier fetch into the same buffer that nobody waited for: it is waited
//   first, so two fetches never write one buffer at once. `passthrough` (the layer's
//   input activation) is aliased through so that compute reading it is ordered after the
//   start: XLA's schedulers may otherwise sink a start past the compute it should overlap.
// wait(dst, ticket, segments, tag, *deps) -> dst
//   Blocks until `dst` holds `segments`. `deps` (the outputs of the compute that overlaps the
//   fetch) keep XLA from hoisting the wait above that compute; lax.optimization_barrier
//   does not. If the ticket fetched anything else (or is -1), the wait fetches the wanted
//   bytes itself: a prefetch is only ever an optimization, never a source of stale KV.
// write_back(src, segments, tag, *deps) -> token
//   Copies the bytes out of `src` (XLA may reuse it as soon as we return) and writes them
//   to the tier in the background. The engine orders later fetches of the same bytes after it.
// mark(x, tag, *deps) -> x   records a timestamp in the engine timeline (compute spans).
//
// Segments are int32[n, 4] rows (block, offset_in_block, memory_offset, bytes): two int32
// fields address a 64-bit tier offset without requiring jax_enable_x64.
//
// Region attributes (region_base, region_bytes, region_count; region_bytes == 0 disables
// the check) describe how the caller carved the tier: `region_count` regions of
// `region_bytes` from `region_base`. Every segment must lie inside one region, so a
// position past a sequence's end (context overflow) or a layer out of range fails loudly
// instead of reading or overwriting a neighbour's KV.
#include <cstring>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "engine/regions.h"
#include "engine/registry.h"
#include "xla/ffi/api/ffi.h"
#include "xla/bindings.h"
#include "xla/status_adapter.h"

namespace tpusync {
namespace {

namespace ffi = xla::ffi;

StatusOr<std::shared_ptr<Engine>> LookupEngine(int64_t engine_id) {
  std::shared_ptr<Engine> engine = EngineRegistry::Global().Get(engine_id);
  if (!engine) {
    return FailedPrecondition("engine " + std::to_string(engine_id) +
                              " is closed or was never created (a jitted function outlived "
                              "its cache?)");
  }
  return engine;
}

TransferTag DecodeTag(const ffi::Buffer<ffi::S32>& tag) {
  TransferTag out;
  if (tag.element_count() >= 1) out.layer = tag.typed_data()[0];
  if (tag.element_count() >= 2) out.chunk = tag.typed_data()[1];
  return out;
}

// Builds a request from int32[n, 4] segment rows against `memory` of `memory_bytes`.
StatusOr<TransferRequest> DecodeRequest(Engine& engine, int32_t tier, Direction direction,
                                            const ffi::Buffer<ffi::S32>& segments,
                                            uint8_t* memory, size_t memory_bytes,
                                            const ffi::Buffer<ffi::S32>& tag,
                                            const Regions& regions) {
  auto dims = segments.dimensions();
  if (dims.size() != 2 || dims[1] != 4) {
    return InvalidArgument("segments must be int32[n, 4]");
  }
  StatusOr<Tier*> t = engine.GetTier(tier);
  if (!t.ok()) return t.status();
  const uint64_t block_bytes = (*t)->block_bytes();
  TransferRequest request;
  request.tier = tier;
  request.direction = direction;
  request.tag = DecodeTag(tag);
  const int32_t* rows = segments.typed_data();
  for (int64_t i = 0; i < dims[0]; ++i) {
    const int32_t* r = rows + 4 * i;
    if (r[0] < 0 || r[1] < 0 || r[2] < 0 || r[3] < 0) {
      return InvalidArgument("segment " + std::to_string(i) + " has a negative field");
    }
    const uint64_t mem_offset = static_cast<uint64_t>(r[2]);
    const uint64_t bytes = static_cast<uint64_t>(r[3]);
    if (bytes == 0) continue;
    if (mem_offset + bytes > memory_bytes) {
      return InvalidArgument(
          "segment " + std::to_string(i) + " covers bytes [" +
          std::to_string(mem_offset) + ", " + std::to_string(mem_offset + bytes) +
          ") of a " + std::to_string(memory_bytes) + "-byte buffer");
    }
    request.segments.push_back({static_cast<uint64_t>(r[0]) * block_bytes +
                                    static_cast<uint64_t>(r[1]),
                                memory + mem_offset, bytes});
    Status in_region = CheckRegion(regions, i, request.segments.back());
    if (!in_region.ok()) return in_region;
  }
  return request;
}

ffi::Error StartImpl(ffi::AnyBuffer passthrough, ffi::AnyBuffer dst,
                     ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::S32> tag,
                     ffi::BufferR0<ffi::S32> retire, ffi::RemainingArgs /*deps*/,
                     ffi::Result<ffi::AnyBuffer> passthrough_out,
                     ffi::Result<ffi::AnyBuffer> dst_out,
                     ffi::Result<ffi::BufferR0<ffi::S32>> ticket_out, int64_t engine_id,
                     int32_t tier, int64_t region_base, int64_t region_bytes,
                     int64_t region_count) {
  auto engine = LookupEngine(engine_id);
  if (!engine.ok()) return ToFfiError(engine.status());
  if (passthrough_out->untyped_data() != passthrough.untyped_data()) {
    std::memcpy(passthrough_out->untyped_data(), passthrough.untyped_data(),
                passthrough.size_bytes());
  }
  const Ticket stale = retire.typed_data()[0];
  if (stale != kNoTicket) {
    // Its bytes are unwanted and it may have been consumed already: only its end matters.
    (*engine)->Wait(stale).ok();
  }
  // The fetch lands in the output buffer; with the operand aliased it is the same memory.
  auto request = DecodeRequest(**engine, tier, Direction::kTierToMemory, segments,
                               static_cast<uint8_t*>(dst_out->untyped_data()),
                               dst_out->size_bytes(), tag,
                               Regions{region_base, region_bytes, region_count});
  if (!request.ok()) return ToFfiError(request.status());
  StatusOr<Ticket> ticket = (*engine)->Submit(std::move(*request));
  if (!ticket.ok()) return ToFfiError(ticket.status());
  ticket_out->typed_data()[0] = static_cast<int32_t>(*ticket);
  return ffi::Error::Success();
}

ffi::Error WaitImpl(ffi::AnyBuffer dst, ffi::BufferR0<ffi::S32> ticket,
                    ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::S32> tag,
                    ffi::RemainingArgs /*deps*/, ffi::Result<ffi::AnyBuffer> dst_out,
                    int64_t engine_id, int32_t tier, int64_t region_base,
                    int64_t region_bytes, int64_t region_count) {
  auto engine = LookupEngine(engine_id);
  if (!engine.ok()) return ToFfiError(engine.status());
  if (dst_out->untyped_data() != dst.untyped_data()) {
    // Not aliased (XLA copied the operand): the prefetch went elsewhere. Carry the
    // buffer over; WaitFor sees the address mismatch and fetches again.
    std::memcpy(dst_out->untyped_data(), dst.untyped_data(), dst.size_bytes());
  }
  auto want = DecodeRequest(**engine, tier, Direction::kTierToMemory, segments,
                            static_cast<uint8_t*>(dst_out->untyped_data()),
                            dst_out->size_bytes(), tag,
                               Regions{region_base, region_bytes, region_count});
  if (!want.ok()) return ToFfiError(want.status());
  bool hit = false;
  return ToFfiError((*engine)->WaitFor(ticket.typed_data()[0], *want, &hit));
}

ffi::Error WriteBackImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> segments,
                         ffi::Buffer<ffi::S32> tag, ffi::RemainingArgs /*deps*/,
                         ffi::Result<ffi::BufferR0<ffi::S32>> token_out, int64_t engine_id,
                         int32_t tier, int64_t region_base, int64_t region_bytes,
                         int64_t region_count) {
  auto engine = LookupEngine(engine_id);
  if (!engine.ok()) return ToFfiError(engine.status());
  auto request = DecodeRequest(**engine, tier, Direction::kMemoryToTier, segments,
                               static_cast<uint8_t*>(src.untyped_data()), src.size_bytes(),
                               tag, Regions{region_base, region_bytes, region_count});
  if (!request.ok()) return ToFfiError(request.status());
  // Pack the source bytes into engine-owned memory; the segments then point into it.
  uint64_t total = 0;
  for (const Segment& s : request->segments) total += s.bytes;
  auto owned = std::make_shared<AlignedBuffer>(total);
  uint64_t at = 0;
  for (Segment& s : request->segments) {
    std::memcpy(owned->data() + at, s.memory, s.bytes);
    s.memory = owned->data() + at;
    at += s.bytes;
  }
  request->owned_memory = std::move(owned);
  request->detached = true;
  StatusOr<Ticket> ticket = (*engine)->Submit(std::move(*request));
  if (!ticket.ok()) return ToFfiError(ticket.status());
  token_out->typed_data()[0] = 0;
  return ffi::Error::Success();
}

ffi::Error MarkImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> tag, ffi::RemainingArgs /*deps*/,
                    ffi::Result<ffi::AnyBuffer> x_out, int64_t engine_id, int32_t kind) {
  auto engine = LookupEngine(engine_id);
  if (!engine.ok()) return ToFfiError(engine.status());
  if (x_out->untyped_data() != x.untyped_data()) {
    std::memcpy(x_out->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  (*engine)->Mark(kind, DecodeTag(tag));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncStartCpu, StartImpl,
                              WithTransferAttrs(ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncWaitCpu, WaitImpl,
                              WithTransferAttrs(ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncWriteBackCpu, WriteBackImpl,
                              WithTransferAttrs(ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::BufferR0<ffi::S32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncMarkCpu, MarkImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("engine_id")
                                  .Attr<int32_t>("kind"));

}  // namespace tpusync
