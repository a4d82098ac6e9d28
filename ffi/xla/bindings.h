// Pieces of the FFI bindings that the CPU and CUDA handlers share.
#ifndef TPUSYNC_XLA_BINDINGS_H_
#define TPUSYNC_XLA_BINDINGS_H_

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace tpusync {

// The attributes of every transfer op (start, wait, write-back): the bounds of the regions
// its segments must stay within, relative to the target's first block (checked before any
// byte moves; see regions.h). Which engine, tier and first block is the `target` operand.
template <typename Binding>
auto WithTransferAttrs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<int64_t>("region_base")
      .template Attr<int64_t>("region_bytes")
      .template Attr<int64_t>("region_count")
      .template Attr<int32_t>("region_block_rows");
}

}  // namespace tpusync

#endif  // TPUSYNC_XLA_BINDINGS_H_
