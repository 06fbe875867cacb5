// The Connect protocol's wire pieces (connectrpc.com/docs/protocol), JSON
// codec only, as E2B's envd speaks it (docs/e2b.md): unary calls are a
// plain JSON body answered with a JSON body (200) or a JSON error
// {"code":"not_found","message":...} with the code's HTTP status;
// server-streaming calls take one envelope and answer 200 with envelopes,
// the last an end-stream envelope that carries any error.
//
// Envelope: u8 flags (0x01 compressed, 0x02 end of stream), u32 big-endian
// payload length, payload.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace dsec::platform::connect {

inline constexpr uint8_t kFlagCompressed = 0x01;
inline constexpr uint8_t kFlagEndStream = 0x02;
// The largest request message we take (a SendInput of a big paste).
inline constexpr size_t kMaxMessage = 4u << 20;

// One data envelope around `json`.
std::string envelope(std::string_view json);
// The end-stream envelope: {} on success, else {"error":{"code","message"}}.
std::string endStream(const Status& st);

// The one message of a server-streaming request body: kInvalidArgument for
// a body that is not exactly one uncompressed envelope (field "body").
Result<std::string> singleMessage(std::string_view body);

// The Connect code name of a status ("not_found", "invalid_argument", ...)
// and the HTTP status a unary error answers with.
const char* codeName(Code code);
int httpStatus(Code code);
// {"code":"...","message":"..."} (a unary error's body, or end-stream's error).
std::string errorJson(const Status& st);

// Whether a request's Content-Type is Connect's JSON for a unary call
// ("application/json", parameters allowed) or a stream
// ("application/connect+json").
bool isUnaryJson(std::string_view contentType);
bool isStreamJson(std::string_view contentType);

// Connect-Timeout-Ms: the client's deadline in milliseconds; 0 when absent.
// kInvalidArgument for a value that is not 1..10 digits.
Result<int64_t> timeoutMs(std::string_view header);

}  // namespace dsec::platform::connect
