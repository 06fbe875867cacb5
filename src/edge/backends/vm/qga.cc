#include "edge/backends/vm/qga.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>

#include "common/base64.h"
#include "common/log.h"
#include "common/util.h"

namespace dsec::edge {

using json = nlohmann::json;

namespace {

constexpr size_t kFileChunk = 1u << 20;           // bytes per guest-file-read/write
constexpr size_t kMaxWriteBytes = 256u << 20;     // a file_write is held in memory whole
constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
// Where an exec's output files live in the guest while it runs (runExec).
constexpr const char* kExecDir = "/run/dsec-exec";
constexpr int64_t kTailChunk = 65536;  // bytes per guest-file-read

// One of an exec's output files, read as it grows.
// The exec wrapper: $0 the tag, $1 the bytes to keep of each stream, then
// the command. The command's stdout and stderr are FIFOs; a reader for each
// (not the command's child: started from a subshell that exits) keeps the
// first $1 bytes in TAG.out / TAG.err and drains the rest to /dev/null, so
// that a flood costs the guest no more than that and the command neither
// blocks nor sees an error past the cap (as in a container). GNU head writes
// through stdio, which holds a file's output until 4 KiB or the end: stdbuf
// -o0 makes each read a write at once (busybox head writes unbuffered, and
// has no stdbuf). Each reader marks its end (TAG.od, TAG.ed) once every
// writer has closed. The shell execs the command: its pid and process group
// stay the command's.
constexpr const char* kExecWrapper = R"(d=/run/dsec-exec t=$0 n=$1
shift
mkdir -p "$d" && mkfifo -m 600 "$d/$t.o" "$d/$t.e" || exit 126
keep() { stdbuf -o0 head -c "$n" 2>/dev/null || head -c "$n"; cat >/dev/null; : >"$1"; }
( keep "$d/$t.od" <"$d/$t.o" >"$d/$t.out" 2>/dev/null &
  keep "$d/$t.ed" <"$d/$t.e" >"$d/$t.err" 2>/dev/null & )
exec "$@" >"$d/$t.o" 2>"$d/$t.e")";
// After the command's exit ($0 the tag): until both readers are done, for
// at most ~2 s. A background process the command left holding its output
// keeps a reader going; what it writes later is not the command's.
constexpr const char* kAwaitReaders = R"(d=/run/dsec-exec t=$0 i=0
while [ ! -e "$d/$t.od" ] || [ ! -e "$d/$t.ed" ]; do
  i=$((i+1)); [ $i -gt 100 ] && exit 1; sleep 0.02
done)";

struct Tail {
  std::string path;
  proto::FrameType type;
  int64_t handle = -1;  // qga's file handle once opened
  uint64_t sent = 0;    // bytes sent to the edge
};

Status writeAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return sysError("qga write");
    data.remove_prefix(size_t(n));
  }
  return Status::ok();
}

const char* apiCode(Code c) {
  switch (c) {
    case Code::kInvalidArgument:
      return "invalid_argument";
    case Code::kPermissionDenied:
      return "permission_denied";
    case Code::kNotFound:
      return "not_found";
    case Code::kAlreadyExists:
      return "already_exists";
    case Code::kFailedPrecondition:
      return "failed_precondition";
    case Code::kResourceExhausted:
      return "resource_exhausted";
    default:
      return "internal";
  }
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

Code codeFromText(const std::string& t) {
  if (t.find("No such file or directory") != std::string::npos) return Code::kNotFound;
  if (t.find("Permission denied") != std::string::npos ||
      t.find("Operation not permitted") != std::string::npos) {
    return Code::kPermissionDenied;
  }
  if (t.find("File exists") != std::string::npos) return Code::kAlreadyExists;
  if (t.find("Directory not empty") != std::string::npos) return Code::kFailedPrecondition;
  if (t.find("Is a directory") != std::string::npos ||
      t.find("Not a directory") != std::string::npos) {
    return Code::kInvalidArgument;
  }
  if (t.find("No space left") != std::string::npos ||
      t.find("Disk quota exceeded") != std::string::npos) {
    return Code::kResourceExhausted;
  }
  return Code::kInternal;
}

// ---- QgaClient ----

Result<json> QgaClient::readReply(double deadline) {
  for (;;) {
    // Sync replies start with 0xFF; anything before the last one is stale.
    size_t ff = buf_.rfind('\xff');
    if (ff != std::string::npos) buf_.erase(0, ff + 1);
    size_t nl = buf_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      if (trimmed(line).empty()) continue;
      json j = json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object()) continue;  // noise from a resync
      return j;
    }
    double left = deadline - monoSeconds();
    if (left <= 0) return Status(Code::kDeadlineExceeded, "qemu-guest-agent did not answer");
    struct pollfd p = {sock_.get(), POLLIN, 0};
    int r = ::poll(&p, 1, int(std::min(left, 1.0) * 1000) + 1);
    if (closed_) return Status(Code::kUnavailable, "guest agent connection closed");
    if (r < 0 && errno != EINTR) return sysError("poll qga");
    if (r <= 0) continue;
    char tmp[65536];
    ssize_t n = ::read(sock_.get(), tmp, sizeof tmp);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return Status(Code::kUnavailable, "guest agent connection closed");
    buf_.append(tmp, size_t(n));
  }
}

Status QgaClient::syncLocked(double deadline) {
  for (;;) {
    uint64_t id = (uint64_t(::getpid()) << 20) + ++nextSync_;
    std::string req = "\xff" + json{{"execute", "guest-sync-delimited"},
                                    {"arguments", {{"id", id}}}}.dump() + "\n";
    RETURN_IF_ERROR(writeAll(sock_.get(), req));
    double step = std::min(deadline, monoSeconds() + 2);
    for (;;) {
      auto r = readReply(step);
      if (!r.isOk()) {
        if (r.status().code() != Code::kDeadlineExceeded) return r.status();
        break;  // ask again: the guest may have opened its port meanwhile
      }
      auto ret = r->find("return");
      if (ret != r->end() && ret->is_number_unsigned() && ret->get<uint64_t>() == id) {
        desynced_ = false;
        return Status::ok();
      }
    }
    if (monoSeconds() >= deadline) {
      return Status(Code::kDeadlineExceeded, "qemu-guest-agent did not answer guest-sync");
    }
  }
}

Status QgaClient::sync(double deadline) {
  std::lock_guard lk(mu_);
  if (closed_) return Status(Code::kUnavailable, "guest agent connection closed");
  return syncLocked(deadline);
}

Result<json> QgaClient::call(const std::string& command, const json& args, double timeoutS) {
  std::lock_guard lk(mu_);
  if (closed_) return Status(Code::kUnavailable, "guest agent connection closed");
  if (desynced_) RETURN_IF_ERROR(syncLocked(monoSeconds() + std::min(timeoutS, 10.0)));
  json req = {{"execute", command}};
  if (!args.is_null()) req["arguments"] = args;
  RETURN_IF_ERROR(writeAll(sock_.get(), req.dump() + "\n"));
  auto r = readReply(monoSeconds() + timeoutS);
  if (!r.isOk()) {
    desynced_ = true;
    return Status(r.status()).withContext(command);
  }
  if (auto e = r->find("error"); e != r->end()) {
    std::string desc = e->is_object() ? e->value("desc", e->dump()) : e->dump();
    return Status(codeFromText(desc), command + ": " + desc);
  }
  auto ret = r->find("return");
  return ret == r->end() ? json::object() : *ret;
}

void QgaClient::close() {
  closed_ = true;
  ::shutdown(sock_.get(), SHUT_RDWR);
}

// ---- QgaBridge ----

struct QgaBridge::Pending {
  proto::FrameType type;
  json req;
  std::string data;
  bool failed = false;
};

QgaBridge::QgaBridge(UniqueFd agentEnd, std::shared_ptr<QgaClient> qga)
    : sock_(std::move(agentEnd)), qga_(std::move(qga)) {}

QgaBridge::~QgaBridge() { stop(); }

Status QgaBridge::start() {
  thread_ = std::thread([this] { loop(); });
  send(0, proto::FrameType::kHello, json{{"version", 1}, {"pid", 0}, {"agent", "qga"}}.dump());
  return Status::ok();
}

void QgaBridge::stop() {
  {
    std::lock_guard lk(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  qga_->close();
  ::shutdown(sock_.get(), SHUT_RDWR);
  if (thread_.joinable()) thread_.join();
  std::unique_lock lk(mu_);
  idleCv_.wait(lk, [&] { return active_ == 0; });
}

void QgaBridge::send(uint32_t stream, proto::FrameType type, std::string_view payload) {
  std::string out;
  while (payload.size() > proto::kMaxPayload) {
    proto::appendFrame(out, stream, type, payload.substr(0, proto::kDataChunk));
    payload.remove_prefix(proto::kDataChunk);
  }
  proto::appendFrame(out, stream, type, payload);
  std::lock_guard lk(writeMu_);
  (void)writeAll(sock_.get(), out);  // a dead edge side ends the loop anyway
}

void QgaBridge::sendResult(uint32_t stream, const Status& st, json extra) {
  json j = extra.is_object() ? extra : json::object();
  j["ok"] = st.isOk();
  if (!st.isOk()) {
    j["code"] = apiCode(st.code());
    j["message"] = st.message();
    if (!st.field().empty()) j["field"] = st.field();
  }
  send(stream, proto::FrameType::kResult, j.dump());
}

void QgaBridge::spawn(std::function<void()> work) {
  {
    std::lock_guard lk(mu_);
    if (stopping_) return;
    ++active_;
  }
  std::thread([this, work = std::move(work)] {
    work();
    std::lock_guard lk(mu_);
    if (--active_ == 0) idleCv_.notify_all();
  }).detach();
}

void QgaBridge::loop() {
  proto::FrameDecoder dec;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(sock_.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (!dec.feed(buf, size_t(n)).isOk()) break;
    proto::Frame f;
    while (dec.next(f)) dispatch(std::move(f));
  }
  // The edge side went: nothing more to serve. Running guest commands finish
  // in the guest; their results have nowhere to go.
  qga_->close();
}

void QgaBridge::dispatch(proto::Frame f) {
  using T = proto::FrameType;
  const uint32_t s = f.stream;
  auto parse = [&]() -> Result<json> {
    json j = json::parse(f.payload, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return invalidArg("request", "malformed JSON request");
    return j;
  };
  if (s == 0) {
    if (f.type == T::kInit || f.type == T::kReattach) {
      send(0, T::kHello, json{{"version", 1}, {"pid", 0}, {"agent", "qga"}}.dump());
    }
    return;
  }
  switch (f.type) {
    case T::kExec: {
      auto j = parse();
      if (!j.isOk()) return sendResult(s, j.status());
      // guest-exec has no terminal, and its stdin is whole up front.
      if (j->contains("pty") && !(*j)["pty"].is_null()) {
        return sendResult(s, invalidArg("pty", "terminals need dsec-aether in the guest "
                                               "(backend microvm or container); the vm "
                                               "backend's qemu-guest-agent has none"));
      }
      if (j->value("stdin", false)) {
        std::lock_guard lk(mu_);
        pending_[s] = std::make_shared<Pending>(Pending{T::kExec, std::move(*j), "", false});
        return;
      }
      return spawn([this, s, req = std::move(*j)] { runExec(s, req, ""); });
    }
    case T::kStdin: {
      std::shared_ptr<Pending> p;
      {
        std::lock_guard lk(mu_);
        auto it = pending_.find(s);
        if (it == pending_.end() || it->second->type != T::kExec) return;
        p = it->second;
        if (!f.payload.empty()) {
          p->data.append(f.payload);
          return;
        }
        pending_.erase(it);
      }
      return spawn([this, s, p] { runExec(s, p->req, std::move(p->data)); });
    }
    case T::kFileWrite: {
      auto j = parse();
      if (!j.isOk()) return sendResult(s, j.status());
      std::lock_guard lk(mu_);
      pending_[s] = std::make_shared<Pending>(Pending{T::kFileWrite, std::move(*j), "", false});
      return;
    }
    case T::kData: {
      std::shared_ptr<Pending> p;
      {
        std::lock_guard lk(mu_);
        auto it = pending_.find(s);
        if (it == pending_.end() || it->second->type != T::kFileWrite) return;
        p = it->second;
        if (!f.payload.empty()) {
          if (p->failed) return;
          if (p->data.size() + f.payload.size() > kMaxWriteBytes) {
            p->failed = true;
            sendResult(s, Status(Code::kResourceExhausted,
                                 "a file written to a vm sandbox is limited to " +
                                     std::to_string(kMaxWriteBytes >> 20) + " MiB"));
            return;
          }
          p->data.append(f.payload);
          return;
        }
        pending_.erase(it);
        if (p->failed) return;
      }
      return spawn([this, s, p] { runFileWrite(s, p->req, std::move(p->data)); });
    }
    case T::kSignal:
    case T::kCancel: {
      int64_t pid = 0;
      int sig = 9;
      {
        std::lock_guard lk(mu_);
        if (pending_.erase(s)) return;  // a write or an exec not started yet
        auto it = guestPids_.find(s);
        if (it == guestPids_.end()) return;
        pid = it->second;
        if (f.type == T::kCancel) cancelled_[s] = true;
      }
      if (f.type == T::kSignal) {
        json j = json::parse(f.payload, nullptr, false);
        if (!j.is_object() || !j.contains("signal") || !j["signal"].is_number_integer()) return;
        sig = j["signal"].get<int>();
        if (sig < 1 || sig > 64) return;
      }
      // A negative pid is the process group of the `timeout` wrapper (which
      // makes its own); without it the command shares qga's group, so only
      // the process itself is signalled.
      return spawn([this, pid, sig] {
        (void)runGuest({"kill", "-" + std::to_string(sig), "--", std::to_string(pid)}, 10);
      });
    }
    case T::kFileRead: {
      auto j = parse();
      if (!j.isOk()) return sendResult(s, j.status());
      return spawn([this, s, req = std::move(*j)] { runFileRead(s, req); });
    }
    case T::kStat:
    case T::kList:
    case T::kMkdir:
    case T::kRemove: {
      auto j = parse();
      if (!j.isOk()) return sendResult(s, j.status());
      return spawn([this, s, t = f.type, req = std::move(*j)] { runSimple(s, t, req); });
    }
    case T::kPolicy: {
      auto j = parse();
      if (!j.isOk()) return sendResult(s, j.status());
      for (const char* k : {"readonly", "hidden"}) {
        auto it = j->find(k);
        if (it != j->end() && it->is_array() && !it->empty()) {
          return sendResult(s, Status(Code::kFailedPrecondition,
                                      "readonly/hidden paths are not supported for backend vm "
                                      "(the guest's own kernel and init rule its files)",
                                      0, "policy"));
        }
      }
      // A policy's resolvers go to the guest's /etc/resolv.conf, as the
      // agent writes them (aether/fs_policy.cc): beside it, then renamed
      // over it, so a symlink is replaced, never followed.
      std::string conf;
      if (auto it = j->find("dns"); it != j->end()) {
        if (!it->is_array()) return sendResult(s, invalidArg("dns", "must be a list of addresses"));
        for (auto& a : *it) {
          std::string addr = a.is_string() ? a.get<std::string>() : "";
          unsigned char buf[16];
          if (::inet_pton(AF_INET, addr.c_str(), buf) != 1 &&
              ::inet_pton(AF_INET6, addr.c_str(), buf) != 1) {
            return sendResult(s, invalidArg("dns", "resolvers must be IP addresses"));
          }
          conf += "nameserver " + addr + "\n";
        }
      }
      if (conf.empty()) return sendResult(s, Status::ok());
      conf = "# written by dsec for the sandbox's policy\n" + conf;
      return spawn([this, s, conf] {
        auto r = runGuest({"/bin/sh", "-c",
                           "printf '%s' \"$1\" >/etc/.resolv.conf.dsec && chmod 644 "
                           "/etc/.resolv.conf.dsec && mv -f /etc/.resolv.conf.dsec /etc/resolv.conf",
                           "sh", conf});
        if (!r.isOk()) return sendResult(s, Status(r.status()).withContext("write /etc/resolv.conf"));
        if (r->exitCode != 0) {
          return sendResult(s, Status(Code::kInternal, "write /etc/resolv.conf: " + r->err));
        }
        sendResult(s, Status::ok());
      });
    }
    case T::kAudit:
      return sendResult(s, Status::ok(),
                        json{{"denied_syscalls", json::object()}, {"denied_total", 0}});
    default:
      return sendResult(s, invalidArg("type", std::string("request type ") +
                                                  proto::frameTypeName(f.type) +
                                                  " is not served by the vm guest agent bridge"));
  }
}

Result<QgaBridge::CmdResult> QgaBridge::runGuest(const std::vector<std::string>& argv,
                                                 double timeoutS) {
  json args = {{"path", argv[0]},
               {"arg", std::vector<std::string>(argv.begin() + 1, argv.end())},
               {"env", json::array({std::string("PATH=") + kDefaultPath})},
               {"capture-output", true}};
  ASSIGN_OR_RETURN(json started, qga_->call("guest-exec", args));
  int64_t pid = started.value("pid", int64_t(-1));
  double deadline = monoSeconds() + timeoutS;
  double pause = 0.005;
  for (;;) {
    ASSIGN_OR_RETURN(json st, qga_->call("guest-exec-status", {{"pid", pid}}));
    if (st.value("exited", false)) {
      CmdResult r;
      r.exitCode = st.contains("exitcode") ? st.value("exitcode", -1) : -1;
      if (auto o = st.find("out-data"); o != st.end() && o->is_string()) {
        if (auto d = base64Decode(o->get<std::string>()); d.isOk()) r.out = *d;
      }
      if (auto e = st.find("err-data"); e != st.end() && e->is_string()) {
        if (auto d = base64Decode(e->get<std::string>()); d.isOk()) r.err = *d;
      }
      return r;
    }
    if (monoSeconds() > deadline) {
      (void)qga_->call("guest-exec", {{"path", "kill"}, {"arg", {"-9", std::to_string(pid)}}});
      return Status(Code::kDeadlineExceeded, "guest command " + argv[0] + " did not finish");
    }
    ::usleep(useconds_t(pause * 1e6));
    pause = std::min(pause * 2, 0.1);
  }
}

void QgaBridge::runExec(uint32_t stream, json req, std::string stdinData) {
  using T = proto::FrameType;
  std::vector<std::string> argv;
  std::vector<std::string> env;
  int64_t timeoutMs = 0;
  uint64_t maxOutput = 1 << 20;
  std::string cwd, user;
  try {
    argv = req.at("argv").get<std::vector<std::string>>();
    if (auto e = req.find("env"); e != req.end() && e->is_array()) {
      env = e->get<std::vector<std::string>>();
    }
    timeoutMs = req.value("timeout_ms", int64_t(0));
    maxOutput = req.value("max_output", uint64_t(1) << 20);
    cwd = req.value("cwd", "");
    user = req.value("user", "");
  } catch (const json::exception&) {
    return sendResult(stream, invalidArg("argv", "exec needs argv, a non-empty list of strings"));
  }
  if (argv.empty()) return sendResult(stream, invalidArg("argv", "argv must not be empty"));
  bool hasPath = false, hasHome = false;
  for (auto& e : env) {
    hasPath = hasPath || startsWith(e, "PATH=");
    hasHome = hasHome || startsWith(e, "HOME=");
  }
  if (!hasPath) env.push_back(std::string("PATH=") + kDefaultPath);
  if (!hasHome && (user.empty() || user == "root" || user == "0")) env.push_back("HOME=/root");
  // Wrappers, innermost first: the user, the working directory, the timeout
  // (qga has neither a cwd nor a kill; `timeout` kills in the guest).
  std::vector<std::string> cmd = argv;
  auto wrap = [&](std::vector<std::string> prefix) {
    prefix.insert(prefix.end(), cmd.begin(), cmd.end());
    cmd = std::move(prefix);
  };
  if (!user.empty() && user != "root" && user != "0") {
    size_t colon = user.find(':');
    if (colon == std::string::npos) {
      wrap({"runuser", "-u", user, "--"});
    } else {
      wrap({"setpriv", "--reuid", user.substr(0, colon), "--regid", user.substr(colon + 1),
            "--clear-groups", "--"});
    }
  }
  if (!cwd.empty()) wrap({"/bin/sh", "-c", "cd \"$0\" || exit 126; exec \"$@\"", cwd});
  if (timeoutMs > 0) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.3f", double(timeoutMs) / 1000);
    wrap({"timeout", "-s", "KILL", secs});
  }
  // Streamed output: qga's capture-output hands a command's output over only
  // at its exit, so the command's stdout and stderr go to files in the
  // guest's /run (a tmpfs under systemd) instead, at most maxOutput + 1
  // bytes each (the one more says the cap was passed; kExecWrapper), read
  // as they grow with guest-file-read while guest-exec-status polls; what
  // qga captures is only the wrapper shell's own complaints (appended to
  // stderr at the end).
  const std::string tag = randomHex(8);
  const std::string base = std::string(kExecDir) + "/" + tag;
  Tail tails[2] = {{base + ".out", T::kStdout}, {base + ".err", T::kStderr}};
  wrap({"/bin/sh", "-c", kExecWrapper, tag, std::to_string(maxOutput + 1)});
  json args = {{"path", cmd[0]},
               {"arg", std::vector<std::string>(cmd.begin() + 1, cmd.end())},
               {"env", env},
               {"capture-output", true}};
  if (!stdinData.empty()) args["input-data"] = base64Encode(stdinData);
  bool truncated = false;
  // Sends what the file has beyond what was sent (up to maxOutput per
  // stream). A file the wrapper has not made yet is simply not read yet.
  auto pump = [&](Tail& t) -> Status {
    if (t.handle < 0) {
      auto h = qga_->call("guest-file-open", {{"path", t.path}, {"mode", "r"}});
      if (!h.isOk() || !h->is_number_integer()) return Status::ok();
      t.handle = h->get<int64_t>();
    }
    for (;;) {
      // glibc's end-of-file is sticky: a seek clears it, so that the
      // stream's stdio sees what was written since the last read.
      RETURN_IF_ERROR(qga_->call("guest-file-seek",
                                 {{"handle", t.handle}, {"offset", 0}, {"whence", "cur"}})
                          .status());
      ASSIGN_OR_RETURN(json r, qga_->call("guest-file-read",
                                          {{"handle", t.handle}, {"count", kTailChunk}}));
      int64_t n = r.value("count", int64_t(0));
      if (n <= 0) return Status::ok();
      auto data = base64Decode(r.value("buf-b64", ""));
      if (!data.isOk()) return data.status();
      std::string_view v = *data;
      if (t.sent >= maxOutput) {
        truncated = true;
      } else {
        if (v.size() > maxOutput - t.sent) {
          v = v.substr(0, size_t(maxOutput - t.sent));
          truncated = true;
        }
        for (size_t off = 0; off < v.size(); off += proto::kDataChunk) {
          send(stream, t.type, v.substr(off, proto::kDataChunk));
        }
        t.sent += v.size();
      }
      if (n < kTailChunk) return Status::ok();
    }
  };
  auto closeTails = [&] {
    for (auto& t : tails) {
      if (t.handle >= 0) (void)qga_->call("guest-file-close", {{"handle", t.handle}});
      t.handle = -1;
    }
    (void)runGuest({"rm", "-f", base + ".out", base + ".err", base + ".o", base + ".e",
                    base + ".od", base + ".ed"});
  };
  double t0 = monoSeconds();
  json exitReport;
  auto started = qga_->call("guest-exec", args);
  if (!started.isOk()) {
    // The program could not be started (not found, not executable): as a
    // shell would say it, like the container agent does.
    if (started.status().code() == Code::kUnavailable) return sendResult(stream, started.status());
    std::string msg = started.status().message();
    bool missing = msg.find("No such file") != std::string::npos;
    send(stream, T::kStderr, "dsec: exec " + argv[0] + ": " + msg + "\n");
    exitReport = {{"exit_code", missing ? 127 : 126}, {"signal", 0}, {"timed_out", false},
                  {"truncated", false},
                  {"duration_us", int64_t((monoSeconds() - t0) * 1e6)}};
    return send(stream, T::kExit, exitReport.dump());
  }
  int64_t pid = started->value("pid", int64_t(-1));
  {
    std::lock_guard lk(mu_);
    guestPids_[stream] = timeoutMs > 0 ? -pid : pid;
  }
  // Our own guard in case the guest's timeout wrapper never ends it.
  double guard = timeoutMs > 0 ? t0 + double(timeoutMs) / 1000 + 15 : 1e18;
  double pause = 0.005;
  json st;
  bool hostTimeout = false;
  for (;;) {
    auto r = qga_->call("guest-exec-status", {{"pid", pid}});
    Status pumped = Status::ok();
    for (auto& t : tails) {
      if (pumped.isOk() && r.isOk()) pumped = pump(t);
    }
    if (!r.isOk() || !pumped.isOk()) {
      {
        std::lock_guard lk(mu_);
        guestPids_.erase(stream);
        cancelled_.erase(stream);
      }
      closeTails();
      return sendResult(stream, r.isOk() ? pumped : r.status());
    }
    if (r->value("exited", false)) {
      st = std::move(*r);
      break;
    }
    if (monoSeconds() > guard) {
      (void)qga_->call("guest-exec",
                       {{"path", "kill"}, {"arg", {"-9", "--", std::to_string(-pid)}}});
      hostTimeout = true;
      break;
    }
    ::usleep(useconds_t(pause * 1e6));
    pause = std::min(pause * 1.5, 0.1);
  }
  double took = monoSeconds() - t0;
  {
    std::lock_guard lk(mu_);
    guestPids_.erase(stream);
    cancelled_.erase(stream);
  }
  // The rest of the files (written between the last read and the exit, once
  // the readers have it), then the wrapper's own output, if any.
  if (!hostTimeout) (void)runGuest({"/bin/sh", "-c", kAwaitReaders, tag}, 10);
  for (auto& t : tails) {
    if (Status p = pump(t); !p.isOk()) log::warn("exec output: " + p.toString());
  }
  closeTails();
  for (auto [key, type] : {std::pair{"out-data", T::kStdout}, std::pair{"err-data", T::kStderr}}) {
    auto it = st.find(key);
    if (it == st.end() || !it->is_string()) continue;
    auto data = base64Decode(it->get<std::string>());
    if (!data.isOk() || data->empty()) continue;
    std::string_view v = *data;
    Tail& t = tails[type == T::kStdout ? 0 : 1];
    if (t.sent + v.size() > maxOutput) {
      v = v.substr(0, t.sent >= maxOutput ? 0 : size_t(maxOutput - t.sent));
      truncated = true;
    }
    for (size_t off = 0; off < v.size(); off += proto::kDataChunk) {
      send(stream, type, v.substr(off, proto::kDataChunk));
    }
    t.sent += v.size();
  }
  int exitCode = st.contains("exitcode") ? st.value("exitcode", -1) : -1;
  int signal = st.value("signal", 0);
  bool timedOut = hostTimeout;
  // `timeout -s KILL` kills its whole process group, itself included (qga
  // then reports signal 9); a timeout that outlived its command says 128+9.
  if (timeoutMs > 0 && (signal == 9 || exitCode == 137) &&
      took * 1000 >= double(timeoutMs) * 0.9) {
    timedOut = true;
  }
  if (timedOut) {
    exitCode = -1;
    signal = 9;
  } else if (signal > 0) {
    exitCode = -1;
  }
  exitReport = {{"exit_code", exitCode},   {"signal", signal},
                {"timed_out", timedOut},   {"truncated", truncated},
                {"duration_us", int64_t(took * 1e6)}};
  send(stream, T::kExit, exitReport.dump());
}

void QgaBridge::runFileRead(uint32_t stream, json req) {
  std::string path = req.value("path", "");
  if (path.empty() || path[0] != '/') {
    return sendResult(stream, invalidArg("path", "path must be absolute"));
  }
  int64_t offset = 0, length = -1;
  try {
    offset = req.value("offset", int64_t(0));
    length = req.value("length", int64_t(-1));
  } catch (const json::exception&) {
    return sendResult(stream, invalidArg("offset", "offset and length must be integers"));
  }
  auto h = qga_->call("guest-file-open", {{"path", path}, {"mode", "r"}});
  if (!h.isOk()) return sendResult(stream, h.status());
  int64_t handle = h->get<int64_t>();
  auto closeIt = [&] { (void)qga_->call("guest-file-close", {{"handle", handle}}); };
  auto end = qga_->call("guest-file-seek", {{"handle", handle}, {"offset", 0}, {"whence", "end"}});
  int64_t size = end.isOk() ? end->value("position", int64_t(0)) : 0;
  auto pos = qga_->call("guest-file-seek",
                        {{"handle", handle}, {"offset", offset}, {"whence", "set"}});
  if (!pos.isOk()) {
    closeIt();
    return sendResult(stream, pos.status());
  }
  int64_t left = length < 0 ? INT64_MAX : length;
  bool first = true;
  for (;;) {
    int64_t want = std::min<int64_t>(left, kFileChunk);
    std::string data;
    bool eof = true;
    if (want > 0) {
      auto r = qga_->call("guest-file-read", {{"handle", handle}, {"count", want}});
      if (!r.isOk()) {
        closeIt();
        Status st = r.status();
        if (st.code() == Code::kInvalidArgument) st = Status(st.code(), st.message(), 0, "path");
        return sendResult(stream, st);
      }
      auto d = base64Decode(r->value("buf-b64", ""));
      if (!d.isOk()) {
        closeIt();
        return sendResult(stream, internalError("guest agent sent bad base64"));
      }
      data = std::move(*d);
      eof = r->value("eof", false) || data.empty();
    }
    if (first) {
      sendResult(stream, Status::ok(), json{{"size", size}});
      first = false;
    }
    for (size_t off = 0; off < data.size(); off += proto::kDataChunk) {
      send(stream, proto::FrameType::kData, std::string_view(data).substr(off, proto::kDataChunk));
    }
    left -= int64_t(data.size());
    if (eof || left <= 0) break;
  }
  closeIt();
  send(stream, proto::FrameType::kData, "");
}

void QgaBridge::runFileWrite(uint32_t stream, json req, std::string data) {
  std::string path = req.value("path", "");
  if (path.empty() || path[0] != '/') {
    return sendResult(stream, invalidArg("path", "path must be absolute"));
  }
  bool append = req.value("append", false);
  bool modeGiven = req.contains("mode") && req["mode"].is_number_integer();
  int mode = modeGiven ? req["mode"].get<int>() : 0644;
  char modeStr[16];
  std::snprintf(modeStr, sizeof modeStr, "%04o", mode & 07777);
  // A plain write goes to a temp file beside the target, renamed over it.
  std::string target = append ? path : path + ".dsec-" + randomHex(4) + ".tmp";
  auto h = qga_->call("guest-file-open", {{"path", target}, {"mode", append ? "a" : "w"}});
  if (!h.isOk()) return sendResult(stream, Status(h.status().code(), h.status().message(), 0,
                                                  h.status().code() == Code::kInvalidArgument
                                                      ? "path"
                                                      : ""));
  int64_t handle = h->get<int64_t>();
  Status st;
  for (size_t off = 0; off < data.size() && st.isOk(); off += kFileChunk) {
    std::string_view piece = std::string_view(data).substr(off, kFileChunk);
    st = qga_->call("guest-file-write", {{"handle", handle}, {"buf-b64", base64Encode(piece)}})
             .status();
  }
  Status closed = qga_->call("guest-file-close", {{"handle", handle}}).status();
  if (st.isOk()) st = closed;
  if (st.isOk() && (!append || modeGiven)) {
    std::vector<std::string> cmd =
        append ? std::vector<std::string>{"chmod", modeStr, "--", path}
               : std::vector<std::string>{"/bin/sh", "-c",
                                          "chmod \"$0\" \"$1\" && mv -f -- \"$1\" \"$2\"",
                                          modeStr, target, path};
    auto r = runGuest(cmd);
    if (!r.isOk()) {
      st = r.status();
    } else if (r->exitCode != 0) {
      st = Status(codeFromText(r->err), "write " + path + ": " + trimmed(r->err));
    }
  }
  if (!st.isOk() && !append) (void)runGuest({"rm", "-f", "--", target}, 10);
  if (!st.isOk()) return sendResult(stream, st);
  sendResult(stream, Status::ok(), json{{"size", data.size()}});
}

void QgaBridge::runSimple(uint32_t stream, proto::FrameType type, json req) {
  using T = proto::FrameType;
  std::string path = req.value("path", "");
  if (path.empty() || path[0] != '/' || path.find('\0') != std::string::npos) {
    return sendResult(stream, invalidArg("path", "path must be absolute"));
  }
  auto failed = [&](const CmdResult& r, const std::string& what) {
    std::string err = trimmed(r.err);
    Code c = codeFromText(err);
    if (c == Code::kInternal && r.exitCode == 2) c = Code::kNotFound;
    return Status(c, what + " " + path + ": " + (err.empty() ? "failed" : err));
  };
  // "type size mode mtime uid gid" for one path: stat's raw mode in hex.
  auto typeOf = [](unsigned m) -> std::string {
    switch (m & 0170000) {
      case 0100000: return "file";
      case 0040000: return "dir";
      case 0120000: return "symlink";
      case 0020000: return "char";
      case 0060000: return "block";
      case 0010000: return "fifo";
      case 0140000: return "socket";
      default: return "file";
    }
  };
  if (type == T::kStat) {
    auto r = runGuest({"stat", "-c", "%f %s %Y %u %g", "--", path});
    if (!r.isOk()) return sendResult(stream, r.status());
    if (r->exitCode != 0) return sendResult(stream, failed(*r, "stat"));
    unsigned mode = 0;
    long long size = 0, mtime = 0;
    unsigned uid = 0, gid = 0;
    if (std::sscanf(r->out.c_str(), "%x %lld %lld %u %u", &mode, &size, &mtime, &uid, &gid) != 5) {
      return sendResult(stream, internalError("stat " + path + ": unexpected output"));
    }
    std::string name = path == "/" ? "/" : path.substr(path.find_last_of('/') + 1);
    json j = {{"name", name},  {"path", path},        {"type", typeOf(mode)},
              {"size", size},  {"mode", mode & 07777}, {"mtime", double(mtime)},
              {"uid", uid},    {"gid", gid}};
    if (typeOf(mode) == "symlink") {
      if (auto t = runGuest({"readlink", "--", path}); t.isOk() && t->exitCode == 0) {
        j["target"] = trimmed(t->out);
      }
    }
    return sendResult(stream, Status::ok(), j);
  }
  if (type == T::kList) {
    auto r = runGuest({"/bin/sh", "-c",
                       "[ -e \"$0\" ] || { echo 'No such file or directory' >&2; exit 2; }; "
                       "[ -d \"$0\" ] || { echo 'Not a directory' >&2; exit 3; }; "
                       "exec find \"$0\" -mindepth 1 -maxdepth 1 -printf '%f\\0%y\\0%s\\0%m\\0%T@\\0%U\\0%G\\0'",
                       path});
    if (!r.isOk()) return sendResult(stream, r.status());
    if (r->exitCode != 0) return sendResult(stream, failed(*r, "list"));
    std::vector<std::string> f = splitString(r->out, '\0');
    std::map<std::string, json> byName;
    static const std::map<std::string, std::string> kTypes = {
        {"f", "file"}, {"d", "dir"}, {"l", "symlink"}, {"c", "char"},
        {"b", "block"}, {"p", "fifo"}, {"s", "socket"}};
    for (size_t i = 0; i + 7 <= f.size(); i += 7) {
      auto t = kTypes.find(f[i + 1]);
      byName[f[i]] = {{"name", f[i]},
                      {"type", t == kTypes.end() ? "file" : t->second},
                      {"size", std::atoll(f[i + 2].c_str())},
                      {"mode", std::strtol(f[i + 3].c_str(), nullptr, 8)},
                      {"mtime", std::atof(f[i + 4].c_str())},
                      {"uid", std::atoll(f[i + 5].c_str())},
                      {"gid", std::atoll(f[i + 6].c_str())}};
    }
    json entries = json::array();
    for (auto& [n, e] : byName) entries.push_back(e);
    return sendResult(stream, Status::ok(), json{{"entries", entries}});
  }
  if (type == T::kMkdir) {
    bool parents = req.value("parents", true);
    int mode = req.value("mode", 0755);
    char modeStr[16];
    std::snprintf(modeStr, sizeof modeStr, "%04o", mode & 07777);
    std::vector<std::string> cmd = {"mkdir"};
    if (parents) cmd.push_back("-p");
    for (auto& a : {std::string("-m"), std::string(modeStr), std::string("--"), path}) {
      cmd.push_back(a);
    }
    auto r = runGuest(cmd);
    if (!r.isOk()) return sendResult(stream, r.status());
    if (r->exitCode != 0) return sendResult(stream, failed(*r, "mkdir"));
    return sendResult(stream, Status::ok());
  }
  // remove
  if (path == "/") return sendResult(stream, invalidArg("path", "refusing to remove /"));
  bool recursive = req.value("recursive", false);
  auto r = runGuest({"/bin/sh", "-c",
                     recursive ? "[ -e \"$0\" ] || [ -L \"$0\" ] || { echo 'No such file or "
                                 "directory' >&2; exit 2; }; exec rm -rf -- \"$0\""
                               : "if [ -d \"$0\" ] && [ ! -L \"$0\" ]; then exec rmdir -- "
                                 "\"$0\"; else exec rm -- \"$0\"; fi",
                     path});
  if (!r.isOk()) return sendResult(stream, r.status());
  if (r->exitCode != 0) return sendResult(stream, failed(*r, "remove"));
  sendResult(stream, Status::ok());
}

}  // namespace dsec::edge
