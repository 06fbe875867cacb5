"""Two images whose layers differ (other names, other times) but hold the same
file bytes: what chunk deduplication across layers is for (docs/images.md,
"Deduplication"). Used by the registry pull tests and the lazy loader tests."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from oci_build import OciLayout, directory, file

MiB = 1 << 20


class DedupPair:
    """Image A: busybox, then /srv/big.bin (3 MiB) and 24 small files (and,
    with `a_own`, that many bytes of its own as /srv/zz-own.bin, stored after
    them). Image B: busybox, then the same bytes as /opt/copy.bin and /opt/c*,
    and 1 MiB of its own (/opt/own.bin). `seed` makes the bytes unlike any
    other test's."""

    def __init__(self, tmp: Path, busybox: bytes, seed: str, a_own: int = 0):
        rnd = random.Random(seed)
        big = rnd.randbytes(3 * MiB + 1234)
        smalls = [rnd.randbytes(rnd.randint(3000, 70000)) for _ in range(24)]
        own = rnd.randbytes(MiB)
        self.shared_bytes = len(big) + sum(len(s) for s in smalls)
        self.own_bytes = len(own)
        own_a = rnd.randbytes(a_own)
        self.a_own_bytes = a_own
        self.a = OciLayout(tmp / "a")
        self.a.add_layer(busybox, compression="gzip")
        self.a.add_layer([directory("srv"), file("srv/big.bin", big),
                          *[file(f"srv/s{i}", s) for i, s in enumerate(smalls)],
                          *([file("srv/zz-own.bin", own_a)] if a_own else [])])
        self.b = OciLayout(tmp / "b")
        self.b.add_layer(busybox, compression="gzip")
        self.b.add_layer([directory("opt", mtime=12345), file("opt/copy.bin", big, mtime=12345),
                          *[file(f"opt/c{i}", s, mtime=12345) for i, s in enumerate(smalls)],
                          file("opt/own.bin", own)], compression="zstd")
        sha = lambda b: hashlib.sha256(b).hexdigest()
        self.files_a = {"/srv/big.bin": sha(big),
                        **{f"/srv/s{i}": sha(s) for i, s in enumerate(smalls)},
                        **({"/srv/zz-own.bin": sha(own_a)} if a_own else {})}
        self.files_b = {"/opt/copy.bin": sha(big), "/opt/own.bin": sha(own),
                        **{f"/opt/c{i}": sha(s) for i, s in enumerate(smalls)}}
        self.a.write("v1")
        self.b.write("v1")

    def push(self, reg, repo: str) -> None:
        reg.push_oci(self.a.dir, repo + "-a", "v1")
        reg.push_oci(self.b.dir, repo + "-b", "v1")


def shas_in(sb, files: dict, timeout: float = 120) -> dict:
    """{path: sha256} of `files`' paths read in sandbox `sb`."""
    r = sb.exec(["sha256sum", *files], timeout=timeout)
    assert r.exit_code == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        digest, path = line.split(None, 1)
        out[path] = digest
    return out
