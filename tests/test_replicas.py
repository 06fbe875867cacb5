"""Two `dsec platform` replicas on one PostgreSQL serve one cluster
(docs/cluster.md, "Replicas").

A throwaway PostgreSQL of our own (tests/pg_cluster.py), two platforms on it
(own data dirs, fixed ports, the second sharing the first's blob directory and
API token), and edges given both URLs (`--platform A,B`). Simulated edges for
the counts; real container edges for a create through one replica used and
destroyed through the other. Checked: both replicas see every node and
sandbox; one replica killed with SIGKILL mid-burst loses nothing it
acknowledged, leaves no duplicate and no record stuck in `creating`, and its
edges fail over to the other; the killed replica restarted rejoins; node
down-detection and reconciling work with one replica dead; the store, not a
nodes.json, holds the node registry (a nodes.json of an older release is moved
in).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import IMAGE_CACHE, _check_prerequisites, dsec_bin, unavailable
from helpers import aether_pids, mounts_containing, sandbox_cgroup_dirs, wait_until
from pg_cluster import Unavailable, start_cluster
from test_cluster import Proc, edge_cgroup_of, free_port, raw, sim_layer

HB_TIMEOUT_S = 2.0
PASSWORD = "pw-" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def pg():
    if not dsec_bin().is_file():
        unavailable(f"{dsec_bin()} not built")
    try:
        cluster = start_cluster(PASSWORD)
    except Unavailable as e:
        unavailable(f"PostgreSQL unavailable: {e}")
    yield cluster
    cluster.stop()


class Replicas:
    """Platforms A and B on one database, and edges that know both."""

    def __init__(self, root: Path, uri: str, edges: int, simulate=True, sim_args=(),
                 platform_args=()):
        self.root = root
        self.uri = uri
        self.simulate = simulate
        self.sim_args = list(sim_args)
        self.n_edges = edges
        self.edges = []
        self.platforms = {}
        self.ports = {"A": free_port(), "B": free_port()}
        for name in ("A", "B"):
            d = root / f"platform{name}"
            self.platforms[name] = Proc(
                ["platform", "--data-dir", d, "--listen", f"127.0.0.1:{self.ports[name]}",
                 "--store", uri, "--heartbeat-timeout-s", HB_TIMEOUT_S, "--lease-ttl-s", "2",
                 *platform_args], d, "up.json")

    @property
    def a(self):
        return self.platforms["A"]

    @property
    def b(self):
        return self.platforms["B"]

    def url(self, name):
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self):
        self.a.start()
        self.token = (self.a.data_dir / "token").read_text().strip()
        # B shares A's API token and blob directory (docs/cluster.md).
        bdir = self.b.data_dir
        bdir.mkdir(mode=0o700)
        shutil.copy(self.a.data_dir / "token", bdir / "token")
        os.chmod(bdir / "token", 0o600)
        os.symlink(self.a.data_dir / "blobs", bdir / "blobs")
        self.b.start()
        for i in range(self.n_edges):
            self.edges.append(self.edge_proc(i).start())
        for p in ("A", "B"):
            assert wait_until(lambda: len(self.nodes_up(p)) == self.n_edges, 15), self.nodes(p)
        return self

    def edge_proc(self, i: int, order=("A", "B")) -> Proc:
        d = self.root / f"edge{i}"
        args = ["edge", "--platform", ",".join(self.url(p) for p in order), "--data-dir", d,
                "--join-token-file", self.a.data_dir / "join_token", "--listen", "127.0.0.1:0",
                "--name", f"n{i}", "--heartbeat-s", "0.3"]
        if self.simulate:
            args += ["--simulate", *self.sim_args]
        else:
            args += ["--blob-store", f"file://{self.a.data_dir}/blobs"]
        return Proc(args, d, "edge.json")

    def api(self, p, method, path, body=None, timeout=60):
        return raw(self.url(p), method, path, body, token=self.token, timeout=timeout)

    def nodes(self, p):
        st, _, doc = self.api(p, "GET", "/v1/nodes")
        assert st == 200, doc
        return doc["nodes"]

    def nodes_up(self, p):
        return [n["name"] for n in self.nodes(p) if n["state"] == "up"]

    def sandboxes(self, p, state=None):
        st, _, doc = self.api(p, "GET", "/v1/sandboxes" + (f"?state={state}" if state else ""))
        assert st == 200, doc
        return {s["id"]: s for s in doc["sandboxes"]}

    def on_edges(self):
        """Every sandbox id each edge runs, asked with its platform key."""
        ids = []
        for i, e in enumerate(self.edges):
            key = json.loads((self.root / f"edge{i}" / "node.json").read_text())["platform_key"]
            st, _, doc = raw(e.url, "GET", "/edge/v1/sandboxes", token=key)
            assert st == 200, doc
            ids += doc["sandboxes"]
        return ids

    def shutdown(self):
        problems = []
        for proc in [*self.edges, *self.platforms.values()]:
            try:
                proc.stop()
            except AssertionError as ex:
                problems.append(str(ex))
        return problems


@pytest.fixture
def root():
    r = Path(tempfile.mkdtemp(prefix="dsec-rep-", dir="/tmp"))
    yield r
    shutil.rmtree(r, ignore_errors=True)


def fresh_db(pg) -> str:
    name = "r" + uuid.uuid4().hex[:10]
    pg.create_database(name)
    return pg.uri(name)


def sim_image(rep):
    class _C:  # sim_layer wants .platform.url and .token
        pass
    c = _C()
    c.platform, c.token = rep.a, rep.token
    st, _, doc = rep.api("A", "POST", "/v1/images", {"name": "sim", "tag": "latest",
                                                     "layers": [sim_layer(c)], "kind": "base"})
    assert st in (200, 201), doc


def create(rep, p, **kw):
    body = {"image": "sim:latest", "cpu": 0.1, "memory_mb": 64, **kw}
    st, _, doc = rep.api(p, "POST", "/v1/sandboxes", body)
    assert st == 201, doc
    return doc


def exec_echo(rep, p, sid, word):
    st, _, doc = rep.api(p, "POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["echo", word]})
    return st, doc


def test_both_replicas_serve_one_cluster(pg, root):
    rep = Replicas(root, fresh_db(pg), 2, sim_args=["--sim-latency-ms", "5"])
    try:
        rep.start()
        sim_image(rep)
        # The registry is in the store: no nodes.json, and B knows nodes that
        # joined through A (the edges try A first).
        assert not (rep.a.data_dir / "nodes.json").exists()
        assert {n["name"] for n in rep.nodes("B")} == {"n0", "n1"}
        # A create through A is seen, used and destroyed through B at once.
        d = create(rep, "A")
        st, _, got = rep.api("B", "GET", f"/v1/sandboxes/{d['id']}")
        assert st == 200 and got["state"] == "running" and got["node"] == d["node"], got
        st, doc = exec_echo(rep, "B", d["id"], "via-b")
        assert st == 200 and doc["stdout"] == "via-b\n", doc
        assert d["id"] in rep.sandboxes("B")
        st, _, doc = rep.api("B", "DELETE", f"/v1/sandboxes/{d['id']}")
        assert st == 200 and doc["state"] == "stopped", doc
        # A follows: stopped there too, and calls through A refuse it.
        assert wait_until(lambda: rep.sandboxes("A")[d["id"]]["state"] == "stopped", 5)
        st, doc = exec_echo(rep, "A", d["id"], "x")
        assert st == 409, doc
        assert d["id"] not in rep.on_edges()
        # And the other way round.
        e = create(rep, "B")
        st, doc = exec_echo(rep, "A", e["id"], "via-a")
        assert st == 200 and doc["stdout"] == "via-a\n", doc
        # One leader between them.
        leaders = pg.psql("SELECT holder FROM leases WHERE name='leader'",
                          db=rep.uri.rsplit("/", 1)[1]).split()
        assert len(leaders) == 1, leaders
        # A third platform claiming B's replica id is refused while B lives.
        dup = root / "platformC"
        r = subprocess.run([str(dsec_bin()), "platform", "--data-dir", dup, "--listen",
                            "127.0.0.1:0", "--store", rep.uri, "--replica-id",
                            "r-" + (rep.b.data_dir / "replica_id").read_text().strip()[:12]],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "is held by a live platform" in r.stderr + r.stdout, r
    finally:
        problems = rep.shutdown()
    assert not problems, problems


def test_replica_sigkill_mid_burst_loses_nothing(pg, root):
    rep = Replicas(root, fresh_db(pg), 3, sim_args=["--sim-latency-ms", "30"],
                   platform_args=["--max-inflight", "4"])
    try:
        rep.start()
        sim_image(rep)
        acked = {}

        def one(i):
            p = "AB"[i % 2]
            try:
                st, _, doc = rep.api(p, "POST", "/v1/sandboxes",
                                     {"image": "sim:latest", "cpu": 0.1, "memory_mb": 64},
                                     timeout=60)
            except Exception:  # cut off by the kill
                return None
            return (p, doc["id"]) if st == 201 else None

        with cf.ThreadPoolExecutor(16) as ex:
            futs = [ex.submit(one, i) for i in range(300)]
            time.sleep(1.0)
            rep.a.kill(signal.SIGKILL)  # mid-burst
            for f in futs:
                r = f.result()
                if r:
                    acked[r[1]] = r[0]
        via = {p: sum(1 for v in acked.values() if v == p) for p in "AB"}
        assert via["A"] > 0 and via["B"] > 0, via
        # Every acknowledged sandbox is there and usable through B.
        running = rep.sandboxes("B", "running")
        assert set(acked) <= set(running), set(acked) - set(running)
        for sid in list(acked)[:: max(1, len(acked) // 10)]:
            st, doc = exec_echo(rep, "B", sid, "alive")
            assert st == 200 and doc["stdout"] == "alive\n", doc
        # The edges failed over to B: no node went down.
        assert set(rep.nodes_up("B")) == {"n0", "n1", "n2"}
        # A's creates in flight: none stays `creating` (B, the leader now,
        # fails them), and once reconciled the edges run exactly the live
        # records, each once.
        assert wait_until(lambda: not rep.sandboxes("B", "creating"), 15), \
            rep.sandboxes("B", "creating")
        live = set(rep.sandboxes("B", "running"))
        assert wait_until(lambda: sorted(rep.on_edges()) == sorted(live), 10), \
            (len(rep.on_edges()), len(live))
        ids = rep.on_edges()
        assert len(ids) == len(set(ids))
        # A restarted rejoins: it sees everything and serves again.
        rep.a.start()
        assert set(acked) <= set(rep.sandboxes("A", "running"))
        d = create(rep, "A")
        st, doc = exec_echo(rep, "A", d["id"], "back")
        assert st == 200 and doc["stdout"] == "back\n", doc
        print(f"burst of 300 over two replicas, A killed after 1 s: {len(acked)} acknowledged "
              f"({via['A']} via A, {via['B']} via B), all kept")
    finally:
        problems = rep.shutdown()
    assert not problems, problems


def test_node_down_detection_with_one_replica_dead(pg, root):
    rep = Replicas(root, fresh_db(pg), 2, sim_args=["--sim-latency-ms", "5"])
    try:
        rep.start()
        sim_image(rep)
        made = [create(rep, "AB"[i % 2]) for i in range(6)]
        # Whichever leads, kill it: the other must take over down-marking.
        dead = leader_of(rep, pg)
        alive = "B" if dead == "A" else "A"
        rep.platforms[dead].kill(signal.SIGKILL)
        victim = made[0]["node"]
        i = int(victim[1:])
        rep.edges[i].kill(signal.SIGKILL)
        on_victim = {d["id"] for d in made if d["node"] == victim}
        assert wait_until(lambda: victim not in rep.nodes_up(alive), HB_TIMEOUT_S + 8), \
            rep.nodes(alive)
        assert wait_until(lambda: all(rep.sandboxes(alive)[s]["state"] == "lost"
                                      for s in on_victim), 5)
        others = {d["id"] for d in made} - on_victim
        assert all(rep.sandboxes(alive)[s]["state"] == "running" for s in others)
        # Not flapping: it stays down, and the survivor's other node stays up.
        time.sleep(1.5)
        assert victim not in rep.nodes_up(alive) and len(rep.nodes_up(alive)) == 1
        # The simulated edge restarted has none of them: they stay lost. The
        # dead replica restarted agrees on everything.
        rep.edges[i] = rep.edge_proc(i).start()
        assert wait_until(lambda: victim in rep.nodes_up(alive), 10)
        rep.platforms[dead].start()
        assert wait_until(lambda: set(rep.nodes_up(dead)) == {"n0", "n1"}, 10)
        for s in on_victim:
            assert rep.sandboxes(dead)[s]["state"] == "lost"
        d = create(rep, dead)
        assert d["state"] == "running"
    finally:
        problems = rep.shutdown()
    assert not problems, problems


def leader_of(rep, pg):
    holder = pg.psql("SELECT holder FROM leases WHERE name='leader'",
                     db=rep.uri.rsplit("/", 1)[1]).strip()
    a_id = "r-" + (rep.a.data_dir / "replica_id").read_text().strip()[:12]
    return "A" if holder.split("/")[0] == a_id else "B"


def test_calls_through_the_other_replica_keep_an_idle_sandbox(pg, root):
    rep = Replicas(root, fresh_db(pg), 1, sim_args=["--sim-latency-ms", "5"])
    try:
        rep.start()
        sim_image(rep)
        lead = leader_of(rep, pg)
        other = "B" if lead == "A" else "A"
        d = create(rep, lead, idle_timeout_s=3)
        # Used only through the replica that does not run the idle timers.
        end = time.monotonic() + 6
        while time.monotonic() < end:
            st, doc = exec_echo(rep, other, d["id"], "busy")
            assert st == 200, doc
            time.sleep(0.5)
        assert rep.sandboxes(lead)[d["id"]]["state"] == "running"
        # Left alone, the leader stops it.
        assert wait_until(lambda: rep.sandboxes(other)[d["id"]]["state"] == "stopped", 8)
        assert rep.sandboxes(other)[d["id"]]["error"] == "idle timeout"
    finally:
        problems = rep.shutdown()
    assert not problems, problems


def test_nodes_json_of_an_older_release_moves_into_the_store(pg, root):
    """A platform upgraded in place: its nodes.json becomes store rows, and its
    edges' saved keys still work."""
    uri = fresh_db(pg)
    rep = Replicas(root, uri, 1, sim_args=["--sim-latency-ms", "5"])
    pdir = rep.a.data_dir
    pdir.mkdir(mode=0o700)
    edge_key, platform_key = uuid.uuid4().hex * 2, uuid.uuid4().hex * 2
    (pdir / "nodes.json").write_text(json.dumps({"nodes": [
        {"name": "n0", "pool": "default", "url": "http://127.0.0.1:1",
         "edge_key": edge_key, "platform_key": platform_key}]}))
    os.chmod(pdir / "nodes.json", 0o600)
    edir = root / "edge0"
    edir.mkdir(mode=0o700)
    (edir / "node.json").write_text(json.dumps({"node": "n0", "edge_key": edge_key,
                                                "platform_key": platform_key}))
    os.chmod(edir / "node.json", 0o600)
    try:
        rep.a.start()
        assert not (pdir / "nodes.json").exists() and (pdir / "nodes.json.migrated").exists()
        rows = pg.psql("SELECT name, edge_key_hash, platform_key FROM nodes",
                       db=uri.rsplit("/", 1)[1]).split("|")
        import hashlib
        assert rows[0] == "n0" and rows[1] == hashlib.sha256(edge_key.encode()).hexdigest()
        assert edge_key not in pg.psql("SELECT * FROM nodes", db=uri.rsplit("/", 1)[1])
        # The edge heartbeats with its old keys: no re-join (its join token is wrong).
        rep.token = (pdir / "token").read_text().strip()
        bad = root / "bad_token"
        bad.write_text("x" * 64)
        e = Proc(["edge", "--platform", rep.url("A"), "--data-dir", edir, "--join-token-file",
                  bad, "--listen", "127.0.0.1:0", "--name", "n0", "--heartbeat-s", "0.3",
                  "--simulate"], edir, "edge.json")
        rep.edges.append(e.start())
        assert wait_until(lambda: rep.nodes_up("A") == ["n0"], 10), rep.nodes("A")
        assert wait_until(lambda: rep.nodes("A")[0]["url"] == e.url, 5)
    finally:
        problems = rep.shutdown()
    assert not problems, problems


# ----- real container edges ----------------------------------------------------------

def test_real_edges_create_through_one_replica_use_through_the_other(pg, root):
    _check_prerequisites()
    tar = IMAGE_CACHE / "busybox.tar"
    if not tar.is_file():
        unavailable(f"test image {tar} missing")
    rep = Replicas(root, fresh_db(pg), 2, simulate=False)
    cg = {i: edge_cgroup_of(root / f"edge{i}") for i in range(2)}
    problems = []
    try:
        rep.start()
        r = subprocess.run([str(dsec_bin()), "image", "import", "--data-dir", rep.a.data_dir,
                            "--name", "busybox:latest", tar], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        body = {"image": "busybox:latest", "cpu": 0.1, "memory_mb": 64}
        st, _, d = rep.api("A", "POST", "/v1/sandboxes", body)
        assert st == 201, d
        st, _, doc = rep.api("B", "POST", f"/v1/sandboxes/{d['id']}/exec",
                             {"cmd": ["sh", "-c", "echo out-$HOSTNAME; exit 3"]})
        assert st == 200 and doc["stdout"] == f"out-{d['id']}\n" and doc["exit_code"] == 3, doc
        # A create through B lands on a node and answers through A.
        st, _, e = rep.api("B", "POST", "/v1/sandboxes", body)
        assert st == 201, e
        st, _, doc = rep.api("A", "POST", f"/v1/sandboxes/{e['id']}/exec", {"cmd": ["true"]})
        assert st == 200 and doc["exit_code"] == 0, doc
        exposed_through_one_replica_cut_through_the_other(rep, d["id"])
        for sid in (d["id"], e["id"]):
            st, _, doc = rep.api("B" if sid == d["id"] else "A", "DELETE", f"/v1/sandboxes/{sid}")
            assert st == 200 and doc["state"] == "stopped", doc
        assert wait_until(lambda: not rep.on_edges(), 5), rep.on_edges()
    finally:
        problems = rep.shutdown()
        for i, name in cg.items():
            if sandbox_cgroup_dirs(name):
                problems.append(f"edge{i}: sandbox cgroups left")
            if aether_pids(name):
                problems.append(f"edge{i}: dsec-aether processes left")
        if mounts_containing(str(root)):
            problems.append(f"mounts left: {mounts_containing(str(root))[:5]}")
    assert not problems, problems


def exposed_through_one_replica_cut_through_the_other(rep, sid):
    """Exposed ports (docs/ports.md): B serves A's exposure with the same
    token (an HMAC of the shared platform token, nothing stored), and an
    unexpose through A cuts B's connection on the node."""
    import socket
    st, _, doc = rep.api("A", "POST", f"/v1/sandboxes/{sid}/exec", {"cmd": [
        "sh", "-c", "mkdir -p /tmp/www && head -c 4000000 /dev/zero | tr '\\0' y > /tmp/www/big "
        "&& echo hi > /tmp/www/index.html"]})
    assert st == 200 and doc["exit_code"] == 0, doc
    st, _, doc = rep.api("A", "POST", f"/v1/sandboxes/{sid}/processes",
                         {"cmd": ["busybox", "httpd", "-f", "-p", "127.0.0.1:8000", "-h", "/tmp/www"]})
    assert st == 201, doc
    st, _, exp = rep.api("A", "POST", f"/v1/sandboxes/{sid}/ports", {"port": 8000})
    assert st == 201, exp
    path = f"/ports/{sid}/8000/"

    def get_b(p):
        s = socket.create_connection(("127.0.0.1", rep.ports["B"]), timeout=10)
        s.sendall(f"GET {p} HTTP/1.1\r\nHost: x\r\nDsec-Port-Token: {exp['token']}\r\n\r\n"
                  .encode())
        return s

    def whole(s):
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    assert wait_until(lambda: b"200 OK" in whole(get_b(path)), 10)
    s = get_b(path + "big")
    assert b" 200 " in s.recv(100)
    st, _, doc = rep.api("A", "DELETE", f"/v1/sandboxes/{sid}/ports/8000")
    assert st == 204, doc
    s.settimeout(5)
    t0 = time.monotonic()
    got = len(whole(s))
    assert got < 4000000 and time.monotonic() - t0 < 5, got
    # And the token no longer opens anything on B.
    assert b" 401 " in whole(get_b(path)).split(b"\r\n", 1)[0] + b" "


def test_batch_resumed_by_one_replica_only(pg, root):
    """A batch's pending records are resumed only by the replica that wins its
    claim in the store (docs/batches.md): a replica restarting while another
    creates the batch leaves it alone, and of two replicas starting together
    after its creator died, exactly one resumes it. The batch ends with
    exactly `count` sandboxes, each on one node once."""
    n = 160
    rep = Replicas(root, fresh_db(pg), 2, sim_args=["--sim-latency-ms", "100"],
                   platform_args=["--max-inflight", "2", "--batch-workers", "8"])
    logs = {p: rep.platforms[p].log_path for p in "AB"}

    def log_from(p, off):
        with open(logs[p], "rb") as f:
            f.seek(off)
            return f.read().decode(errors="replace")
    try:
        rep.start()
        sim_image(rep)
        st, _, b = rep.api("A", "POST", "/v1/batches",
                           {"count": n, "spec": {"image": "sim:latest", "cpu": 0.1,
                                                 "memory_mb": 64}})
        assert st == 202, b
        bid = b["id"]
        time.sleep(0.5)
        # B restarts while A creates the batch: it must not resume it.
        off_b = logs["B"].stat().st_size
        assert rep.b.stop() == 0
        rep.b.start()
        text = log_from("B", off_b)
        assert f"batch {bid}: claimed by another live replica" in text, text[-2000:]
        assert "resuming batches" not in text
        st, _, doc = rep.api("A", "GET", f"/v1/batches/{bid}")
        assert doc["pending"] > 0, "the batch ended before the restarts; slow it down"
        # A dies mid-batch; A and B start together: one of them resumes it.
        rep.a.kill(signal.SIGKILL)
        off = {p: logs[p].stat().st_size for p in "AB"}
        rep.b.stop()
        with cf.ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda p: rep.platforms[p].start(timeout=60), "AB"))
        # B's claim attempt may come after A's old claim lapsed (10 s) or not;
        # either way exactly one resumes, and a loser says why.
        winners = [p for p in "AB" if "resuming batches" in log_from(p, off[p])]
        assert len(winners) == 1, {p: log_from(p, off[p])[-1500:] for p in "AB"}
        w = winners[0]

        def batch_sandboxes():
            st, _, doc = rep.api(w, "GET", f"/v1/sandboxes?batch={bid}")
            assert st == 200, doc
            return doc["sandboxes"]
        assert wait_until(lambda: sum(s["state"] == "running" for s in batch_sandboxes()) == n,
                          120), len(batch_sandboxes())
        live = {s["id"] for s in batch_sandboxes() if s["state"] == "running"}
        # Once reconciled the nodes run exactly those, each once.
        assert wait_until(lambda: sorted(rep.on_edges()) == sorted(live), 40), \
            (len(rep.on_edges()), len(live))
        st, _, doc = rep.api(w, "GET", f"/v1/batches/{bid}")
        assert doc["state"] == "done" and doc["running"] == n and doc["failed"] == 0, doc
    finally:
        problems = rep.shutdown()
    assert not problems, problems


def test_one_pull_per_cluster_the_other_replica_waits(pg, root, tmp_path):
    """Both replicas asked to pull one image at once fetch each registry layer
    once between them: the replica that claimed a layer (a `pull-layer:`
    lease in the store) fetches and converts it, the other waits and takes
    its layer (dsec_pull_layers_total{result="awaited"})."""
    import dsec
    import re
    import threading
    from oci_build import OciLayout, file
    from oci_registry import Registry
    from registry_proxy import RegistryProxy

    rep = Replicas(root, fresh_db(pg), 0)
    try:
        rep.start()
        lay = OciLayout(tmp_path / "oci")
        for i in range(3):
            lay.add_layer([file(f"l{i}.bin", os.urandom(2 << 20))])
        lay.write("v1")
        with Registry(tmp_path) as reg, RegistryProxy(reg) as proxy:
            repo = "rep-" + uuid.uuid4().hex[:8]
            reg.push_oci(tmp_path / "oci", repo, "v1")
            for d in lay.layers:  # slow enough for the two pulls to meet
                proxy.stall(1.0, digest=d["digest"], after=1 << 20)
            ref = f"{proxy.host}/{repo}:v1"
            got, errs = {}, []

            def pull(p):
                try:
                    c = dsec.Client(rep.url(p), rep.token, timeout=120)
                    got[p] = c.pull_image(ref, insecure_registry=True).layers
                except Exception as e:  # noqa: BLE001
                    errs.append(e)

            ts = [threading.Thread(target=pull, args=(p,)) for p in "AB"]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not errs, errs
            assert got["A"] == got["B"] and len(got["A"]) == 3
            for d in lay.layers:
                assert proxy.count(blob=d["digest"], method="GET") == 1, d["digest"]
        awaited = 0
        for p in "AB":
            st, data, _ = raw(rep.url(p), "GET", "/v1/metrics", token=rep.token)
            assert st == 200
            text = data.decode()
            m = re.search(r'dsec_pull_layers_total\{result="awaited"\} (\d+)', text)
            awaited += int(m.group(1)) if m else 0
        assert awaited >= 1
    finally:
        assert not rep.shutdown()
