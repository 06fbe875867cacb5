// fncall calls (docs/fncall.md): POST /v1/run runs code once in a warm pool
// sandbox of its image (edge/backends/fncall/run_pool.h); POST
// /v1/sandboxes/{id}/run runs it in a fncall sandbox, whose /scratch keeps
// its files between calls.
#include <cmath>

#include "common/log.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"

namespace dsec::platform {

namespace {

constexpr size_t kMaxCode = 256u << 10;
constexpr size_t kMaxFilesBytes = 384u << 10;
constexpr size_t kMaxFiles = 256;
constexpr size_t kMaxRunStdin = 1u << 20;
constexpr int64_t kMaxRunOutput = 16ll << 20;

// The first byte offset at which `s` is not UTF-8, or npos.
size_t badUtf8At(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return i;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return i;
    }
    i += n;
  }
  return std::string::npos;
}

bool validRelPath(const std::string& p) {
  if (p.empty() || p.size() > 1024 || p[0] == '/' || p.find('\0') != std::string::npos) {
    return false;
  }
  for (const auto& part : splitString(p, '/')) {
    if (part.empty() || part == "." || part == "..") return false;
  }
  return true;
}

struct RunPlan {
  proto::ExecSpec spec;
  bool b64 = false;
  std::string language;
};

// The parts of a run request both endpoints share. `oneShot`: files are
// allowed (written into the call's fresh dir).
Result<RunPlan> planRun(const json& j, bool oneShot, const std::map<std::string, std::string>& baseEnv) {
  RunPlan plan;
  proto::ExecSpec& spec = plan.spec;
  auto codeIt = j.find("code");
  if (codeIt == j.end() || codeIt->is_null()) return invalidArg("code", "code is required");
  if (!codeIt->is_string()) return invalidArg("code", "code must be a string");
  const std::string& code = codeIt->get_ref<const std::string&>();
  if (code.size() > kMaxCode) {
    return Status(Code::kPayloadTooLarge,
                  "code is " + std::to_string(code.size()) + " bytes; at most " +
                      std::to_string(kMaxCode) + " are allowed",
                  0, "code");
  }
  if (code.find('\0') != std::string::npos) return invalidArg("code", "code must not hold NUL");
  ASSIGN_OR_RETURN(std::string language, getString(j, "language", "python", 32));
  if (language.empty()) return invalidArg("language", "language must not be empty");
  for (char c : language) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) {
      return invalidArg("language", "unknown language '" + language + "'");
    }
  }
  plan.language = language;
  json call = {{"language", language}, {"code", code}};

  json files = json::object();
  size_t fileBytes = 0;
  for (const char* field : {"files", "files_b64"}) {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) continue;
    if (!oneShot) {
      return invalidArg(field, std::string(field) +
                                   " are for one-shot runs; write a sandbox's files with the "
                                   "files API (they persist in /scratch)");
    }
    if (!it->is_object()) {
      return invalidArg(field, std::string(field) + " must map relative paths to contents");
    }
    for (auto f = it->begin(); f != it->end(); ++f) {
      if (!validRelPath(f.key())) {
        return invalidArg(field, "'" + f.key() + "' is not a relative path without '..'");
      }
      if (!f.value().is_string()) {
        return invalidArg(field, "the contents of '" + f.key() + "' must be a string");
      }
      std::string data = f.value().get<std::string>();
      if (std::string(field) == "files_b64") {
        auto dec = base64Decode(data);
        if (!dec.isOk()) return invalidArg(field, "'" + f.key() + "' is not base64");
        data = std::move(*dec);
      }
      if (files.contains(f.key())) {
        return invalidArg(field, "'" + f.key() + "' is given twice");
      }
      fileBytes += data.size();
      files[f.key()] = base64Encode(data);
    }
  }
  if (files.size() > kMaxFiles) {
    return invalidArg("files", "at most " + std::to_string(kMaxFiles) + " files");
  }
  if (fileBytes > kMaxFilesBytes) {
    return Status(Code::kPayloadTooLarge,
                  "files hold " + std::to_string(fileBytes) + " bytes; at most " +
                      std::to_string(kMaxFilesBytes) + " are allowed (use a sandbox and the "
                      "files API for more)",
                  0, "files");
  }
  if (!files.empty()) call["files"] = files;

  ASSIGN_OR_RETURN(double timeout, getNumber(j, "timeout_s", 10, 0.001, 3600));
  spec.timeoutMs = std::max<int64_t>(1, int64_t(timeout * 1000));
  // CPU time past the wall clock would never be reached: the wall clock is
  // the limit a caller sees, unless it asks for a tighter CPU limit.
  json limits = {{"cpu_s", int64_t(std::ceil(timeout)) + 1}, {"file_size_mb", 64},
                 {"open_files", 1024}};
  if (auto it = j.find("limits"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return invalidArg("limits", "limits must be an object");
    static const std::pair<const char*, int64_t> kLimits[] = {{"cpu_s", 86400},
                                                              {"memory_mb", 1 << 20},
                                                              {"processes", 1 << 20},
                                                              {"file_size_mb", 1 << 20},
                                                              {"open_files", 1 << 20}};
    for (auto l = it->begin(); l != it->end(); ++l) {
      const std::pair<const char*, int64_t>* known = nullptr;
      for (auto& k : kLimits) {
        if (l.key() == k.first) known = &k;
      }
      std::string field = "limits." + l.key();
      if (!known) return invalidArg(field, "unknown limit '" + l.key() + "'");
      if (!l.value().is_number_integer() || l.value().get<int64_t>() < 1 ||
          l.value().get<int64_t>() > known->second) {
        return invalidArg(field, field + " must be an integer from 1 to " +
                                     std::to_string(known->second));
      }
      limits[l.key()] = l.value();
    }
  }
  call["limits"] = limits;

  ASSIGN_OR_RETURN(int64_t cap, getInt(j, "max_output_bytes", 1 << 20, 0, kMaxRunOutput));
  spec.maxOutput = cap;
  ASSIGN_OR_RETURN(std::string encoding, getString(j, "encoding", "utf-8", 16));
  if (encoding != "utf-8" && encoding != "base64") {
    return invalidArg("encoding", "encoding must be utf-8 or base64");
  }
  plan.b64 = encoding == "base64";
  if (j.contains("stdin") && j.contains("stdin_b64")) {
    return invalidArg("stdin", "give stdin or stdin_b64, not both");
  }
  if (auto it = j.find("stdin"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return invalidArg("stdin", "stdin must be a string");
    if (it->get_ref<const std::string&>().size() > kMaxRunStdin) {
      return Status(Code::kPayloadTooLarge, "stdin larger than 1 MiB", 0, "stdin");
    }
    spec.stdinData = it->get<std::string>();
  }
  if (auto it = j.find("stdin_b64"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return invalidArg("stdin_b64", "stdin_b64 must be a string");
    auto dec = base64Decode(it->get<std::string>());
    if (!dec.isOk()) return invalidArg("stdin_b64", "stdin_b64 is not base64");
    if (dec->size() > kMaxRunStdin) {
      return Status(Code::kPayloadTooLarge, "stdin larger than 1 MiB", 0, "stdin_b64");
    }
    spec.stdinData = std::move(*dec);
  }
  ASSIGN_OR_RETURN(auto env, getStringMap(j, "env"));
  RETURN_IF_ERROR(validateEnv(env, "env"));
  std::map<std::string, std::string> merged = baseEnv;
  for (auto& [k, v] : env) merged[k] = v;
  for (auto& [k, v] : merged) spec.env.push_back(k + "=" + v);
  spec.argv = {language};
  spec.fncallJson = call.dump();
  return plan;
}

json runResultJson(const proto::ExecResult& r, const RunPlan& plan) {
  json out = {{"exit_code", r.exitCode},   {"signal", r.signal},
              {"truncated", r.truncated},  {"timed_out", r.timedOut},
              {"oom_killed", r.oomKilled}, {"duration_ms", r.durationMs},
              {"limit", r.limit.empty() ? json(nullptr) : json(r.limit)},
              {"language", plan.language}};
  if (plan.b64) {
    out["stdout"] = base64Encode(r.out);
    out["stderr"] = base64Encode(r.err);
    out["encoding"] = "base64";
  } else {
    out["stdout"] = r.out;
    out["stderr"] = r.err;
  }
  return out;
}

// Like parseObject, but says where a body that is not UTF-8 goes wrong
// (code is text; binary belongs in files_b64 or stdin_b64).
Result<json> parseRunBody(http::Request& req, std::initializer_list<const char*> allowed) {
  ASSIGN_OR_RETURN(std::string body, req.readBody(kMaxJsonBody));
  if (size_t at = badUtf8At(body); at != std::string::npos) {
    return invalidArg("body", "request body is not valid UTF-8 (byte " + std::to_string(at) +
                                  "); code must be text, binary data goes in files_b64 or "
                                  "stdin_b64");
  }
  return parseObjectText(body, allowed);
}

}  // namespace

void Platform::runCode(http::Request& req, http::Response& res) {
  auto parsed = parseRunBody(req, {"image", "language", "code", "stdin", "stdin_b64", "files",
                                   "files_b64", "timeout_s", "limits", "max_output_bytes",
                                   "encoding", "env"});
  if (!parsed.isOk()) return sendError(res, parsed.status());
  const json& j = *parsed;
  auto image = getString(j, "image", opts_.runImage, 512);
  if (!image.isOk()) return sendError(res, image.status());
  std::vector<std::string> layers;
  std::map<std::string, std::string> baseEnv;
  std::string key;
  if (startsWith(*image, "sha256:")) {
    auto l = resolveLayers(*image, "", "image");
    if (!l.isOk()) return sendError(res, l.status());
    layers = *l;
    key = *image;
  } else {
    std::string name, tag;
    if (Status st = parseImageRef(*image, name, tag); !st.isOk()) {
      return sendError(res, invalidArg("image", st.message()));
    }
    auto img = visibleImage(name, tag);
    if (!img.isOk()) return sendError(res, img.status());
    layers = img->layers;
    baseEnv = envMap(img->config.env);
    key = name + ":" + tag;
  }
  auto plan = planRun(j, true, baseEnv);
  if (!plan.isOk()) return sendError(res, plan.status());
  // Checked here too (the agent checks again), so that a typo does not
  // build a pool.
  if (plan->language != "python" && plan->language != "bash" &&
      !cluster_->fncallLanguages().count(plan->language)) {
    std::string known = "python, bash";
    for (auto& [name, argv] : cluster_->fncallLanguages()) known += ", " + name;
    return sendError(res, invalidArg("language", "unknown language '" + plan->language +
                                                     "' (known: " + known + ")"));
  }
  // The caller's quotas (docs/tenants.md): a run is a creation (creates_per_s)
  // and, while under way, holds a warm sandbox of the pool's size
  // (max_sandboxes, max_cpu, max_memory_mb), checked and taken under the lock
  // that admits sandbox creates.
  auto owner = tenants_->tenant(currentCaller().tenant);
  if (!owner.isOk()) return sendError(res, owner.status());
  SandboxRecord asked;
  asked.cpu = opts_.runPool.cpu;
  asked.memoryMb = opts_.runPool.memoryBytes >> 20;
  {
    std::lock_guard lk(mu_);
    if (Status st = admitLocked(asked, *owner); !st.isOk()) return sendError(res, st);
    Usage& u = runsInFlight_[owner->id];
    u.runs++;
    u.cpu += asked.cpu;
    u.memoryMb += asked.memoryMb;
  }
  auto release = [this, tenant = owner->id, asked] {
    std::lock_guard lk(mu_);
    Usage& u = runsInFlight_[tenant];
    u.cpu -= asked.cpu;
    u.memoryMb -= asked.memoryMb;
    if (--u.runs <= 0) runsInFlight_.erase(tenant);
  };
  // One pool per (image, language): a pool's sandboxes keep that language's
  // zygote warm. The call is answered when it ends; no thread waits for it.
  auto d = res.defer();
  runPool_->runAsync(key + "|" + plan->language, layers, plan->spec,
                     [d, release, plan = *plan](Result<proto::ExecResult> r) {
                       release();
                       if (!r.isOk()) return sendError(*d, r.status());
                       sendJson(*d, 200, dumpJson(runResultJson(*r, plan)));
                     });
}

void Platform::runInSandbox(const std::string& id, http::Request& req, http::Response& res,
                            std::shared_ptr<void> activity) {
  auto parsed = parseRunBody(req, {"language", "code", "stdin", "stdin_b64", "timeout_s",
                                   "limits", "max_output_bytes", "encoding", "env"});
  if (!parsed.isOk()) return sendError(res, parsed.status());
  auto sb = runningSandbox(id);
  if (!sb.isOk()) return sendError(res, sb.status());
  if (sb->backend != BackendKind::kFncall) {
    return sendError(res, Status(Code::kFailedPrecondition,
                                 "sandbox " + id + " is a " + proto::backendName(sb->backend) +
                                     " sandbox; run needs backend fncall (use exec)"));
  }
  auto plan = planRun(*parsed, false, sb->env);
  if (!plan.isOk()) return sendError(res, plan.status());
  // Answered when the call ends; a client that goes away cancels it.
  auto d = res.defer();
  proto::ExecCallbacks cb;
  cb.onDone = [d, plan = *plan, activity](Result<proto::ExecResult> r) {
    if (!r.isOk()) return sendError(*d, r.status());
    sendJson(*d, 200, dumpJson(runResultJson(*r, plan)));
  };
  auto call = cluster_->startExec(id, plan->spec, std::move(cb));
  d->onClientGone([call] { call->cancel(); });
}

}  // namespace dsec::platform
