#include "cli/cluster_cmd.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/log.h"
#include "common/metrics.h"
#include "common/runtime.h"
#include "common/sha256.h"
#include "common/util.h"
#include "edge/edge_server.h"
#include "edge/image/node_cache.h"
#include "proto/sim_edge.h"
#include "proto/codec.h"

namespace dsec::cli {

using json = nlohmann::json;

namespace {

int fail(const std::string& msg) {
  std::cerr << "dsec: " << msg << "\n";
  return 1;
}

std::string selfDirectory() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string p(buf, size_t(n));
  return p.substr(0, p.rfind('/'));
}

int64_t totalMemoryMb() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  while (f >> key >> kb) {
    if (key == "MemTotal:") return kb / 1024;
    f.ignore(256, '\n');
  }
  return 4096;
}

// A positive number flag, or an error naming it.
Result<double> numberFlag(const ArgGet& get, const std::string& flag, double def) {
  std::string v = get(flag, "");
  if (v.empty()) return def;
  char* end = nullptr;
  double d = std::strtod(v.c_str(), &end);
  if (!end || *end || d < 0) return invalidArg(flag, "--" + flag + " must be a number >= 0");
  return d;
}

Result<std::string> loadOrCreateSecret(const std::string& path) {
  auto existing = readFile(path);
  if (existing.isOk()) {
    std::string t = *existing;
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
    if (t.size() >= 32) return t;
  }
  std::string t = randomHex(32);
  RETURN_IF_ERROR(writeFileAtomic(path, t + "\n", 0600));
  return t;
}

// --burst-pool P (default cloud; "none": no bursting), --burst-threshold X
// (0..1, default 0.8), --prestage 'POOL=REF[,REF...][;POOL=...]'.
Status burstFlags(const ArgGet& get, platform::ClusterOptions& co) {
  auto validName = [](const std::string& s) {
    if (s.empty() || s.size() > 63) return false;
    for (char c : s) {
      if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) {
        return false;
      }
    }
    return true;
  };
  co.burst.pool = get("burst-pool", "cloud");
  if (co.burst.pool == "none") co.burst.pool.clear();
  if (!co.burst.pool.empty() && !validName(co.burst.pool)) {
    return invalidArg("burst-pool", "--burst-pool must be 1-63 of [A-Za-z0-9._-] (or none)");
  }
  ASSIGN_OR_RETURN(co.burst.threshold, numberFlag(get, "burst-threshold", 0.8));
  if (co.burst.threshold > 1) {
    return invalidArg("burst-threshold", "--burst-threshold must be from 0 to 1 (a utilization)");
  }
  std::string spec = get("prestage", "");
  for (auto& part : splitString(spec, ';')) {
    if (part.empty()) continue;
    size_t eq = part.find('=');
    std::string pool = part.substr(0, eq);
    if (eq == std::string::npos || !validName(pool) || eq + 1 == part.size()) {
      return invalidArg("prestage", "--prestage takes POOL=REF[,REF...][;POOL=...], not '" +
                                        part + "'");
    }
    for (auto& ref : splitString(part.substr(eq + 1), ',')) {
      if (ref.empty()) return invalidArg("prestage", "--prestage: empty ref in '" + part + "'");
      co.prestage[pool].push_back(ref);
    }
  }
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<platform::Cluster>> startCluster(const ArgGet& get,
                                                        const std::string& dataDir,
                                                        platform::Store* store, edge::Edge* local,
                                                        const edge::EdgeOptions& fncall) {
  platform::ClusterOptions co;
  co.dataDir = dataDir;
  co.store = store;
  co.fncallLanguages = fncall.fncallLanguages;
  co.fncallZygoteMaxCalls = fncall.fncallZygoteMaxCalls;
  // The replica's id: kept in its data dir, so a restart is the same replica
  // (and fails its own half-made creates at once).
  co.replicaId = get("replica-id", "");
  if (co.replicaId.empty()) {
    ASSIGN_OR_RETURN(std::string id, loadOrCreateSecret(dataDir + "/replica_id"));
    co.replicaId = "r-" + id.substr(0, 12);
  }
  // The cluster's join token: the store keeps its SHA-256, set by the first
  // platform; every replica checks joins against it (docs/cluster.md).
  std::string tokenFile = get("join-token-file", dataDir + "/join_token");
  bool givenFile = !get("join-token-file", "").empty();
  std::string mine;
  if (auto t = readFile(tokenFile); t.isOk()) {
    mine = *t;
    while (!mine.empty() && (mine.back() == '\n' || mine.back() == ' ')) mine.pop_back();
  } else if (givenFile) {
    return invalidArg("join-token-file", "--join-token-file: " + t.status().message());
  }
  if (!mine.empty() && mine.size() < 32) {
    return invalidArg("join-token-file", tokenFile + " holds fewer than 32 characters");
  }
  std::string candidate = mine.empty() ? randomHex(32) : mine;
  ASSIGN_OR_RETURN(co.joinTokenHash, store->settingOrPut("join_token_sha256", sha256Hex(candidate)));
  if (co.joinTokenHash == sha256Hex(candidate)) {
    if (mine.empty()) RETURN_IF_ERROR(writeFileAtomic(tokenFile, candidate + "\n", 0600));
    log::info("edges join with the token in " + tokenFile);
  } else if (!mine.empty()) {
    return invalidArg("join-token-file",
                      tokenFile + " is not this cluster's join token (the store holds another, set "
                                  "by the first platform on it): pass that platform's token file");
  } else {
    log::info("edges join with the cluster's token (in the data dir of the platform that set it)");
  }
  ASSIGN_OR_RETURN(co.heartbeatTimeoutS, numberFlag(get, "heartbeat-timeout-s", 5));
  ASSIGN_OR_RETURN(co.leaseTtlS, numberFlag(get, "lease-ttl-s", std::max(2.0, co.heartbeatTimeoutS)));
  if (co.leaseTtlS <= 0) return invalidArg("lease-ttl-s", "--lease-ttl-s must be positive");
  ASSIGN_OR_RETURN(double inflight, numberFlag(get, "max-inflight", 16));
  if (inflight < 1) return invalidArg("max-inflight", "--max-inflight must be at least 1");
  co.maxInflightPerNode = int(inflight);
  ASSIGN_OR_RETURN(co.admissionWaitS, numberFlag(get, "admission-wait-s", 30));
  co.lookup = [dataDir, store](const std::string& digest) {
    return platform::Platform::describeLayer(store, dataDir, digest);
  };
  RETURN_IF_ERROR(burstFlags(get, co));
  co.resolveLayers = [store](const std::string& ref) {
    return platform::Platform::layersOfRef(store, ref);
  };
  ASSIGN_OR_RETURN(auto cluster, platform::Cluster::start(co));
  if (local) {
    // The in-process node takes what it is asked by default (as before
    // clusters): capacity bounds only when given.
    platform::NodeCapacity cap;
    ASSIGN_OR_RETURN(cap.cpus, numberFlag(get, "cpus", 1e6));
    ASSIGN_OR_RETURN(double mem, numberFlag(get, "memory-mb", 1e12));
    ASSIGN_OR_RETURN(double slots, numberFlag(get, "slots", 1e9));
    cap.memoryMb = int64_t(mem);
    cap.slots = int64_t(slots);
    cluster->addLocal(local, local, get("node-name", "local"), cap);
  }
  return cluster;
}

http::Handler platformHandler(platform::Platform* p, platform::Cluster* c, std::string token) {
  (void)token;  // the API's keys are the Platform's to check (checkAdmin)
  return [p, c](http::Request& req, http::Response& res) {
    if (startsWith(req.path, "/internal/")) return c->handleInternal(req, res);
    if (req.path == "/v1/nodes" || startsWith(req.path, "/v1/nodes/")) {
      // The API's keys (platform/tenants.h): admins only.
      if (Status st = p->checkAdmin(req.header("authorization")); !st.isOk()) {
        if (st.code() == Code::kUnauthenticated) res.setHeader("WWW-Authenticate", "Bearer");
        platform::countApiError(st.code());
        (void)res.send(httpStatusFor(st.code()), "application/json", proto::errorJson(st).dump());
        return;
      }
      return c->handleNodes(req, res);
    }
    if (req.path == "/metrics") req.path = "/v1/metrics";
    p->handle(req, res);
  };
}

// `dsec edge --simulate --sim-nodes K`: K simulated nodes in one process,
// each its own node as the platform sees it (name NAME-i, data dir
// DIR/node-i, its own port, keys and heartbeats), so a cluster of hundreds of
// nodes does not need hundreds of processes. Stops on SIGTERM/SIGINT.
int runSimNodes(const edge::EdgeAgentOptions& base, const http::ServerOptions& so0, int k,
                const proto::SimOptions& sopt, sigset_t sigs) {
  struct SimNode {
    std::unique_ptr<http::Server> server;
    std::unique_ptr<edge::EdgeAgent> agent;
    std::unique_ptr<proto::SimEdge> sim;
  };
  std::vector<std::unique_ptr<SimNode>> nodes;
  json list = json::array();
  for (int i = 0; i < k; ++i) {
    auto n = std::make_unique<SimNode>();
    http::ServerOptions so = so0;
    so.port = 0;
    n->server = std::make_unique<http::Server>(so);
    if (Status st = n->server->listen(); !st.isOk()) return fail(st.toString());
    edge::EdgeAgentOptions ao = base;
    ao.name = base.name + "-" + std::to_string(i);
    ao.dataDir = base.dataDir + "/node-" + std::to_string(i);
    if (Status st = makeDirs(ao.dataDir, 0700); !st.isOk()) return fail(st.toString());
    std::string host = base.url.substr(0, base.url.rfind(':'));
    ao.url = host + ":" + std::to_string(n->server->port());
    ao.registry = nullptr;  // its own: each node's /metrics shows that node alone
    n->agent = std::make_unique<edge::EdgeAgent>(ao);
    if (Status st = n->agent->start(); !st.isOk()) return fail("join " + ao.name + ": " + st.toString());
    n->sim = std::make_unique<proto::SimEdge>(sopt);
    n->agent->serveLink(n->sim.get(), [sim = n->sim.get()] { return sim->sandboxIds(); },
                        nullptr);
    auto* agent = n->agent.get();
    auto* server = n->server.get();
    // All the nodes' servers share the process's event loop: no thread each.
    server->start([agent](http::Request& req, http::Response& res) { agent->handle(req, res); });
    list.push_back({{"node", ao.name}, {"url", ao.url}});
    nodes.push_back(std::move(n));
  }
  log::info("dsec edge: " + std::to_string(k) + " simulated nodes " + base.name + "-0.." +
            std::to_string(k - 1) + " for " + base.platformUrl);
  json info = {{"url", list[0]["url"]}, {"pid", getpid()}, {"nodes", list}};
  (void)writeFileAtomic(base.dataDir + "/edge.json", info.dump() + "\n", 0644);
  int sig = 0;
  sigwait(&sigs, &sig);
  log::info(std::string("received ") + strsignal(sig) + ", shutting down");
  // As one simulated edge does: the platform hears its sandboxes go first.
  for (auto& n : nodes) {
    for (auto& id : n->sim->sandboxIds()) n->agent->reportDeath(id, "node stopped");
  }
  for (auto& n : nodes) n->server->stop();
  for (auto& n : nodes) {
    n->server->wait();
    n->agent->stop();
  }
  ::unlink((base.dataDir + "/edge.json").c_str());
  log::info("dsec edge: stopped");
  return 0;
}

uint64_t addServerMetrics(const http::Server& server) {
  return metrics::Registry::global().add([&server](metrics::Writer& w) {
    http::ServerStats s = server.stats();
    w.gauge("dsec_http_connections", "Open HTTP connections.", double(s.openConnections));
    w.gauge("dsec_http_max_connections",
            "Open HTTP connections at most (--max-connections, capped under RLIMIT_NOFILE).",
            double(s.maxConnections));
    w.gauge("dsec_http_requests_in_flight",
            "HTTP requests in flight now (from their headers to their last response byte).",
            double(s.inFlight));
    w.gauge("dsec_http_requests_in_flight_peak", "The most HTTP requests in flight at once.",
            double(s.peakInFlight));
    w.gauge("dsec_http_deferred_in_flight",
            "Responses answered later (execs in flight) not yet complete.",
            double(s.deferredInFlight));
    w.counter("dsec_http_connections_accepted_total", "HTTP connections accepted.",
              double(s.acceptedTotal));
    w.counter("dsec_http_connections_refused_total",
              "HTTP connections refused past --max-connections.", double(s.refusedTotal));
    w.counter("dsec_http_timeouts_total",
              "HTTP connections closed for a header, idle, body or send timeout.",
              double(s.timedOutTotal));
    Runtime& rt = Runtime::global();
    w.gauge("dsec_runtime_blocking_queued", "Blocking work waiting for a worker thread.",
            double(rt.blockingQueued()));
    w.gauge("dsec_runtime_blocking_busy", "Worker threads running blocking work.",
            double(rt.blockingBusy()));
    w.gauge("dsec_runtime_threads", "Threads of the event loop (io) and the blocking pool.",
            double(rt.blockingThreadCount()), {{"kind", "blocking"}});
    w.gauge("dsec_runtime_blocking_max_threads",
            "Blocking pool threads at most (--max-workers).", double(rt.blockingMaxThreads()));
    w.gauge("dsec_runtime_threads", "Threads of the event loop (io) and the blocking pool.",
            double(rt.ioThreadCount()), {{"kind", "io"}});
  });
}

Result<Daemon> prepareDaemon(const ArgGet& get, const std::string& listen,
                             const std::string& dataDir, int defaultMaxWorkers) {
  Daemon d;
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return invalidArg("listen", "--listen must be HOST:PORT");
  d.server.host = listen.substr(0, colon);
  int port = std::atoi(listen.substr(colon + 1).c_str());
  if (port < 0 || port > 65535) return invalidArg("listen", "bad port in --listen");
  d.server.port = uint16_t(port);
  // The event loop and the blocking pool, sized to the node (docs/concurrency.md).
  RuntimeOptions ro;
  ASSIGN_OR_RETURN(double io, numberFlag(get, "io-threads", 0));
  ASSIGN_OR_RETURN(double workers, numberFlag(get, "workers", 0));
  ASSIGN_OR_RETURN(double maxWorkers, numberFlag(get, "max-workers", defaultMaxWorkers));
  if (io > 64 || workers > 1024 || maxWorkers > 4096) {
    return invalidArg(io > 64 ? "io-threads" : workers > 1024 ? "workers" : "max-workers",
                      "--io-threads at most 64, --workers at most 1024, --max-workers at most "
                      "4096");
  }
  if (!get("max-workers", "").empty() && workers > maxWorkers) {
    return invalidArg("max-workers", "--max-workers must be at least --workers");
  }
  ro.ioThreads = int(io);
  ro.blockingThreads = int(workers);
  ro.maxBlockingThreads = int(maxWorkers);
  // A simulated node's latency sleeps on a worker (proto/sim_edge.h), and one
  // process may run hundreds of them.
  if (workers == 0 && get("simulate", "-") != "-") ro.blockingThreads = 64;
  Runtime::configureGlobal(ro);
  ASSIGN_OR_RETURN(double maxConn, numberFlag(get, "max-connections", 100000));
  if (maxConn < 1 || maxConn > 4e6) {
    return invalidArg("max-connections", "--max-connections must be 1..4000000");
  }
  d.server.maxConnections = int(maxConn);
  for (auto [flag, out] : {std::pair{"header-timeout-s", &d.server.headerTimeoutS},
                           std::pair{"idle-timeout-s", &d.server.idleTimeoutS},
                           std::pair{"body-timeout-s", &d.server.bodyTimeoutS},
                           std::pair{"send-timeout-s", &d.server.sendTimeoutS}}) {
    ASSIGN_OR_RETURN(*out, numberFlag(get, flag, *out));
    if (*out <= 0) return invalidArg(flag, std::string("--") + flag + " must be positive");
  }

  // Signals go to one thread that stops the server; everything else has them blocked.
  sigemptyset(&d.sigs);
  sigaddset(&d.sigs, SIGTERM);
  sigaddset(&d.sigs, SIGINT);
  sigaddset(&d.sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &d.sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Every connection is a socket: the fd limit must fit the connection
  // limit and what sandboxes, agents and layers hold besides (a root
  // process may raise its hard limit up to fs.nr_open).
  uint64_t fds = raiseNofileLimit(uint64_t(maxConn) + 65536);
  // Past the fd limit accept() fails and clients hang in the backlog; past
  // the connection cap they get a 503. So the cap stays under the limit,
  // leaving a tenth of it (at least 2048) to sandboxes, agents and layers.
  uint64_t reserve = std::max<uint64_t>(2048, fds / 10);
  if (fds < uint64_t(maxConn) + reserve) {
    int capped = int(fds > reserve + 64 ? fds - reserve : 64);
    log::warn("open files limited to " + std::to_string(fds) + " (RLIMIT_NOFILE; raising it " +
              "needs CAP_SYS_RESOURCE): connections capped at " + std::to_string(capped) +
              " instead of --max-connections " + std::to_string(int64_t(maxConn)));
    d.server.maxConnections = capped;
  }
  if (Status st = makeDirs(dataDir, 0700); !st.isOk()) {
    return Status(st.code(), st.toString(), st.sysErrno());
  }
  // Held (never closed) for the life of the process.
  int lockFd = ::open((dataDir + "/lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lockFd < 0 || flock(lockFd, LOCK_EX | LOCK_NB) != 0) {
    return Status(Code::kFailedPrecondition, "another dsec is running on " + dataDir);
  }
  return d;
}

int cmdEdge(const ArgGet& get) {
  std::string dataDir = get("data-dir", "");
  std::string platformUrl = get("platform", "");
  std::string listen = get("listen", "127.0.0.1:0");
  bool simulate = get("simulate", "-") != "-";
  if (dataDir.empty()) return fail("dsec edge needs --data-dir DIR");
  for (auto& u : splitString(platformUrl, ',')) {
    if (!startsWith(u, "http://")) {
      return fail("dsec edge needs --platform http://HOST:PORT[,http://HOST:PORT...]");
    }
  }
  std::string lvl = get("log-level", "info");
  if (lvl == "debug") log::setLevel(log::Level::kDebug);
  if (lvl == "warn") log::setLevel(log::Level::kWarn);
  if (!get("log-file", "").empty() && !log::setFile(get("log-file", ""), 64 << 20)) {
    return fail("cannot open --log-file " + get("log-file", ""));
  }
  if (!simulate && geteuid() != 0) return fail("dsec edge must run as root (or with --simulate)");
  auto daemon = prepareDaemon(get, listen, dataDir);
  if (!daemon.isOk()) return fail(daemon.status().message());
  http::ServerOptions so = daemon->server;
  sigset_t sigs = daemon->sigs;

  // The join token: from a file (kept out of /proc/PID/cmdline) or the flag.
  std::string joinToken = get("join-token", "");
  if (!get("join-token-file", "").empty()) {
    auto t = readFile(get("join-token-file", ""));
    if (!t.isOk()) return fail("--join-token-file: " + t.status().message());
    joinToken = *t;
    while (!joinToken.empty() && (joinToken.back() == '\n' || joinToken.back() == ' ')) {
      joinToken.pop_back();
    }
  }

  http::Server server(so);
  if (Status st = server.listen(); !st.isOk()) return fail(st.toString());
  std::string advertise = get("advertise", so.host == "0.0.0.0" ? "127.0.0.1" : so.host);

  edge::EdgeAgentOptions ao;
  ao.platformUrl = platformUrl;
  ao.joinToken = joinToken;
  ao.dataDir = dataDir;
  char host[256] = "node";
  gethostname(host, sizeof host - 1);
  ao.name = get("name", std::string(host) + "-" + std::to_string(server.port()));
  ao.pool = get("pool", "default");
  ao.url = "http://" + advertise + ":" + std::to_string(server.port());
  auto num = [&](const std::string& flag, double def) { return numberFlag(get, flag, def); };
  auto hb = num("heartbeat-s", 1);
  if (!hb.isOk() || *hb <= 0) return fail("--heartbeat-s must be a positive number");
  ao.heartbeatS = *hb;
  auto simCap = num("sim-capacity", 1000);
  auto simLat = num("sim-latency-ms", 0);
  if (!simCap.isOk() || !simLat.isOk())
    return fail("--sim-capacity and --sim-latency-ms take numbers");
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  auto cpus = num("cpus", simulate ? *simCap : 4.0 * double(ncpu > 0 ? ncpu : 1));
  auto mem = num("memory-mb", simulate ? *simCap * 512 : double(totalMemoryMb()));
  auto slots = num("slots", simulate ? *simCap : 256);
  for (auto* r : {&cpus, &mem, &slots}) {
    if (!r->isOk()) return fail(r->status().message());
  }
  ao.cpus = *cpus;
  ao.memoryMb = int64_t(*mem);
  ao.slots = int64_t(*slots);

  auto simNodes = num("sim-nodes", 1);
  if (!simNodes.isOk() || *simNodes < 1 || *simNodes > 1024) {
    return fail("--sim-nodes must be a number from 1 to 1024");
  }
  if (*simNodes > 1) {
    if (!simulate) return fail("--sim-nodes needs --simulate");
    proto::SimOptions sopt;
    sopt.latencyMs = int(*simLat);
    sopt.capacity = int64_t(*simCap);
    return runSimNodes(ao, so, int(*simNodes), sopt, sigs);
  }

  bool liveRestore = !simulate && get("live-restore", "no") == "yes";
  // One node in this process: its /metrics is the process's registry.
  ao.registry = &metrics::Registry::global();
  edge::EdgeAgent agent(ao);
  if (Status st = agent.start(); !st.isOk()) return fail("join: " + st.toString());

  std::unique_ptr<edge::Edge> real;
  std::unique_ptr<proto::SimEdge> sim;
  proto::EdgeLink* link;
  std::function<std::vector<std::string>()> ids;
  std::function<std::vector<std::string>()> layers;
  if (simulate) {
    proto::SimOptions sopt;
    sopt.latencyMs = int(*simLat);
    sopt.capacity = int64_t(*simCap);
    sim = std::make_unique<proto::SimEdge>(sopt);
    link = sim.get();
    ids = [s = sim.get()] { return s->sandboxIds(); };
  } else {
    edge::EdgeOptions eo;
    eo.dataDir = dataDir;
    eo.aetherPath = get("aether", selfDirectory() + "/dsec-aether");
    eo.diskQuota = get("disk-quota", "auto");
    eo.egressSubnet = get("egress-subnet", "10.88.0.0/16");
    eo.egressNat = get("egress-nat", "yes") == "yes";
    eo.registry = &metrics::Registry::global();
    eo.userns = get("userns", "auto");
    // A range per sandbox from this edge's window (docs/security.md): two
    // edges on one host need windows of their own.
    if (std::string w = get("userns-width", ""); !w.empty()) {
      auto width = edge::parseIdWidth(w);  // a multiple of 65536: checked at start
      if (!width.isOk()) return fail(width.status().message());
      eo.usernsWidth = *width;
    }
    if (std::string w = get("userns-window", ""); !w.empty()) {
      auto win = edge::parseIdWindow(w);
      if (!win.isOk()) return fail(win.status().message());
      std::tie(eo.usernsFirst, eo.usernsLast) = *win;
    }
    eo.liveRestore = get("live-restore", "no") == "yes";
    eo.microvmAccel = get("microvm-accel", "auto");
    eo.microvmAgentChannel = get("microvm-agent-channel", "auto");
    auto statsEvery = num("stats-interval-s", eo.statsIntervalS);
    if (!statsEvery.isOk() || !(*statsEvery == 0 || (*statsEvery >= 0.1 && *statsEvery <= 3600))) {
      return fail("--stats-interval-s must be 0 (off) or 0.1..3600");
    }
    eo.statsIntervalS = *statsEvery;
    eo.lookup = [&agent](const std::string& digest) { return agent.lookupLayer(digest); };
    eo.cache.storeUri = get("blob-store", "");
    if (eo.cache.storeUri.empty()) {
      return fail(
          "dsec edge needs --blob-store URI (file:///DIR or http(s)://...): where layers are");
    }
    eo.cache.loader = get("loader", "auto");
    auto e = edge::Edge::start(eo);
    if (!e.isOk()) return fail("edge: " + e.status().toString());
    real = std::move(*e);
    link = real.get();
    ids = [r = real.get()] { return r->sandboxIds(); };
    real->setDeathHandler([&agent](const std::string& id, const std::string& why) {
      // Off the backend's thread: the report calls the platform, which calls back.
      std::thread([&agent, id, why] { agent.reportDeath(id, why); }).detach();
    });
    layers = [e = real.get()] {
      std::vector<std::string> out;
      for (auto& l : e->nodeCache().layers()) out.push_back(l.digest);
      return out;
    };
    // The layers the platform asks this node's pool to hold (--prestage).
    agent.setPrestager(
        [e = real.get()](const std::string& digest) { return e->nodeCache().prestage(digest); });
  }
  agent.serveLink(link, ids, layers);
  log::info("dsec edge: node " + ao.name + (simulate ? " (simulated)" : "") + " serving " + ao.url +
            " for " + platformUrl);
  json info = {{"url", ao.url}, {"pid", getpid()}, {"node", ao.name}};
  (void)writeFileAtomic(dataDir + "/edge.json", info.dump() + "\n", 0644);

  std::thread sigThread([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    log::info(std::string("received ") + strsignal(sig) + ", shutting down");
    // Its sandboxes go with it (unless they stay for the next edge): the
    // platform hears so now, while this node still answers its destroys, and
    // records them failed rather than lost.
    if (!liveRestore) {
      for (auto& id : ids()) agent.reportDeath(id, "node " + ao.name + " stopped");
    }
    server.stop();
    sigwait(&sigs, &sig);
    _exit(2);
  });
  server.serve([&agent](http::Request& req, http::Response& res) { agent.handle(req, res); });
  agent.stop();
  if (real) {
    real->setDeathHandler(nullptr);
    real->shutdown();
  }
  ::unlink((dataDir + "/edge.json").c_str());
  sigThread.detach();
  log::info("dsec edge: stopped");
  return 0;
}

}  // namespace dsec::cli
