"""Helpers shared by the end-to-end tests: host inspection, polling, errors."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

import dsec

SB_ID_RE = re.compile(r"\bsb-[0-9a-f]{16}\b")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
HOST_ENV_MARKER = "DSEC_TEST_HOST_ENV_MARKER"


def mounts_containing(text: str) -> list:
    """Mount points in our mount namespace whose mountinfo line contains `text`."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if text in line:
                fields = line.split()
                out.append(fields[4] if len(fields) > 4 else line.strip())
    return out


def loop_devices_backed_by(prefix: str) -> list:
    """Loop devices whose backing file lies under `prefix` (deleted ones too)."""
    out = []
    for f in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            backing = Path(f).read_text().strip()
        except OSError:
            continue  # detached meanwhile
        if backing.startswith(prefix):
            out.append(f"/dev/{f.split('/')[3]}: {backing}")
    return out


def edge_cgroup(data_dir) -> str:
    """The cgroup an edge on `data_dir` puts its sandboxes under ("e-<hash>")."""
    import hashlib
    real = os.path.realpath(os.path.join(str(data_dir), "edge"))
    return "e-" + hashlib.sha256(real.encode()).hexdigest()[:12]


def zygote_pids(data_dir) -> list:
    """Host pids of the fncall zygotes (docs/fncall.md) of the edge on `data_dir`:
    python processes of its cgroups started by an aether (a zygote's forks, the
    spares and calls, have the zygote's command line too)."""
    edge = edge_cgroup(data_dir)
    aethers = aether_pids(edge)
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"dsec fncall zygote" not in f.read(200):
                    continue
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) in aethers:
                    out.append(int(p))
        except (OSError, ValueError, IndexError):
            continue
    return out


def sandbox_cgroup_dirs(edge: str = "*") -> set:
    """Every cgroup directory named sb-* below a `dsec` cgroup (v1 and v2 layouts),
    only those of edge cgroup `edge` if given (so other dsec instances on the
    host do not count)."""
    found = set()
    for pat in ("/sys/fs/cgroup/dsec/sb-*", "/sys/fs/cgroup/*/dsec/sb-*",
                f"/sys/fs/cgroup/*/dsec/{edge}/sb-*", f"/sys/fs/cgroup/dsec/{edge}/sb-*"):
        found.update(p for p in glob.glob(pat) if os.path.isdir(p))
    return found


def cgroup_dirs_named(name: str) -> list:
    """Cgroup directories called `name` anywhere under /sys/fs/cgroup (depth <= 5)."""
    out = []
    root = "/sys/fs/cgroup"

    def walk(d, depth):
        try:
            it = os.scandir(d)
        except OSError:
            return
        with it:
            for e in it:
                if not e.is_dir(follow_symlinks=False):
                    continue
                if e.name == name:
                    out.append(e.path)
                elif depth < 5:
                    walk(e.path, depth + 1)

    walk(root, 0)
    return out


def aether_pids(edge: str = "") -> set:
    """PIDs of processes running dsec-aether (by argv[0] or by executable name);
    with `edge`, only those in that edge's cgroups."""
    pids = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except OSError:
            continue
        hit = b"dsec-aether" in os.path.basename(argv0)
        if not hit:
            try:
                hit = "dsec-aether" in os.path.basename(os.readlink(f"/proc/{d}/exe"))
            except OSError:
                pass
        if hit and edge:
            try:
                with open(f"/proc/{d}/cgroup") as f:
                    hit = f"/{edge}/" in f.read()
            except OSError:
                hit = False
        if hit:
            pids.add(int(d))
    return pids


def proc_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def tail(path: Path, lines: int = 60) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(data.splitlines()[-lines:])


def wait_until(pred, timeout: float, interval: float = 0.1):
    """Polls pred() until it returns a truthy value (returned) or timeout (None)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def running_ids(client) -> set:
    return {s.id for s in client.list(state="running")}


def cgroup_ids() -> set:
    """Sandbox ids that have a cgroup directory right now."""
    return {os.path.basename(p) for p in sandbox_cgroup_dirs()}


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"



def expect_error(fn, cls, field=None, status=None):
    """Calls fn() and asserts it raises `cls` (a DsecError subclass) with that field/status."""
    with pytest.raises(dsec.DsecError) as ei:
        fn()
    e = ei.value
    assert isinstance(e, cls), f"expected {cls.__name__}, got {e!r}"
    if field is not None:
        assert e.field == field, f"expected field {field!r}, got {e!r}"
    if status is not None:
        assert e.status == status, f"expected HTTP {status}, got {e!r}"
    return e


# ----- the QEMU backends (tests/test_microvm.py, tests/test_vm.py) -----------

def qemu_pids(data_dir: Path, backend: str) -> set:
    """QEMU processes whose working directory is under this server's VM root
    for `backend` ("microvm" or "vm": <data>/edge/<backend>/<id>)."""
    root = str(Path(data_dir) / "edge" / backend) + "/"
    found = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.readlink(p / "exe").endswith("qemu-system-x86_64") and \
                    (os.readlink(p / "cwd") + "/").startswith(root):
                found.add(int(p.name))
        except OSError:
            pass
    return found


def vm_dirs(data_dir: Path, backend: str) -> set:
    """The VM directories the edge has for `backend` ("microvm" or "vm")."""
    root = Path(data_dir) / "edge" / backend
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def require_qemu(*tools: str):
    """Skips (with the reason printed) unless the test prerequisites and the
    QEMU tools (default: qemu-system-x86_64) are there."""
    import shutil
    from conftest import _check_prerequisites, unavailable
    _check_prerequisites()
    for tool in tools or ("qemu-system-x86_64",):
        if shutil.which(tool) is None:
            unavailable(f"{tool} not installed (scripts/install-deps.sh)")


def start_vm_server(s, timeout: float):
    """Starts (or restarts) a test Server whose client waits `timeout` s per
    call (a TCG boot is slow)."""
    s.start()
    s.client = dsec.Client.from_data_dir(str(s.data_dir), timeout=timeout)


def require_backend(s, backend: str):
    """Skips, stopping the server, unless its node says `backend` is available."""
    from conftest import unavailable
    info = s.raw("GET", "/v1/node")[3]["backends"][backend]
    if not info["available"]:
        s.stop()
        unavailable(f"{backend} backend unavailable here: {info['reason']}")


def pause_to_disk(client, sb) -> float:
    """Pauses VM sandbox `sb` to disk and checks that the answer and the
    platform's record say so; the seconds the call took."""
    import time
    t0 = time.monotonic()
    sb.pause(memory="disk")
    took = time.monotonic() - t0
    assert sb.info["state"] == "paused" and sb.info["pause_memory"] == "disk", sb.info
    again = client.get(sb.id)
    assert again.state == "paused" and again.info["pause_memory"] == "disk", again.info
    return took


def resume_from_disk(sb, state) -> float:
    """For VM sandbox `sb`, paused to disk with its saved state at `state`:
    pausing to disk again and a RAM pause are no-ops; then resumes it and
    checks that it runs and the state file is gone. The resume's seconds."""
    import time
    sb.pause(memory="disk")
    sb.pause()
    assert sb.info["pause_memory"] == "disk"
    t0 = time.monotonic()
    sb.resume()
    took = time.monotonic() - t0
    assert sb.info["state"] == "running" and sb.info["pause_memory"] is None, sb.info
    assert not state.exists()
    return took


def npm_ci(npm: str, directory: Path, timeout_s: float) -> None:
    """`npm ci` in `directory` (a pinned package-lock.json): the test fails,
    with npm's output, if it errs or takes over timeout_s."""
    def text(b) -> str:
        if b is None:
            return ""
        return b.decode(errors="replace") if isinstance(b, bytes) else b
    try:
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=directory,
                           capture_output=True, text=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`npm ci` in {directory} took over {timeout_s} s\n"
                    f"stdout:\n{text(e.stdout)}\nstderr:\n{text(e.stderr)}", pytrace=False)
    if r.returncode != 0:
        pytest.fail(f"`npm ci` in {directory} exited {r.returncode}\n"
                    f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}", pytrace=False)
