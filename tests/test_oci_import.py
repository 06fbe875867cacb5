"""Import of OCI image layouts and `docker save` archives built here (no registry
is reachable): one dsec layer per image layer, whiteouts and opaque directories
translated to overlayfs form, owners, modes, xattrs, links and devices kept."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from helpers import unique

CACHE = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"))


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", **kw) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mtime = 1700000000
    for k, v in kw.items():
        setattr(ti, k, v)
    tf.addfile(ti, io.BytesIO(data) if ti.isreg() else None)


def layer_base() -> bytes:
    """The busybox test rootfs plus files the next layer changes."""
    src = CACHE / "busybox.tar"
    if not src.exists():
        pytest.skip(f"{src} missing (scripts/build-test-images.sh)")
    buf = io.BytesIO()
    with tarfile.open(src) as tin, tarfile.open(fileobj=buf, mode="w",
                                                format=tarfile.PAX_FORMAT) as tout:
        for m in tin.getmembers():
            tout.addfile(m, tin.extractfile(m) if m.isreg() else None)
        _add(tout, "data", type=tarfile.DIRTYPE, mode=0o755)
        _add(tout, "data/keep.txt", b"keep\n", mode=0o644)
        _add(tout, "data/gone.txt", b"gone\n", mode=0o644)
        _add(tout, "opq", type=tarfile.DIRTYPE, mode=0o755)
        _add(tout, "opq/old.txt", b"old\n", mode=0o644)
    return buf.getvalue()


def layer_changes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "data/.wh.gone.txt", b"", mode=0o644)
        _add(tf, "opq", type=tarfile.DIRTYPE, mode=0o755)
        _add(tf, "opq/.wh..wh..opq", b"", mode=0o644)
        _add(tf, "opq/new.txt", b"new\n", mode=0o644)
        _add(tf, "owned.txt", b"owned\n", mode=0o640, uid=1234, gid=5678)
        _add(tf, "link", type=tarfile.SYMTYPE, linkname="data/keep.txt")
        _add(tf, "hard1", b"hardlinked\n", mode=0o644)
        _add(tf, "hard2", type=tarfile.LNKTYPE, linkname="hard1")
        _add(tf, "devnode", type=tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
        _add(tf, "xattr.txt", b"x\n", mode=0o644,
             pax_headers={"SCHILY.xattr.user.dsec": "yes"})
    return buf.getvalue()


def sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def build_oci(path: Path, layers: list, config: dict = None) -> None:
    """An OCI layout tar of `layers` (raw tars, bottom first); `config` is the
    image config's runtime "config" object (User, Env, WorkingDir, ...)."""
    blobs = {}
    descs = []
    for i, raw in enumerate(layers):
        data = gzip.compress(raw) if i == 0 else raw  # one compressed, one plain
        blobs[sha(data)] = data
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar" +
                      ("+gzip" if i == 0 else ""), "digest": sha(data), "size": len(data)})
    config = image_config(layers, config)
    blobs[sha(config)] = config
    manifest = json.dumps({"schemaVersion": 2,
                           "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": sha(config), "size": len(config)},
                           "layers": descs}).encode()
    blobs[sha(manifest)] = manifest
    index = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(manifest),
         "size": len(manifest), "platform": {"os": "linux", "architecture": "amd64"}}]}).encode()
    with tarfile.open(path, "w") as tf:
        _add(tf, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}', mode=0o644)
        _add(tf, "index.json", index, mode=0o644)
        for d, data in blobs.items():
            _add(tf, "blobs/sha256/" + d.split(":")[1], data, mode=0o644)


def image_config(layers: list, config: dict = None) -> bytes:
    doc = {"architecture": "amd64", "os": "linux",
           "rootfs": {"type": "layers", "diff_ids": [sha(l) for l in layers]}}
    if config is not None:
        doc["config"] = config
    return json.dumps(doc).encode()


def build_docker_save(path: Path, layers: list, config: dict = None) -> None:
    """A `docker save` tar of `layers`; `config` as for build_oci (None: the
    config file is a bare {})."""
    with tarfile.open(path, "w") as tf:
        names = []
        for i, raw in enumerate(layers):
            name = f"l{i}/layer.tar"
            _add(tf, name, raw, mode=0o644)
            names.append(name)
        _add(tf, "config.json", b"{}" if config is None else image_config(layers, config),
             mode=0o644)
        _add(tf, "manifest.json", json.dumps(
            [{"Config": "config.json", "RepoTags": ["x:latest"], "Layers": names}]).encode(),
            mode=0o644)


@pytest.mark.parametrize("fmt", ["oci", "docker"])
def test_import_keeps_the_tree_file_by_file(server, client, tmp_path, make_sandbox, fmt):
    layers = [layer_base(), layer_changes()]
    archive = tmp_path / f"image-{fmt}.tar"
    (build_oci if fmt == "oci" else build_docker_save)(archive, layers)
    name = unique(f"imp-{fmt}")
    r = server.cli("image", "import", "--data-dir", server.data_dir, "--name", f"{name}:1",
                   archive, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"from {fmt}" in r.stderr and "2 layer(s)" in r.stderr, r.stderr
    img = client.image(f"{name}:1")
    assert len(img.layers) == 2

    sb = make_sandbox(f"{name}:1")
    sh = lambda c: sb.exec(c)  # noqa: E731
    assert sh("cat /data/keep.txt").stdout == "keep\n"
    assert sh("test -e /data/gone.txt").exit_code == 1, "whiteout did not hide the file"
    assert sh("ls /opq").stdout.split() == ["new.txt"], "opaque dir shows lower files"
    st = sb.stat("/owned.txt")
    assert (st["uid"], st["gid"], st["mode"]) == (1234, 5678, 0o640), st
    assert sb.stat("/link")["type"] == "symlink" and sh("readlink /link").stdout == "data/keep.txt\n"
    assert sh("cat /link").stdout == "keep\n"
    inodes = sh("stat -c %i /hard1 /hard2").stdout.split()
    assert len(inodes) == 2 and inodes[0] == inodes[1], "hard link lost"
    assert sh("stat -c %t,%T /devnode").stdout.strip() == "1,3"
    assert sb.stat("/devnode")["type"] == "char"

    # the top layer itself, as mounted on the node: overlayfs whiteouts and an xattr
    top = Path(server.data_dir) / "edge" / "layers" / img.layers[1].split(":")[1]
    gone = os.lstat(top / "data" / "gone.txt")
    assert os.major(gone.st_rdev) == 0 and os.minor(gone.st_rdev) == 0
    assert os.getxattr(top / "opq", "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    assert os.getxattr(top / "xattr.txt", "user.dsec") == b"yes"


def layer_windows_owned() -> bytes:
    """opt/win.txt as Git for Windows' tar makes it: owned by 197609 (0x30000 + RID 1001)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "opt", type=tarfile.DIRTYPE, mode=0o755)
        _add(tf, "opt/win.txt", b"from windows\n", mode=0o644, uid=197609, gid=197609)
        _add(tf, "opt/mine.txt", b"mine\n", mode=0o644, uid=65535, gid=65535)
    return buf.getvalue()


def test_import_reports_owners_outside_the_mapping(server, client, tmp_path, make_sandbox):
    archive = tmp_path / "image-owners.tar"
    build_docker_save(archive, [layer_base(), layer_windows_owned()])
    name = unique("imp-owners")
    r = server.cli("image", "import", "--data-dir", server.data_dir, "--name", f"{name}:1",
                   archive, timeout=300)
    # A warning, not a refusal: the image is imported and usable.
    assert r.returncode == 0, r.stderr
    assert "2 layer(s)" in r.stderr, r.stderr
    assert ("warning: 1 file is owned by ids outside 0-65535, the ids a sandbox maps "
            "(--owner-width)") in r.stderr, r.stderr
    assert "(EACCES, EOVERFLOW): opt/win.txt (uid 197609, gid 197609)\n" in r.stderr, r.stderr
    assert "mine.txt" not in r.stderr, "65535 is inside the mapping"
    assert "--userns-width 262144" in r.stderr, r.stderr
    assert len(client.image(f"{name}:1").layers) == 2

    status, _, _, node = server.raw("GET", "/v1/node")
    assert status == 200, node
    u = node["userns"]
    if not u["enabled"]:
        pytest.skip(f"sandboxes run without user namespaces here, so every owner maps: "
                    f"{u['reason']}")
    if u["length"] > 197609:
        pytest.skip(f"this node maps {u['length']} ids, 197609 among them")
    sb = make_sandbox(f"{name}:1")
    sh = lambda c: sb.exec(c)  # noqa: E731
    assert sh("stat -c %u:%g /opt/win.txt").stdout == "65534:65534\n"
    assert sh("stat -c %u:%g /opt/mine.txt").stdout == "65535:65535\n"
    assert sh("cat /opt/win.txt").stdout == "from windows\n", "0644: others may read it"
    # Opening it for writing is refused by the VFS, whatever its mode, before
    # overlayfs is asked (inode_permission: a write to an inode with an
    # unmapped owner is EACCES); what overlayfs would copy up first (a mode,
    # a time, a rename, a removal) fails in the copy-up (EOVERFLOW).
    w = sh("echo x >> /opt/win.txt")
    assert w.exit_code != 0 and "Permission denied" in w.stderr, w
    for change in ("chmod 600 /opt/win.txt", "touch -d 2020-01-01 /opt/win.txt",
                   "mv /opt/win.txt /opt/moved", "rm -f /opt/win.txt"):
        c = sh(change)
        assert c.exit_code != 0 and "Value too large for defined data type" in c.stderr, \
            (change, c)
    assert sh("cat /opt/win.txt").stdout == "from windows\n"
    assert sh("stat -c %a /opt/win.txt").stdout == "644\n"
    # An owner inside the mapping is writable as usual.
    assert sh("echo x >> /opt/mine.txt").exit_code == 0


def test_owner_width_is_checked_and_widens_what_is_reported(server, tmp_path):
    archive = tmp_path / "image-owners.tar"
    build_docker_save(archive, [layer_windows_owned()])
    for bad in ("0", "100000", "65536x", "4294967296"):
        r = server.cli("image", "import", "--data-dir", server.data_dir, "--name",
                       unique("bad-width"), "--owner-width", bad, archive)
        assert r.returncode != 0, r.stderr
        assert "--owner-width must be a positive multiple of 65536" in r.stderr, r.stderr
        assert f"'{bad}'" in r.stderr, r.stderr
    r = server.cli("image", "import", "--data-dir", server.data_dir, "--name",
                   unique("wide-owners"), "--owner-width", "262144", archive, timeout=300)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


def test_bad_archives_are_refused(server, tmp_path):
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tf:
        _add(tf, "oci-layout", b"{}", mode=0o644)
        _add(tf, "index.json", b'{"schemaVersion":2,"manifests":[]}', mode=0o644)
    r = server.cli("image", "import", "--data-dir", server.data_dir, "--name", unique("bad"),
                   bad)
    assert r.returncode != 0 and "no manifests" in r.stderr, r.stderr
    escape = tmp_path / "escape.tar"
    with tarfile.open(escape, "w") as tf:
        _add(tf, "manifest.json", b'[{"Layers": ["../../etc/passwd"]}]', mode=0o644)
    r = server.cli("image", "import", "--data-dir", server.data_dir, "--name", unique("bad"),
                   escape)
    assert r.returncode != 0 and "leaves the archive" in r.stderr, r.stderr
