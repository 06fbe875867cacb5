#include "common/status.h"

#include <cstring>

namespace dsec {

const char* codeName(Code code) {
  switch (code) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid_argument";
    case Code::kUnauthenticated: return "unauthenticated";
    case Code::kPermissionDenied: return "permission_denied";
    case Code::kNotFound: return "not_found";
    case Code::kAlreadyExists: return "already_exists";
    case Code::kConflict: return "conflict";
    case Code::kFailedPrecondition: return "failed_precondition";
    case Code::kPayloadTooLarge: return "payload_too_large";
    case Code::kResourceExhausted: return "resource_exhausted";
    case Code::kDeadlineExceeded: return "deadline_exceeded";
    case Code::kUnavailable: return "unavailable";
    case Code::kDataLoss: return "data_loss";
    case Code::kInternal: return "internal";
    case Code::kQuotaExceeded: return "quota_exceeded";
    case Code::kRateLimited: return "rate_limited";
  }
  return "internal";
}

int httpStatusFor(Code code) {
  switch (code) {
    case Code::kOk: return 200;
    case Code::kInvalidArgument: return 400;
    case Code::kUnauthenticated: return 401;
    case Code::kPermissionDenied: return 403;
    case Code::kNotFound: return 404;
    case Code::kAlreadyExists: return 409;
    case Code::kConflict: return 409;
    case Code::kFailedPrecondition: return 409;
    case Code::kPayloadTooLarge: return 413;
    case Code::kResourceExhausted: return 429;
    case Code::kDeadlineExceeded: return 504;
    case Code::kUnavailable: return 503;
    case Code::kDataLoss: return 502;
    case Code::kInternal: return 500;
    case Code::kQuotaExceeded: return 403;
    case Code::kRateLimited: return 429;
  }
  return 500;
}

Status& Status::withContext(std::string_view ctx) {
  if (!isOk()) message_ = std::string(ctx) + ": " + message_;
  return *this;
}

std::string Status::toString() const {
  if (isOk()) return "ok";
  std::string s = std::string(codeName(code_)) + ": " + message_;
  if (!field_.empty()) s += " (field " + field_ + ")";
  return s;
}

Status sysError(std::string_view what, int err) {
  Code code = Code::kInternal;
  switch (err) {
    case ENOENT: code = Code::kNotFound; break;
    case EEXIST: code = Code::kAlreadyExists; break;
    case EACCES:
    case EPERM:
    case EROFS: code = Code::kPermissionDenied; break;
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
    case EAGAIN:
    case EDQUOT: code = Code::kResourceExhausted; break;
    case ENOTDIR:
    case EISDIR:
    case EINVAL:
    case ENAMETOOLONG:
    case ELOOP: code = Code::kInvalidArgument; break;
    case ENOTEMPTY: code = Code::kFailedPrecondition; break;
    default: break;
  }
  return Status(code, std::string(what) + ": " + std::strerror(err), err);
}

}  // namespace dsec
