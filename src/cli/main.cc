// The dsec command: `dsec up` runs the platform and an edge in one process;
// the other subcommands are thin clients of the REST API.
#include <fcntl.h>
#include <signal.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cli/cluster_cmd.h"
#include "common/http_client.h"
#include "common/http_server.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/util.h"
#include "edge/edge.h"
#include "edge/image/fanotify_loader.h"
#include "edge/image/fuse_loader.h"
#include "edge/qemu.h"
#include "common/sha256.h"
#include "image/build_context.h"
#include "image/layer_builder.h"
#include "image/oci_import.h"
#include "image/credential_helper.h"
#include "image/registry_client.h"
#include "platform/platform.h"
#include "platform/store.h"
#include "ui/ui_assets.h"

using json = nlohmann::json;
using namespace dsec;

namespace {

constexpr const char* kDefaultDataDir = "/var/lib/dsec";

const char* kUsage = R"(usage: dsec COMMAND [OPTIONS]

  up [--data-dir DIR] [--listen HOST:PORT] [--aether PATH] [--log-level debug|info|warn]
     [--store sqlite|postgres://USER[:PASSWORD]@HOST[:PORT]/DB[?PARAM=V...]]
        Run the platform and an edge in one process (REST API, state store,
        local blob store). Stops on SIGTERM/SIGINT, destroying its sandboxes
        (unless --live-restore). A crash destroys none: the next start on the
        same data dir re-adopts them.
  up --store: where the platform keeps its state: sqlite (default: <data-dir>/state.db)
        or a libpq connection URI, postgres:// or postgresql:// (e.g.
        postgresql://dsec@db.example:5432/dsec?sslmode=require; a password is
        better kept in ~/.pgpass or $PGPASSWORD). The schema is created or
        upgraded at start; see docs/stores.md
  up also takes --gc-grace-s S: unreferenced layers older than S are deleted (default 600)
     --insecure-registry HOST (repeatable), --registry-ca FILE (PEM, instead of the
        system CAs), --registry-auth CONFIG.json (credentials for pulls that bring
        none), --pull-workers N (layers fetched and converted at once; default 4),
        --registry-allow HOST (repeatable: tenants may pull from it though it is on a
        loopback, private or link-local address; admins always may)
     --expose-domain D: exposed ports' host-form URLs are http://PORT-ID.D[:port]/
        (default localhost, which browsers resolve to loopback; empty: path form only),
        --expose-scheme http|https, --expose-port P (default the listener's; -1 none),
        --public-url URL (the platform as clients reach it, for path-form URLs)
     --ui-dir DIR: serve the web console (/ui) from DIR, the output of
        `node ui/build.mjs --out DIR --watch`, instead of the copy built in (development)
     --metrics-history-interval-s S: the console's charts sample metrics this often
        (default 10; the last hour is kept in memory: GET /v1/metrics/history)
     --stats-interval-s S: the node reads each sandbox's CPU, memory and task figures
        this often into its last 240 readings (default 15: an hour; 0: off;
        GET /v1/sandboxes/ID/stats). Also for edge
     --stopped-retention-max N: stopped sandboxes stay listed for an hour, and at
        most N of them (the longest stopped go first; default 10000)
     --blob-store URI: where the node reads layer blobs: file:///DIR or http(s)://HOST/PREFIX
        (default file://<data-dir>/blobs, the platform's own blob directory)
     --blob-store-ca FILE: CA certificates (PEM) an https:// store is checked against
     --loader auto|direct|fanotify|fuse: how layer data reaches the node (default auto:
        direct for file://, else fanotify where the kernel allows it, else fuse)
     --cache-mb N: node cache limit (unused layers evicted past it; default none)
     --loader-timeout-s S: a loader process silent this long is restarted (default 5)
     --max-connections N: open HTTP connections at most (default 100000; RLIMIT_NOFILE
        is raised to fit); --header-timeout-s S (30), --idle-timeout-s S (300),
        --body-timeout-s S (60), --send-timeout-s S (300): how long a client may take
        to send a request's headers, to start its next request, to go silent in a
        body, to take no response bytes (docs/concurrency.md). Also for platform and edge
     --io-threads N, --workers N, --max-workers N: the event loop's threads (default
        1 per 4 cores, 1..4) and the pool running blocking work: threads always there
        (default 4 per core, 8..32; 64 for edge --simulate) and at most, added one per
        5 ms while work waits with none free and ended after 10 s idle (default: up and
        edge --workers, a fixed pool; platform 256). Also for platform and edge
     --log-file PATH [--log-max-mb N]: log there instead of stderr, rotated to PATH.1
        past N MiB (default 64); at most 1000 lines a second, the rest counted
     --prefetch-window-s S: chunks read this long after a layer is attached are
        prefetched when it is next attached with a cold cache (default 15)
     --disk-quota auto|xfs|ext4|btrfs|tmpfs|none: how disk_mb is enforced (default auto:
        xfs project quotas (ENOSPC), else an ext4 loop image per sandbox (ENOSPC),
        else btrfs qgroups (EDQUOT), else tmpfs; see
        docs/container-backend.md) and --disk-pool-mb N: size of the sparse xfs/btrfs
        pool image (default: the free space of the data dir)
     --fncall-pool-max N: warm fncall sandboxes for one-shot calls (POST /v1/run) this
        node keeps at most, all pools together (default 16); --fncall-pool-idle-s S: an
        idle one is destroyed after S seconds (default 60)
     --fncall-zygote-max-calls N: calls a python zygote forks before a new one (with
        a new hash secret) replaces it (default 1024; see docs/fncall.md)
     --fncall-language NAME=ARGV (repeatable): a language calls may name, run as ARGV
        split on spaces with the code appended as one more argument, from the
        sandbox's image (e.g. --fncall-language 'node=node -e' --fncall-language
        'ruby=/usr/bin/ruby -e'); python and bash are built in. --fncall-languages
        FILE: the same from a JSON object {"node": ["node", "-e"], ...}; see docs/fncall.md
     --trajectory-retention-s S: trajectories whose last step is older are deleted
        (default 604800, a week; 0: never)
     --setup-egress LIST: what the built-in `setup` policy may reach, comma-separated
        (10.0.0.0/8:80, mirror.example:443, [2001:db8::/32]:443; default: nothing)
     --setup-dns LIST: resolvers `setup` sandboxes use (allowed on port 53)
     --egress-subnet CIDR: IPv4 subnet of the veths of sandboxes with egress (default
        10.88.0.0/16) and --egress-nat yes|no: masquerade them out of the host (default yes)
     --userns auto|off: run each sandbox in a user namespace of its own, root inside =
        an unprivileged host uid no other sandbox has (default auto: where the kernel
        supports it; see docs/security.md); --userns-width N: the ids each sandbox maps,
        0..N-1 (a multiple of 65536, default 65536); --userns-window FIRST-LAST: the host
        ids the sandboxes' ranges come from (default 524288-1879048191, less the host's
        /etc/subuid and /etc/subgid entries)
     --live-restore yes|no: a graceful stop leaves running sandboxes for the next
        start to re-adopt, e.g. across an upgrade (default no: it destroys them)
     --microvm-accel auto|kvm|tcg: the microvm backend's accelerator (default auto: KVM
        if a probe guest runs on /dev/kvm and QEMU boots the guest kernel under it, else
        TCG); --microvm-boot-timeout-s S (default
        120); --microvm-guest-dir DIR (default microvm-guest/ beside dsec-aether);
        --microvm-agent-channel auto|vsock|virtio-serial (default auto: vsock where
        /dev/vhost-vsock opens); --qemu PATH (default qemu-system-x86_64). See docs/microvm.md
     --vm-boot-timeout-s S: how long a vm sandbox's qemu-guest-agent may take to answer
        after QEMU starts (default 300; one retry); --qemu-img PATH (default qemu-img).
        The vm backend uses --microvm-accel's choice too. See docs/vm.md
  platform [--data-dir DIR] [--listen HOST:PORT] [--store ...] [--join-token-file F]
           [--heartbeat-timeout-s S] [--max-inflight N] [--admission-wait-s S]
           [--burst-pool P|none] [--burst-threshold X] [--prestage 'POOL=REF,...;...']
           [--batch-workers N]   threads creating batches' sandboxes, at most (default:
                                 8 for up, 128 for platform); they start as batches come
           [--replica-id ID] [--lease-ttl-s S]
        The control plane alone (API, store, scheduler): edges join it with the
        token in <data-dir>/join_token (0600). `dsec up` takes the same flags and
        also accepts edges besides its own node. Several platforms on one
        --store postgres://... are replicas of one cluster. See docs/cluster.md
  edge --platform URL[,URL...] --data-dir DIR [--join-token T | --join-token-file F]
       [--listen HOST:PORT] [--name N] [--pool P] [--cpus N] [--memory-mb N] [--slots N]
       [--heartbeat-s S] --blob-store URI [--loader ...] [--live-restore yes|no]
       [--userns auto|off] [--userns-width N] [--userns-window FIRST-LAST]
       [--simulate [--sim-latency-ms N] [--sim-capacity N] [--sim-nodes K]]
        A node in its own process: joins the platform, heartbeats, serves the
        platform's calls (each authenticated); --simulate runs no sandboxes;
        --sim-nodes K runs K simulated nodes (NAME-0..K-1) in this one process
  image import --name NAME[:TAG] [--kind base|workspace|toolkit|diff]
               [--format auto|rootfs|oci|docker] [--owner-width N] PATH
        Build EROFS layers from a root filesystem (dir or tarball), an OCI image
        layout (dir or tar) or a `docker save` archive (one layer per image layer);
        the image config's User, Env and WorkingDir become the sandboxes' defaults.
        Files owned by a uid or gid >= N (default 65536, a multiple of 65536: the
        nodes' `up --userns-width`) are imported but warned about: sandboxes see
        them as 65534 and cannot change them (docs/images.md)
  image import --kind disk --name NAME[:TAG] PATH
        Store a bootable disk image (qcow2 or raw, with its own kernel and init, e.g. a
        cloud image with qemu-guest-agent) for backend vm (docs/vm.md)
  image pull [--platform OS/ARCH[/VARIANT]] [--name NAME[:TAG]] [--insecure-registry HOST]
             [--auth-file CONFIG.json] REF
        Pull REF (e.g. debian:12, ghcr.io/org/img@sha256:...) from its OCI registry: the
        platform fetches and converts each layer once (a layer it has is not fetched
        again) and names the image HOST/REPO:TAG unless --name says otherwise.
        Credentials come from --auth-file, else $DOCKER_CONFIG/config.json, else
        ~/.docker/config.json; --insecure-registry HOST: plain http for that host
  image build [-f DOCKERFILE] -t NAME[:TAG] [--build-arg K=V]... [--target STAGE]
              [--network] [--no-cache] [--platform OS/ARCH] [--insecure-registry] CONTEXT
        Build an image from a Dockerfile (default CONTEXT/Dockerfile): CONTEXT is tarred
        here (its .dockerignore applied) and uploaded; each RUN runs in a sandbox of the
        image so far (no egress; --network: the setup policy's), each RUN/COPY/ADD is a
        layer, and steps whose inputs did not change come from the build cache
        (docs/images.md). Steps and RUN output go to stderr; the image ref to stdout
  image ls
  image tag SRC NAME[:TAG]
  image rm NAME[:TAG]...
  layer ls
  gc [--grace-s S]                       Delete layers no image names and no sandbox uses
  sandbox create --image REF [--workspace REF]... [--toolkit REF]... [--diff REF]...
                 [--cpu N] [--memory-mb N] [--ttl-s N] [--policy P] [--label K=V]... [--env K=V]...
                 [--user U]   who execs run as by default (else the image's User, else root)
                 [--count N [--all-or-nothing yes] [--wait yes]]   N alike: a batch
                 (docs/batches.md); prints the batch id
  sandbox ls [--label K=V]... [--batch ID]
  sandbox rm ID... | --label K=V... | --batch ID
  sandbox batch ls | show ID | rm ID     Batches and their progress; rm destroys its sandboxes
  sandbox phase ID POLICY [--readonly PATH]... [--hide PATH]...   Switch its security policy
  sandbox audit ID                       Syscalls it tried and was refused
  sandbox expose ID PORT [--ttl-s S] [--rotate]   Reach a port of it through the platform
  sandbox unexpose ID PORT | sandbox ports ID      End an exposure | list them
  sandbox exec ID [--timeout S] [--user U] [--cwd DIR] -- CMD [ARG...]
  sandbox shell ID [--user U] [--cwd DIR] [--env K=V]... [-- CMD [ARG...]]
                                         An interactive terminal (default: bash, else sh);
                                         the shell's exit ends it
  exec ID ... -- CMD [ARG...]            (same as sandbox exec)
  tenant create [ID] [--name N] [--role user|admin] [--max-sandboxes N] [--max-cpu N]
                [--max-memory-mb N] [--creates-per-s N] [--create-burst N]
  tenant ls | tenant rm ID | tenant quota ID [--max-... N]...   (admin; docs/tenants.md)
  key create TENANT [--name N]           Prints the new key once (only its hash is kept)
  key ls TENANT | key rm TENANT KEY_ID   (admin)
  whoami                                 The tenant and role of this client's key

Client commands find the platform by --url/--token, else $DSEC_URL/$DSEC_TOKEN,
else from --data-dir (default /var/lib/dsec): <dir>/up.json and <dir>/token.
)";

struct Args {
  std::vector<std::string> positional;
  std::multimap<std::string, std::string> opts;
  std::vector<std::string> rest;  // after "--"
  std::string get(const std::string& k, const std::string& def = "") const {
    auto it = opts.find(k);
    return it == opts.end() ? def : it->second;
  }
  std::vector<std::string> all(const std::string& k) const {
    std::vector<std::string> v;
    for (auto [it, end] = opts.equal_range(k); it != end; ++it) v.push_back(it->second);
    return v;
  }
};

Args parseArgs(int argc, char** argv, int start) {
  Args a;
  for (int i = start; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--") {
      for (++i; i < argc; ++i) a.rest.push_back(argv[i]);
      break;
    }
    if (startsWith(s, "--")) {
      size_t eq = s.find('=');
      if (eq != std::string::npos) {
        a.opts.emplace(s.substr(2, eq - 2), s.substr(eq + 1));
      } else if (i + 1 < argc && !startsWith(argv[i + 1], "--")) {
        a.opts.emplace(s.substr(2), argv[++i]);
      } else {
        a.opts.emplace(s.substr(2), "");
      }
    } else {
      a.positional.push_back(s);
    }
  }
  return a;
}

// Overwrites with '*' the passwords of PostgreSQL URIs among the arguments
// (user info, `password=`), once parsed: /proc/PID/cmdline is world-readable.
void maskUriPasswords(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* s = argv[i];
    char* uri = strstr(s, "postgres://");
    if (!uri) uri = strstr(s, "postgresql://");
    if (!uri) continue;
    char* auth = strstr(uri, "://") + 3;
    size_t authLen = strcspn(auth, "/?");
    char* at = static_cast<char*>(memrchr(auth, '@', authLen));
    char* colon = at ? static_cast<char*>(memchr(auth, ':', size_t(at - auth))) : nullptr;
    if (colon) memset(colon + 1, '*', size_t(at - colon - 1));
    for (char* p = strstr(uri, "password="); p; p = strstr(p, "password=")) {
      p += strlen("password=");
      memset(p, '*', strcspn(p, "&"));
    }
  }
}

int die(const std::string& msg) {
  std::cerr << "dsec: " << msg << "\n";
  return 1;
}

// ---------------------------------------------------------------- dsec up

std::string selfDir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string p(buf, size_t(n));
  return p.substr(0, p.rfind('/'));
}

Result<std::string> loadOrCreateToken(const std::string& dataDir) {
  std::string path = dataDir + "/token";
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

// A whole-number flag in [lo, hi], `def` when not given.
Result<long long> rangeFlag(const Args& a, const std::string& flag, long long lo, long long hi,
                            long long def) {
  if (a.get(flag).empty()) return def;
  long long n = std::atoll(a.get(flag).c_str());
  if (n < lo || n > hi) {
    return invalidArg(flag, "--" + flag + " must be a number from " + std::to_string(lo) +
                                " to " + std::to_string(hi));
  }
  return n;
}

// --fncall-language NAME=ARGV (repeatable) and --fncall-languages FILE.
Result<std::map<std::string, std::vector<std::string>>> fncallLanguagesFromArgs(const Args& a) {
  std::map<std::string, std::vector<std::string>> out;
  auto add = [&out](const std::string& name, std::vector<std::string> argv,
                    const std::string& flag) -> Status {
    bool ok = !name.empty() && name.size() <= 32;
    for (char c : name) {
      ok = ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
                  c == '+' || c == '.');
    }
    if (!ok) return invalidArg(flag, flag + ": bad language name '" + name + "' (a-z 0-9 _ - + .)");
    if (name == "python" || name == "bash") {
      return invalidArg(flag, flag + ": " + name + " is built in");
    }
    if (argv.empty() || argv[0].empty()) {
      return invalidArg(flag, flag + ": language " + name + " needs an argv (e.g. 'node -e')");
    }
    if (out.count(name)) return invalidArg(flag, flag + ": language " + name + " given twice");
    out[name] = std::move(argv);
    return Status::ok();
  };
  if (std::string file = a.get("fncall-languages"); !file.empty()) {
    ASSIGN_OR_RETURN(std::string text, readFile(file));
    json j = json::parse(text, nullptr, false);
    if (!j.is_object()) {
      return invalidArg("fncall-languages",
                        "--fncall-languages " + file + ": not a JSON object of name -> [argv...]");
    }
    for (auto& [name, v] : j.items()) {
      std::vector<std::string> argv;
      bool ok = v.is_array();
      for (auto& x : ok ? v : json::array()) {
        if (x.is_string()) {
          argv.push_back(x.get<std::string>());
        } else {
          ok = false;
        }
      }
      if (!ok) {
        return invalidArg("fncall-languages", "--fncall-languages " + file + ": " + name +
                                                  " is not an array of strings");
      }
      RETURN_IF_ERROR(add(name, std::move(argv), "--fncall-languages"));
    }
  }
  for (auto& spec : a.all("fncall-language")) {
    auto eq = spec.find('=');
    if (eq == std::string::npos) {
      return invalidArg("fncall-language",
                        "--fncall-language " + spec + ": expected NAME=ARGV, e.g. 'node=node -e'");
    }
    std::vector<std::string> argv;
    for (auto& w : splitString(spec.substr(eq + 1), ' ')) {
      if (!w.empty()) argv.push_back(w);
    }
    RETURN_IF_ERROR(add(spec.substr(0, eq), std::move(argv), "--fncall-language"));
  }
  return out;
}

int cmdUp(const Args& a) {
  std::string dataDir = a.get("data-dir", kDefaultDataDir);
  std::string listen = a.get("listen", "127.0.0.1:7070");
  std::string aether = a.get("aether", selfDir() + "/dsec-aether");
  std::string lvl = a.get("log-level", "info");
  if (lvl == "debug") log::setLevel(log::Level::kDebug);
  if (lvl == "warn") log::setLevel(log::Level::kWarn);
  if (!a.get("log-file").empty()) {
    long long maxMb = a.get("log-max-mb").empty() ? 64 : std::atoll(a.get("log-max-mb").c_str());
    if (maxMb < 1) return die("--log-max-mb must be at least 1");
    if (!log::setFile(a.get("log-file"), maxMb << 20)) {
      return die("cannot open --log-file " + a.get("log-file") + ": " + strerror(errno));
    }
  }
  if (geteuid() != 0 && a.positional[0] == "up") {
    return die("dsec up must run as root (it builds namespaces and cgroups)");
  }
  // The platform's handlers wait on remote nodes (a create's admission and the
  // node's answer): its pool grows while starved (docs/concurrency.md).
  auto daemon = cli::prepareDaemon(
      [&a](const std::string& k, const std::string& d) { return a.get(k, d); }, listen, dataDir,
      a.positional[0] == "platform" ? 256 : 0);
  if (!daemon.isOk()) return die(daemon.status().message());
  http::ServerOptions so = daemon->server;
  sigset_t sigs = daemon->sigs;
  ::chmod(dataDir.c_str(), 0700);
  // A crashed run leaves its up.json behind; it must not point clients at a
  // dead address while this one starts.
  ::unlink((dataDir + "/up.json").c_str());
  auto token = loadOrCreateToken(dataDir);
  if (!token.isOk()) return die(token.status().toString());
  std::string storeWhere;
  std::string storeSpec = a.get("store", "sqlite");
  if (storeSpec.empty()) return die("--store needs a value: sqlite or a postgres:// URI");
  auto store = platform::openStore(storeSpec, dataDir, &storeWhere);
  if (!store.isOk()) return die("--store: " + store.status().message());
  log::info("dsec up: state store " + storeWhere);

  // The platform's blob directory: the node's default blob store.
  if (Status st = makeDirs(dataDir + "/blobs/sha256", 0700); !st.isOk()) return die(st.toString());
  edge::EdgeOptions eo;
  eo.dataDir = dataDir + "/edge";
  eo.aetherPath = aether;
  if (auto langs = fncallLanguagesFromArgs(a); langs.isOk()) {
    eo.fncallLanguages = std::move(*langs);
  } else {
    return die(langs.status().message());
  }
  if (auto n = rangeFlag(a, "fncall-zygote-max-calls", 1, 1000000, 0); n.isOk()) {
    eo.fncallZygoteMaxCalls = *n;
  } else {
    return die(n.status().message());
  }
  platform::RunPoolOptions runPool;
  if (auto n = rangeFlag(a, "fncall-pool-max", 1, 100000, runPool.maxSandboxes); n.isOk()) {
    runPool.maxSandboxes = int(*n);
  } else {
    return die(n.status().message());
  }
  if (!a.get("fncall-pool-idle-s").empty()) {
    runPool.idleSeconds = std::atof(a.get("fncall-pool-idle-s").c_str());
    if (runPool.idleSeconds <= 0) return die("--fncall-pool-idle-s must be positive");
  }
  eo.diskQuota = a.get("disk-quota", "auto");
  eo.registry = &metrics::Registry::global();
  if (!a.get("disk-pool-mb").empty()) {
    long long mb = std::atoll(a.get("disk-pool-mb").c_str());
    if (mb <= 0) return die("--disk-pool-mb must be a positive number of MiB");
    eo.diskPoolBytes = int64_t(mb) << 20;
  }
  eo.egressSubnet = a.get("egress-subnet", "10.88.0.0/16");
  if (std::string nat = a.get("egress-nat", "yes"); nat == "yes" || nat == "no") {
    eo.egressNat = nat == "yes";
  } else {
    return die("--egress-nat must be yes or no");
  }
  eo.userns = a.get("userns", "auto");
  if (eo.userns != "auto" && eo.userns != "off") return die("--userns must be auto or off");
  if (std::string w = a.get("userns-width"); !w.empty()) {
    auto width = edge::parseIdWidth(w);  // a multiple of 65536: checked at start
    if (!width.isOk()) return die(width.status().message());
    eo.usernsWidth = *width;
  }
  if (std::string w = a.get("userns-window"); !w.empty()) {
    auto win = edge::parseIdWindow(w);
    if (!win.isOk()) return die(win.status().message());
    std::tie(eo.usernsFirst, eo.usernsLast) = *win;
  }
  if (std::string lr = a.get("live-restore", "no"); lr == "yes" || lr == "no") {
    eo.liveRestore = lr == "yes";
  } else {
    return die("--live-restore must be yes or no");
  }
  eo.microvmAccel = a.get("microvm-accel", "auto");
  if (eo.microvmAccel != "auto" && eo.microvmAccel != "kvm" && eo.microvmAccel != "tcg") {
    return die("--microvm-accel must be auto, kvm or tcg");
  }
  eo.microvmAgentChannel = a.get("microvm-agent-channel", "auto");
  if (eo.microvmAgentChannel != "auto" && eo.microvmAgentChannel != "vsock" &&
      eo.microvmAgentChannel != "virtio-serial") {
    return die("--microvm-agent-channel must be auto, vsock or virtio-serial");
  }
  if (!a.get("microvm-boot-timeout-s").empty()) {
    eo.microvmBootTimeoutS = std::atof(a.get("microvm-boot-timeout-s").c_str());
    if (eo.microvmBootTimeoutS <= 0) return die("--microvm-boot-timeout-s must be positive");
  }
  eo.microvmGuestDir = a.get("microvm-guest-dir", "");
  eo.qemuPath = a.get("qemu", "qemu-system-x86_64");
  eo.qemuImgPath = a.get("qemu-img", "qemu-img");
  if (!a.get("vm-boot-timeout-s").empty()) {
    eo.vmBootTimeoutS = std::atof(a.get("vm-boot-timeout-s").c_str());
    if (eo.vmBootTimeoutS <= 0) return die("--vm-boot-timeout-s must be positive");
  }
  if (std::string v = a.get("stats-interval-s"); !v.empty()) {
    char* end = nullptr;
    eo.statsIntervalS = std::strtod(v.c_str(), &end);
    if (*end != '\0' ||
        !(eo.statsIntervalS == 0 || (eo.statsIntervalS >= 0.1 && eo.statsIntervalS <= 3600))) {
      return die("--stats-interval-s must be 0 (off) or 0.1..3600");
    }
  }
  platform::Store* st = store->get();
  eo.lookup = [dataDir, st](const std::string& digest) {
    return platform::Platform::describeLayer(st, dataDir, digest);
  };
  // The node reads blobs from the platform's blob directory unless told to
  // fetch them from elsewhere (a shared mount, a web server holding a copy).
  eo.cache.storeUri = a.get("blob-store", "file://" + dataDir + "/blobs");
  eo.cache.loader = a.get("loader", "auto");
  eo.cache.storeOptions.caFile = a.get("blob-store-ca");
  if (!a.get("cache-mb").empty()) eo.cache.limitBytes = std::atoll(a.get("cache-mb").c_str()) << 20;
  if (!a.get("loader-timeout-s").empty()) {
    eo.cache.loaderPingTimeoutS = std::atof(a.get("loader-timeout-s").c_str());
  }
  if (!a.get("prefetch-window-s").empty()) {
    eo.cache.recordWindowS = std::atof(a.get("prefetch-window-s").c_str());
  }
  // `dsec platform` runs no node of its own: edges join it (docs/cluster.md).
  bool withEdge = a.positional[0] == "up";
  std::unique_ptr<edge::Edge> localEdge;
  if (withEdge) {
    auto edge = edge::Edge::start(eo);
    if (!edge.isOk()) return die("edge: " + edge.status().toString());
    localEdge = std::move(*edge);
  }
  auto cluster = cli::startCluster([&a](const std::string& k, const std::string& d) { return a.get(k, d); },
                                   dataDir, store->get(), localEdge.get(), eo);
  if (!cluster.isOk()) return die("cluster: " + cluster.status().toString());

  platform::PlatformOptions po;
  po.dataDir = dataDir;
  po.replicaId = (*cluster)->replicaId();
  po.leader = [c = cluster->get()] { return c->isLeader(); };
  po.runPool = runPool;
  po.token = *token;
  po.liveRestore = eo.liveRestore;
  if (withEdge) po.batchWorkers = 8;  // its node takes 16 creates at a time, in groups
  if (!a.get("batch-workers").empty()) {
    po.batchWorkers = std::atoi(a.get("batch-workers").c_str());
    if (po.batchWorkers < 1 || po.batchWorkers > 4096) return die("--batch-workers must be 1..4096");
  }
  if (!a.get("gc-grace-s").empty()) po.gcGraceS = std::atof(a.get("gc-grace-s").c_str());
  if (!a.get("stopped-retention-max").empty()) {
    long long n = std::atoll(a.get("stopped-retention-max").c_str());
    if (n < 0) return die("--stopped-retention-max must be >= 0");
    po.stoppedRetentionMax = size_t(n);
  }
  if (!a.get("trajectory-retention-s").empty()) {
    po.trajectoryRetentionS = std::atof(a.get("trajectory-retention-s").c_str());
    if (po.trajectoryRetentionS < 0) return die("--trajectory-retention-s must be >= 0");
  }
  // Registry pulls (docs/images.md).
  po.insecureRegistries = a.all("insecure-registry");
  po.registryAllow = a.all("registry-allow");
  po.registryCa = a.get("registry-ca");
  if (std::string f = a.get("registry-auth"); !f.empty()) {
    auto text = readFile(f);
    if (!text.isOk()) return die("--registry-auth: " + text.status().toString());
    po.registryAuth = *text;
  }
  if (!a.get("pull-workers").empty()) {
    po.pullWorkers = std::atoi(a.get("pull-workers").c_str());
    if (po.pullWorkers < 1 || po.pullWorkers > 64) return die("--pull-workers must be 1..64");
  }
  for (auto [flag, out] : {std::pair{"setup-egress", &po.setupEgress},
                           std::pair{"setup-dns", &po.setupDns}}) {
    for (auto& x : splitString(a.get(flag), ',')) {
      if (!x.empty()) out->push_back(x);
    }
  }
  if (a.opts.count("expose-domain")) po.exposeDomain = a.get("expose-domain");
  if (!a.get("expose-scheme").empty()) {
    po.exposeScheme = a.get("expose-scheme");
    if (po.exposeScheme != "http" && po.exposeScheme != "https") {
      return die("--expose-scheme must be http or https");
    }
  }
  if (!a.get("expose-port").empty()) {
    po.exposePort = std::atoi(a.get("expose-port").c_str());
    if (po.exposePort < -1 || po.exposePort > 65535) return die("--expose-port must be -1..65535");
  }
  po.publicUrl = a.get("public-url");
  if (!a.get("metrics-history-interval-s").empty()) {
    po.metricsHistoryIntervalS = std::atof(a.get("metrics-history-interval-s").c_str());
    if (!(po.metricsHistoryIntervalS >= 0.1 && po.metricsHistoryIntervalS <= 3600)) {
      return die("--metrics-history-interval-s must be 0.1..3600");
    }
  }
  auto plat = platform::Platform::start(po, store->get(), cluster->get());
  if (!plat.isOk()) return die("platform: " + plat.status().toString());

  // Health and the console's files (/, /ui/...: in memory, docs/console.md)
  // answer on the event loop: never queued behind blocking work.
  if (!a.get("ui-dir").empty()) ui::setUiDir(a.get("ui-dir"));
  so.inlineHandler = [](http::Request& req, http::Response& res) {
    if (ui::serveUi(req, res)) return true;
    if (req.path != "/v1/health" || req.method != "GET") return false;
    (void)res.send(200, "application/json", R"({"status":"ok","version":"0.1.0"})");
    return true;
  };
  // Requests for exposed ports go to the reverse proxy (docs/ports.md).
  so.divert = [p = plat->get()](const http::Request& req) { return p->divertPort(req); };
  http::Server server(so);
  if (Status st = server.listen(); !st.isOk()) return die(st.toString());
  uint64_t serverMetrics = cli::addServerMetrics(server);
  std::string url = "http://" + so.host + ":" + std::to_string(server.port());
  (*plat)->setListenUrl(url);
  json up = {{"url", url}, {"pid", getpid()}};
  if (Status st = writeFileAtomic(dataDir + "/up.json", up.dump() + "\n", 0644); !st.isOk()) {
    return die(st.toString());
  }
  log::info("dsec up: serving " + url + " (data " + dataDir + ", token in " + dataDir + "/token)");

  platform::Platform* p = plat->get();
  std::thread sigThread([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    log::info(std::string("received ") + strsignal(sig) + ", shutting down");
    server.stop();
    // Destroying the sandboxes ends the execs in flight (their deferred
    // answers were dropped with the connections); serve() returns once no
    // handler runs.
    p->shutdown();
    sigwait(&sigs, &sig);
    log::warn(std::string("received ") + strsignal(sig) + " again, exiting at once");
    _exit(2);
  });
  server.serve(cli::platformHandler(p, cluster->get(), *token));
  metrics::Registry::global().remove(serverMetrics);
  ::unlink((dataDir + "/up.json").c_str());
  (*plat)->shutdown();
  // No death reports may reach the platform once it is gone.
  if (localEdge) {
    localEdge->setDeathHandler(nullptr);
    localEdge->shutdown();
  }
  // No lost or death reports may reach the platform once it is gone.
  (*cluster)->setLostHandler(nullptr);
  (*cluster)->setDeathHandler(nullptr);
  plat->reset();
  cluster->reset();
  // The signal thread waits for a second signal; it dies with the process.
  sigThread.detach();
  log::info("dsec up: stopped");
  return 0;
}

// ---------------------------------------------------------------- clients

Result<std::unique_ptr<http::Client>> connectClient(const Args& a) {
  std::string url = a.get("url", getenv("DSEC_URL") ? getenv("DSEC_URL") : "");
  std::string token = a.get("token", getenv("DSEC_TOKEN") ? getenv("DSEC_TOKEN") : "");
  std::string dataDir = a.get("data-dir", kDefaultDataDir);
  if (url.empty()) {
    auto up = readFile(dataDir + "/up.json");
    if (!up.isOk()) {
      return Status(Code::kUnavailable, "no --url, no $DSEC_URL, and no running dsec in " +
                                            dataDir + " (" + up.status().message() + ")");
    }
    json j = json::parse(*up, nullptr, false);
    if (j.is_discarded() || !j.contains("url")) return internalError("bad " + dataDir + "/up.json");
    url = j["url"];
  }
  if (token.empty()) {
    auto t = readFile(dataDir + "/token");
    if (t.isOk()) {
      token = *t;
      while (!token.empty() && token.back() == '\n') token.pop_back();
    }
  }
  return http::Client::connect(url, token);
}

// Prints an API error and returns the exit code for it.
// Prints an API error object ({code, message, field}); returns 1.
int printError(const json& e) {
  std::string field = e.value("field", "");
  std::cerr << "dsec: " << e.value("code", "error") << ": " << e.value("message", "")
            << (field.empty() ? "" : " (field " + field + ")") << "\n";
  return 1;
}

int apiError(const http::ClientResponse& r) {
  json j = json::parse(r.body, nullptr, false);
  if (!j.is_discarded() && j.contains("error")) {
    printError(j["error"]);
  } else {
    std::cerr << "dsec: HTTP " << r.status << ": " << r.body << "\n";
  }
  return 1;
}

// A bootable disk image for backend vm (docs/vm.md): checked with qemu-img
// (qcow2 or raw, no backing or external data file), stored whole as one blob.
int importDisk(http::Client& c, const std::string& name, const std::string& tag,
               const std::string& path) {
  std::string qemuImg = edge::qemu::which("qemu-img");
  if (qemuImg.empty()) return die("qemu-img not found (install qemu-utils)");
  auto info = edge::inspectDisk(qemuImg, path);
  if (!info.isOk()) return die(info.status().message());
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return die("open " + path + ": " + std::strerror(errno));
  Sha256 h;
  std::string buf(1 << 20, '\0');
  int64_t size = 0;
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return die("read " + path + ": " + std::strerror(errno));
    if (n == 0) break;
    h.update(buf.data(), size_t(n));
    size += n;
  }
  std::string digest = "sha256:" + h.hexDigest();
  auto up = c.uploadFile("PUT", "/v1/blobs/" + digest, path);
  if (!up.isOk()) return die(up.status().toString());
  if (up->status != 201) return apiError(*up);
  json body = {{"name", name}, {"tag", tag}, {"layers", {digest}}, {"kind", "disk"}};
  auto r = c.request("POST", "/v1/images", body.dump());
  if (!r.isOk()) return die(r.status().toString());
  if (r->status != 201) return apiError(*r);
  std::cout << digest << "\n";
  std::cerr << "imported " << name << ":" << tag << ": disk image (" << info->format << ", "
            << (info->virtualSize >> 20) << " MiB virtual, " << size << " bytes)\n";
  return 0;
}

// The credentials the Docker CLI would use for registry `host`: from
// --auth-file, else $DOCKER_CONFIG/config.json, else ~/.docker/config.json.
Result<std::optional<image::RegistryCredentials>> dockerCredentials(const Args& a,
                                                                    const std::string& host) {
  std::string path = a.get("auth-file");
  if (path.empty()) {
    const char* dir = getenv("DOCKER_CONFIG");
    const char* home = getenv("HOME");
    if (dir && *dir) {
      path = std::string(dir) + "/config.json";
    } else if (home && *home) {
      path = std::string(home) + "/.docker/config.json";
    }
  }
  if (path.empty()) return std::optional<image::RegistryCredentials>();
  auto text = readFile(path);
  if (!text.isOk()) {
    if (a.get("auth-file").empty()) return std::optional<image::RegistryCredentials>();
    return std::move(text).takeStatus();
  }
  // A helper named for the registry (or for all) holds the credentials, as
  // for the Docker CLI; "auths" is read when it has none.
  ASSIGN_OR_RETURN(auto helper, image::credentialHelperFor(*text, host));
  if (helper) {
    ASSIGN_OR_RETURN(auto fromHelper, image::runCredentialHelper(*helper, host));
    if (fromHelper) return fromHelper;
  }
  return image::credentialsFromDockerConfig(*text, host);
}

// dsec image pull REF: the platform pulls; this shows its progress, a line
// per layer (redrawn in place on a terminal).
int cmdPull(const Args& a, http::Client& c) {
  if (a.positional.size() != 3) {
    return die("usage: dsec image pull [--platform OS/ARCH] [--name NAME[:TAG]] "
               "[--insecure-registry HOST] [--auth-file CONFIG.json] REF");
  }
  auto ref = image::parseRegistryRef(a.positional[2]);
  if (!ref.isOk()) return die(ref.status().message());
  json body = {{"ref", a.positional[2]}};
  if (!a.get("platform").empty()) body["platform"] = a.get("platform");
  for (auto& h : a.all("insecure-registry")) {
    if (h == ref->host) body["insecure_registry"] = true;
  }
  if (std::string n = a.get("name"); !n.empty()) {
    std::string name, tag;
    if (Status st = platform::parseImageRef(n, name, tag); !st.isOk()) return die(st.message());
    body["name"] = name;
    body["tag"] = tag;
  }
  auto creds = dockerCredentials(a, ref->host);
  if (!creds.isOk()) return die(creds.status().toString());
  if (*creds) {
    if (!(*creds)->identityToken.empty()) {
      body["auth"] = {{"identity_token", (*creds)->identityToken}};
    } else {
      body["auth"] = {{"username", (*creds)->username}, {"password", (*creds)->password}};
    }
  }
  const bool tty = isatty(STDERR_FILENO);
  std::vector<std::string> order;               // layers, in manifest order
  std::map<std::string, std::string> lines;     // what each shows now
  size_t drawn = 0;
  auto redraw = [&] {
    if (!tty) return;
    if (drawn) fprintf(stderr, "\033[%zuA", drawn);
    for (auto& d : order) fprintf(stderr, "\033[2K%s\n", lines[d].c_str());
    drawn = order.size();
  };
  std::string pending, errorBody;
  int code = 1;
  auto onData = [&](std::string_view d) {
    pending.append(d);
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      json ev = json::parse(line, nullptr, false);
      if (ev.is_discarded() || !ev.is_object()) {
        errorBody += line;
        continue;
      }
      std::string type = ev.value("type", "");
      if (type == "resolved") {
        fprintf(stderr, "%s: %s (%s)\n", ev.value("ref", "").c_str(),
                ev.value("manifest_digest", "").c_str(), ev.value("platform", "").c_str());
        for (auto& l : ev["layers"]) {
          std::string dg = l.value("digest", "");
          order.push_back(dg);
          lines[dg] = dg.substr(7, 12) + ": waiting";
        }
        redraw();
      } else if (type == "layer") {
        std::string dg = ev.value("digest", "");
        std::string status = ev.value("status", "");
        int64_t bytes = ev.value("bytes", int64_t(0)), total = ev.value("total", int64_t(0));
        std::string text = dg.substr(7, 12) + ": " + status;
        if (status == "downloading" && total > 0) {
          int width = 30, fill = int(width * double(bytes) / double(total));
          text += " [" + std::string(fill, '=') + std::string(width - fill, ' ') + "] " +
                  std::to_string(bytes >> 20) + "/" + std::to_string(total >> 20) + " MiB";
        }
        if (tty) {
          lines[dg] = text;
          redraw();
        } else if (lines[dg] != status) {
          lines[dg] = status;
          fprintf(stderr, "%s\n", text.c_str());
        }
      } else if (type == "done") {
        auto& img = ev["image"];
        std::cout << img.value("ref", "") << (ev.value("unchanged", false) ? " (up to date)" : "")
                  << "\n";
        code = 0;
      } else if (type == "error") {
        code = printError(ev["error"]);
      }
    }
  };
  auto r = c.requestStreaming("POST", "/v1/images/pull", body.dump(), onData);
  if (!r.isOk()) return die(r.status().toString());
  if (r->status != 200) {
    http::ClientResponse e = *r;
    e.body = errorBody + pending;
    return apiError(e);
  }
  return code;
}

// `dsec image build`'s arguments: -f and -t as Docker spells them, and
// --network, --no-cache and --insecure-registry as switches (the generic
// parser would take the context for their value).
Args parseBuildArgs(int argc, char** argv, int start) {
  static const std::set<std::string> kSwitches = {"network", "no-cache", "insecure-registry",
                                                  "quiet"};
  Args a;
  for (int i = start; i < argc; ++i) {
    std::string s = argv[i];
    if ((s == "-f" || s == "-t") && i + 1 < argc) {
      a.opts.emplace(s == "-f" ? "file" : "tag", argv[++i]);
    } else if (s == "-q") {
      a.opts.emplace("quiet", "true");
    } else if (startsWith(s, "--")) {
      size_t eq = s.find('=');
      std::string name = s.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      if (eq != std::string::npos) {
        a.opts.emplace(name, s.substr(eq + 1));
      } else if (kSwitches.count(name) || i + 1 >= argc) {
        a.opts.emplace(name, "true");
      } else {
        a.opts.emplace(name, argv[++i]);
      }
    } else {
      a.positional.push_back(s);
    }
  }
  return a;
}

int cmdBuild(const Args& a) {
  const char* usage =
      "usage: dsec image build [-f DOCKERFILE] -t NAME[:TAG] [--build-arg K=V]... "
      "[--target STAGE] [--network] [--no-cache] [--platform OS/ARCH] [--insecure-registry] "
      "CONTEXT";
  if (a.positional.size() != 3) return die(usage);
  const std::string ctx = a.positional[2];
  std::string ref = a.get("tag");
  if (ref.empty()) return die(std::string("-t NAME[:TAG] is required\n") + usage);
  std::string name, tag;
  if (Status st = platform::parseImageRef(ref, name, tag); !st.isOk()) return die(st.message());
  std::string dfPath = a.get("file", "Dockerfile");
  if (dfPath != "-" && dfPath[0] != '/' && a.opts.count("file") == 0) dfPath = ctx + "/" + dfPath;
  auto dockerfile =
      dfPath == "-"
          ? Result<std::string>(std::string(std::istreambuf_iterator<char>(std::cin), {}))
          : readFile(dfPath);
  if (!dockerfile.isOk()) return die(dockerfile.status().toString());
  json body = {{"dockerfile", *dockerfile}, {"name", name}, {"tag", tag}};
  json args = json::object();
  for (auto& kv : a.all("build-arg")) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos) {
      // As Docker: NAME alone takes the value from this environment.
      const char* v = getenv(kv.c_str());
      if (!v) continue;
      args[kv] = v;
    } else {
      args[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
  }
  if (!args.empty()) body["build_args"] = args;
  if (!a.get("target").empty()) body["target"] = a.get("target");
  if (!a.get("platform").empty()) body["platform"] = a.get("platform");
  if (a.get("network") == "true") body["network"] = true;
  if (a.get("no-cache") == "true") body["no_cache"] = true;
  if (a.get("insecure-registry") == "true") body["insecure_registry"] = true;
  const bool quiet = a.get("quiet") == "true";

  auto client = connectClient(a);
  if (!client.isOk()) return die(client.status().toString());
  auto& c = **client;
  // The context, tarred as Docker sends it (.dockerignore applied), uploaded
  // as a blob unless the platform has it already.
  {
    std::string tarPath = "/var/tmp/dsec-context-" + randomHex(6) + ".tar";
    UniqueFd fd(::open(tarPath.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) return die(sysError("create " + tarPath).toString());
    auto packed = image::packContextDir(ctx, fd.get());
    fd.reset();
    if (!packed.isOk()) {
      ::unlink(tarPath.c_str());
      return die(packed.status().toString());
    }
    auto head = c.request("HEAD", "/v1/blobs/" + packed->digest);
    if (!head.isOk() || head->status != 200) {
      auto up = c.uploadFile("PUT", "/v1/blobs/" + packed->digest, tarPath);
      if (!up.isOk()) {
        ::unlink(tarPath.c_str());
        return die(up.status().toString());
      }
      if (up->status != 201) {
        ::unlink(tarPath.c_str());
        return apiError(*up);
      }
    }
    ::unlink(tarPath.c_str());
    if (!quiet) {
      std::cerr << "context: " << packed->files << " entries, " << packed->size << " bytes ("
                << packed->digest.substr(0, 19) << ")\n";
    }
    body["context"] = packed->digest;
  }
  std::string pending, errorBody;
  int code = 1;
  bool atLineStart = true;
  auto onData = [&](std::string_view d) {
    pending.append(d);
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      json ev = json::parse(line, nullptr, false);
      if (ev.is_discarded() || !ev.is_object()) {
        errorBody += line;
        continue;
      }
      std::string type = ev.value("type", "");
      if (type == "step" && !quiet) {
        if (!atLineStart) std::cerr << "\n";
        std::cerr << "#" << ev.value("line", 0) << " " << ev.value("instruction", "")
                  << (ev.value("cached", false) ? "  (cached)" : "") << "\n";
        atLineStart = true;
      } else if (type == "output" && !quiet) {
        std::string data = ev.value("data", "");
        std::cerr << data;
        if (!data.empty()) atLineStart = data.back() == '\n';
      } else if ((type == "pull" || type == "pulled") && !quiet) {
        std::cerr << (type == "pull" ? "pulling " : "pulled ") << ev.value("ref", "") << "\n";
      } else if (type == "done") {
        std::cout << ev["image"].value("ref", "") << "\n";
        code = 0;
      } else if (type == "error") {
        if (!atLineStart) std::cerr << "\n";
        code = printError(ev["error"]);
      }
    }
  };
  auto r = c.requestStreaming("POST", "/v1/images/build", body.dump(), onData);
  if (!r.isOk()) return die(r.status().toString());
  if (r->status != 200) {
    http::ClientResponse e = *r;
    e.body = errorBody + pending;
    return apiError(e);
  }
  return code;
}

int cmdImage(const Args& a) {
  if (a.positional.size() < 2) return die("usage: dsec image import|pull|build|ls|tag|rm");
  auto client = connectClient(a);
  if (!client.isOk()) return die(client.status().toString());
  auto& c = **client;
  const std::string& sub = a.positional[1];
  if (sub == "pull") return cmdPull(a, c);
  if (sub == "ls") {
    auto r = c.request("GET", "/v1/images");
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 200) return apiError(*r);
    json j = json::parse(r->body);
    printf("%-30s %-12s %-12s %s\n", "IMAGE", "LAYERS", "SIZE", "CREATED");
    for (auto& i : j["images"]) {
      printf("%-30s %-12zu %-12lld %s\n", i["ref"].get<std::string>().c_str(), i["layers"].size(),
             (long long)i["size"].get<int64_t>(), i["created_at"].get<std::string>().c_str());
    }
    return 0;
  }
  if (sub == "tag") {
    if (a.positional.size() != 4) return die("usage: dsec image tag SRC NAME[:TAG]");
    std::string name, tag;
    if (Status st = platform::parseImageRef(a.positional[3], name, tag); !st.isOk()) {
      return die(st.message());
    }
    json body = {{"name", name}, {"tag", tag}, {"from", a.positional[2]}};
    auto r = c.request("POST", "/v1/images", body.dump());
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 201) return apiError(*r);
    std::cout << name << ":" << tag << "\n";
    return 0;
  }
  if (sub == "rm") {
    int rc = 0;
    for (size_t i = 2; i < a.positional.size(); ++i) {
      auto r = c.request("DELETE", "/v1/images/" + http::percentEncode(a.positional[i]));
      if (!r.isOk()) return die(r.status().toString());
      if (r->status != 200) rc = apiError(*r);
    }
    return rc;
  }
  if (sub != "import") return die("unknown image command '" + sub + "'");
  if (a.positional.size() != 3) return die("usage: dsec image import --name NAME[:TAG] PATH");
  std::string ref = a.get("name");
  if (ref.empty()) return die("--name is required");
  std::string name, tag;
  if (Status st = platform::parseImageRef(ref, name, tag); !st.isOk()) return die(st.message());
  if (a.get("kind") == "disk") return importDisk(c, name, tag, a.positional[2]);
  std::string work = "/var/tmp/dsec-import-" + randomHex(6);
  std::string fmt = a.get("format", "auto");
  image::ArchiveFormat format;
  if (fmt == "auto") {
    auto detected = image::detectFormat(a.positional[2]);
    if (!detected.isOk()) return die(detected.status().toString());
    format = *detected;
  } else if (fmt == "rootfs") {
    format = image::ArchiveFormat::kRootfs;
  } else if (fmt == "oci") {
    format = image::ArchiveFormat::kOciLayout;
  } else if (fmt == "docker") {
    format = image::ArchiveFormat::kDockerSave;
  } else {
    return die("--format must be auto, rootfs, oci or docker");
  }
  uint32_t ownerWidth = image::kDefaultOwnerWidth;
  if (a.opts.count("owner-width") != 0) {
    std::string w = a.get("owner-width");
    // The ids a sandbox maps: a node's `dsec up --userns-width`, whose rules it follows.
    bool digits = !w.empty() && w.size() <= 10 && w.find_first_not_of("0123456789") == w.npos;
    unsigned long long v = digits ? std::strtoull(w.c_str(), nullptr, 10) : 0;
    if (v == 0 || v % 65536 != 0 || v > 0xffff0000ULL) {
      return die("--owner-width must be a positive multiple of 65536 (at most 4294901760), not '" +
                 w + "'");
    }
    ownerWidth = static_cast<uint32_t>(v);
  }
  auto imported = image::importImage(a.positional[2], format, work, ownerWidth);
  if (!imported.isOk()) {
    (void)removeTree(work);
    return die(imported.status().toString());
  }
  json digests = json::array();
  int64_t total = 0;
  for (auto& layer : imported->layers) {
    // The data blob first: the metadata image names it when it is uploaded.
    for (auto [target, path] : {std::pair{"/v1/blobs/" + layer.dataDigest, layer.dataPath},
                                std::pair{"/v1/blobs/" + layer.digest + "?data=" +
                                              http::percentEncode(layer.dataDigest),
                                          layer.path}}) {
      auto up = c.uploadFile("PUT", target, path);
      if (!up.isOk()) {
        (void)removeTree(work);
        return die(up.status().toString());
      }
      if (up->status != 201) {
        (void)removeTree(work);
        return apiError(*up);
      }
    }
    digests.push_back(layer.digest);
    total += layer.size + layer.dataSize;
  }
  (void)removeTree(work);
  json body = {{"name", name}, {"tag", tag}, {"layers", digests}, {"kind", a.get("kind", "base")}};
  const image::ImageConfig& config = imported->config;
  if (!config.empty()) {
    body["config"] = {
        {"user", config.user}, {"env", config.env}, {"working_dir", config.workingDir}};
    if (!config.entrypoint.empty()) body["config"]["entrypoint"] = config.entrypoint;
    if (!config.cmd.empty()) body["config"]["cmd"] = config.cmd;
    if (!config.labels.empty()) body["config"]["labels"] = config.labels;
  }
  auto r = c.request("POST", "/v1/images", body.dump());
  if (!r.isOk()) return die(r.status().toString());
  if (r->status != 201) return apiError(*r);
  for (auto& d : digests) std::cout << d.get<std::string>() << "\n";
  std::cerr << "imported " << name << ":" << tag << " from " << image::formatName(format) << ": "
            << digests.size() << " layer(s), " << total << " bytes";
  if (!config.user.empty()) std::cerr << ", user " << config.user;
  if (!config.workingDir.empty()) std::cerr << ", working dir " << config.workingDir;
  if (!config.env.empty()) std::cerr << ", " << config.env.size() << " env var(s)";
  std::cerr << "\n";
  if (const image::OwnerReport& o = imported->owners; o.outside > 0) {
    // A warning, not a refusal: the image works, those files are only frozen.
    std::cerr << "warning: " << o.outside << (o.outside == 1 ? " file is" : " files are")
              << " owned by ids outside 0-" << (o.width - 1)
              << ", the ids a sandbox maps (--owner-width): they show as 65534 inside and cannot"
                 " be changed (EACCES, EOVERFLOW): ";
    for (size_t i = 0; i < o.examples.size(); ++i) {
      const auto& e = o.examples[i];
      std::cerr << (i ? ", " : "") << e.path << " (uid " << e.uid << ", gid " << e.gid << ")";
    }
    if (o.outside > static_cast<int64_t>(o.examples.size())) {
      std::cerr << ", and " << (o.outside - static_cast<int64_t>(o.examples.size())) << " more";
    }
    // The width that would map them all: nodes started with it keep them writable.
    uint64_t need = ((uint64_t{std::max(o.maxUid, o.maxGid)} >> 16) + 1) << 16;
    std::cerr << "\n  largest owner ids: uid " << o.maxUid << ", gid " << o.maxGid;
    if (need <= 0xffff0000ULL) {
      std::cerr << "; sandboxes on nodes run with `dsec up --userns-width " << need << "` map them";
    }
    std::cerr << " (docs/images.md)\n";
  }
  return 0;
}

Result<std::map<std::string, std::string>> keyValues(const std::vector<std::string>& items,
                                                     const std::string& what) {
  std::map<std::string, std::string> out;
  for (auto& kv : items) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) return invalidArg(what, what + " must be K=V: " + kv);
    out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

int cmdExec(const Args& a, const std::string& id) {
  if (a.rest.empty()) return die("usage: dsec exec ID -- CMD [ARG...]");
  auto client = connectClient(a);
  if (!client.isOk()) return die(client.status().toString());
  // base64 keeps binary output byte-exact on the way to our stdout.
  json body = {{"cmd", a.rest}, {"stream", true}, {"encoding", "base64"}};
  if (!a.get("timeout").empty()) body["timeout_s"] = std::atof(a.get("timeout").c_str());
  if (!a.get("user").empty()) body["user"] = a.get("user");
  if (!a.get("cwd").empty()) body["cwd"] = a.get("cwd");
  auto envs = keyValues(a.all("env"), "env");
  if (!envs.isOk()) return die(envs.status().message());
  if (!envs->empty()) body["env"] = *envs;
  std::string pending;
  int code = 1;
  std::string errorBody;
  auto onData = [&](std::string_view d) {
    pending.append(d);
    size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      json ev = json::parse(pending.substr(0, nl), nullptr, false);
      pending.erase(0, nl + 1);
      if (ev.is_discarded()) {
        errorBody += pending;
        continue;
      }
      std::string type = ev.value("type", "");
      if (type == "stdout" || type == "stderr") {
        auto decoded = base64Decode(ev.value("data_b64", ""));
        std::string data = decoded.isOk() ? *decoded : ev.value("data", "");
        FILE* f = type == "stdout" ? stdout : stderr;
        fwrite(data.data(), 1, data.size(), f);
        fflush(f);
      } else if (type == "exit") {
        code = ev.value("exit_code", -1);
        if (code < 0) code = 128 + ev.value("signal", 0);
        if (ev.value("timed_out", false)) std::cerr << "dsec: command timed out\n";
        if (ev.value("truncated", false)) std::cerr << "dsec: output truncated\n";
      } else if (type == "error") {
        std::cerr << "dsec: " << ev["error"].value("message", "exec failed") << "\n";
        code = 1;
      } else if (ev.contains("error")) {
        std::cerr << "dsec: " << ev["error"].value("code", "") << ": "
                  << ev["error"].value("message", "") << "\n";
      }
    }
  };
  auto r = (*client)->requestStreaming("POST", "/v1/sandboxes/" + id + "/exec", body.dump(), onData);
  if (!r.isOk()) return die(r.status().toString());
  if (r->status != 200) {
    onData("\n");  // the error object, if any, is the whole body
    return 1;
  }
  return code;
}

// `dsec sandbox shell`: a process session on a pseudo-terminal
// (docs/processes.md), with this terminal in raw mode: keystrokes go to it
// as typed (^C included), its output comes back as written, a resize of
// this window resizes it. Two connections: one streams the output, the
// other carries input and resizes (an http::Client is not thread-safe).
struct RawTerminal {
  bool active = false;
  struct termios saved {};
  void enter() {
    if (!::isatty(0) || ::tcgetattr(0, &saved) < 0) return;
    struct termios raw = saved;
    ::cfmakeraw(&raw);
    if (::tcsetattr(0, TCSADRAIN, &raw) == 0) active = true;
  }
  void restore() {
    if (active) ::tcsetattr(0, TCSADRAIN, &saved);
    active = false;
  }
  ~RawTerminal() { restore(); }
};

int g_winchPipe = -1;
void onWinch(int) {
  char c = 'w';
  [[maybe_unused]] ssize_t n = ::write(g_winchPipe, &c, 1);
}

proto::TermSize terminalSize() {
  struct winsize ws {};
  if (::ioctl(0, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0 && ws.ws_col > 0) {
    return proto::TermSize{ws.ws_row, ws.ws_col};
  }
  return proto::TermSize{24, 80};
}

int cmdShell(const Args& a, const std::string& id) {
  auto ctl = connectClient(a);
  if (!ctl.isOk()) return die(ctl.status().toString());
  auto out = connectClient(a);
  if (!out.isOk()) return die(out.status().toString());
  proto::TermSize size = terminalSize();
  json body = {{"pty", {{"rows", size.rows}, {"cols", size.cols}}}};
  body["cmd"] = a.rest.empty()
                    ? json{"/bin/sh", "-c", "[ -x /bin/bash ] && exec /bin/bash -i; exec /bin/sh -i"}
                    : json(a.rest);
  auto envs = keyValues(a.all("env"), "env");
  if (!envs.isOk()) return die(envs.status().message());
  json env = *envs;
  if (!env.contains("TERM")) env["TERM"] = getenv("TERM") ? getenv("TERM") : "xterm-256color";
  body["env"] = env;
  if (!a.get("user").empty()) body["user"] = a.get("user");
  if (!a.get("cwd").empty()) body["cwd"] = a.get("cwd");
  auto r = (*ctl)->request("POST", "/v1/sandboxes/" + id + "/processes", body.dump());
  if (!r.isOk()) return die(r.status().toString());
  if (r->status != 201) return apiError(*r);
  json info = json::parse(r->body, nullptr, false);
  if (info.is_discarded() || !info.contains("pid")) return die("bad answer: " + r->body);
  const std::string base = "/v1/sandboxes/" + id + "/processes/" + std::to_string(info["pid"].get<int>());

  int wake[2], winch[2];
  if (::pipe2(wake, O_CLOEXEC) < 0 || ::pipe2(winch, O_CLOEXEC | O_NONBLOCK) < 0) {
    return die("pipe: " + std::string(strerror(errno)));
  }
  g_winchPipe = winch[1];
  struct sigaction sa {};
  sa.sa_handler = onWinch;
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGWINCH, &sa, nullptr);

  RawTerminal term;
  term.enter();
  int code = 1;
  std::string failure;
  std::thread reader([&] {
    std::string pending;
    auto onData = [&](std::string_view d) {
      pending.append(d);
      size_t nl;
      while ((nl = pending.find('\n')) != std::string::npos) {
        json ev = json::parse(pending.substr(0, nl), nullptr, false);
        pending.erase(0, nl + 1);
        if (!ev.is_object()) continue;
        std::string type = ev.value("type", "");
        if (type == "stdout" || type == "stderr") {
          auto data = base64Decode(ev.value("data_b64", ""));
          if (data.isOk()) {
            fwrite(data->data(), 1, data->size(), stdout);
            fflush(stdout);
          }
        } else if (type == "exit") {
          code = ev.value("exit_code", -1);
          if (code < 0) code = 128 + ev.value("signal", 0);
        } else if (type == "error") {
          failure = ev["error"].value("message", "the session failed");
        }
      }
    };
    auto rr = (*out)->requestStreaming("GET", base + "/output?offset=0&follow=true", "", onData);
    if (!rr.isOk()) failure = rr.status().toString();
    char c = 'x';
    [[maybe_unused]] ssize_t n = ::write(wake[1], &c, 1);
  });
  bool stdinOpen = true;
  for (;;) {
    struct pollfd fds[3] = {{wake[0], POLLIN, 0}, {winch[0], POLLIN, 0}, {0, POLLIN, 0}};
    int n = ::poll(fds, stdinOpen ? 3 : 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || fds[0].revents) break;
    if (fds[1].revents) {
      char drain[64];
      while (::read(winch[0], drain, sizeof drain) > 0) {
      }
      proto::TermSize now = terminalSize();
      (void)(*ctl)->request("POST", base + "/resize",
                            json{{"rows", now.rows}, {"cols", now.cols}}.dump());
    }
    if (stdinOpen && fds[2].revents) {
      char buf[4096];
      ssize_t got = ::read(0, buf, sizeof buf);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        stdinOpen = false;  // the output (and the shell's exit) still come
        continue;
      }
      auto sent = (*ctl)->request(
          "POST", base + "/input",
          json{{"data_b64", base64Encode(std::string_view(buf, size_t(got)))}}.dump());
      if (!sent.isOk() || sent->status != 200) break;  // it ended
    }
  }
  reader.join();
  ::signal(SIGWINCH, SIG_DFL);
  term.restore();
  if (!failure.empty()) std::cerr << "dsec: " << failure << "\n";
  return code;
}

int cmdSandbox(const Args& a) {
  if (a.positional.size() < 2) return die("usage: dsec sandbox create|ls|rm|exec|shell|phase|audit");
  const std::string& sub = a.positional[1];
  if (sub == "exec") {
    if (a.positional.size() != 3) return die("usage: dsec sandbox exec ID -- CMD [ARG...]");
    return cmdExec(a, a.positional[2]);
  }
  if (sub == "shell") {
    if (a.positional.size() != 3) return die("usage: dsec sandbox shell ID [-- CMD [ARG...]]");
    return cmdShell(a, a.positional[2]);
  }
  auto client = connectClient(a);
  if (!client.isOk()) return die(client.status().toString());
  auto& c = **client;
  if (sub == "create") {
    json body = {{"image", a.get("image")}};
    if (!a.get("backend").empty()) body["backend"] = a.get("backend");
    if (!a.get("cpu").empty()) body["cpu"] = std::atof(a.get("cpu").c_str());
    if (!a.get("memory-mb").empty()) body["memory_mb"] = std::atoll(a.get("memory-mb").c_str());
    if (!a.get("ttl-s").empty()) body["ttl_s"] = std::atoll(a.get("ttl-s").c_str());
    if (!a.get("policy").empty()) body["policy"] = a.get("policy");
    if (!a.get("user").empty()) body["user"] = a.get("user");
    for (auto [flag, field] : {std::pair{"workspace", "workspaces"}, std::pair{"toolkit", "toolkits"},
                               std::pair{"diff", "diffs"}}) {
      if (!a.all(flag).empty()) body[field] = a.all(flag);
    }
    auto labels = keyValues(a.all("label"), "label");
    if (!labels.isOk()) return die(labels.status().message());
    if (!labels->empty()) body["labels"] = *labels;
    auto envs = keyValues(a.all("env"), "env");
    if (!envs.isOk()) return die(envs.status().message());
    if (!envs->empty()) body["env"] = *envs;
    if (!a.get("count").empty()) {
      // A batch (docs/batches.md): prints its id; --wait yes polls its progress.
      json batch = {{"count", std::atoll(a.get("count").c_str())}, {"spec", body},
                    {"all_or_nothing", a.get("all-or-nothing", "no") == "yes"}};
      auto r = c.request("POST", "/v1/batches", batch.dump());
      if (!r.isOk()) return die(r.status().toString());
      if (r->status != 202) return apiError(*r);
      std::string id = json::parse(r->body)["id"];
      std::cout << id << "\n";
      if (a.get("wait", "no") != "yes") return 0;
      for (;;) {
        auto g = c.request("GET", "/v1/batches/" + id);
        if (!g.isOk()) return die(g.status().toString());
        if (g->status != 200) return apiError(*g);
        json b = json::parse(g->body);
        std::cerr << "batch " << id << ": " << b["running"] << " running, " << b["pending"]
                  << " pending, " << b["failed"] << " failed of " << b["requested"] << "\n";
        if (b["pending"] == 0 && b["state"] != "running") return b["failed"] == 0 ? 0 : 1;
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
    }
    auto r = c.request("POST", "/v1/sandboxes", body.dump());
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 201) return apiError(*r);
    std::cout << json::parse(r->body)["id"].get<std::string>() << "\n";
    return 0;
  }
  if (sub == "batch") {
    // dsec sandbox batch ls | show ID | rm ID
    std::string op = a.positional.size() > 2 ? a.positional[2] : "";
    if (op == "ls" || ((op == "show" || op == "rm") && a.positional.size() == 4)) {
      std::string path = "/v1/batches" + (op == "ls" ? "" : "/" + a.positional[3]);
      auto r = c.request(op == "rm" ? "DELETE" : "GET", path);
      if (!r.isOk()) return die(r.status().toString());
      if (r->status != 200) return apiError(*r);
      std::cout << json::parse(r->body).dump(2) << "\n";
      return 0;
    }
    return die("usage: dsec sandbox batch ls | show ID | rm ID");
  }
  if (sub == "ls") {
    std::string q;
    for (auto& l : a.all("label")) q += (q.empty() ? "?" : "&") + std::string("label=") + http::percentEncode(l);
    if (!a.get("batch").empty()) q += (q.empty() ? "?" : "&") + std::string("batch=") + http::percentEncode(a.get("batch"));
    auto r = c.request("GET", "/v1/sandboxes" + q);
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 200) return apiError(*r);
    printf("%-20s %-10s %-24s %-10s %s\n", "ID", "STATE", "IMAGE", "BACKEND", "CREATED");
    json listing = json::parse(r->body);
    for (auto& s : listing["sandboxes"]) {
      printf("%-20s %-10s %-24s %-10s %s\n", s["id"].get<std::string>().c_str(),
             s["state"].get<std::string>().c_str(), s["image"].get<std::string>().c_str(),
             s["backend"].get<std::string>().c_str(), s["created_at"].get<std::string>().c_str());
    }
    return 0;
  }
  if (sub == "rm" && a.positional.size() == 2 &&
      (!a.all("label").empty() || !a.get("batch").empty())) {
    // Every live sandbox matching the filters (DELETE /v1/sandboxes?label=&batch=).
    std::string q;
    for (auto& l : a.all("label")) q += (q.empty() ? "?" : "&") + std::string("label=") + http::percentEncode(l);
    if (!a.get("batch").empty()) q += (q.empty() ? "?" : "&") + std::string("batch=") + http::percentEncode(a.get("batch"));
    auto r = c.request("DELETE", "/v1/sandboxes" + q);
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 200) return apiError(*r);
    std::cout << json::parse(r->body)["destroyed"] << " destroyed\n";
    return 0;
  }
  if (sub == "rm") {
    if (a.positional.size() < 3) return die("usage: dsec sandbox rm ID... | --label K=V... | --batch ID");
    int rc = 0;
    for (size_t i = 2; i < a.positional.size(); ++i) {
      auto r = c.request("DELETE", "/v1/sandboxes/" + a.positional[i]);
      if (!r.isOk()) return die(r.status().toString());
      if (r->status != 200) {
        rc = apiError(*r);
      } else {
        std::cout << a.positional[i] << "\n";
      }
    }
    return rc;
  }
  if (sub == "phase") {
    // dsec sandbox phase ID POLICY [--readonly PATH]... [--hide PATH]...
    if (a.positional.size() != 4) {
      return die("usage: dsec sandbox phase ID POLICY [--readonly PATH]... [--hide PATH]...");
    }
    json body = {{"policy", a.positional[3]}};
    if (!a.all("readonly").empty()) body["readonly_paths"] = a.all("readonly");
    if (!a.all("hide").empty()) body["hidden_paths"] = a.all("hide");
    auto r = c.request("POST", "/v1/sandboxes/" + a.positional[2] + "/phase", body.dump());
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 200) return apiError(*r);
    json s = json::parse(r->body);
    for (auto& p : s["phases"]) {
      std::cout << p["at"].get<std::string>() << " " << p["policy"].get<std::string>() << "\n";
    }
    return 0;
  }
  if (sub == "audit") {
    if (a.positional.size() != 3) return die("usage: dsec sandbox audit ID");
    auto r = c.request("GET", "/v1/sandboxes/" + a.positional[2] + "/audit");
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 200) return apiError(*r);
    json s = json::parse(r->body);
    for (auto& [name, n] : s["denied_syscalls"].items()) {
      std::cout << name << " " << n.get<int64_t>() << "\n";
    }
    std::cout << "total " << s["denied_total"].get<int64_t>() << "\n";
    return 0;
  }
  if (sub == "expose") {
    // dsec sandbox expose ID PORT [--ttl-s S] [--rotate] (docs/ports.md)
    if (a.positional.size() != 4) {
      return die("usage: dsec sandbox expose ID PORT [--ttl-s S] [--rotate]");
    }
    int port = std::atoi(a.positional[3].c_str());
    json body = {{"port", port}};
    if (!a.get("ttl-s").empty()) body["ttl_s"] = std::atof(a.get("ttl-s").c_str());
    if (a.opts.count("rotate")) body["rotate"] = true;
    auto r = c.request("POST", "/v1/sandboxes/" + a.positional[2] + "/ports", body.dump());
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 200 && r->status != 201) return apiError(*r);
    json p = json::parse(r->body);
    std::cout << "url       " << p["url"].get<std::string>() << "\n"
              << "path_url  " << p["path_url"].get<std::string>() << "\n"
              << "token     " << p["token"].get<std::string>() << "\n";
    return 0;
  }
  if (sub == "unexpose") {
    if (a.positional.size() != 4) return die("usage: dsec sandbox unexpose ID PORT");
    auto r = c.request("DELETE", "/v1/sandboxes/" + a.positional[2] + "/ports/" + a.positional[3]);
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 204) return apiError(*r);
    return 0;
  }
  if (sub == "ports") {
    if (a.positional.size() != 3) return die("usage: dsec sandbox ports ID");
    auto r = c.request("GET", "/v1/sandboxes/" + a.positional[2] + "/ports");
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 200) return apiError(*r);
    json s = json::parse(r->body);
    for (auto& p : s["ports"]) {
      std::cout << p["port"].get<int>() << " " << p["url"].get<std::string>() << "\n";
    }
    return 0;
  }
  return die("unknown sandbox command '" + sub + "'");
}

// dsec tenant ... / dsec key ... / dsec whoami (docs/tenants.md).
int cmdTenants(const std::string& cmd, const Args& a) {
  auto client = connectClient(a);
  if (!client.isOk()) return die(client.status().toString());
  auto& c = **client;
  const std::string sub = a.positional.size() > 1 ? a.positional[1] : "";
  auto call = [&](const char* method, const std::string& path, const std::string& body,
                  int want) -> std::optional<json> {
    auto r = c.request(method, path, body);
    if (!r.isOk()) {
      die(r.status().toString());
      return std::nullopt;
    }
    if (r->status != want) {
      apiError(*r);
      return std::nullopt;
    }
    return json::parse(r->body, nullptr, false);
  };
  auto quota = [&] {
    json q = json::object();
    for (auto [flag, field] :
         {std::pair{"max-sandboxes", "max_sandboxes"}, std::pair{"max-memory-mb", "max_memory_mb"},
          std::pair{"create-burst", "create_burst"}}) {
      if (!a.get(flag).empty()) q[field] = std::atoll(a.get(flag).c_str());
    }
    for (auto [flag, field] :
         {std::pair{"max-cpu", "max_cpu"}, std::pair{"creates-per-s", "creates_per_s"}}) {
      if (!a.get(flag).empty()) q[field] = std::atof(a.get(flag).c_str());
    }
    return q;
  };
  auto printTenant = [](const json& t) {
    auto& q = t["quota"];
    auto& u = t["usage"];
    printf("%-24s %-6s %5lld/%-5lld %7.2f/%-7.2f %8lld/%-8lld %g/s\n",
           t["id"].get<std::string>().c_str(), t["role"].get<std::string>().c_str(),
           (long long)u["sandboxes"].get<int64_t>(), (long long)q["max_sandboxes"].get<int64_t>(),
           u["cpu"].get<double>(), q["max_cpu"].get<double>(),
           (long long)u["memory_mb"].get<int64_t>(), (long long)q["max_memory_mb"].get<int64_t>(),
           q["creates_per_s"].get<double>());
  };
  const char* header = "%-24s %-6s %-11s %-15s %-17s %s\n";
  if (cmd == "whoami") {
    auto j = call("GET", "/v1/whoami", "", 200);
    if (!j) return 1;
    std::cout << (*j)["tenant"].get<std::string>() << " " << (*j)["role"].get<std::string>()
              << "\n";
    return 0;
  }
  if (cmd == "tenant" && sub == "create") {
    json body = {{"quota", quota()}};
    if (a.positional.size() > 2) body["id"] = a.positional[2];
    if (!a.get("name").empty()) body["name"] = a.get("name");
    if (!a.get("role").empty()) body["role"] = a.get("role");
    auto j = call("POST", "/v1/tenants", body.dump(), 201);
    if (!j) return 1;
    std::cout << (*j)["id"].get<std::string>() << "\n";
    return 0;
  }
  if (cmd == "tenant" && sub == "ls") {
    auto j = call("GET", "/v1/tenants", "", 200);
    if (!j) return 1;
    printf(header, "TENANT", "ROLE", "SANDBOXES", "CPU", "MEMORY_MB", "CREATES");
    for (auto& t : (*j)["tenants"]) printTenant(t);
    return 0;
  }
  if (cmd == "tenant" && sub == "quota" && a.positional.size() == 3) {
    auto j = call("PATCH", "/v1/tenants/" + a.positional[2], json{{"quota", quota()}}.dump(), 200);
    if (!j) return 1;
    printf(header, "TENANT", "ROLE", "SANDBOXES", "CPU", "MEMORY_MB", "CREATES");
    printTenant(*j);
    return 0;
  }
  if (cmd == "tenant" && sub == "rm" && a.positional.size() >= 3) {
    for (size_t i = 2; i < a.positional.size(); ++i) {
      if (!call("DELETE", "/v1/tenants/" + a.positional[i], "", 200)) return 1;
      std::cout << a.positional[i] << "\n";
    }
    return 0;
  }
  if (cmd == "key" && sub == "create" && a.positional.size() == 3) {
    json body = {{"name", a.get("name")}};
    auto j = call("POST", "/v1/tenants/" + a.positional[2] + "/keys", body.dump(), 201);
    if (!j) return 1;
    std::cerr << "key " << (*j)["id"].get<std::string>()
              << " (shown once; the server keeps only its hash):\n";
    std::cout << (*j)["key"].get<std::string>() << "\n";
    return 0;
  }
  if (cmd == "key" && sub == "ls" && a.positional.size() == 3) {
    auto j = call("GET", "/v1/tenants/" + a.positional[2] + "/keys", "", 200);
    if (!j) return 1;
    printf("%-14s %-22s %-26s %-26s %s\n", "KEY_ID", "PREFIX", "CREATED", "REVOKED", "NAME");
    for (auto& k : (*j)["keys"]) {
      printf("%-14s %-22s %-26s %-26s %s\n", k["id"].get<std::string>().c_str(),
             k["prefix"].get<std::string>().c_str(), k["created_at"].get<std::string>().c_str(),
             k["revoked_at"].is_null() ? "-" : k["revoked_at"].get<std::string>().c_str(),
             k["name"].get<std::string>().c_str());
    }
    return 0;
  }
  if (cmd == "key" && sub == "rm" && a.positional.size() == 4) {
    if (!call("DELETE", "/v1/tenants/" + a.positional[2] + "/keys/" + a.positional[3], "", 200)) {
      return 1;
    }
    std::cout << a.positional[3] << "\n";
    return 0;
  }
  return die(cmd == "key" ? "usage: dsec key create|ls TENANT, dsec key rm TENANT KEY_ID"
                          : "usage: dsec tenant create [ID]|ls|rm ID|quota ID [--max-... N]");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::cout << kUsage;
    return argc < 2 ? 1 : 0;
  }
  std::string cmd = argv[1];
  Args a = parseArgs(argc, argv, 1);
  maskUriPasswords(argc, argv);
  bool help = a.opts.count("help") || (a.positional.size() > 1 && a.positional.back() == "help");
  if (help) {
    std::cout << kUsage;
    return 0;
  }
  if (cmd == "up" || cmd == "platform") return cmdUp(a);
  if (cmd == "edge") {
    return cli::cmdEdge([&a](const std::string& k, const std::string& d) { return a.get(k, d); });
  }
  if (cmd == "loader") {
    // Internal: a loader process started by the edge (edge/image/fanotify_loader.h,
    // edge/image/fuse_loader.h).
    std::string kind = a.positional.size() == 2 ? a.positional[1] : "";
    int ctl = std::atoi(a.get("control-fd", "3").c_str());
    if (kind == "fanotify" && !a.get("store").empty()) {
      return edge::runFanotifyLoaderProcess(ctl, a.get("store"), a.get("store-ca"));
    }
    if (kind == "fuse" && !a.get("store").empty() && !a.get("mount").empty()) {
      return edge::runFuseLoaderProcess(ctl, a.get("store"), a.get("mount"), a.get("store-ca"));
    }
    return die(
        "usage: dsec loader fanotify --store URI --control-fd N\n"
        "       dsec loader fuse --store URI --mount DIR --control-fd N (started by dsec up)");
  }
  if (cmd == "image" && a.positional.size() > 1 && a.positional[1] == "build") {
    return cmdBuild(parseBuildArgs(argc, argv, 1));
  }
  if (cmd == "image") return cmdImage(a);
  if (cmd == "sandbox") return cmdSandbox(a);
  if (cmd == "tenant" || cmd == "key" || cmd == "whoami") return cmdTenants(cmd, a);
  if (cmd == "layer" || cmd == "gc") {
    auto client = connectClient(a);
    if (!client.isOk()) return die(client.status().toString());
    if (cmd == "gc") {
      json body = json::object();
      if (!a.get("grace-s").empty()) body["grace_s"] = std::atof(a.get("grace-s").c_str());
      auto r = (*client)->request("POST", "/v1/gc", body.dump());
      if (!r.isOk()) return die(r.status().toString());
      if (r->status != 200) return apiError(*r);
      json answer = json::parse(r->body);
      for (auto& d : answer["removed"]) std::cout << d.get<std::string>() << "\n";
      // Data blobs that lost the chunks no layer reads any more.
      for (auto& x : answer.value("reclaimed", json::array())) {
        std::cout << x.value("digest", "") << " reclaimed " << x.value("bytes", int64_t(0))
                  << " bytes\n";
      }
      return 0;
    }
    auto r = (*client)->request("GET", "/v1/layers");
    if (!r.isOk()) return die(r.status().toString());
    if (r->status != 200) return apiError(*r);
    json listing = json::parse(r->body);
    printf("%-71s %-9s %-12s %s\n", "LAYER", "KIND", "SIZE", "IMAGES");
    for (auto& l : listing["layers"]) {
      std::string imgs;
      for (auto& i : l["images"]) imgs += (imgs.empty() ? "" : ",") + i.get<std::string>();
      printf("%-71s %-9s %-12lld %s\n", l["digest"].get<std::string>().c_str(),
             l["kind"].is_null() ? "-" : l["kind"].get<std::string>().c_str(),
             (long long)l["size"].get<int64_t>(), imgs.c_str());
    }
    return 0;
  }
  if (cmd == "exec") {
    if (a.positional.size() != 2) return die("usage: dsec exec ID -- CMD [ARG...]");
    return cmdExec(a, a.positional[1]);
  }
  std::cerr << kUsage;
  return die("unknown command '" + cmd + "'");
}
