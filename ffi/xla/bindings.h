// Pieces of the FFI bindings that the CPU and CUDA handlers share.
#ifndef TPUSYNC_XLA_BINDINGS_H_
#define TPUSYNC_XLA_BINDINGS_H_

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace tpusync {

// The attributes of every transfer op (start, wait, write-back): which engine and tier, and
// the bounds of the tier region its segments must stay within (checked before any byte moves).
template <typename Binding>
auto WithTransferAttrs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<int64_t>("engine_id")
      .template Attr<int32_t>("tier")
      .template Attr<int64_t>("region_base")
      .template Attr<int64_t>("region_bytes")
      .template Attr<int64_t>("region_count");
}

}  // namespace tpusync

#endif  // TPUSYNC_XLA_BINDINGS_H_
