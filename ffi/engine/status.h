// Status and StatusOr for the engine core.
//
// The core never throws across threads: every fallible call returns a Status, and the
// adapters (XLA FFI, nanobind) turn it into ffi::Error or a Python exception. Messages
// always start with "tpusync: " so a user can tell our errors from XLA's.
#ifndef TPUSYNC_ENGINE_STATUS_H_
#define TPUSYNC_ENGINE_STATUS_H_

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

namespace tpusync {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kAlreadyExists,
  kResourceExhausted,
  kFailedPrecondition,
  kCancelled,
  kDeadlineExceeded,
  kUnavailable,
  kInternal,
  kDataLoss,  // Bytes a tier should hold are gone (its file truncated or replaced).
};

const char* StatusCodeName(StatusCode code);

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(Prefixed(std::move(message))) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // The message without the "tpusync: " prefix, for composing into another message.
  std::string detail() const { return message_.size() >= 9 ? message_.substr(9) : message_; }

 private:
  static std::string Prefixed(std::string message) {
    static constexpr char kPrefix[] = "tpusync: ";
    if (message.rfind(kPrefix, 0) == 0) return message;
    return kPrefix + message;
  }

  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return Status(StatusCode::kInvalidArgument, std::move(m));
}
inline Status NotFound(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
inline Status ResourceExhausted(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
inline Status FailedPrecondition(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
inline Status Cancelled(std::string m) { return Status(StatusCode::kCancelled, std::move(m)); }
inline Status DeadlineExceeded(std::string m) {
  return Status(StatusCode::kDeadlineExceeded, std::move(m));
}
inline Status Unavailable(std::string m) {
  return Status(StatusCode::kUnavailable, std::move(m));
}
inline Status Internal(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
inline Status DataLoss(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }

// An errno-carrying I/O failure: "<what>: <strerror>".
inline Status ErrnoStatus(const std::string& what, int err) {
  StatusCode code = StatusCode::kInternal;
  if (err == ENOENT) code = StatusCode::kNotFound;
  if (err == EACCES || err == EPERM || err == EROFS) code = StatusCode::kFailedPrecondition;
  if (err == ENOSPC || err == ENOMEM || err == EDQUOT) code = StatusCode::kResourceExhausted;
  return Status(code, what + ": " + std::strerror(err));
}

template <typename T>
class StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design.
  StatusOr(Status status) : status_(std::move(status)) {}  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() { return *value_; }
  const T& value() const { return *value_; }
  T* operator->() { return &*value_; }
  T& operator*() { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

#define TPUSYNC_RETURN_IF_ERROR(expr)      \
  do {                                     \
    ::tpusync::Status _st = (expr);        \
    if (!_st.ok()) return _st;             \
  } while (0)

}  // namespace tpusync

#endif  // TPUSYNC_ENGINE_STATUS_H_
