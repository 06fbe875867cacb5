"""Isolation and limits: what a sandbox can see and do to the host and to other
sandboxes. Each check has a positive control, so a broken probe cannot pass."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

import dsec
from helpers import unique, wait_until

REPO = Path(__file__).resolve().parent.parent


def test_hostname_is_the_sandbox_id(bb):
    assert bb.exec(["hostname"]).stdout.strip() == bb.id
    assert bb.exec(["cat", "/proc/sys/kernel/hostname"]).stdout.strip() == bb.id
    assert socket.gethostname() != bb.id


def test_pid1_is_dsec_aether(bb):
    r = bb.exec(["cat", "/proc/1/cmdline"], encoding="base64")
    assert r.ok, r
    argv0 = r.stdout_bytes.split(b"\0")[0]
    assert b"dsec-aether" in argv0, r.stdout_bytes


def test_sandboxes_run_at_normal_priority(make_sandbox, busybox):
    # The edge prepares spare sandboxes on a thread at nice 10 (background
    # work yields to requests); the sandbox's processes must not inherit it.
    # Several sandboxes, so that some come from the spares.
    for _ in range(4):
        sb = make_sandbox(busybox)
        r = sb.exec("cut -d' ' -f19 /proc/1/stat /proc/self/stat")
        assert r.exit_code == 0 and r.stdout.split() == ["0", "0"], r


def test_host_processes_are_invisible(bb, server):
    host_pids = [p for p in os.listdir("/proc") if p.isdigit()]
    assert len(host_pids) > 20  # positive control: the host has many
    r = bb.exec("ls /proc")
    inner = [p for p in r.stdout.split() if p.isdigit()]
    assert 1 <= len(inner) <= 10, f"sandbox sees {len(inner)} pids: {inner}"
    ps = bb.exec(["ps", "-o", "pid,args"]).stdout
    assert "pytest" not in ps and "dsec up" not in ps and "--data-dir" not in ps, ps


def test_cannot_signal_host_processes(bb, server):
    r = bb.exec(f"kill -9 {server.pid}", user="root")
    assert r.exit_code != 0
    assert server.proc.poll() is None, "the server died"
    assert server.client.health()["status"] == "ok"


def test_host_files_are_invisible(bb):
    name = unique("hostmark")
    marker = Path("/tmp") / name
    marker.write_text("host")
    try:
        assert marker.exists()  # positive control
        assert bb.exec(["test", "-e", str(marker)]).exit_code == 1
        assert name not in bb.exec(["ls", "-a", "/tmp"]).stdout
        bb.write_file(f"/tmp/{name}-inner", b"x")  # and the probe can see sandbox files
        assert f"{name}-inner" in bb.exec(["ls", "-a", "/tmp"]).stdout
    finally:
        marker.unlink()
    assert (REPO / "CMakeLists.txt").exists()
    assert bb.exec(["test", "-e", str(REPO / "CMakeLists.txt")]).exit_code == 1


def test_no_block_devices(bb):
    r = bb.exec("find /dev -type b 2>/dev/null; true")
    assert r.stdout.strip() == "", f"block devices visible in the sandbox: {r.stdout}"


@pytest.mark.parametrize("knob", ["kernel/pid_max", "vm/overcommit_memory", "kernel/sysrq"])
def test_kernel_settings_are_read_only(bb, knob):
    path = f"/proc/sys/{knob}"
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist on this host")
    with open(path) as f:
        host_value = f.read().strip()
    # writing back the host's own value is harmless even if isolation is broken
    r = bb.exec(f"echo {host_value} > {path}", user="root")
    assert r.exit_code != 0, f"a sandbox could write {path}"


def test_network_only_loopback(deb, server):
    devs = deb.exec(["cat", "/proc/net/dev"]).stdout.splitlines()[2:]
    names = sorted(line.split(":")[0].strip() for line in devs if ":" in line)
    assert names == ["lo"], names
    r = deb.exec(["sh", "-c", "ls /sys/class/net 2>/dev/null || true"])
    assert r.stdout.split() in ([], ["lo"]), r.stdout
    port = int(server.url.rsplit(":", 1)[1])
    probe = f"""
import socket
def try_(host, port):
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((host, port)); return "OPEN"
    except OSError:
        return "BLOCKED"
    finally:
        s.close()
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(try_("127.0.0.1", srv.getsockname()[1]), try_("1.1.1.1", 53),
      try_("127.0.0.1", {port}), try_("8.8.8.8", 443))
"""
    r = deb.exec(["python3", "-c", probe], timeout=20)
    assert r.ok, r
    # own loopback works (control); the internet and the host's API do not
    assert r.stdout.split() == ["OPEN", "BLOCKED", "BLOCKED", "BLOCKED"], r.stdout


def test_sandboxes_cannot_see_each_other(module_sandboxes, busybox, bb):
    other = module_sandboxes(busybox)
    name = unique("secret")
    bb.write_file(f"/tmp/{name}", b"mine")
    assert bb.read_file(f"/tmp/{name}") == b"mine"
    with pytest.raises(dsec.NotFound):
        other.read_file(f"/tmp/{name}")
    assert other.exec(["test", "-e", f"/tmp/{name}"]).exit_code == 1
    # processes: a long exec in `other` is visible there only
    t = threading.Thread(target=other.exec, args=("sleep 2.5",))
    t.start()
    try:
        seen = wait_until(lambda: "sleep 2.5" in other.exec(["ps", "-o", "args"]).stdout, 2)
        assert seen, "control: the sleeping exec should be visible in its own sandbox"
        assert "sleep 2.5" not in bb.exec(["ps", "-o", "args"]).stdout
    finally:
        t.join(10)
    assert other.exec("hostname").stdout.strip() == other.id != bb.id


def test_memory_limit_kills_a_hog_and_sandbox_survives(make_sandbox, debian):
    sb = make_sandbox(debian, memory_mb=128)
    ok = sb.exec(["python3", "-c", "b = bytearray(32 << 20); b[::4096] = b'x' * len(b[::4096]);"
                  "print('fine')"], timeout=30)
    assert ok.stdout == "fine\n", ok  # control: below the limit works
    hog = ("b = bytearray(600 << 20)\n"
           "for i in range(0, len(b), 4096): b[i] = 1\n"
           "print('survived')\n")
    t0 = time.monotonic()
    r = sb.exec(["python3", "-c", hog], timeout=60)
    assert "survived" not in r.stdout, r
    assert r.oom_killed or r.signal == 9, r
    assert time.monotonic() - t0 < 30
    assert sb.exec("echo still-alive").stdout == "still-alive\n"
    sb.refresh()
    assert sb.state == "running"
    assert sb.info.get("stats", {}).get("oom_kills", 0) >= 1, sb.info.get("stats")


def test_fork_bomb_is_contained(make_sandbox, busybox, bb, server):
    sb = make_sandbox(busybox, pids=64)
    result = {}

    def bomb():
        t0 = time.monotonic()
        try:
            result["r"] = sb.exec("f(){ f|f& }; f; sleep 10", timeout=5)
        except dsec.DsecError as e:
            result["err"] = e
        result["wall"] = time.monotonic() - t0

    t = threading.Thread(target=bomb)
    t.start()
    time.sleep(1.5)
    # while it rages: the host's API and another sandbox answer promptly
    t0 = time.monotonic()
    assert server.client.health()["status"] == "ok"
    assert bb.exec("echo other-ok").stdout == "other-ok\n"
    assert time.monotonic() - t0 < 5, "host/other sandbox slowed down by a fork bomb"
    t.join(60)
    assert not t.is_alive(), "the fork-bomb exec never returned"
    assert "err" not in result, result
    assert result["r"].timed_out, result["r"]
    assert result["wall"] < 20, result
    # the bomb's processes are gone, so the sandbox can fork again
    again = wait_until(lambda: _try_echo(sb), 10, 0.5)
    assert again, "the sandbox still cannot run a command 10 s after the fork bomb"
    stats = sb.refresh().info.get("stats", {})
    assert stats.get("pids_limit_hits", 0) > 0, stats


def _try_echo(sb):
    try:
        return sb.exec("echo ok", timeout=5).stdout == "ok\n"
    except dsec.DsecError:
        return False


def test_open_files_are_bounded(deb):
    # Soft 1024, hard at most 65536 whatever the node's own limit, and no way
    # to raise the hard limit (no CAP_SYS_RESOURCE).
    r = deb.exec(["python3", "-c", """
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
print(soft, hard)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard + 1)); print("raised")
except (ValueError, OSError) as e:
    print("refused")
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
fds = []
try:
    while True:
        fds.append(open("/dev/null"))
except OSError as e:
    print("stopped at", len(fds) + 3, e.errno)
"""])
    lines = r.stdout.split("\n")
    soft, hard = map(int, lines[0].split())
    assert soft == min(1024, hard) and hard <= 65536, r.stdout
    assert lines[1] == "refused", r.stdout
    stopped = int(lines[2].split()[2])
    assert hard - 8 <= stopped <= hard and lines[2].endswith(" 24"), r.stdout  # EMFILE
