#include "platform/connect_rpc.h"

#include <nlohmann/json.hpp>

#include "common/util.h"

namespace dsec::platform::connect {

using json = nlohmann::json;

namespace {

std::string frame(uint8_t flags, std::string_view payload) {
  std::string out;
  out.reserve(5 + payload.size());
  out.push_back(static_cast<char>(flags));
  uint32_t n = static_cast<uint32_t>(payload.size());
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((n >> shift) & 0xff));
  out.append(payload);
  return out;
}

std::string mediaType(std::string_view contentType) {
  std::string t = asciiLower(contentType.substr(0, contentType.find(';')));
  while (!t.empty() && (t.back() == ' ' || t.back() == '\t')) t.pop_back();
  return t;
}

}  // namespace

std::string envelope(std::string_view json) { return frame(0, json); }

std::string endStream(const Status& st) {
  if (st.isOk()) return frame(kFlagEndStream, "{}");
  return frame(kFlagEndStream, "{\"error\":" + errorJson(st) + "}");
}

Result<std::string> singleMessage(std::string_view body) {
  if (body.size() < 5) return invalidArg("body", "a stream request is one Connect envelope");
  auto flags = static_cast<uint8_t>(body[0]);
  if (flags & kFlagCompressed) {
    return invalidArg("body", "compressed Connect messages are not supported");
  }
  const auto* u = reinterpret_cast<const unsigned char*>(body.data() + 1);
  uint32_t n = uint32_t(u[0]) << 24 | uint32_t(u[1]) << 16 | uint32_t(u[2]) << 8 | uint32_t(u[3]);
  if (n > kMaxMessage) return invalidArg("body", "Connect message too large");
  if (body.size() != 5 + size_t(n)) {
    return invalidArg("body", "a stream request is exactly one Connect envelope");
  }
  return std::string(body.substr(5));
}

const char* codeName(Code code) {
  switch (code) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid_argument";
    case Code::kUnauthenticated: return "unauthenticated";
    case Code::kPermissionDenied: return "permission_denied";
    case Code::kNotFound: return "not_found";
    case Code::kAlreadyExists: return "already_exists";
    case Code::kConflict: return "aborted";
    case Code::kFailedPrecondition: return "failed_precondition";
    case Code::kPayloadTooLarge: return "resource_exhausted";
    case Code::kResourceExhausted:
    case Code::kQuotaExceeded:
    case Code::kRateLimited: return "resource_exhausted";
    case Code::kDeadlineExceeded: return "deadline_exceeded";
    case Code::kUnavailable: return "unavailable";
    case Code::kDataLoss: return "data_loss";
    case Code::kInternal: return "internal";
  }
  return "unknown";
}

int httpStatus(Code code) {
  switch (code) {
    case Code::kOk: return 200;
    case Code::kInvalidArgument:
    case Code::kFailedPrecondition: return 400;
    case Code::kUnauthenticated: return 401;
    case Code::kPermissionDenied: return 403;
    case Code::kNotFound: return 404;
    case Code::kAlreadyExists:
    case Code::kConflict: return 409;
    case Code::kPayloadTooLarge:
    case Code::kResourceExhausted:
    case Code::kQuotaExceeded:
    case Code::kRateLimited: return 429;
    case Code::kDeadlineExceeded: return 504;
    case Code::kUnavailable: return 503;
    case Code::kDataLoss:
    case Code::kInternal: return 500;
  }
  return 500;
}

std::string errorJson(const Status& st) {
  std::string msg = st.message();
  if (!st.field().empty()) msg += " (field " + st.field() + ")";
  return json{{"code", connect::codeName(st.code())}, {"message", msg}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

bool isUnaryJson(std::string_view contentType) {
  return mediaType(contentType) == "application/json";
}

bool isStreamJson(std::string_view contentType) {
  return mediaType(contentType) == "application/connect+json";
}

Result<int64_t> timeoutMs(std::string_view header) {
  if (header.empty()) return int64_t{0};
  if (header.size() > 10) return invalidArg("connect-timeout-ms", "at most 10 digits");
  int64_t v = 0;
  for (char c : header) {
    if (c < '0' || c > '9') return invalidArg("connect-timeout-ms", "not a number of milliseconds");
    v = v * 10 + (c - '0');
  }
  return v;
}

}  // namespace dsec::platform::connect
