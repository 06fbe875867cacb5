"""pack_diff: a running sandbox's changes become a diff layer; sandboxes made
from it see exactly those changes; diffs chain."""

from __future__ import annotations

import dsec
from helpers import expect_error, unique


def test_pack_diff_restores_writes_edits_deletes_and_renames(client, busybox, make_sandbox):
    sb = make_sandbox(busybox)
    setup = " && ".join([
        "mkdir -p /work/sub /work/gone-dir",
        "echo new > /work/sub/new.txt",
        "echo data > /work/gone-dir/x",
        "printf 'binary\\000' > /work/bin.dat",
        "chmod 0600 /work/bin.dat",
        "echo edited >> /etc/passwd",          # a lower file, modified
        "rm /etc/group",                        # a lower file, deleted
        "mv /work/sub/new.txt /work/renamed.txt",
        "rm -r /work/gone-dir",
        "ln -s /work/renamed.txt /work/link",
        "chown 123:456 /work/renamed.txt",
    ])
    r = sb.exec(setup)
    assert r.ok, r.stderr
    snap = unique("snap")
    img = sb.pack_diff(snap, "1")
    assert img.kind == "diff" and len(img.layers) == 1
    assert img.parent["image"] == busybox
    # the source keeps running, unfrozen
    assert sb.exec("echo still here").stdout == "still here\n"

    restored = make_sandbox(None, snapshot=f"{snap}:1")
    assert restored.info["layers"] == client.image(busybox).layers + img.layers
    sh = lambda c: restored.exec(c)  # noqa: E731
    assert sh("cat /work/renamed.txt").stdout == "new\n"
    assert sh("test -e /work/sub/new.txt").exit_code == 1
    assert sh("test -e /work/gone-dir").exit_code == 1
    assert sh("test -e /etc/group").exit_code == 1, "deletion of a lower file lost"
    assert sh("tail -n1 /etc/passwd").stdout == "edited\n"
    assert restored.read_file("/work/bin.dat") == b"binary\0"
    st = restored.stat("/work/bin.dat")
    assert st["mode"] == 0o600
    st = restored.stat("/work/renamed.txt")
    assert (st["uid"], st["gid"]) == (123, 456)
    assert sh("readlink /work/link").stdout == "/work/renamed.txt\n"

    # diffs chain: change the restored sandbox and pack again
    assert restored.exec("echo second > /work/second.txt && rm /work/renamed.txt").ok
    snap2 = unique("snap")
    img2 = restored.pack_diff(snap2)
    assert img2.layers[:1] == img.layers and len(img2.layers) == 2
    third = make_sandbox(None, snapshot=f"{snap2}:latest")
    assert third.exec("cat /work/second.txt").stdout == "second\n"
    assert third.exec("test -e /work/renamed.txt").exit_code == 1
    assert third.exec("tail -n1 /etc/passwd").stdout == "edited\n"


def test_pack_diff_errors(client, busybox, make_sandbox):
    sb = make_sandbox(busybox)
    e = expect_error(lambda: sb.pack_diff(""), dsec.InvalidArgument, status=400)
    assert e.field == "name"
    e = expect_error(lambda: client.create(snapshot=busybox), dsec.InvalidArgument, status=400)
    assert e.field == "snapshot"
    expect_error(lambda: client.create(snapshot=unique("nope") + ":1"), dsec.NotFound)
    e = expect_error(lambda: client.create(), dsec.InvalidArgument, status=400)
    assert e.field == "image"
