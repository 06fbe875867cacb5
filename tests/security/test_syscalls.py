"""Abuse suite, kernel surface: what an agent in a sandbox may try against the
kernel. Each attempt must fail inside the sandbox, and the sandbox, a
neighbouring sandbox and the host must be unaffected afterwards."""

from __future__ import annotations

import json
import os

import pytest

from helpers import wait_until

PROBE = r"""
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return 0 if r >= 0 else ctypes.get_errno()
buf = ctypes.create_string_buffer(256)
out = {
  "init_module": sc(175, 0, 0, 0),
  "finit_module": sc(313, -1, 0, 0),
  "delete_module": sc(176, ctypes.addressof(buf), 0),
  "kexec_load": sc(246, 0, 0, 0, 0),
  "bpf": sc(321, 0, ctypes.addressof(buf), 64),
  "perf_event_open": sc(298, ctypes.addressof(buf), 0, -1, -1, 0),
  "keyctl": sc(250, 0, 0, 0, 0, 0),
  "add_key": sc(248, 0, 0, 0, 0, 0),
  "userfaultfd": sc(323, 0),
  "io_uring_setup": sc(425, 1, ctypes.addressof(buf)),
  "mount": sc(165, 0, ctypes.addressof(buf), 0, 0, 0),
  "umount2": sc(166, ctypes.addressof(buf), 0),
  "fsopen": sc(430, 0, 0),
  "open_tree": sc(428, -100, 0, 0),
  "unshare_user": sc(272, 0x10000000),
  "unshare_net": sc(272, 0x40000000),
  "setns": sc(308, -1, 0),
  "clone_newuser": sc(56, 0x10000000 | 17, 0, 0, 0, 0),
  "clone3": sc(435, 0, 0),
  "swapon": sc(167, 0, 0),
  "reboot": sc(169, 0, 0, 0, 0),
  "settimeofday": sc(164, ctypes.addressof(buf), 0),
  "clock_settime": sc(227, 0, ctypes.addressof(buf)),
  "syslog": sc(103, 3, ctypes.addressof(buf), 10),
  "iopl": sc(172, 3),
  "ioperm": sc(173, 0x80, 1, 1),
  "acct": sc(163, 0),
  "open_by_handle_at": sc(304, -100, ctypes.addressof(buf), 0),
  "fanotify_init": sc(300, 0, 0),
  "tiocsti": sc(16, 0, 0x5412, ctypes.addressof(buf)),
}
for name, fam, typ in (("raw_socket", socket.AF_INET, socket.SOCK_RAW),
                       ("packet_socket", 17, socket.SOCK_RAW)):
    try:
        socket.socket(fam, typ, 1 if fam == socket.AF_INET else 0).close(); out[name] = 0
    except OSError as e:
        out[name] = e.errno
# The host's block devices: /dev/vda-like (254:0), loop0 (7:0), sda (8:0),
# made in the overlay root and in /dev.
out["mknod_block"] = {}
for i, (ma, mi) in enumerate(((254, 0), (7, 0), (8, 0), (7, 0))):
    p = f"/tmp/blk{i}" if i < 3 else "/dev/blk"
    try:
        os.mknod(p, 0o600 | 0o060000, os.makedev(ma, mi))
        with open(p, "rb") as f:
            f.read(1)
        out["mknod_block"][p] = 0
    except OSError as e:
        out["mknod_block"][p] = e.errno
# What must keep working: threads, subprocesses, ordinary sockets.
import threading, subprocess
t = threading.Thread(target=lambda: None); t.start(); t.join()
out["subprocess"] = subprocess.run(["true"]).returncode
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); s.close()
out["status"] = [l for l in open("/proc/self/status").read().splitlines()
                 if l.startswith(("NoNewPrivs", "Seccomp", "CapEff", "CapBnd"))]
print(json.dumps(out))
"""

# Every one of these must be refused (EPERM, or ENOSYS for clone3, or EACCES/
# EPERM for the device node which the sandbox's /dev cannot serve).
REFUSED = ["init_module", "finit_module", "delete_module", "kexec_load", "bpf",
           "perf_event_open", "keyctl", "add_key", "userfaultfd", "io_uring_setup", "mount",
           "umount2", "fsopen", "open_tree", "unshare_user", "unshare_net", "setns",
           "clone_newuser", "swapon", "reboot", "settimeofday", "clock_settime", "syslog",
           "iopl", "ioperm", "acct", "open_by_handle_at", "fanotify_init", "tiocsti",
           "raw_socket", "packet_socket"]


@pytest.fixture(scope="module")
def probe(deb):
    r = deb.exec(["python3", "-c", PROBE], timeout=60)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", REFUSED)
def test_dangerous_syscall_is_refused(probe, name):
    assert probe[name] == 1, f"{name}: errno {probe[name]} ({os.strerror(probe[name])}), want EPERM"


def test_refused_syscalls_are_counted_per_sandbox(probe, deb, module_sandboxes, busybox, server):
    audit = deb.audit()
    denied = audit["denied_syscalls"]
    for name in ("init_module", "bpf", "mount", "unshare", "keyctl", "perf_event_open",
                 "clone", "ioctl"):
        assert denied.get(name, 0) >= 1, audit
    assert audit["denied_total"] == sum(denied.values())
    # A fresh neighbour has a clean record; a stopped sandbox has none to give.
    nb = module_sandboxes(busybox)
    assert nb.audit()["denied_total"] == 0
    before = deb.audit()["denied_total"]
    deb.exec(["sh", "-c", "mount -t tmpfs x /mnt; true"])
    assert deb.audit()["denied_total"] > before
    from test_contract import conforms
    conforms(server.raw("GET", f"/v1/sandboxes/{nb.id}/audit"), "/v1/sandboxes/{id}/audit", "GET")
    status, _, _, doc = server.raw("GET", "/v1/sandboxes/sb-0000000000000000/audit")
    assert status == 404 and doc["error"]["code"] == "not_found"

    # The same counts reach /v1/metrics without asking each agent: the agent
    # reports them unasked at most every 100 ms. Clean sandboxes are left out.
    total = deb.audit()["denied_total"]

    def metric():
        text = server.raw("GET", "/v1/metrics")[2].decode()
        line = f'dsec_sandbox_syscalls_denied_total{{sandbox="{deb.id}"}} '
        got = [l for l in text.splitlines() if l.startswith(line)]
        assert f'sandbox="{nb.id}"' not in text
        return int(got[0].split()[-1]) if got else None
    assert wait_until(lambda: metric() == total, 3), (metric(), total)


def test_clone3_falls_back_and_ordinary_work_goes_on(probe):
    assert probe["clone3"] == 38  # ENOSYS: libc uses clone, which the filter can read
    assert probe["subprocess"] == 0


def test_no_new_privs_and_seccomp_are_on(probe):
    status = dict(l.split(":\t") for l in probe["status"])
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
    # No CAP_SYS_ADMIN (21), CAP_NET_RAW (13), CAP_SYS_MODULE (16), CAP_SYS_TIME (25),
    # CAP_MKNOD (27).
    bnd = int(status["CapBnd"], 16)
    for cap in (13, 16, 21, 25, 27):
        assert not bnd & (1 << cap), f"capability {cap} left in the bounding set"


def test_block_device_nodes_cannot_be_opened(probe):
    # EPERM (device cgroup), EACCES (nodev mount) or ENXIO; never a read.
    for dev, err in probe["mknod_block"].items():
        assert err in (1, 6, 13), f"{dev}: {err}"


def test_unshare_and_mount_commands_fail_and_the_sandbox_stays_usable(deb, module_sandboxes,
                                                                      busybox):
    for cmd in ("unshare -r true", "unshare -n true", "mount -t tmpfs x /mnt",
                "mount --bind / /mnt", "chroot / true && unshare -U true"):
        r = deb.exec(["sh", "-c", cmd], timeout=30)
        assert r.exit_code != 0, f"{cmd!r} succeeded: {r}"
    assert deb.exec("echo alive").stdout == "alive\n"
    neighbour = module_sandboxes(busybox)
    assert neighbour.exec("echo fine").stdout == "fine\n"
