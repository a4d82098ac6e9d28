// Engine Status -> XLA FFI error.
#ifndef TPUSYNC_XLA_STATUS_ADAPTER_H_
#define TPUSYNC_XLA_STATUS_ADAPTER_H_

#include "engine/status.h"
#include "xla/ffi/api/ffi.h"

namespace tpusync {

inline xla::ffi::Error ToFfiError(const Status& status) {
  namespace ffi = xla::ffi;
  if (status.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (status.code()) {
    case StatusCode::kOk: break;
    case StatusCode::kInvalidArgument: code = ffi::ErrorCode::kInvalidArgument; break;
    case StatusCode::kNotFound: code = ffi::ErrorCode::kNotFound; break;
    case StatusCode::kAlreadyExists: code = ffi::ErrorCode::kAlreadyExists; break;
    case StatusCode::kResourceExhausted: code = ffi::ErrorCode::kResourceExhausted; break;
    case StatusCode::kFailedPrecondition: code = ffi::ErrorCode::kFailedPrecondition; break;
    case StatusCode::kCancelled: code = ffi::ErrorCode::kCancelled; break;
    case StatusCode::kDeadlineExceeded: code = ffi::ErrorCode::kDeadlineExceeded; break;
    case StatusCode::kUnavailable: code = ffi::ErrorCode::kUnavailable; break;
    case StatusCode::kInternal: code = ffi::ErrorCode::kInternal; break;
    case StatusCode::kDataLoss: code = ffi::ErrorCode::kDataLoss; break;
  }
  return ffi::Error(code, status.message());
}

}  // namespace tpusync

#endif  // TPUSYNC_XLA_STATUS_ADAPTER_H_
