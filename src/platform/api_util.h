// JSON request parsing shared by the api_*.cc handlers: strict objects
// (unknown fields rejected), typed getters that name the offending field.
#pragma once

#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/http_server.h"
#include "common/status.h"

namespace dsec::platform {

using json = nlohmann::json;

constexpr size_t kMaxJsonBody = 16u << 20;

// Reads and parses the body as one JSON object; an empty body is {} when
// allowEmpty. Rejects keys not in `allowed`.
Result<json> parseObject(http::Request& req, std::initializer_list<const char*> allowed,
                         bool allowEmpty = false);

Result<double> getNumber(const json& j, const char* field, double def, double min, double max);
Result<int64_t> getInt(const json& j, const char* field, int64_t def, int64_t min, int64_t max);
Result<bool> getBool(const json& j, const char* field, bool def);
Result<std::string> getString(const json& j, const char* field, const std::string& def,
                              size_t maxLen);
// A {"k": "v"} object of strings.
Result<std::map<std::string, std::string>> getStringMap(const json& j, const char* field);
// A list of strings; empty when absent or null.
Result<std::vector<std::string>> getStringList(const json& j, const char* field);

// JSON with invalid UTF-8 replaced (exec output is arbitrary bytes).
std::string dumpJson(const json& j);

}  // namespace dsec::platform
