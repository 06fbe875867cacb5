"""Abuse suite, reach: what a sandboxed agent may try against the agent, the
platform, the host and its neighbours."""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
import uuid

import pytest


def test_cannot_take_or_talk_to_the_agent_channel(deb):
    # The agent's socket is fd 3 of PID 1; it has no path, and a root process
    # in the sandbox may not pull it out of PID 1 (pidfd_getfd needs ptrace
    # rights over a process holding more capabilities).
    r = deb.exec(["python3", "-c", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pfd = libc.syscall(434, 1, 0)
fd = libc.syscall(438, pfd, 3, 0)
print("getfd", fd, ctypes.get_errno())
try:
    os.open("/proc/1/fd/3", os.O_RDWR); print("open", 0)
except OSError as e:
    print("open", e.errno)
print("ptrace", libc.syscall(101, 16, 1, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
"""], timeout=30)
    assert r.exit_code == 0, r.stderr
    lines = dict(l.split(" ", 1) for l in r.stdout.splitlines())
    assert lines["getfd"].split()[0] == "-1", lines
    assert lines["open"] != "0", lines
    assert lines["ptrace"].split()[0] == "-1", lines
    assert deb.exec("echo agent fine").stdout == "agent fine\n"


def test_cannot_take_pid1s_disk_handle(deb):
    # PID 1 keeps a read-only clone of the sandbox's own disk at fd 10 for a
    # restarted edge (docs/container-backend.md, Mounts): like fd 3, no
    # process of the sandbox may pull it out, open it through /proc, or list
    # what it reaches.
    r = deb.exec(["python3", "-c", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pfd = libc.syscall(434, 1, 0)
fd = libc.syscall(438, pfd, 10, 0)
print("getfd", fd, ctypes.get_errno())
for how in (os.O_RDONLY | os.O_DIRECTORY, os.O_PATH):
    try:
        os.open("/proc/1/fd/10", how); print("open ok")
    except OSError as e:
        print("open refused", e.errno)
try:
    print("list ok", len(os.listdir("/proc/1/fd/10/")))
except OSError as e:
    print("list refused", e.errno)
"""], timeout=30)
    assert r.exit_code == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].split()[1] == "-1", out
    assert not [l for l in out if " ok" in l], out
    assert deb.exec("echo agent fine").stdout == "agent fine\n"


def test_host_logs_are_invisible(bb):
    marker = f"/var/log/dsec-host-secret-{uuid.uuid4().hex}"
    with open(marker, "w") as f:
        f.write("host secret\n")
    try:
        r = bb.exec(f"cat {marker}; grep -r 'host secret' /var/log /tmp /root 2>/dev/null; true")
        assert "host secret" not in r.stdout
    finally:
        os.unlink(marker)


def test_platform_and_host_services_are_unreachable(deb, server):
    # A service on the host's loopback, and the platform API itself.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    host_port = srv.getsockname()[1]
    api_port = urllib.parse.urlsplit(server.url).port
    accepted = []
    srv.settimeout(0.2)

    def accept():
        for _ in range(30):
            try:
                accepted.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept)
    t.start()
    r = deb.exec(["python3", "-c", f"""
import socket
for port in ({host_port}, {api_port}):
    for host in ("127.0.0.1", "10.0.2.2", "172.17.0.1", "169.254.169.254"):
        s = socket.socket(); s.settimeout(1)
        try:
            s.connect((host, port)); print("CONNECTED", host, port)
        except OSError as e:
            print("refused", host, port, e.errno)
        s.close()
"""], timeout=60)
    t.join()
    srv.close()
    assert r.exit_code == 0, r.stderr
    assert "CONNECTED" not in r.stdout, r.stdout
    assert not accepted


def test_port_scan_finds_nothing_but_its_own_loopback(deb):
    r = deb.exec(["python3", "-c", """
import socket
open_ports = []
for port in list(range(1, 1024)) + [2375, 5432, 6443, 7070, 8080, 10250]:
    s = socket.socket(); s.settimeout(0.05)
    if s.connect_ex(("127.0.0.1", port)) == 0: open_ports.append(port)
    s.close()
print(open_ports)
"""], timeout=120)
    assert r.stdout.strip() == "[]", r.stdout


def test_recursive_scan_of_proc_and_sys_is_harmless(deb, module_sandboxes, busybox):
    # What crashed a kernel in the field: reading every file under /proc and /sys.
    r = deb.exec(["sh", "-c", "timeout 15 find /proc /sys -xdev -type f -size -1M "
                  "-exec cat {} + >/dev/null 2>&1; echo done"], timeout=40)
    assert "done" in r.stdout
    assert deb.exec("echo still here").stdout == "still here\n"
    assert module_sandboxes(busybox).exec("echo neighbour ok").stdout == "neighbour ok\n"


def test_cannot_escalate_from_an_unprivileged_user(deb):
    r = deb.exec(["python3", "-c", """
import os
for f in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: open("/etc/shadow").read()):
    try:
        f(); print("ESCALATED")
    except OSError as e:
        print("denied", e.errno)
"""], user="nobody", timeout=30)
    assert r.exit_code == 0, r.stderr
    assert "ESCALATED" not in r.stdout
