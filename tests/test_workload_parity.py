"""Issue 31, item 4: a broad real workload, run in a sandbox and on the host,
gives the same results.

The workload is CPython's own regression test suite (Debian's
libpython3.11-testsuite, for the image's python3.11): MODULES, which exercise
files, processes, signals, ptys, sockets and time. It runs at the same time

  * in a dsec container sandbox of the `debian-pytest.tar` test image (default
    policy: no network beyond its own loopback), and
  * on the host, in a plain chroot of the same root filesystem, as root, in
    new mount, pid, net (loopback up, no egress, like the sandbox), uts and ipc
    namespaces with /proc, /sys, the host's /dev and a tmpfs /tmp mounted: an
    ordinary Debian machine without a network. Only CAP_SYS_TIME, CAP_SYS_BOOT
    and CAP_SYS_MODULE are taken from it (HOST_DROPPED_CAPS), so that the suite
    cannot set this host's clock.

Both sides get the same environment, working directory, /etc/hosts layout,
open-file limits (a Debian login's) and a pseudo-terminal as the controlling
terminal (`script`). tests/parity_runner.py runs each module in a process of
its own, two at a time, and records every test case's outcome (passed, failed,
error, skipped, xfail, xpass) and every module's verdict. Whatever differs is
run again on both sides, alone (`--matchfile`): what then agrees is printed as
not reproduced and does not count; what still differs fails the test unless
EXCEPTIONS says why a sandbox must differ, pointing at the doc. The summary
(counts per outcome on each side, the slowest modules, the differences with
each side's last traceback line) is printed either way.

Needs `debian-pytest.tar` in the image cache (scripts/build-test-images.sh,
`make images`) and unshare, chroot, setpriv, prlimit, ip on the host; skips
saying so without them. ~3.5 minutes on a 2-core host (each side ~205 s,
at the same time, then ~10 s for the second run).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import IMAGE_CACHE, _image_fixture, unavailable
from helpers import mounts_containing

pytestmark = pytest.mark.slow

IMAGE_TAR = "debian-pytest.tar"
IMAGE_REF = "debian-pytest:latest"

# Files, processes, signals, ptys, sockets and time.
MODULES = [
    # the longest first, so that two at a time end together (~70, 65, 50 s here)
    "test_asyncio", "test_multiprocessing_fork", "test_signal",
    # files
    "test_os", "test_posix", "test_shutil", "test_tarfile", "test_zipfile", "test_tempfile",
    "test_pathlib", "test_glob", "test_stat", "test_fileio", "test_file", "test_io",
    "test_fileinput", "test_posixpath", "test_mailbox", "test_mmap", "test_fcntl",
    # users, processes, limits
    "test_pwd", "test_grp", "test_resource", "test_subprocess", "test_fork1", "test_wait3",
    "test_wait4", "test_platform", "test_uuid",
    # signals, threads
    "test_eintr", "test_faulthandler", "test_threading", "test_thread",
    "test_threadsignals",
    # ptys and terminals
    "test_pty", "test_openpty", "test_ioctl", "test_getpass",
    # sockets, polling
    "test_socket", "test_select", "test_selectors", "test_epoll", "test_poll",
    "test_socketserver", "test_httpservers", "test_logging", "test_timeout",
    # time
    "test_time", "test_sched",
]
JOBS = 2  # modules at a time on each side
# regrtest -u: `network` for the loopback servers of test_socketserver and
# friends; what would go further fails to resolve or connect on both sides.
USE = "network"
MODULE_TIMEOUT_S = 300  # regrtest --timeout, per module
SIDE_TIMEOUT_S = 1800

# Left out on both sides (regrtest --ignore), with the reason.
IGNORED = {
    "test.test_socket.ThreadedVSOCKSocketStreamTest.*":
        "vsock is not network-namespaced: on the host side it is the real host's, and on a "
        "guest whose hypervisor does not loop a connection to its own CID back (Firecracker) "
        "accept() never returns, so the module times out; in a sandbox vsock sockets are "
        "refused (seccomp, docs/security.md) and the class skips",
}

# Reasons several EXCEPTIONS share.
_CHOWN_PAST_THE_MAPPING = (
    "chown to uid/gid 2**31 as root: EINVAL in a sandbox, whose user namespace maps ids "
    "0-65535 only (--userns-width; every sandbox a range of its own, so the 32-bit id space "
    "cannot be mapped whole); docs/security.md, 'Ids outside the mapping'")
_TRUSTED_XATTRS = (
    "os_helper.can_xattr() sets a trusted.* attribute: the kernel allows that only with "
    "CAP_SYS_ADMIN in the host's user namespace, which a sandbox never has (it drops "
    "CAP_SYS_ADMIN, and its root is an ordinary host uid); user.* attributes work "
    "(test_os.ExtendedAttributeTests passes on both sides); docs/security.md, capabilities "
    "and user namespace")
_VSOCK = (
    "vsock sockets are refused (EPERM) by the seccomp profile: vsock is not "
    "network-namespaced; docs/security.md, seccomp")

# Test ids (or module names, for a module's verdict) whose outcome in a sandbox
# must differ from a plain host's, each with the documented reason.
EXCEPTIONS: dict[str, str] = {
    "test.test_posix.PosixTester.test_chown": _CHOWN_PAST_THE_MAPPING,
    "test.test_posix.PosixTester.test_fchown": _CHOWN_PAST_THE_MAPPING,
    "test.test_posix.PosixTester.test_lchown": _CHOWN_PAST_THE_MAPPING,
    "test.test_shutil.TestCopy.test_copy2_xattr": _TRUSTED_XATTRS,
    "test.test_shutil.TestCopy.test_copyxattr": _TRUSTED_XATTRS,
    "test.test_shutil.TestCopy.test_copyxattr_symlinks": _TRUSTED_XATTRS,
    "test.test_socket.BasicVSOCKTest.testCreateSocket": _VSOCK,
    "test.test_socket.BasicVSOCKTest.testCrucialConstants": _VSOCK,
    "test.test_socket.BasicVSOCKTest.testSocketBufferSize": _VSOCK,
    "test.test_socket.BasicVSOCKTest.testVSOCKConstants": _VSOCK,
    "test.test_socket.GeneralModuleTests.test_sethostname":
        "sethostname() is EPERM in a sandbox: its execs run without CAP_SYS_ADMIN (as in "
        "Docker's default set); the hostname is the sandbox's id, set at create; "
        "docs/security.md, capabilities",
    "test.test_subprocess.POSIXProcessTestCase.test_preexec_fork_failure":
        "passes in a sandbox, skips on the host ('RLIMIT_NPROC had no effect; probably "
        "superuser'): the kernel exempts the host's root user (and CAP_SYS_RESOURCE or "
        "CAP_SYS_ADMIN holders) from RLIMIT_NPROC; a sandbox's root is an ordinary host uid "
        "of its own range without either, so the limit holds for it as for any user; "
        "docs/security.md, user namespace",
}

ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
RUNNER = "/opt/parity/parity_runner.py"
OUT = "/root/parity-out"
# The host side is root with every capability but these, which would let the
# suite change the host itself: test_time's test_monotonic_settime sets the
# real-time clock an hour back (and then forward again). In a sandbox clock
# setting is refused anyway (seccomp, docs/security.md), so that test skips on
# both sides.
HOST_DROPPED_CAPS = "-sys_time,-sys_boot,-sys_module"
# systemd's default for a Debian 12 login, 1024 soft and 524288 hard, or this
# process's own hard limit where lower (raising it needs CAP_SYS_RESOURCE).
NOFILE = (1024, min(524288, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

# The host side's PID 1 (a process of the host's python, before the chroot):
# runs the command as its child and reaps every orphan, as a sandbox's init
# does, until the command ends; its exit then takes the pid namespace down.
_REAPER = textwrap.dedent("""
    import os, signal, sys
    pid = os.fork()
    if pid == 0:
        # Default dispositions and an empty mask, as a sandbox's execs get
        # (whatever this test was started with: a shell's background job
        # ignores SIGINT, and python then raises no KeyboardInterrupt).
        for s in signal.valid_signals():
            if s not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.execvp(sys.argv[1], sys.argv[1:])
    while True:
        p, status = os.wait()
        if p == pid:
            sys.exit(os.waitstatus_to_exitcode(status) & 0xff)
""")

_HOST_SETUP = textwrap.dedent("""
    set -eu
    root=$1; shift
    hostname "$HOSTNAME_WANTED"
    ip link set lo up
    mount -t proc proc "$root/proc"
    mount -t sysfs sysfs "$root/sys"
    mount --rbind /dev "$root/dev"
    mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
    exec "$@"
""")


def _hosts_file(hostname: str) -> str:
    # What Debian's installer writes, and what a sandbox's init writes too.
    return (f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"127.0.1.1\t{hostname}\n")


def _runner_argv(matchfile: str | None, modules) -> list:
    argv = ["python3", RUNNER, "--out", OUT, "--jobs", str(JOBS),
            "--timeout", str(MODULE_TIMEOUT_S)]
    if matchfile:
        argv += ["--matchfile", matchfile]
    for pattern in IGNORED:
        argv += ["--ignore", pattern]
    return argv + ["--use", USE] + list(modules)


def _shell(argv) -> str:
    """The command line both sides run: under `script`, so that the runner's
    session has a pseudo-terminal for its controlling terminal (/dev/tty, as in
    a login), in a fixed environment."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in ENV.items())
    inner = f"exec env -i {env} {shlex.join(argv)}"
    return (f"cd /root && rm -rf {OUT} && "
            f"exec script -qefc {shlex.quote(inner)} /dev/null </dev/null")


class SandboxSide:
    name = "sandbox"

    def __init__(self, sb):
        self.sb = sb

    def put(self, path: str, data: bytes):
        self.sb.mkdir(os.path.dirname(path), parents=True)
        self.sb.write_file(path, data)

    def run(self, argv) -> dict:
        t0 = time.monotonic()
        r = self.sb.exec(["/bin/sh", "-c", _shell(argv)], timeout=SIDE_TIMEOUT_S,
                         max_output_bytes=1 << 20)
        took = time.monotonic() - t0
        assert r.exit_code == 0, f"the runner failed in the sandbox: {r!r}"
        return json.loads(self.sb.read_file(f"{OUT}/summary.json")) | {"seconds": took}


class HostSide:
    name = "host"

    def __init__(self, root: Path):
        self.root = root

    def put(self, path: str, data: bytes):
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def run(self, argv) -> dict:
        t0 = time.monotonic()
        cmd = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork",
               "--kill-child", "--net", "--uts", "--ipc", "--",
               "/bin/sh", "-c", _HOST_SETUP, "sh", str(self.root),
               sys.executable, "-c", _REAPER,
               "setpriv", f"--bounding-set={HOST_DROPPED_CAPS}", "--",
               "prlimit", f"--nofile={NOFILE[0]}:{NOFILE[1]}", "--",
               "chroot", str(self.root), "/bin/sh", "-c", _shell(argv)]
        env = dict(os.environ, HOSTNAME_WANTED="parity-host")
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=SIDE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.communicate()
            raise AssertionError(f"the host side took over {SIDE_TIMEOUT_S} s")
        took = time.monotonic() - t0
        assert p.returncode == 0, (f"the runner failed on the host ({p.returncode}):\n"
                                   f"{out.decode(errors='replace')[-4000:]}")
        summary = self.root / OUT.lstrip("/") / "summary.json"
        return json.loads(summary.read_text()) | {"seconds": took}


def _cases(result: dict) -> dict:
    """{id: outcome} over all modules, with each module's verdict under its name."""
    out = {}
    for mod, m in result["modules"].items():
        out[mod] = "module " + m["status"]
        for cid, (outcome, _) in m["cases"].items():
            out[cid] = outcome
    return out


def _detail(result: dict, cid: str) -> str:
    for mod, m in result["modules"].items():
        if cid == mod:
            return m["output_tail"][-600:]
        if cid in m["cases"]:
            return m["cases"][cid][1]
    return "(not run)"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:200] if lines else "(no message)"


def _module_of(cid: str) -> str:
    parts = cid.split(".")
    return parts[1] if parts[0] == "test" and len(parts) > 1 else parts[0]


def _differences(a: dict, b: dict) -> dict:
    ca, cb = _cases(a), _cases(b)
    return {cid: (ca.get(cid, "missing"), cb.get(cid, "missing"))
            for cid in sorted(ca.keys() | cb.keys()) if ca.get(cid) != cb.get(cid)}


def _run_both(sides, argv) -> list:
    """Runs argv on every side at once (one thread per side); their results."""
    results = [None] * len(sides)
    errors = [None] * len(sides)

    def one(i):
        try:
            results[i] = sides[i].run(argv)
        except BaseException as e:  # noqa: B902 - handed to the main thread
            errors[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sides))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def _counts(result: dict) -> dict:
    counts = {}
    for m in result["modules"].values():
        for outcome, _ in m["cases"].values():
            counts[outcome] = counts.get(outcome, 0) + 1
    return dict(sorted(counts.items()))


@pytest.fixture(scope="module")
def pytest_image(server):
    return _image_fixture(server, IMAGE_REF, IMAGE_TAR)


@pytest.fixture(scope="module")
def host_root():
    tar = IMAGE_CACHE / IMAGE_TAR
    for tool in ("unshare", "chroot", "setpriv", "prlimit", "ip", "hostname", "tar"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} not found (the host side of the comparison needs it)")
    root = Path(tempfile.mkdtemp(prefix="dsec-parity-", dir="/var/tmp"))
    try:
        subprocess.run(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls",
                        "-C", str(root), "-xpf", str(tar)], check=True, timeout=300)
        (root / "etc/hostname").write_text("parity-host\n")
        (root / "etc/hosts").write_text(_hosts_file("parity-host"))
        yield root
    finally:
        # The chroot's mounts lived in its own mount namespace, gone with its
        # processes; nothing may be left mounted before the tree goes.
        left = mounts_containing(str(root))
        assert not left, f"mounts left under {root}: {left[:5]}"
        shutil.rmtree(root, ignore_errors=True)


def test_cpython_suite_same_in_sandbox_and_on_host(server, pytest_image, make_sandbox,
                                                  host_root):
    sb = make_sandbox(pytest_image, cpu=2, memory_mb=4096, disk_mb=8192, pids=4096,
                      ttl_s=3 * SIDE_TIMEOUT_S, labels={"suite": "parity"})
    sides = [SandboxSide(sb), HostSide(host_root)]
    runner = (Path(__file__).parent / "parity_runner.py").read_bytes()
    for side in sides:
        side.put(RUNNER, runner)

    first = _run_both(sides, _runner_argv(None, MODULES))
    diffs = _differences(*first)
    # A module's verdict that differs because some of its cases do says
    # nothing more; it counts only where no case of the module differs
    # (a crash, a timeout, a changed environment).
    case_mods = {_module_of(c) for c in diffs if c not in MODULES}
    follows = {c for c in diffs if c in MODULES and c in case_mods}
    diffs = {c: v for c, v in diffs.items() if c not in follows}

    # Once more, alone, whatever differed: a difference that does not come back
    # is a flaky test (or one that depends on its neighbours), printed only.
    confirmed, flaky, second = {}, {}, None
    if diffs:
        mods = sorted({_module_of(c) for c in diffs})
        ids = []
        for c in diffs:
            last = c.rsplit(".", 1)[-1]
            if c in MODULES:
                ids.append(f"test.{c}.*")
            elif last.startswith(("setUp", "tearDown")):
                ids.append(c.rsplit(".", 1)[0] + ".*")  # its whole class or module
            else:
                ids.append(c)
        matchfile = "/root/parity-rerun.txt"
        for side in sides:
            side.put(matchfile, ("\n".join(ids) + "\n").encode())
        second = _run_both(sides, _runner_argv(matchfile, mods))
        again = _differences(*second)
        for cid, first_pair in diffs.items():
            (confirmed if cid in again else flaky)[cid] = (first_pair, again.get(cid))

    lines = [f"CPython regression tests, {len(MODULES)} modules, {JOBS} at a time on each side, "
             f"both sides at once"]
    for side, res in zip(sides, first):
        slow = sorted(res["modules"].items(), key=lambda kv: -kv[1]["seconds"])[:5]
        lines.append(f"  {side.name}: {res['seconds']:.0f} s, outcomes {_counts(res)}; slowest "
                     + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in slow))
        bad = {k: v["status"] for k, v in res["modules"].items() if v["status"] != "passed"}
        lines.append(f"    module verdicts other than passed: {bad or 'none'}")
    lines.append(f"  differences: {len(diffs)} (and {len(follows)} module verdicts that follow "
                 f"from them); {len(confirmed)} again when run alone, {len(flaky)} not")
    failing = []
    for cid, ((s1, h1), (s2, h2)) in sorted(confirmed.items()):
        why = EXCEPTIONS.get(cid)
        lines.append(f"  {cid}: sandbox {s1}, again {s2}; host {h1}, again {h2}")
        lines.append(f"      sandbox: {_last_line(_detail(second[0], cid))}")
        lines.append(f"      host:    {_last_line(_detail(second[1], cid))}")
        lines.append(f"      {'documented: ' + why if why else 'NOT DOCUMENTED'}")
        if not why:
            failing.append(cid)
    for cid, ((s1, h1), _) in sorted(flaky.items()):
        lines.append(f"  not again when run alone: {cid}: sandbox {s1}, host {h1}")
        lines.append(f"      sandbox: {_last_line(_detail(first[0], cid))}")
        lines.append(f"      host:    {_last_line(_detail(first[1], cid))}")
    stale = sorted(set(EXCEPTIONS) - set(confirmed))
    if stale:
        lines.append(f"  EXCEPTIONS that did not differ this time: {stale}")
    summary = "\n".join(lines)
    print(summary)

    for side, res in zip(sides, first):
        n = sum(len(m["cases"]) for m in res["modules"].values())
        assert n > 5000, f"only {n} test cases ran on the {side.name} side:\n{summary}"
    assert not failing, (f"{len(failing)} test outcome(s) differ between a sandbox and a plain "
                         f"host without a documented reason:\n{summary}")
