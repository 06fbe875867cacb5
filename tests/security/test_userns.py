"""User namespaces (issue 4): root inside a sandbox is root only within a user
namespace whose ids map to the node's unprivileged host range, so what it
writes and what it runs as belong to host uid `base` and up.

Skips, with the edge's reason, when the node runs sandboxes without user
namespaces (`dsec up --userns off`, or a kernel that cannot)."""

from __future__ import annotations

import os

import pytest

from helpers import aether_pids, edge_cgroup


@pytest.fixture(scope="module")
def userns(server) -> dict:
    status, _, _, node = server.raw("GET", "/v1/node")
    assert status == 200, node
    u = node["userns"]
    if not u["enabled"]:
        pytest.skip(f"sandboxes run without user namespaces here: {u['reason']}")
    return u


def _upper(server, sb) -> str:
    """The sandbox's upper dir as the host sees it: <data>/edge/sandboxes/<id>/upper,
    or, where its disk is a detached mount held by the edge (docs/container-backend.md,
    Mounts), /proc/<edge pid>/fd/N/upper: the edge's fd whose upper dir holds a
    marker the sandbox just wrote."""
    legacy = os.path.join(str(server.data_dir), "edge", "sandboxes", sb.id, "upper")
    if os.path.isdir(legacy):
        return legacy
    marker = f".upper-marker-{os.getpid()}-{sb.id}"
    assert sb.exec(f"touch /{marker}").exit_code == 0
    try:
        fds = f"/proc/{server.pid}/fd"
        for fd in os.listdir(fds):
            upper = os.path.join(fds, fd, "upper")
            if os.path.exists(os.path.join(upper, marker)):
                return upper
    finally:
        sb.exec(f"rm -f /{marker}")
    raise AssertionError(f"no upper dir of {sb.id} on the host")


def test_node_reports_the_mapping(userns):
    assert userns["base"] > 0 and userns["length"] >= 65536, userns
    assert userns["reason"].startswith("on"), userns


def test_id_maps_inside_are_the_node_range(bb, userns):
    r = bb.exec("id -u; id -g; cat /proc/self/uid_map /proc/self/gid_map")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:2] == ["0", "0"], r.stdout
    want = ["0", str(userns["base"]), str(userns["length"])]
    assert [l.split() for l in lines[2:]] == [want, want], r.stdout


def test_sandbox_processes_are_the_base_uid_on_the_host(bb, server, userns):
    # The sandboxes' PID 1s (dsec-aether, in this edge's cgroups) run as host
    # uid `base`, not as host root. (A child between fork and exec also shows
    # as dsec-aether, as whichever user it is becoming: still in the range.)
    bb.exec("true")
    base, length = userns["base"], userns["length"]
    seen = {}
    for pid in aether_pids(edge_cgroup(server.data_dir)):
        try:
            with open(f"/proc/{pid}/status") as f:
                ids = {l.split(":")[0]: [int(x) for x in l.split()[1:]]
                       for l in f if l.startswith(("Uid:", "Gid:"))}
        except OSError:
            continue  # gone meanwhile
        seen[pid] = ids
        for v in ids["Uid"] + ids["Gid"]:
            assert base <= v < base + length, (pid, ids)
    assert any(ids["Uid"] == [base] * 4 and ids["Gid"] == [base] * 4 for ids in seen.values()), seen


def test_files_written_inside_belong_to_the_host_range(bb, server, userns):
    r = bb.exec("echo x > /userns-root.txt && echo y > /userns-1000.txt && "
                "chown 1000:1001 /userns-1000.txt && stat -c '%u:%g' /userns-root.txt")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "0:0\n"
    base = userns["base"]
    upper = _upper(server, bb)
    st = os.stat(os.path.join(upper, "userns-root.txt"))
    assert (st.st_uid, st.st_gid) == (base, base)
    st = os.stat(os.path.join(upper, "userns-1000.txt"))
    assert (st.st_uid, st.st_gid) == (base + 1000, base + 1001)
    # The sandbox's directory is its own, closed to every other host user.
    sb = os.stat(os.path.dirname(upper))
    assert sb.st_uid == base and sb.st_mode & 0o077 == 0, oct(sb.st_mode)


def test_root_inside_cannot_read_a_host_root_file(bb, server, userns):
    # Were a host-root-only file reachable (here: put into the sandbox's upper
    # dir behind its back), root inside still could not read it: its
    # CAP_DAC_OVERRIDE holds only over ids its namespace maps.
    path = os.path.join(_upper(server, bb), "host-root-secret.txt")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"host secret\n")
        os.close(fd)
        os.chown(path, 0, 0)
        r = bb.exec("stat -c '%u %a' /host-root-secret.txt; cat /host-root-secret.txt; echo rc=$?")
        assert "host secret" not in r.stdout, r.stdout
        assert r.stdout.splitlines()[0] == "65534 600", r.stdout  # unmapped owner
        assert "rc=0" not in r.stdout, r.stdout
    finally:
        os.unlink(path)


def test_no_nested_user_namespace_or_mount(deb, userns):
    # CAP_SYS_ADMIN in its own user namespace would let root mount and build
    # nested namespaces; the seccomp profile refuses both, so the overlay root
    # the edge handed over (whose flags are not locked) cannot be remounted.
    r = deb.exec(["python3", "-c", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("unshare", libc.unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
print("mount", libc.mount(None, b"/", None, 0x20 | 0x2000000, None), ctypes.get_errno())  # MS_REMOUNT|MS_BIND
print("tmpfs", libc.mount(b"t", b"/mnt", b"tmpfs", 0, None), ctypes.get_errno())
"""], timeout=30)
    assert r.exit_code == 0, r.stderr
    for line in r.stdout.splitlines():
        name, rc, _ = line.split()
        assert rc == "-1", r.stdout


def test_exec_as_another_user_stays_in_the_range(deb, userns):
    # setresuid inside moves only between ids of the node's range.
    r = deb.exec(["sh", "-c", "id -u; cat /proc/self/uid_map"], user="nobody")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "65534"
    assert lines[1].split() == ["0", str(userns["base"]), str(userns["length"])]
