"""Issue 31, item 1: inode numbers in a container sandbox behave as on one
filesystem. readdir's d_ino (os.scandir's inode()) equals stat's st_ino for
every entry of the root filesystem: files only in a lower layer of each kind
(the image's, a workspace's, a toolkit's, and a snapshot's restored from
pack_diff), files the sandbox wrote (upper),
lower files it changed (copied up), directories merged from several layers,
/tmp; and (st_dev, st_ino) names one file only, across layers. Without
overlayfs' xino each layer's own inode numbers leak through readdir
(edge/userns.cc, overlayOf).

Mount points are skipped as on any host: a directory's entry in its parent
is the directory under the mount (/proc, /dev, the masked paths), which stat
does not see."""

from __future__ import annotations

import json

from helpers import unique
from test_layers import import_layer

CHECK = r"""
import json, os, stat, sys
mounts = {l.split()[4] for l in open("/proc/self/mountinfo")} - {"/"}
checked, bad, seen, dups = 0, [], {}, []
def visit(d):
    global checked
    try:
        it = os.scandir(d)
    except OSError:
        return
    with it:
        for e in it:
            try:
                st = os.stat(e.path, follow_symlinks=False)
            except OSError:
                continue
            if e.path in mounts:
                continue  # a mount point: not the root filesystem's
            checked += 1
            if e.inode() != st.st_ino:
                bad.append([e.path, e.inode(), st.st_ino])
            key = (st.st_dev, st.st_ino)
            if (key in seen and seen[key] != e.path and not stat.S_ISDIR(st.st_mode)
                    and st.st_nlink < 2):
                dups.append([e.path, seen[key]])
            seen.setdefault(key, e.path)
            if e.is_dir(follow_symlinks=False):
                visit(e.path)
for top in sys.argv[1:]:
    visit(top)
print(json.dumps({"checked": checked, "bad": bad[:20], "nbad": len(bad),
                  "dups": dups[:20], "devs": len({k[0] for k in seen})}))
"""

# What a sandbox writes before the check: new files and dirs (upper), an edit
# of a lower file (copy-up), a new dir in a merged dir, /tmp.
WRITES = " && ".join([
    "mkdir -p /work/a/b /usr/local/new-dir",
    "echo x > /work/a/b/f",
    "echo y > /tmp/t",
    "echo z >> /etc/debian_version",
    "touch /usr/bin/python3",  # a lower file's metadata: copied up
    "ln /work/a/b/f /work/a/hard",
])
PATHS = ["/etc", "/usr/bin", "/usr/local", "/usr/lib/python3", "/work", "/tmp", "/root", "/"]


def check(sb) -> dict:
    r = sb.exec(["python3", "-c", CHECK, *PATHS], timeout=120)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_readdir_inodes_agree_with_stat(server, tmp_path, make_sandbox, debian):
    # Every kind of layer: the image's (base), a workspace and a toolkit,
    # both also writing into /usr/local and /etc (directories merged across
    # three filesystems), and below, a snapshot's diff layer.
    ws, tk = unique("ws"), unique("tk")
    import_layer(server, tmp_path, f"{ws}:1", "workspace", {
        "work/ws/README": ("task\n", 0o644), "etc/ws.conf": ("w\n", 0o644)})
    import_layer(server, tmp_path, f"{tk}:1", "toolkit", {
        "usr/local/tk/bin/t": ("#!/bin/sh\n", 0o755), "etc/tk.conf": ("t\n", 0o644)})
    sb = make_sandbox(debian, workspaces=[f"{ws}:1"], toolkits=[f"{tk}:1"])
    before = check(sb)
    assert before["checked"] > 1000, before
    assert before["nbad"] == 0, before
    assert sb.exec(WRITES).exit_code == 0
    after = check(sb)
    assert after["nbad"] == 0, after
    assert not after["dups"], after
    assert after["devs"] == 1, after  # one st_dev, as one filesystem
    # ... and in a sandbox restored from its snapshot, where the writes are
    # a lower layer of their own over the image's.
    snap = unique("inodes")
    sb.pack_diff(snap)
    restored = make_sandbox(None, snapshot=f"{snap}:latest")
    assert restored.exec("cat /work/ws/README /etc/tk.conf").stdout == "task\nt\n"
    assert restored.exec("cat /work/a/b/f").stdout == "x\n"
    again = check(restored)
    assert again["nbad"] == 0 and not again["dups"] and again["devs"] == 1, again
    assert restored.exec("echo w > /work/a/b/f && echo v > /work/new").exit_code == 0
    last = check(restored)
    assert last["nbad"] == 0 and not last["dups"], last
