"""User namespaces (issues 4 and 31): root inside a sandbox is root only
within a user namespace whose ids map to an unprivileged host range of its
own, disjoint from every other sandbox's, so what it writes and what it runs
as belong to that range's `base` and up, and an escape lands in ids no other
sandbox owns.

Skips, with the edge's reason, when the node runs sandboxes without user
namespaces (`dsec up --userns off`, or a kernel that cannot)."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import time

import pytest

import dsec
from conftest import IMAGE_CACHE, Server, _check_prerequisites
from helpers import aether_pids, edge_cgroup, expect_error, unique, wait_until


@pytest.fixture(scope="module")
def userns(server) -> dict:
    status, _, _, node = server.raw("GET", "/v1/node")
    assert status == 200, node
    u = node["userns"]
    if not u["enabled"]:
        pytest.skip(f"sandboxes run without user namespaces here: {u['reason']}")
    return u


def sandbox_range(sb) -> tuple:
    """(base, length) of the sandbox's mapping, as its own /proc shows it."""
    r = sb.exec("cat /proc/self/uid_map /proc/self/gid_map")
    assert r.exit_code == 0, r.stderr
    uid, gid = (l.split() for l in r.stdout.splitlines())
    assert uid == gid and uid[0] == "0", r.stdout
    return int(uid[1]), int(uid[2])


def pid1(server, sb) -> int:
    """The host pid of the sandbox's PID 1 (its aether, in its own range)."""
    base, _ = sandbox_range(sb)
    for pid in aether_pids(edge_cgroup(server.data_dir)):
        try:
            with open(f"/proc/{pid}/uid_map") as f:
                mapped = f.read().split()
            with open(f"/proc/{pid}/status") as f:
                nspid = next(l for l in f if l.startswith("NSpid:")).split()
        except (OSError, StopIteration):
            continue
        if int(mapped[1]) == base and nspid[-1] == "1":
            return pid
    raise AssertionError(f"no PID 1 of {sb.id} (range base {base}) on the host")


def _upper(server, sb) -> str:
    """The sandbox's upper dir as the host sees it: <data>/edge/sandboxes/<id>/upper,
    or, where its disk is a detached mount its PID 1 holds (docs/container-backend.md,
    Mounts), /proc/<PID 1>/fd/10/upper."""
    legacy = os.path.join(str(server.data_dir), "edge", "sandboxes", sb.id, "upper")
    if os.path.isdir(legacy):
        return legacy
    upper = f"/proc/{pid1(server, sb)}/fd/10/upper"
    assert os.path.isdir(upper), upper
    return upper


def _root(server, sb) -> str:
    """The sandbox's root as the host sees it (its overlay, writable by host
    root): where files are planted behind the sandbox's back."""
    return f"/proc/{pid1(server, sb)}/root"


def test_node_reports_the_ranges(userns):
    assert userns["length"] >= 65536 and userns["length"] % 65536 == 0, userns
    w, r = userns["window"], userns["ranges"]
    assert 0 < w["first"] < w["last"] < 2**32 - 1, userns
    assert 0 < r["capacity"] <= (w["last"] - w["first"] + 1) // userns["length"], userns
    assert r["in_use"] >= r["sandboxes"] + r["spares"] and r["free"] == r["capacity"] - r["in_use"]
    assert userns["reason"].startswith("on"), userns


def test_each_sandbox_maps_a_range_of_its_own(bb, make_sandbox, busybox, userns):
    others = [make_sandbox(busybox) for _ in range(2)]
    ranges = [sandbox_range(sb) for sb in [bb, *others]]
    w = userns["window"]
    for base, length in ranges:
        assert length == userns["length"]
        assert w["first"] <= base and base + length - 1 <= w["last"], (ranges, w)
    bases = sorted(b for b, _ in ranges)
    assert all(b2 - b1 >= userns["length"] for b1, b2 in zip(bases, bases[1:])), ranges
    assert bb.exec("id -u; id -g").stdout == "0\n0\n"


def test_sandbox_processes_run_as_their_own_range(bb, server, userns):
    # The sandbox's PID 1 (dsec-aether) runs as host uid `base` of its own
    # range, not as host root; every process of it stays in the range.
    base, length = sandbox_range(bb)
    pid = pid1(server, bb)
    with open(f"/proc/{pid}/status") as f:
        ids = {l.split(":")[0]: [int(x) for x in l.split()[1:]]
               for l in f if l.startswith(("Uid:", "Gid:"))}
    assert ids["Uid"] == [base] * 4 and ids["Gid"] == [base] * 4, ids


def test_files_written_inside_belong_to_the_sandboxs_range(bb, server, userns):
    r = bb.exec("echo x > /userns-root.txt && echo y > /userns-1000.txt && "
                "chown 1000:1001 /userns-1000.txt && stat -c '%u:%g' /userns-root.txt")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "0:0\n"
    base, _ = sandbox_range(bb)
    upper = _upper(server, bb)
    st = os.stat(os.path.join(upper, "userns-root.txt"))
    assert (st.st_uid, st.st_gid) == (base, base)
    st = os.stat(os.path.join(upper, "userns-1000.txt"))
    assert (st.st_uid, st.st_gid) == (base + 1000, base + 1001)
    # The sandbox's directory is its own, closed to every other host user.
    sb = os.stat(os.path.dirname(upper))
    assert sb.st_uid == base and sb.st_mode & 0o077 == 0, oct(sb.st_mode)


def _open_as(uid: int, path: str) -> int:
    """0 when a process running as host uid `uid` (as an escaped sandbox root
    would) can open `path` for reading, else the errno."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.close(os.open(path, os.O_RDONLY))
            os._exit(0)
        except OSError as e:
            os._exit(e.errno or 1)
        except BaseException:
            os._exit(255)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_one_sandbox_cannot_read_anothers_files(make_sandbox, busybox, server, userns):
    a, b = make_sandbox(busybox), make_sandbox(busybox)
    assert a.exec("echo a-secret > /secret && chmod 600 /secret").exit_code == 0
    (base_a, _), (base_b, _) = sandbox_range(a), sandbox_range(b)
    assert base_a != base_b
    upper_a = _upper(server, a)
    st = os.stat(os.path.join(upper_a, "secret"))
    assert (st.st_uid, st.st_mode & 0o777) == (base_a, 0o600)
    # Were A's file in B's tree (planted behind their backs), root in B sees
    # an unmapped owner and cannot read it: no DAC override over A's ids.
    planted = os.path.join(_root(server, b), "planted")
    with open(os.path.join(upper_a, "secret"), "rb") as src, open(planted, "wb") as dst:
        dst.write(src.read())
    os.chown(planted, base_a, base_a)
    os.chmod(planted, 0o600)
    try:
        r = b.exec("stat -c '%u:%g %a' /planted; cat /planted; echo rc=$?")
        assert r.stdout.splitlines()[0] == "65534:65534 600", r.stdout
        assert "a-secret" not in r.stdout and "rc=0" not in r.stdout, r.stdout
    finally:
        os.unlink(planted)
    # And a process that got out of B as its root (host uid base_b) cannot
    # read A's files, while A's own root could: the ranges are what separate
    # them (a shared range would let it in).
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        copy = os.path.join(d, "secret")
        with open(copy, "w") as f:
            f.write("a-secret\n")
        os.chown(copy, base_a, base_a)
        os.chmod(copy, 0o600)
        assert _open_as(base_b, copy) == 13  # EACCES
        assert _open_as(base_a, copy) == 0


def test_a_snapshot_keeps_owners_across_ranges(make_sandbox, busybox, server, userns):
    # pack_diff maps the sandbox's host ids back to 0-based ones, and a
    # sandbox restored from it (while the source lives: another range) maps
    # them into its own.
    src = make_sandbox(busybox)
    assert src.exec("mkdir -p /own && echo r > /own/root && echo u > /own/u && "
                    "chown 1000:1001 /own/u && echo n > /own/n && chown 65535:65534 /own/n").ok
    snap = unique("snap")
    src.pack_diff(snap, "1")
    dst = make_sandbox(None, snapshot=f"{snap}:1")
    (base_s, _), (base_d, _) = sandbox_range(src), sandbox_range(dst)
    assert base_s != base_d
    r = dst.exec("stat -c '%n %u:%g' /own/root /own/u /own/n")
    assert r.stdout.splitlines() == ["/own/root 0:0", "/own/u 1000:1001", "/own/n 65535:65534"], \
        r.stdout
    # On the host, the restored files (a lower layer now) show through its
    # own range.
    root = f"/proc/{pid1(server, dst)}/root"
    st = os.stat(os.path.join(root, "own/u"))
    assert (st.st_uid, st.st_gid) == (base_d + 1000, base_d + 1001)


def test_chown_past_the_mapping_fails_as_documented(bb, userns):
    # Ids 0..length-1 are the sandbox's; one past is no id of its namespace:
    # chown says EINVAL (docs/security.md, "Ids outside the mapping").
    top = userns["length"] - 1
    r = bb.exec(f"touch /hi && chown {top}:{top} /hi && stat -c '%u:%g' /hi")
    assert r.stdout == f"{top}:{top}\n", (r.stdout, r.stderr)
    r = bb.exec(f"chown {top + 1} /hi")
    assert r.exit_code != 0 and "Invalid argument" in r.stderr, (r.stdout, r.stderr)


def test_root_inside_cannot_read_a_host_root_file(bb, server, userns):
    # Were a host-root-only file reachable (here: put into the sandbox's upper
    # dir behind its back), root inside still could not read it: its
    # CAP_DAC_OVERRIDE holds only over ids its namespace maps.
    path = os.path.join(_root(server, bb), "host-root-secret.txt")
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
    # setresuid inside moves only between ids of the sandbox's own range.
    base, length = sandbox_range(deb)
    r = deb.exec(["sh", "-c", "id -u; cat /proc/self/uid_map"], user="nobody")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "65534"
    assert lines[1].split() == ["0", str(base), str(length)]


def _own_server(tmp_path_factory, *args) -> Server:
    _check_prerequisites()
    s = Server(tmp_path_factory.mktemp("userns") / "data", list(args))
    s.data_dir.mkdir()
    s.start()
    return s


def _node_ranges(s: Server) -> dict:
    status, _, _, node = s.raw("GET", "/v1/node")
    assert status == 200, node
    return node["userns"]["ranges"]


def test_ranges_run_out_and_come_back_on_destroy(tmp_path_factory, userns):
    # A window of 6 ranges: sandboxes and spare agents share them (a create
    # turns a spare into a sandbox), so 6 sandboxes fit and the 7th is
    # refused with 429 naming the ranges; a destroy gives one back.
    first = 1_700_000_000  # far from the session server's (the default window's low end)
    s = _own_server(tmp_path_factory, "--userns-window", f"{first}-{first + 6 * 65536 - 1}")
    try:
        s.import_image("busybox:latest", IMAGE_CACHE / "busybox.tar")
        assert _node_ranges(s)["capacity"] == 6
        held = [s.client.create("busybox:latest", disk_mb=16) for _ in range(6)]
        bases = {sandbox_range(sb)[0] for sb in held}
        assert len(bases) == 6 and all(first <= b < first + 6 * 65536 for b in bases), bases
        e = expect_error(lambda: s.client.create("busybox:latest", disk_mb=16),
                         dsec.ResourceExhausted, status=429)
        assert "id ranges" in str(e), e
        r = _node_ranges(s)
        assert (r["in_use"], r["free"], r["sandboxes"]) == (6, 0, 6), r
        gone = sandbox_range(held[0])[0]
        held[0].destroy()
        # Back once its PID 1 is reaped and its disk removed; then a spare
        # takes it, and the next create gets it.
        def create():
            try:
                return s.client.create("busybox:latest", disk_mb=16)
            except dsec.ResourceExhausted:
                return None
        again = wait_until(create, 30, interval=0.2)
        assert again is not None, _node_ranges(s)
        assert sandbox_range(again)[0] == gone
        for sb in held[1:] + [again]:
            sb.destroy()
        assert wait_until(lambda: _node_ranges(s)["sandboxes"] == 0, 30), _node_ranges(s)
    finally:
        s.stop()


def _owned_tar(members) -> bytes:
    """A tar (PAX, as made on another system) of files owned by the given ids."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, uid in members:
            data = f"{name}\n".encode()
            info = tarfile.TarInfo(name)
            info.size, info.uid, info.gid, info.mode = len(data), uid, uid, 0o644
            info.uname = info.gname = ""
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_high_ids_in_archives(tmp_path_factory, deb, userns):
    # Default width: an archive's owner of 65000 is kept, 197609 (Git for
    # Windows' tar) fails as documented and tar says so. A node run with
    # --userns-width 262144 keeps both, through a snapshot too.
    tar = _owned_tar([("a/low", 65000), ("a/win", 197609)])
    deb.write_file("/tmp/owned.tar", tar)
    r = deb.exec("mkdir -p /x && cd /x && tar --same-owner -xpf /tmp/owned.tar; echo rc=$?; "
                 "stat -c '%n %u' a/low a/win")
    assert "rc=0" not in r.stdout and "Cannot change ownership" in r.stderr, (r.stdout, r.stderr)
    assert "a/low 65000" in r.stdout and "a/win 0" in r.stdout, r.stdout

    s = _own_server(tmp_path_factory, "--userns-width", "262144")
    try:
        status, _, _, node = s.raw("GET", "/v1/node")
        assert node["userns"]["length"] == 262144, node["userns"]
        s.import_image("debian:latest", IMAGE_CACHE / "debian.tar")
        sb = s.client.create("debian:latest", disk_mb=256)
        assert sandbox_range(sb)[1] == 262144
        sb.write_file("/tmp/owned.tar", tar)
        r = sb.exec("mkdir -p /x && cd /x && tar --same-owner -xpf /tmp/owned.tar && "
                    "stat -c '%n %u:%g' a/low a/win && chown 262143 a/low && stat -c %u a/low")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.splitlines() == ["a/low 65000:65000", "a/win 197609:197609", "262143"], \
            r.stdout
        snap = unique("wide")
        sb.pack_diff(snap)
        restored = s.client.create(snapshot=f"{snap}:latest", disk_mb=256)
        assert sandbox_range(restored)[0] != sandbox_range(sb)[0]
        assert restored.exec("stat -c %u /x/a/win").stdout == "197609\n"
        restored.destroy()
        sb.destroy()
    finally:
        s.stop()


def test_a_neighbours_pipes_do_not_shrink_mine(make_sandbox, debian, userns):
    # The kernel counts pipe buffers per host uid: past
    # fs.pipe-user-pages-soft, every new pipe of that uid gets the minimum. With
    # a range per sandbox a neighbour's pipes count against its uid, not ours
    # (docs/security.md, "Root inside = an unprivileged host uid of its own").
    with open("/proc/sys/fs/pipe-user-pages-soft") as f:
        soft = int(f.read())
    if soft == 0:
        pytest.skip("fs.pipe-user-pages-soft is 0 here: pipes are not limited per user")
    n = soft // 16 + 64  # pipes of 16 pages (64 KiB) each, past the limit
    size = """import fcntl, os
r, w = os.pipe()
print(fcntl.fcntl(w, 1032))  # F_GETPIPE_SZ
"""
    hog, other = make_sandbox(debian), make_sandbox(debian)
    # Held in the background while we look.
    hog.write_file("/hog.py", f"""import fcntl, os, resource, time
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
pipes = [os.pipe() for _ in range({n})]
r, w = os.pipe()
open("/hog.out", "w").write(str(fcntl.fcntl(w, 1032)))
time.sleep(300)
""")
    assert hog.exec("nohup python3 /hog.py >/dev/null 2>&1 </dev/null &").exit_code == 0
    assert wait_until(lambda: hog.exec("cat /hog.out").stdout.strip(), 60), "the hog did not start"
    # Past the limit the kernel gives a new pipe its minimum (2 pages here).
    assert int(hog.exec("cat /hog.out").stdout) < 65536, "the hog was not limited"
    r = other.exec(["python3", "-c", size])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "65536", r.stdout


def test_exec_as_an_unmapped_user_says_why(bb, userns):
    # setgid would fail with a bare EINVAL: the agent names the id, the field
    # and the mapping instead.
    length = sandbox_range(bb)[1]
    e = expect_error(lambda: bb.exec("id", user=str(length)), dsec.InvalidArgument,
                     field="user", status=400)
    assert f"uid {length} is outside this sandbox's id mapping (0-{length - 1})" in str(e), e
    assert bb.exec("id -u", user=str(length - 1)).stdout == f"{length - 1}\n"
