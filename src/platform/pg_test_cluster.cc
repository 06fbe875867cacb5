#include "platform/pg_test_cluster.h"

#include <fcntl.h>
#include <grp.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "common/util.h"

namespace dsec::platform {

namespace {

bool executable(const std::string& p) { return ::access(p.c_str(), X_OK) == 0; }

Result<std::string> findBinDir() {
  if (const char* env = getenv("DSEC_PG_BIN"); env && *env) {
    if (executable(std::string(env) + "/initdb") && executable(std::string(env) + "/pg_ctl")) {
      return std::string(env);
    }
    return Status(Code::kUnavailable, std::string("$DSEC_PG_BIN=") + env + " has no initdb/pg_ctl");
  }
  for (int v = 17; v >= 13; --v) {
    std::string d = "/usr/lib/postgresql/" + std::to_string(v) + "/bin";
    if (executable(d + "/initdb") && executable(d + "/pg_ctl")) return d;
  }
  return Status(Code::kUnavailable,
                "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb, or "
                "$DSEC_PG_BIN; Debian package postgresql, installed by scripts/install-deps.sh)");
}

// Runs argv (as `user` through runuser when set), output appended to `log`.
Status run(const std::vector<std::string>& argv, const std::string& user, const std::string& log) {
  std::vector<std::string> full;
  if (!user.empty()) full = {"/usr/sbin/runuser", "-u", user, "--"};
  full.insert(full.end(), argv.begin(), argv.end());
  std::vector<char*> args;  // built before fork(): the child only calls async-signal-safe functions
  for (auto& a : full) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return Status(Code::kInternal, "fork", errno);
  if (pid == 0) {
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    if (null >= 0) dup2(null, 0);
    execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Status::ok();
  auto text = readFile(log);
  std::string tail = text.isOk() ? *text : "";
  if (tail.size() > 2000) tail = tail.substr(tail.size() - 2000);
  return Status(Code::kInternal,
                argv[0] + " failed (status " + std::to_string(status) + "): " + tail);
}

int freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

Status execOn(const std::string& conninfo, const std::string& sql) {
  PGconn* c = PQconnectdb(conninfo.c_str());
  if (PQstatus(c) != CONNECTION_OK) {
    std::string msg = PQerrorMessage(c);
    PQfinish(c);
    return Status(Code::kUnavailable, "test cluster: connect: " + msg);
  }
  PQsetNoticeProcessor(
      c, [](void*, const char*) {}, nullptr);  // DROP ... CASCADE's lists
  PGresult* r = PQexec(c, sql.c_str());
  Status st;
  if (PQresultStatus(r) != PGRES_COMMAND_OK && PQresultStatus(r) != PGRES_TUPLES_OK) {
    st = Status(Code::kInternal, "test cluster: " + sql + ": " + PQerrorMessage(c));
  }
  PQclear(r);
  PQfinish(c);
  return st;
}

}  // namespace

Result<std::unique_ptr<PgTestCluster>> PgTestCluster::start() {
  ASSIGN_OR_RETURN(std::string bin, findBinDir());
  std::unique_ptr<PgTestCluster> c(new PgTestCluster());
  c->bin_ = bin;
  uid_t uid = geteuid();
  gid_t gid = getegid();
  if (uid == 0) {
    // The server refuses to run as root.
    passwd* pw = getpwnam("postgres");
    if (!pw) {
      return Status(Code::kUnavailable,
                    "running as root and there is no `postgres` user to run the server as");
    }
    if (!executable("/usr/sbin/runuser")) return Status(Code::kUnavailable, "no /usr/sbin/runuser");
    c->user_ = "postgres";
    uid = pw->pw_uid;
    gid = pw->pw_gid;
  }
  char tmpl[] = "/tmp/dsec-pg-XXXXXX";
  if (!mkdtemp(tmpl)) return Status(Code::kInternal, "mkdtemp /tmp/dsec-pg-XXXXXX", errno);
  c->dir_ = tmpl;  // from here on the destructor removes it
  if (!c->user_.empty() && ::chown(c->dir_.c_str(), uid, gid) != 0) {
    return Status(Code::kInternal, "chown " + c->dir_, errno);
  }
  std::string log = c->dir_ + "/setup.log";
  RETURN_IF_ERROR(run({bin + "/initdb", "-D", c->dir_ + "/data", "-U", "dsec", "--auth-local=trust",
                       "--auth-host=trust", "--no-sync", "-E", "UTF8", "--locale=C"},
                      c->user_, log));
  std::string serverLog = c->dir_ + "/server.log";
  for (int attempt = 0;; ++attempt) {
    c->port_ = freePort();
    if (c->port_ == 0) return Status(Code::kInternal, "no free port");
    std::vector<std::string> argv = {
        bin + "/postgres",        "-D", c->dir_ + "/data",           "-k", c->dir_, "-p",
        std::to_string(c->port_), "-c", "listen_addresses=127.0.0.1"};
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    bool root = getuid() == 0;
    pid_t pid = fork();
    if (pid < 0) return Status(Code::kInternal, "fork", errno);
    if (pid == 0) {
      int fd = ::open(serverLog.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      if (null >= 0) dup2(null, 0);
      setsid();  // a ^C to the test goes to the test; stop() ends the server
      if (root && (setgroups(0, nullptr) != 0 || setgid(gid) != 0 || setuid(uid) != 0)) {
        _exit(126);
      }
      execv(args[0], args.data());
      _exit(127);
    }
    c->pid_ = pid;
    // Ready when it answers on its socket; gone early: the port was taken
    // between freePort() and its bind, or something worse (the log says).
    std::string conninfo = "host=" + c->dir_ + " port=" + std::to_string(c->port_) +
                           " user=dsec dbname=postgres connect_timeout=2";
    bool ready = false, exited = false;
    for (int i = 0; i < 600 && !ready && !exited; ++i) {
      ready = PQping(conninfo.c_str()) == PQPING_OK;
      int status = 0;
      if (!ready && waitpid(pid, &status, WNOHANG) == pid) exited = true;
      if (!ready && !exited) usleep(50 * 1000);
    }
    if (ready) break;
    if (!exited) return Status(Code::kInternal, "test cluster: the server did not answer in 30 s");
    c->pid_ = -1;
    if (attempt == 2) {
      auto text = readFile(serverLog);
      return Status(Code::kInternal,
                    "test cluster: the server exited: " + (text.isOk() ? *text : ""));
    }
  }
  RETURN_IF_ERROR(execOn(c->uri("postgres"), "CREATE DATABASE dsec"));
  return c;
}

PgTestCluster::~PgTestCluster() { (void)stop(); }

Status PgTestCluster::stop() {
  Status st;
  if (pid_ > 0) {
    // SIGINT: fast shutdown (sessions ended, a checkpoint, exit).
    ::kill(pid_, SIGINT);
    int status = 0;
    bool gone = false;
    for (int i = 0; i < 600 && !gone; ++i) {
      gone = waitpid(pid_, &status, WNOHANG) == pid_;
      if (!gone) usleep(50 * 1000);
    }
    if (!gone) {
      ::kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      st = Status(Code::kInternal, "test cluster: the server ignored SIGINT for 30 s; killed");
    }
    pid_ = -1;
  }
  if (!dir_.empty()) {
    if (Status rm = removeTree(dir_); st.isOk()) st = rm;
    dir_.clear();
  }
  return st;
}

std::string PgTestCluster::uri(const std::string& db, const std::string& schema) const {
  // The socket directory goes in the query: a path is no URI host.
  std::string u = "postgresql://dsec@/" + db + "?host=" + dir_ + "&port=" + std::to_string(port_);
  if (!schema.empty()) u += "&options=-csearch_path%3D" + schema;
  return u;
}

Result<std::string> PgTestCluster::createSchema(const std::string& prefix) {
  std::string name = prefix + "_" + randomHex(6);
  RETURN_IF_ERROR(exec("CREATE SCHEMA " + name));
  return name;
}

Status PgTestCluster::dropSchema(const std::string& name) {
  return exec("DROP SCHEMA IF EXISTS " + name + " CASCADE");
}

Status PgTestCluster::exec(const std::string& sql) { return execOn(uri("dsec"), sql); }

Result<PgTestCluster*> sharedPgTestCluster() {
  static std::mutex mu;
  static std::unique_ptr<PgTestCluster> cluster;  // stopped by its destructor at exit
  static Status failed;
  std::lock_guard lk(mu);
  if (cluster) return cluster.get();
  if (!failed.isOk()) return failed;
  auto c = PgTestCluster::start();
  if (!c.isOk()) {
    failed = c.status();
    return failed;
  }
  cluster = std::move(*c);
  return cluster.get();
}

}  // namespace dsec::platform
