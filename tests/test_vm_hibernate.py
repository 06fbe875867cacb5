"""Pause to disk (issue 8 item 6, docs/microvm.md "Pause to disk"): a VM
sandbox's whole state (RAM and devices) saved to a file on its node, its QEMU
gone while paused, and restored exactly on resume: background processes,
RAM-only (tmpfs) files and the agent connection survive, and so does the
egress of a microvm with a NIC (its restored QEMU's new netns is plumbed
again). Also across an edge crash, on destroy, and when a save or a restore
fails; containers get a clear refusal. The vm backend's: test_vm_pause_to_disk.py.

Real QEMU (TCG where the host has no usable KVM): generous timeouts, no
timing assertions (the times are printed). Skips with the reason printed when
QEMU or the guest kernel is missing."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

import dsec
from conftest import Server
from helpers import (edge_cgroup, expect_error, pause_to_disk, proc_rss_kb, qemu_pids,
                     require_backend, require_qemu, resume_from_disk, sandbox_cgroup_dirs,
                     start_vm_server, vm_dirs, wait_until)
from outside_host import ADDR, GREETING, OTHER_ADDR, OutsideHost

BUSYBOX_TAR = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar"
CALL_S = 900  # per call: a TCG boot, save or restore on a loaded host is slow

# A background process and a counter in tmpfs, both started by a call that
# has ended (so they are the guest's own, as a user's server would be).
START_BG = ("sleep 100000 >/dev/null 2>&1 </dev/null & echo $! > /root/bg; "
            "(n=0; while :; do n=$((n+1)); echo $n > /dev/shm/n; sleep 0.2; done) "
            ">/dev/null 2>&1 </dev/null & cat /root/bg")


def _vm_qemu(s: Server, sid: str) -> set:
    """QEMU processes of sandbox `sid` (their cwd is its VM directory)."""
    found = set()
    for pid in qemu_pids(s.data_dir, "microvm"):
        try:
            if os.readlink(f"/proc/{pid}/cwd").endswith("/" + sid):
                found.add(pid)
        except OSError:
            pass
    return found


def _vm_dir(s: Server, sid: str) -> Path:
    return s.data_dir / "edge" / "microvm" / sid


def _counter(sb) -> int:
    return int(sb.exec("cat /dev/shm/n").stdout.strip() or 0)


def _crash(s: Server):
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    s._log.close()
    (s.data_dir / "up.json").unlink()


def _leaves_nothing(s: Server, sid: str):
    assert wait_until(lambda: not _vm_qemu(s, sid), 30), _vm_qemu(s, sid)
    assert wait_until(lambda: sid not in vm_dirs(s.data_dir, "microvm"), 30)
    assert wait_until(lambda: sid not in {os.path.basename(p) for p in
                                          sandbox_cgroup_dirs(edge_cgroup(s.data_dir))}, 30)
    assert not (s.data_dir / "edge" / "state" / f"{sid}.json").exists()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    require_qemu()
    s = Server(tmp_path_factory.mktemp("hibernate") / "data")
    s.data_dir.mkdir()
    start_vm_server(s, CALL_S)
    require_backend(s, "microvm")
    s.import_image("busybox:latest", BUSYBOX_TAR)
    yield s
    if s.proc.poll() is None:
        assert s.stop() == 0, s.log_tail()
    assert not qemu_pids(s.data_dir, "microvm")
    assert not vm_dirs(s.data_dir, "microvm")


def _microvm(s: Server):
    return s.client.create("busybox:latest", backend="microvm", cpu=1, memory_mb=128,
                           disk_mb=64)


def test_containers_cannot_pause_to_disk(srv):
    sb = srv.client.create("busybox:latest")
    try:
        status, _, _, doc = srv.raw("POST", f"/v1/sandboxes/{sb.id}/pause", {"memory": "disk"})
        assert status == 409, doc
        assert doc["error"]["code"] == "failed_precondition" and \
            doc["error"]["field"] == "memory", doc
        assert "microvm" in doc["error"]["message"], doc
        e = expect_error(lambda: sb.pause(memory="disk"), dsec.Conflict, field="memory",
                         status=409)
        assert "container" in str(e)
        # left as it was
        assert srv.client.get(sb.id).state == "running"
        assert sb.exec("echo ok").stdout == "ok\n"
        for body, field in (({"memory": "swap"}, "memory"), ({"memory": 1}, "memory"),
                            ({"mem": "disk"}, "mem")):
            status, _, _, doc = srv.raw("POST", f"/v1/sandboxes/{sb.id}/pause", body)
            assert status == 400 and doc["error"]["field"] == field, (body, doc)
        assert srv.client.get(sb.id).state == "running"
        # a RAM pause with an explicit body still works
        status, _, _, doc = srv.raw("POST", f"/v1/sandboxes/{sb.id}/pause", {"memory": "ram"})
        assert status == 200 and doc["state"] == "paused" and doc["pause_memory"] == "ram", doc
        sb.resume()
        assert sb.info["pause_memory"] is None
    finally:
        sb.destroy()


def test_microvm_pause_to_disk_frees_qemu_and_resumes_exactly(srv):
    s = srv
    sb = _microvm(s)
    try:
        bg = sb.exec(START_BG).stdout.strip()
        assert bg.isdigit(), bg
        secret = os.urandom(8).hex()
        sb.exec(f"echo {secret} > /dev/shm/ram.txt; echo on-disk > /root/disk.txt")
        assert wait_until(lambda: _counter(sb) > 2, 60)
        qemu = _vm_qemu(s, sb.id)
        assert len(qemu) == 1, qemu
        (pid,) = qemu
        rss_kb = proc_rss_kb(pid)

        save_s = pause_to_disk(s.client, sb)
        # its QEMU is gone, memory and all; the state is a file
        assert not os.path.exists(f"/proc/{pid}")
        assert not _vm_qemu(s, sb.id)
        state = _vm_dir(s, sb.id) / "memory.state"
        size = state.stat().st_size
        assert size > 1 << 20, size
        restore_s = resume_from_disk(sb, state)
        print(f"microvm 128 MiB: QEMU RSS before {rss_kb // 1024} MiB; state {size / 1e6:.1f} MB, "
              f"pause to disk {save_s:.2f} s, resume {restore_s:.2f} s")
        r = sb.exec(f"kill -0 {bg} && echo alive; cat /dev/shm/ram.txt /root/disk.txt")
        assert r.stdout == f"alive\n{secret}\non-disk\n", r.stdout + r.stderr
        # the counter's loop runs on
        n = _counter(sb)
        assert wait_until(lambda: _counter(sb) > n, 60)
        assert len(_vm_qemu(s, sb.id)) == 1

        # a call to a sandbox paused to disk resumes it; files work too
        sb.pause(memory="disk")
        assert not _vm_qemu(s, sb.id)
        sb.write_file("/dev/shm/w.txt", b"written after\n")
        assert sb.read_file("/dev/shm/w.txt") == b"written after\n"
        assert s.client.get(sb.id).state == "running"
        assert sb.exec(f"kill -0 {bg} && cat /dev/shm/ram.txt").stdout == f"{secret}\n"
        # a RAM pause, then to disk from there
        sb.pause()
        sb.pause(memory="disk")
        assert sb.info["pause_memory"] == "disk" and not _vm_qemu(s, sb.id)
        assert sb.exec("cat /root/disk.txt").stdout == "on-disk\n"
    finally:
        sb.destroy()
    _leaves_nothing(s, sb.id)


def test_destroy_while_paused_to_disk_leaves_nothing(srv):
    s = srv
    sb = _microvm(s)
    sb.exec("echo x > /dev/shm/x")
    sb.pause(memory="disk")
    assert (_vm_dir(s, sb.id) / "memory.state").exists()
    sb.destroy()
    assert sb.info["state"] == "stopped"
    _leaves_nothing(s, sb.id)


def test_a_failed_save_leaves_the_vm_running(srv):
    s = srv
    sb = _microvm(s)
    try:
        bg = sb.exec(START_BG).stdout.strip()
        # the edge cannot create its state file: a directory is in the way
        blocker = _vm_dir(s, sb.id) / "memory.state.tmp"
        blocker.mkdir()
        status, _, _, doc = s.raw("POST", f"/v1/sandboxes/{sb.id}/pause", {"memory": "disk"},
                                  timeout=CALL_S)
        assert status >= 500, doc
        assert "keeps running" in doc["error"]["message"], doc
        blocker.rmdir()
        assert s.client.get(sb.id).state == "running"
        assert len(_vm_qemu(s, sb.id)) == 1
        assert sb.exec(f"kill -0 {bg} && echo alive").stdout == "alive\n"
        # and a save afterwards works
        sb.pause(memory="disk")
        assert sb.exec(f"kill -0 {bg} && echo alive").stdout == "alive\n"
    finally:
        sb.destroy()
    _leaves_nothing(s, sb.id)


def test_a_failed_restore_marks_the_sandbox_failed_and_keeps_its_console_log(srv):
    s = srv
    sb = _microvm(s)
    sb.pause(memory="disk")
    state = _vm_dir(s, sb.id) / "memory.state"
    # a state QEMU refuses
    data = state.read_bytes()
    state.write_bytes(data[:4096] + b"\xff" * 4096)
    status, _, _, doc = s.raw("POST", f"/v1/sandboxes/{sb.id}/resume", timeout=CALL_S)
    assert status >= 500, doc
    msg = doc["error"]["message"]
    assert "restore" in msg and "console log: " in msg, msg
    log = Path(msg.split("console log: ")[1].split(")")[0])
    assert log.exists() and log.stat().st_size > 0, log
    again = s.client.get(sb.id)
    assert again.state == "failed" and "restore" in again.info["error"], again.info
    _leaves_nothing(s, sb.id)


def test_edge_crash_while_paused_to_disk_then_resume(srv):
    s = srv
    sb = _microvm(s)
    bg = sb.exec(START_BG).stdout.strip()
    sb.exec("echo kept > /dev/shm/kept")
    sb.pause(memory="disk")
    assert not _vm_qemu(s, sb.id)
    _crash(s)
    start_vm_server(s, CALL_S)
    again = s.client.get(sb.id)
    assert again.state == "paused" and again.info["pause_memory"] == "disk", again.info
    assert (_vm_dir(s, sb.id) / "memory.state").exists()
    again.resume()
    r = again.exec(f"kill -0 {bg} && echo alive; cat /dev/shm/kept; hostname")
    assert r.stdout == f"alive\nkept\n{sb.id}\n", r.stdout + r.stderr
    # and once more, to disk and back, on the new edge
    again.pause(memory="disk")
    assert again.exec("cat /dev/shm/kept").stdout == "kept\n"
    again.destroy()
    _leaves_nothing(s, sb.id)


def _greeting(sb, host, port) -> str:
    """What the outside host's TCP server says to the guest (busybox nc), or
    nc's error."""
    r = sb.exec(f"nc -w 3 {host} {port} </dev/null 2>&1", timeout=60)
    return r.stdout


def _veths(s: Server, sid: str) -> list:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if sid in l and f"dsec {s.egress_tag} " in l]


def test_microvm_with_a_nic_keeps_its_egress_across_pause_to_disk(srv):
    """A microvm created under a policy with egress has a NIC whose traffic
    is QEMU's, in QEMU's netns, behind the edge's veth and filter. Paused to
    disk, that QEMU and netns are gone (the veth with them); the restored
    QEMU's new netns gets a veth again before the guest runs, and the filter
    (on the sandbox's cgroup) still applies: what was allowed is reachable,
    what was refused still is. Also after an edge crash while paused."""
    s = srv
    if s.egress_unavailable:
        pytest.skip(f"this node gives no sandbox egress: {s.egress_unavailable}")
    h = OutsideHost()
    h.start()
    sb = None
    try:
        s.client.create_policy("hib-net", egress=[f"{ADDR}:8080"])
        sb = s.client.create("busybox:latest", backend="microvm", cpu=1, memory_mb=128,
                             disk_mb=64, policy="hib-net")
        hello = GREETING.decode()
        assert hello in _greeting(sb, ADDR, 8080)
        assert len(_veths(s, sb.id)) == 1

        def denied():
            for host, port in ((ADDR, 8081), (OTHER_ADDR, 8080)):
                out = _greeting(sb, host, port)
                assert hello not in out, (host, port, out)

        denied()
        refused = sb.audit()["egress_denied"]
        sb.exec("echo kept > /dev/shm/kept")
        sb.pause(memory="disk")
        assert not _vm_qemu(s, sb.id) and not _veths(s, sb.id)
        sb.resume()
        assert len(_veths(s, sb.id)) == 1
        assert hello in _greeting(sb, ADDR, 8080)
        denied()
        assert sb.audit()["egress_denied"] >= refused + 2
        assert sb.exec("cat /dev/shm/kept").stdout == "kept\n"

        # across an edge crash while paused to disk
        sb.pause(memory="disk")
        _crash(s)
        start_vm_server(s, CALL_S)
        sb = s.client.get(sb.id)
        assert sb.state == "paused" and sb.info["pause_memory"] == "disk", sb.info
        sb.resume()
        assert hello in _greeting(sb, ADDR, 8080)
        denied()
        assert sb.exec("cat /dev/shm/kept").stdout == "kept\n"
    finally:
        if sb is not None:
            s.client.get(sb.id).destroy()
        h.stop()
    _leaves_nothing(s, sb.id)
    assert not _veths(s, sb.id)
