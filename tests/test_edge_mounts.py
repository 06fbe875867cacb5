"""Issue 30, item 1: the edge's mount namespace, which every new sandbox's
namespace is copied from, holds O(1) mounts per node, not one per live
sandbox. A server holds N sandboxes (DSEC_TEST_MOUNTS_N, default 2,000 as the
issue asks: ~20 s per mechanism here; a host without the memory for them,
~2.5 MB each, skips saying so)
on the ext4 mechanism this host picks (`auto`) and on tmpfs: the edge's mount
count (/proc/<dsec pid>/mountinfo, also GET /v1/node `edge_mounts` and the
`dsec_edge_mounts` gauge) stays where it was with one sandbox, and a sandbox
sees only its own mounts, as many with N live as with one. The edge also
keeps at most two descriptors per live sandbox (its PID 1's pidfd and the
agent connection; the disk is the sandbox's own, DiskQuota::lend): the
host's RLIMIT_NOFILE bounds how many one node holds."""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import Server, _check_prerequisites, unavailable
from helpers import loop_devices_backed_by, wait_until

N = int(os.environ.get("DSEC_TEST_MOUNTS_N", "2000"))
# Host memory a held busybox sandbox may take at most here (kernel included:
# on a host that once held thousands, a memory cgroup alone costs ~0.7 MB).
MB_PER_SANDBOX = 2.5
BUSYBOX_TAR = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar"
# Mounts the edge may gain beside the sandboxes (a layer mounted on first use
# is counted in the baseline already; pack_diff's transient view is not here).
SLACK = 2
# Descriptors per held sandbox the edge may keep, and a few besides (spares,
# the layer cache's loaders, connections of the test's client).
FDS_PER_SANDBOX = 2
FD_SLACK = 64

pytestmark = pytest.mark.slow


def edge_mounts(s: Server) -> int:
    with open(f"/proc/{s.pid}/mountinfo") as f:
        return sum(1 for _ in f)


def edge_fds(s: Server) -> int:
    return len(os.listdir(f"/proc/{s.pid}/fd"))


def own_mounts(s: Server) -> int:
    """The edge's mounts of this server's own (under its data dir): the edge runs
    in the host's namespace, where other programs may mount meanwhile."""
    with open(f"/proc/{s.pid}/mountinfo") as f:
        return sum(1 for line in f if str(s.data_dir) in line)


def node_field(s: Server) -> int:
    status, _, _, node = s.raw("GET", "/v1/node")
    assert status == 200, node
    assert isinstance(node.get("edge_mounts"), int), node
    return node["edge_mounts"]


def gauge(s: Server) -> float:
    status, _, body, _ = s.raw("GET", "/v1/metrics")
    assert status == 200
    m = re.search(r"^dsec_edge_mounts (\S+)$", body.decode(), re.M)
    assert m, "dsec_edge_mounts not in /v1/metrics"
    return float(m.group(1))


def sandbox_mountinfo(sb) -> list:
    r = sb.exec("cat /proc/self/mountinfo")
    assert r.ok, r.stderr
    return r.stdout.splitlines()


@pytest.fixture(params=["auto", "tmpfs"])
def quota_server(request, tmp_path_factory):
    _check_prerequisites()
    if not BUSYBOX_TAR.exists():
        unavailable(f"{BUSYBOX_TAR} missing (make images)")
    with open("/proc/meminfo") as f:
        avail_mb = next(int(l.split()[1]) for l in f if l.startswith("MemAvailable:")) / 1024
    if avail_mb < N * MB_PER_SANDBOX + 1024:
        unavailable(f"{N} sandboxes need ~{N * MB_PER_SANDBOX + 1024:.0f} MB of memory, "
                    f"{avail_mb:.0f} MB available (set DSEC_TEST_MOUNTS_N lower)")
    s = Server(tmp_path_factory.mktemp("mounts") / "data",
               ["--disk-quota", request.param, "--slots", str(N + 50)])
    s.data_dir.mkdir()
    s.start()
    s.import_image("busybox:latest", BUSYBOX_TAR)
    log = s.log_path.read_text(errors="replace")
    if "sandbox disks are mounted in the edge's namespace" in log:
        s.stop()
        line = next(l for l in log.splitlines() if "sandbox disks are mounted" in l)
        print(f"SKIP reason: {line}")
        unavailable(f"this kernel cannot keep sandbox disks detached: {line}")
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_edge_mount_count_does_not_grow_with_live_sandboxes(quota_server):
    s = quota_server
    disk_mb = 16 if "tmpfs" in s.extra_args else 1024
    first = s.client.create("busybox:latest", disk_mb=disk_mb)
    assert first.exec("echo ok").stdout == "ok\n"
    base, own_base, fds_base = edge_mounts(s), own_mounts(s), edge_fds(s)
    assert abs(node_field(s) - base) <= SLACK and abs(gauge(s) - base) <= SLACK
    own_first = sandbox_mountinfo(first)

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        held = list(pool.map(lambda _: s.client.create("busybox:latest", disk_mb=disk_mb),
                             range(N - 1)))
    took = time.monotonic() - t0
    live, own_live, fds_live = edge_mounts(s), own_mounts(s), edge_fds(s)
    print(f"edge mounts: {base} with 1 sandbox, {live} with {N} live; of this server's: "
          f"{own_base}, {own_live} ({s.extra_args[1]}, {N - 1} creates in {took:.1f} s); "
          f"edge fds: {fds_base}, {fds_live} ({(fds_live - fds_base) / (N - 1):.2f} per sandbox)")
    assert fds_live - fds_base <= FDS_PER_SANDBOX * (N - 1) + FD_SLACK, \
        f"{fds_live} fds with {N} live vs {fds_base} with 1"
    assert own_live == own_base, f"{own_live} mounts with {N} live vs {own_base} with 1"
    # Other programs on the host may mount meanwhile, never one per sandbox.
    assert live - base < max(SLACK + 1, N // 4), f"{live} mounts with {N} live vs {base} with 1"
    assert abs(node_field(s) - live) <= SLACK

    # A sandbox sees its own mounts only: as many now as the first had alone,
    # none of another sandbox's, and none mounted on a path of the node's (its
    # overlay's options may name the layers it is made of, as they always did).
    last = held[-1]
    own_last = sandbox_mountinfo(last)
    assert len(own_last) == len(own_first), (own_first, own_last)
    assert len(sandbox_mountinfo(first)) == len(own_first)
    others = {sb.id for sb in held[:-1]} | {first.id}
    text = "\n".join(own_last)
    assert not [i for i in others if i in text], text
    points = [line.split()[4] for line in own_last]
    assert not [p for p in points if str(s.data_dir) in p or "/sandboxes" in p], points
    # ... and the sandboxes still work (their writable layers are theirs).
    last.exec("echo mine > /f")
    assert last.exec("cat /f").stdout == "mine\n"
    assert first.exec("cat /f").exit_code != 0

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda sb: sb.destroy(), held + [first]))
    assert wait_until(lambda: own_mounts(s) <= own_base, 30), own_mounts(s)
    # Only spares keep a loop device once everything is gone (ext4).
    disks = str(s.data_dir)
    assert wait_until(lambda: len(loop_devices_backed_by(disks)) <= 40, 60), \
        loop_devices_backed_by(disks)
