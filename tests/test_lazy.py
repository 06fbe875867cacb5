"""Layers loaded on demand from an HTTP blob store (a real nginx), the suite run
once per loader (fanotify, fuse): exact bytes, only what is read is fetched, a
killed or hung loader never yields wrong bytes (fanotify: the edge's own filler
keeps reads correct; fuse: reads of the dead mount fail, and new sandboxes get
the layer remounted over the restarted loader), corrupt blobs fail reads with
EIO, metrics, a cache that survives restarts, a size limit, and prefetch."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

import dsec
from conftest import Server, dsec_bin, _check_prerequisites
from dedup_images import DedupPair, shas_in
from helpers import cgroup_dirs_named, mounts_containing, unique, wait_until
from nginx_store import Nginx
from oci_registry import Registry

MiB = 1 << 20


def fanotify_pre_content_reason():
    """None when this kernel can mark files with FAN_PRE_ACCESS, else why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.fanotify_init(0x8 | 0x1, os.O_RDWR)  # FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC
    if fd < 0:
        return f"fanotify_init(FAN_CLASS_PRE_CONTENT): {os.strerror(ctypes.get_errno())}"
    try:
        with tempfile.NamedTemporaryFile(dir="/var/tmp") as f:
            libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64,
                                           ctypes.c_int, ctypes.c_char_p]
            rc = libc.fanotify_mark(fd, 0x1, 0x00100000, -100, f.name.encode())
            if rc != 0:
                return f"FAN_PRE_ACCESS marks refused: {os.strerror(ctypes.get_errno())}"
    finally:
        os.close(fd)
    return None


def fuse_reason():
    """None when this host can mount FUSE file systems, else why not."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"/dev/fuse: {e.strerror}"
    return None


def loader_procs(needle: str = "") -> list:
    """Pids of `dsec loader` processes (whose command line contains needle)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if len(cmd) > 2 and cmd[1] == b"loader" and needle.encode() in b" ".join(cmd):
                out.append(int(p.name))
    return out


class Lazy:
    """A `dsec up` whose node reads blobs from nginx with the given loader."""

    def __init__(self, tmp: Path, loader: str, fast: bool = False):
        self.tmp = tmp
        self.loader = loader
        self.fast = fast  # the store at nginx's full speed, not /slow/ (benchmarks)
        self.data_dir = tmp / "data"
        self.data_dir.mkdir()
        (self.data_dir / "blobs").mkdir(mode=0o700)
        self.nginx = Nginx(self.data_dir / "blobs").start()
        self.srv = None
        self.files = {}  # layer name -> {path in sandbox: sha256}

    def start(self, *extra):
        self.srv = Server(self.data_dir, ["--blob-store",
                                          self.nginx.url if self.fast else self.nginx.slow_url,
                                          "--loader",
                                          self.loader, "--loader-timeout-s", "2",
                                          "--prefetch-window-s", "1", *extra])
        self.srv.start()
        return self.srv

    def stop(self):
        rc = self.srv.stop()
        assert rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM), self.srv.log_tail()

    @property
    def client(self) -> dsec.Client:
        return self.srv.client

    def node(self) -> dict:
        status, _, _, doc = self.srv.raw("GET", "/v1/node")
        assert status == 200, doc
        return doc

    def layer_stats(self, digest: str) -> dict:
        for l in self.node()["layers"]:
            if l["digest"] == digest:
                return l
        raise AssertionError(f"layer {digest} not on the node: {self.node()}")

    def random_toolkit(self, name: str, big_mb: int = 6) -> str:
        """Imports a toolkit layer holding /opt/<name>/big (random) and small.txt;
        returns its layer digest."""
        root = self.tmp / f"src-{name}"
        d = root / "opt" / name
        d.mkdir(parents=True)
        big = os.urandom(big_mb * MiB)
        (d / "big").write_bytes(big)
        (d / "small.txt").write_text(f"hello from {name}\n")
        self.files[name] = {f"/opt/{name}/big": hashlib.sha256(big).hexdigest(),
                            f"/opt/{name}/small.txt":
                                hashlib.sha256(f"hello from {name}\n".encode()).hexdigest()}
        tar = self.tmp / f"{name}.tar"
        with tarfile.open(tar, "w") as t:
            t.add(root, arcname=".")
        r = self.srv.cli("image", "import", "--data-dir", self.data_dir, "--name", name,
                         "--kind", "toolkit", tar, timeout=300)
        assert r.returncode == 0, r.stderr
        return self.client.image(name).layers[0]

    def data_blob(self, layer: str) -> Path:
        status, _, _, doc = self.srv.raw("GET", f"/v1/layers/{layer}")
        assert status == 200, doc
        return self.data_dir / "blobs" / "sha256" / doc["data"]["digest"][7:]


@pytest.fixture(scope="module", params=["fanotify", "fuse"])
def lazy(request):
    _check_prerequisites()
    reason = fanotify_pre_content_reason() if request.param == "fanotify" else fuse_reason()
    if reason:
        print(f"skipping the {request.param} loader: {reason}")
        pytest.skip(f"{request.param} loader unavailable on this host: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="dsec-lazy-", dir="/tmp"))
    lz = Lazy(tmp, request.param)
    try:
        lz.start()
        lz.srv.import_image("busybox", Path("/var/cache/dsec/test-images/busybox.tar"))
        yield lz
    finally:
        if lz.srv and lz.srv.proc and lz.srv.proc.poll() is None:
            lz.stop()
        lz.nginx.stop()
    # (Agents and cgroups are checked by the session's leftover check.)
    problems = []
    if loader_procs(lz.nginx.url):
        problems.append(f"loader processes left: {loader_procs(lz.nginx.url)}")
    if mounts_containing(str(tmp)):
        problems.append(f"mounts left: {mounts_containing(str(tmp))}")
    shutil.rmtree(tmp, ignore_errors=True)
    assert not problems, problems


def sha_in(sb, path: str, timeout: float = 120) -> str:
    r = sb.exec(["sha256sum", path], timeout=timeout)
    assert r.exit_code == 0, r.stderr
    return r.stdout.split()[0]


def test_reads_exact_bytes_and_fetches_only_what_is_read(lazy):
    layer = lazy.random_toolkit("lazy-a")
    sb = lazy.client.create("busybox", toolkits=["lazy-a"])
    try:
        node = lazy.node()
        assert node["loader"] == lazy.loader and node["blob_store"] == lazy.nginx.slow_url
        assert len(node["loader_pids"]) == 1
        want = lazy.files["lazy-a"]
        assert sha_in(sb, "/opt/lazy-a/small.txt") == want["/opt/lazy-a/small.txt"]
        s = lazy.layer_stats(layer)
        assert s["attached"] and s["chunks"] >= 6
        # Only the chunk(s) holding small.txt (if any) were fetched, not the 6 MiB.
        assert s["bytes_fetched"] <= 1 * MiB, s
        assert sha_in(sb, "/opt/lazy-a/big") == want["/opt/lazy-a/big"]
        s = lazy.layer_stats(layer)
        assert s["chunks_cached"] == s["chunks"], s
        # (Reads of chunks fetched ahead, or of a complete fanotify copy, need
        # not reach the loader.)
        assert s["bytes_fetched"] >= 6 * MiB and s["bytes_read"] > 0, s
        # Read again: served from the node cache, nothing fetched.
        before = s["bytes_fetched"]
        assert sha_in(sb, "/opt/lazy-a/big") == want["/opt/lazy-a/big"]
        assert lazy.layer_stats(layer)["bytes_fetched"] == before
    finally:
        sb.destroy()


def _read_while(lazy, name: str, action) -> tuple:
    """Reads /opt/<name>/big in a sandbox while `action(loader_pid)` runs 1 s in,
    and waits for the edge to replace the loader process. The store is slowed
    to 96 KB/s per request for the read (nginx sends the first second's worth
    of a response at once, so at the suite's 2 MB/s, or even 512 KB/s, a
    128 KiB chunk is not throttled; at 96 KB/s the 6 MiB read takes 5-30 s):
    the action lands mid-read. Returns the exec result of the read, the old
    pid, the new pids, the seconds from the action to a new loader process,
    and the sandbox (still running; the caller destroys it)."""
    sb = lazy.client.create("busybox", toolkits=[name])
    lazy.nginx.set_slow_rate("96k")
    try:
        pid = lazy.node()["loader_pids"][0]
        out = {}

        def read():
            t0 = time.monotonic()
            out["r"] = sb.exec(["sha256sum", f"/opt/{name}/big"], timeout=120)
            out["s"] = time.monotonic() - t0

        t = threading.Thread(target=read)
        t.start()
        time.sleep(1.0)
        assert t.is_alive(), "the read ended before the loader was disturbed: the store is too fast"
        t0 = time.monotonic()
        action(pid)
        deadline = time.monotonic() + 15
        replaced = None
        while time.monotonic() < deadline:
            pids = lazy.node()["loader_pids"]
            if pids and pids[0] != pid:
                replaced = time.monotonic() - t0
                break
            time.sleep(0.05)
        t.join(120)
        assert not t.is_alive(), "the read never finished"
        print(f"{lazy.loader}: the read took {out.get('s', 0):.2f} s")
        return out.get("r"), pid, lazy.node()["loader_pids"], replaced, sb
    except BaseException:
        sb.destroy()
        raise
    finally:
        lazy.nginx.set_slow_rate("2m")


def _check_read(lazy, name: str, r) -> None:
    """The read returned the exact bytes or (fuse, whose dead mount fails
    safe) an error; never other bytes."""
    want = lazy.files[name][f"/opt/{name}/big"]
    assert r is not None
    if r.exit_code == 0:
        assert r.stdout.split()[0] == want, "WRONG BYTES read through the loader"
        return
    assert lazy.loader == "fuse", f"the fanotify loader must keep reads correct: {r}"
    # EIO from read(2), or SIGBUS where a page of a mapped file (busybox
    # itself: its layer is served by the same loader) could not be read.
    assert "error" in r.stderr.lower() or r.signal == signal.SIGBUS, r
    assert want not in r.stdout


def _new_sandbox_reads_correctly(lazy, name: str, old_sb) -> None:
    """A sandbox created after the loader restart reads the exact bytes (fuse:
    the layer was remounted over the new process) while the old sandbox's
    reads still never yield wrong bytes."""
    want = lazy.files[name][f"/opt/{name}/big"]
    sb = lazy.client.create("busybox", toolkits=[name])
    try:
        assert sha_in(sb, f"/opt/{name}/big") == want
        assert sha_in(sb, f"/opt/{name}/small.txt") == lazy.files[name][f"/opt/{name}/small.txt"]
    finally:
        sb.destroy()
    _check_read(lazy, name, old_sb.exec(["sha256sum", f"/opt/{name}/big"], timeout=120))


def test_kill_9_of_the_loader_mid_read_never_yields_wrong_bytes(lazy):
    name = "lazy-kill"
    lazy.random_toolkit(name)
    r, old, new, took, sb = _read_while(lazy, name, lambda pid: os.kill(pid, signal.SIGKILL))
    try:
        print(f"{lazy.loader}: kill -9 mid-read -> exit {r.exit_code}; "
              f"new loader process after {took} s")
        _check_read(lazy, name, r)
        assert new and new[0] != old, "the loader process was not restarted"
        _new_sandbox_reads_correctly(lazy, name, sb)
    finally:
        sb.destroy()


def test_a_hung_loader_is_replaced_and_reads_stay_correct(lazy):
    name = "lazy-hang"
    lazy.random_toolkit(name)
    stopped = []

    def hang(pid):
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    sb = None
    try:
        r, old, new, took, sb = _read_while(lazy, name, hang)
        print(f"{lazy.loader}: SIGSTOP mid-read -> exit {r.exit_code}; "
              f"new loader process after {took} s")
        _check_read(lazy, name, r)
        assert new and new[0] != old, "the hung loader process was not replaced"
        assert old not in loader_procs()
        _new_sandbox_reads_correctly(lazy, name, sb)
    finally:
        for pid in stopped:  # already killed by the edge, normally
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if sb:
            sb.destroy()


def test_a_corrupt_chunk_fails_the_read_with_eio_not_wrong_bytes(lazy):
    layer = lazy.random_toolkit("lazy-bad", big_mb=3)
    blob = lazy.data_blob(layer)
    with open(blob, "r+b") as f:
        f.seek(MiB + 12345)
        orig = f.read(1)
        f.seek(MiB + 12345)
        f.write(bytes([orig[0] ^ 0xFF]))
    sb = lazy.client.create("busybox", toolkits=["lazy-bad"])
    try:
        r = sb.exec(["cat", "/opt/lazy-bad/big"], timeout=120)
        assert r.exit_code != 0
        assert "Input/output error" in r.stderr, r.stderr
        # The blob repaired in the store: the same read now succeeds.
        with open(blob, "r+b") as f:
            f.seek(MiB + 12345)
            f.write(orig)
        assert sha_in(sb, "/opt/lazy-bad/big") == lazy.files["lazy-bad"]["/opt/lazy-bad/big"]
    finally:
        sb.destroy()


def test_metrics_per_layer_and_node(lazy):
    status, headers, body, _ = lazy.srv.raw("GET", "/v1/metrics")
    assert status == 200
    text = body.decode()
    assert "# TYPE dsec_layer_bytes_fetched_total counter" in text
    assert 'dsec_layer_bytes_fetched_total{layer="sha256:' in text
    assert "dsec_node_cache_bytes " in text
    assert lazy.srv.raw("GET", "/v1/metrics", token=None)[0] == 401
    from test_contract import conforms
    conforms(lazy.srv.raw("GET", "/v1/node"), "/v1/node", "GET")
    totals = lazy.node()["totals"]
    assert totals["bytes_fetched"] > 0 and totals["read_requests"] > 0


def test_a_layer_reading_another_layers_blob_gets_exact_bytes(lazy, tmp_path):
    """A pulled layer whose chunks lie in an earlier layer's data blob (chunk
    deduplication across layers): the node fetches and verifies both blobs
    on demand, and two sandboxes, one on each image, read exact bytes."""
    pair = DedupPair(tmp_path, Path("/var/cache/dsec/test-images/busybox.tar").read_bytes(),
                     unique("lazy-dedup"))
    repo = unique("lazy-dedup")
    with Registry(tmp_path) as reg:
        pair.push(reg, repo)
        ref_a, ref_b = f"{reg.host}/{repo}-a:v1", f"{reg.host}/{repo}-b:v1"
        lazy.client.pull_image(ref_a, insecure_registry=True)
        img_b = lazy.client.pull_image(ref_b, insecure_registry=True)
    st, _, _, lb = lazy.srv.raw("GET", f"/v1/layers/{img_b.layers[-1]}")
    assert st == 200 and len(lb["extra_data"]) == 1, lb
    sb_b = lazy.client.create(image=ref_b)
    try:
        assert shas_in(sb_b, pair.files_b) == pair.files_b
        sb_a = lazy.client.create(image=ref_a)
        try:
            assert shas_in(sb_a, pair.files_a) == pair.files_a
        finally:
            sb_a.destroy()
        # A's sandbox and its layer's mount are gone; the blob they shared
        # still serves B's reads.
        r = sb_b.exec(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; "
                                   "sha256sum /opt/copy.bin"])
        assert r.exit_code == 0 and r.stdout.split()[0] == pair.files_b["/opt/copy.bin"], r
    finally:
        sb_b.destroy()
    for ref in (ref_a, ref_b):
        lazy.client.delete_image(ref)


def test_cache_survives_restart_then_limit_evicts_and_prefetch_refills(lazy):
    layer = lazy.random_toolkit("lazy-keep", big_mb=4)
    want = lazy.files["lazy-keep"]["/opt/lazy-keep/big"]
    sb = lazy.client.create("busybox", toolkits=["lazy-keep"])
    assert sha_in(sb, "/opt/lazy-keep/big") == want
    sb.destroy()
    # Past --prefetch-window-s after the layer was attached, the read order is recorded.
    cache = lazy.data_dir / "edge" / "cache"
    data_hex = lazy.data_blob(layer).name
    deadline = time.monotonic() + 15
    while not (cache / f"{data_hex}.order").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (cache / f"{data_hex}.order").exists()
    recorded = len((cache / f"{data_hex}.order").read_text().split())
    assert recorded >= 4

    # Restart: the cached chunks are still there, nothing is fetched again.
    lazy.stop()
    lazy.start("--cache-mb", "3")
    sb = lazy.client.create("busybox", toolkits=["lazy-keep"])
    assert sha_in(sb, "/opt/lazy-keep/big") == want
    s = lazy.layer_stats(layer)
    # (A complete fanotify copy is read with no loader involved at all.)
    assert s["bytes_fetched"] == 0 and (s["cache_hits"] > 0 or s["chunks_cached"] == s["chunks"]), s
    sb.destroy()

    # Over the 3 MiB limit: mounting another layer evicts the unused one.
    lazy.random_toolkit("lazy-other", big_mb=1)
    sb = lazy.client.create("busybox", toolkits=["lazy-other"])
    sb.destroy()
    assert not (cache / f"{data_hex}.data").exists(), sorted(os.listdir(cache))
    assert lazy.node()["cache"]["used_bytes"] <= 3 * MiB + 512 * 1024

    # Cold again: the recorded chunks are prefetched in the background.
    sb = lazy.client.create("busybox", toolkits=["lazy-keep"])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s = lazy.layer_stats(layer)
            if s["chunks_prefetched"] >= recorded:  # all of them, so nothing races the read
                break
            time.sleep(0.2)
        assert s["chunks_prefetched"] >= recorded, s
        assert s["chunks_cached"] >= s["chunks_prefetched"], s
        fetched = s["bytes_fetched"]
        assert sha_in(sb, "/opt/lazy-keep/big") == want
        s = lazy.layer_stats(layer)
        assert s["bytes_fetched"] == fetched, s
    finally:
        sb.destroy()


def test_a_crashed_edge_leaves_no_loader_or_mount_after_restart(lazy):
    lazy.random_toolkit("lazy-crash", big_mb=2)
    old = lazy.node()["loader_pids"][0]
    fuse_dir = str(lazy.data_dir / "edge" / "cache" / "fuse")
    lazy.srv.proc.kill()  # SIGKILL: no clean shutdown
    lazy.srv.proc.wait(10)
    # The loader keeps serving whatever sandboxes the dead edge left.
    assert old in loader_procs(lazy.nginx.url)
    if lazy.loader == "fuse":
        assert len(mounts_containing(fuse_dir)) == 1
    (lazy.data_dir / "up.json").unlink()  # the dead edge's address
    lazy.start()
    deadline = time.monotonic() + 10
    while old in loader_procs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert old not in loader_procs(), "the loader of the crashed edge is still running"
    assert loader_procs(lazy.nginx.url) == lazy.node()["loader_pids"]
    # Exactly the new edge's FUSE mount: the stale one was detached.
    assert len(mounts_containing(fuse_dir)) == (1 if lazy.loader == "fuse" else 0)
    sb = lazy.client.create("busybox", toolkits=["lazy-crash"])
    try:
        assert sha_in(sb, "/opt/lazy-crash/big") == lazy.files["lazy-crash"]["/opt/lazy-crash/big"]
    finally:
        sb.destroy()


def test_a_read_in_progress_through_an_edge_crash_gets_exact_bytes(lazy):
    """The sandbox outlives the edge (it is re-adopted): a read running in it
    while the edge is dead is served by the loader process the edge left,
    which the next edge ends only once nothing needs it."""
    name = "lazy-adopt"
    lazy.random_toolkit(name, big_mb=3)
    want = lazy.files[name][f"/opt/{name}/big"]
    sb = lazy.client.create("busybox", toolkits=[name])
    old = lazy.node()["loader_pids"][0]
    lazy.nginx.set_slow_rate("96k")
    try:
        # in the background: it is the sandbox's, not an exec the edge waits on
        sb.exec(f"(sha256sum /opt/{name}/big > /tmp/sum; echo done >> /tmp/sum) "
                ">/dev/null 2>&1 </dev/null &")
        time.sleep(1.0)
        lazy.srv.proc.kill()  # SIGKILL mid-read
        lazy.srv.proc.wait(10)
        lazy.srv._log.close()
        time.sleep(1.0)  # the read goes on with the edge dead
        assert old in loader_procs(lazy.nginx.url)
        (lazy.data_dir / "up.json").unlink()
        lazy.start()
        again = lazy.client.get(sb.id)
        assert again.state == "running"

        def summed():
            return again.exec("cat /tmp/sum 2>/dev/null").stdout.endswith("done\n")
        assert wait_until(summed, 60), again.exec("cat /tmp/sum; ls -l /opt").stdout
        assert again.exec("cat /tmp/sum").stdout.split()[0] == want
        assert sha_in(again, f"/opt/{name}/big") == want
        if lazy.loader == "fanotify":
            # the new edge's fillers mark the same files: the old process is done
            assert wait_until(lambda: old not in loader_procs(), 10)
        else:
            # its FUSE connection still serves the re-adopted sandbox's layers
            assert old in loader_procs()
    finally:
        lazy.nginx.set_slow_rate("2m")
        lazy.client.get(sb.id).destroy()
    assert wait_until(lambda: old not in loader_procs(), 10), "the old loader outlived its sandboxes"
    assert loader_procs(lazy.nginx.url) == lazy.node()["loader_pids"]


def test_https_store_checked_against_its_ca(tmp_path):
    _check_prerequisites()
    if fanotify_pre_content_reason():
        pytest.skip(f"fanotify loader unavailable: {fanotify_pre_content_reason()}")
    data = tmp_path / "data"
    (data / "blobs").mkdir(parents=True, mode=0o700)
    ng = Nginx(data / "blobs", tls=True).start()
    try:
        for ca, ok in ((None, False), (ng.ca, True)):
            extra = ["--blob-store", ng.tls_url, "--loader", "fanotify"]
            if ca:
                extra += ["--blob-store-ca", ca]
            srv = Server(data, extra)
            srv.start()
            try:
                srv.import_image("busybox", Path("/var/cache/dsec/test-images/busybox.tar"))
                if not ok:
                    with pytest.raises(dsec.DsecError) as e:
                        srv.client.create("busybox")
                    assert "certificate" in str(e.value), e.value
                    continue
                sb = srv.client.create("busybox")
                assert sb.exec("busybox echo over tls").stdout == "over tls\n"
                sb.destroy()
            finally:
                rc = srv.stop()
            assert rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM), srv.log_tail()
    finally:
        ng.stop()
    assert not loader_procs(ng.tls_url) and not mounts_containing(str(tmp_path))


@pytest.mark.parametrize("args,needle", [
    (["--blob-store", "ftp://example/x"], "blob_store"),
    (["--blob-store", "file://relative"], "blob_store"),
    (["--loader", "bogus"], "loader"),
    (["--blob-store", "http://127.0.0.1:1/", "--loader", "direct"], "direct loader"),
])
def test_bad_store_and_loader_options_are_refused(args, needle, tmp_path):
    _check_prerequisites()
    r = subprocess.run([str(dsec_bin()), "up", "--data-dir", str(tmp_path / "d"), "--listen",
                        "127.0.0.1:0", *args], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert not mounts_containing(str(tmp_path))
    edge_dir = os.path.realpath(tmp_path / "d" / "edge")
    parent = "e-" + hashlib.sha256(edge_dir.encode()).hexdigest()[:12]
    assert not cgroup_dirs_named(parent), "a refused start left its cgroups"
