// Typed, non-throwing access to the fields of a request's JSON object, and
// JSON output that never throws. nlohmann::json throws on type mismatches and
// on invalid UTF-8 when dumping; every request payload comes from outside the
// sandbox's trust boundary, so aether reads JSON only through these helpers.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace dsec::aether {

using Json = nlohmann::json;

// Parses `payload` as a JSON object. Anything else (bad syntax, invalid
// UTF-8, an array) is kInvalidArgument.
Result<Json> parseObject(std::string_view payload);

// Each reader leaves `out` unchanged when the key is absent or null and
// `required` is false; a present value of the wrong type or range is
// kInvalidArgument naming `key` as the field.
Status readString(const Json& obj, const char* key, bool required, std::string& out);
Status readBool(const Json& obj, const char* key, bool& out);
Status readInt(const Json& obj, const char* key, int64_t min, int64_t max, int64_t& out);
Status readStringList(const Json& obj, const char* key, bool required,
                      std::vector<std::string>& out);
// A required absolute path without NUL bytes.
Status readPath(const Json& obj, const char* key, std::string& out);

// Serialises without throwing; invalid UTF-8 (say, in a file name) becomes U+FFFD.
std::string dumpJson(const Json& value);

// {"ok":false,"code":…,"message":…,"errno":N?,"field":…?}
std::string errorJson(const Status& status);

}  // namespace dsec::aether
