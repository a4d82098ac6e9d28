// XLA FFI handlers (platform "CUDA") for the in-graph transfer ops, with the same operands,
// results and attributes as the CPU handlers in ffi/xla/cpu_ops.cc (both bind the signatures
// in ffi/xla/op_signatures.h, here behind the CUDA stream):
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
// The handlers check shapes, carry unaliased operands over and enqueue the op on its
// device's DeviceContext (device_context.h, which describes the design: descriptors staged
// on the compute stream, an agent thread per device, completion through a counter the
// compute stream waits on). They never block the host on the GPU.
//
// memory_kind="pinned_host" operands: these handlers assume every operand is device
// memory and never rely on host-resident operands (the descriptor is always copied out on
// the stream, which works for either). Whether XLA hands a CUDA custom call a host pointer
// for a pinned_host operand, inserts a copy, or rejects the program is not assumed; the
// `tpusync_pointer_kind` probe answers it on a real GPU (tests/runtime/cuda, examples/gpu_check.sh).
// If it is a host pointer, descriptors could be read without the D2H staging copy.
//
// The handlers do not declare the command-buffer trait: they must run on the host at every
// execution, so XLA must never capture them into a CUDA graph.
#include "cuda/cuda_ops.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "cuda/device_context.h"
#include "engine/engine.h"
#include "engine/regions.h"
#include "xla/ffi/api/ffi.h"
#include "xla/op_signatures.h"
#include "xla/status_adapter.h"

namespace tpusync {
namespace cuda {
namespace {

namespace ffi = xla::ffi;

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

}  // namespace

// The signatures, operand by operand, are in xla/op_signatures.h (shared with the CPU).
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncStartCuda, StartImpl,
                              StartSignature(ffi::Ffi::Bind()
                                                 .Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncWaitCuda, WaitImpl,
                              WaitSignature(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncWriteBackCuda, WriteBackImpl,
                              WriteBackSignature(ffi::Ffi::Bind()
                                                     .Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncMarkCuda, MarkImpl,
                              MarkSignature(ffi::Ffi::Bind()
                                                .Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncPointerKindCuda, PointerKindImpl,
                              PointerKindSignature(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

}  // namespace cuda
}  // namespace tpusync
