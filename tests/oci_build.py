"""Builders of OCI image layout directories, for the registry tests (push them
with oci_registry.Registry.push_oci) and for `dsec image import` (to_tar).

Deterministic: the same calls give the same blobs and digests (fixed mtimes,
gzip with mtime 0 and no file name, zstd from the CLI at a fixed level, compact
JSON in a fixed key order, tar in PAX format with empty user and group names
unless given).

    from oci_build import OciLayout, file, directory, symlink, whiteout, opaque

    img = OciLayout(tmp_path / "oci")
    img.add_layer([directory("etc"), file("etc/motd", "hi\\n", mode=0o600, uid=7)])
    img.add_layer({"etc/motd": b"changed\\n", "bin/": None}, compression="zstd")
    img.add_layer([whiteout("etc/motd"), opaque("var/cache")], compression="none")
    img.set_config(user="1000", env={"A": "1"}, workdir="/w", cmd=["sh"])
    digest = img.write("v1")            # manifest digest; oci:DIR:v1 for skopeo

    idx = OciLayout(tmp_path / "multi")
    amd, arm = OciLayout(idx.dir), OciLayout(idx.dir)  # children may share the dir
    amd.add_layer({"arch": "amd64\\n"}); arm.add_layer({"arch": "arm64\\n"})
    idx.write_multi_arch("latest", {"linux/amd64": amd, "linux/arm64/v8": arm})

Large mostly-empty files (2 GiB by default), without writing 2 GiB anywhere:
    img.add_sparse_layer(tmp_path / "work")  # GNU tar --sparse --format=posix
    img.add_zeros_layer()                    # one plain tar entry, zeros streamed
both return a LargeFile (name, size, blocks, sha256()) describing the content.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

MTIME = 1700000000  # every entry's default mtime, and the configs' "created"
CREATED = "2023-11-14T22:13:20Z"

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
REF_NAME = "org.opencontainers.image.ref.name"
GIB = 1 << 30


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def dumps(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


# ----- tar entries -------------------------------------------------------------------

@dataclass
class Entry:
    """One tar member. `type`: file, dir, symlink, hardlink, char, block, fifo."""
    path: str
    type: str = "file"
    data: bytes = b""
    target: str = ""          # symlink / hard link target
    mode: Optional[int] = None  # default 0644 files, 0755 dirs, 0777 symlinks, 0666 devices
    uid: int = 0
    gid: int = 0
    uname: str = ""
    gname: str = ""
    mtime: int = MTIME
    xattrs: dict = field(default_factory=dict)  # name -> str|bytes, as PAX SCHILY.xattr.NAME
    devmajor: int = 0
    devminor: int = 0
    pax: dict = field(default_factory=dict)     # more PAX records, as given

    _TYPES = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
              "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE,
              "fifo": tarfile.FIFOTYPE}
    _MODES = {"file": 0o644, "dir": 0o755, "symlink": 0o777, "hardlink": 0o644,
              "char": 0o666, "block": 0o660, "fifo": 0o644}

    def tarinfo(self) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(self.path)
        ti.type = self._TYPES[self.type]
        ti.mode = self._MODES[self.type] if self.mode is None else self.mode
        ti.uid, ti.gid, ti.uname, ti.gname = self.uid, self.gid, self.uname, self.gname
        ti.mtime = int(self.mtime)
        ti.size = len(self.data) if self.type == "file" else 0
        ti.linkname = self.target
        ti.devmajor, ti.devminor = self.devmajor, self.devminor
        pax = {}
        for name, value in self.xattrs.items():
            if isinstance(value, bytes):  # tarfile writes undecodable values as BINARY
                value = value.decode("utf-8", "surrogateescape")
            pax["SCHILY.xattr." + name] = value
        pax.update(self.pax)
        ti.pax_headers = pax
        return ti


def _data(data) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def file(path: str, data=b"", mode: int = 0o644, **kw) -> Entry:
    return Entry(path, "file", data=_data(data), mode=mode, **kw)


def directory(path: str, mode: int = 0o755, **kw) -> Entry:
    return Entry(path.rstrip("/"), "dir", mode=mode, **kw)


def symlink(path: str, target: str, **kw) -> Entry:
    return Entry(path, "symlink", target=target, **kw)


def hardlink(path: str, target: str, **kw) -> Entry:
    """A hard link to `target`, an earlier member of the same layer."""
    return Entry(path, "hardlink", target=target, **kw)


def chardev(path: str, major: int, minor: int, mode: int = 0o666, **kw) -> Entry:
    return Entry(path, "char", devmajor=major, devminor=minor, mode=mode, **kw)


def blockdev(path: str, major: int, minor: int, mode: int = 0o660, **kw) -> Entry:
    return Entry(path, "block", devmajor=major, devminor=minor, mode=mode, **kw)


def fifo(path: str, mode: int = 0o644, **kw) -> Entry:
    return Entry(path, "fifo", mode=mode, **kw)


def whiteout(path: str, **kw) -> Entry:
    """Hides `path` of the layers below: an empty file DIR/.wh.NAME."""
    d, _, name = path.rstrip("/").rpartition("/")
    return Entry((d + "/" if d else "") + ".wh." + name, "file", mode=0o644, **kw)


def opaque(dirpath: str, **kw) -> Entry:
    """Hides what the layers below have in `dirpath`: DIR/.wh..wh..opq."""
    return Entry(dirpath.rstrip("/") + "/.wh..wh..opq", "file", mode=0o644, **kw)


def entries(spec) -> list:
    """A list of Entry from a list of Entry, or a dict path -> bytes|str (a file),
    None (a directory), Entry (used as is, its path replaced by the key)."""
    if isinstance(spec, dict):
        out = []
        for path, v in spec.items():
            if isinstance(v, Entry):
                v.path = path
                out.append(v)
            elif v is None or path.endswith("/"):
                out.append(directory(path))
            else:
                out.append(file(path, v))
        return out
    return list(spec)


def layer_tar(spec) -> bytes:
    """The uncompressed tar of `spec` (see entries())."""
    buf = io.BytesIO()
    _write_tar(buf, spec)
    return buf.getvalue()


def _write_tar(fileobj, spec) -> None:
    with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT,
                      encoding="utf-8") as tf:
        for e in entries(spec):
            tf.addfile(e.tarinfo(), io.BytesIO(e.data) if e.type == "file" else None)


# ----- blob writing ------------------------------------------------------------------

class _LayerWriter:
    """A file-like sink: hashes what it is given (the diff id) and compresses it
    into a temporary blob file; close() names the blob by its digest."""

    def __init__(self, blobs: Path, compression: str, level: Optional[int] = None):
        if compression not in MT_LAYER:
            raise ValueError(f"compression {compression!r}: want gzip, zstd or none")
        self.blobs = blobs
        self.compression = compression
        self.diff = hashlib.sha256()
        self.usize = 0
        self.tmp = blobs / f".tmp-{uuid.uuid4().hex}"
        self.f = open(self.tmp, "wb")
        self.proc = None
        if compression == "gzip":
            self.out = gzip.GzipFile(filename="", mode="wb", fileobj=self.f, mtime=0,
                                     compresslevel=6 if level is None else level)
        elif compression == "zstd":
            self.proc = subprocess.Popen(["zstd", "-q", f"-{3 if level is None else level}",
                                          "-c", "-"], stdin=subprocess.PIPE, stdout=self.f)
            self.out = self.proc.stdin
        else:
            self.out = self.f

    def write(self, b) -> int:
        self.diff.update(b)
        self.usize += len(b)
        self.out.write(b)
        return len(b)

    def close(self) -> dict:
        """Returns the layer's descriptor (plus "diff_id" and "uncompressed_size")."""
        if self.compression == "gzip":
            self.out.close()
        elif self.proc is not None:
            self.out.close()
            if self.proc.wait() != 0:
                raise RuntimeError(f"zstd exited with {self.proc.returncode}")
        self.f.close()
        h = hashlib.sha256()
        with open(self.tmp, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = "sha256:" + h.hexdigest()
        size = self.tmp.stat().st_size
        os.replace(self.tmp, self.blobs / h.hexdigest())
        return {"mediaType": MT_LAYER[self.compression], "digest": digest, "size": size,
                "diff_id": "sha256:" + self.diff.hexdigest(), "uncompressed_size": self.usize}


@dataclass
class LargeFile:
    """What a large-file layer holds: `name`, `size` bytes, zeros except `blocks`
    (offset -> bytes)."""
    name: str
    size: int
    blocks: dict
    descriptor: dict = None

    def chunks(self, chunk: int = 1 << 20):
        """The file's bytes, in pieces (never the whole file at once)."""
        zeros = memoryview(bytes(chunk))
        pos = 0
        for off in sorted(self.blocks):
            data = self.blocks[off]
            while pos < off:
                n = min(chunk, off - pos)
                yield zeros[:n]
                pos += n
            yield data
            pos += len(data)
        while pos < self.size:
            n = min(chunk, self.size - pos)
            yield zeros[:n]
            pos += n

    def sha256(self) -> str:
        """The hex sha256 of the whole file (~1 s for 2 GiB)."""
        h = hashlib.sha256()
        for c in self.chunks():
            h.update(c)
        return h.hexdigest()


def default_blocks(size: int) -> dict:
    """A few non-zero 4 KiB blocks: at 0, in the middle, at the last block; each
    the tag repeated, and ending with it ("head ", "middle ", "tail ")."""
    def block(tag: str) -> bytes:
        t = tag.encode()
        return (t * 4096)[:4096 - len(t)] + t
    mid = (size // 2) // 4096 * 4096
    last = (size - 4096) // 4096 * 4096
    return {0: block("head "), mid: block("middle "), last: block("tail ")}


# ----- the layout --------------------------------------------------------------------

class OciLayout:
    """An OCI image layout directory being built (one image; several layouts may
    share a directory, as the children of write_multi_arch)."""

    def __init__(self, dir, architecture: str = "amd64", os_: str = "linux",
                 variant: Optional[str] = None):
        self.dir = Path(dir)
        self.blobs = self.dir / "blobs" / "sha256"
        self.blobs.mkdir(parents=True, exist_ok=True)
        (self.dir / "oci-layout").write_bytes(b'{"imageLayoutVersion":"1.0.0"}')
        self.layers = []      # descriptors (mediaType, digest, size)
        self.diff_ids = []
        self.uncompressed_sizes = []
        self.platform = {"architecture": architecture, "os": os_}
        if variant:
            self.platform["variant"] = variant
        self.runtime_config = {}
        self.config_extra = {}
        self.manifest_annotations = {}
        self.manifest = None  # the last built manifest (a dict) and its digest
        self.manifest_digest = None
        self.config_digest = None

    # layers

    def _done(self, desc: dict) -> dict:
        self.diff_ids.append(desc.pop("diff_id"))
        self.uncompressed_sizes.append(desc.pop("uncompressed_size"))
        self.layers.append(desc)
        return dict(desc)

    def add_layer(self, spec, compression: str = "gzip", level: Optional[int] = None) -> dict:
        """Appends a layer of `spec` (see entries(); or raw tar bytes, used as
        they are, e.g. test_oci_import.layer_changes()). Returns its descriptor."""
        w = _LayerWriter(self.blobs, compression, level)
        if isinstance(spec, (bytes, bytearray)):
            w.write(bytes(spec))
        else:
            _write_tar(w, spec)
        return self._done(w.close())

    def add_blob_layer(self, data: bytes, media_type: str, diff_id: str) -> dict:
        """Appends a layer blob given as is (e.g. a malformed one)."""
        self.put_blob(data)
        self.diff_ids.append(diff_id)
        self.uncompressed_sizes.append(None)
        desc = {"mediaType": media_type, "digest": sha(data), "size": len(data)}
        self.layers.append(desc)
        return dict(desc)

    def add_sparse_layer(self, workdir, size: int = 2 * GIB, blocks: Optional[dict] = None,
                         name: str = "sparse.img", compression: str = "gzip",
                         sparse_version: str = "1.0", mode: int = 0o644) -> LargeFile:
        """A layer of one file `name` of `size` bytes, zeros but for `blocks`
        (offset -> bytes; default_blocks() if None), stored as a sparse member
        by `tar --sparse --format=posix` (GNU PAX sparse format `sparse_version`,
        1.0 by default; 0.0 and 0.1 also exist). The file is made with truncate
        and pwrite in `workdir` (holes take no disk) and removed afterwards.
        Format 1.0 names the member's header `./GNUSparseFile.<pid>/<name>`:
        tar runs as pid 1 of a new pid namespace so that it is the same each
        time (root only; otherwise the digest changes from run to run)."""
        blocks = default_blocks(size) if blocks is None else dict(blocks)
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        src = workdir / name
        with open(src, "wb") as f:
            f.truncate(size)
            for off, data in blocks.items():
                os.pwrite(f.fileno(), data, off)
        os.chmod(src, mode)
        os.utime(src, (MTIME, MTIME))
        cmd = ["tar", "--sparse", f"--sparse-version={sparse_version}", "--format=posix",
               "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
               f"--mtime=@{MTIME}", "--owner=0", "--group=0", "--numeric-owner",
               "-C", str(workdir), "-cf", "-", name]
        if os.geteuid() == 0 and shutil.which("unshare"):
            cmd = ["unshare", "--pid", "--fork", "--kill-child", *cmd]
        w = _LayerWriter(self.blobs, compression)
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            while chunk := proc.stdout.read(1 << 20):
                w.write(chunk)
            err = proc.stderr.read()
            if proc.wait() != 0:
                raise RuntimeError(f"{cmd} exited with {proc.returncode}: {err!r}")
        finally:
            src.unlink()
        lf = LargeFile(name, size, blocks)
        lf.descriptor = self._done(w.close())
        return lf

    def add_zeros_layer(self, size: int = 2 * GIB, blocks: Optional[dict] = None,
                        name: str = "zeros.img", compression: str = "gzip",
                        level: Optional[int] = None, mode: int = 0o644) -> LargeFile:
        """A layer of one plain (not sparse-encoded) tar member `name` of `size`
        bytes, zeros but for `blocks` (default_blocks() if None), streamed
        through the compressor: nothing of `size` is held in memory or written
        uncompressed. gzip level 6 (default) makes 2 GiB of zeros ~2 MB in
        ~10 s of CPU; level=1 ~9 MB in ~3 s; zstd ~70 KB in ~1 s."""
        blocks = default_blocks(size) if blocks is None else dict(blocks)
        lf = LargeFile(name, size, blocks)
        ti = tarfile.TarInfo(name)
        ti.size, ti.mode, ti.mtime = size, mode, MTIME
        w = _LayerWriter(self.blobs, compression, level)
        header = ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        w.write(header)
        for c in lf.chunks():
            w.write(c)
        total = 512 * ((size + 511) // 512)
        tail = bytes(total - size) + bytes(1024)  # padding, end-of-archive blocks
        written = len(header) + total + 1024
        tail += bytes(-written % tarfile.RECORDSIZE)  # as tarfile pads the last record
        w.write(tail)
        lf.descriptor = self._done(w.close())
        return lf

    # blobs and documents

    def put_blob(self, data: bytes) -> str:
        d = sha(data)
        p = self.blobs / d.split(":")[1]
        if not p.exists():
            p.write_bytes(data)
        return d

    def blob_path(self, digest: str) -> Path:
        return self.blobs / digest.split(":", 1)[1]

    def set_config(self, user=None, env=None, workdir=None, entrypoint=None, cmd=None,
                   labels=None, **extra) -> None:
        """The image config's runtime "config" (User, Env, WorkingDir, Entrypoint,
        Cmd, Labels; **extra are more keys as given, e.g. StopSignal="SIGINT").
        env may be a dict or a list of "K=V"."""
        c = {}
        if user is not None:
            c["User"] = user
        if env is not None:
            c["Env"] = [f"{k}={v}" for k, v in env.items()] if isinstance(env, dict) else list(env)
        if workdir is not None:
            c["WorkingDir"] = workdir
        if entrypoint is not None:
            c["Entrypoint"] = list(entrypoint)
        if cmd is not None:
            c["Cmd"] = list(cmd)
        if labels is not None:
            c["Labels"] = dict(labels)
        c.update(extra)
        self.runtime_config = c

    def config_bytes(self) -> bytes:
        doc = {"created": CREATED, **self.platform}
        if self.runtime_config:
            doc["config"] = self.runtime_config
        doc["rootfs"] = {"type": "layers", "diff_ids": list(self.diff_ids)}
        doc["history"] = [{"created": CREATED, "created_by": f"oci_build layer {i}"}
                          for i in range(len(self.layers))]
        doc.update(self.config_extra)
        return dumps(doc)

    def build(self) -> dict:
        """Writes the config and manifest blobs; returns the manifest's descriptor
        (with platform). index.json is left alone."""
        config = self.config_bytes()
        self.config_digest = self.put_blob(config)
        m = {"schemaVersion": 2, "mediaType": MT_MANIFEST,
             "config": {"mediaType": MT_CONFIG, "digest": self.config_digest,
                        "size": len(config)},
             "layers": [dict(l) for l in self.layers]}
        if self.manifest_annotations:
            m["annotations"] = dict(self.manifest_annotations)
        raw = dumps(m)
        self.manifest = m
        self.manifest_digest = self.put_blob(raw)
        return {"mediaType": MT_MANIFEST, "digest": self.manifest_digest, "size": len(raw),
                "platform": dict(self.platform)}

    def _tag(self, desc: dict, tag: str) -> None:
        path = self.dir / "index.json"
        index = (json.loads(path.read_bytes()) if path.exists() else
                 {"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": []})
        index["manifests"] = [m for m in index["manifests"]
                              if m.get("annotations", {}).get(REF_NAME) != tag]
        d = dict(desc)
        d["annotations"] = {REF_NAME: tag}
        index["manifests"].append(d)
        path.write_bytes(dumps(index))

    def write(self, tag: str = "latest") -> str:
        """Builds the image and tags it in index.json; returns the manifest digest."""
        desc = self.build()
        desc.pop("platform")
        self._tag(desc, tag)
        return self.manifest_digest

    def write_multi_arch(self, tag: str, platforms: dict) -> str:
        """An image index of the OciLayouts `platforms` ("os/arch[/variant]" ->
        layout; each gets that platform in its config), tagged `tag` here. The
        children's blobs are copied here unless they share this directory.
        Returns the index digest."""
        manifests = []
        for plat, child in platforms.items():
            parts = plat.split("/")
            child.platform = {"architecture": parts[1], "os": parts[0]}
            if len(parts) > 2:
                child.platform["variant"] = parts[2]
            manifests.append(child.build())
            if child.blobs.resolve() != self.blobs.resolve():
                for d in [child.manifest_digest, child.config_digest,
                          *(l["digest"] for l in child.layers)]:
                    dst = self.blob_path(d)
                    if not dst.exists():
                        shutil.copyfile(child.blob_path(d), dst)
        raw = dumps({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": manifests})
        self.index_digest = self.put_blob(raw)
        self._tag({"mediaType": MT_INDEX, "digest": self.index_digest, "size": len(raw)}, tag)
        return self.index_digest

    def to_tar(self, path) -> Path:
        """The layout as one tar (what `dsec image import` reads), sorted, fixed mtimes."""
        path = Path(path)
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
            for name in ["oci-layout", "index.json"] + [
                    "blobs/sha256/" + p.name for p in sorted(self.blobs.iterdir())
                    if not p.name.startswith(".")]:
                src = self.dir / name
                ti = tarfile.TarInfo(name)
                ti.size, ti.mode, ti.mtime = src.stat().st_size, 0o644, MTIME
                with open(src, "rb") as f:
                    tf.addfile(ti, f)
        return path
