// The process shapes of a cluster (docs/cluster.md): the platform side of
// `dsec up` and `dsec platform` (node registry, edges' internal API, GET
// /v1/nodes) and `dsec edge`, a node in its own process.
#pragma once

#include <signal.h>

#include <functional>
#include <memory>
#include <string>

#include "common/http_server.h"
#include "common/status.h"
#include "edge/edge.h"
#include "platform/cluster.h"
#include "platform/platform.h"
#include "platform/store.h"

namespace dsec::cli {

// A flag's value, or def when absent.
using ArgGet = std::function<std::string(const std::string& flag, const std::string& def)>;

// The node registry of a platform in dataDir: the join token (created 0600 in
// <dataDir>/join_token unless --join-token-file names one), --heartbeat-timeout-s,
// --max-inflight, --admission-wait-s; `local` (may be null) is the
// in-process node of `dsec up`, offered with --cpus/--memory-mb/--slots.
// `fncall` (its fncallLanguages and fncallZygoteMaxCalls) is how every node
// runs fncall sandboxes (ClusterOptions).
Result<std::unique_ptr<platform::Cluster>> startCluster(const ArgGet& get,
                                                        const std::string& dataDir,
                                                        platform::Store* store, edge::Edge* local,
                                                        const edge::EdgeOptions& fncall);

// The platform process's HTTP handler: /internal/ to the cluster (edges'
// credentials), /v1/nodes to the cluster (API token), /metrics as
// /v1/metrics, the rest to the Platform.
http::Handler platformHandler(platform::Platform* p, platform::Cluster* c, std::string token);

// What `dsec up`, `dsec platform` and `dsec edge` do before serving: parse
// --listen (HOST:PORT), block SIGTERM/SIGINT/SIGHUP in every thread (the
// caller sigwait()s `sigs`), ignore SIGPIPE, raise RLIMIT_NOFILE to its hard
// limit (each sandbox holds an agent socket and a pidfd), make dataDir (0700)
// and hold its lock for the process's life. The error says which step failed.
struct Daemon {
  http::ServerOptions server;
  sigset_t sigs;
};
// The listening address, the server's connection limit and timeouts
// (--max-connections, --header-timeout-s, --idle-timeout-s, --body-timeout-s,
// --send-timeout-s), the signal mask, RLIMIT_NOFILE raised to fit the
// connection limit, and the data dir made and locked. Errors name the flag.
// defaultMaxWorkers: --max-workers when not given (0: --workers, a fixed pool).
Result<Daemon> prepareDaemon(const ArgGet& get, const std::string& listen,
                             const std::string& dataDir, int defaultMaxWorkers = 0);
// The HTTP server's connection figures (dsec_http_*) in the process's
// metrics registry; the returned id removes them.
uint64_t addServerMetrics(const http::Server& server);

// `dsec edge --platform URL --join-token T --data-dir D --listen HOST:PORT
// [--name N] [--pool P] [--simulate --sim-latency-ms N --sim-capacity N] ...`
int cmdEdge(const ArgGet& get);

}  // namespace dsec::cli
