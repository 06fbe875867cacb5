#include "platform/api_util.h"

#include <cmath>

namespace dsec::platform {

Result<json> parseObject(http::Request& req, std::initializer_list<const char*> allowed,
                         bool allowEmpty) {
  ASSIGN_OR_RETURN(std::string body, req.readBody(kMaxJsonBody));
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

std::string dumpJson(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace dsec::platform
