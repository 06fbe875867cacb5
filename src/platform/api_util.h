// JSON request parsing shared by the api_*.cc handlers: strict objects
// (unknown fields rejected), typed getters that name the offending field.
#pragma once

#include <sys/socket.h>

#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/http_server.h"
#include "common/status.h"
#include "image/image_config.h"

namespace dsec::platform {

using json = nlohmann::json;

constexpr size_t kMaxJsonBody = 16u << 20;

// Reads and parses the body as one JSON object; an empty body is {} when
// allowEmpty. Rejects keys not in `allowed`.
Result<json> parseObject(http::Request& req, std::initializer_list<const char*> allowed,
                         bool allowEmpty = false);
// The same for a body already read.
Result<json> parseObjectText(const std::string& body, std::initializer_list<const char*> allowed,
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

// Environment variables: a name that is non-empty and holds no '=' or NUL, a
// value without NUL. Errors name `field`.
Status validateEnv(const std::map<std::string, std::string>& env, const std::string& field);

// Who a command runs as: a name, uid, name:group or uid:gid, at most 64 bytes,
// without whitespace, control characters or NUL, each side of the one ':'
// non-empty. "" (unset) is fine. Whether a name exists is up to the sandbox's
// /etc/passwd, checked when a command runs. Errors name `field`.
Status validateUserSpec(const std::string& user, const std::string& field);

constexpr size_t kMaxConfigEnv = 256;
constexpr size_t kMaxWorkingDir = 1024;
constexpr size_t kMaxConfigArgs = 256;      // entrypoint, cmd items; labels
constexpr size_t kMaxConfigString = 65536;  // one of those items or label values

// The "config" of POST /v1/images: an object with only "user" (as
// validateUserSpec), "env" (a list of at most 256 "K=V" strings, K as
// validateEnv), "working_dir" (absolute, normalised, at most 1024 bytes),
// "entrypoint" and "cmd" (lists of at most 256 strings) and "labels" (an
// object of at most 256 strings), each optional. Errors name "config" or
// "config.<key>".
Result<image::ImageConfig> parseImageConfig(const json& config);
// {"user","env","working_dir","entrypoint","cmd","labels"}, all present
// (empty when unset).
json imageConfigToApi(const image::ImageConfig& c);
// The image config's Env as a map; a later entry of a key wins (as in Docker).
std::map<std::string, std::string> envMap(const std::vector<std::string>& env);

// JSON with invalid UTF-8 replaced (exec output is arbitrary bytes).
std::string dumpJson(const json& j);

// 400 "method M not allowed on PATH", field "method".
Status methodNotAllowed(const http::Request& req);

// The request's `label=key=value` query parameters (all must match), or 400
// naming "label".
Result<std::map<std::string, std::string>> labelFilter(const http::Request& req);

// Whether a tenant's pull may connect to `a` (RegistryOptions::allowAddress):
// an address on the public internet. Refused: IPv4 0/8, 10/8, 100.64/10
// (CGNAT), 127/8, 169.254/16, 172.16/12, 192.0.0/24, 192.0.2/24,
// 192.168/16, 198.18/15 (benchmarking), 198.51.100/24, 203.0.113/24,
// 224/4 (multicast), 240/4 (reserved, with 255.255.255.255); IPv6 outside
// 2000::/3 (so ::, ::1, fc00::/7, fe80::/10, ff00::/8), 2001::/23 (IETF
// protocols, Teredo), 2001:db8::/32 and 3fff::/20 (documentation). IPv6 that
// carries an IPv4 address is judged by it: ::ffff:0:0/96 (mapped), ::/96
// (compatible), 64:ff9b::/96 (NAT64), 2002::/16 (6to4). Families other than
// AF_INET and AF_INET6 are refused.
bool publicAddress(const sockaddr* a);

}  // namespace dsec::platform
