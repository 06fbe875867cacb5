"""The `crun run` baseline: `true` in a bundle whose rootfs is busybox.tar.

crun 1.8 refuses hybrid cgroup hosts (v1 controllers + a v2 hierarchy that holds
hugetlb). The workaround (../shared/HOST.md) binds hugetlb to a v1 hierarchy
inside a private mount namespace. We enter that namespace once and time every
`crun run` from a driver inside it (this file run as a script, asked over a
pipe for one run at a time), so the workaround's cost (unshare, mount, a Python
start) is not charged to crun.
Each iteration is what a user of crun pays: fork+exec of crun, create, start,
wait for `true`, delete.
"""

import json
import os
import subprocess
import sys
import time

HYBRID_MSG = "hybrid mode not supported"


def prepare_bundle(busybox_tar, parent):
    """Extracts the rootfs and writes config.json from `crun spec`, adjusted."""
    bundle = os.path.join(parent, "bundle")
    rootfs = os.path.join(bundle, "rootfs")
    os.makedirs(rootfs)
    r = subprocess.run(["tar", "--numeric-owner", "-xpf", busybox_tar, "-C", rootfs],
                       stdin=subprocess.DEVNULL, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError("extracting %s: %s" % (busybox_tar, r.stderr.decode(errors="replace")))
    r = subprocess.run(["crun", "spec"], cwd=bundle, stdin=subprocess.DEVNULL, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError("crun spec: %s" % r.stderr.decode(errors="replace"))
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["process"]["args"] = ["true"]
    cfg["process"]["terminal"] = False
    cfg["root"]["readonly"] = False
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return bundle


def _crun_cmd(crun, state, bundle, name):
    return [crun, "--root", state, "run", "--bundle", bundle, name]


def needs_hybrid_workaround(crun, bundle, state):
    """Probes with one plain `crun run`: True if crun refuses this host's cgroups."""
    r = subprocess.run(_crun_cmd(crun, state, bundle, "dsec-bench-probe-%d" % os.getpid()),
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    if r.returncode == 0:
        return False
    err = r.stderr.decode(errors="replace")
    if HYBRID_MSG in err:
        return True
    raise RuntimeError("crun run failed (%d): %s" % (r.returncode, err.strip()))


class Baseline:
    """A driver process timing one `crun run` per run_one() call, inside the
    hybrid-cgroup workaround namespace when this host needs it. Lets a benchmark
    interleave crun with what it compares, so both see the same host load."""

    def __init__(self, bundle, work, crun="crun"):
        self.bundle, self.work, self.crun = bundle, work, crun
        self.mode = None
        self.remounts = 0  # hugetlb hierarchies lost to other users and re-mounted
        self._p = None

    def start(self):
        state = os.path.join(self.work, "crun-state")
        os.makedirs(state, exist_ok=True)
        hybrid = needs_hybrid_workaround(self.crun, self.bundle, state)
        self.mode = "hybrid-workaround" if hybrid else "direct"
        cmd = [sys.executable, os.path.abspath(__file__), "--crun", self.crun,
               "--bundle", self.bundle, "--state", state]
        if hybrid:
            cg = os.path.join(self.work, "hugetlb")
            os.makedirs(cg, exist_ok=True)
            cmd = ["unshare", "-m", "--propagation", "private"] + cmd + ["--hugetlb-dir", cg]
        self._p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, bufsize=1)
        ready = self._p.stdout.readline()
        if not ready.startswith("ready"):
            self._fail()
        return self

    def run_one(self):
        """Seconds one `crun run` of `true` took (fork+exec of crun to its exit)."""
        self._p.stdin.write("run\n")
        self._p.stdin.flush()
        line = self._p.stdout.readline()
        try:
            obj = json.loads(line)
        except ValueError:
            self._fail(line)
        self.remounts = obj["remounts"]
        return obj["s"]

    def _fail(self, line=""):
        self.close()
        err = self._p.stderr.read() if self._p.stderr else ""
        raise RuntimeError("crun driver failed (exit %s): %s" % (self._p.returncode,
                                                                (line + err).strip()))

    def close(self):
        if self._p and self._p.poll() is None:
            try:
                self._p.stdin.close()
            except OSError:
                pass
            try:
                self._p.wait(30)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.wait()


def run_baseline(bundle, work, n, warmup, crun="crun", progress=None):
    """Times n runs (after warmup) in a row. Returns (samples in seconds, mode)."""
    b = Baseline(bundle, work, crun).start()
    try:
        samples = []
        step = max(1, n // 10)
        for i in range(warmup + n):
            dt = b.run_one()
            if i < warmup:
                continue
            samples.append(dt)
            if progress and (len(samples) % step == 0 or len(samples) == n):
                recent = sorted(samples[-step:])
                progress({"event": "crun_progress", "done": len(samples), "of": n,
                          "recent_p50_ms": round(recent[len(recent) // 2] * 1000, 3)})
        return samples, b.mode
    finally:
        b.close()


def _driver(argv):
    """Serves lines on stdin: each "run" -> one timed `crun run`, answered with
    the seconds it took on a line of stdout. EOF ends it."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--crun", default="crun")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--hugetlb-dir")
    a = ap.parse_args(argv)
    def mount_hugetlb():
        # Inside our private mount namespace: the mount goes when it exits.
        r = subprocess.run(["mount", "-t", "cgroup", "-o", "hugetlb", "cgroup", a.hugetlb_dir],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write("mount hugetlb cgroup: %s\n" % r.stderr.strip())
            return False
        return True

    if a.hugetlb_dir and not mount_hugetlb():
        return 1
    print("ready", flush=True)
    remounts = 0
    for i, line in enumerate(sys.stdin):
        if line.strip() != "run":
            sys.stderr.write("unknown request %r\n" % line)
            return 1
        for attempt in range(4):
            cmd = _crun_cmd(a.crun, a.state, a.bundle, "dsec-bench-%d-%d-%d" % (os.getpid(), i, attempt))
            t0 = time.perf_counter()
            r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
            dt = time.perf_counter() - t0
            if r.returncode == 0:
                break
            err = r.stderr.decode(errors="replace").strip()
            # The kernel kills a v1 hierarchy that has no child cgroups when any
            # superblock of it goes, e.g. when someone else on the host who used
            # the same workaround exits; hugetlb is then back in v2 despite our
            # mount. Mount a fresh hierarchy and retry (untimed).
            if a.hugetlb_dir and HYBRID_MSG in err and attempt < 3:
                subprocess.run(["umount", "-l", a.hugetlb_dir], stdin=subprocess.DEVNULL,
                               capture_output=True)
                if not mount_hugetlb():
                    return 1
                remounts += 1
                continue
            sys.stderr.write("%s: exit %d: %s\n" % (" ".join(cmd), r.returncode, err))
            return 1
        print(json.dumps({"s": dt, "remounts": remounts}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_driver(sys.argv[1:]))
