// /v1/sandboxes/{id}/processes: process sessions, with or without a
// terminal (processes.h, docs/processes.md).
#include <signal.h>

#include <charconv>
#include <cstring>

#include "common/base64.h"
#include "common/runtime.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/platform.h"
#include "platform/processes.h"
#include "platform/session_reader.h"
#include "proto/codec.h"

namespace dsec::platform {

namespace {

constexpr size_t kMaxInputBytes = 1u << 20;
// A following client hears at least this often (a keepalive event when the
// process is quiet), so its read timeout tells a dead server from an idle shell.
constexpr double kKeepaliveS = 15;

// One GET .../output response: the session's output as NDJSON events.
class NdjsonOutput : public SessionReader {
 public:
  NdjsonOutput(std::shared_ptr<ProcessSession> s, std::shared_ptr<http::Deferred> d,
               uint64_t from, bool follow, bool b64)
      : SessionReader(std::move(s), std::move(d), from, follow, kKeepaliveS), b64_(b64) {}

 protected:
  std::string gap(uint64_t from, uint64_t next) override {
    // Output that left the window before this client read it.
    return line({{"type", "gap"}, {"offset", from}, {"next", next}});
  }
  std::string chunk(const ProcessSession::Chunk& c) override {
    json ev = {{"type", c.isErr ? "stderr" : "stdout"}, {"offset", c.offset}};
    if (b64_) {
      ev["data_b64"] = base64Encode(c.data);
    } else {
      ev["data"] = c.data;
    }
    return line(ev);
  }
  std::string end(const Result<proto::ExecResult>& r, uint64_t offset) override {
    if (!r.isOk()) {
      return line({{"type", "error"},
                   {"error", {{"code", codeName(r.status().code())}, {"message", r.status().message()}}}});
    }
    return line({{"type", "exit"},          {"exit_code", r->exitCode},
                 {"signal", r->signal},      {"timed_out", r->timedOut},
                 {"oom_killed", r->oomKilled}, {"duration_ms", r->durationMs},
                 {"offset", offset}});
  }
  std::string keepalive(uint64_t offset) override {
    return line({{"type", "keepalive"}, {"offset", offset}});
  }

 private:
  static std::string line(const json& ev) { return dumpJson(ev) + "\n"; }
  const bool b64_;
};

bool parsePid(const std::string& s, int& out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size() && out > 0;
}

Result<int> signalNumber(const json& j) {
  auto it = j.find("signal");
  if (it == j.end() || it->is_null()) return invalidArg("signal", "signal is required");
  if (it->is_number_integer()) {
    int64_t n = it->get<int64_t>();
    if (n < 1 || n > 64) return invalidArg("signal", "signal must be from 1 to 64");
    return static_cast<int>(n);
  }
  if (!it->is_string()) return invalidArg("signal", "signal must be a number or a name");
  std::string name = it->get<std::string>();
  if (name.rfind("SIG", 0) == 0) name = name.substr(3);
  static const std::pair<const char*, int> kNames[] = {
      {"HUP", SIGHUP},   {"INT", SIGINT},   {"QUIT", SIGQUIT}, {"KILL", SIGKILL},
      {"TERM", SIGTERM}, {"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"CONT", SIGCONT},
      {"STOP", SIGSTOP}, {"TSTP", SIGTSTP}, {"WINCH", SIGWINCH}, {"ALRM", SIGALRM},
      {"PIPE", SIGPIPE}};
  for (auto& [n, v] : kNames) {
    if (name == n) return v;
  }
  return invalidArg("signal", "unknown signal name: " + it->get<std::string>());
}

}  // namespace

void Platform::processesApi(const std::string& id, const std::vector<std::string>& parts,
                            http::Request& req, http::Response& res,
                            std::shared_ptr<void> activity) {
  const size_t n = parts.size();
  const std::string& m = req.method;
  // A sandbox that does not exist is that, whatever else is wrong with the
  // call (as another tenant's: nothing leaks, test_tenants).
  {
    std::lock_guard lk(mu_);
    if (!sandboxes_.count(id)) return sendError(res, notFound("sandbox " + id + " not found"));
  }
  if (n == 5) {
    if (m == "POST") return startProcess(id, req, res, std::move(activity));
    if (m == "GET") {
      auto sb = runningSandbox(id);
      if (!sb.isOk() && sb.status().code() == Code::kNotFound) return sendError(res, sb.status());
      json list = json::array();
      for (auto& s : processes_->list(id)) list.push_back(json::parse(s->infoJson()));
      return sendJson(res, 200, dumpJson(json{{"processes", list}}));
    }
    return sendError(res, methodNotAllowed(req));
  }
  int pid = 0;
  if (!parsePid(parts[5], pid)) {
    return sendError(res, invalidArg("pid", "pid must be a positive integer"));
  }
  auto s = processes_->find(id, pid);
  if (!s) {
    auto sb = runningSandbox(id);
    if (!sb.isOk() && sb.status().code() == Code::kNotFound) return sendError(res, sb.status());
    return sendError(res, Status(Code::kNotFound,
                                 "no process " + parts[5] + " in sandbox " + id, 0, "pid"));
  }
  if (n == 6) {
    if (m == "GET") return sendJson(res, 200, s->infoJson());
    if (m == "DELETE") {
      // SIGKILL to its process group (and a terminal's foreground job); the
      // session records the end.
      s->kill();
      return sendJson(res, 202, s->infoJson());
    }
    return sendError(res, methodNotAllowed(req));
  }
  const std::string& op = parts[6];
  if (n == 7 && op == "output") {
    if (m != "GET") return sendError(res, methodNotAllowed(req));
    uint64_t from = 0;
    if (auto o = req.param("offset")) {
      auto [p, ec] = std::from_chars(o->data(), o->data() + o->size(), from);
      if (ec != std::errc() || p != o->data() + o->size() || o->empty()) {
        return sendError(res, invalidArg("offset", "offset must be a non-negative integer"));
      }
    }
    bool follow = true;
    if (auto f = req.param("follow")) {
      if (*f != "true" && *f != "false") {
        return sendError(res, invalidArg("follow", "follow must be true or false"));
      }
      follow = *f == "true";
    }
    std::string enc = req.param("encoding").value_or("base64");
    if (enc != "base64" && enc != "utf-8") {
      return sendError(res, invalidArg("encoding", "encoding must be base64 or utf-8"));
    }
    auto d = res.defer();
    (void)d->beginChunked(200, "application/x-ndjson");
    SessionReader::start(std::make_shared<NdjsonOutput>(s, d, from, follow, enc == "base64"));
    return;
  }
  if (n == 7 && m != "POST") return sendError(res, methodNotAllowed(req));
  if (n == 7 && op == "input") {
    auto j = parseObject(req, {"data", "data_b64", "eof"});
    if (!j.isOk()) return sendError(res, j.status());
    if (j->contains("data") && j->contains("data_b64")) {
      return sendError(res, invalidArg("data", "give data or data_b64, not both"));
    }
    std::string bytes;
    if (auto it = j->find("data"); it != j->end() && !it->is_null()) {
      if (!it->is_string()) return sendError(res, invalidArg("data", "data must be a string"));
      bytes = it->get<std::string>();
    } else if (auto b = j->find("data_b64"); b != j->end() && !b->is_null()) {
      if (!b->is_string()) return sendError(res, invalidArg("data_b64", "data_b64 must be a string"));
      auto dec = base64Decode(b->get<std::string>());
      if (!dec.isOk()) return sendError(res, invalidArg("data_b64", "data_b64 is not base64"));
      bytes = std::move(*dec);
    }
    if (bytes.size() > kMaxInputBytes) {
      return sendError(res, Status(Code::kPayloadTooLarge, "input over 1 MiB in one request", 0,
                                   "data"));
    }
    auto eof = getBool(*j, "eof", false);
    if (!eof.isOk()) return sendError(res, eof.status());
    if (!bytes.empty()) {
      if (Status st = s->sendInput(bytes); !st.isOk()) return sendError(res, st);
    }
    if (*eof) {
      if (Status st = s->sendInput(""); !st.isOk()) return sendError(res, st);
    }
    return sendJson(res, 200, "{}");
  }
  if (n == 7 && op == "resize") {
    auto j = parseObject(req, {"rows", "cols"});
    if (!j.isOk()) return sendError(res, j.status());
    auto size = proto::termSizeFromJson(*j, "pty");
    if (!size.isOk()) return sendError(res, size.status());
    if (Status st = s->resize(*size); !st.isOk()) return sendError(res, st);
    return sendJson(res, 200, "{}");
  }
  if (n == 7 && op == "signal") {
    auto j = parseObject(req, {"signal"});
    if (!j.isOk()) return sendError(res, j.status());
    auto sig = signalNumber(*j);
    if (!sig.isOk()) return sendError(res, sig.status());
    if (Status st = s->signal(*sig); !st.isOk()) return sendError(res, st);
    return sendJson(res, 200, "{}");
  }
  sendError(res, notFound("no such endpoint: " + m + " " + req.path));
}

void Platform::startProcess(const std::string& id, http::Request& req, http::Response& res,
                            std::shared_ptr<void> activity) {
  auto parsed = parseObject(req, {"cmd", "env", "cwd", "user", "timeout_s", "pty", "stdin", "tag"});
  if (!parsed.isOk()) return sendError(res, parsed.status());
  auto s = startSession(id, *parsed, req, std::move(activity));
  if (!s.isOk()) return sendError(res, s.status());
  sendJson(res, 201, (*s)->infoJson());
}

Result<std::shared_ptr<ProcessSession>> Platform::startSession(const std::string& id,
                                                               const json& j, http::Request& req,
                                                               std::shared_ptr<void> activity) {
  json execArgs = json::object();
  for (const char* k : {"cmd", "env", "cwd", "user", "timeout_s"}) {
    if (j.contains(k)) execArgs[k] = j[k];
  }
  ASSIGN_OR_RETURN(ExecPlan plan, planExec(id, execArgs, req));
  proto::ExecSpec& spec = plan.spec;
  ASSIGN_OR_RETURN(SandboxRecord sb, runningSandbox(id));
  const PolicyLimits caps = policies_->limitsOf(sb.policy);
  // A session runs until it ends or is killed, unless asked (or a policy
  // says) otherwise; its output is a window, not a cap.
  if (!j.contains("timeout_s") || j["timeout_s"].is_null()) {
    spec.timeoutMs = caps.maxExecTimeoutS > 0 ? int64_t(caps.maxExecTimeoutS * 1000) : 0;
  }
  spec.maxOutput = caps.maxOutputBytes > 0 ? caps.maxOutputBytes : INT64_MAX;
  if (j.contains("pty") && !j["pty"].is_null()) {
    ASSIGN_OR_RETURN(spec.pty, proto::termSizeFromJson(j["pty"], "pty"));
  }
  ASSIGN_OR_RETURN(bool stdinOpen, getBool(j, "stdin", spec.pty.has_value()));
  if (spec.pty && !stdinOpen) return invalidArg("stdin", "a terminal's input is always open");
  spec.interactive = stdinOpen;
  ASSIGN_OR_RETURN(std::string tag, getString(j, "tag", "", 256));
  RETURN_IF_ERROR(processes_->checkRoom(id));

  auto session = std::make_shared<ProcessSession>(id, spec, tag, nowSeconds());
  if (auto env = getStringMap(j, "env"); env.isOk()) session->setAskedEnv(*env);
  proto::ExecCallbacks cb;
  std::weak_ptr<ProcessSession> weak = session;
  cb.onStarted = [weak](int pid) {
    if (auto s = weak.lock()) s->started(pid);
  };
  cb.onOutput = [weak](bool isErr, std::string_view data) {
    if (auto s = weak.lock()) s->output(isErr, data);
  };
  // The session keeps the sandbox busy (idle timeout, auto-pause) while it runs.
  cb.onDone = [weak, activity](Result<proto::ExecResult> r) {
    if (auto s = weak.lock()) s->done(std::move(r));
  };
  auto call = cluster_->startExec(id, spec, std::move(cb));
  session->setCall(call);
  auto pid = session->awaitStart(30);
  if (!pid.isOk()) {
    call->cancel();
    return pid.status();
  }
  processes_->add(session);
  return session;
}

}  // namespace dsec::platform
