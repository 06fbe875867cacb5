"""Platform lifecycle with a `dsec up` of the test's own: stopping while work is
in flight, and restarting on a data dir whose previous run was killed."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import Server, _check_prerequisites
from helpers import (aether_pids, edge_cgroup, loop_devices_backed_by, mounts_containing,
                     sandbox_cgroup_dirs, wait_until)


@pytest.fixture
def own_server(tmp_path_factory, server, sdk):
    """A second, private `dsec up` (the session server keeps running beside
    it); its ``client`` is of the module run's SDK flavor."""
    _check_prerequisites()
    s = Server(tmp_path_factory.mktemp("own") / "data", sdk=sdk)
    s.data_dir.mkdir()
    s.start()
    s.import_image("busybox:latest", Path(os.environ.get(
        "DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar")
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_sigterm_ends_blocked_execs_and_cleans_up(own_server, sdk):
    s = own_server
    sb = s.client.create("busybox:latest")
    errors = []

    def long_exec():
        c = sdk.from_data_dir(str(s.data_dir), timeout=120)
        try:
            c.sandbox(sb.id).exec("sleep 3600", timeout=3600)
        except Exception as e:  # the server goes away under it: any error is fine
            errors.append(e)

    t = threading.Thread(target=long_exec)
    t.start()
    time.sleep(0.5)  # the exec is running
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(30)
    took = time.monotonic() - t0
    t.join(30)
    assert took < 15, f"SIGTERM with an exec in flight took {took:.1f} s"
    assert s.proc.returncode == 0, s.log_tail()
    assert not mounts_containing(str(s.data_dir))
    assert sb.id not in {os.path.basename(p) for p in sandbox_cgroup_dirs()}


def test_restart_after_the_node_lost_its_sandboxes_marks_them_lost_and_removes_leftovers(
        own_server):
    s = own_server
    sb = s.client.create("busybox:latest", disk_mb=32)
    assert sb.exec("echo hi > /f && cat /f").stdout == "hi\n"
    sandboxes = s.data_dir / "edge" / "sandboxes"
    mounts_before = mounts_containing(str(sandboxes))
    edge = edge_cgroup(s.data_dir)
    agents = aether_pids(edge)
    os.kill(s.proc.pid, signal.SIGKILL)  # a crash: nothing is cleaned up
    s.proc.wait(10)
    s._log.close()
    # ... and the sandbox's PID 1 dies too (test_restart.py covers the usual
    # case, where it lives on and is re-adopted); its cgroup stays behind
    for pid in agents:
        os.kill(pid, signal.SIGKILL)
    assert sb.id in {os.path.basename(p) for p in sandbox_cgroup_dirs()}
    (s.data_dir / "up.json").unlink()  # stale: the crashed run could not remove it
    s.start()
    r = s.client.get(sb.id)
    assert r.state == "failed" and "lost" in (r.info.get("error") or ""), r.info
    assert sb.id not in {os.path.basename(p) for p in sandbox_cgroup_dirs()}
    # The crashed run's sandbox pool (a mount, maybe with a loop device) was
    # replaced, not stacked, and its sandbox directory (with the filesystem of
    # its own that the ext4 and tmpfs mechanisms mount there) is gone.
    assert mounts_containing(str(sandboxes)) == [
        m for m in mounts_before if sb.id not in m], s.log_tail()
    assert not (sandboxes / sb.id).exists()
    # and it serves new sandboxes, with their disk quota
    sb2 = s.client.create("busybox:latest", disk_mb=16)
    assert sb2.exec("echo again").stdout == "again\n"
    assert sb2.exec("dd if=/dev/zero of=/big bs=1M count=32").exit_code != 0
    sb2.destroy()
    assert s.stop() == 0
    assert not mounts_containing(str(s.data_dir))
    assert wait_until(lambda: not loop_devices_backed_by(str(s.data_dir)), 5), \
        loop_devices_backed_by(str(s.data_dir))


@pytest.mark.parametrize("quota", ["none", "auto"])
def test_sandboxes_without_user_namespaces_under_a_tmp_data_dir(tmp_path_factory, server, quota):
    """`--userns off` (a node without idmapped mounts runs so): spare agents
    stage /proc, /sys and /dev in a directory of the edge's own, so a data
    dir under /tmp (pytest's is) stays visible to them. Staging on a tmpfs
    over /tmp hid it, and every create failed with ENOENT."""
    _check_prerequisites()
    s = Server(tmp_path_factory.mktemp("nouserns") / "data",
               extra_args=["--userns", "off", "--disk-quota", quota])
    assert str(s.data_dir).startswith("/tmp/"), s.data_dir
    s.data_dir.mkdir()
    s.start()
    try:
        s.import_image("busybox:latest", Path(os.environ.get(
            "DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar")
        status, _, _, node = s.raw("GET", "/v1/node")
        assert status == 200 and not node["userns"]["enabled"], node
        for _ in range(3):  # spares cloned at start and after
            sb = s.client.create("busybox:latest")
            r = sb.exec("id -u; cat /proc/1/comm; ls /dev/null /sys/kernel >/dev/null && echo ok")
            assert r.exit_code == 0 and r.stdout.split() == ["0", "dsec-aether", "ok"], \
                (r.stdout, r.stderr)
            sb.destroy()
    finally:
        s.stop()
    assert not mounts_containing(str(s.data_dir))


def test_stopped_sandboxes_are_kept_up_to_a_count(tmp_path_factory, server, sdk):
    """Issue 30: stopped sandboxes stay listed for an hour, and at most
    `--stopped-retention-max` of them (the longest stopped go first), so a
    trainer's churn does not grow the platform's memory and store by the hour.
    The janitor walks the records every 5 s."""
    _check_prerequisites()
    s = Server(tmp_path_factory.mktemp("retention") / "data", sdk=sdk,
               extra_args=["--stopped-retention-max", "2"])
    s.data_dir.mkdir()
    s.start()
    try:
        s.import_image("busybox:latest", Path(os.environ.get(
            "DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar")
        ids = []
        for _ in range(5):
            sb = s.client.create("busybox:latest", labels={"t": "retention"})
            ids.append(sb.id)
            sb.destroy()
            time.sleep(0.05)  # distinct stop times
        live = s.client.create("busybox:latest", labels={"t": "retention"})

        def listed():
            return {x.id for x in s.client.list(labels={"t": "retention"})}
        deadline = time.monotonic() + 30
        while len(listed()) > 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        # The running one stays, and the two stopped last; the rest are gone
        # from the list and from GET.
        assert listed() == {live.id, ids[3], ids[4]}
        for old in ids[:3]:
            status, _, _, body = s.raw("GET", f"/v1/sandboxes/{old}")
            assert status == 404, body
        live.destroy()
    finally:
        s.stop()
