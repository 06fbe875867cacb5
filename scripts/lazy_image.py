#!/usr/bin/env python3
"""Helpers of scripts/build-lazy-image.sh (Python 3 stdlib only).

  lazy_image.py diff BASE FULL LIST
      Writes to LIST (NUL-separated, "./"-relative, parents first) every entry
      of the tree FULL that BASE lacks or has with another type, mode, owner,
      size, mtime or symlink target, plus the directories leading to them:
      the layer that turns BASE into FULL (deletions are not carried).
  lazy_image.py workspace MB OUT.tar
      Writes a repository-like tree under ./workspace/repo of about MB
      megabytes to OUT.tar, byte for byte the same on every run (seeded PRNG,
      fixed mtimes and owners): source files (~12%), text data (~8%), binary
      assets and a git pack (~80%, incompressible, no duplicate chunks).
"""

import io
import os
import random
import stat
import sys
import tarfile


def _differs(a, b, pa, pb):
    if stat.S_IFMT(a.st_mode) != stat.S_IFMT(b.st_mode):
        return True
    if (a.st_mode, a.st_uid, a.st_gid) != (b.st_mode, b.st_uid, b.st_gid):
        return True
    if stat.S_ISDIR(a.st_mode):
        return False  # a directory's mtime changes when anything is added to it
    if stat.S_ISLNK(a.st_mode):
        return os.readlink(pa) != os.readlink(pb)
    if stat.S_ISREG(a.st_mode):
        return a.st_size != b.st_size or a.st_mtime_ns != b.st_mtime_ns
    return (a.st_rdev != b.st_rdev)


def diff(base, full, out):
    keep = set()
    missing = 0
    for root, dirs, files in os.walk(full):
        rel_root = os.path.relpath(root, full)
        for name in dirs + files:
            rel = os.path.normpath(os.path.join(rel_root, name))
            pf, pb = os.path.join(full, rel), os.path.join(base, rel)
            sf = os.lstat(pf)
            try:
                sb = os.lstat(pb)
            except FileNotFoundError:
                keep.add(rel)
                continue
            if _differs(sf, sb, pf, pb):
                keep.add(rel)
    for root, dirs, files in os.walk(base):
        rel_root = os.path.relpath(root, base)
        for name in dirs + files:
            if not os.path.lexists(os.path.join(full, rel_root, name)):
                missing += 1
    # Parents of everything kept, so owners and modes of new dirs come along.
    for rel in list(keep):
        d = os.path.dirname(rel)
        while d and d not in keep:
            keep.add(d)
            d = os.path.dirname(d)
    paths = sorted(keep, key=lambda p: p.split("/"))
    with open(out, "wb") as f:
        for p in paths:
            f.write(b"./" + os.fsencode(p) + b"\0")
    sys.stderr.write("lazy_image diff: %d entries differ or are new, %d deleted (not carried)\n"
                     % (len(paths), missing))


# ---- the workspace ----------------------------------------------------------

MTIME = 1767225600  # 2026-01-01T00:00:00Z
WORDS = ("self data value result config index buffer parse token node tree graph cache "
         "request response handler client server layer image chunk stream reader writer "
         "error status count offset length size name path key item batch queue worker "
         "score reward policy agent episode step action state model train eval sample").split()


class Tar:
    def __init__(self, path):
        self.t = tarfile.open(path, "w", format=tarfile.GNU_FORMAT)
        self.dirs = set()
        self.bytes = 0

    def _dir(self, path):
        if not path or path in self.dirs:
            return
        self._dir(os.path.dirname(path))
        ti = tarfile.TarInfo("./" + path)
        ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, MTIME
        self.t.addfile(ti)
        self.dirs.add(path)

    def file(self, path, data, mode=0o644):
        self._dir(os.path.dirname(path))
        ti = tarfile.TarInfo("./" + path)
        ti.size, ti.mode, ti.mtime = len(data), mode, MTIME
        self.t.addfile(ti, io.BytesIO(data))
        self.bytes += len(data)

    def close(self):
        self.t.close()


def _ident(rng):
    return "_".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))


def _python_source(rng, size):
    out = ['"""%s: %s."""\n\nimport os\nimport sys\n\n' % (_ident(rng), " ".join(
        rng.choice(WORDS) for _ in range(8)))]
    n = len(out[0])
    while n < size:
        fn = _ident(rng)
        args = ", ".join(_ident(rng) for _ in range(rng.randint(0, 4)))
        body = ["def %s(%s):\n" % (fn, args)]
        for _ in range(rng.randint(2, 12)):
            body.append("    %s = %s(%s) + %d\n" % (_ident(rng), _ident(rng), _ident(rng),
                                                     rng.randint(0, 9999)))
        body.append("    return %s\n\n\n" % _ident(rng))
        s = "".join(body)
        out.append(s)
        n += len(s)
    return "".join(out).encode()


def _c_source(rng, size):
    out = ["/* %s */\n#include <stdio.h>\n#include <stdlib.h>\n\n" % " ".join(
        rng.choice(WORDS) for _ in range(6))]
    n = len(out[0])
    while n < size:
        s = "static int %s(int %s, long %s) {\n  int r = %s * %d;\n  for (int i = 0; i < %s; ++i) " \
            "r ^= i << %d;\n  return r + (int)%s;\n}\n\n" % (
                _ident(rng), "a", "b", "a", rng.randint(1, 999), "a", rng.randint(1, 30), "b")
        out.append(s)
        n += len(s)
    return "".join(out).encode()


def _csv(rng, size):
    lines = ["id,episode,step,reward,latency_ms,label\n"]
    n = len(lines[0])
    i = 0
    while n < size:
        s = "%d,%d,%d,%.4f,%.2f,%s\n" % (i, rng.randint(0, 99999), rng.randint(0, 512),
                                         rng.random(), rng.random() * 300, rng.choice(WORDS))
        lines.append(s)
        n += len(s)
        i += 1
    return "".join(lines).encode()


def workspace(mb, out):
    rng = random.Random(20261130)
    total = int(mb) << 20
    t = Tar(out)
    root = "workspace/repo"
    t.file(root + "/README.md", b"# repo\n\nA generated repository for bench/lazy.\n")
    t.file(root + "/Makefile", b"all:\n\tpython3 -m pytest tests\n")
    t.file(root + "/.git/HEAD", b"ref: refs/heads/main\n")
    t.file(root + "/.git/config", b"[core]\n\trepositoryformatversion = 0\n\tbare = false\n")
    # Sources: ~12% in many small files (packages of modules, C extensions, tests).
    src_budget, n = total * 12 // 100, 0
    while n < src_budget:
        pkg = "src/%s/%s" % (rng.choice(WORDS), rng.choice(WORDS))
        for j in range(rng.randint(5, 30)):
            size = int(rng.lognormvariate(8.5, 1.0))  # median ~5 KB
            if rng.random() < 0.25:
                data, name = _c_source(rng, size), "%s_%d.c" % (_ident(rng), j)
            else:
                data, name = _python_source(rng, size), "%s_%d.py" % (_ident(rng), j)
            t.file("%s/%s/%s" % (root, pkg, name), data)
            n += len(data)
    # Text data: ~8%.
    data_budget, n, k = total * 8 // 100, 0, 0
    while n < data_budget:
        data = _csv(rng, rng.randint(256 << 10, 4 << 20))
        t.file("%s/data/runs_%03d.csv" % (root, k), data)
        n += len(data)
        k += 1
    # Binary assets and a git pack: the rest, random (incompressible, no
    # duplicate chunks), 1-48 MB each.
    k = 0
    pack = (total - t.bytes) // 5
    t.file("%s/.git/objects/pack/pack-%040x.pack" % (root, rng.getrandbits(160)),
           rng.randbytes(pack))
    while t.bytes < total:
        size = min(total - t.bytes, rng.randint(1 << 20, 48 << 20))
        kind = rng.choice(("models", "fixtures", "images"))
        t.file("%s/assets/%s/%s_%03d.bin" % (root, kind, _ident(rng), k), rng.randbytes(size))
        k += 1
    t.close()
    sys.stderr.write("lazy_image workspace: %d bytes of file data\n" % t.bytes)


def main(argv):
    if len(argv) == 5 and argv[1] == "diff":
        diff(argv[2], argv[3], argv[4])
    elif len(argv) == 4 and argv[1] == "workspace":
        workspace(argv[2], argv[3])
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
