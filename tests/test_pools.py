"""Node pools, bursting and pre-staged layers; pack_diff and computer use on
remote nodes (docs/cluster.md, issue 7 item 6).

Simulated edges (`dsec edge --simulate --pool ...`) check placement: sandboxes
go to their pool only; a burstable one goes to the burst pool when its pool's
utilization is at or above the threshold (exactly at it too), when its pool is
down, and falls back to its own pool when the burst pool is full; a
non-burstable one never goes there. Real edges (a `default` node reading the
platform's blob directory in place, a `cloud` node with an on-demand loader)
check that the cloud node pre-stages the configured image's layers before any
sandbox uses them (they are in its heartbeat's cached layers, and a sandbox
there reads them with the blob store gone), and that pack_diff works on a
remote node: the snapshot is recorded on the platform, its blob is in the
shared store, and sandboxes made from it on the same and on another node see
the files exactly. Computer-use calls cross the node hop and come back with
the node's own answer.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import dsec
from conftest import IMAGE_CACHE, _check_prerequisites, dsec_bin, unavailable
from helpers import aether_pids, mounts_containing, sandbox_cgroup_dirs, wait_until
from test_cluster import HB_TIMEOUT_S, Proc, edge_cgroup_of, free_port, raw


class PoolCluster:
    """A `dsec platform` with edges given as (name, pool, extra args)."""

    def __init__(self, root: Path, platform_args=()):
        self.root = root
        self.pdir = root / "platform"
        self.port = free_port()
        self.platform = Proc(["platform", "--data-dir", self.pdir,
                              "--listen", f"127.0.0.1:{self.port}",
                              "--heartbeat-timeout-s", HB_TIMEOUT_S, *platform_args],
                             self.pdir, "up.json")
        self.edges = {}

    def start_platform(self):
        self.platform.start()
        self.token = (self.pdir / "token").read_text().strip()
        self.client = dsec.Client(self.platform.url, self.token, timeout=60)
        return self

    def edge_proc(self, name, pool, args=()):
        d = self.root / name
        return Proc(["edge", "--platform", self.platform.url, "--data-dir", d,
                     "--join-token-file", self.pdir / "join_token", "--listen", "127.0.0.1:0",
                     "--name", name, "--pool", pool, "--heartbeat-s", "0.3", *args], d, "edge.json")

    def add_edge(self, name, pool, args=()):
        self.edges[name] = self.edge_proc(name, pool, args).start()
        assert wait_until(lambda: self.node(name).get("state") == "up", 10), self.nodes()
        return self.edges[name]

    def nodes(self):
        st, _, doc = raw(self.platform.url, "GET", "/v1/nodes", token=self.token)
        assert st == 200, doc
        return {n["name"]: n for n in doc["nodes"]}

    def node(self, name):
        return self.nodes().get(name, {})

    def api(self, method, path, body=None, timeout=60):
        return raw(self.platform.url, method, path, body, token=self.token, timeout=timeout)

    def metrics(self):
        st, body, _ = self.api("GET", "/metrics")
        assert st == 200
        return body.decode()

    def shutdown(self):
        problems = []
        for e in self.edges.values():
            try:
                e.stop()
            except AssertionError as ex:
                problems.append(str(ex))
        try:
            self.platform.stop()
        except AssertionError as ex:
            problems.append(str(ex))
        return problems


def metric(text, name, labels=""):
    m = re.search(r"^" + re.escape(name + labels) + r" ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


# ---------------------------------------------------------------- simulated

@pytest.fixture
def sim_root():
    if not dsec_bin().is_file():
        unavailable(f"{dsec_bin()} not built")
    root = Path(tempfile.mkdtemp(prefix="dsec-pool-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def sim_image(cl, name="sim", kind="base"):
    data = f"{name} layer".encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    st, _, doc = cl.api("PUT", f"/v1/blobs/{digest}", data)
    assert st in (200, 201), doc
    st, _, doc = cl.api("POST", "/v1/images", {"name": name, "tag": "latest",
                                                "layers": [digest], "kind": kind})
    assert st in (200, 201), doc


def test_bursting_on_simulated_edges(sim_root):
    # Two default nodes (4 slots each) and one cloud node (4 slots); requests
    # of 0.1 cpu and 64 MiB, so slots are the scarce resource: utilization of
    # the default pool is its sandboxes over 8.
    cl = PoolCluster(sim_root, ["--burst-pool", "cloud", "--burst-threshold", "0.5",
                                "--admission-wait-s", "1"])
    try:
        cl.start_platform()
        for name, pool in (("d0", "default"), ("d1", "default"), ("c0", "cloud")):
            cl.add_edge(name, pool, ["--simulate", "--sim-capacity", "4"])
        sim_image(cl)
        pool_of = {n: v["pool"] for n, v in cl.nodes().items()}

        def make(burstable=None, pool=None, expect=201):
            body = {"image": "sim:latest", "cpu": 0.1, "memory_mb": 64}
            if burstable is not None:
                body["burstable"] = burstable
            if pool is not None:
                body["pool"] = pool
            st, _, doc = cl.api("POST", "/v1/sandboxes", body)
            assert st == expect, doc
            return doc

        def util():
            return metric(cl.metrics(), "dsec_pool_utilization", '{pool="default"}')

        plain = [make() for _ in range(4)]
        assert {pool_of[d["node"]] for d in plain} == {"default"}
        assert util() == pytest.approx(0.5)
        # Exactly at the threshold: a burstable sandbox bursts (through the SDK's kwarg).
        sb = cl.client.create("sim:latest", cpu=0.1, memory_mb=64, burstable=True)
        assert sb.info["node"] == "c0" and sb.info["burstable"] is True
        assert sb.info["pool"] == "default"  # the pool asked for
        # Below it (3/8), it stays home.
        assert cl.api("DELETE", f"/v1/sandboxes/{plain.pop()['id']}")[0] == 200
        assert util() == pytest.approx(0.375)
        home = make(burstable=True)
        assert pool_of[home["node"]] == "default" and home["burstable"] is True
        # Not burstable: never the cloud pool, even with the default pool full
        # and room in the cloud.
        plain += [make() for _ in range(4)]
        assert util() == pytest.approx(1.0)
        st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "sim:latest", "cpu": 0.1,
                                                       "memory_mb": 64})
        assert st == 503 and doc["error"]["code"] == "unavailable", doc
        assert "pool 'default'" in doc["error"]["message"]
        assert make(burstable=True)["node"] == "c0"
        # The burst pool full (4/4): a burstable sandbox falls back to its own
        # pool while it has room, above the threshold too (7/8).
        make(pool="cloud")
        make(pool="cloud")
        assert cl.node("c0")["allocated"]["sandboxes"] == 4
        st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "sim:latest", "cpu": 0.1,
                                                       "memory_mb": 64, "burstable": True})
        assert st == 503 and "burst pool" in doc["error"]["message"], doc
        assert cl.api("DELETE", f"/v1/sandboxes/{plain.pop()['id']}")[0] == 200
        back = make(burstable=True)
        assert pool_of[back["node"]] == "default"
        # The default pool down: burstable sandboxes go to the cloud; others
        # fail naming the pool.
        for n in ("d0", "d1"):
            cl.edges[n].kill()
        assert wait_until(lambda: all(cl.node(n)["state"] == "down" for n in ("d0", "d1")),
                          HB_TIMEOUT_S + 5)
        assert util() == pytest.approx(1.0)
        assert cl.api("DELETE", f"/v1/sandboxes/{sb.id}")[0] == 200
        assert make(burstable=True)["node"] == "c0"
        st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "sim:latest", "cpu": 0.1,
                                                       "memory_mb": 64})
        assert st == 503 and doc["error"]["field"] == "pool", doc
        # Bursts are counted: at the threshold, with the pool full, with it down.
        m = cl.metrics()
        assert metric(m, "dsec_sandbox_bursts_total",
                      '{pool="default",burst_pool="cloud"}') == 3, m
        # Bad input names its field.
        st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "sim:latest", "burstable": "yes"})
        assert st == 400 and doc["error"]["field"] == "burstable", doc
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_burst_flags_are_checked(sim_root):
    for args, word in ((["--burst-threshold", "1.5"], "burst-threshold"),
                       (["--burst-pool", "no pool"], "burst-pool"),
                       (["--prestage", "cloud"], "prestage"),
                       (["--prestage", "cloud=a,,b"], "prestage")):
        r = subprocess.run([str(dsec_bin()), "platform", "--data-dir", sim_root / "p",
                            "--listen", "127.0.0.1:0", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and word in r.stderr, (args, r.stderr)


def test_computer_use_crosses_the_hop(sim_root):
    # A vm sandbox on a simulated node: the platform forwards screenshots and
    # input to the node, and the node's own answer comes back (a simulated
    # node has no display), no longer "not carried to remote nodes".
    cl = PoolCluster(sim_root)
    try:
        cl.start_platform()
        cl.add_edge("s0", "default", ["--simulate"])
        sim_image(cl, "disk", kind="disk")
        st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "disk:latest", "backend": "vm"})
        assert st == 201 and doc["node"] == "s0", doc
        sid = doc["id"]
        st, _, doc = cl.api("GET", f"/v1/sandboxes/{sid}/screenshot")
        assert st == 409 and doc["error"]["code"] == "failed_precondition", doc
        assert "(simulated node)" in doc["error"]["message"], doc
        for action in ({"type": "type", "text": "hi"}, {"type": "key", "key": "ctrl+c"},
                       {"type": "mouse", "x": 3, "y": 4, "button": "left"}):
            st, _, doc = cl.api("POST", f"/v1/sandboxes/{sid}/input", action)
            assert st == 409 and "(simulated node)" in doc["error"]["message"], (action, doc)
        # Bad input is refused by the platform before it reaches the node.
        st, _, doc = cl.api("POST", f"/v1/sandboxes/{sid}/input", {"type": "mouse", "x": 1})
        assert st == 400 and doc["error"]["field"] == "y", doc
    finally:
        problems = cl.shutdown()
    assert not problems, problems


# ---------------------------------------------------------------- real edges

def start_real_edge(cl, name, pool, extra=()):
    """A real edge on the platform's blob directory; `extra` picks its loader."""
    return cl.add_edge(name, pool, ["--blob-store", f"file://{cl.pdir}/blobs", *extra])


@pytest.fixture(scope="module")
def real_pools():
    _check_prerequisites()
    tar = IMAGE_CACHE / "busybox.tar"
    if not tar.is_file():
        unavailable(f"test image {tar} missing")
    root = Path(tempfile.mkdtemp(prefix="dsec-pools-", dir="/tmp"))
    cl = PoolCluster(root, ["--prestage", "cloud=busybox:latest"])
    names = ("n0", "c0")
    try:
        cl.start_platform()
        r = subprocess.run([str(dsec_bin()), "image", "import", "--data-dir", cl.pdir,
                            "--name", "busybox:latest", tar], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        # n0 reads the blob directory in place (direct); c0 keeps a node-local
        # cache filled by a loader (fanotify where the kernel allows, else FUSE).
        start_real_edge(cl, "n0", "default")
        try:
            start_real_edge(cl, "c0", "cloud", ["--loader", "fanotify"])
        except RuntimeError as e:
            print(f"fanotify loader unavailable, using fuse: {str(e)[-300:]}")
            start_real_edge(cl, "c0", "cloud", ["--loader", "fuse"])
        yield cl
    finally:
        problems = cl.shutdown()
        for name in names:
            cg = edge_cgroup_of(root / name)
            if sandbox_cgroup_dirs(cg):
                problems.append(f"{name}: sandbox cgroups left")
            if aether_pids(cg):
                problems.append(f"{name}: dsec-aether processes left")
        mounts = mounts_containing(str(root))
        if mounts:
            problems.append(f"mounts left: {mounts[:5]}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        if problems:
            pytest.fail("teardown:\n  " + "\n  ".join(problems), pytrace=False)


def test_cloud_node_prestages_layers_before_use(real_pools):
    cl = real_pools
    st, _, img = cl.api("GET", "/v1/images/busybox:latest")
    assert st == 200, img
    layers = img["layers"]
    # Before any sandbox exists, the cloud node reports the image's layers
    # cached; the default pool's node (not configured to) holds none.
    st, _, doc = cl.api("GET", "/v1/sandboxes")
    assert st == 200 and doc["sandboxes"] == [], doc
    assert wait_until(lambda: cl.node("c0")["layers"] == len(layers), 30), cl.nodes()
    assert cl.node("n0")["layers"] == 0
    edge_metrics = raw(cl.edges["c0"].url, "GET", "/metrics")[1].decode()
    assert metric(edge_metrics, "dsec_edge_prestaged_layers_total") == len(layers)
    # The node cache holds them whole: metadata and every byte of the data.
    cache = cl.root / "c0" / "cache"
    for digest in layers:
        assert (cache / f"{digest.split(':')[1]}.meta").is_file()
    datas = list(cache.glob("*.data"))
    assert datas, sorted(p.name for p in cache.iterdir())
    for d in datas:
        st_ = d.stat()
        assert st_.st_blocks * 512 >= st_.st_size, f"{d} is still sparse"
    # A sandbox on the cloud node needs nothing from the blob store: with the
    # store's directory moved away, it starts and reads its image.
    blobs = cl.pdir / "blobs"
    aside = cl.pdir / "blobs.aside"
    blobs.rename(aside)
    try:
        sb = cl.client.create("busybox:latest", pool="cloud", cpu=0.1, memory_mb=64)
        try:
            assert sb.info["node"] == "c0"
            r = sb.exec(["sh", "-c", "busybox | head -1; cat /bin/busybox | wc -c"])
            assert r.exit_code == 0 and "BusyBox" in r.stdout, (r.stdout, r.stderr)
        finally:
            sb.destroy()
    finally:
        aside.rename(blobs)
    assert metric(raw(cl.edges["c0"].url, "GET", "/metrics")[1].decode(),
                  "dsec_edge_prestage_failures_total") == 0


def test_pack_diff_on_a_remote_node(real_pools):
    cl = real_pools
    sb = cl.client.create("busybox:latest", pool="default", cpu=0.1, memory_mb=64)
    made = []
    try:
        assert sb.info["node"] == "n0"
        payload = bytes(range(256)) * 4000  # ~1 MB, binary
        sb.write_file("/root/data.bin", payload)
        r = sb.exec(["sh", "-c", "mkdir -p /work/d && echo hello > /work/d/a.txt && "
                                 "ln -s a.txt /work/d/link && rm /etc/nsswitch.conf && "
                                 "chmod 0751 /work/d && echo changed > /etc/passwd"])
        assert r.exit_code == 0, r.stderr
        st, _, snap = cl.api("POST", f"/v1/sandboxes/{sb.id}/pack_diff",
                             {"name": "remote-snap", "tag": "v1"}, timeout=300)
        assert st == 201, snap
        assert snap["kind"] == "diff" and len(snap["layers"]) == 1
        diff = snap["layers"][0]
        # Recorded on the platform, its blobs in the shared store.
        st, _, img = cl.api("GET", "/v1/images/remote-snap:v1")
        assert st == 200 and img["layers"] == [diff]
        assert (cl.pdir / "blobs" / "sha256" / diff.split(":")[1]).is_file()
        # Nothing left of the pack on the node.
        packs = cl.root / "n0" / "packs"
        assert not packs.exists() or not any(packs.iterdir()), list(packs.iterdir())
        # From the snapshot: on another node (it fetches the diff through its
        # loader) and on the same one.
        for pool, node in (("cloud", "c0"), ("default", "n0")):
            s2 = cl.client.create(snapshot="remote-snap:v1", pool=pool, cpu=0.1, memory_mb=64)
            made.append(s2)
            assert s2.info["node"] == node
            assert s2.read_file("/root/data.bin") == payload
            r = s2.exec(["sh", "-c", "cat /work/d/a.txt; readlink /work/d/link; "
                                     "stat -c %a /work/d; cat /etc/passwd; "
                                     "test -e /etc/nsswitch.conf && echo present || echo gone"])
            assert r.stdout == "hello\na.txt\n751\nchanged\ngone\n", (node, r.stdout, r.stderr)
        # An unknown sandbox cannot be packed.
        st, _, doc = cl.api("POST", "/v1/sandboxes/sb-0000000000000000/pack_diff",
                            {"name": "x"})
        assert st == 404, doc
    finally:
        for s in [sb, *made]:
            s.destroy()


def test_edge_pack_routes_need_the_platform_key(real_pools):
    cl = real_pools
    edge = cl.edges["n0"]
    for method, path in (("POST", "/edge/v1/sandboxes/sb-0000000000000000/pack_diff"),
                         ("GET", "/edge/v1/packs/abc/meta"), ("DELETE", "/edge/v1/packs/abc"),
                         ("GET", "/edge/v1/sandboxes/sb-0000000000000000/screenshot")):
        for token in (None, cl.token):
            st, _, doc = raw(edge.url, method, path, token=token)
            assert st == 401 and doc["error"]["code"] == "unauthenticated", (path, doc)
    key = json.loads((cl.root / "n0" / "node.json").read_text())["platform_key"]
    st, _, doc = raw(edge.url, "GET", "/edge/v1/packs/abc/meta", token=key)
    assert st == 404 and doc["error"]["code"] == "not_found", doc


def test_a_remote_exec_ends_with_its_client(real_pools):
    """An exec on a node that joined over the link: its client going away
    cancels the call on the link, and the node kills its process group."""
    import socket
    cl = real_pools
    sb = cl.client.create("busybox:latest", pool="cloud", cpu=0.1, memory_mb=64)
    try:
        def running():
            r = sb.exec(["sh", "-c", "ps -o args | grep -c '^[s]leep 7791$'"])
            return r.stdout.strip() != "0"
        for stream in (False, True):
            body = json.dumps({"cmd": ["sleep", "7791"], "timeout_s": 600,
                               "stream": stream}).encode()
            s = socket.create_connection(("127.0.0.1", cl.port), timeout=10)
            s.sendall(b"POST /v1/sandboxes/%s/exec HTTP/1.1\r\nHost: x\r\n"
                      b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % (sb.id.encode(), cl.token.encode(),
                                                          len(body)) + body)
            try:
                assert wait_until(running, 10), "the command never started"
            finally:
                s.close()
            assert wait_until(lambda: not running(), 10), f"outlived its client (stream {stream})"
    finally:
        sb.destroy()


def test_computer_use_on_a_remote_container_answers_as_locally(real_pools):
    cl = real_pools
    sb = cl.client.create("busybox:latest", pool="cloud", cpu=0.1, memory_mb=64)
    try:
        # Through the platform: the same 409 as for a local container sandbox.
        st, _, doc = cl.api("GET", f"/v1/sandboxes/{sb.id}/screenshot")
        assert st == 409 and doc["error"]["code"] == "failed_precondition", doc
        assert "has no display" in doc["error"]["message"]
        st, _, doc = cl.api("POST", f"/v1/sandboxes/{sb.id}/input", {"type": "key", "key": "a"})
        assert st == 409 and doc["error"]["code"] == "failed_precondition", doc
        assert "has no display" in doc["error"]["message"]
        # The node's own calls over HTTP are list/create/destroy only: the
        # platform reaches the rest (screenshot, input) over its link.
        key = json.loads((cl.root / "c0" / "node.json").read_text())["platform_key"]
        url = cl.edges["c0"].url
        st, _, doc = raw(url, "GET", f"/edge/v1/sandboxes/{sb.id}/screenshot", token=key)
        assert st == 404 and doc["error"]["code"] == "not_found", doc
    finally:
        sb.destroy()


# ---------------------------------------------------------------- a VM on a remote node

def test_computer_use_of_a_vm_on_a_remote_node(sim_root):
    # A real vm sandbox (QEMU, TCG here: a slow boot) on a `dsec edge`:
    # screenshots and keyboard/mouse input cross the node hop.
    _check_prerequisites()
    vm_image = IMAGE_CACHE / "vm-debian.qcow2"
    for tool in ("qemu-system-x86_64", "qemu-img"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} not installed")
    if not vm_image.is_file():
        unavailable(f"no {vm_image} (make vm-image)")
    cl = PoolCluster(sim_root)
    try:
        cl.start_platform()
        start_real_edge(cl, "v0", "default")
        r = subprocess.run([str(dsec_bin()), "image", "import", "--data-dir", cl.pdir,
                            "--kind", "disk", "--name", "vmdeb:latest", vm_image],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr
        c = dsec.Client(cl.platform.url, cl.token, timeout=900)
        t0 = time.monotonic()
        try:
            sb = c.create("vmdeb:latest", backend="vm", cpu=2, memory_mb=512)
        except dsec.DsecError as e:
            if e.code == "failed_precondition" and "not available on this node" in str(e):
                unavailable(f"vm backend unavailable on the node: {e}")
            raise
        print(f"remote vm boot: {time.monotonic() - t0:.1f} s")
        try:
            assert sb.info["node"] == "v0"
            png = sb.screenshot()
            assert png[:4] == b"\x89PNG", png[:16]
            sb.key("Return")
            sb.type("echo hi\n")
            sb.mouse(10, 10, "left")
            assert sb.screenshot()[:4] == b"\x89PNG"
        finally:
            sb.destroy()
    finally:
        problems = cl.shutdown()
    assert not problems, problems
