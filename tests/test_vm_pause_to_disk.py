"""Pause to disk of a full VM (backend="vm", docs/vm.md "Lifecycle", and
docs/microvm.md "Pause to disk", whose mechanism it shares): the q35
guest's RAM and devices saved through QEMU's migration stream, its QEMU
gone while paused; resume (or any call) restores it on the same command line
and qcow2 overlay, qemu-guest-agent reconnected. Background processes, tmpfs
files, the guest's clock and its egress (a new netns, plumbed again) carry
over; also across an edge crash; a failed save keeps it running; a failed
restore marks it failed with its console log kept; destroy leaves nothing.

One VM serves the file (a TCG boot of systemd takes tens of seconds), created
without disk_mb (the image's own size) and, where the node gives egress,
under a policy with an allow-list. Real QEMU on TCG here: generous timeouts,
no timing assertions (the times are printed). Skips with the reason printed
when QEMU, qemu-img or the image is missing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import dsec
from conftest import Server, unavailable
from helpers import (edge_cgroup, pause_to_disk, proc_rss_kb, qemu_pids,
                     require_backend, require_qemu, resume_from_disk, sandbox_cgroup_dirs,
                     start_vm_server, vm_dirs, wait_until)
from outside_host import ADDR, GREETING, OTHER_ADDR, OutsideHost

CACHE = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"))
VM_IMAGE = CACHE / "vm-debian.qcow2"
CALL_S = 900  # per call: a TCG boot, save or restore of systemd on a loaded host is slow

# A background process and a counter in tmpfs, both started by a call that
# has ended (so they are the guest's own, as a user's server would be).
START_BG = ("setsid sleep 100000 >/dev/null 2>&1 </dev/null & echo $! > /root/bg; "
            "setsid sh -c 'n=0; while :; do n=$((n+1)); echo $n > /dev/shm/n; sleep 0.2; done' "
            ">/dev/null 2>&1 </dev/null & cat /root/bg")
TCP_PROBE = ('exec 3<>"/dev/tcp/$1/$2" || exit 7; IFS= read -r -t 20 line <&3; '
             'echo "got $line"')


def _background(vm) -> str:
    """The pid of the guest's background process: the one the first test
    started, or (when this test runs alone, e.g. with -k) one started now."""
    bg = vm.exec("p=$(cat /root/bg 2>/dev/null) && kill -0 $p 2>/dev/null && echo $p").stdout.strip()
    if not bg:
        bg = vm.exec(START_BG).stdout.strip()
    assert bg.isdigit(), bg
    return bg


def _vm_qemu(s: Server, sid: str) -> set:
    return {p for p in qemu_pids(s.data_dir, "vm")
            if os.readlink(f"/proc/{p}/cwd").endswith("/" + sid)}


def _vm_dir(s: Server, sid: str) -> Path:
    return s.data_dir / "edge" / "vm" / sid


def _counter(sb) -> int:
    return int(sb.exec("cat /dev/shm/n").stdout.strip() or 0)


def _tcp(sb, host, port):
    r = sb.exec(["timeout", "40", "bash", "-c", TCP_PROBE, "probe", host, str(port)], timeout=90)
    return r.exit_code, r.stdout + r.stderr


def _veths(s: Server, sid: str) -> list:
    import subprocess
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if sid in l and f"dsec {s.egress_tag} " in l]


def _crash(s: Server):
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    s._log.close()
    (s.data_dir / "up.json").unlink()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    require_qemu("qemu-system-x86_64", "qemu-img")
    if not VM_IMAGE.exists():
        unavailable(f"no {VM_IMAGE} (make vm-image, or scripts/build-vm-image.sh)")
    s = Server(tmp_path_factory.mktemp("vmdisk") / "data")
    s.data_dir.mkdir()
    start_vm_server(s, CALL_S)
    require_backend(s, "vm")
    r = s.cli("image", "import", "--data-dir", s.data_dir, "--kind", "disk", "--name",
              "vmdeb:latest", VM_IMAGE, timeout=600)
    assert r.returncode == 0, r.stderr
    yield s
    if s.proc.poll() is None:
        assert s.stop() == 0, s.log_tail()
    assert not qemu_pids(s.data_dir, "vm")
    assert not vm_dirs(s.data_dir, "vm")


@pytest.fixture(scope="module")
def outside(srv):
    """The outside host where the node gives egress (else None)."""
    if srv.egress_unavailable:
        print(f"egress part skipped: this node gives no sandbox egress: {srv.egress_unavailable}")
        yield None
        return
    h = OutsideHost()
    h.start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def vm(srv, outside):
    policy = None
    if outside is not None:
        srv.client.create_policy("vm-disk-net", egress=[f"{ADDR}:8080"], dns=[ADDR])
        policy = "vm-disk-net"
    t0 = time.monotonic()
    # no disk_mb: the image's own size (2 GiB), above the default 1024
    sb = srv.client.create("vmdeb:latest", backend="vm", cpu=1, memory_mb=384, policy=policy)
    print(f"vm create (boot to qemu-guest-agent answering): {time.monotonic() - t0:.1f} s")
    yield sb
    try:
        srv.client.get(sb.id).destroy()
    except dsec.DsecError:
        pass


def test_the_default_disk_is_the_images_size(vm):
    assert int(vm.exec("cat /sys/block/vda/size").stdout) * 512 == 2048 << 20


def test_pause_to_disk_frees_qemu_and_resumes_exactly(srv, vm, outside):
    s = srv
    bg = vm.exec(START_BG).stdout.strip()
    assert bg.isdigit(), bg
    secret = os.urandom(8).hex()
    vm.exec(f"echo {secret} > /dev/shm/ram.txt; echo on-disk > /root/disk.txt; sync")
    assert wait_until(lambda: _counter(vm) > 2, 120)
    if outside is not None:
        assert _tcp(vm, ADDR, 8080) == (0, "got " + GREETING.decode())
        assert len(_veths(s, vm.id)) == 1
    (pid,) = _vm_qemu(s, vm.id)
    rss_kb = proc_rss_kb(pid)

    save_s = pause_to_disk(s.client, vm)
    # its QEMU is gone, memory and all (and its netns with its veth); the
    # state is a file beside the overlay
    assert not os.path.exists(f"/proc/{pid}")
    assert not _vm_qemu(s, vm.id)
    state = _vm_dir(s, vm.id) / "memory.state"
    size = state.stat().st_size
    assert size > 1 << 20, size
    assert (_vm_dir(s, vm.id) / "disk.qcow2").exists()
    if outside is not None:
        assert not _veths(s, vm.id)
    restore_s = resume_from_disk(vm, state)
    print(f"vm 384 MiB: QEMU RSS before {rss_kb // 1024} MiB; state {size / 1e6:.1f} MB, "
          f"pause to disk {save_s:.2f} s, resume {restore_s:.2f} s")
    r = vm.exec(f"kill -0 {bg} && echo alive; cat /dev/shm/ram.txt /root/disk.txt")
    assert r.stdout == f"alive\n{secret}\non-disk\n", r.stdout + r.stderr
    n = _counter(vm)
    assert wait_until(lambda: _counter(vm) > n, 120)
    # the guest's clock was set to the host's (it stood still while saved)
    skew = abs(float(vm.exec("date +%s.%N").stdout) - time.time())
    assert skew < 30, skew
    assert len(_vm_qemu(s, vm.id)) == 1
    if outside is not None:
        # its egress carried over into the new QEMU's netns: allowed still
        # reaches, the rest is still refused
        assert len(_veths(s, vm.id)) == 1
        assert _tcp(vm, ADDR, 8080) == (0, "got " + GREETING.decode())
        for host, port in ((ADDR, 8081), (OTHER_ADDR, 8080)):
            code, out = _tcp(vm, host, port)
            assert code != 0 and "hello" not in out, (host, port, out)

    # a call to a vm paused to disk resumes it; files and the screen too
    vm.pause(memory="disk")
    assert not _vm_qemu(s, vm.id)
    vm.write_file("/dev/shm/w.txt", b"written after\n")
    assert vm.read_file("/dev/shm/w.txt") == b"written after\n"
    assert s.client.get(vm.id).state == "running"
    vm.pause(memory="disk")
    assert vm.screenshot()[:4] == b"\x89PNG"
    assert s.client.get(vm.id).state == "running"
    # a RAM pause, then to disk from there
    vm.pause()
    vm.pause(memory="disk")
    assert vm.info["pause_memory"] == "disk" and not _vm_qemu(s, vm.id)
    assert vm.exec(f"kill -0 {bg} && cat /dev/shm/ram.txt").stdout == f"{secret}\n"


def _failed_save(s: Server, vm):
    """A pause to disk whose state file the edge cannot create (a directory
    is in the way): it fails, saying the VM keeps running."""
    blocker = _vm_dir(s, vm.id) / "memory.state.tmp"
    blocker.mkdir()
    try:
        status, _, _, doc = s.raw("POST", f"/v1/sandboxes/{vm.id}/pause", {"memory": "disk"},
                                  timeout=CALL_S)
    finally:
        blocker.rmdir()
    assert status >= 500 and "keeps running" in doc["error"]["message"], (status, doc)


def test_a_failed_save_leaves_the_vm_running(srv, vm):
    s = srv
    bg = _background(vm)
    _failed_save(s, vm)
    assert s.client.get(vm.id).state == "running"
    assert len(_vm_qemu(s, vm.id)) == 1
    assert vm.exec(f"kill -0 {bg} && echo alive").stdout == "alive\n"
    # a RAM-paused one stays paused after a failed save
    vm.pause()
    _failed_save(s, vm)
    again = s.client.get(vm.id)
    assert again.state == "paused" and again.info["pause_memory"] == "ram", again.info
    vm.resume()
    assert vm.exec(f"kill -0 {bg} && echo alive").stdout == "alive\n"


def test_edge_crash_while_paused_to_disk_then_resume(srv, vm, outside):
    s = srv
    bg = _background(vm)
    vm.exec("echo kept > /dev/shm/kept")
    vm.pause(memory="disk")
    assert not _vm_qemu(s, vm.id)
    _crash(s)
    start_vm_server(s, CALL_S)
    again = s.client.get(vm.id)
    assert again.state == "paused" and again.info["pause_memory"] == "disk", again.info
    assert (_vm_dir(s, vm.id) / "memory.state").exists()
    again.resume()
    r = again.exec(f"kill -0 {bg} && echo alive; cat /dev/shm/kept; hostname")
    assert r.stdout.splitlines()[:2] == ["alive", "kept"], r.stdout + r.stderr
    if outside is not None:
        assert _tcp(again, ADDR, 8080) == (0, "got " + GREETING.decode())
        code, out = _tcp(again, OTHER_ADDR, 8080)
        assert code != 0 and "hello" not in out, out
    # and once more, to disk and back, on the new edge
    again.pause(memory="disk")
    assert again.exec("cat /dev/shm/kept").stdout == "kept\n"


def test_zz_a_failed_restore_marks_the_vm_failed_and_keeps_its_console_log(srv, vm):
    """Runs last: ends the shared VM. Its saved state is damaged; the restore
    fails, the sandbox is failed with the reason, its console log (every
    run's) kept, and nothing else of it is left."""
    s = srv
    vm = s.client.get(vm.id)  # the server was restarted meanwhile (new port, new client)
    vm.pause(memory="disk")
    state = _vm_dir(s, vm.id) / "memory.state"
    data = state.read_bytes()
    state.write_bytes(data[:4096] + b"\xff" * 4096)
    status, _, _, doc = s.raw("POST", f"/v1/sandboxes/{vm.id}/resume", timeout=CALL_S)
    assert status >= 500, doc
    msg = doc["error"]["message"]
    assert "restore" in msg and "console log: " in msg, msg
    log = Path(msg.split("console log: ")[1].split(")")[0])
    assert log.exists() and log.stat().st_size > 0, log
    # the kernel's boot messages of the first run are in it
    assert b"Linux version" in log.read_bytes()
    again = s.client.get(vm.id)
    assert again.state == "failed" and "restore" in again.info["error"], again.info
    assert wait_until(lambda: not _vm_qemu(s, vm.id), 30)
    assert wait_until(lambda: vm.id not in vm_dirs(s.data_dir, "vm"), 30)
    assert wait_until(lambda: vm.id not in {os.path.basename(p) for p in
                                            sandbox_cgroup_dirs(edge_cgroup(s.data_dir))}, 30)
    assert not (s.data_dir / "edge" / "state" / f"{vm.id}.json").exists()
    if not s.egress_unavailable:
        assert not _veths(s, vm.id)


def test_zz_destroy_while_paused_to_disk_leaves_nothing(srv):
    """A second VM (a second boot of the same base: its size comes from the
    node's record of the image) destroyed while paused to disk."""
    s = srv
    sb = s.client.create("vmdeb:latest", backend="vm", cpu=1, memory_mb=256)
    assert int(sb.exec("cat /sys/block/vda/size").stdout) * 512 == 2048 << 20
    sb.exec("echo x > /dev/shm/x")
    sb.pause(memory="disk")
    assert (_vm_dir(s, sb.id) / "memory.state").exists()
    sb.destroy()
    assert sb.info["state"] == "stopped"
    assert wait_until(lambda: not _vm_qemu(s, sb.id), 30)
    assert wait_until(lambda: sb.id not in vm_dirs(s.data_dir, "vm"), 30)
    assert wait_until(lambda: sb.id not in {os.path.basename(p) for p in
                                            sandbox_cgroup_dirs(edge_cgroup(s.data_dir))}, 30)
