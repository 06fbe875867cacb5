"""File API: round trips (incl. 20 MiB), list/stat/mkdir/remove, path rules and
escapes (traversal, symlinks) that must stay inside the sandbox."""

from __future__ import annotations

import datetime
import hashlib
import io
import os
import tempfile
import time

import pytest

import dsec
from helpers import expect_error, unique


def sha256_in(sb, path):
    r = sb.exec(["sha256sum", path], timeout=30)
    assert r.ok, r
    return r.stdout.split()[0]


def test_small_binary_round_trip(bb):
    data = bytes(range(256)) + b"\x00\r\n\xff" * 10
    assert bb.write_file("/tmp/small.bin", data)["size"] == len(data)
    assert bb.read_file("/tmp/small.bin") == data
    assert sha256_in(bb, "/tmp/small.bin") == hashlib.sha256(data).hexdigest()


def test_20mib_round_trip(bb):
    data = os.urandom(20 << 20)
    res = bb.write_file("/tmp/big.bin", data)
    assert res["size"] == len(data) and res["path"] == "/tmp/big.bin"
    assert sha256_in(bb, "/tmp/big.bin") == hashlib.sha256(data).hexdigest()
    back = bb.read_file("/tmp/big.bin")
    assert len(back) == len(data) and back == data
    assert bb.stat("/tmp/big.bin").size == len(data)
    bb.remove("/tmp/big.bin")


def test_streamed_upload_and_download(bb):
    data = os.urandom(5 << 20)
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        assert bb.write_file("/tmp/streamed.bin", f)["size"] == len(data)
    # an iterable of chunks (sent with chunked transfer encoding)
    chunks = (data[i:i + 777_777] for i in range(0, len(data), 777_777))
    assert bb.write_file("/tmp/chunked.bin", chunks)["size"] == len(data)
    for p in ("/tmp/streamed.bin", "/tmp/chunked.bin"):
        buf = io.BytesIO()
        assert bb.read_file_to(p, buf) == len(data)
        assert buf.getvalue() == data
        bb.remove(p)


def test_text_empty_and_overwrite(bb):
    bb.write_file("/tmp/t.txt", "héllo\n")
    assert bb.read_file("/tmp/t.txt") == "héllo\n".encode()
    bb.write_file("/tmp/t.txt", b"x" * 1000)
    bb.write_file("/tmp/t.txt", b"short")
    assert bb.read_file("/tmp/t.txt") == b"short"  # truncated, not overlaid
    bb.write_file("/tmp/empty", b"")
    assert bb.read_file("/tmp/empty") == b"" and bb.stat("/tmp/empty").size == 0


def test_write_mode_is_applied(bb):
    bb.write_file("/tmp/secret", b"s", mode=0o600)
    assert bb.stat("/tmp/secret").mode & 0o7777 == 0o600
    assert bb.exec(["stat", "-c", "%a", "/tmp/secret"]).stdout.strip() == "600"
    bb.write_file("/tmp/script.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert bb.exec(["/tmp/script.sh"]).stdout == "ran\n"


def test_files_are_shared_with_exec(bb):
    assert bb.exec("echo from-exec > /tmp/fromexec").ok
    assert bb.read_file("/tmp/fromexec") == b"from-exec\n"
    bb.write_file("/tmp/fromapi", b"from-api")
    assert bb.exec(["cat", "/tmp/fromapi"]).stdout == "from-api"


def _mtime_seconds(v):
    if isinstance(v, (int, float)):
        return float(v)
    return datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()


def test_list_dir_and_stat(bb):
    d = "/tmp/" + unique("ld")
    bb.mkdir(d + "/sub")
    bb.write_file(d + "/a", b"abc", mode=0o640)
    assert bb.exec(f"ln -s a {d}/link").ok
    ents = {e.name: e for e in bb.list_dir(d)}
    assert set(ents) == {"a", "sub", "link"}, ents
    assert ents["a"].type == "file" and ents["a"].size == 3
    assert ents["a"].mode & 0o777 == 0o640
    assert ents["sub"].type == "dir"
    assert ents["link"].type == "symlink"
    for e in ents.values():
        assert {"name", "type", "size", "mode", "mtime", "uid", "gid"} <= set(e.raw), e
    st = bb.stat(d + "/a")
    assert (st.name, st.path, st.type, st.size) == ("a", d + "/a", "file", 3)
    assert abs(_mtime_seconds(st.mtime) - time.time()) < 600, st.mtime
    assert isinstance(st.uid, int) and isinstance(st.gid, int)
    assert bb.stat(d).type == "dir"
    assert bb.stat("/").type == "dir"
    names = {e.name for e in bb.list_dir("/")}
    assert {"bin", "etc", "tmp"} <= names and "." not in names and ".." not in names


def test_mkdir(bb):
    d = "/tmp/" + unique("mk")
    bb.mkdir(d + "/x/y/z")
    assert bb.stat(d + "/x/y/z").type == "dir"
    bb.mkdir(d + "/x/y/z")  # like mkdir -p: existing is fine
    expect_error(lambda: bb.mkdir(d + "/missing/child", parents=False), dsec.NotFound)
    expect_error(lambda: bb.mkdir(d + "/x", parents=False), dsec.Conflict)
    bb.mkdir(d + "/private", parents=False, mode=0o700)
    assert bb.stat(d + "/private").mode & 0o777 == 0o700
    assert bb.exec(["test", "-d", d + "/x/y/z"]).ok


def test_remove(bb):
    d = "/tmp/" + unique("rm")
    bb.mkdir(d + "/sub")
    bb.write_file(d + "/sub/f", b"1")
    bb.write_file(d + "/g", b"2")
    bb.remove(d + "/g")
    expect_error(lambda: bb.stat(d + "/g"), dsec.NotFound)
    e = expect_error(lambda: bb.remove(d), dsec.Conflict, status=409)
    assert e.code == "failed_precondition", repr(e)
    assert bb.stat(d + "/sub/f").size == 1  # nothing was removed
    bb.remove(d, recursive=True)
    expect_error(lambda: bb.stat(d), dsec.NotFound)
    assert bb.exec(["test", "-e", d]).exit_code == 1
    expect_error(lambda: bb.remove(d), dsec.NotFound)


def test_missing_paths_are_not_found(bb):
    expect_error(lambda: bb.read_file("/no/such/file"), dsec.NotFound, status=404)
    expect_error(lambda: bb.stat("/no/such/file"), dsec.NotFound, status=404)
    expect_error(lambda: bb.list_dir("/no/such/dir"), dsec.NotFound, status=404)


@pytest.mark.parametrize("path", ["relative/path", "tmp/x", "", "./x", "/tmp/a\x00b"])
def test_bad_paths_are_invalid_argument(bb, path):
    for call in (lambda: bb.read_file(path), lambda: bb.write_file(path, b"x"),
                 lambda: bb.stat(path), lambda: bb.list_dir(path),
                 lambda: bb.mkdir(path), lambda: bb.remove(path)):
        expect_error(call, dsec.InvalidArgument, field="path", status=400)


def test_reading_a_directory_is_a_clean_error(bb):
    e = expect_error(lambda: bb.read_file("/etc"), dsec.DsecError)
    assert 400 <= e.status < 500, repr(e)


def test_dotdot_stays_inside_the_sandbox(bb):
    name = unique("trav")
    host_file = f"/tmp/{name}"
    with open(host_file, "w") as f:
        f.write("HOST")
    try:
        bb.write_file(f"/tmp/{name}", b"SANDBOX")
        assert bb.read_file(f"/../../../tmp/{name}") == b"SANDBOX"
        assert bb.read_file(f"/tmp/../../../../tmp/{name}") == b"SANDBOX"
        bb.write_file(f"/../../../tmp/{name}", b"SANDBOX2")
        with open(host_file) as f:
            assert f.read() == "HOST"
        assert bb.read_file(f"/tmp/{name}") == b"SANDBOX2"
    finally:
        os.unlink(host_file)


def test_dotdot_etc_hostname_is_the_sandbox_own(deb):
    inside = deb.exec(["cat", "/etc/hostname"])
    assert inside.ok, inside
    assert deb.read_file("/../../../etc/hostname") == inside.stdout_bytes
    assert deb.read_file("/../../../etc/passwd") == deb.exec(["cat", "/etc/passwd"]).stdout_bytes


def test_symlinks_do_not_escape_on_read(bb):
    name = unique("lnk")
    host_file = f"/tmp/{name}"
    with open(host_file, "w") as f:
        f.write("HOST SECRET")
    try:
        assert bb.exec(f"ln -sf {host_file} /tmp/abs-{name} && "
                       f"ln -sf ../../../../../../../tmp/{name} /tmp/rel-{name}").ok
        for link in (f"/tmp/abs-{name}", f"/tmp/rel-{name}"):
            # nothing at the target inside the sandbox yet: not found (or refused)
            e = expect_error(lambda: bb.read_file(link), dsec.DsecError)
            assert 400 <= e.status < 500, repr(e)
        bb.write_file(f"/tmp/{name}", b"SANDBOX")
        for link in (f"/tmp/abs-{name}", f"/tmp/rel-{name}"):
            try:
                data = bb.read_file(link)
            except dsec.DsecError as e:  # refusing symlinks is fine too
                assert 400 <= e.status < 500, repr(e)
                continue
            assert data == b"SANDBOX", f"{link} resolved outside the sandbox: {data!r}"
    finally:
        os.unlink(host_file)


def test_symlinks_do_not_escape_on_write(bb):
    name = unique("wlnk")
    host_target = f"/tmp/{name}"
    etc_target = f"/etc/{name}"
    assert not os.path.exists(host_target)
    try:
        assert bb.exec(f"ln -sf {host_target} /tmp/w-{name} && ln -sfn /etc /tmp/etc-{name}").ok
        for call in (lambda: bb.write_file(f"/tmp/w-{name}", b"pwned"),
                     lambda: bb.write_file(f"/tmp/etc-{name}/{name}", b"pwned"),
                     lambda: bb.mkdir(f"/tmp/etc-{name}/{name}.d")):
            try:
                call()
            except dsec.DsecError:
                pass
        assert not os.path.exists(host_target), "a write through a symlink reached the host"
        assert not os.path.exists(etc_target), "a write through a symlink reached the host"
        assert not os.path.exists(etc_target + ".d")
    finally:
        for p in (host_target, etc_target):
            if os.path.lexists(p):
                os.unlink(p)
        if os.path.isdir(etc_target + ".d"):
            os.rmdir(etc_target + ".d")


def test_remove_does_not_follow_symlinks_out(bb):
    name = unique("rml")
    host_dir = f"/tmp/{name}"
    os.mkdir(host_dir)
    with open(f"{host_dir}/keep", "w") as f:
        f.write("keep")
    try:
        assert bb.exec(f"ln -sfn {host_dir} /tmp/d-{name}").ok
        try:
            bb.remove(f"/tmp/d-{name}/keep")
        except dsec.DsecError:
            pass
        try:
            bb.remove(f"/tmp/d-{name}", recursive=True)
        except dsec.DsecError:
            pass
        assert os.path.exists(f"{host_dir}/keep"), "remove through a symlink deleted a host file"
    finally:
        if os.path.exists(f"{host_dir}/keep"):
            os.unlink(f"{host_dir}/keep")
        os.rmdir(host_dir)


def test_special_files_are_refused_not_streamed(bb):
    assert bb.exec("rm -f /tmp/fifo; mkfifo /tmp/fifo").ok
    for path in ("/dev/zero", "/dev/urandom", "/tmp/fifo"):
        t0 = time.monotonic()
        e = expect_error(lambda: bb.read_file(path, timeout=10), dsec.DsecError)
        assert 400 <= e.status < 500, repr(e)
        assert time.monotonic() - t0 < 5, f"reading {path} took {time.monotonic() - t0:.1f} s"


def test_unicode_and_odd_names(bb):
    for name in ("ünï cødé", "sp ace", "new\nline", "-dash", "x" * 255):
        path = "/tmp/" + name
        bb.write_file(path, name.encode())
        assert bb.read_file(path) == name.encode()
        assert name in {e.name for e in bb.list_dir("/tmp")}
        bb.remove(path)
    e = expect_error(lambda: bb.write_file("/tmp/" + "y" * 256, b"x"), dsec.DsecError)
    assert 400 <= e.status < 500, repr(e)


def test_pseudo_files_are_read_whole(bb):
    """/proc files report size 0 but have content: the file API streams it."""
    data = bb.read_file("/proc/self/status")
    assert b"Name:" in data and len(data) > 100, data[:200]
    assert bb.read_file("/proc/sys/kernel/hostname").strip() == bb.id.encode()
    # an empty regular file is still empty
    bb.write_file("/tmp/empty", b"")
    assert bb.read_file("/tmp/empty") == b""
