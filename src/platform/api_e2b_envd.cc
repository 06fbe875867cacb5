// E2B compatibility, the in-sandbox API (docs/e2b.md): what E2B's SDK asks
// of "envd" under E2B_SANDBOX_URL = <dsec>/e2b/envd, routed by its
// E2b-Sandbox-Id header and authenticated by X-Access-Token (the
// envdAccessToken create returned). The Connect protocol with the JSON codec
// (connect_rpc.h) for the process and filesystem services, /files for
// transfers, /health. Everything goes to dsec's own agent through the
// platform's operations: process sessions (processes.h), agent file ops.
#include <signal.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <charconv>
#include <deque>
#include <map>
#include <mutex>
#include <set>

#include "common/base64.h"
#include "common/log.h"
#include "common/runtime.h"
#include "common/sha256.h"
#include "common/util.h"
#include "platform/api_util.h"
#include "platform/connect_rpc.h"
#include "proto/codec.h"
#include "platform/platform.h"
#include "platform/session_reader.h"

namespace dsec::platform {

namespace {

// Keepalive-Ping-Interval when the client sends none (upstream envd's).
constexpr double kDefaultKeepaliveS = 50;
constexpr size_t kMaxListEntries = 20000;
constexpr uint64_t kMaxUpload = 4ull << 30;
constexpr size_t kMaxMultipart = 512u << 20;

void envdRestError(http::Response& res, const Status& st) {
  int status = httpStatusFor(st.code());
  std::string msg = st.message();
  if (!st.field().empty()) msg += " (field " + st.field() + ")";
  (void)res.send(status, "application/json",
                 dumpJson(json{{"code", status}, {"message", msg}}));
}

void unaryError(http::Response& res, const Status& st) {
  (void)res.send(connect::httpStatus(st.code()), "application/json", connect::errorJson(st));
}

// "Basic base64(user:)" -> user; empty when absent.
Result<std::string> basicUser(const std::string& auth) {
  if (auth.empty()) return std::string();
  if (!startsWith(auth, "Basic ")) return Status(Code::kUnauthenticated, "unsupported Authorization");
  auto dec = base64Decode(auth.substr(6));
  if (!dec.isOk()) return Status(Code::kUnauthenticated, "Authorization is not base64");
  std::string user = dec->substr(0, dec->find(':'));
  if (Status st = validateUserSpec(user, "user"); !st.isOk()) {
    return Status(Code::kUnauthenticated, st.message());
  }
  return user;
}

// E2B's EntryInfo from dsec's stat/list entry. `dir` is the listed
// directory (list entries carry only their name).
// Names of the sandbox's users and groups by id (its /etc/passwd and
// /etc/group, read per call: programs in it may add users).
struct Names {
  std::map<int64_t, std::string> users, groups;
  std::set<std::string> userNames;
  std::string user(int64_t uid) const {
    auto it = users.find(uid);
    return it == users.end() ? std::to_string(uid) : it->second;
  }
  std::string group(int64_t gid) const {
    auto it = groups.find(gid);
    return it == groups.end() ? std::to_string(gid) : it->second;
  }
};

void parseIds(const std::string& text, std::map<int64_t, std::string>& out,
              std::set<std::string>* names) {
  for (const std::string& line : splitString(text, '\n')) {
    auto f = splitString(line, ':');
    if (f.size() < 3 || f[0].empty()) continue;
    int64_t id = 0;
    auto [p, ec] = std::from_chars(f[2].data(), f[2].data() + f[2].size(), id);
    if (ec != std::errc() || p != f[2].data() + f[2].size()) continue;
    out.emplace(id, f[0]);
    if (names) names->insert(f[0]);
  }
}

json entryInfo(const json& e, const std::string& path, const Names& names) {
  std::string type = e.value("type", "");
  const char* ft = type == "file"      ? "FILE_TYPE_FILE"
                   : type == "dir"     ? "FILE_TYPE_DIRECTORY"
                   : type == "symlink" ? "FILE_TYPE_SYMLINK"
                                       : "FILE_TYPE_UNSPECIFIED";
  int64_t mode = e.value("mode", int64_t(0));
  // ls -l's permission string.
  std::string perm = type == "dir" ? "d" : type == "symlink" ? "l" : "-";
  const char* rwx = "rwxrwxrwx";
  for (int i = 0; i < 9; ++i) perm.push_back((mode >> (8 - i)) & 1 ? rwx[i] : '-');
  std::string name = path == "/" ? "/" : path.substr(path.rfind('/') + 1);
  json j = {{"name", name},
            {"type", ft},
            {"path", path},
            {"size", std::to_string(e.value("size", int64_t(0)))},
            {"mode", mode & 07777},
            {"permissions", perm},
            {"owner", names.user(e.value("uid", int64_t(0)))},
            {"group", names.group(e.value("gid", int64_t(0)))},
            {"modifiedTime", isoTime(e.value("mtime", 0.0))}};
  if (e.contains("target")) j["symlinkTarget"] = e["target"];
  if (e.contains("meta") && e["meta"].is_object() && !e["meta"].empty()) j["metadata"] = e["meta"];
  return j;
}

Names readNames(proto::EdgeLink& node, const std::string& id) {
  Names n;
  for (auto [path, map, set] :
       {std::tuple{"/etc/passwd", &n.users, &n.userNames}, std::tuple{"/etc/group", &n.groups, (std::set<std::string>*)nullptr}}) {
    std::string text;
    Status st = node.readFile(
        id, path, [](std::optional<uint64_t>) { return Status::ok(); },
        [&text](std::string_view d) {
          if (text.size() + d.size() > (4u << 20)) return Status(Code::kResourceExhausted, "too big");
          text.append(d);
          return Status::ok();
        });
    if (st.isOk()) parseIds(text, *map, set);
  }
  n.users.emplace(0, "root");
  n.groups.emplace(0, "root");
  n.userNames.insert("root");
  return n;
}

// A user named in a call must exist in the sandbox (E2B answers
// unauthenticated for one that does not). Numeric ids pass.
Status checkUser(const std::string& user, const Names& names) {
  if (user.empty()) return Status::ok();
  std::string name = user.substr(0, user.find(':'));
  bool numeric = !name.empty() && name.find_first_not_of("0123456789") == std::string::npos;
  if (numeric || names.userNames.count(name)) return Status::ok();
  return Status(Code::kUnauthenticated, "invalid username: '" + name + "' (no such user in the sandbox)");
}

Result<json> statEntry(proto::EdgeLink& node, const std::string& id, const std::string& path,
                       const Names& names) {
  ASSIGN_OR_RETURN(std::string r,
                   node.agentOp(id, proto::AgentOp::kStat, json{{"path", path}}.dump()));
  json j = json::parse(r, nullptr, false);
  if (!j.is_object()) return internalError("agent sent malformed JSON");
  return entryInfo(j, path, names);
}

std::string joinPath(const std::string& dir, const std::string& name) {
  return dir == "/" ? "/" + name : dir + "/" + name;
}

// The process a ProcessSelector names: {"pid": N} or {"tag": "t"}.
struct Selector {
  int pid = 0;
  std::string tag;
};
Result<Selector> selectorOf(const json& j) {
  auto p = j.find("process");
  if (p == j.end() || !p->is_object()) return invalidArg("process", "process (pid or tag) is required");
  Selector s;
  if (auto pid = p->find("pid"); pid != p->end() && pid->is_number_unsigned()) {
    s.pid = pid->get<int>();
  } else if (auto tag = p->find("tag"); tag != p->end() && tag->is_string()) {
    s.tag = tag->get<std::string>();
  } else {
    return invalidArg("process", "process needs a pid or a tag");
  }
  return s;
}

// A session's output as E2B's process event stream (Connect envelopes).
class ConnectProcessStream : public SessionReader {
 public:
  ConnectProcessStream(std::shared_ptr<ProcessSession> s, std::shared_ptr<http::Deferred> d,
                       uint64_t from, double keepaliveS, bool pty)
      : SessionReader(std::move(s), std::move(d), from, true, keepaliveS), pty_(pty) {}

 protected:
  std::string gap(uint64_t, uint64_t) override { return {}; }  // E2B has no notion of one
  std::string chunk(const ProcessSession::Chunk& c) override {
    const char* kind = pty_ ? "pty" : c.isErr ? "stderr" : "stdout";
    return connect::envelope(
        json{{"event", {{"data", {{kind, base64Encode(c.data)}}}}}}.dump());
  }
  std::string end(const Result<proto::ExecResult>& r, uint64_t) override {
    if (!r.isOk()) return connect::endStream(Status(Code::kUnavailable, r.status().message()));
    if (r->timedOut) {
      return connect::endStream(Status(Code::kDeadlineExceeded,
                                       "the process ran past its timeout and was killed"));
    }
    // As Go's ProcessState says it, which upstream envd reports.
    json end = {{"exited", r->signal == 0}};
    if (r->signal != 0) {
      end["exitCode"] = -1;
      end["status"] = std::string("signal: ") + (r->signal == SIGKILL ? "killed" : strsignal(r->signal));
      end["error"] = end["status"];
    } else {
      end["exitCode"] = r->exitCode;
      end["status"] = "exit status " + std::to_string(r->exitCode);
      if (r->exitCode != 0) end["error"] = end["status"];
    }
    return connect::envelope(json{{"event", {{"end", end}}}}.dump()) +
           connect::endStream(Status::ok());
  }
  std::string keepalive(uint64_t) override {
    return connect::envelope(R"({"event":{"keepalive":{}}})");
  }

 private:
  const bool pty_;
};

double keepaliveOf(http::Request& req) {
  std::string h = req.header("keepalive-ping-interval");
  double v = 0;
  auto [p, ec] = std::from_chars(h.data(), h.data() + h.size(), v);
  if (ec != std::errc() || p != h.data() + h.size() || v < 1 || v > 3600) return kDefaultKeepaliveS;
  return v;
}

// A stream that fails before its start event: E2B's client reads errors of
// streams only from a 200 with an end-stream envelope.
void streamError(http::Response& res, const Status& st) {
  (void)res.send(200, "application/connect+json", connect::endStream(st));
}

}  // namespace

void Platform::e2bEnvd(const std::vector<std::string>& p, http::Request& req,
                       http::Response& res) {
  // p: the path after /e2b/envd, split. The sandbox is the header's.
  const std::string id = req.header("e2b-sandbox-id");
  const std::string what = p.empty() ? "" : p[0];
  SandboxRecord rec;
  {
    std::lock_guard lk(mu_);
    auto it = id.empty() ? sandboxes_.end() : sandboxes_.find(id);
    if (it == sandboxes_.end() || !proto::isUp(it->second.state)) {
      // What envd behind a dead sandbox would be: unreachable (the SDK maps
      // 502 to "sandbox not running").
      (void)res.send(502, "application/json",
                     dumpJson(json{{"code", 502},
                                   {"message", id.empty() ? "E2b-Sandbox-Id header is required"
                                                          : "sandbox " + id + " is not running"}}));
      return;
    }
    rec = it->second;
  }
  if (what == "health") return (void)res.send(204, "", "");
  bool authed = req.header("x-access-token") == envdToken(id);
  if (!authed && what == "files") authed = validFileSignature(id, req);
  if (!authed) {
    Status st(Code::kUnauthenticated, "unauthorized access: X-Access-Token missing or wrong");
    return p.size() == 2 ? unaryError(res, st) : envdRestError(res, st);
  }
  Caller owner;
  owner.tenant = rec.owner;
  owner.admin = rec.owner == kAdminTenant;
  CallerScope scope(owner);
  if (what == "files" && p.size() == 1) return e2bFiles(rec, req, res);
  if (p.size() != 2 || req.method != "POST") {
    return unaryError(res, Status(Code::kNotFound, "no such envd endpoint: " + req.path));
  }
  const std::string& service = p[0];
  const std::string& method = p[1];
  const bool stream = connect::isStreamJson(req.header("content-type"));
  auto body = req.readBody(connect::kMaxMessage + 5);
  if (!body.isOk()) return stream ? streamError(res, body.status()) : unaryError(res, body.status());
  std::string msg = *body;
  if (stream) {
    auto one = connect::singleMessage(*body);
    if (!one.isOk()) return streamError(res, one.status());
    msg = *one;
  } else if (!connect::isUnaryJson(req.header("content-type"))) {
    return unaryError(res, invalidArg("content-type", "only Connect's JSON codec is served"));
  }
  json j = msg.empty() ? json::object() : json::parse(msg, nullptr, false);
  if (!j.is_object()) {
    Status st = invalidArg("body", "the message is not a JSON object");
    return stream ? streamError(res, st) : unaryError(res, st);
  }
  auto user = basicUser(req.header("authorization"));
  if (!user.isOk()) return stream ? streamError(res, user.status()) : unaryError(res, user.status());
  if (service == "process.Process") return e2bProcess(rec, method, j, *user, stream, req, res);
  if (service == "filesystem.Filesystem") return e2bFilesystem(rec, method, j, *user, stream, req, res);
  unaryError(res, Status(Code::kNotFound, "no such service: " + service));
}

// ---- process.Process ----

void Platform::e2bProcess(const SandboxRecord& rec, const std::string& method, const json& j,
                          const std::string& user, bool stream, http::Request& req,
                          http::Response& res) {
  const std::string& id = rec.id;
  if (method == "Start" || method == "Connect") {
    if (!stream) return unaryError(res, invalidArg("content-type", method + " is a stream"));
    std::shared_ptr<ProcessSession> s;
    uint64_t from = 0;
    if (method == "Start") {
      auto proc = j.find("process");
      if (proc == j.end() || !proc->is_object() || !proc->contains("cmd")) {
        return streamError(res, invalidArg("process", "process.cmd is required"));
      }
      if (!user.empty()) {
        if (Status st = checkUser(user, readNames(*cluster_, id)); !st.isOk()) {
          return streamError(res, st);
        }
      }
      json cmd = json::array({proc->value("cmd", "")});
      for (auto& a : proc->value("args", json::array())) cmd.push_back(a);
      json body = {{"cmd", cmd}};
      if (proc->contains("envs")) body["env"] = (*proc)["envs"];
      if (proc->contains("cwd") && (*proc)["cwd"].is_string()) body["cwd"] = (*proc)["cwd"];
      if (!user.empty()) body["user"] = user;
      if (j.contains("tag") && j["tag"].is_string()) body["tag"] = j["tag"];
      auto t = connect::timeoutMs(req.header("connect-timeout-ms"));
      if (!t.isOk()) return streamError(res, t.status());
      if (*t > 0) body["timeout_s"] = double(*t) / 1000;
      if (auto pty = j.find("pty"); pty != j.end() && pty->is_object()) {
        json size = pty->value("size", json::object());
        body["pty"] = {{"rows", size.value("rows", 24)}, {"cols", size.value("cols", 80)}};
      } else {
        body["stdin"] = j.value("stdin", false);
      }
      auto started = startSession(id, body, req, nullptr);
      if (!started.isOk()) return streamError(res, started.status());
      s = *started;
    } else {
      auto sel = selectorOf(j);
      if (!sel.isOk()) return streamError(res, sel.status());
      s = findSession(id, sel->pid, sel->tag);
      // E2B forgets a process once it ends.
      if (!s || !s->running()) return streamError(res, Status(Code::kNotFound, "process not found"));
      // No replay: what it writes from now on.
      from = s->outputEnd();
    }
    auto d = res.defer();
    (void)d->beginChunked(200, "application/connect+json");
    // The start event first, at once: the SDK waits for it.
    (void)d->write(connect::envelope(json{{"event", {{"start", {{"pid", s->pid()}}}}}}.dump()));
    SessionReader::start(std::make_shared<ConnectProcessStream>(s, d, from, keepaliveOf(req),
                                                                s->hasPty()));
    return;
  }
  if (stream) return streamError(res, Status(Code::kNotFound, "no such stream: " + method));
  if (method == "List") {
    json list = json::array();
    for (auto& s : processes_->list(id)) {
      if (!s->running()) continue;
      const std::vector<std::string>& argv = s->argv();
      json cfg = {{"cmd", argv.empty() ? "" : argv[0]},
                  {"args", std::vector<std::string>(argv.begin() + (argv.empty() ? 0 : 1), argv.end())},
                  {"envs", s->askedEnv()}};
      if (!s->cwd().empty()) cfg["cwd"] = s->cwd();
      json one = {{"pid", s->pid()}, {"config", cfg}};
      if (!s->tag().empty()) one["tag"] = s->tag();
      list.push_back(one);
    }
    return sendJson(res, 200, dumpJson(json{{"processes", list}}));
  }
  auto sel = selectorOf(j);
  if (!sel.isOk()) return unaryError(res, sel.status());
  auto s = findSession(id, sel->pid, sel->tag);
  if (!s || !s->running()) {
    return unaryError(res, Status(Code::kNotFound, sel->tag.empty()
                                                       ? "process with pid " + std::to_string(sel->pid) + " not found"
                                                       : "process with tag " + sel->tag + " not found"));
  }
  Status st;
  if (method == "SendInput") {
    json in = j.value("input", json::object());
    std::string b64 = in.contains("pty") ? in.value("pty", "") : in.value("stdin", "");
    auto bytes = base64Decode(b64);
    if (!bytes.isOk()) return unaryError(res, invalidArg("input", "input is not base64"));
    if (!bytes->empty()) st = s->sendInput(*bytes);
  } else if (method == "CloseStdin") {
    st = s->sendInput("");
  } else if (method == "SendSignal") {
    json sig = j.value("signal", json("SIGNAL_UNSPECIFIED"));
    int n = sig.is_number_integer() ? sig.get<int>()
            : sig == "SIGNAL_SIGKILL" ? SIGKILL
            : sig == "SIGNAL_SIGTERM" ? SIGTERM
                                      : 0;
    if (n != SIGKILL && n != SIGTERM) return unaryError(res, invalidArg("signal", "SIGKILL or SIGTERM"));
    if (n == SIGKILL) {
      s->kill();
    } else {
      st = s->signal(n);
    }
  } else if (method == "Update") {
    json size = j.value("pty", json::object()).value("size", json::object());
    auto t = proto::termSizeFromJson(size, "pty");
    if (!t.isOk()) return unaryError(res, t.status());
    st = s->resize(*t);
  } else {
    return unaryError(res, Status(Code::kNotFound, "no such method: process.Process/" + method));
  }
  if (!st.isOk()) return unaryError(res, st);
  sendJson(res, 200, "{}");
}

std::shared_ptr<ProcessSession> Platform::findSession(const std::string& id, int pid,
                                                      const std::string& tag) {
  if (pid > 0) return processes_->find(id, pid);
  std::shared_ptr<ProcessSession> found;
  for (auto& s : processes_->list(id)) {
    if (s->tag() == tag && (!found || s->running())) found = s;
  }
  return found;
}

// ---- filesystem.Filesystem ----

Result<std::string> Platform::e2bPath(const SandboxRecord& rec, const std::string& user,
                                      const std::string& path) {
  if (path.empty()) return invalidArg("path", "path is required");
  if (path[0] == '/') return path;
  // Relative to the user's home, as envd has it.
  std::string u = user.empty() ? rec.user : user;
  u = u.substr(0, u.find(':'));
  std::string home = (u.empty() || u == "root" || u == "0") ? "/root" : "/home/" + u;
  return home + "/" + path;
}

void Platform::e2bFilesystem(const SandboxRecord& rec, const std::string& method, const json& j,
                             const std::string& user, bool stream, http::Request& req,
                             http::Response& res) {
  const std::string& id = rec.id;
  const Names names = readNames(*cluster_, id);
  if (Status st = checkUser(user, names); !st.isOk()) {
    return stream ? streamError(res, st) : unaryError(res, st);
  }
  if (method == "WatchDir") {
    if (!stream) return unaryError(res, invalidArg("content-type", "WatchDir is a stream"));
    auto path = e2bPath(rec, user, j.value("path", ""));
    if (!path.isOk()) return streamError(res, path.status());
    // allowNetworkMounts asks nothing of a poll: any file system is watched.
    return e2bWatch(rec, *path, j.value("recursive", false), j.value("includeEntry", false), req,
                    res);
  }
  if (stream) return streamError(res, Status(Code::kNotFound, "no such stream: " + method));
  if (method == "CreateWatcher" || method == "GetWatcherEvents" || method == "RemoveWatcher") {
    return e2bWatcher(rec, method, j, user, res);
  }
  auto reply = [&](const Result<json>& r) {
    if (!r.isOk()) return unaryError(res, r.status());
    sendJson(res, 200, dumpJson(*r));
  };
  if (method == "Move") {
    auto src = e2bPath(rec, user, j.value("source", ""));
    auto dst = e2bPath(rec, user, j.value("destination", ""));
    if (!src.isOk()) return unaryError(res, src.status());
    if (!dst.isOk()) return unaryError(res, dst.status());
    if (auto st = statEntry(*cluster_, id, *src, names); !st.isOk()) {
      return unaryError(res, st.status());
    }
    proto::ExecSpec spec;
    spec.argv = {"mv", "-f", "-T", "--", *src, *dst};
    spec.user = user.empty() ? rec.user : user;
    spec.timeoutMs = 60000;
    auto r = cluster_->exec(id, spec, nullptr);
    if (!r.isOk()) return unaryError(res, r.status());
    if (r->exitCode != 0) {
      std::string err = r->err;
      while (!err.empty() && err.back() == '\n') err.pop_back();
      Code code = err.find("ermission denied") != std::string::npos ? Code::kPermissionDenied
                  : err.find("No such file") != std::string::npos ? Code::kNotFound
                                                                  : Code::kInvalidArgument;
      return unaryError(res, Status(code, err.empty() ? "move failed" : err));
    }
    auto e = statEntry(*cluster_, id, *dst, names);
    if (!e.isOk()) return reply(e);
    return reply(json{{"entry", *e}});
  }
  auto path = e2bPath(rec, user, j.value("path", ""));
  if (!path.isOk()) return unaryError(res, path.status());
  if (method == "Stat") {
    auto e = statEntry(*cluster_, id, *path, names);
    if (!e.isOk()) return reply(e);
    return reply(json{{"entry", *e}});
  }
  if (method == "MakeDir") {
    if (statEntry(*cluster_, id, *path, names).isOk()) {
      return unaryError(res, Status(Code::kAlreadyExists, "path " + *path + " already exists"));
    }
    auto r = cluster_->agentOp(id, proto::AgentOp::kMkdir,
                               json{{"path", *path}, {"parents", true}, {"mode", 0755}}.dump());
    if (!r.isOk()) return unaryError(res, r.status());
    auto e = statEntry(*cluster_, id, *path, names);
    if (!e.isOk()) return reply(e);
    return reply(json{{"entry", *e}});
  }
  if (method == "Remove") {
    auto r = cluster_->agentOp(id, proto::AgentOp::kRemove,
                               json{{"path", *path}, {"recursive", true}}.dump());
    if (!r.isOk()) return unaryError(res, r.status());
    return sendJson(res, 200, "{}");
  }
  if (method == "ListDir") {
    int64_t depth = j.value("depth", int64_t(1));
    if (depth < 1) depth = 1;
    json entries = json::array();
    // Breadth first, `depth` levels down; symlinks are not followed.
    std::deque<std::pair<std::string, int64_t>> todo = {{*path, 1}};
    bool first = true;
    while (!todo.empty() && entries.size() < kMaxListEntries) {
      auto [dir, level] = todo.front();
      todo.pop_front();
      auto r = cluster_->agentOp(id, proto::AgentOp::kList, json{{"path", dir}}.dump());
      if (!r.isOk()) {
        if (first) return unaryError(res, r.status());
        continue;  // a subdirectory that went or is unreadable
      }
      first = false;
      json l = json::parse(*r, nullptr, false);
      for (auto& e : l.value("entries", json::array())) {
        std::string child = joinPath(dir, e.value("name", ""));
        entries.push_back(entryInfo(e, child, names));
        if (e.value("type", "") == "dir" && level < depth) todo.emplace_back(child, level + 1);
      }
    }
    return reply(json{{"entries", entries}});
  }
  unaryError(res, Status(Code::kNotFound, "no such method: filesystem.Filesystem/" + method));
}

// ---- filesystem watch (WatchDir, and the Python SDK's CreateWatcher) ----

// A tree's state, polled: each poll() lists it (on the caller's thread: a
// worker) and tells what changed since the last one, as E2B's
// FilesystemEvent objects: created, written (size or mtime), removed. A
// poll, not inotify: it works on every backend and file system, including
// the lazily loaded image layers, at the price of latency (the polling
// interval) and of missing a change undone between two polls.
namespace {
struct Seen {
  std::string type;
  int64_t size = 0;
  double mtime = 0;
};
}  // namespace

struct E2bWatcher {
  static constexpr size_t kMaxEntries = 10000;
  std::mutex mu;  // one poll at a time (GetWatcherEvents)
  std::string sandbox, path;
  bool recursive = false;
  bool includeEntry = false;
  std::string owner;  // the tenant that made it (CreateWatcher)
  Names names;

  Result<json> poll(proto::EdgeLink& node) {
    std::map<std::string, Seen> now;
    std::map<std::string, json> entries;
    std::deque<std::string> todo = {""};
    while (!todo.empty() && now.size() < kMaxEntries) {
      std::string rel = todo.front();
      todo.pop_front();
      std::string dir = rel.empty() ? path : joinPath(path, rel);
      auto r = node.agentOp(sandbox, proto::AgentOp::kList, json{{"path", dir}}.dump());
      if (!r.isOk()) {
        if (rel.empty()) return r.status();
        continue;  // a subdirectory that went or is unreadable
      }
      json l = json::parse(*r, nullptr, false);
      for (auto& e : l.value("entries", json::array())) {
        std::string name = rel.empty() ? e.value("name", "") : rel + "/" + e.value("name", "");
        Seen st{e.value("type", ""), e.value("size", int64_t(0)), e.value("mtime", 0.0)};
        if (recursive && st.type == "dir") todo.push_back(name);
        now[name] = st;
        if (includeEntry) entries[name] = entryInfo(e, joinPath(path, name), names);
      }
    }
    json events = json::array();
    if (primed_) {
      auto event = [&](const std::string& name, const char* type) {
        json fs = {{"name", name}, {"type", type}};
        if (auto it = entries.find(name); it != entries.end()) fs["entry"] = it->second;
        events.push_back(std::move(fs));
      };
      for (auto& [name, st] : now) {
        auto old = seen_.find(name);
        if (old == seen_.end()) {
          event(name, "EVENT_TYPE_CREATE");
        } else if (st.type != "dir" &&
                   (old->second.size != st.size || old->second.mtime != st.mtime)) {
          // A directory's mtime moves with its entries, which get events of
          // their own (as inotify reports them).
          event(name, "EVENT_TYPE_WRITE");
        }
      }
      for (auto& [name, st] : seen_) {
        if (!now.count(name)) event(name, "EVENT_TYPE_REMOVE");
      }
    }
    seen_ = std::move(now);
    primed_ = true;
    return events;
  }

 private:
  std::map<std::string, Seen> seen_;
  bool primed_ = false;
};

namespace {

// The watched path must be a directory of the sandbox.
Status checkWatchable(proto::EdgeLink& node, const std::string& id, const std::string& path) {
  ASSIGN_OR_RETURN(std::string r,
                   node.agentOp(id, proto::AgentOp::kStat, json{{"path", path}}.dump()));
  if (json::parse(r, nullptr, false).value("type", "") != "dir") {
    return invalidArg("path", path + " is not a directory");
  }
  return Status::ok();
}

}  // namespace

void Platform::e2bWatch(const SandboxRecord& rec, const std::string& path, bool recursive,
                        bool includeEntry, http::Request& req, http::Response& res) {
  constexpr double kWatchPollS = 0.2;
  const std::string id = rec.id;
  auto t = connect::timeoutMs(req.header("connect-timeout-ms"));
  if (!t.isOk()) return streamError(res, t.status());
  if (Status st = checkWatchable(*cluster_, id, path); !st.isOk()) return streamError(res, st);
  struct Watch {
    E2bWatcher tree;
    std::shared_ptr<http::Deferred> d;
    double deadline = 0;  // monoSeconds; 0: none
    double keepaliveS = kDefaultKeepaliveS;
    double lastWrite = monoSeconds();
    std::shared_ptr<std::function<void()>> self;  // the polls, until the end
  };
  auto w = std::make_shared<Watch>();
  w->tree.sandbox = id;
  w->tree.path = path;
  w->tree.recursive = recursive;
  w->tree.includeEntry = includeEntry;
  if (includeEntry) w->tree.names = readNames(*cluster_, id);
  w->keepaliveS = keepaliveOf(req);
  if (*t > 0) w->deadline = monoSeconds() + double(*t) / 1000;
  w->d = res.defer();
  (void)w->d->beginChunked(200, "application/connect+json");
  (void)w->d->write(connect::envelope(R"({"start":{}})"));
  // poll runs on the blocking pool; it schedules the next one.
  auto poll = std::make_shared<std::function<void()>>();
  std::weak_ptr<std::function<void()>> weakPoll = poll;
  *poll = [this, w, weakPoll]() {
    auto end = [&](const Status& st) {
      (void)w->d->write(connect::endStream(st));
      (void)w->d->finish();
      w->self.reset();  // the last poll
    };
    if (w->d->gone()) {
      w->self.reset();
      return;
    }
    if (w->deadline > 0 && monoSeconds() >= w->deadline) {
      return end(Status(Code::kDeadlineExceeded, "the watch ran to its timeout"));
    }
    auto events = w->tree.poll(*cluster_);
    if (!events.isOk()) {
      // The directory went (the watch is over), or the sandbox did.
      return end(events.status().code() == Code::kNotFound
                     ? Status::ok()
                     : Status(Code::kUnavailable, events.status().message()));
    }
    std::string out;
    for (auto& ev : *events) out += connect::envelope(json{{"filesystem", ev}}.dump());
    if (out.empty() && monoSeconds() - w->lastWrite >= w->keepaliveS) {
      out = connect::envelope(R"({"keepalive":{}})");
    }
    if (!out.empty()) {
      (void)w->d->write(out);
      w->lastWrite = monoSeconds();
    }
    Runtime::global().after(kWatchPollS, [weakPoll] {
      if (auto p = weakPoll.lock()) Runtime::global().runBlocking(*p);
    });
  };
  // The watch holds its polls (the timers only a weak reference) until it
  // ends or sees its client gone.
  w->self = poll;
  Runtime::global().runBlocking(*poll);
}

// The polled watchers of E2B's Python SDK: CreateWatcher takes the first
// look, each GetWatcherEvents tells what changed since the one before.
void Platform::e2bWatcher(const SandboxRecord& rec, const std::string& method, const json& j,
                          const std::string& user, http::Response& res) {
  constexpr size_t kMaxWatchersPerSandbox = 64;
  if (method == "CreateWatcher") {
    auto path = e2bPath(rec, user, j.value("path", ""));
    if (!path.isOk()) return unaryError(res, path.status());
    if (Status st = checkWatchable(*cluster_, rec.id, *path); !st.isOk()) return unaryError(res, st);
    auto w = std::make_shared<E2bWatcher>();
    w->sandbox = rec.id;
    w->path = *path;
    w->recursive = j.value("recursive", false);
    w->includeEntry = j.value("includeEntry", false);
    w->owner = rec.owner;
    if (w->includeEntry) w->names = readNames(*cluster_, rec.id);
    if (auto first = w->poll(*cluster_); !first.isOk()) return unaryError(res, first.status());
    std::string wid = "w-" + randomHex(16);
    {
      std::lock_guard lk(e2bWatchersMu_);
      // Watchers of sandboxes that are gone go with them.
      size_t mine = 0;
      for (auto it = e2bWatchers_.begin(); it != e2bWatchers_.end();) {
        bool up = false;
        {
          std::lock_guard l2(mu_);
          auto sb = sandboxes_.find(it->second->sandbox);
          up = sb != sandboxes_.end() && proto::isUp(sb->second.state);
        }
        if (!up) {
          it = e2bWatchers_.erase(it);
          continue;
        }
        mine += it->second->sandbox == rec.id;
        ++it;
      }
      if (mine >= kMaxWatchersPerSandbox) {
        return unaryError(res, Status(Code::kResourceExhausted,
                                      "the sandbox has 64 watchers; remove one first"));
      }
      e2bWatchers_[wid] = w;
    }
    return sendJson(res, 200, dumpJson(json{{"watcherId", wid}}));
  }
  std::string wid = j.value("watcherId", "");
  std::shared_ptr<E2bWatcher> w;
  {
    std::lock_guard lk(e2bWatchersMu_);
    auto it = e2bWatchers_.find(wid);
    if (it != e2bWatchers_.end() && it->second->sandbox == rec.id) w = it->second;
    if (w && method == "RemoveWatcher") e2bWatchers_.erase(it);
  }
  if (!w) return unaryError(res, Status(Code::kNotFound, "watcher " + wid + " not found"));
  if (method == "RemoveWatcher") return sendJson(res, 200, "{}");
  // One poll at a time per watcher: its state is the last look.
  std::lock_guard lk(w->mu);
  auto events = w->poll(*cluster_);
  if (!events.isOk()) return unaryError(res, events.status());
  sendJson(res, 200, dumpJson(json{{"events", *events}}));
}

// ---- /files ----

bool Platform::validFileSignature(const std::string& id, http::Request& req) {
  auto sig = req.param("signature");
  auto path = req.param("path");
  if (!sig || !path) return false;
  std::string op = req.method == "GET" ? "read" : "write";
  std::string text = *path + ":" + op + ":" + req.param("username").value_or("") + ":" + envdToken(id);
  auto exp = req.param("signature_expiration");
  if (exp) {
    int64_t e = 0;
    auto [p, ec] = std::from_chars(exp->data(), exp->data() + exp->size(), e);
    if (ec != std::errc() || p != exp->data() + exp->size() || double(e) < nowSeconds()) return false;
    text += ":" + *exp;
  }
  std::string hex = sha256Hex(text), raw;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    raw.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  std::string want = "v1_" + base64Encode(raw);
  while (!want.empty() && want.back() == '=') want.pop_back();
  return *sig == want;
}

namespace {

// Inflates a gzip body as it arrives.
class Gunzip {
 public:
  Gunzip() { ok_ = inflateInit2(&z_, 16 + MAX_WBITS) == Z_OK; }
  ~Gunzip() {
    if (ok_) inflateEnd(&z_);
  }
  Result<std::string> feed(std::string_view in) {
    if (!ok_) return internalError("zlib init failed");
    std::string out;
    z_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
    z_.avail_in = static_cast<uInt>(in.size());
    char buf[64 << 10];
    while (z_.avail_in > 0 && !done_) {
      z_.next_out = reinterpret_cast<Bytef*>(buf);
      z_.avail_out = sizeof buf;
      int rc = inflate(&z_, Z_NO_FLUSH);
      if (rc != Z_OK && rc != Z_STREAM_END) {
        return invalidArg("content-encoding", "the body is not valid gzip");
      }
      out.append(buf, sizeof buf - z_.avail_out);
      if (rc == Z_STREAM_END) done_ = true;
    }
    return out;
  }

 private:
  z_stream z_{};
  bool ok_ = false;
  bool done_ = false;
};

struct Part {
  std::string filename;
  std::string data;
};

// multipart/form-data: the parts named "file" (RFC 7578).
Result<std::vector<Part>> multipartFiles(const std::string& body, const std::string& contentType) {
  size_t b = contentType.find("boundary=");
  if (b == std::string::npos) return invalidArg("content-type", "multipart without a boundary");
  std::string boundary = contentType.substr(b + 9);
  if (size_t semi = boundary.find(';'); semi != std::string::npos) boundary.resize(semi);
  if (boundary.size() >= 2 && boundary.front() == '"') boundary = boundary.substr(1, boundary.size() - 2);
  const std::string delim = "--" + boundary;
  std::vector<Part> out;
  size_t pos = body.find(delim);
  if (pos == std::string::npos) return invalidArg("body", "no multipart boundary in the body");
  for (;;) {
    pos += delim.size();
    if (body.compare(pos, 2, "--") == 0) break;  // the closing delimiter
    if (body.compare(pos, 2, "\r\n") != 0) return invalidArg("body", "malformed multipart body");
    pos += 2;
    size_t headersEnd = body.find("\r\n\r\n", pos);
    if (headersEnd == std::string::npos) return invalidArg("body", "malformed multipart part");
    std::string headers = body.substr(pos, headersEnd - pos);
    size_t dataStart = headersEnd + 4;
    size_t next = body.find("\r\n" + delim, dataStart);
    if (next == std::string::npos) return invalidArg("body", "unterminated multipart part");
    std::string lower = asciiLower(headers);
    if (lower.find("name=\"file\"") != std::string::npos) {
      Part p;
      size_t f = lower.find("filename=\"");
      if (f != std::string::npos) {
        size_t start = f + 10, end = headers.find('"', start);
        if (end == std::string::npos) return invalidArg("body", "malformed filename");
        p.filename = headers.substr(start, end - start);
      }
      p.data = body.substr(dataStart, next - dataStart);
      out.push_back(std::move(p));
    }
    pos = next + 2;
  }
  return out;
}

}  // namespace

void Platform::e2bFiles(const SandboxRecord& rec, http::Request& req, http::Response& res) {
  const std::string& id = rec.id;
  std::string user = req.param("username").value_or("");
  if (!user.empty()) {
    if (Status st = validateUserSpec(user, "username"); !st.isOk()) return envdRestError(res, st);
    if (Status st = checkUser(user, readNames(*cluster_, id)); !st.isOk()) {
      return envdRestError(res, st);
    }
  }
  std::optional<std::string> asked = req.param("path");
  if (req.method == "GET") {
    if (!asked) return envdRestError(res, invalidArg("path", "path is required"));
    auto path = e2bPath(rec, user, *asked);
    if (!path.isOk()) return envdRestError(res, path.status());
    Status st = sendSandboxFile(id, *path, res);
    if (st.code() == Code::kNotFound) st = Status(Code::kNotFound, "path '" + *path + "' does not exist");
    if (!st.isOk()) envdRestError(res, st);
    return;
  }
  if (req.method != "POST") return envdRestError(res, methodNotAllowed(req));
  // X-Metadata-<key>: <value> headers, kept as the file's metadata (keys
  // lower-case, as envd has them).
  json meta = json::object();
  for (auto& [name, value] : req.headers) {
    if (startsWith(name, "x-metadata-") && name.size() > 11) meta[name.substr(11)] = value;
  }
  // Writes one file: parents made, then the bytes (replacing it whole).
  auto writeOne = [&](const std::string& p, const proto::ByteSource& src) -> Result<json> {
    ASSIGN_OR_RETURN(std::string path, e2bPath(rec, user, p));
    std::string parent = path.substr(0, path.rfind('/'));
    if (!parent.empty()) {
      RETURN_IF_ERROR(cluster_->agentOp(id, proto::AgentOp::kMkdir,
                                        json{{"path", parent}, {"parents", true}, {"mode", 0755}}.dump())
                          .status());
    }
    RETURN_IF_ERROR(cluster_->writeFile(id, path, 0644, src).status());
    if (!meta.empty()) {
      RETURN_IF_ERROR(cluster_->agentOp(id, proto::AgentOp::kSetMeta,
                                        json{{"path", path}, {"meta", meta}}.dump())
                          .status());
    }
    if (!user.empty() && user != "root") {
      // Owned by the user who wrote it, as envd does.
      proto::ExecSpec spec;
      spec.argv = {"chown", "--", user, path};
      spec.timeoutMs = 30000;
      auto r = cluster_->exec(id, spec, nullptr);
      if (!r.isOk()) return r.status();
      if (r->exitCode != 0) return invalidArg("username", "chown " + user + ": " + r->err);
    }
    json entry = {{"name", path.substr(path.rfind('/') + 1)}, {"path", path}, {"type", "file"}};
    if (!meta.empty()) entry["metadata"] = meta;
    return entry;
  };
  std::string ctype = req.header("content-type");
  json written = json::array();
  if (startsWith(ctype, "multipart/form-data")) {
    auto body = req.readBody(kMaxMultipart);
    if (!body.isOk()) return envdRestError(res, body.status());
    auto parts = multipartFiles(*body, ctype);
    if (!parts.isOk()) return envdRestError(res, parts.status());
    if (parts->empty()) return envdRestError(res, invalidArg("file", "no part named file"));
    for (auto& part : *parts) {
      std::string p = asked && parts->size() == 1 ? *asked : part.filename;
      if (p.empty()) return envdRestError(res, invalidArg("path", "a part without a path"));
      size_t off = 0;
      proto::ByteSource src = [&](char* buf, size_t n) -> Result<size_t> {
        size_t k = std::min(n, part.data.size() - off);
        std::memcpy(buf, part.data.data() + off, k);
        off += k;
        return k;
      };
      auto one = writeOne(p, src);
      if (!one.isOk()) return envdRestError(res, one.status());
      written.push_back(*one);
    }
    return sendJson(res, 200, dumpJson(written));
  }
  if (!asked) return envdRestError(res, invalidArg("path", "path is required"));
  const bool gz = req.header("content-encoding") == "gzip";
  Gunzip unzip;
  std::string pending;
  size_t pendingOff = 0;
  uint64_t total = 0;
  bool eof = false;
  proto::ByteSource src = [&](char* buf, size_t n) -> Result<size_t> {
    while (pendingOff == pending.size() && !eof) {
      std::string raw(64 << 10, '\0');
      ASSIGN_OR_RETURN(size_t got, req.readSome(raw.data(), raw.size()));
      if (got == 0) {
        eof = true;
        break;
      }
      raw.resize(got);
      if (gz) {
        ASSIGN_OR_RETURN(pending, unzip.feed(raw));
      } else {
        pending = std::move(raw);
      }
      pendingOff = 0;
      total += pending.size();
      if (total > kMaxUpload) return Status(Code::kPayloadTooLarge, "file larger than 4 GiB");
    }
    size_t k = std::min(n, pending.size() - pendingOff);
    std::memcpy(buf, pending.data() + pendingOff, k);
    pendingOff += k;
    return k;
  };
  auto one = writeOne(*asked, src);
  if (!one.isOk()) return envdRestError(res, one.status());
  written.push_back(*one);
  sendJson(res, 200, dumpJson(written));
}

}  // namespace dsec::platform
