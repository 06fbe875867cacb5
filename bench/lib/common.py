"""Shared code of the dsec benchmarks: run a private `dsec up`, import the test
image, percentiles, and the JSON line protocol (progress lines as we go, then
exactly one summary line last on stdout; diagnostics go to stderr).

Python 3 stdlib only, plus the SDK at sdk/python/dsec (or, if that cannot be
imported, the minimal REST client in bench/lib/rawclient.py, reported as
"client": "raw" in the summary).
"""

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DSEC = os.path.join(REPO, "build", "bin", "dsec")
DEFAULT_CACHE = os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")
IMAGE_NAME = "busybox:latest"


class BenchError(Exception):
    """A failure with a message fit for the user; no traceback is printed."""


# ---- output -------------------------------------------------------------------

def emit(obj):
    """One progress line: a JSON object on stdout, flushed."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def note(msg):
    sys.stderr.write("bench: %s\n" % msg)
    sys.stderr.flush()


def rounded(obj, digits=3):
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v, digits) for v in obj]
    return obj


# ---- statistics ---------------------------------------------------------------

def percentile(values, p):
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * (p / 100.0)
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats_ms(samples_s, prefix=""):
    """{p50_ms, p99_ms, mean_ms, min_ms, max_ms} of samples given in seconds."""
    ms = [x * 1000.0 for x in samples_s]
    if not ms:
        return {}
    return {
        prefix + "p50_ms": percentile(ms, 50),
        prefix + "p99_ms": percentile(ms, 99),
        prefix + "mean_ms": sum(ms) / len(ms),
        prefix + "min_ms": min(ms),
        prefix + "max_ms": max(ms),
    }


# ---- host ---------------------------------------------------------------------

def meminfo_kb(field="MemAvailable"):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise BenchError("no %s in /proc/meminfo" % field)


def rss_kb(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def read_int(path, default=0):
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


# ---- the server ---------------------------------------------------------------

def _raise_nofile(n):
    def fn():
        cap = read_int("/proc/sys/fs/nr_open", 1048576)
        want = min(max(n, 1024), cap)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    return fn


class Server:
    """A private `dsec up` on 127.0.0.1:0 with its own data dir."""

    def __init__(self, dsec, cache, nofile=65536, tmp_root=None, keep=False, up_timeout=60.0,
                 data_dir=None, extra_args=(), log_name="server.log", needs_busybox=True):
        """data_dir: an existing data dir to run on (the caller owns it: stop()
        leaves it); default a new temp dir that stop() removes unless keep.
        extra_args: more `dsec up` options (--blob-store, --loader, ...)."""
        self.dsec = dsec
        self.cache = cache
        self.nofile = nofile
        self.tmp_root = tmp_root
        self.keep = keep
        self.up_timeout = up_timeout
        self.proc = None
        self.data_dir = data_dir
        self.own_dir = data_dir is None
        self.extra_args = list(extra_args)
        self.log_name = log_name
        self.needs_busybox = needs_busybox
        self.url = None
        self.pid = None
        self.token = None
        self._log = None

    def start(self):
        if not (os.path.isfile(self.dsec) and os.access(self.dsec, os.X_OK)):
            raise BenchError("%s not found or not executable (build dsec first, or --dsec PATH)"
                             % self.dsec)
        tar = os.path.join(self.cache, "busybox.tar")
        if self.needs_busybox and not os.path.isfile(tar):
            raise BenchError("%s missing: run scripts/build-test-images.sh %s" % (tar, self.cache))
        if self.own_dir:
            self.data_dir = tempfile.mkdtemp(prefix="dsec-bench-", dir=self.tmp_root)
        self._log = open(os.path.join(self.data_dir, self.log_name), "w+b")
        cmd = [self.dsec, "up", "--data-dir", self.data_dir, "--listen", "127.0.0.1:0"]
        cmd += self.extra_args
        note("starting %s" % " ".join(cmd))
        # Own session: a ^C at the terminal reaches us, and we stop the server
        # in order (SIGTERM, wait), rather than both dying at once.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_raise_nofile(self.nofile))
        up = os.path.join(self.data_dir, "up.json")
        deadline = time.monotonic() + self.up_timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError("dsec up exited with %s before serving:\n%s"
                                 % (self.proc.returncode, self.log_tail()))
            if os.path.exists(up):
                try:
                    with open(up) as f:
                        info = json.load(f)
                    self.url, self.pid = info["url"], int(info["pid"])
                    break
                except (ValueError, KeyError):
                    pass  # written atomically, but be lenient about a torn read
            if time.monotonic() > deadline:
                raise BenchError("no %s after %.0f s:\n%s" % (up, self.up_timeout, self.log_tail()))
            time.sleep(0.02)
        with open(os.path.join(self.data_dir, "token")) as f:
            self.token = f.read().strip()
        with urllib.request.urlopen(self.url + "/v1/health", timeout=10) as r:
            health = json.loads(r.read())
        emit({"event": "server_up", "url": self.url, "pid": self.pid,
              "version": health.get("version"), "data_dir": self.data_dir})
        return self

    def import_image(self, name=IMAGE_NAME, tar=None, kind=None, timeout=300):
        tar = tar or os.path.join(self.cache, "busybox.tar")
        cmd = [self.dsec, "image", "import", "--data-dir", self.data_dir, "--name", name]
        if kind:
            cmd += ["--kind", kind]
        cmd.append(tar)
        t0 = time.monotonic()
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout)
        if r.returncode != 0:
            raise BenchError("%s failed (%d):\n%s" % (" ".join(cmd), r.returncode,
                                                       r.stdout.decode(errors="replace")[-2000:]))
        emit({"event": "image_imported", "name": name, "s": round(time.monotonic() - t0, 3)})

    def rss_kb(self):
        return rss_kb(self.pid or self.proc.pid)

    def log_tail(self, n=4000):
        if not self._log:
            return ""
        try:
            self._log.flush()
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(0, size - n))
            return self._log.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def stop(self, timeout=60.0):
        """SIGTERM, wait; SIGKILL if it will not go. Returns the exit status."""
        rc = None
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                note("dsec up ignored SIGTERM for %.0f s; killing it" % timeout)
                self.proc.kill()
                rc = self.proc.wait()
        elif self.proc:
            rc = self.proc.returncode
        if self.data_dir and self.own_dir and not self.keep:
            self._remove_data_dir()
        return rc

    def _remove_data_dir(self):
        # Never recurse through a mount left behind (it could reach outside).
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4] for line in f]
        prefix = self.data_dir.rstrip("/") + "/"
        left = [m for m in mounts if m == self.data_dir or m.startswith(prefix)]
        if left:
            note("leaving %s: %d mounts still under it (e.g. %s)" % (self.data_dir, len(left), left[0]))
            return
        shutil.rmtree(self.data_dir, ignore_errors=True)


# ---- clients ------------------------------------------------------------------

def load_client_module(kind="auto"):
    """Returns (module with Client.from_data_dir, name). kind: auto | sdk | raw."""
    if kind in ("auto", "sdk"):
        sdk = os.path.join(REPO, "sdk", "python")
        if sdk not in sys.path:
            sys.path.insert(0, sdk)
        try:
            import dsec  # noqa: F401
            if hasattr(dsec, "Client"):
                return dsec, "sdk"
            err = "sdk/python/dsec has no Client"
        except Exception as e:  # the SDK is young; any import failure means "not usable"
            err = "cannot import the SDK: %s" % e
        if kind == "sdk":
            raise BenchError(err)
        note(err + "; using bench/lib/rawclient.py")
    from lib import rawclient
    return rawclient, "raw"


# ---- running a benchmark ------------------------------------------------------

def base_parser(name, description):
    p = argparse.ArgumentParser(prog="bench/" + name, description=description)
    p.add_argument("--dsec", default=DEFAULT_DSEC, help="dsec binary (default %(default)s)")
    p.add_argument("--cache", default=DEFAULT_CACHE,
                   help="test image cache with busybox.tar (default %(default)s)")
    p.add_argument("--client", choices=("auto", "sdk", "raw"), default="auto",
                   help="SDK, or the stdlib REST client in bench/lib (default %(default)s: SDK if importable)")
    p.add_argument("--tmp", default=None, help="parent of temp dirs (default: $TMPDIR or /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the server's data dir")
    p.add_argument("--userns", choices=("auto", "off"), default=None,
                   help="`dsec up --userns` of the server (default: dsec's own, auto)")
    p.add_argument("--disk-quota", default=None,
                   help="`dsec up --disk-quota` of the server (default: dsec's own, auto)")
    return p


class Cleanup:
    """Callbacks run in reverse order on exit, success or not."""

    def __init__(self):
        self._fns = []

    def push(self, fn, what):
        self._fns.append((fn, what))

    def run(self):
        ok = True
        while self._fns:
            fn, what = self._fns.pop()
            try:
                fn()
            except Exception as e:
                ok = False
                note("cleanup (%s) failed: %s" % (what, e))
        return ok


def run_main(name, body):
    """Runs body(cleanup) -> summary dict; prints the summary as the last line.
    Any failure: run cleanups, print the reason on stderr, exit 1 (130 on ^C)."""
    cleanup = Cleanup()

    def on_term(signum, frame):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_term)
    code = 0
    summary = None
    try:
        summary = body(cleanup)
    except BenchError as e:
        note("%s failed: %s" % (name, e))
        code = 1
    except KeyboardInterrupt:
        note("%s interrupted" % name)
        code = 130
    except Exception as e:
        traceback.print_exc()
        note("%s failed: %s: %s" % (name, type(e).__name__, e))
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not cleanup.run() and code == 0:
            code = 1
    if code == 0 and summary is not None:
        out = {"bench": name}
        out.update(rounded(summary))
        # How busy the host was: these are timings on a shared machine.
        with open("/proc/loadavg") as f:
            out["loadavg_1m"] = float(f.read().split()[0])
        sys.stdout.write(json.dumps(out, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    sys.exit(code)


def start_server(args, cleanup, nofile=65536):
    extra = ["--userns", args.userns] if getattr(args, "userns", None) else []
    if getattr(args, "disk_quota", None):
        extra += ["--disk-quota", args.disk_quota]
    srv = Server(args.dsec, args.cache, nofile=nofile, tmp_root=args.tmp, keep=args.keep,
                 extra_args=extra)
    def stop():
        rc = srv.stop()
        if rc not in (0, None, -signal.SIGTERM):
            note("dsec up exited with %s; log tail:\n%s" % (rc, srv.log_tail()))
    cleanup.push(stop, "stop dsec up")
    srv.start()
    srv.import_image()
    return srv


class SandboxTracker:
    """Remembers live sandboxes so a failure destroys them before the server stops."""

    def __init__(self):
        self.live = {}

    def add(self, sb):
        self.live[id(sb)] = sb
        return sb

    def discard(self, sb):
        self.live.pop(id(sb), None)

    def destroy_all(self):
        n = 0
        for sb in list(self.live.values()):
            try:
                sb.destroy()
                n += 1
            except Exception as e:
                note("destroy %s: %s" % (getattr(sb, "id", "?"), e))
        self.live.clear()
        return n


def make_client(args, srv):
    """A new Client for srv (SDK or raw, per --client). Returns (client, kind)."""
    mod, kind = load_client_module(args.client)
    return mod.Client.from_data_dir(srv.data_dir), kind


def close_client(client):
    fn = getattr(client, "close", None)
    if fn:
        try:
            fn()
        except Exception:
            pass


class Progress:
    """Emits a progress line every ~10% of n with the recent batch's p50."""

    def __init__(self, event, n, **extra):
        self.event, self.n, self.extra = event, n, extra
        self.step = max(1, n // 10)
        self.batch = []
        self.done = 0

    def add(self, seconds):
        self.batch.append(seconds)
        self.done += 1
        if self.done % self.step == 0 or self.done == self.n:
            line = {"event": self.event, "done": self.done, "of": self.n,
                    "recent_p50_ms": round(percentile(self.batch, 50) * 1000, 3)}
            line.update(self.extra)
            emit(line)
            self.batch = []


def proc_cpu_s(pid):
    """utime+stime of pid plus its waited-for children (seconds), 0 if gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = sum(int(x) for x in fields[11:15])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def self_cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
