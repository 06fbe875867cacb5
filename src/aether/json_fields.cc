#include "aether/json_fields.h"

namespace dsec::aether {

namespace {
const Json* lookup(const Json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}
}  // namespace

Result<Json> parseObject(std::string_view payload) {
  // allow_exceptions=false: a parse error yields a "discarded" value instead.
  Json j = Json::parse(payload.begin(), payload.end(), nullptr, false);
  if (j.is_discarded()) return invalidArg("", "payload is not valid JSON");
  if (!j.is_object()) return invalidArg("", "payload is not a JSON object");
  return j;
}

Status readString(const Json& obj, const char* key, bool required, std::string& out) {
  const Json* v = lookup(obj, key);
  if (v == nullptr) {
    if (required) return invalidArg(key, std::string(key) + " is required");
    return Status::ok();
  }
  if (!v->is_string()) return invalidArg(key, std::string(key) + " must be a string");
  out = v->get_ref<const std::string&>();
  return Status::ok();
}

Status readBool(const Json& obj, const char* key, bool& out) {
  const Json* v = lookup(obj, key);
  if (v == nullptr) return Status::ok();
  if (!v->is_boolean()) return invalidArg(key, std::string(key) + " must be a boolean");
  out = v->get<bool>();
  return Status::ok();
}

Status readInt(const Json& obj, const char* key, int64_t min, int64_t max, int64_t& out) {
  const Json* v = lookup(obj, key);
  if (v == nullptr) return Status::ok();
  std::string range = std::string(key) + " must be an integer in [" + std::to_string(min) + ", " +
                      std::to_string(max) + "]";
  if (v->is_number_unsigned()) {
    uint64_t u = v->get<uint64_t>();
    // JSON parsers hand non-negative integers over as unsigned: check min too.
    if (u > static_cast<uint64_t>(max) || static_cast<int64_t>(u) < min) {
      return invalidArg(key, range);
    }
    out = static_cast<int64_t>(u);
  } else if (v->is_number_integer()) {
    int64_t i = v->get<int64_t>();
    if (i < min || i > max) return invalidArg(key, range);
    out = i;
  } else {
    return invalidArg(key, range);
  }
  return Status::ok();
}

Status readStringList(const Json& obj, const char* key, bool required,
                      std::vector<std::string>& out) {
  const Json* v = lookup(obj, key);
  if (v == nullptr) {
    if (required) return invalidArg(key, std::string(key) + " is required");
    return Status::ok();
  }
  std::string msg = std::string(key) + " must be an array of strings without NUL bytes";
  if (!v->is_array()) return invalidArg(key, msg);
  std::vector<std::string> list;
  list.reserve(v->size());
  for (const Json& e : *v) {
    if (!e.is_string()) return invalidArg(key, msg);
    const auto& s = e.get_ref<const std::string&>();
    // execve would silently cut the string at the NUL.
    if (s.find('\0') != std::string::npos) return invalidArg(key, msg);
    list.push_back(s);
  }
  out = std::move(list);
  return Status::ok();
}

Status readPath(const Json& obj, const char* key, std::string& out) {
  std::string p;
  RETURN_IF_ERROR(readString(obj, key, true, p));
  if (p.empty() || p[0] != '/') return invalidArg(key, std::string(key) + " must be absolute");
  if (p.find('\0') != std::string::npos) {
    return invalidArg(key, std::string(key) + " must not contain NUL bytes");
  }
  if (p.size() >= 4096) return invalidArg(key, std::string(key) + " is too long");
  out = std::move(p);
  return Status::ok();
}

std::string dumpJson(const Json& value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string errorJson(const Status& status) {
  Json j = {{"ok", false}, {"code", codeName(status.code())}, {"message", status.message()}};
  if (status.sysErrno() != 0) j["errno"] = status.sysErrno();
  if (!status.field().empty()) j["field"] = status.field();
  return dumpJson(j);
}

}  // namespace dsec::aether
