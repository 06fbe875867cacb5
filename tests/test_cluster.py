"""The platform and its edges as separate processes (docs/cluster.md).

One `dsec platform` and three real `dsec edge` processes on this machine, each
edge with its own data dir and port, sharing the platform's blob directory;
then a platform with simulated edges (`dsec edge --simulate`) for a burst.
Checked: placement spreads; node identity is in every sandbox; calls without
the right credential are refused both ways; an edge killed with SIGKILL leaves
its sandboxes `lost` and new ones go elsewhere; the edge restarted on its data
dir reconciles (its sandboxes run again; one deleted meanwhile is destroyed
there); a burst of 500 creates against simulated edges queues instead of
failing; a platform killed with SIGKILL and restarted loses nothing it
acknowledged and leaves no duplicates on the nodes.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import re
import signal
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

import pytest

import dsec
from conftest import IMAGE_CACHE, _check_prerequisites, dsec_bin, unavailable
from helpers import aether_pids, mounts_containing, sandbox_cgroup_dirs, tail, wait_until

HB_TIMEOUT_S = 2.0


def raw(url, method, path, body=None, token=None, timeout=30):
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    hdrs = {}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    if body is not None and not isinstance(body, (bytes, bytearray)):
        body = json.dumps(body).encode()
        hdrs["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        try:
            doc = json.loads(data) if data else None
        except ValueError:
            doc = None
        return resp.status, data, doc
    finally:
        conn.close()


class Proc:
    """A dsec process (platform or edge) with its own data dir and log."""

    def __init__(self, args, data_dir: Path, ready_file: str):
        self.args = [str(a) for a in args]
        self.data_dir = data_dir
        self.ready = data_dir / ready_file
        self.log_path = data_dir.parent / (data_dir.name + ".log")
        self.proc = None

    def start(self, timeout=30):
        with __import__("contextlib").suppress(FileNotFoundError):
            self.ready.unlink()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(dsec_bin()), *self.args], stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited {self.proc.returncode}:\n"
                                   f"{tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.args[0]} not ready in {timeout} s:\n{tail(self.log_path)}")
            time.sleep(0.05)
        self.url = json.loads(self.ready.read_text())["url"]
        return self

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)

    def stop(self):
        """SIGTERM and wait; the exit status."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"{self.args[0]} ignored SIGTERM:\n{tail(self.log_path)}")
        return self.proc.returncode if self.proc else 0


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def edge_cgroup_of(data_dir: Path) -> str:
    import hashlib
    return "e-" + hashlib.sha256(os.path.realpath(data_dir).encode()).hexdigest()[:12]


class Cluster:
    def __init__(self, root: Path, edges: int, simulate=False, sim_args=(), platform_args=()):
        self.root = root
        self.platform_args = list(platform_args)
        self.pdir = root / "platform"
        # A fixed port, so a restarted platform is where its edges look.
        self.port = free_port()
        self.platform = Proc(["platform", "--data-dir", self.pdir,
                              "--listen", f"127.0.0.1:{self.port}",
                              "--heartbeat-timeout-s", HB_TIMEOUT_S, *self.platform_args],
                             self.pdir, "up.json")
        self.simulate = simulate
        self.sim_args = list(sim_args)
        self.edges = []
        self.n_edges = edges

    def edge_proc(self, i: int) -> Proc:
        d = self.root / f"edge{i}"
        args = ["edge", "--platform", self.platform.url, "--data-dir", d,
                "--join-token-file", self.pdir / "join_token", "--listen", "127.0.0.1:0",
                "--name", f"n{i}", "--heartbeat-s", "0.3"]
        if self.simulate:
            args += ["--simulate", *self.sim_args]
        else:
            args += ["--blob-store", f"file://{self.pdir}/blobs"]
        return Proc(args, d, "edge.json")

    def start(self):
        self.platform.start()
        self.token = (self.pdir / "token").read_text().strip()
        self.client = dsec.Client(self.platform.url, self.token, timeout=60)
        for i in range(self.n_edges):
            self.edges.append(self.edge_proc(i).start())
        assert wait_until(lambda: len(self.nodes_up()) == self.n_edges, 10), self.nodes()
        return self

    def nodes(self):
        st, _, doc = raw(self.platform.url, "GET", "/v1/nodes", token=self.token)
        assert st == 200, doc
        return doc["nodes"]

    def nodes_up(self):
        return [n["name"] for n in self.nodes() if n["state"] == "up"]

    def api(self, method, path, body=None, timeout=60):
        return raw(self.platform.url, method, path, body, token=self.token, timeout=timeout)

    def shutdown(self):
        problems = []
        for e in self.edges:
            try:
                e.stop()
            except AssertionError as ex:
                problems.append(str(ex))
        try:
            self.platform.stop()
        except AssertionError as ex:
            problems.append(str(ex))
        return problems


@pytest.fixture(scope="module")
def real_cluster():
    _check_prerequisites()
    tar = IMAGE_CACHE / "busybox.tar"
    if not tar.is_file():
        unavailable(f"test image {tar} missing")
    root = Path(tempfile.mkdtemp(prefix="dsec-cl-", dir="/tmp"))
    # How fncall sandboxes run is the platform's to say, on every node
    # (test_fncall_on_joined_edges_runs_as_the_platform_says).
    cl = Cluster(root, 3, platform_args=["--fncall-language", "perl=perl -e",
                                         "--fncall-zygote-max-calls", "4"])
    cg = {i: edge_cgroup_of(root / f"edge{i}") for i in range(3)}
    try:
        cl.start()
        r = subprocess.run([str(dsec_bin()), "image", "import", "--data-dir", cl.pdir,
                            "--name", "busybox:latest", tar], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        yield cl
    finally:
        problems = cl.shutdown()
        for i, name in cg.items():
            left = sandbox_cgroup_dirs(name)
            if left:
                problems.append(f"edge{i}: sandbox cgroups left: {sorted(left)[:5]}")
            if aether_pids(name):
                problems.append(f"edge{i}: dsec-aether processes left")
        mounts = mounts_containing(str(root))
        if mounts:
            problems.append(f"mounts left: {mounts[:5]}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        if problems:
            pytest.fail("cluster teardown:\n  " + "\n  ".join(problems), pytrace=False)


def create(cl, **kw):
    body = {"image": "busybox:latest", "cpu": 0.1, "memory_mb": 64, **kw}
    st, _, doc = cl.api("POST", "/v1/sandboxes", body)
    assert st == 201, doc
    return doc


def test_nodes_join_and_list(real_cluster):
    cl = real_cluster
    nodes = {n["name"]: n for n in cl.nodes()}
    assert set(nodes) == {"n0", "n1", "n2"}
    for n in nodes.values():
        assert n["state"] == "up" and n["pool"] == "default" and not n["local"]
        assert n["capacity"]["slots"] > 0 and n["url"].startswith("http://127.0.0.1:")
        assert n["loadavg_1m"] >= 0
    st, _, doc = cl.api("GET", "/v1/nodes/n1")
    assert st == 200 and doc["name"] == "n1"
    st, _, doc = cl.api("GET", "/v1/nodes/nope")
    assert st == 404 and doc["error"]["code"] == "not_found"
    st, _, doc = raw(cl.platform.url, "GET", "/v1/nodes")
    assert st == 401 and doc["error"]["code"] == "unauthenticated"
    # The join token and the node credentials are files only root reads.
    for f in (cl.pdir / "join_token", cl.root / "edge0" / "node.json"):
        assert f.stat().st_mode & 0o077 == 0, f
    # The node registry is in the store (edge keys only as hashes), not in a file.
    assert not (cl.pdir / "nodes.json").exists()
    import sqlite3
    db = sqlite3.connect(cl.pdir / "state.db")
    try:
        rows = db.execute("SELECT name, edge_key_hash FROM nodes ORDER BY name").fetchall()
    finally:
        db.close()
    assert [r[0] for r in rows] == ["n0", "n1", "n2"]
    keys = json.loads((cl.root / "edge0" / "node.json").read_text())
    import hashlib
    assert rows[0][1] == hashlib.sha256(keys["edge_key"].encode()).hexdigest()
    # ... and never logged.
    token = (cl.pdir / "join_token").read_text().strip()
    for p in [cl.platform, *cl.edges]:
        assert token not in p.log_path.read_text()


def test_placement_spreads_and_calls_cross_the_hop(real_cluster):
    cl = real_cluster
    made = [create(cl) for _ in range(6)]
    try:
        per = {}
        for d in made:
            assert d["state"] == "running" and d["node"] in ("n0", "n1", "n2")
            per[d["node"]] = per.get(d["node"], 0) + 1
        assert per == {"n0": 2, "n1": 2, "n2": 2}, per
        for d in made[:3]:
            sb = cl.client.get(d["id"])
            assert sb.info["node"] == d["node"]
            r = sb.exec(["sh", "-c", "echo out-$HOSTNAME; echo err >&2; exit 3"])
            assert (r.stdout, r.stderr, r.exit_code) == (f"out-{d['id']}\n", "err\n", 3)
            events = list(sb.exec_stream(["sh", "-c", "echo a; sleep 0.3; echo b"]))
            out = [e.data for e in events if e.type == "stdout"]
            assert out == ["a\n", "b\n"], [e.raw for e in events]  # two events: streamed
            assert events[-1].type == "exit"
            sb.write_file("/tmp/x.bin", b"\x00\x01hello" * 1000)
            assert sb.read_file("/tmp/x.bin") == b"\x00\x01hello" * 1000
        nodes = {n["name"]: n for n in cl.nodes()}
        assert all(nodes[f"n{i}"]["allocated"]["sandboxes"] >= 2 for i in range(3))
    finally:
        for d in made:
            cl.api("DELETE", f"/v1/sandboxes/{d['id']}")


def test_terminal_on_a_joined_edge_takes_input_resize_and_signals(real_cluster):
    """A process session on a remote node: the platform's session drives
    the exec over the link (input, resize and signals in the call's body,
    the pid in a started event)."""
    cl = real_cluster
    d = create(cl)
    try:
        sb = cl.client.get(d["id"])
        term = sb.pty(["sh", "-i"], rows=20, cols=70, env={"PS1": "$ "})
        assert term.pid > 0

        def until(want: bytes) -> bytes:
            got = b""
            deadline = time.monotonic() + 30
            for ev in term.events():  # keepalives every 15 s bound the wait
                got += ev.data
                if want in got or ev.type in ("exit", "error") or time.monotonic() > deadline:
                    break
            assert want in got, got
            return got

        until(b"$ ")
        term.send("stty size\n")
        until(b"20 70")
        term.resize(45, 99)
        term.send("stty size\n")
        until(b"45 99")
        # SIGINT goes to the foreground job only, as a typed ^C would (a
        # shell abandons the rest of a command line whose job died of it).
        term.send("sleep 100\n")
        time.sleep(0.5)
        term.signal("INT")
        term.send("echo rc=$?\n")
        until(b"rc=130")
        term.send("exit 4\n")
        info = term.wait()
        assert info["exit_code"] == 4 and info["running"] is False, info
        bg = sb.start_process(["sh", "-c", "cat; echo end"], stdin=True)
        bg.send("over the hop\n")
        bg.close_stdin()
        out = b"".join(ev.data for ev in bg.events())
        assert out == b"over the hop\nend\n"
    finally:
        cl.api("DELETE", f"/v1/sandboxes/{d['id']}")


def test_exposed_port_on_a_joined_edge(real_cluster):
    """An exposed port of a sandbox on a remote node: the proxy's upstream is
    a link call (port_open) relayed both ways; unexpose cuts it on the node."""
    import http.client
    import socket
    cl = real_cluster
    d = create(cl)
    try:
        sb = cl.client.get(d["id"])
        sb.exec(["sh", "-c", "mkdir -p /tmp/www && head -c 3000000 /dev/zero | tr '\\0' x "
                 "> /tmp/www/big.txt && echo hello-from-$HOSTNAME > /tmp/www/index.html"])
        sb.start_process(["busybox", "httpd", "-f", "-p", "127.0.0.1:8000", "-h", "/tmp/www"])
        e = sb.expose(8000)
        host, port = cl.platform.url.split("//")[1].split(":")
        path = e.path_url[e.path_url.index("/ports/"):]
        deadline = time.monotonic() + 20
        while True:
            c = http.client.HTTPConnection(host, int(port), timeout=10)
            c.request("GET", path, headers={"Dsec-Port-Token": e.token})
            r = c.getresponse()
            body = r.read()
            c.close()
            if r.status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # httpd still starting: 502
        assert r.status == 200 and body == f"hello-from-{d['id']}\n".encode(), (r.status, body)
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        c.request("GET", path + "big.txt", headers={"Dsec-Port-Token": e.token})
        r = c.getresponse()
        assert r.status == 200 and r.read() == b"x" * 3000000
        c.close()
        # A slow download is cut by unexpose, through the node.
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(f"GET {path}big.txt HTTP/1.1\r\nHost: x\r\nDsec-Port-Token: {e.token}"
                  "\r\n\r\n".encode())
        s.recv(1000)
        sb.unexpose(8000)
        s.settimeout(5)
        got = 0
        t0 = time.monotonic()
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += len(chunk)
        s.close()
        assert got < 3000000 and time.monotonic() - t0 < 5, got
    finally:
        cl.api("DELETE", f"/v1/sandboxes/{d['id']}")


def test_fncall_on_joined_edges_runs_as_the_platform_says(real_cluster):
    """`dsec platform --fncall-language ... --fncall-zygote-max-calls 4`: a
    fncall sandbox on any joined edge runs the platform's languages and
    retires its python zygote after 4 calls (the spec carries the init
    frame's fncall object to the node), and one-shot calls of the configured
    language pass the platform's check."""
    cl = real_cluster
    tar = IMAGE_CACHE / "debian.tar"
    if not tar.is_file():
        unavailable(f"test image {tar} missing")
    r = subprocess.run([str(dsec_bin()), "image", "import", "--data-dir", cl.pdir,
                        "--name", "debian:latest", tar], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    made = [create(cl, image="debian:latest", backend="fncall", memory_mb=256)
            for _ in range(3)]
    try:
        assert sorted(d["node"] for d in made) == ["n0", "n1", "n2"], made
        for d in made:
            sb = cl.client.get(d["id"])
            r = sb.run("print 6*7, qq(\n)", language="perl")
            assert (r.exit_code, r.stdout) == (0, "42\n"), (d["node"], r)
            zygotes = [sb.run("import os; print(os.getppid())").stdout for _ in range(6)]
            assert zygotes[:4] == [zygotes[0]] * 4 and zygotes[4] != zygotes[0], zygotes
        r = cl.client.run("print 6*7, qq(\n)", language="perl", image="debian:latest")
        assert (r.exit_code, r.stdout) == (0, "42\n"), r
        e = None
        try:
            cl.client.run("x", language="cobol", image="debian:latest")
        except dsec.InvalidArgument as ex:
            e = ex
        assert e is not None and e.field == "language" and "perl" in e.message, e
    finally:
        for d in made:
            cl.api("DELETE", f"/v1/sandboxes/{d['id']}")


def test_bad_placement_input(real_cluster):
    cl = real_cluster
    st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "busybox:latest", "pool": "no pool!"})
    assert st == 400 and doc["error"]["field"] == "pool"
    st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "busybox:latest", "spread": "yes"})
    assert st == 400 and doc["error"]["field"] == "spread"


def test_unauthenticated_calls_refused_both_ways(real_cluster):
    cl = real_cluster
    edge = cl.edges[0]
    body = {"backend": "container", "spec": {"id": "sb-0000000000000bad", "layers": []}}
    # The edge obeys only the platform's key for it.
    for token in (None, "wrong", cl.token, (cl.pdir / "join_token").read_text().strip()):
        st, _, doc = raw(edge.url, "POST", "/edge/v1/sandboxes", body, token=token)
        assert st == 401 and doc["error"]["code"] == "unauthenticated", (token, doc)
        st, _, _ = raw(edge.url, "GET", "/edge/v1/sandboxes", token=token)
        assert st == 401
    key = json.loads((cl.root / "edge0" / "node.json").read_text())
    st, _, doc = raw(edge.url, "GET", "/edge/v1/sandboxes", token=key["platform_key"])
    assert st == 200 and "sandboxes" in doc
    # The platform accepts no unauthenticated edge: heartbeats, events, joins.
    hb = {"boot_id": "x", "capacity": {"cpus": 1, "memory_mb": 1, "slots": 1}, "sandboxes": []}
    for token in (None, "wrong", cl.token, key["platform_key"]):
        st, _, doc = raw(cl.platform.url, "POST", "/internal/v1/nodes/n0/heartbeat", hb, token=token)
        assert st == 401 and doc["error"]["code"] == "unauthenticated"
        st, _, doc = raw(cl.platform.url, "POST", "/internal/v1/nodes/n0/events",
                         {"sandbox": "sb-1"}, token=token)
        assert st == 401
    # Another node's key does not pass for n0.
    key1 = json.loads((cl.root / "edge1" / "node.json").read_text())
    st, _, _ = raw(cl.platform.url, "POST", "/internal/v1/nodes/n0/heartbeat", hb,
                   token=key1["edge_key"])
    assert st == 401
    join = {"name": "evil", "url": "http://127.0.0.1:1", "capacity": hb["capacity"]}
    st, _, doc = raw(cl.platform.url, "POST", "/internal/v1/join", join, token="wrong")
    assert st == 401 and doc["error"]["code"] == "unauthenticated"
    # An edge with a wrong join token does not get in.
    d = cl.root / "badedge"
    r = subprocess.run([str(dsec_bin()), "edge", "--platform", cl.platform.url, "--data-dir", d,
                        "--join-token", "0" * 64, "--simulate", "--name", "bad"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unauthenticated" in r.stderr, r.stderr
    assert "bad" not in [n["name"] for n in cl.nodes()]
    # Bad join input: clear errors naming the field.
    jt = (cl.pdir / "join_token").read_text().strip()
    for bad, field in (({**join, "name": "a b"}, "name"), ({**join, "url": "ftp://x"}, "url"),
                       ({"name": "x", "url": "http://127.0.0.1:1"}, "capacity")):
        st, _, doc = raw(cl.platform.url, "POST", "/internal/v1/join", bad, token=jt)
        assert st == 400 and doc["error"]["field"] == field, doc


def sandbox(cl, sid):
    st, _, doc = cl.api("GET", f"/v1/sandboxes/{sid}")
    assert st == 200, doc
    return doc


def test_edge_sigkill_lost_then_reconciled(real_cluster):
    cl = real_cluster
    made = [create(cl) for _ in range(6)]
    victim = cl.edges[2]
    on_victim = [d["id"] for d in made if d["node"] == "n2"]
    others = [d["id"] for d in made if d["node"] != "n2"]
    assert len(on_victim) == 2
    # A process in one of them proves it is the same sandbox after the return.
    cl.client.get(on_victim[0]).exec(["sh", "-c", "echo before > /tmp/mark"])
    victim.kill(signal.SIGKILL)
    t0 = time.monotonic()
    assert wait_until(lambda: all(sandbox(cl, i)["state"] == "lost" for i in on_victim), 15), \
        [sandbox(cl, i) for i in on_victim]
    lost_after = time.monotonic() - t0
    assert lost_after < HB_TIMEOUT_S + 3
    doc = sandbox(cl, on_victim[0])
    assert doc["node"] == "n2" and "n2" in doc["error"]
    assert [n["state"] for n in cl.nodes() if n["name"] == "n2"] == ["down"]
    assert all(sandbox(cl, i)["state"] == "running" for i in others)
    # Calls to a lost sandbox fail clearly; creates go to the other nodes.
    st, _, err = cl.api("POST", f"/v1/sandboxes/{on_victim[0]}/exec", {"cmd": ["true"]})
    assert st in (409, 503) and err["error"]["code"] in ("failed_precondition", "unavailable")
    fresh = [create(cl) for _ in range(3)]
    assert all(d["node"] in ("n0", "n1") for d in fresh), [d["node"] for d in fresh]
    # Deleted while its node is down: stopped now, destroyed on the node when it returns.
    st, _, doc = cl.api("DELETE", f"/v1/sandboxes/{on_victim[1]}")
    assert st == 200 and doc["state"] == "stopped", doc
    # The edge comes back on its data dir: it re-adopts what survived the crash.
    cl.edges[2] = victim = cl.edge_proc(2).start()
    assert wait_until(lambda: sandbox(cl, on_victim[0])["state"] == "running", 20), \
        sandbox(cl, on_victim[0])
    r = cl.client.get(on_victim[0]).exec(["cat", "/tmp/mark"])
    assert r.stdout == "before\n"
    key = json.loads((cl.root / "edge2" / "node.json").read_text())

    def edge_ids():
        return set(raw(victim.url, "GET", "/edge/v1/sandboxes", token=key["platform_key"])[2]
                   ["sandboxes"])
    assert wait_until(lambda: on_victim[1] not in edge_ids(), 10), edge_ids()
    assert on_victim[0] in edge_ids()
    # Metrics: per-node load, sandboxes by state, lost ones counted while they were.
    st, body, _ = cl.api("GET", "/metrics")
    text = body.decode()
    assert st == 200
    for name in ("dsec_node_up{node=\"n2\"", "dsec_sandboxes{state=\"lost\"}",
                 "dsec_schedule_latency_seconds_bucket", "dsec_sandbox_creations_total",
                 "dsec_schedule_queue_depth", "dsec_node_sandboxes{node=\"n0\"}",
                 "dsec_api_errors_total{code="):
        assert name in text, name
    st, body, _ = raw(victim.url, "GET", "/metrics")
    assert st == 200 and "dsec_edge_sandboxes" in body.decode()
    for d in made + fresh:
        cl.api("DELETE", f"/v1/sandboxes/{d['id']}")


# ----- simulated edges --------------------------------------------------------------

@pytest.fixture
def sim_root():
    if not dsec_bin().is_file():
        unavailable(f"{dsec_bin()} not built")
    root = Path(tempfile.mkdtemp(prefix="dsec-sim-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def burst(cl, n, workers=64, **kw):
    """n creates at once; returns (docs, errors, per-create seconds)."""
    def one(_):
        t = time.monotonic()
        st, _, doc = cl.api("POST", "/v1/sandboxes",
                            {"image": "sha256:" + "0" * 64, "cpu": 0.1, "memory_mb": 64, **kw},
                            timeout=120)
        return st, doc, time.monotonic() - t
    docs, errors, times = [], [], []
    with cf.ThreadPoolExecutor(workers) as ex:
        for st, doc, dt in ex.map(one, range(n)):
            times.append(dt)
            (docs if st == 201 else errors).append(doc)
    return docs, errors, times


def sim_layer(cl):
    """A layer record for the simulated sandboxes (they read nothing)."""
    import hashlib
    data = b"not really erofs"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    st, _, doc = raw(cl.platform.url, "PUT", f"/v1/blobs/{digest}", data, token=cl.token)
    assert st in (200, 201), doc
    return digest


def test_simulated_edges_take_a_burst_queued(sim_root):
    cl = Cluster(sim_root, 3, simulate=True,
                 sim_args=["--sim-latency-ms", "20", "--sim-capacity", "400"],
                 platform_args=["--max-inflight", "4", "--admission-wait-s", "60"])
    try:
        cl.start()
        st, _, doc = cl.api("POST", "/v1/images", {"name": "sim", "tag": "latest",
                                                    "layers": [sim_layer(cl)], "kind": "base"})
        assert st in (200, 201), doc
        t = time.monotonic()
        docs, errors, times = burst(cl, 500, image="sim:latest")
        wall = time.monotonic() - t
        assert not errors, errors[:3]
        per = {}
        for d in docs:
            per[d["node"]] = per.get(d["node"], 0) + 1
        assert len(docs) == 500 and set(per) == {"n0", "n1", "n2"}
        assert max(per.values()) - min(per.values()) <= 50, per
        # Simulated execs answer through the same hop.
        sb = cl.client.get(docs[0]["id"])
        assert sb.exec(["echo", "hi"]).stdout == "hi\n"
        st, body, _ = cl.api("GET", "/metrics")
        m = re.search(r"^dsec_sandbox_creations_total (\d+)", body.decode(), re.M)
        assert m and int(m.group(1)) == 500
        print(f"burst of 500 on 3 simulated edges (20 ms, 4 in flight each): {wall:.1f} s, "
              f"{500 / wall:.0f} creates/s, p50 {sorted(times)[250] * 1000:.0f} ms, "
              f"p99 {sorted(times)[495] * 1000:.0f} ms")
        # Past capacity (1200 slots, 500 used): a burst of 800 fills the nodes,
        # the rest is refused with a clear 503 after the admission wait.
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_admission_wait_expires_with_503(sim_root):
    cl = Cluster(sim_root, 1, simulate=True, sim_args=["--sim-capacity", "3"],
                 platform_args=["--admission-wait-s", "1"])
    try:
        cl.start()
        st, _, doc = cl.api("POST", "/v1/images", {"name": "sim", "tag": "latest",
                                                    "layers": [sim_layer(cl)], "kind": "base"})
        docs, errors, _ = burst(cl, 5, workers=5, image="sim:latest")
        assert len(docs) == 3 and len(errors) == 2
        for e in errors:
            assert e["error"]["code"] == "unavailable"
            assert "no node could take the sandbox within 1 s" in e["error"]["message"]
        st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "sim:latest", "pool": "gpu"})
        assert st == 503 and doc["error"]["field"] == "pool", doc
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_platform_sigkill_loses_nothing_acknowledged(sim_root):
    cl = Cluster(sim_root, 2, simulate=True, sim_args=["--sim-latency-ms", "30"],
                 platform_args=["--max-inflight", "4"])
    try:
        cl.start()
        cl.api("POST", "/v1/images", {"name": "sim", "tag": "latest",
                                      "layers": [sim_layer(cl)], "kind": "base"})
        acked = []

        def one(_):
            st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "sim:latest", "cpu": 0.1,
                                                          "memory_mb": 64}, timeout=30)
            return doc["id"] if st == 201 else None

        with cf.ThreadPoolExecutor(16) as ex:
            futs = [ex.submit(one, i) for i in range(200)]
            time.sleep(0.8)
            cl.platform.kill(signal.SIGKILL)  # mid-burst
            for f in futs:
                try:
                    sid = f.result()
                except Exception:  # cut off by the kill
                    sid = None
                if sid:
                    acked.append(sid)
        assert acked, "nothing was acknowledged before the kill"
        cl.platform.start()
        st, _, doc = cl.api("GET", "/v1/sandboxes?state=running")
        running = {s["id"] for s in doc["sandboxes"]}
        assert set(acked) <= running, set(acked) - running
        # No duplicates: once reconciled, the nodes run exactly what the platform records.
        keys = {i: json.loads((sim_root / f"edge{i}" / "node.json").read_text()) for i in range(2)}

        def on_nodes():
            ids = []
            for i, e in enumerate(cl.edges):
                ids += raw(e.url, "GET", "/edge/v1/sandboxes",
                           token=keys[i]["platform_key"])[2]["sandboxes"]
            return ids
        assert wait_until(lambda: sorted(on_nodes()) == sorted(running), 10), \
            (len(on_nodes()), len(running))
        assert len(set(on_nodes())) == len(on_nodes())
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_heartbeat_deltas_keep_the_orphan_check(sim_root):
    """Heartbeats carry what was added since the list the platform last
    acknowledged (docs/cluster.md): a delta against a token the platform
    does not hold, or of a node to reconcile, is answered with a request for
    the full list; an added id the platform never placed is destroyed."""
    cl = Cluster(sim_root, 1, simulate=True)
    try:
        cl.start()
        cl.api("POST", "/v1/images", {"name": "sim", "tag": "latest",
                                      "layers": [sim_layer(cl)], "kind": "base"})
        ids = []
        for _ in range(2):
            st, _, doc = cl.api("POST", "/v1/sandboxes", {"image": "sim:latest", "cpu": 0.1,
                                                          "memory_mb": 64})
            assert st == 201, doc
            ids.append(doc["id"])
        key = json.loads((sim_root / "edge0" / "node.json").read_text())["edge_key"]
        hb_path = "/internal/v1/nodes/n0/heartbeat"
        base = {"capacity": {"cpus": 8, "memory_mb": 8192, "slots": 1000}}
        # The real edge pauses, so only these heartbeats speak for n0.
        cl.edges[0].proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(0.5)  # a heartbeat of the edge already on the wire lands first
            # A new boot id: the node must be reconciled, which needs a full list.
            st, _, doc = raw(cl.platform.url, "POST", hb_path,
                             {**base, "boot_id": "t1", "since": "nope", "added": [], "count": 2},
                             token=key)
            assert st == 200 and doc.get("full") is True and "token" not in doc, doc
            st, _, doc = raw(cl.platform.url, "POST", hb_path,
                             {**base, "boot_id": "t1", "sandboxes": ids}, token=key)
            assert st == 200 and doc["destroy"] == [] and doc.get("token"), doc
            token = doc["token"]
            # A delta: the added id no record places there is to be destroyed.
            orphan = "sb-00000000deadbeef"
            st, _, doc = raw(cl.platform.url, "POST", hb_path,
                             {**base, "boot_id": "t1", "since": token, "added": [orphan],
                              "count": 3}, token=key)
            assert st == 200 and doc["destroy"] == [orphan] and doc.get("token"), doc
            assert doc["token"] != token
            node = [n for n in cl.nodes() if n["name"] == "n0"][0]
            assert node["reported_sandboxes"] == 3, node
            # The same token twice: not the list acknowledged last, so a full list.
            st, _, doc = raw(cl.platform.url, "POST", hb_path,
                             {**base, "boot_id": "t1", "since": token, "added": [], "count": 2},
                             token=key)
            assert st == 200 and doc.get("full") is True, doc
            # Bad bodies: clear errors, nothing changed.
            for bad in ({**base, "boot_id": "t1"},
                        {**base, "boot_id": "t1", "since": "x", "added": "sb-1", "count": 1},
                        {**base, "boot_id": "t1", "since": "x", "added": [], "count": "two"},
                        {**base, "boot_id": "t1", "sandboxes": [1, 2]}):
                st, _, doc = raw(cl.platform.url, "POST", hb_path, bad, token=key)
                assert st == 400 and doc["error"]["field"] == "sandboxes", (bad, doc)
        finally:
            cl.edges[0].proc.send_signal(signal.SIGCONT)
        # The edge's next heartbeats (its token is stale: a full list) keep both.
        time.sleep(1.5)
        for sid in ids:
            assert sandbox(cl, sid)["state"] == "running"
        assert "n0" in cl.nodes_up()
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_bulk_create_call_on_an_edge(sim_root):
    """POST /edge/v1/bulk/sandboxes (a batch's creations on one node in one
    call): one result per spec, in order; a bad spec refuses the whole call."""
    cl = Cluster(sim_root, 1, simulate=True, sim_args=["--sim-capacity", "3"])
    try:
        cl.start()
        pk = json.loads((sim_root / "edge0" / "node.json").read_text())["platform_key"]
        e = cl.edges[0].url
        specs = [{"id": "sb-00000000000000a%d" % i, "layers": []} for i in range(4)]
        for bad, field in (({"specs": []}, "specs"), ({"specs": "x"}, "specs"),
                           ({"specs": [specs[0], {"layers": []}]}, None)):
            st, _, doc = raw(e, "POST", "/edge/v1/bulk/sandboxes", bad, token=pk)
            assert st == 400, (bad, doc)
            if field:
                assert doc["error"]["field"] == field, doc
        st, _, doc = raw(e, "GET", "/edge/v1/sandboxes", token=pk)
        assert doc["sandboxes"] == []
        st, _, doc = raw(e, "POST", "/edge/v1/bulk/sandboxes", {"specs": specs}, token=pk)
        assert st == 200, doc
        res = doc["results"]
        assert [r["id"] for r in res] == [s["id"] for s in specs]
        assert all("error" not in r for r in res[:3]), res
        assert res[3]["error"]["code"] == "resource_exhausted", res  # capacity 3
        st, _, doc = raw(e, "POST", "/edge/v1/bulk/sandboxes", {"specs": specs}, token="wrong")
        assert st == 401
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_bulk_destroy_call_on_an_edge(sim_root):
    """POST /edge/v1/bulk/destroy (a bulk destroy's share of one node in one
    call): one result per id, in order, unknown ids included (destroy is
    idempotent); a bad list refuses the whole call and destroys nothing."""
    cl = Cluster(sim_root, 1, simulate=True)
    try:
        cl.start()
        pk = json.loads((sim_root / "edge0" / "node.json").read_text())["platform_key"]
        e = cl.edges[0].url
        specs = [{"id": "sb-00000000000000b%d" % i, "layers": []} for i in range(3)]
        st, _, doc = raw(e, "POST", "/edge/v1/bulk/sandboxes", {"specs": specs}, token=pk)
        assert st == 200, doc
        ids = [s["id"] for s in specs]
        for bad in ({"ids": []}, {"ids": "x"}, {"ids": [ids[0], 7]}, {},
                    {"ids": ["sb-x"] * 4097}):
            st, _, doc = raw(e, "POST", "/edge/v1/bulk/destroy", bad, token=pk)
            assert st == 400 and doc["error"]["field"] == "ids", (str(bad)[:80], doc)
        assert sorted(raw(e, "GET", "/edge/v1/sandboxes", token=pk)[2]["sandboxes"]) == ids
        st, _, doc = raw(e, "POST", "/edge/v1/bulk/destroy", {"ids": ids[:2]}, token="wrong")
        assert st == 401
        st, _, doc = raw(e, "POST", "/edge/v1/bulk/destroy", {"ids": ids[:2] + ["sb-gone"]},
                         token=pk)
        assert st == 200, doc
        assert [r["id"] for r in doc["results"]] == ids[:2] + ["sb-gone"], doc
        assert all("error" not in r for r in doc["results"]), doc
        assert raw(e, "GET", "/edge/v1/sandboxes", token=pk)[2]["sandboxes"] == ids[2:]
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_lost_sandbox_keeps_its_ttl(sim_root):
    cl = Cluster(sim_root, 2, simulate=True)
    try:
        cl.start()
        cl.api("POST", "/v1/images", {"name": "sim", "tag": "latest",
                                      "layers": [sim_layer(cl)], "kind": "base"})
        docs = [cl.api("POST", "/v1/sandboxes", {"image": "sim:latest", "ttl_s": ttl,
                                                 "spread": True})[2] for ttl in (4, 4, 600, 600)]
        on0 = [d for d in docs if d["node"] == "n0"]
        assert len(on0) == 2 and {d["ttl_s"] for d in on0} == {4, 600}, docs
        cl.edges[0].kill(signal.SIGKILL)
        assert wait_until(lambda: all(sandbox(cl, d["id"])["state"] == "lost" for d in on0), 10)
        short = next(d for d in on0 if d["ttl_s"] == 4)
        long_ = next(d for d in on0 if d["ttl_s"] == 600)
        assert wait_until(lambda: sandbox(cl, short["id"])["state"] == "stopped", 10)
        assert sandbox(cl, short["id"])["error"] == "ttl expired"
        assert sandbox(cl, long_["id"])["state"] == "lost"
        # Back on its data dir: the simulated node lost everything, so it stays lost.
        cl.edges[0] = cl.edge_proc(0).start()
        assert wait_until(lambda: "n0" in cl.nodes_up(), 10)
        time.sleep(1)
        assert sandbox(cl, long_["id"])["state"] == "lost"
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_edge_stopped_gracefully_reports_its_sandboxes(sim_root):
    cl = Cluster(sim_root, 2, simulate=True)
    try:
        cl.start()
        cl.api("POST", "/v1/images", {"name": "sim", "tag": "latest",
                                      "layers": [sim_layer(cl)], "kind": "base"})
        docs = [create(cl, image="sim:latest") for _ in range(4)]
        on1 = [d["id"] for d in docs if d["node"] == "n1"]
        assert on1
        assert cl.edges[1].stop() == 0
        for i in on1:
            assert wait_until(lambda: sandbox(cl, i)["state"] == "failed", 10), sandbox(cl, i)
            assert sandbox(cl, i)["error"] == "node n1 stopped", sandbox(cl, i)
        assert all(sandbox(cl, d["id"])["state"] == "running" for d in docs if d["node"] == "n0")
    finally:
        problems = cl.shutdown()
    assert not problems, problems


def test_dsec_up_takes_joining_edges_beside_its_own_node(sim_root):
    _check_prerequisites()
    up = Proc(["up", "--data-dir", sim_root / "up", "--listen", "127.0.0.1:0"], sim_root / "up",
               "up.json")
    edge = None
    try:
        up.start()
        token = (sim_root / "up" / "token").read_text().strip()
        edge = Proc(["edge", "--simulate", "--platform", up.url, "--data-dir", sim_root / "e",
                     "--join-token-file", sim_root / "up" / "join_token", "--name", "s0",
                     "--pool", "sim", "--heartbeat-s", "0.3"], sim_root / "e", "edge.json").start()

        def nodes():
            return {n["name"]: n for n in raw(up.url, "GET", "/v1/nodes", token=token)[2]["nodes"]}
        assert wait_until(lambda: nodes().get("s0", {}).get("state") == "up", 10), nodes()
        assert nodes()["local"]["local"] and nodes()["local"]["pool"] == "default"
        data = b"sim layer"
        import hashlib
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        raw(up.url, "PUT", f"/v1/blobs/{digest}", data, token=token)
        raw(up.url, "POST", "/v1/images", {"name": "sim", "tag": "latest", "layers": [digest]},
            token=token)
        st, _, doc = raw(up.url, "POST", "/v1/sandboxes", {"image": "sim:latest", "pool": "sim"},
                         token=token)
        assert st == 201 and doc["node"] == "s0" and doc["pool"] == "sim", doc
        assert raw(up.url, "GET", "/v1/node", token=token)[0] == 200  # the local node's view
        assert raw(up.url, "DELETE", f"/v1/sandboxes/{doc['id']}", token=token)[0] == 200
    finally:
        problems = []
        for p in (edge, up):
            if p:
                try:
                    p.stop()
                except AssertionError as e:
                    problems.append(str(e))
    assert not problems, problems
