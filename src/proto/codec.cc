#include "proto/codec.h"

#include <algorithm>

#include "common/base64.h"

namespace dsec::proto {

json toJson(const SandboxSpec& s) {
  return {{"id", s.id},
          {"layers", s.layers},
          {"cpu", s.cpu},
          {"memory_bytes", s.memoryBytes},
          {"disk_bytes", s.diskBytes},
          {"disk_explicit", s.diskExplicit},
          {"pids", s.pids},
          {"fncall_init", s.fncallInit},
          {"init_policy", s.initPolicy},
          {"working_dir", s.workingDir},
          {"network", s.network}};
}

Result<SandboxSpec> specFromJson(const json& j) {
  try {
    SandboxSpec s;
    s.id = j.at("id").get<std::string>();
    s.layers = j.value("layers", std::vector<std::string>{});
    s.cpu = j.value("cpu", 1.0);
    s.memoryBytes = j.value("memory_bytes", int64_t(512) << 20);
    s.diskBytes = j.value("disk_bytes", int64_t(1) << 30);
    s.diskExplicit = j.value("disk_explicit", false);
    s.pids = j.value("pids", int64_t(1024));
    s.fncallInit = j.value("fncall_init", "");
    s.initPolicy = j.value("init_policy", "");
    s.workingDir = j.value("working_dir", "");
    s.network = j.value("network", false);
    return s;
  } catch (const std::exception& e) {
    return invalidArg("spec", std::string("bad sandbox spec: ") + e.what());
  }
}

json toJson(const ExecSpec& s) {
  json j = {{"argv", s.argv},
            {"env", s.env},
            {"cwd", s.cwd},
            {"user", s.user},
            {"timeout_ms", s.timeoutMs},
            {"max_output", s.maxOutput},
            {"fncall", s.fncallJson}};
  if (s.stdinData) j["stdin_b64"] = base64Encode(*s.stdinData);
  return j;
}

Result<ExecSpec> execFromJson(const json& j) {
  try {
    ExecSpec s;
    s.argv = j.at("argv").get<std::vector<std::string>>();
    s.env = j.value("env", std::vector<std::string>{});
    s.cwd = j.value("cwd", "");
    s.user = j.value("user", "");
    s.timeoutMs = j.value("timeout_ms", int64_t(60000));
    s.maxOutput = j.value("max_output", int64_t(1) << 20);
    s.fncallJson = j.value("fncall", "");
    if (j.contains("stdin_b64")) {
      auto d = base64Decode(j["stdin_b64"].get<std::string>());
      if (!d.isOk()) return invalidArg("stdin_b64", "not base64");
      s.stdinData = *d;
    }
    return s;
  } catch (const std::exception& e) {
    return invalidArg("exec", std::string("bad exec spec: ") + e.what());
  }
}

json toJson(const ExecResult& r) {
  return {{"exit_code", r.exitCode},
          {"signal", r.signal},
          {"timed_out", r.timedOut},
          {"truncated", r.truncated},
          {"oom_killed", r.oomKilled},
          {"duration_ms", r.durationMs},
          {"call", r.call},
          {"limit", r.limit},
          {"zygote_started", r.zygoteStarted},
          {"out_b64", base64Encode(r.out)},
          {"err_b64", base64Encode(r.err)}};
}

Result<ExecResult> resultFromJson(const json& j) {
  try {
    ExecResult r;
    r.exitCode = j.value("exit_code", 0);
    r.signal = j.value("signal", 0);
    r.timedOut = j.value("timed_out", false);
    r.truncated = j.value("truncated", false);
    r.oomKilled = j.value("oom_killed", false);
    r.durationMs = j.value("duration_ms", 0.0);
    r.call = j.value("call", false);
    r.limit = j.value("limit", "");
    r.zygoteStarted = j.value("zygote_started", false);
    auto out = base64Decode(j.value("out_b64", ""));
    auto err = base64Decode(j.value("err_b64", ""));
    if (!out.isOk() || !err.isOk()) return invalidArg("result", "exec output is not base64");
    r.out = std::move(*out);
    r.err = std::move(*err);
    return r;
  } catch (const std::exception& e) {
    return invalidArg("result", std::string("bad exec result: ") + e.what());
  }
}

json toJson(const EgressRule& r) {
  json ports = json::array();
  for (auto& p : r.ports) ports.push_back({p.lo, p.hi});
  return {{"family", r.family},
          {"addr", base64Encode(std::string_view(reinterpret_cast<const char*>(r.addr.data()),
                                                 r.addr.size()))},
          {"prefix", r.prefixLen},
          {"ports", ports}};
}

Result<EgressRule> ruleFromJson(const json& j) {
  try {
    EgressRule r;
    r.family = j.at("family").get<int>();
    auto a = base64Decode(j.at("addr").get<std::string>());
    if (!a.isOk() || a->size() != r.addr.size()) return invalidArg("rules", "bad egress address");
    std::copy(a->begin(), a->end(), r.addr.begin());
    r.prefixLen = j.at("prefix").get<int>();
    for (auto& p : j.at("ports")) {
      r.ports.push_back({p.at(0).get<uint16_t>(), p.at(1).get<uint16_t>()});
    }
    return r;
  } catch (const std::exception& e) {
    return invalidArg("rules", std::string("bad egress rule: ") + e.what());
  }
}

json errorJson(const Status& st) {
  json e = {{"code", codeName(st.code())}, {"message", st.message()}};
  if (!st.field().empty()) e["field"] = st.field();
  if (st.sysErrno() != 0) e["errno"] = st.sysErrno();
  return {{"error", e}};
}

Status statusFromError(const json& e) {
  if (!e.is_object()) return Status(Code::kInternal, "malformed error from the node");
  auto str = [&](const char* k) {
    auto it = e.find(k);
    return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  auto en = e.find("errno");
  int err = en != e.end() && en->is_number_integer() ? en->get<int>() : 0;
  std::string code = str("code");
  return Status(codeFromName(code.empty() ? "internal" : code), str("message"), err, str("field"));
}

Code codeFromName(const std::string& name) {
  for (Code c : {Code::kInvalidArgument, Code::kUnauthenticated, Code::kPermissionDenied,
                 Code::kNotFound, Code::kAlreadyExists, Code::kConflict, Code::kFailedPrecondition,
                 Code::kPayloadTooLarge, Code::kResourceExhausted, Code::kDeadlineExceeded,
                 Code::kUnavailable, Code::kDataLoss, Code::kInternal}) {
    if (name == codeName(c)) return c;
  }
  return Code::kInternal;
}

Status statusFromBody(int httpStatus, const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (!j.is_discarded() && j.is_object() && j.contains("error") && j["error"].is_object()) {
    return statusFromError(j["error"]);
  }
  Code c = httpStatus == 401   ? Code::kUnauthenticated
           : httpStatus == 404 ? Code::kNotFound
           : httpStatus == 503 ? Code::kUnavailable
                               : Code::kInternal;
  return Status(c, "HTTP " + std::to_string(httpStatus) + ": " + body.substr(0, 200));
}

json toJson(const InputAction& a) {
  return {{"kind", a.kind}, {"text", a.text}, {"key", a.key},
          {"x", a.x},       {"y", a.y},       {"button", a.button}};
}

Result<InputAction> inputFromJson(const json& j) {
  InputAction a;
  try {
    a.kind = j.at("kind").get<std::string>();
    a.text = j.value("text", "");
    a.key = j.value("key", "");
    a.x = j.value("x", 0);
    a.y = j.value("y", 0);
    a.button = j.value("button", "");
  } catch (const std::exception& e) {
    return invalidArg("input", std::string("bad input action: ") + e.what());
  }
  return a;
}

json toJson(const CgroupLimits& l) {
  return {{"cpu", l.cpu}, {"memory_bytes", l.memoryBytes}, {"pids", l.pids}};
}

Result<CgroupLimits> limitsFromJson(const json& j) {
  try {
    CgroupLimits l;
    l.cpu = j.at("cpu").get<double>();
    l.memoryBytes = j.value("memory_bytes", int64_t(0));
    l.pids = j.value("pids", int64_t(0));
    return l;
  } catch (const std::exception& e) {
    return invalidArg("limits", std::string("bad limits: ") + e.what());
  }
}

json toJson(const CgroupStats& s) {
  return {{"oom_kills", s.oomKills},
          {"pids_limit_hits", s.pidsLimitHits},
          {"memory_bytes", s.memoryBytes}};
}

Result<CgroupStats> statsFromJson(const json& j) {
  try {
    CgroupStats s;
    s.oomKills = j.value("oom_kills", int64_t(0));
    s.pidsLimitHits = j.value("pids_limit_hits", int64_t(0));
    s.memoryBytes = j.value("memory_bytes", int64_t(0));
    return s;
  } catch (const std::exception& e) {
    return invalidArg("stats", std::string("bad stats: ") + e.what());
  }
}

json toJson(const EgressDenials& d) { return {{"count", d.count}, {"last", d.last}}; }

Result<EgressDenials> denialsFromJson(const json& j) {
  try {
    EgressDenials d;
    d.count = j.value("count", uint64_t(0));
    d.last = j.value("last", "");
    return d;
  } catch (const std::exception& e) {
    return invalidArg("egress", std::string("bad egress denials: ") + e.what());
  }
}

json toJson(const image::BuiltLayer& l) {
  return {{"digest", l.digest},
          {"size", l.size},
          {"data_digest", l.dataDigest},
          {"data_size", l.dataSize},
          {"kind", l.kind}};
}

Result<image::BuiltLayer> builtLayerFromJson(const json& j) {
  try {
    image::BuiltLayer l;
    l.digest = j.at("digest").get<std::string>();
    l.size = j.value("size", int64_t(0));
    l.dataDigest = j.value("data_digest", "");
    l.dataSize = j.value("data_size", int64_t(0));
    l.kind = j.value("kind", "");
    return l;
  } catch (const std::exception& e) {
    return invalidArg("layer", std::string("bad layer: ") + e.what());
  }
}

std::string fncallInitJson(int64_t scratchBytes,
                           const std::map<std::string, std::vector<std::string>>& languages,
                           int64_t zygoteMaxCalls) {
  json j = {{"scratch_mb", std::max<int64_t>(1, scratchBytes >> 20)}, {"prestart", {"python"}}};
  if (!languages.empty()) j["languages"] = languages;
  if (zygoteMaxCalls > 0) j["zygote_max_calls"] = zygoteMaxCalls;
  return j.dump();
}

}  // namespace dsec::proto
