// The XLA FFI signatures of the in-graph ops: every operand, result and attribute of each
// op, named, in the order the Python side (jax_tpusync/runtime/ops.py) passes them. The CPU handlers
// (xla/cpu_ops.cc) and the CUDA handlers (cuda/cuda_ops.cc) bind the same signatures; a
// platform adds only its context in front, e.g. the CUDA stream:
//
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncStartCpu, StartImpl, StartSignature(ffi::Ffi::Bind()));
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(TpusyncStartCuda, StartImpl, StartSignature(
//       ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
//
// so a handler's parameters are its platform context, then exactly the list below.
// What each op does is described in xla/cpu_ops.cc; the operand encodings in short:
//   segments   int32[n, 4] rows (block, offset_in_block, memory_offset, bytes)
//   tag        int32[2] (layer, chunk), for the timeline
//   owner      int32[4] (stream, epoch, generation, claims): see Engine::CheckOwner
//   target     int32[3] (engine id, tier, first block): see engine/regions.h
//   deps       any number of operands the op is ordered after (never read)
#ifndef TPUSYNC_XLA_OP_SIGNATURES_H_
#define TPUSYNC_XLA_OP_SIGNATURES_H_

#include <cstdint>
#include <utility>

#include "engine/regions.h"
#include "xla/ffi/api/ffi.h"

namespace tpusync {

// The attributes of every op that names tier bytes (start, wait, write-back, attend): the
// bounds of the regions its segments must stay within, relative to the target's first
// block (checked before any byte moves; see regions.h).
template <typename Binding>
auto WithTransferAttrs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<int64_t>("region_base")
      .template Attr<int64_t>("region_bytes")
      .template Attr<int64_t>("region_count")
      .template Attr<int32_t>("region_block_rows");  // 0/1: rows must stay in their block.
}

// The Regions the region attributes describe.
inline Regions MakeRegions(int64_t base, int64_t bytes, int64_t count, int32_t block_rows) {
  return Regions{base, bytes, count, block_rows != 0};
}

// tpusync_start(passthrough, segments, tag, retire, owner, target, *deps)
//   -> (passthrough, ticket); attributes: the region bounds, dst_bytes.
template <typename Binding>
auto StartSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return WithTransferAttrs(std::forward<Binding>(binding)
                               .template Arg<ffi::AnyBuffer>()            // passthrough
                               .template Arg<ffi::Buffer<ffi::S32>>()     // segments
                               .template Arg<ffi::Buffer<ffi::S32>>()     // tag
                               .template Arg<ffi::BufferR0<ffi::S32>>()   // retire (-1: none)
                               .template Arg<ffi::Buffer<ffi::S32>>()     // owner
                               .template Arg<ffi::Buffer<ffi::S32>>()     // target
                               .RemainingArgs()                           // deps
                               .template Ret<ffi::AnyBuffer>()            // passthrough
                               .template Ret<ffi::BufferR0<ffi::S32>>())  // ticket
      .template Attr<int64_t>("dst_bytes");  // The size of the dst its wait will fill.
}

// tpusync_wait(dst, ticket, segments, tag, owner, target, *deps) -> dst;
// attributes: the region bounds.
template <typename Binding>
auto WaitSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return WithTransferAttrs(std::forward<Binding>(binding)
                               .template Arg<ffi::AnyBuffer>()           // dst
                               .template Arg<ffi::BufferR0<ffi::S32>>()  // ticket
                               .template Arg<ffi::Buffer<ffi::S32>>()    // segments
                               .template Arg<ffi::Buffer<ffi::S32>>()    // tag
                               .template Arg<ffi::Buffer<ffi::S32>>()    // owner
                               .template Arg<ffi::Buffer<ffi::S32>>()    // target
                               .RemainingArgs()                          // deps
                               .template Ret<ffi::AnyBuffer>());         // dst, filled
}

// tpusync_write_back(src, segments, tag, owner, target, *deps) -> token;
// attributes: the region bounds.
template <typename Binding>
auto WriteBackSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return WithTransferAttrs(std::forward<Binding>(binding)
                               .template Arg<ffi::AnyBuffer>()             // src
                               .template Arg<ffi::Buffer<ffi::S32>>()      // segments
                               .template Arg<ffi::Buffer<ffi::S32>>()      // tag
                               .template Arg<ffi::Buffer<ffi::S32>>()      // owner
                               .template Arg<ffi::Buffer<ffi::S32>>()      // target
                               .RemainingArgs()                            // deps
                               .template Ret<ffi::BufferR0<ffi::S32>>());  // token
}

// tpusync_mark(x, tag, *deps) -> x; attributes: engine_id, kind.
template <typename Binding>
auto MarkSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::Buffer<ffi::S32>>()   // tag
      .RemainingArgs()                         // deps
      .template Ret<ffi::AnyBuffer>()          // x, unchanged
      .template Attr<int64_t>("engine_id")     // The engine whose timeline records it.
      .template Attr<int32_t>("kind");         // What it marks (MARK_* in timeline.py).
}

// tpusync_attend(q, segments, positions, tag, owner, target, *deps) -> (out, lse);
// attributes: the region bounds, unit_len, kv_dtype, tier_dtype, num_kv_heads, scale,
// soft_cap, window. CPU only.
template <typename Binding>
auto AttendSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return WithTransferAttrs(std::forward<Binding>(binding)
                               .template Arg<ffi::Buffer<ffi::F32>>()   // q
                               .template Arg<ffi::Buffer<ffi::S32>>()   // segments
                               .template Arg<ffi::Buffer<ffi::S32>>()   // positions [3 or 4, batch]
                               .template Arg<ffi::Buffer<ffi::S32>>()   // tag
                               .template Arg<ffi::Buffer<ffi::S32>>()   // owner
                               .template Arg<ffi::Buffer<ffi::S32>>()   // target
                               .RemainingArgs()                         // deps
                               .template Ret<ffi::Buffer<ffi::F32>>()   // out, like q
                               .template Ret<ffi::Buffer<ffi::F32>>())  // lse
      .template Attr<int64_t>("unit_len")      // Rows of one sequence's K (or V) in the unit.
      .template Attr<int32_t>("kv_dtype")      // KvDtype (engine/pool_attention.h).
      .template Attr<int32_t>("tier_dtype")    // TierDtype: rows of codes + scales, or 0.
      .template Attr<int32_t>("num_kv_heads")
      .template Attr<float>("scale")           // Multiplies q . k.
      .template Attr<float>("soft_cap")        // <= 0: none.
      .template Attr<int32_t>("window");       // Sliding window in keys; <= 0: none.
}

// tpusync_attend_landed(q, ticket, segments, positions, tag, owner, target, *deps)
//   -> (out, lse); attributes: attend's. CPU only.
template <typename Binding>
auto AttendLandedSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return WithTransferAttrs(std::forward<Binding>(binding)
                               .template Arg<ffi::Buffer<ffi::F32>>()    // q
                               .template Arg<ffi::BufferR0<ffi::S32>>()  // ticket (-1: none)
                               .template Arg<ffi::Buffer<ffi::S32>>()    // segments
                               .template Arg<ffi::Buffer<ffi::S32>>()    // positions [3 or 4, batch]
                               .template Arg<ffi::Buffer<ffi::S32>>()    // tag
                               .template Arg<ffi::Buffer<ffi::S32>>()    // owner
                               .template Arg<ffi::Buffer<ffi::S32>>()    // target
                               .RemainingArgs()                          // deps
                               .template Ret<ffi::Buffer<ffi::F32>>()    // out, like q
                               .template Ret<ffi::Buffer<ffi::F32>>())   // lse
      .template Attr<int64_t>("unit_len")
      .template Attr<int32_t>("kv_dtype")
      .template Attr<int32_t>("tier_dtype")
      .template Attr<int32_t>("num_kv_heads")
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int32_t>("window");
}

// tpusync_attend_spilled(q, spill_ticket, segments, spill_segments, positions, tag, owner,
//   target, spill_target, *deps) -> (out, lse); attributes: the region bounds of the
//   memory tier, spill_region_* those of the spill tier, and attend's. CPU only.
template <typename Binding>
auto AttendSpilledSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return WithTransferAttrs(std::forward<Binding>(binding)
                               .template Arg<ffi::Buffer<ffi::F32>>()    // q
                               .template Arg<ffi::BufferR0<ffi::S32>>()  // spill ticket
                               .template Arg<ffi::Buffer<ffi::S32>>()    // segments
                               .template Arg<ffi::Buffer<ffi::S32>>()    // spill segments
                               .template Arg<ffi::Buffer<ffi::S32>>()    // positions [3 or 4, batch]
                               .template Arg<ffi::Buffer<ffi::S32>>()    // tag
                               .template Arg<ffi::Buffer<ffi::S32>>()    // owner
                               .template Arg<ffi::Buffer<ffi::S32>>()    // target
                               .template Arg<ffi::Buffer<ffi::S32>>()    // spill target
                               .RemainingArgs()                          // deps
                               .template Ret<ffi::Buffer<ffi::F32>>()    // out, like q
                               .template Ret<ffi::Buffer<ffi::F32>>())   // lse
      .template Attr<int64_t>("spill_region_base")
      .template Attr<int64_t>("spill_region_bytes")
      .template Attr<int64_t>("spill_region_count")
      .template Attr<int32_t>("spill_region_block_rows")
      .template Attr<int64_t>("unit_len")
      .template Attr<int32_t>("kv_dtype")
      .template Attr<int32_t>("tier_dtype")
      .template Attr<int32_t>("num_kv_heads")
      .template Attr<float>("scale")
      .template Attr<float>("soft_cap")
      .template Attr<int32_t>("window");
}

// tpusync_pointer_kind(x) -> kind: diagnostics, CUDA only (see cuda/cuda_ops.h).
template <typename Binding>
auto PointerKindSignature(Binding&& binding) {
  namespace ffi = xla::ffi;
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()          // x
      .template Ret<ffi::BufferR0<ffi::U8>>();  // kind (cudaMemoryType; 255: error)
}

}  // namespace tpusync

#endif  // TPUSYNC_XLA_OP_SIGNATURES_H_
