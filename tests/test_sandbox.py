"""Sandbox lifecycle through the SDK: create, get, list, destroy, TTL, cleanup."""

from __future__ import annotations

import re
import threading
import time

import dsec
from helpers import (SB_ID_RE, cgroup_dirs_named, expect_error, mounts_containing, unique,
                     wait_until)

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def test_health_needs_no_token(server):
    status, _, _, doc = server.raw("GET", "/v1/health", token=None)
    assert status == 200, doc
    assert doc["status"] == "ok" and isinstance(doc.get("version"), str)
    assert server.client.health()["status"] == "ok"


def assert_gone_from_host(sandbox_id: str):
    """After destroy: no cgroup directory and no mount mentions the sandbox."""
    assert wait_until(lambda: not cgroup_dirs_named(sandbox_id), 5), \
        f"cgroups left after destroy: {cgroup_dirs_named(sandbox_id)}"
    # Teardown runs after the reply (the cleaner: cgroups, then the disk).
    assert wait_until(lambda: not mounts_containing(sandbox_id), 5), \
        mounts_containing(sandbox_id)


def test_busybox_create_exec_files_destroy(client, busybox, server):
    label = unique("life")
    sb = client.create(busybox, labels={"t": label})
    server.created.add(sb.id)
    try:
        assert SB_ID_RE.fullmatch(sb.id), sb.id
        assert sb.state == "running"
        assert sb.backend == "container"
        assert sb.image == "busybox:latest"
        assert sb.labels == {"t": label}
        info = sb.info
        assert info["layers"] and all(DIGEST.match(d) for d in info["layers"]), info["layers"]
        # documented defaults
        assert (info["cpu"], info["memory_mb"], info["disk_mb"], info["pids"], info["ttl_s"]) \
            == (1.0, 512, 1024, 1024, 3600), info
        assert info["env"] == {} and isinstance(info["created_at"], str)
        assert info["expires_at"] is not None and info["error"] is None
        # while running, the sandbox's cgroup exists on the host
        assert cgroup_dirs_named(sb.id), f"no cgroup directory named {sb.id}"

        r = sb.exec(["echo", "hello"])
        assert (r.exit_code, r.stdout, r.stderr) == (0, "hello\n", "")
        sb.write_file("/tmp/f.bin", b"\x00\x01\x02")
        assert sb.read_file("/tmp/f.bin") == b"\x00\x01\x02"
        assert sb.exec("wc -c < /tmp/f.bin").stdout.strip() == "3"

        got = client.get(sb.id)
        assert got.id == sb.id and got.state == "running"
        assert isinstance(got.info.get("stats"), dict), got.info
        assert got.info["stats"].get("oom_kills") == 0
    finally:
        out = sb.destroy()
    assert out.state == "stopped"
    assert client.get(sb.id).state == "stopped"
    assert_gone_from_host(sb.id)


def test_debian_python3(make_sandbox, debian):
    sb = make_sandbox(debian)
    r = sb.exec(["python3", "-c", "import sys; print(6*7, sys.version_info[0])"])
    assert (r.exit_code, r.stdout) == (0, "42 3\n"), r
    r = sb.exec("python3 -c 'import os; print(os.getcwd() != None)' && echo done")
    assert r.stdout.endswith("done\n"), r
    sb.write_file("/tmp/prog.py", "print(sum(range(10)))\n")
    assert sb.exec(["python3", "/tmp/prog.py"]).stdout == "45\n"


def test_requested_resources_are_recorded_and_applied(make_sandbox, busybox):
    sb = make_sandbox(busybox, cpu=0.5, memory_mb=64, disk_mb=100, pids=32, ttl_s=0,
                      env={"A": "1"}, labels={"x": "y"})
    i = sb.info
    assert (i["cpu"], i["memory_mb"], i["disk_mb"], i["pids"], i["ttl_s"]) == (0.5, 64, 100, 32, 0)
    assert i["expires_at"] is None
    assert i["env"] == {"A": "1"} and i["labels"] == {"x": "y"}
    dirs = cgroup_dirs_named(sb.id)
    assert dirs, f"no cgroup directory named {sb.id}"
    checked = set()
    for d in dirs:
        for fname, want in (("memory.max", str(64 << 20)),
                            ("memory.limit_in_bytes", str(64 << 20)),
                            ("pids.max", "32")):
            try:
                with open(f"{d}/{fname}") as f:
                    val = f.read().strip()
            except OSError:
                continue
            assert val == want, f"{d}/{fname} = {val}, want {want}"
            checked.add(fname.split(".")[0])
    assert checked == {"memory", "pids"}, f"limits not found in {dirs}"


def test_env_from_create_is_default_for_exec(make_sandbox, busybox):
    sb = make_sandbox(busybox, env={"SBVAR": "from-create", "OTHER": "o"})
    assert sb.exec("echo $SBVAR $OTHER").stdout == "from-create o\n"
    assert sb.exec("echo $SBVAR $OTHER", env={"SBVAR": "from-exec"}).stdout == "from-exec o\n"


def test_list_filters_by_labels_and_state(make_sandbox, client, busybox):
    run = unique("run")
    a = make_sandbox(busybox, labels={"run": run, "idx": "0"})
    b = make_sandbox(busybox, labels={"run": run, "idx": "1"})
    ids = lambda sbs: sorted(s.id for s in sbs)  # noqa: E731
    assert ids(client.list(labels={"run": run})) == sorted([a.id, b.id])
    assert ids(client.list(labels={"run": run, "idx": "1"})) == [b.id]
    assert client.list(labels={"run": run, "idx": "2"}) == []
    assert client.list(labels={"run": unique("none")}) == []
    assert {a.id, b.id} <= {s.id for s in client.list(state="running")}
    a.destroy()
    assert ids(client.list(labels={"run": run}, state="running")) == [b.id]
    assert ids(client.list(labels={"run": run}, state="stopped")) == [a.id]
    listed = {s.id: s for s in client.list(labels={"run": run})}
    assert listed[a.id].state == "stopped" and listed[b.id].state == "running"


def test_destroy_twice_and_context_manager(client, busybox, server):
    with client.create(busybox) as sb:
        server.created.add(sb.id)
        assert sb.exec("true").ok
    assert sb.state == "stopped"
    again = sb.destroy()
    assert again.state == "stopped" and again.id == sb.id
    assert client.destroy(sb.id).state == "stopped"
    assert_gone_from_host(sb.id)


def test_exec_after_destroy_is_refused(make_sandbox, busybox):
    sb = make_sandbox(busybox)
    sb.destroy()
    for call in (lambda: sb.exec("true"), lambda: sb.read_file("/etc/passwd"),
                 lambda: sb.write_file("/tmp/x", b"x"), lambda: sb.list_dir("/")):
        e = expect_error(call, dsec.Conflict, status=409)
        assert e.code == "failed_precondition", repr(e)


def test_get_and_delete_unknown_id(client):
    expect_error(lambda: client.get("sb-0000000000000000"), dsec.NotFound, status=404)
    expect_error(lambda: client.destroy("sb-0000000000000000"), dsec.NotFound, status=404)
    expect_error(lambda: client.get("not-an-id"), dsec.NotFound, status=404)


def test_ttl_expiry_stops_sandbox(make_sandbox, busybox):
    sb = make_sandbox(busybox, ttl_s=1)
    assert sb.info["expires_at"] is not None
    stopped = wait_until(lambda: sb.refresh().state in ("stopping", "stopped"), 15, 0.25)
    assert stopped, f"sandbox with ttl_s=1 still {sb.state} after 15 s"
    assert wait_until(lambda: sb.refresh().state == "stopped", 10, 0.25), sb.state
    assert wait_until(lambda: not cgroup_dirs_named(sb.id), 5)


def test_parallel_creates_get_distinct_sandboxes(make_sandbox, busybox):
    out, errs = {}, []
    lock = threading.Lock()

    def one(i):
        try:
            sb = make_sandbox(busybox, labels={"par": str(i)})
            host = sb.exec("hostname").stdout.strip()
            with lock:
                out[i] = (sb.id, host)
        except Exception as e:  # surfaced below
            errs.append(e)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs, errs
    assert len({sid for sid, _ in out.values()}) == 4
    assert all(sid == host for sid, host in out.values()), out


def test_concurrent_execs_in_one_sandbox_run_in_parallel(make_sandbox, busybox):
    sb = make_sandbox(busybox)
    res = {}

    def one(i):
        res[i] = sb.exec(f"sleep 1; echo {i}")

    t0 = time.monotonic()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    wall = time.monotonic() - t0
    assert sorted(r.stdout for r in res.values()) == [f"{i}\n" for i in range(6)]
    assert wall < 4, f"6 concurrent 1 s execs took {wall:.1f} s (serialised?)"


def test_destroy_while_exec_runs(make_sandbox, busybox):
    sb = make_sandbox(busybox)
    out = {}

    def long_exec():
        t0 = time.monotonic()
        try:
            out["r"] = sb.exec("sleep 30", timeout=60)
        except dsec.DsecError as e:
            out["e"] = e
        out["wall"] = time.monotonic() - t0

    t = threading.Thread(target=long_exec)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert sb.destroy().state == "stopped"
    assert time.monotonic() - t0 < 10, "destroy waited for the running exec"
    t.join(15)
    assert not t.is_alive(), "the exec did not return after its sandbox was destroyed"
    assert out["wall"] < 15
    if "r" in out:  # an answer is fine as long as it does not claim success
        assert not out["r"].ok, out["r"]
    assert_gone_from_host(sb.id)


def test_create_destroy_churn_leaves_nothing(client, busybox, server):
    ids = []
    for i in range(10):
        sb = client.create(busybox, labels={"churn": "1"})
        server.created.add(sb.id)
        ids.append(sb.id)
        assert sb.exec(["true"]).ok
        sb.destroy()
    for sid in ids:
        assert_gone_from_host(sid)


def _local_port(c) -> int:
    """The local port of the client's kept-alive connection (the sync client's
    connection of this thread; the one idle connection of an AsyncClient)."""
    if isinstance(c, dsec.Client):
        return c._local.conn.sock.getsockname()[1]
    pool = c.unwrapped._pool_
    assert pool.open == 1 and len(pool._idle) == 1, (pool.open, len(pool._idle))
    return pool._idle[0].writer.get_extra_info("sockname")[1]


def test_keepalive_connection_is_reused(server, make_sandbox, busybox, sdk):
    sb0 = make_sandbox(busybox)
    c = sdk.Client(server.url, token=server.client.token, timeout=30)
    sb = c.get(sb0.id)
    port = None
    for i in range(30):
        c.list(labels={"none": "x"})
        assert sb.exec(["echo", str(i)]).stdout == f"{i}\n"
        sb.write_file("/tmp/k", b"k" * i)
        assert sb.read_file("/tmp/k") == b"k" * i
        evs = list(sb.exec_stream(["echo", "s"]))
        assert evs[-1].type == "exit"
        local = _local_port(c)
        port = port or local
        assert local == port, f"request {i} needed a new connection: keep-alive broken"
    c.close()


def test_delete_racing_create_never_leaves_a_running_sandbox(server, busybox, sdk):
    """A cleanup that deletes by label while creates are in flight: whatever the
    interleaving, every sandbox ends stopped and leaves nothing on the host."""
    label = unique("race")
    stop = threading.Event()
    created, cancelled = [], []

    def deleter():
        c = sdk.from_data_dir(str(server.data_dir))
        while not stop.is_set():
            for sb in c.list(labels={"race": label}):
                if sb.state not in ("stopped", "failed"):
                    c.destroy(sb.id)

    t_del = threading.Thread(target=deleter)
    t_del.start()
    try:
        c = sdk.from_data_dir(str(server.data_dir))
        for _ in range(15):
            try:
                sb = c.create(image=busybox, labels={"race": label})
                server.created.add(sb.id)
                created.append(sb.id)
            except dsec.Conflict:  # the delete won while it was being created
                cancelled.append(1)
    finally:
        time.sleep(0.3)
        stop.set()
        t_del.join()
    client = dsec.Client.from_data_dir(str(server.data_dir))
    final = client.list(labels={"race": label})
    for sb in final:
        if sb.state == "running":  # created after the deleter's last pass
            sb.destroy()
    final = client.list(labels={"race": label})
    # every attempt left exactly one record, and none of them runs
    assert len(final) == 15, [(sb.id, sb.state) for sb in final]
    assert set(created) <= {sb.id for sb in final}
    assert all(sb.state in ("stopped", "failed") for sb in final), \
        [(sb.id, sb.state) for sb in final]
    for sb in final:
        assert_gone_from_host(sb.id)
