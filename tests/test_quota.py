"""disk_mb: each sandbox's writable layer is bounded by its disk_mb. Writes past
it fail inside that sandbox only (ENOSPC with the xfs and ext4 mechanisms, the
ones `auto` prefers, EDQUOT with btrfs, ENOSPC with tmpfs:
docs/container-backend.md), the sandbox keeps working, deleting frees room, and
teardown leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest

import dsec
from conftest import Server, _check_prerequisites, unavailable
from helpers import expect_error, loop_devices_backed_by, mounts_containing, unique, wait_until

MiB = 1 << 20
# What a writer over the limit is told, by mechanism.
ERRNO_TEXT = {"xfs": "No space left on device", "ext4": "No space left on device",
              "btrfs": "Disk quota exceeded", "tmpfs": "No space left on device"}


def xfs_quota_unavailable_reason() -> str:
    """Why this host cannot have the xfs mechanism (as src/edge/xfs_quota.cc
    checks before trying), empty if it may."""
    try:
        fss = Path("/proc/filesystems").read_text().split()
    except OSError as e:
        return f"cannot read /proc/filesystems: {e}"
    if "xfs" not in fss:
        return "the kernel has no xfs"
    if Path("/proc/fs/xfs").is_dir() and not Path("/proc/fs/xfs/xqmstat").exists():
        return ("the kernel's xfs has no quota support (built without CONFIG_XFS_QUOTA: "
                "no /proc/fs/xfs/xqmstat)")
    if not any(Path(d, "mkfs.xfs").exists() for d in ("/usr/sbin", "/sbin", "/usr/bin")):
        return "mkfs.xfs not installed (xfsprogs)"
    return ""


def ext4_unavailable_reason() -> str:
    """Why this host cannot have the ext4 mechanism (as src/edge/ext4_quota.cc
    checks), empty if it may."""
    try:
        fss = Path("/proc/filesystems").read_text().split()
    except OSError as e:
        return f"cannot read /proc/filesystems: {e}"
    if "ext4" not in fss:
        return "the kernel has no ext4"
    if not os.access("/dev/loop-control", os.W_OK):
        return "no loop devices (/dev/loop-control)"
    if not any(Path(d, "mkfs.ext4").exists() for d in ("/usr/sbin", "/sbin", "/usr/bin")):
        return "mkfs.ext4 not installed (e2fsprogs)"
    return ""


def mechanism_of(server: Server) -> str:
    """The disk quota mechanism the server chose (from its start-up line)."""
    with open(server.log_path, "rb") as f:
        head = f.read(1 << 20).decode("utf-8", "replace")
    m = re.search(r"disk quota by (\w+)", head)
    assert m, f"no 'disk quota by' in the server log:\n{server.log_tail()}"
    kind = m.group(1)
    if kind not in ERRNO_TEXT:
        unavailable(f"the server enforces no disk quota here ({kind}): see its log")
    return kind


@pytest.fixture(scope="module")
def mechanism(server) -> str:
    return mechanism_of(server)


def fill(sb, path: str, mb: int):
    """dd of `mb` MiB of zeros to `path` inside the sandbox; the ExecResult."""
    return sb.exec(f"dd if=/dev/zero of={path} bs=1M count={mb} && sync", timeout=60)


def file_size(sb, path: str) -> int:
    r = sb.exec(f"wc -c < {path}")
    assert r.ok, r.stderr
    return int(r.stdout)


def check_quota_behaviour(client, image, make, kind):
    small = make(image, disk_mb=32)
    other = make(image, disk_mb=64)

    r = fill(small, "/big", 64)
    assert r.exit_code != 0, f"64 MiB fit in disk_mb=32: {r!r}"
    assert ERRNO_TEXT[kind] in r.stderr, r.stderr
    size = file_size(small, "/big")
    assert 24 * MiB < size <= 32 * MiB, size

    # The full sandbox still runs, reads, lists, and refuses more bytes.
    assert small.exec("echo alive").stdout == "alive\n"
    assert small.read_file("/etc/passwd").startswith(b"root:")
    assert any(e.name == "big" for e in small.list_dir("/"))
    e = expect_error(lambda: small.write_file("/more.bin", b"x" * (4 * MiB)),
                     dsec.ResourceExhausted, status=429)
    assert ERRNO_TEXT[kind].lower() in str(e).lower(), e

    # Other sandboxes are not charged for it.
    r = fill(other, "/f", 48)
    assert r.ok, r.stderr
    assert file_size(other, "/f") == 48 * MiB

    # pack_diff reads the full upper dir; a sandbox made from the diff does not
    # count the diff (a lower layer) against its own disk_mb.
    snap = unique("quota")
    img = small.pack_diff(snap, "1")
    restored = make(None, snapshot=f"{snap}:1", disk_mb=16)
    assert file_size(restored, "/big") == size
    try:
        # Deleting frees the room: writes work again, through exec and files.
        assert small.exec("rm -f /big /more.bin").ok
        assert small.exec("test -e /big").exit_code == 1
        r = fill(small, "/again", 24)
        assert r.ok, r.stderr
        small.write_file("/more.bin", b"y" * (4 * MiB))
        assert file_size(small, "/more.bin") == 4 * MiB
    finally:
        restored.destroy()
        client.delete_image(f"{snap}:1")
    return small, other, img


def sandbox_dir(server: Server, sandbox_id: str) -> Path:
    return server.data_dir / "edge" / "sandboxes" / sandbox_id


def test_writes_past_disk_mb_fail_in_that_sandbox_only(server, client, busybox, make_sandbox,
                                                       mechanism):
    small, other, _ = check_quota_behaviour(client, busybox, make_sandbox, mechanism)
    # Teardown removes the sandbox's directory (subvolume, tmpfs) off the request path.
    # ext4 and tmpfs disks are detached where the kernel allows: no directory,
    # nothing mounted anywhere for them (docs/container-backend.md, Mounts).
    d = sandbox_dir(server, small.id)
    assert d.is_dir() or (mechanism in ("ext4", "tmpfs") and not mounts_containing(small.id)), d
    small.destroy()
    assert wait_until(lambda: not d.exists(), 10), f"{d} left after destroy"
    assert other.exec("echo ok").stdout == "ok\n"


def test_smallest_disk_mb_still_runs(make_sandbox, busybox, mechanism):
    sb = make_sandbox(busybox, disk_mb=16)
    assert sb.exec("echo tiny > /t && cat /t").stdout == "tiny\n"
    r = fill(sb, "/big", 32)
    assert r.exit_code != 0 and ERRNO_TEXT[mechanism] in r.stderr, r.stderr


def test_auto_prefers_an_enospc_mechanism(mechanism):
    """auto: xfs where the kernel has XFS quotas, else ext4 (both ENOSPC)."""
    why = xfs_quota_unavailable_reason()
    if not why:
        assert mechanism == "xfs", "auto should pick xfs where the kernel has XFS quotas"
        return
    print(f"xfs unavailable here ({why}); auto chose {mechanism}")
    why4 = ext4_unavailable_reason()
    if not why4:
        assert mechanism == "ext4", "auto should pick ext4 where xfs quotas are missing"
    else:
        print(f"ext4 unavailable here ({why4})")
        assert mechanism not in ("xfs", "ext4")


def test_xfs_gives_enospc(tmp_path_factory, server):
    """`dsec up --disk-quota xfs`: a write past disk_mb fails with ENOSPC."""
    why = xfs_quota_unavailable_reason()
    if why:
        print(f"SKIP reason: {why}")
        unavailable(f"xfs project quotas: {why}")
    _check_prerequisites()
    s = Server(tmp_path_factory.mktemp("xfsq") / "data",
               extra_args=["--disk-quota", "xfs", "--disk-pool-mb", "1024"])
    s.data_dir.mkdir()
    s.start()
    made = []
    try:
        assert mechanism_of(s) == "xfs"
        s.import_image("busybox:latest", Path(os.environ.get(
            "DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar")

        def make(image, **kw):
            sb = s.client.create(image, **kw)
            made.append(sb)
            return sb

        small, _, _ = check_quota_behaviour(s.client, "busybox:latest", make, "xfs")
        # df inside shows the project's limit, not the pool.
        r = small.exec("df -k / | tail -1")
        assert r.ok and int(r.stdout.split()[1]) <= 32 * 1024, r.stdout
        d = sandbox_dir(s, small.id)
        small.destroy()
        assert wait_until(lambda: not d.exists(), 10), f"{d} left after destroy"
    finally:
        for sb in made:
            with contextlib.suppress(dsec.DsecError):
                sb.destroy()
    assert s.stop() == 0
    assert not mounts_containing(str(s.data_dir))
    assert not loop_devices_backed_by(str(s.data_dir))


def test_unavailable_xfs_is_refused_with_its_reason(tmp_path_factory, server):
    """Where xfs project quotas cannot work, `--disk-quota xfs` fails at start
    saying why, and leaves nothing mounted."""
    why = xfs_quota_unavailable_reason()
    if not why:
        pytest.skip("xfs project quotas work here (test_xfs_gives_enospc covers them)")
    s = Server(tmp_path_factory.mktemp("noxfs") / "data", extra_args=["--disk-quota", "xfs"])
    s.data_dir.mkdir()
    with pytest.raises(RuntimeError):
        s.start()
    log = s.log_tail()
    assert "xfs" in log and ("quota" in log or "xfs" in why), log
    assert not mounts_containing(str(s.data_dir))
    assert not loop_devices_backed_by(str(s.data_dir))


@pytest.fixture
def tmpfs_server(tmp_path_factory, server):
    """A private `dsec up --disk-quota tmpfs` (the fallback mechanism)."""
    _check_prerequisites()
    s = Server(tmp_path_factory.mktemp("tmpfsq") / "data", extra_args=["--disk-quota", "tmpfs"])
    s.data_dir.mkdir()
    s.start()
    s.import_image("busybox:latest", Path(os.environ.get(
        "DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar")
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_tmpfs_fallback_gives_enospc(tmpfs_server):
    s = tmpfs_server
    assert mechanism_of(s) == "tmpfs"
    made = []

    def make(image, **kw):
        sb = s.client.create(image, **kw)
        made.append(sb)
        return sb

    try:
        small, _, _ = check_quota_behaviour(s.client, "busybox:latest", make, "tmpfs")
        d = sandbox_dir(s, small.id)
        small.destroy()
        assert wait_until(lambda: not d.exists(), 10), f"{d} left after destroy"
    finally:
        for sb in made:
            with contextlib.suppress(dsec.DsecError):
                sb.destroy()
    assert s.stop() == 0
    assert not mounts_containing(str(s.data_dir))
    assert not loop_devices_backed_by(str(s.data_dir))


@pytest.fixture
def ext4_server(tmp_path_factory, server):
    """A private `dsec up --disk-quota ext4`."""
    why = ext4_unavailable_reason()
    if why:
        print(f"SKIP reason: {why}")
        unavailable(f"ext4 per-sandbox images: {why}")
    _check_prerequisites()
    s = Server(tmp_path_factory.mktemp("ext4q") / "data", extra_args=["--disk-quota", "ext4"])
    s.data_dir.mkdir()
    s.start()
    s.import_image("busybox:latest", Path(os.environ.get(
        "DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar")
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_ext4_gives_enospc_and_leaves_nothing(ext4_server):
    """`dsec up --disk-quota ext4`: a filesystem of disk_mb per sandbox, so a
    write past it fails with ENOSPC in that sandbox only; its agent, the files
    API, pack_diff and the other sandboxes carry on; destroy and stop leave no
    mount, loop device or image."""
    s = ext4_server
    assert mechanism_of(s) == "ext4"
    disks = s.data_dir / "edge" / "sandbox-disks"
    made = []

    def make(image, **kw):
        sb = s.client.create(image, **kw)
        made.append(sb)
        return sb

    try:
        small, other, _ = check_quota_behaviour(s.client, "busybox:latest", make, "ext4")
        # Each sandbox has a filesystem of its own, of its disk_mb: df inside
        # shows it, and a loop device backs it.
        r = small.exec("df -k / | tail -1")
        assert r.ok and 16 * 1024 < int(r.stdout.split()[1]) <= 32 * 1024, r.stdout
        r = other.exec("df -k / | tail -1")
        assert r.ok and 32 * 1024 < int(r.stdout.split()[1]) <= 64 * 1024, r.stdout
        for sb in (small, other):
            assert loop_devices_backed_by(str(disks / f"{sb.id}.img")), sb.id
        # A full sandbox's own processes still write their logs elsewhere:
        # the agent answers, and a new exec's output is whole.
        assert small.exec("dd if=/dev/zero of=/fill bs=1M count=64 2>/dev/null; seq 1 2000 | tail -1"
                          ).stdout == "2000\n"
        small.exec("rm -f /fill")
        d = sandbox_dir(s, small.id)
        img = disks / f"{small.id}.img"
        small.destroy()
        assert wait_until(lambda: not d.exists() and not img.exists(), 10), \
            f"{d} or {img} left after destroy"
        assert wait_until(lambda: not loop_devices_backed_by(str(img)), 10), \
            loop_devices_backed_by(str(img))
        assert not mounts_containing(small.id)
        assert other.exec("echo ok").stdout == "ok\n"
    finally:
        for sb in made:
            with contextlib.suppress(dsec.DsecError):
                sb.destroy()
    assert s.stop() == 0
    assert not mounts_containing(str(s.data_dir)), mounts_containing(str(s.data_dir))
    assert wait_until(lambda: not loop_devices_backed_by(str(s.data_dir)), 10), \
        loop_devices_backed_by(str(s.data_dir))
    assert not disks.exists() or not any(disks.iterdir()), list(disks.iterdir())


def test_ext4_gives_freed_blocks_back_to_the_host(ext4_server):
    """The sandbox's ext4 is mounted with online discard: a deleted file's
    blocks leave the sparse image on the host at once, not at destroy."""
    s = ext4_server
    sb = s.client.create("busybox:latest", disk_mb=128)
    try:
        img = s.data_dir / "edge" / "sandbox-disks" / f"{sb.id}.img"

        def allocated_mb():
            return img.stat().st_blocks * 512 / (1 << 20)

        base = allocated_mb()
        assert sb.exec("dd if=/dev/urandom of=/big bs=1M count=40 2>/dev/null && sync").ok
        assert allocated_mb() >= base + 35, (base, allocated_mb())
        assert sb.exec("rm /big && sync").ok
        assert wait_until(lambda: allocated_mb() <= base + 5, 10), (base, allocated_mb())
    finally:
        sb.destroy()


def test_ext4_survives_a_burst_of_concurrent_creates_and_destroys(ext4_server):
    """16 clients creating and destroying at once: every create gets a loop
    device (no 429 `no free loop device` from threads racing for the same
    one), and teardown keeps up: the disks are released within seconds."""
    import threading
    s = ext4_server
    disks = s.data_dir / "edge" / "sandbox-disks"
    errors = []

    def churn():
        c = dsec.Client.from_data_dir(str(s.data_dir), timeout=60)
        for _ in range(6):
            try:
                sb = c.create("busybox:latest", disk_mb=32)
                sb.destroy()
            except dsec.DsecError as e:
                errors.append(e)

    threads = [threading.Thread(target=churn) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    # What is left is the spares: two per size, a few sizes, once the
    # destroyed sandboxes' filesystems kept as spares (recycled) have been
    # idle for 10 s.
    assert wait_until(lambda: len(loop_devices_backed_by(str(disks))) <= 6, 40), \
        loop_devices_backed_by(str(disks))
    assert wait_until(lambda: len([p for p in disks.iterdir() if p.name.startswith("sb-")]) == 0,
                      20), list(disks.iterdir())


def test_ext4_recycled_filesystem_keeps_nothing_of_its_sandbox(ext4_server):
    """A destroyed sandbox that wrote little gives its filesystem back as a
    spare (emptied); the sandboxes that get it see none of its files and the
    whole disk_mb free."""
    s = ext4_server
    disks = s.data_dir / "edge" / "sandbox-disks"
    sb = s.client.create("busybox:latest", disk_mb=40)
    assert sb.exec("mkdir -p /root/d && echo secret > /root/d/s && "
                   "dd if=/dev/urandom of=/root/blob bs=1M count=4 && chmod 000 /root/d").ok
    loop = [line.split(":")[0] for line in loop_devices_backed_by(str(disks))
            if f"{sb.id}.img" in line]
    assert len(loop) == 1, loop_devices_backed_by(str(disks))
    sb.destroy()
    # Kept as a spare of its size: same loop device, now behind a spare's image.
    assert wait_until(lambda: any(line.startswith(loop[0] + ":") and "/spare-" in line
                                  for line in loop_devices_backed_by(str(disks))), 20), \
        loop_devices_backed_by(str(disks))
    reused = False
    sbs = [s.client.create("busybox:latest", disk_mb=40) for _ in range(3)]
    try:
        for n in sbs:
            r = n.exec("ls -a /root; df -k / | tail -1")
            assert r.ok and "secret" not in r.stdout and "blob" not in r.stdout and \
                "d\n" not in r.stdout, r.stdout
            used_kb = int(r.stdout.strip().splitlines()[-1].split()[2])
            assert used_kb < 1024, r.stdout  # not A's 4 MiB
            reused |= any(line.startswith(loop[0] + ":") and f"{n.id}.img" in line
                          for line in loop_devices_backed_by(str(disks)))
        assert reused, "the destroyed sandbox's filesystem was not reused"
    finally:
        for n in sbs:
            n.destroy()


def test_ext4_sizes_without_a_spare_are_formatted_on_demand(ext4_server):
    """A disk_mb no spare was made for is formatted at create (slower, once),
    and exact too."""
    s = ext4_server
    sizes = (16, 48, 100)
    sbs = [s.client.create("busybox:latest", disk_mb=mb) for mb in sizes]
    try:
        for mb, sb in zip(sizes, sbs):
            r = sb.exec("df -k / | tail -1")
            assert r.ok and (mb - 8) * 1024 < int(r.stdout.split()[1]) <= mb * 1024, (mb, r.stdout)
            r = fill(sb, "/big", mb + 8)
            assert r.exit_code != 0 and "No space left on device" in r.stderr, r.stderr
    finally:
        for sb in sbs:
            sb.destroy()
