// Test-only: a throwaway PostgreSQL cluster (initdb into a temp dir, the
// server on a Unix socket in that dir and a free 127.0.0.1 port, run as the
// unprivileged `postgres` user when we are root), stopped and removed by
// stop(). No system-wide service is involved. The server is a child of this
// process (not daemonized by pg_ctl), so stop() reaps it: nothing is left, not
// even a zombie under an init that does not reap. tests/pg_cluster.py is the
// same for pytest.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "common/status.h"

namespace dsec::platform {

class PgTestCluster {
 public:
  // kUnavailable, saying why, when this host cannot run one (no server
  // binaries under /usr/lib/postgresql/*/bin or $DSEC_PG_BIN, root without a
  // `postgres` user); the caller skips with that reason.
  static Result<std::unique_ptr<PgTestCluster>> start();
  ~PgTestCluster();  // stop()

  // Stops the server (fast shutdown, waited for) and removes the dir.
  Status stop();

  // URI of database `db` as the superuser `dsec`, over the Unix socket; with
  // `schema`, the session's search_path is that schema.
  std::string uri(const std::string& db = "dsec", const std::string& schema = "") const;
  const std::string& dir() const { return dir_; }
  int port() const { return port_; }

  // Creates an empty schema named after `prefix` in database dsec and returns
  // its name; dropSchema() drops it with its tables.
  Result<std::string> createSchema(const std::string& prefix);
  Status dropSchema(const std::string& name);
  // Runs one SQL command (no parameters) in database dsec.
  Status exec(const std::string& sql);

 private:
  PgTestCluster() = default;
  std::string bin_;   // directory of initdb, pg_ctl
  std::string dir_;   // the cluster's temp dir (data/, socket, log)
  std::string user_;  // who runs the server ("" when not root: ourselves)
  int port_ = 0;
  pid_t pid_ = -1;  // the postmaster
};

// The cluster the tests of this process share, started on first use and
// stopped when the process exits. kUnavailable: the reason to skip.
Result<PgTestCluster*> sharedPgTestCluster();

}  // namespace dsec::platform
