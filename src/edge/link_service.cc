#include "edge/link_service.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <mutex>

#include "common/log.h"
#include "common/util.h"
#include "proto/codec.h"
#include "proto/port_relay.h"

namespace dsec::edge {

using json = nlohmann::json;

namespace {

// How long a blocking body transfer may make no progress (a platform that
// stopped reading or writing); the link's ping finds a dead peer sooner.
constexpr double kBodyStallS = 600;
constexpr size_t kChunk = 256u << 10;

Result<std::string> stringArg(const json& args, const char* name) {
  auto it = args.find(name);
  if (it == args.end() || !it->is_string()) {
    return invalidArg(name, std::string(name) + " must be a string");
  }
  return it->get<std::string>();
}

Result<proto::BackendKind> backendArg(const json& args) {
  ASSIGN_OR_RETURN(std::string b, stringArg(args, "backend"));
  auto kind = proto::parseBackend(b);
  if (!kind) return invalidArg("backend", "unknown backend '" + b + "'");
  return *kind;
}

// A bulk call's answer: one entry per id, in order, {id} or {id, error}.
json bulkAnswer(const std::vector<std::string>& ids, const std::vector<Status>& sts,
                metrics::CounterVec& errors) {
  json results = json::array();
  for (size_t i = 0; i < ids.size(); ++i) {
    json one = {{"id", ids[i]}};
    if (i >= sts.size() || !sts[i].isOk()) {
      Status st = i < sts.size() ? sts[i] : internalError("no result");
      errors.inc(codeName(st.code()));
      one["error"] = proto::errorJson(st)["error"];
    }
    results.push_back(std::move(one));
  }
  return {{"results", results}};
}

// The output of an exec on its way to the platform: events go out as the
// agent sends them; when the link's send buffer is full they wait here (the
// agent reactor must not block) and go out on the call's onWritable, and the
// result follows the last of them.
class ExecRelay : public std::enable_shared_from_this<ExecRelay> {
 public:
  explicit ExecRelay(std::shared_ptr<proto::ServerCall> call) : call_(std::move(call)) {}

  void output(bool isErr, std::string_view data) {
    for (size_t off = 0; off < data.size(); off += proto::kMaxEventPayload - 1) {
      std::string ev(1, isErr ? 'e' : 'o');
      ev.append(data.substr(off, proto::kMaxEventPayload - 1));
      {
        std::lock_guard lk(mu_);
        pending_.push_back(std::move(ev));
      }
    }
    flush();
  }

  // The process's pid, as an event 'p' {"pid": N} (asked for with
  // "started": true in the call's args; older platforms would take it for output).
  void started(int pid) {
    {
      std::lock_guard lk(mu_);
      pending_.push_back("p" + json{{"pid", pid}}.dump());
    }
    flush();
  }

  void done(Result<proto::ExecResult> r) {
    {
      std::lock_guard lk(mu_);
      result_.emplace(std::move(r));
    }
    flush();
  }

  // Sends what it can; called again on onWritable.
  void flush() {
    std::unique_lock lk(mu_);
    while (!pending_.empty()) {
      Status st = call_->event(pending_.front());
      if (st.code() == Code::kResourceExhausted) {
        if (!waiting_) {
          waiting_ = true;
          std::weak_ptr<ExecRelay> weak = shared_from_this();
          call_->onWritable([weak] {
            if (auto self = weak.lock()) {
              {
                std::lock_guard l(self->mu_);
                self->waiting_ = false;
              }
              self->flush();
            }
          });
        }
        return;
      }
      pending_.pop_front();
      if (!st.isOk()) pending_.clear();  // cancelled: nothing more goes out
    }
    if (!result_ || replied_) return;
    replied_ = true;
    Result<proto::ExecResult> r = std::move(*result_);
    lk.unlock();
    if (r.isOk()) {
      r->out.clear();  // sent as events
      r->err.clear();
      (void)call_->reply(proto::toJson(*r).dump());
    } else {
      (void)call_->fail(r.status());
    }
  }

 private:
  std::shared_ptr<proto::ServerCall> call_;
  std::mutex mu_;  // guards pending_, result_, waiting_, replied_
  std::deque<std::string> pending_;
  std::optional<Result<proto::ExecResult>> result_;
  bool waiting_ = false;
  bool replied_ = false;
};

}  // namespace

LinkService::LinkService(Runtime& rt, proto::EdgeLink* link,
                         std::function<std::string(const std::string& node)> key,
                         std::function<std::vector<std::string>()> ids, std::string packDir)
    : rt_(rt), link_(link), ids_(std::move(ids)), packDir_(std::move(packDir)) {
  // Packs of an earlier process went with its connections.
  (void)removeTree(packDir_);
  server_ = std::make_unique<proto::LinkServer>(
      rt_,
      [key = std::move(key)](const std::string& node) -> Result<std::string> {
        std::string k = key(node);
        if (k.empty()) return Status(Code::kUnauthenticated, "unknown node " + node);
        return k;
      },
      [this](std::shared_ptr<proto::ServerCall> call) {
        // The node's operations block: off the io thread.
        if (!rt_.runBlocking([this, call] { serve(call); })) {
          (void)call->fail(Status(Code::kUnavailable, "the node is stopping"));
        }
      });
}

LinkService::~LinkService() { server_->close(); }

void LinkService::adopt(UniqueFd fd, std::string buffered) {
  server_->adopt(std::move(fd), std::move(buffered));
}

void LinkService::writeMetrics(metrics::Writer& w) {
  w.gauge("dsec_edge_link_connections", "Platform link connections this node serves.",
          double(server_->connections()));
  w.gauge("dsec_edge_link_calls", "Platform calls in flight on this node's link.",
          double(server_->callsInFlight()));
  w.counter("dsec_edge_link_auth_failures_total",
            "Link handshakes refused (wrong key, unknown node, replay).",
            double(server_->authFailures()));
}

Result<json> LinkService::runJson(const std::string& method, const json& args) {
  if (!args.is_object()) return invalidArg("args", "args must be a JSON object");
  if (method == "list") return json{{"sandboxes", ids_()}};
  if (method == "create") {
    ASSIGN_OR_RETURN(auto backend, backendArg(args));
    ASSIGN_OR_RETURN(auto spec, proto::specFromJson(args.value("spec", json::object())));
    creates_++;
    RETURN_IF_ERROR(link_->create(backend, spec));
    return json{{"id", spec.id}};
  }
  if (method == "create_many") {
    // A bad spec refuses the whole call before anything is made.
    ASSIGN_OR_RETURN(auto backend, backendArg(args));
    auto specsJ = args.find("specs");
    if (specsJ == args.end() || !specsJ->is_array() || specsJ->empty() ||
        specsJ->size() > 4096) {
      return invalidArg("specs", "specs must be a list of 1 to 4096 sandbox specs");
    }
    std::vector<proto::SandboxSpec> specs;
    std::vector<std::string> ids;
    for (auto& sj : *specsJ) {
      ASSIGN_OR_RETURN(auto spec, proto::specFromJson(sj));
      ids.push_back(spec.id);
      specs.push_back(std::move(spec));
    }
    creates_ += specs.size();
    return bulkAnswer(ids, link_->createMany(backend, specs), errors_);
  }
  if (method == "destroy_many") {
    auto idsJ = args.find("ids");
    if (idsJ == args.end() || !idsJ->is_array() || idsJ->empty() || idsJ->size() > 4096) {
      return invalidArg("ids", "ids must be a list of 1 to 4096 sandbox ids");
    }
    std::vector<std::string> ids;
    for (auto& i : *idsJ) {
      if (!i.is_string()) return invalidArg("ids", "ids must be strings");
      ids.push_back(i.get<std::string>());
    }
    destroys_ += ids.size();
    return bulkAnswer(ids, link_->destroyMany(ids), errors_);
  }
  if (method == "evict_layer") {
    ASSIGN_OR_RETURN(std::string digest, stringArg(args, "digest"));
    RETURN_IF_ERROR(link_->evictLayer(digest));
    return json::object();
  }
  // The rest name a sandbox.
  ASSIGN_OR_RETURN(std::string id, stringArg(args, "id"));
  if (method == "destroy") {
    destroys_++;
    RETURN_IF_ERROR(link_->destroy(id));
    return json::object();
  }
  if (method == "agent_op") {
    ASSIGN_OR_RETURN(std::string opName, stringArg(args, "op"));
    auto op = proto::parseAgentOp(opName);
    if (!op) return invalidArg("op", "unknown agent op '" + opName + "'");
    ASSIGN_OR_RETURN(std::string body, link_->agentOp(id, *op, args.value("json", "{}")));
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded()) return internalError("agent sent malformed JSON");
    return j;
  }
  if (method == "stats") {
    // With "history": the readings of the last window_s seconds (an older
    // platform asks without it and gets the figures now).
    if (args.value("history", false)) {
      auto w = args.find("window_s");
      if (w == args.end() || !w->is_number() || !(w->get<double>() > 0)) {
        return invalidArg("window_s", "window_s must be a positive number");
      }
      ASSIGN_OR_RETURN(auto h, link_->statsHistory(id, w->get<double>()));
      return proto::toJson(h);
    }
    ASSIGN_OR_RETURN(auto s, link_->stats(id));
    return proto::toJson(s);
  }
  if (method == "pause") {
    bool paused = args.value("paused", true);
    bool toDisk = args.value("memory", std::string()) == "disk";
    RETURN_IF_ERROR(paused && toDisk ? link_->hibernate(id) : link_->pause(id, paused));
    return json::object();
  }
  if (method == "set_limits") {
    ASSIGN_OR_RETURN(auto l, proto::limitsFromJson(args.value("limits", json::object())));
    RETURN_IF_ERROR(link_->setLimits(id, l));
    return json::object();
  }
  if (method == "set_egress") {
    std::vector<proto::EgressRule> rules;
    for (auto& x : args.value("rules", json::array())) {
      ASSIGN_OR_RETURN(auto r, proto::ruleFromJson(x));
      rules.push_back(std::move(r));
    }
    RETURN_IF_ERROR(link_->setEgress(id, rules));
    return json::object();
  }
  if (method == "egress_denials") {
    ASSIGN_OR_RETURN(auto d, link_->egressDenials(id));
    return proto::toJson(d);
  }
  if (method == "set_ports") {
    auto ps = args.find("ports");
    if (ps == args.end() || !ps->is_array() || ps->size() > 65535) {
      return invalidArg("ports", "ports must be a list of {port, gen}");
    }
    std::vector<proto::PortGen> ports;
    for (auto& p : *ps) {
      if (!p.is_object() || !p.contains("port") || !p["port"].is_number_integer() ||
          !p.contains("gen") || !p["gen"].is_number_unsigned()) {
        return invalidArg("ports", "ports must be a list of {port, gen}");
      }
      ports.push_back({p["port"].get<int>(), p["gen"].get<uint64_t>()});
    }
    RETURN_IF_ERROR(link_->setPorts(id, ports));
    return json::object();
  }
  if (method == "input") {
    ASSIGN_OR_RETURN(auto a, proto::inputFromJson(args.value("action", json::object())));
    RETURN_IF_ERROR(link_->input(id, a));
    return json::object();
  }
  return notFound("no such call: " + method);
}

void LinkService::serve(const std::shared_ptr<proto::ServerCall>& call) {
  json args = json::parse(call->args(), nullptr, false);
  Status st;
  const std::string& m = call->method();
  if (args.is_discarded() || !args.is_object()) {
    st = invalidArg("args", "args must be a JSON object");
  } else if (m == "exec") {
    return serveExec(call, args);
  } else if (m == "write_file") {
    st = serveWriteFile(*call, args);
  } else if (m == "read_file") {
    st = serveReadFile(*call, args);
  } else if (m == "pack_diff") {
    st = servePackDiff(*call, args);
  } else if (m == "screenshot") {
    st = serveScreenshot(*call, args);
  } else if (m == "port_open") {
    return servePortOpen(call, args);
  } else {
    auto r = runJson(m, args);
    if (r.isOk()) {
      (void)call->reply(r->dump(-1, ' ', false, json::error_handler_t::replace));
      return;
    }
    st = r.status();
  }
  if (!st.isOk()) {
    countError(st);
    (void)call->fail(st);
  }
}

void LinkService::serveExec(const std::shared_ptr<proto::ServerCall>& call, const json& args) {
  auto id = stringArg(args, "id");
  auto spec = id.isOk() ? proto::execFromJson(args.value("spec", json::object()))
                        : Result<proto::ExecSpec>(id.status());
  if (!spec.isOk()) {
    countError(spec.status());
    (void)call->fail(spec.status());
    return;
  }
  execs_++;
  auto relay = std::make_shared<ExecRelay>(call);
  proto::ExecCallbacks cb;
  cb.onOutput = [relay](bool isErr, std::string_view data) { relay->output(isErr, data); };
  cb.onDone = [this, relay](Result<proto::ExecResult> r) {
    if (!r.isOk()) countError(r.status());
    relay->done(std::move(r));
  };
  if (args.value("started", false)) cb.onStarted = [relay](int pid) { relay->started(pid); };
  auto exec = link_->startExec(*id, *spec, std::move(cb));
  // The platform's caller went away (or the link dropped): kill it.
  call->onCancel([exec](const Status&) { exec->cancel(); });
  {
    // The call's body carries the exec's input, resizes and signals as
    // records (proto::ExecControlDecoder).
    auto decoder = std::make_shared<proto::ExecControlDecoder>();
    call->onData(
        [exec, decoder](std::string_view bytes) {
          Status st = decoder->feed(bytes, *exec);
          if (!st.isOk()) {
            log::warn("link exec: bad control record: " + st.toString());
            exec->cancel();
          }
        },
        [] {});
  }
}

Status LinkService::serveWriteFile(proto::ServerCall& call, const json& args) {
  ASSIGN_OR_RETURN(std::string id, stringArg(args, "id"));
  ASSIGN_OR_RETURN(std::string path, stringArg(args, "path"));
  int mode = args.value("mode", 0644);
  proto::ByteSource src = [&call](char* buf, size_t n) {
    return call.read(buf, n, kBodyStallS);
  };
  ASSIGN_OR_RETURN(uint64_t written, link_->writeFile(id, path, mode, src));
  return call.reply(json{{"written", written}}.dump());
}

Status LinkService::serveReadFile(proto::ServerCall& call, const json& args) {
  ASSIGN_OR_RETURN(std::string id, stringArg(args, "id"));
  ASSIGN_OR_RETURN(std::string path, stringArg(args, "path"));
  RETURN_IF_ERROR(link_->readFile(
      id, path,
      [&call](std::optional<uint64_t> size) {
        json head = {{"size", size ? json(*size) : json(nullptr)}};
        return call.write(head.dump() + "\n", kBodyStallS);
      },
      [&call](std::string_view data) { return call.write(data, kBodyStallS); }));
  RETURN_IF_ERROR(call.end());
  return call.reply("{}");
}

Status LinkService::serveScreenshot(proto::ServerCall& call, const json& args) {
  ASSIGN_OR_RETURN(std::string id, stringArg(args, "id"));
  ASSIGN_OR_RETURN(std::string png, link_->screenshot(id));
  RETURN_IF_ERROR(call.write(png, kBodyStallS));
  RETURN_IF_ERROR(call.end());
  return call.reply("{}");
}

void LinkService::servePortOpen(const std::shared_ptr<proto::ServerCall>& call,
                                const json& args) {
  auto fail = [&](const Status& st) {
    countError(st);
    (void)call->fail(st);
  };
  auto id = stringArg(args, "id");
  if (!id.isOk()) return fail(id.status());
  auto p = args.find("port");
  if (p == args.end() || !p->is_number_integer() || p->get<int64_t>() < 1 ||
      p->get<int64_t>() > 65535) {
    return fail(invalidArg("port", "port must be from 1 to 65535"));
  }
  int port = p->get<int>();
  auto g = args.find("gen");
  if (g == args.end() || !g->is_number_unsigned()) {
    return fail(invalidArg("gen", "gen must be a non-negative integer"));
  }
  double timeoutS = std::clamp(args.value("timeout_s", 10.0), 0.1, 300.0);
  auto fd = link_->openPort(*id, port, g->get<uint64_t>(), timeoutS);
  if (!fd.isOk()) return fail(fd.status());
  // Cancelled meanwhile: the socket closes here.
  if (!call->event("o").isOk()) return;
  proto::PortRelay::serve(rt_, std::move(*fd), call, "port " + std::to_string(port) + " of " + *id);
}

namespace {
// Streams the file at `path` (exactly `size` bytes) into the call's body.
Status sendFile(proto::ServerCall& call, const std::string& path, int64_t size) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return sysError("open " + path);
  std::string buf(kChunk, '\0');
  int64_t sent = 0;
  while (sent < size) {
    ssize_t n = ::read(fd.get(), buf.data(), std::min<int64_t>(buf.size(), size - sent));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return sysError("read " + path);
    if (n == 0) return Status(Code::kDataLoss, path + " is shorter than announced");
    RETURN_IF_ERROR(call.write(std::string_view(buf.data(), size_t(n)), kBodyStallS));
    sent += n;
  }
  return Status::ok();
}
}  // namespace

Status LinkService::servePackDiff(proto::ServerCall& call, const json& args) {
  ASSIGN_OR_RETURN(std::string id, stringArg(args, "id"));
  RETURN_IF_ERROR(makeDirs(packDir_, 0700));
  std::string dir = packDir_ + "/" + randomHex(8);
  auto layer = link_->packDiff(id, dir);
  // The node's copy goes once sent (or on any error).
  struct Cleanup {
    std::string dir;
    ~Cleanup() { (void)removeTree(dir); }
  } cleanup{dir};
  if (!layer.isOk()) return layer.status();
  RETURN_IF_ERROR(call.write(proto::toJson(*layer).dump() + "\n", kBodyStallS));
  RETURN_IF_ERROR(sendFile(call, layer->path, layer->size));
  if (!layer->dataPath.empty() && layer->dataSize > 0) {
    RETURN_IF_ERROR(sendFile(call, layer->dataPath, layer->dataSize));
  }
  RETURN_IF_ERROR(call.end());
  return call.reply("{}");
}

}  // namespace dsec::edge
