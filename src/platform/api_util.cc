#include "platform/api_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>

#include "common/util.h"

namespace dsec::platform {

Result<json> parseObject(http::Request& req, std::initializer_list<const char*> allowed,
                         bool allowEmpty) {
  ASSIGN_OR_RETURN(std::string body, req.readBody(kMaxJsonBody));
  return parseObjectText(body, allowed, allowEmpty);
}

Result<json> parseObjectText(const std::string& body, std::initializer_list<const char*> allowed,
                             bool allowEmpty) {
  if (body.empty() && allowEmpty) return json::object();
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return invalidArg("body", "request body is not valid JSON");
  if (!j.is_object()) return invalidArg("body", "request body must be a JSON object");
  for (auto& [k, v] : j.items()) {
    bool known = false;
    for (const char* a : allowed) known = known || k == a;
    if (!known) return invalidArg(k, "unknown field '" + k + "'");
  }
  return j;
}

Result<double> getNumber(const json& j, const char* field, double def, double min, double max) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number()) return invalidArg(field, std::string(field) + " must be a number");
  double v = it->get<double>();
  if (!std::isfinite(v) || v < min || v > max) {
    return invalidArg(field, std::string(field) + " must be between " + json(min).dump() +
                                 " and " + json(max).dump());
  }
  return v;
}

Result<int64_t> getInt(const json& j, const char* field, int64_t def, int64_t min, int64_t max) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number_integer()) return invalidArg(field, std::string(field) + " must be an integer");
  int64_t v = it->get<int64_t>();
  if (v < min || v > max) {
    return invalidArg(field, std::string(field) + " must be between " + std::to_string(min) +
                                 " and " + std::to_string(max));
  }
  return v;
}

Result<bool> getBool(const json& j, const char* field, bool def) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_boolean()) return invalidArg(field, std::string(field) + " must be true or false");
  return it->get<bool>();
}

Result<std::string> getString(const json& j, const char* field, const std::string& def,
                              size_t maxLen) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_string()) return invalidArg(field, std::string(field) + " must be a string");
  std::string v = it->get<std::string>();
  if (v.size() > maxLen) {
    return invalidArg(field, std::string(field) + " is longer than " + std::to_string(maxLen));
  }
  if (v.find('\0') != std::string::npos) {
    return invalidArg(field, std::string(field) + " must not contain NUL");
  }
  return v;
}

Result<std::map<std::string, std::string>> getStringMap(const json& j, const char* field) {
  std::map<std::string, std::string> out;
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_object()) return invalidArg(field, std::string(field) + " must be an object");
  for (auto& [k, v] : it->items()) {
    if (!v.is_string()) {
      return invalidArg(field, std::string(field) + "." + k + " must be a string");
    }
    out[k] = v.get<std::string>();
  }
  return out;
}

Result<std::vector<std::string>> getStringList(const json& j, const char* field) {
  std::vector<std::string> out;
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_array()) return invalidArg(field, std::string(field) + " must be a list of strings");
  for (auto& v : *it) {
    if (!v.is_string()) return invalidArg(field, std::string(field) + " must be a list of strings");
    out.push_back(v.get<std::string>());
  }
  return out;
}

Status validateEnv(const std::map<std::string, std::string>& env, const std::string& field) {
  for (auto& [k, v] : env) {
    if (k.empty() || k.find('=') != std::string::npos || k.find('\0') != std::string::npos ||
        v.find('\0') != std::string::npos) {
      return invalidArg(field, "invalid environment variable name '" + k + "'");
    }
  }
  return Status::ok();
}

Status validateUserSpec(const std::string& user, const std::string& field) {
  if (user.empty()) return Status::ok();
  if (user.size() > 64) return invalidArg(field, field + " is longer than 64 bytes");
  for (char c : user) {
    auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f || std::isspace(u)) {
      return invalidArg(field, field + " must not contain whitespace or control characters");
    }
  }
  size_t colon = user.find(':');
  if (colon != std::string::npos &&
      (colon == 0 || colon + 1 == user.size() || user.find(':', colon + 1) != std::string::npos)) {
    return invalidArg(field,
                      field + " must be name, uid, name:group or uid:gid, not '" + user + "'");
  }
  return Status::ok();
}

Result<image::ImageConfig> parseImageConfig(const json& config) {
  image::ImageConfig c;
  if (config.is_null()) return c;
  if (!config.is_object()) return invalidArg("config", "config must be an object");
  for (auto& [k, v] : config.items()) {
    if (k != "user" && k != "env" && k != "working_dir" && k != "entrypoint" && k != "cmd" &&
        k != "labels") {
      return invalidArg("config." + k, "unknown field 'config." + k + "'");
    }
  }
  auto user = getString(config, "user", "", 64);
  if (!user.isOk()) return invalidArg("config.user", "config." + user.status().message());
  RETURN_IF_ERROR(validateUserSpec(*user, "config.user"));
  c.user = *user;

  if (auto env = config.find("env"); env != config.end() && !env->is_null()) {
    if (!env->is_array() || env->size() > kMaxConfigEnv) {
      return invalidArg("config.env", "config.env must be a list of at most " +
                                          std::to_string(kMaxConfigEnv) + " \"K=V\" strings");
    }
    for (auto& e : *env) {
      if (!e.is_string()) return invalidArg("config.env", "config.env items must be strings");
      std::string kv = e.get<std::string>();
      size_t eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) {
        return invalidArg("config.env", "config.env item '" + kv + "' is not K=V");
      }
      RETURN_IF_ERROR(validateEnv({{kv.substr(0, eq), kv.substr(eq + 1)}}, "config.env"));
      c.env.push_back(std::move(kv));
    }
  }

  auto dir = getString(config, "working_dir", "", kMaxWorkingDir);
  if (!dir.isOk()) return invalidArg("config.working_dir", "config." + dir.status().message());
  if (!dir->empty()) {
    bool normal = (*dir)[0] == '/';
    if (normal && *dir != "/") {
      for (auto& part : splitString(dir->substr(1), '/')) {
        normal = normal && !part.empty() && part != "." && part != "..";
      }
    }
    if (!normal) {
      return invalidArg(
          "config.working_dir",
          "config.working_dir must be an absolute, normalised path, not '" + *dir + "'");
    }
  }
  c.workingDir = *dir;

  for (auto [key, out] : {std::pair{"entrypoint", &c.entrypoint}, std::pair{"cmd", &c.cmd}}) {
    auto a = config.find(key);
    if (a == config.end() || a->is_null()) continue;
    const std::string field = std::string("config.") + key;
    if (!a->is_array() || a->size() > kMaxConfigArgs) {
      return invalidArg(field, field + " must be a list of at most " +
                                   std::to_string(kMaxConfigArgs) + " strings");
    }
    for (auto& x : *a) {
      if (!x.is_string() || x.get<std::string>().size() > kMaxConfigString ||
          x.get<std::string>().find('\0') != std::string::npos) {
        return invalidArg(field, field + " items must be strings of at most " +
                                     std::to_string(kMaxConfigString) + " bytes, without NUL");
      }
      out->push_back(x.get<std::string>());
    }
  }
  if (auto l = config.find("labels"); l != config.end() && !l->is_null()) {
    if (!l->is_object() || l->size() > kMaxConfigArgs) {
      return invalidArg("config.labels", "config.labels must be an object of at most " +
                                             std::to_string(kMaxConfigArgs) + " strings");
    }
    for (auto& [k, v] : l->items()) {
      if (k.empty() || k.size() > 256 || !v.is_string() ||
          v.get<std::string>().size() > kMaxConfigString) {
        return invalidArg("config.labels", "config.labels maps names of 1 to 256 bytes to "
                                           "strings of at most " +
                                               std::to_string(kMaxConfigString) + " bytes");
      }
      c.labels[k] = v.get<std::string>();
    }
  }
  return c;
}

json imageConfigToApi(const image::ImageConfig& c) {
  return {{"user", c.user},       {"env", c.env},   {"working_dir", c.workingDir},
          {"entrypoint", c.entrypoint}, {"cmd", c.cmd}, {"labels", c.labels}};
}

std::map<std::string, std::string> envMap(const std::vector<std::string>& env) {
  std::map<std::string, std::string> out;
  for (auto& kv : env) {
    size_t eq = kv.find('=');
    if (eq != std::string::npos && eq > 0) out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

std::string dumpJson(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

Status methodNotAllowed(const http::Request& req) {
  return Status(Code::kInvalidArgument, "method " + req.method + " not allowed on " + req.path, 0,
                "method");
}

Result<std::map<std::string, std::string>> labelFilter(const http::Request& req) {
  std::map<std::string, std::string> want;
  for (auto [it, end] = req.query.equal_range("label"); it != end; ++it) {
    size_t eq = it->second.find('=');
    if (eq == std::string::npos || eq == 0) {
      return invalidArg("label", "label filter must be key=value");
    }
    want[it->second.substr(0, eq)] = it->second.substr(eq + 1);
  }
  return want;
}

namespace {

bool publicIpv4(uint32_t ip) {
  auto in = [ip](uint32_t net, int bits) { return (ip >> (32 - bits)) == (net >> (32 - bits)); };
  return !(in(0x00000000, 8) ||   // "this network", 0.0.0.0
           in(0x0a000000, 8) ||   // RFC 1918
           in(0x64400000, 10) ||  // CGNAT
           in(0x7f000000, 8) ||   // loopback
           in(0xa9fe0000, 16) ||  // link-local (cloud metadata services)
           in(0xac100000, 12) ||  // RFC 1918
           in(0xc0000000, 24) ||  // IETF protocol assignments
           in(0xc0000200, 24) ||  // TEST-NET-1
           in(0xc0a80000, 16) ||  // RFC 1918
           in(0xc6120000, 15) ||  // benchmarking
           in(0xc6336400, 24) ||  // TEST-NET-2
           in(0xcb007100, 24) ||  // TEST-NET-3
           in(0xe0000000, 4) ||   // multicast
           in(0xf0000000, 4));    // reserved, and the broadcast address
}

uint32_t ipv4At(const in6_addr& ip, size_t offset) {
  uint32_t v;
  std::memcpy(&v, ip.s6_addr + offset, 4);
  return ntohl(v);
}

}  // namespace

bool publicAddress(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    return publicIpv4(ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr));
  }
  if (a->sa_family != AF_INET6) return false;
  const in6_addr& ip = reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
  const uint8_t* b = ip.s6_addr;
  auto zeros = [b](size_t from, size_t to) {
    return std::all_of(b + from, b + to, [](uint8_t x) { return x == 0; });
  };
  // Forms that carry an IPv4 address reach it (the kernel for mapped and
  // compatible ones, a NAT64 gateway or 6to4 relay for the others): judge
  // that address. :: and ::1 are compatible ones of 0.0.0.0 and 0.0.0.1.
  if (zeros(0, 10) && b[10] == 0xff && b[11] == 0xff) return publicIpv4(ipv4At(ip, 12));
  if (zeros(0, 12)) return publicIpv4(ipv4At(ip, 12));
  if (b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b && zeros(4, 12)) {
    return publicIpv4(ipv4At(ip, 12));
  }
  if (b[0] == 0x20 && b[1] == 0x02) return publicIpv4(ipv4At(ip, 2));
  // Only 2000::/3 is global unicast: everything else (ULA, link- and
  // site-local, multicast, discard-only, local-use NAT64, the reserved rest)
  // is refused wholesale rather than range by range.
  if ((b[0] & 0xe0) != 0x20) return false;
  if (b[0] == 0x20 && b[1] == 0x01 && (b[2] & 0xfe) == 0) {
    return false;  // 2001::/23: IETF protocol assignments, Teredo among them
  }
  if (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x0d && b[3] == 0xb8) {
    return false;  // 2001:db8::/32, documentation
  }
  if (b[0] == 0x3f && b[1] == 0xff && (b[2] & 0xf0) == 0) return false;  // 3fff::/20, documentation
  return true;
}

}  // namespace dsec::platform
