// Status and Result<T>: how every dsec library reports failure. No exceptions
// cross a dsec API; third-party exceptions are caught in the adapter that wraps
// the library.
#pragma once

#include <cerrno>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace dsec {

// Error codes double as the API's error "code" strings (see api/openapi.yaml),
// so each maps to one HTTP status in httpStatusFor().
enum class Code {
  kOk = 0,
  kInvalidArgument,
  kUnauthenticated,
  kPermissionDenied,
  kNotFound,
  kAlreadyExists,
  kConflict,
  kFailedPrecondition,
  kPayloadTooLarge,
  kResourceExhausted,
  kDeadlineExceeded,
  kUnavailable,
  kDataLoss,  // bytes that fail their checksum
  kInternal,
  kQuotaExceeded,  // a tenant's quota (platform/tenants.h) would be exceeded
  kRateLimited,    // a tenant's rate of calls is over its quota: retry later
};

const char* codeName(Code code);
int httpStatusFor(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message, int err = 0, std::string field = {})
      : code_(code), message_(std::move(message)), errno_(err), field_(std::move(field)) {}

  static Status ok() { return {}; }
  bool isOk() const { return code_ == Code::kOk; }
  explicit operator bool() const { return isOk(); }

  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // The errno behind a system-call failure, 0 otherwise.
  int sysErrno() const { return errno_; }
  // For kInvalidArgument: the request field at fault, if known.
  const std::string& field() const { return field_; }

  // Prefixes the message with context ("mount overlay: ...").
  Status& withContext(std::string_view ctx);
  std::string toString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
  int errno_ = 0;
  std::string field_;
};

// A failed system call: message "<what>: <strerror>", errno kept. ENOENT maps
// to kNotFound, EEXIST to kAlreadyExists, EACCES/EPERM to kPermissionDenied,
// ENOSPC/EMFILE/ENOMEM/EAGAIN to kResourceExhausted, others to kInternal.
Status sysError(std::string_view what, int err = errno);

inline Status invalidArg(std::string field, std::string message) {
  return Status(Code::kInvalidArgument, std::move(message), 0, std::move(field));
}
inline Status notFound(std::string message) { return Status(Code::kNotFound, std::move(message)); }
inline Status internalError(std::string message) {
  return Status(Code::kInternal, std::move(message));
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: implicit by design

  bool isOk() const { return v_.index() == 0; }
  explicit operator bool() const { return isOk(); }
  T& value() & { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  const T& value() const& { return std::get<0>(v_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T& operator*() const& { return value(); }
  const Status& status() const& {
    static const Status kOkStatus;
    return isOk() ? kOkStatus : std::get<1>(v_);
  }
  Status takeStatus() && { return isOk() ? Status() : std::get<1>(std::move(v_)); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace dsec

#define DSEC_CONCAT_INNER(a, b) a##b
#define DSEC_CONCAT(a, b) DSEC_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function if it is not ok.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::dsec::Status _st = (expr);               \
    if (!_st.isOk()) return _st;               \
  } while (0)

// ASSIGN_OR_RETURN(auto x, f()): unwraps a Result or returns its Status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(DSEC_CONCAT(_res_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.isOk()) return std::move(tmp).takeStatus(); \
  lhs = std::move(tmp).value()
