"""What the web console charts and lists at fleet scale:

- GET /v1/sandboxes/{id}/stats: each node samples its sandboxes' cgroups
  (CPU time, memory, tasks) into a ring of 240 readings; the platform answers
  them as parallel arrays with CPU turned into cores used. A dedicated
  `dsec up --stats-interval-s 0.5` runs the CPU burn, the session server the
  error cases.
- GET /v1/sandboxes?limit=&sort=: the newest N and the total matching.
- GET /v1/nodes: per pool its utilization and bursts, and the burst policy.
"""

from __future__ import annotations

import time

import pytest

from conftest import IMAGE_CACHE, Server, _check_prerequisites, unavailable
from helpers import unique
from test_contract import conforms

STATS = "/v1/sandboxes/{id}/stats"


@pytest.fixture(scope="module")
def fast_server(tmp_path_factory):
    """A `dsec up` whose node samples every 0.5 s (default 15 s)."""
    _check_prerequisites()
    tar = IMAGE_CACHE / "busybox.tar"
    if not tar.is_file():
        unavailable(f"test image {tar} missing")
    s = Server(tmp_path_factory.mktemp("stats") / "data", ["--stats-interval-s", "0.5"])
    s.data_dir.mkdir()
    s.start()
    try:
        s.import_image("busybox:latest", tar)
        yield s
    finally:
        if s.proc.poll() is None:
            s.stop()


def stats(server, sid, window="60", token=True):
    return server.raw("GET", f"/v1/sandboxes/{sid}/stats?window_s={window}", token=token)


def test_cpu_memory_and_pids_history(fast_server):
    s = fast_server
    sb = s.client.create("busybox:latest", cpu=1, memory_mb=256, pids=128)
    try:
        time.sleep(1.2)  # a few idle readings first
        r = sb.exec("sh -c 'while :; do :; done & p=$!; sleep 3; kill $p'", timeout=30)
        assert r.exit_code == 0, r
        time.sleep(1.2)  # and the readings after
        doc = conforms(stats(s, sb.id), STATS, "GET")
        n = len(doc["t"])
        assert n >= 8, doc
        assert doc["interval_s"] == 0.5 and doc["window_s"] == 60
        assert len(doc["cpu"]) == len(doc["memory_bytes"]) == len(doc["pids"]) == n
        assert doc["t"] == sorted(doc["t"]) and abs(doc["t"][-1] - time.time()) < 5
        assert doc["cpu"][0] is None
        busy = [c for c in doc["cpu"] if c is not None]
        # The loop ran at up to the sandbox's one core for 3 s.
        assert max(busy) > 0.3, doc["cpu"]
        assert max(busy) < 1.5, doc["cpu"]
        assert min(busy) < 0.1, f"no idle reading: {doc['cpu']}"
        assert all(m > 0 for m in doc["memory_bytes"]), doc["memory_bytes"]
        assert all(p >= 1 for p in doc["pids"]) and max(doc["pids"]) >= 3, doc["pids"]
        assert doc["cpu_limit"] == 1 and doc["memory_limit_bytes"] == 256 << 20
        assert doc["pids_limit"] == 128 and doc["state"] == "running"
        # The window counts back from now; the last reading is taken now.
        short = conforms(stats(s, sb.id, "1"), STATS, "GET")
        assert 1 <= len(short["t"]) <= 4, short
        # The record's figures: CPU time so far and tasks now.
        got = conforms(s.raw("GET", f"/v1/sandboxes/{sb.id}"), "/v1/sandboxes/{id}", "GET")
        assert got["stats"]["cpu_usec"] > 1_000_000, got["stats"]
        assert got["stats"]["pids"] >= 1, got["stats"]
        # Paused: readings still come, and looking does not resume it.
        sb.pause()
        paused = conforms(stats(s, sb.id), STATS, "GET")
        assert paused["state"] == "paused" and len(paused["t"]) >= n, paused
        assert s.client.get(sb.id).state == "paused"
        sb.resume()
    finally:
        sb.destroy()
    # Gone with the sandbox: empty series, not an error.
    gone = conforms(stats(s, sb.id), STATS, "GET")
    assert gone["state"] == "stopped" and gone["t"] == [] and gone["cpu"] == [], gone


@pytest.mark.parametrize("window", ["0", "0.5", "3601", "abc", "", "nan", "-5"])
def test_stats_window_is_checked(server, client, busybox, make_sandbox, window):
    sb = make_sandbox(busybox)
    status, _, _, doc = stats(server, sb.id, window)
    assert status == 400, doc
    assert doc["error"]["field"] == "window_s" and doc["error"]["code"] == "invalid_argument", doc


def test_stats_of_unknown_or_another_tenant_s_sandbox_is_not_found(server, client, busybox,
                                                                  make_sandbox):
    sb = make_sandbox(busybox)
    # Default window: an hour.
    doc = conforms(server.raw("GET", f"/v1/sandboxes/{sb.id}/stats"), STATS, "GET")
    assert doc["window_s"] == 3600 and doc["interval_s"] == 15 and len(doc["t"]) >= 1, doc
    status, _, _, doc = stats(server, "sb-" + "0" * 16)
    assert status == 404 and doc["error"]["code"] == "not_found", doc
    tenant = unique("st")
    client.create_tenant(tenant, name="stats test")
    try:
        key = client.create_key(tenant, name="test")["key"]
        status, _, _, doc = stats(server, sb.id, token=key)
        assert status == 404 and doc["error"]["code"] == "not_found", doc
    finally:
        client.delete_tenant(tenant)
    status, _, _, doc = server.raw("POST", f"/v1/sandboxes/{sb.id}/stats", body={})
    assert status == 400 and doc["error"]["field"] == "method", doc


def test_list_limit_sort_and_total(server, client, busybox, make_sandbox):
    tag = unique("ls")
    made = [make_sandbox(busybox, labels={"list": tag}) for _ in range(3)]
    path = f"/v1/sandboxes?label=list={tag}"
    every = conforms(server.raw("GET", path), "/v1/sandboxes", "GET")
    assert every["total"] == 3 and len(every["sandboxes"]) == 3
    newest = conforms(server.raw("GET", path + "&sort=-created&limit=2"), "/v1/sandboxes", "GET")
    assert newest["total"] == 3
    assert [s["id"] for s in newest["sandboxes"]] == [made[2].id, made[1].id]
    oldest = conforms(server.raw("GET", path + "&sort=created"), "/v1/sandboxes", "GET")
    assert [s["id"] for s in oldest["sandboxes"]] == [m.id for m in made]
    one = conforms(server.raw("GET", path + "&limit=1"), "/v1/sandboxes", "GET")
    assert one["total"] == 3 and len(one["sandboxes"]) == 1
    # The total counts the other filters too.
    made[0].destroy()
    running = conforms(server.raw("GET", path + "&state=running&limit=1&sort=-created"),
                       "/v1/sandboxes", "GET")
    assert running["total"] == 2 and running["sandboxes"][0]["id"] == made[2].id
    for q, field in (("limit=0", "limit"), ("limit=10001", "limit"), ("limit=abc", "limit"),
                     ("limit=", "limit"), ("limit=2.5", "limit"), ("sort=name", "sort"),
                     ("sort=", "sort"), ("sort=created,id", "sort")):
        r = server.raw("GET", f"/v1/sandboxes?{q}")
        conforms(r, "/v1/sandboxes", "GET")
        status, _, _, doc = r
        assert status == 400 and doc["error"]["field"] == field, (q, doc)


def test_nodes_carry_pools_and_the_burst_policy(server, busybox, make_sandbox):
    make_sandbox(busybox)
    doc = conforms(server.raw("GET", "/v1/nodes"), "/v1/nodes", "GET")
    assert doc["burst"] == {"pool": "cloud", "threshold": 0.8}, doc["burst"]
    pools = {p["name"]: p for p in doc["pools"]}
    assert set(pools) == {n["pool"] for n in doc["nodes"]}
    d = pools["default"]
    assert d["nodes"] >= 1 and d["up"] >= 1 and not d["burst_pool"] and d["bursts"] == 0
    assert 0 < d["utilization"] <= 1, d
