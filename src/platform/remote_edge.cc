#include "platform/remote_edge.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <optional>

#include "common/fd.h"
#include "common/sha256.h"
#include "common/util.h"
#include "proto/codec.h"
#include "proto/port_relay.h"

namespace dsec::platform {

using json = nlohmann::json;

namespace {

// The longest a node may take to answer a call. Creates of vm sandboxes wait
// for a boot (--vm-boot-timeout-s, 300 s, retried once); a node that died is
// found sooner by the link's ping (its calls fail with kUnavailable) and by
// its heartbeats.
constexpr double kCallTimeoutS = 3600;
// The longest a body transfer may make no progress.
constexpr double kStallS = 600;
constexpr size_t kChunk = 256u << 10;

// "http://HOST:PORT" -> host, port.
std::pair<std::string, uint16_t> hostPort(const std::string& url) {
  std::string rest = startsWith(url, "http://") ? url.substr(7) : url;
  rest = rest.substr(0, rest.find('/'));
  size_t colon = rest.rfind(':');
  if (colon == std::string::npos) return {rest, 80};
  return {rest.substr(0, colon), uint16_t(std::atoi(rest.c_str() + colon + 1))};
}

Status unreachable(const std::string& url, const Status& st) {
  if (st.code() != Code::kUnavailable && st.code() != Code::kUnauthenticated) return st;
  return Status(Code::kUnavailable, "node at " + url + ": " + st.message());
}

// Reads the call's body up to and including the first '\n': the JSON head
// of a read_file or pack_diff answer. Bytes read past it go to `rest`.
Result<json> readHead(proto::ClientCall& call, std::string& rest) {
  std::string buf;
  char chunk[4096];
  for (;;) {
    size_t nl = buf.find('\n');
    if (nl != std::string::npos) {
      rest = buf.substr(nl + 1);
      json j = json::parse(buf.substr(0, nl), nullptr, false);
      if (j.is_discarded() || !j.is_object()) return internalError("node: malformed answer head");
      return j;
    }
    if (buf.size() > (64u << 10)) return internalError("node: answer head over 64 KiB");
    ASSIGN_OR_RETURN(size_t n, call.read(chunk, sizeof chunk, kStallS));
    if (n == 0) {
      // The body ended without a head: the call's own error says why.
      ASSIGN_OR_RETURN(std::string reply, call.wait(kStallS));
      (void)reply;
      return internalError("node: answer without a head");
    }
    buf.append(chunk, n);
  }
}

// The outcome of a call whose body was read or written: the call's own
// error if it has one (the real cause of a transfer that broke off).
Status outcomeOf(proto::ClientCall& call, const Status& transfer) {
  auto out = call.wait(transfer.isOk() ? kCallTimeoutS : 5);
  if (!out.isOk()) return out.status();
  return transfer;
}

class LinkExec : public proto::ExecCall {
 public:
  LinkExec(std::shared_ptr<proto::ClientCall> call, bool interactive)
      : call_(std::move(call)), interactive_(interactive) {}
  void cancel() override {
    call_->cancel(Status(Code::kUnavailable, "exec cancelled: client went away"));
  }
  // Records on the call's body (proto::ExecControlDecoder on the edge). A
  // full send buffer is the caller's kResourceExhausted: input pushes back.
  Status sendInput(std::string_view bytes) override {
    return control(proto::execInputRecord(bytes));
  }
  Status resize(proto::TermSize size) override { return control(proto::execResizeRecord(size)); }
  Status signal(int sig) override {
    if (sig < 1 || sig > 64) return invalidArg("signal", "signal must be from 1 to 64");
    return control(proto::execSignalRecord(sig), true);
  }

 private:
  // Signals serve every exec; input and resizes interactive ones.
  Status control(const std::string& rec, bool anyExec = false) {
    if ((!interactive_ && !anyExec) || call_->done()) {
      return Status(Code::kFailedPrecondition, "the exec is not interactive, or has ended", 0,
                    "interactive");
    }
    std::lock_guard lk(mu_);  // one record whole before the next
    return call_->send(rec);
  }

  std::shared_ptr<proto::ClientCall> call_;
  const bool interactive_;
  std::mutex mu_;
};

}  // namespace

RemoteEdge::RemoteEdge(std::string url, std::string key, std::string node, Runtime& rt)
    : rt_(rt), node_(std::move(node)), url_(std::move(url)), key_(std::move(key)) {}

RemoteEdge::~RemoteEdge() {
  std::shared_ptr<proto::LinkClient> c;
  {
    std::lock_guard lk(mu_);
    c = std::move(client_);
  }
  if (c) c->close();
}

void RemoteEdge::reset(std::string url, std::string key) {
  std::shared_ptr<proto::LinkClient> old;
  {
    std::lock_guard lk(mu_);
    if (url == url_ && key == key_) return;
    url_ = std::move(url);
    key_ = std::move(key);
    old = std::move(client_);
  }
  if (old) old->close();
}

std::string RemoteEdge::url() const {
  std::lock_guard lk(mu_);
  return url_;
}

std::shared_ptr<proto::LinkClient> RemoteEdge::client() const {
  std::lock_guard lk(mu_);
  if (!client_) {
    proto::LinkClientOptions o;
    std::tie(o.host, o.port) = hostPort(url_);
    o.key = key_;
    o.node = node_;
    client_ = std::make_shared<proto::LinkClient>(rt_, o);
  }
  return client_;
}

bool RemoteEdge::connected() const {
  std::lock_guard lk(mu_);
  return client_ && client_->connected();
}

uint64_t RemoteEdge::connects() const {
  std::lock_guard lk(mu_);
  return client_ ? client_->connects() : 0;
}

size_t RemoteEdge::callsInFlight() const {
  std::lock_guard lk(mu_);
  return client_ ? client_->callsInFlight() : 0;
}

Result<json> RemoteEdge::unary(const std::string& method, const json& args) {
  auto r = client()->unary(method, args.dump(-1, ' ', false, json::error_handler_t::replace),
                           kCallTimeoutS);
  if (!r.isOk()) return unreachable(url(), r.status());
  json j = json::parse(*r, nullptr, false);
  if (j.is_discarded()) return internalError("node: malformed answer to " + method);
  return j;
}

Status RemoteEdge::create(proto::BackendKind backend, const proto::SandboxSpec& spec) {
  return unary("create", {{"backend", proto::backendName(backend)}, {"spec", proto::toJson(spec)}})
      .status();
}

namespace {

// The statuses a bulk call's answer ({results: [{id} or {id, error}]}, one
// per id in order) gives for `ids`; an entry the answer lacks is an error.
std::vector<Status> bulkResults(const json& j, const std::vector<std::string>& ids) {
  std::vector<Status> out(ids.size(),
                          Status(Code::kInternal, "node answered no result for the sandbox"));
  if (!j.is_object() || !j.contains("results") || !j["results"].is_array()) return out;
  auto& res = j["results"];
  for (size_t i = 0; i < ids.size() && i < res.size(); ++i) {
    if (!res[i].is_object() || res[i].value("id", "") != ids[i]) continue;
    out[i] = res[i].contains("error") ? proto::statusFromError(res[i]["error"]) : Status::ok();
  }
  return out;
}

}  // namespace

std::vector<Status> RemoteEdge::createMany(proto::BackendKind backend,
                                           const std::vector<proto::SandboxSpec>& specs) {
  if (specs.empty()) return {};
  json arr = json::array();
  std::vector<std::string> ids;
  for (auto& sp : specs) {
    arr.push_back(proto::toJson(sp));
    ids.push_back(sp.id);
  }
  auto r = unary("create_many", {{"backend", proto::backendName(backend)}, {"specs", arr}});
  // Nothing is known of any of them when the call failed: each failed
  // (anything the node made anyway is wanted by no record, and its
  // reconcile destroys it).
  if (!r.isOk()) return std::vector<Status>(specs.size(), r.status());
  return bulkResults(*r, ids);
}

Status RemoteEdge::destroy(const std::string& id) { return unary("destroy", {{"id", id}}).status(); }

std::vector<Status> RemoteEdge::destroyMany(const std::vector<std::string>& ids) {
  constexpr size_t kMaxPerCall = 4096;  // the node's bound
  std::vector<Status> out;
  out.reserve(ids.size());
  for (size_t from = 0; from < ids.size(); from += kMaxPerCall) {
    std::vector<std::string> part(ids.begin() + from,
                                  ids.begin() + std::min(ids.size(), from + kMaxPerCall));
    auto r = unary("destroy_many", {{"ids", part}});
    auto sts = r.isOk() ? bulkResults(*r, part) : std::vector<Status>(part.size(), r.status());
    out.insert(out.end(), sts.begin(), sts.end());
  }
  return out;
}

std::shared_ptr<proto::ExecCall> RemoteEdge::startExec(const std::string& id,
                                                       const proto::ExecSpec& spec,
                                                       proto::ExecCallbacks cb) {
  // The call's callbacks run on io threads, one at a time for the call.
  struct State {
    proto::ExecCallbacks cb;
    std::string out, err;  // collected when there is no onOutput
  };
  auto st = std::make_shared<State>();
  st->cb = std::move(cb);
  proto::CallHandler h;
  h.onEvent = [st](std::string_view ev) {
    if (ev.empty()) return;
    if (ev[0] == 'p') {
      json j = json::parse(ev.substr(1), nullptr, false);
      if (st->cb.onStarted && j.is_object() && j.contains("pid") && j["pid"].is_number_integer()) {
        st->cb.onStarted(j["pid"].get<int>());
      }
      return;
    }
    bool isErr = ev[0] == 'e';
    std::string_view data = ev.substr(1);
    if (st->cb.onOutput) {
      st->cb.onOutput(isErr, data);
    } else {
      (isErr ? st->err : st->out).append(data);
    }
  };
  h.onDone = [st, url = url()](Result<std::string> outcome) {
    auto cb = std::move(st->cb);
    if (!outcome.isOk()) return cb.onDone(unreachable(url, outcome.status()));
    json j = json::parse(*outcome, nullptr, false);
    if (j.is_discarded()) return cb.onDone(internalError("node: malformed exec result"));
    auto r = proto::resultFromJson(j);
    if (r.isOk()) {
      r->out = std::move(st->out);
      r->err = std::move(st->err);
    }
    cb.onDone(std::move(r));
  };
  json args = {{"id", id}, {"spec", proto::toJson(spec)}};
  if (st->cb.onStarted) args["started"] = true;
  auto call = client()->start("exec", args.dump(-1, ' ', false, json::error_handler_t::replace),
                              std::move(h));
  return std::make_shared<LinkExec>(std::move(call), spec.interactive || spec.pty.has_value());
}

Result<uint64_t> RemoteEdge::writeFile(const std::string& id, const std::string& path, int mode,
                                       const proto::ByteSource& src) {
  json args = {{"id", id}, {"path", path}, {"mode", mode}};
  auto call = client()->start("write_file", args.dump(), proto::CallHandler{});
  std::string buf(kChunk, '\0');
  Status transfer;
  for (;;) {
    auto n = src(buf.data(), buf.size());
    if (!n.isOk()) {
      // The caller's body broke off: nothing is written.
      call->cancel(n.status());
      return n.status();
    }
    if (*n == 0) break;
    transfer = call->write(std::string_view(buf.data(), *n), kStallS);
    if (!transfer.isOk()) break;
  }
  if (transfer.isOk()) transfer = call->end();
  auto out = call->wait(transfer.isOk() ? kCallTimeoutS : 5);
  if (!out.isOk()) return unreachable(url(), out.status());
  if (!transfer.isOk()) return unreachable(url(), transfer);
  json j = json::parse(*out, nullptr, false);
  if (j.is_discarded()) return internalError("node: bad write answer");
  return j.value("written", uint64_t(0));
}

Status RemoteEdge::readFile(const std::string& id, const std::string& path,
                            const std::function<Status(std::optional<uint64_t>)>& onSize,
                            const proto::ByteSink& sink) {
  json args = {{"id", id}, {"path", path}};
  auto call = client()->start("read_file", args.dump(), proto::CallHandler{});
  std::string rest;
  auto head = readHead(*call, rest);
  if (!head.isOk()) return unreachable(url(), outcomeOf(*call, head.status()));
  std::optional<uint64_t> size;
  if (auto s = head->find("size"); s != head->end() && s->is_number_unsigned()) {
    size = s->get<uint64_t>();
  }
  Status st = onSize(size);
  if (st.isOk() && !rest.empty()) st = sink(rest);
  std::string buf(kChunk, '\0');
  while (st.isOk()) {
    auto n = call->read(buf.data(), buf.size(), kStallS);
    if (!n.isOk()) {
      st = n.status();
      break;
    }
    if (*n == 0) break;
    st = sink(std::string_view(buf.data(), *n));
  }
  if (!st.isOk()) {
    call->cancel(st);  // the caller went away, or the transfer broke off
    return unreachable(url(), outcomeOf(*call, st));
  }
  return unreachable(url(), outcomeOf(*call, Status::ok()));
}

Result<std::string> RemoteEdge::agentOp(const std::string& id, proto::AgentOp op,
                                        const std::string& body) {
  ASSIGN_OR_RETURN(json j, unary("agent_op", {{"id", id},
                                              {"op", proto::agentOpName(op)},
                                              {"json", body}}));
  return j.dump();
}

Result<proto::CgroupStats> RemoteEdge::stats(const std::string& id) {
  ASSIGN_OR_RETURN(json j, unary("stats", {{"id", id}}));
  return proto::statsFromJson(j);
}

Result<proto::StatsSeries> RemoteEdge::statsHistory(const std::string& id, double windowS) {
  ASSIGN_OR_RETURN(json j, unary("stats", {{"id", id}, {"history", true}, {"window_s", windowS}}));
  if (j.contains("samples")) return proto::seriesFromJson(j);
  ASSIGN_OR_RETURN(auto now, proto::statsFromJson(j));
  proto::StatsSeries s;
  s.samples.push_back({nowSeconds(), now.cpuUsec, now.memoryBytes, now.pids});
  return s;
}

Status RemoteEdge::pause(const std::string& id, bool paused) {
  return unary("pause", {{"id", id}, {"paused", paused}}).status();
}

Status RemoteEdge::hibernate(const std::string& id) {
  return unary("pause", {{"id", id}, {"paused", true}, {"memory", "disk"}}).status();
}

Status RemoteEdge::setLimits(const std::string& id, const proto::CgroupLimits& l) {
  return unary("set_limits", {{"id", id}, {"limits", proto::toJson(l)}}).status();
}

Status RemoteEdge::setEgress(const std::string& id, const std::vector<proto::EgressRule>& rules) {
  json rs = json::array();
  for (auto& r : rules) rs.push_back(proto::toJson(r));
  return unary("set_egress", {{"id", id}, {"rules", rs}}).status();
}

Result<proto::EgressDenials> RemoteEdge::egressDenials(const std::string& id) {
  ASSIGN_OR_RETURN(json j, unary("egress_denials", {{"id", id}}));
  return proto::denialsFromJson(j);
}

namespace {

// Copies exactly `size` bytes of the call's body (`rest` first) into a new
// file at `dest`, checking them against `digest`.
Status receiveFile(proto::ClientCall& call, std::string& rest, const std::string& dest,
                   int64_t size, const std::string& digest) {
  UniqueFd fd(::open(dest.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd) return sysError("create " + dest);
  Sha256 h;
  int64_t got = 0;
  auto take = [&](std::string_view d) -> Status {
    h.update(d.data(), d.size());
    got += int64_t(d.size());
    if (::write(fd.get(), d.data(), d.size()) != ssize_t(d.size())) return sysError("write " + dest);
    return Status::ok();
  };
  size_t first = std::min<size_t>(rest.size(), size_t(size));
  RETURN_IF_ERROR(take(std::string_view(rest).substr(0, first)));
  rest.erase(0, first);
  std::string buf(kChunk, '\0');
  while (got < size) {
    ASSIGN_OR_RETURN(size_t n,
                     call.read(buf.data(), std::min<size_t>(buf.size(), size - got), kStallS));
    if (n == 0) break;
    RETURN_IF_ERROR(take(std::string_view(buf.data(), n)));
  }
  if (::fsync(fd.get()) != 0) return sysError("fsync " + dest);
  std::string sum = "sha256:" + h.hexDigest();
  if (got != size || sum != digest) {
    return Status(Code::kDataLoss, "the node's " + dest + " is " + std::to_string(got) +
                                       " bytes hashing to " + sum + ", it announced " +
                                       std::to_string(size) + " bytes of " + digest);
  }
  return Status::ok();
}

}  // namespace

Result<image::BuiltLayer> RemoteEdge::packDiff(const std::string& id, const std::string& workDir) {
  // The node builds the layer and streams its two files back in the call's
  // body, each checked against the size and digest it announced first (the
  // caller moves them into the blob store, where every node reads them).
  auto call = client()->start("pack_diff", json{{"id", id}}.dump(), proto::CallHandler{});
  std::string rest;
  auto head = readHead(*call, rest);
  if (!head.isOk()) return unreachable(url(), outcomeOf(*call, head.status()));
  ASSIGN_OR_RETURN(image::BuiltLayer layer, proto::builtLayerFromJson(*head));
  Status st = makeDirs(workDir, 0700);
  layer.path = workDir + (layer.kind == "disk" ? "/disk.qcow2" : "/meta");
  if (st.isOk()) st = receiveFile(*call, rest, layer.path, layer.size, layer.digest);
  if (st.isOk() && !layer.dataDigest.empty()) {
    layer.dataPath = workDir + "/data";
    st = receiveFile(*call, rest, layer.dataPath, layer.dataSize, layer.dataDigest);
  }
  if (!st.isOk()) call->cancel(st);
  st = outcomeOf(*call, st);
  if (!st.isOk()) {
    return unreachable(url(), st).withContext("pack_diff " + id + ": fetching the layer");
  }
  return layer;
}

Status RemoteEdge::evictLayer(const std::string& digest) {
  return unary("evict_layer", {{"digest", digest}}).status();
}

Result<UniqueFd> RemoteEdge::openPort(const std::string& id, int port, uint64_t gen,
                                      double connectTimeoutS) {
  if (port < 1 || port > 65535) return invalidArg("port", "port must be from 1 to 65535");
  int sp[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sp) != 0) {
    return sysError("socketpair (port " + std::to_string(port) + ")");
  }
  UniqueFd mine(sp[0]), theirs(sp[1]);
  auto relay =
      proto::PortRelay::client(rt_, std::move(mine), "port " + std::to_string(port) + " of " + id);
  // Connected (event 'o') or failed: the first of the two wakes the caller.
  struct Wait {
    std::mutex mu;  // guards opened, failed
    std::condition_variable cv;
    bool opened = false;
    std::optional<Status> failed;
  };
  auto w = std::make_shared<Wait>();
  auto h = relay->handler(
      [w](std::string_view ev) {
        if (ev != "o") return;
        std::lock_guard lk(w->mu);
        w->opened = true;
        w->cv.notify_all();
      },
      [w](const Result<std::string>& outcome) {
        std::lock_guard lk(w->mu);
        if (w->opened) return;
        w->failed = outcome.isOk() ? internalError("node: port_open ended before it connected")
                                   : outcome.status();
        w->cv.notify_all();
      });
  json args = {{"id", id}, {"port", port}, {"gen", gen}, {"timeout_s", connectTimeoutS}};
  relay->attach(client()->start("port_open", args.dump(), std::move(h)));
  std::unique_lock lk(w->mu);
  bool answered = w->cv.wait_for(lk, std::chrono::duration<double>(connectTimeoutS + 10),
                                 [&] { return w->opened || w->failed.has_value(); });
  if (!answered) {
    lk.unlock();
    Status st(Code::kDeadlineExceeded,
              "node at " + url() + " did not answer port_open within " +
                  std::to_string(int(connectTimeoutS + 10)) + " s",
              0, "port");
    relay->abort(st);
    return st;
  }
  // The node's own errors as they are (their messages and fields are the
  // answer); the relay closed its end already.
  if (!w->opened) return *w->failed;
  return theirs;
}

Status RemoteEdge::setPorts(const std::string& id, const std::vector<proto::PortGen>& ports) {
  json ps = json::array();
  for (auto& p : ports) ps.push_back({{"port", p.port}, {"gen", p.gen}});
  return unary("set_ports", {{"id", id}, {"ports", ps}}).status();
}

Result<std::string> RemoteEdge::screenshot(const std::string& id) {
  auto call = client()->start("screenshot", json{{"id", id}}.dump(), proto::CallHandler{});
  std::string png;
  std::string buf(kChunk, '\0');
  Status st;
  for (;;) {
    auto n = call->read(buf.data(), buf.size(), kStallS);
    if (!n.isOk()) {
      st = n.status();
      break;
    }
    if (*n == 0) break;
    png.append(buf.data(), *n);
  }
  st = outcomeOf(*call, st);
  if (!st.isOk()) return unreachable(url(), st);
  return png;
}

Status RemoteEdge::input(const std::string& id, const proto::InputAction& action) {
  return unary("input", {{"id", id}, {"action", proto::toJson(action)}}).status();
}

}  // namespace dsec::platform
