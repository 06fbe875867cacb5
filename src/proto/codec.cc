#include "proto/codec.h"

#include <sys/socket.h>

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "common/base64.h"

namespace dsec::proto {
namespace {

// What the readers below throw, and each decoder's catch turns into its
// kInvalidArgument: what() names the key, as nlohmann's type errors do not.
struct BadField : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// v as T. An integer must be whole and fit T: nlohmann's get would truncate
// 1.5 and wrap 70000 into a uint16_t port.
template <class T>
T as(const json& v, const std::string& name) {
  try {
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      if (!v.is_number_integer()) throw BadField(name + ": not an integer");
      bool fits = v.is_number_unsigned() ? std::in_range<T>(v.get<uint64_t>())
                                         : std::in_range<T>(v.get<int64_t>());
      if (!fits) throw BadField(name + ": out of range");
    }
    return v.get<T>();
  } catch (const json::exception& e) {
    throw BadField(name + ": " + e.what());
  }
}

const json& member(const json& j, const char* k, bool& found) {
  if (!j.is_object()) throw BadField("not an object");
  auto it = j.find(k);
  found = it != j.end();
  return found ? *it : j;
}

template <class T>
T req(const json& j, const char* k) {
  bool found;
  const json& v = member(j, k, found);
  if (!found) throw BadField(std::string(k) + ": missing");
  return as<T>(v, k);
}

template <class T>
T opt(const json& j, const char* k, T def) {
  bool found;
  const json& v = member(j, k, found);
  return found ? as<T>(v, k) : def;
}

// A size, count or limit, where a negative value means nothing.
template <class T>
T nonNeg(const json& j, const char* k, T def) {
  T v = opt(j, k, def);
  if (v < 0) throw BadField(std::string(k) + ": negative");
  return v;
}

}  // namespace

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
    s.id = req<std::string>(j, "id");
    s.layers = opt(j, "layers", std::vector<std::string>{});
    s.cpu = nonNeg(j, "cpu", 1.0);
    s.memoryBytes = nonNeg(j, "memory_bytes", int64_t(512) << 20);
    s.diskBytes = nonNeg(j, "disk_bytes", int64_t(1) << 30);
    s.diskExplicit = opt(j, "disk_explicit", false);
    s.pids = nonNeg(j, "pids", int64_t(1024));
    s.fncallInit = opt(j, "fncall_init", std::string());
    s.initPolicy = opt(j, "init_policy", std::string());
    s.workingDir = opt(j, "working_dir", std::string());
    s.network = opt(j, "network", false);
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
  if (s.interactive) j["interactive"] = true;
  if (s.pty) j["pty"] = {{"rows", s.pty->rows}, {"cols", s.pty->cols}};
  return j;
}

Result<TermSize> termSizeFromJson(const json& j, const std::string& field) {
  if (!j.is_object()) return invalidArg(field, field + " must be an object {rows, cols}");
  TermSize t;
  for (auto [key, out] : {std::pair{"rows", &t.rows}, std::pair{"cols", &t.cols}}) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() < 1 ||
        it->get<int64_t>() > 65535) {
      return invalidArg(key, std::string(key) + " must be an integer from 1 to 65535");
    }
    *out = static_cast<uint16_t>(it->get<int64_t>());
  }
  return t;
}

Result<ExecSpec> execFromJson(const json& j) {
  try {
    ExecSpec s;
    s.argv = req<std::vector<std::string>>(j, "argv");
    s.env = opt(j, "env", std::vector<std::string>{});
    s.cwd = opt(j, "cwd", std::string());
    s.user = opt(j, "user", std::string());
    s.timeoutMs = nonNeg(j, "timeout_ms", int64_t(60000));
    s.maxOutput = nonNeg(j, "max_output", int64_t(1) << 20);
    s.fncallJson = opt(j, "fncall", std::string());
    if (j.contains("stdin_b64")) {
      auto d = base64Decode(req<std::string>(j, "stdin_b64"));
      if (!d.isOk()) return invalidArg("stdin_b64", "not base64");
      s.stdinData = *d;
    }
    s.interactive = opt(j, "interactive", false);
    if (j.contains("pty") && !j["pty"].is_null()) {
      ASSIGN_OR_RETURN(s.pty, termSizeFromJson(j["pty"], "pty"));
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
    r.exitCode = opt(j, "exit_code", 0);
    r.signal = opt(j, "signal", 0);
    r.timedOut = opt(j, "timed_out", false);
    r.truncated = opt(j, "truncated", false);
    r.oomKilled = opt(j, "oom_killed", false);
    r.durationMs = opt(j, "duration_ms", 0.0);
    r.call = opt(j, "call", false);
    r.limit = opt(j, "limit", std::string());
    r.zygoteStarted = opt(j, "zygote_started", false);
    auto out = base64Decode(opt(j, "out_b64", std::string()));
    auto err = base64Decode(opt(j, "err_b64", std::string()));
    if (!out.isOk()) return invalidArg("result", "bad exec result: out_b64: not base64");
    if (!err.isOk()) return invalidArg("result", "bad exec result: err_b64: not base64");
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
    r.family = req<int>(j, "family");
    if (r.family != AF_INET && r.family != AF_INET6) throw BadField("family: not AF_INET(6)");
    auto a = base64Decode(req<std::string>(j, "addr"));
    if (!a.isOk() || a->size() != r.addr.size()) throw BadField("addr: not 16 bytes of base64");
    std::copy(a->begin(), a->end(), r.addr.begin());
    r.prefixLen = req<int>(j, "prefix");
    if (r.prefixLen < 0 || r.prefixLen > (r.family == AF_INET ? 32 : 128)) {
      throw BadField("prefix: out of range");
    }
    json ports = req<json>(j, "ports");
    if (!ports.is_array()) throw BadField("ports: not an array");
    for (auto& p : ports) {
      if (!p.is_array() || p.size() != 2) throw BadField("ports: not [lo, hi]");
      PortRange pr{as<uint16_t>(p[0], "ports"), as<uint16_t>(p[1], "ports")};
      if (pr.lo > pr.hi) throw BadField("ports: lo above hi");
      r.ports.push_back(pr);
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
    a.kind = req<std::string>(j, "kind");
    a.text = opt(j, "text", std::string());
    a.key = opt(j, "key", std::string());
    a.x = opt(j, "x", 0);
    a.y = opt(j, "y", 0);
    a.button = opt(j, "button", std::string());
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
    l.cpu = req<double>(j, "cpu");
    if (l.cpu < 0) throw BadField("cpu: negative");
    l.memoryBytes = nonNeg(j, "memory_bytes", int64_t(0));
    l.pids = nonNeg(j, "pids", int64_t(0));
    return l;
  } catch (const std::exception& e) {
    return invalidArg("limits", std::string("bad limits: ") + e.what());
  }
}

json toJson(const CgroupStats& s) {
  return {{"oom_kills", s.oomKills},
          {"pids_limit_hits", s.pidsLimitHits},
          {"memory_bytes", s.memoryBytes},
          {"cpu_usec", s.cpuUsec},
          {"pids", s.pids}};
}

Result<CgroupStats> statsFromJson(const json& j) {
  try {
    CgroupStats s;
    s.oomKills = opt(j, "oom_kills", int64_t(0));
    s.pidsLimitHits = opt(j, "pids_limit_hits", int64_t(0));
    s.memoryBytes = opt(j, "memory_bytes", int64_t(0));
    s.cpuUsec = opt(j, "cpu_usec", int64_t(0));
    s.pids = opt(j, "pids", int64_t(0));
    return s;
  } catch (const std::exception& e) {
    return invalidArg("stats", std::string("bad stats: ") + e.what());
  }
}

json toJson(const StatsSeries& s) {
  json samples = json::array();
  for (auto& x : s.samples) samples.push_back({x.t, x.cpuUsec, x.memoryBytes, x.pids});
  return {{"interval_s", s.intervalS}, {"samples", std::move(samples)}};
}

Result<StatsSeries> seriesFromJson(const json& j) {
  try {
    StatsSeries s;
    s.intervalS = opt(j, "interval_s", 0.0);
    for (auto& x : j.at("samples")) {
      if (!x.is_array() || x.size() != 4) return invalidArg("samples", "bad stats sample");
      s.samples.push_back(
          {x[0].get<double>(), x[1].get<int64_t>(), x[2].get<int64_t>(), x[3].get<int64_t>()});
    }
    return s;
  } catch (const std::exception& e) {
    return invalidArg("samples", std::string("bad stats history: ") + e.what());
  }
}

json toJson(const EgressDenials& d) { return {{"count", d.count}, {"last", d.last}}; }

Result<EgressDenials> denialsFromJson(const json& j) {
  try {
    EgressDenials d;
    d.count = opt(j, "count", uint64_t(0));
    d.last = opt(j, "last", std::string());
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
    l.digest = req<std::string>(j, "digest");
    l.size = nonNeg(j, "size", int64_t(0));
    l.dataDigest = opt(j, "data_digest", std::string());
    l.dataSize = nonNeg(j, "data_size", int64_t(0));
    l.kind = opt(j, "kind", std::string());
    return l;
  } catch (const std::exception& e) {
    return invalidArg("layer", std::string("bad layer: ") + e.what());
  }
}

json toJson(const LayerDesc& d) {
  json extra = json::array();
  for (auto& x : d.extraData) {
    json e = {{"digest", x.digest}, {"size", x.size}, {"chunks_digest", x.chunksDigest}};
    if (!x.reclaimed.empty()) e["reclaimed"] = x.reclaimed;
    extra.push_back(std::move(e));
  }
  return {{"digest", d.digest},
          {"size", d.size},
          {"data_digest", d.dataDigest},
          {"data_size", d.dataSize},
          {"chunks_digest", d.chunksDigest},
          {"extra_data", std::move(extra)}};
}

Result<LayerDesc> layerDescFromJson(const json& j) {
  try {
    LayerDesc d;
    d.digest = req<std::string>(j, "digest");
    d.size = nonNeg(j, "size", int64_t(0));
    d.dataDigest = opt(j, "data_digest", std::string());
    d.dataSize = nonNeg(j, "data_size", int64_t(0));
    d.chunksDigest = opt(j, "chunks_digest", std::string());
    bool found;
    const json& extra = member(j, "extra_data", found);
    if (found && !extra.is_null()) {
      if (!extra.is_array()) throw BadField("extra_data: not an array");
      for (size_t i = 0; i < extra.size(); ++i) {
        try {
          DataBlobDesc x;
          x.digest = req<std::string>(extra[i], "digest");
          x.size = nonNeg(extra[i], "size", int64_t(0));
          x.chunksDigest = opt(extra[i], "chunks_digest", std::string());
          x.reclaimed = opt(extra[i], "reclaimed", std::string());
          d.extraData.push_back(std::move(x));
        } catch (const BadField& e) {
          throw BadField("extra_data[" + std::to_string(i) + "]." + e.what());
        }
      }
    }
    return d;
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
