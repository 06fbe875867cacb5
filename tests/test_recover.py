"""Chronus recover: a trajectory whose sandbox was lost (its node died, or it was
destroyed behind the trajectory's back) is rebuilt in a new sandbox from its
latest checkpoint, with the mutating steps logged after it re-executed once
each; replaying the trainer's code through the new sandbox returns the logged
results, then goes live. And a rollout process SIGKILLed at random steps and
restarted from step 0 never runs a step twice."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import dsec
from helpers import aether_pids, edge_cgroup, expect_error, wait_until

REPO = Path(__file__).resolve().parent.parent


def tid() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def kill_node(server, client, sb) -> None:
    """Node death as the host sees it: SIGKILL to the sandbox's PID 1 (its
    agent), found by the sandbox's cgroup under this server's edge cgroup."""
    edge = edge_cgroup(server.data_dir)
    pids = []
    for p in aether_pids(edge):
        try:
            with open(f"/proc/{p}/cgroup") as f:
                if f"/{sb.id}" in f.read():
                    pids.append(p)
        except OSError:
            pass
    assert pids, f"no agent process found for {sb.id}"
    for p in pids:
        os.kill(p, signal.SIGKILL)
    assert wait_until(lambda: client.get(sb.id).state == "failed", 15), client.get(sb.id).info


COUNT = "n=$(cat /root/w/n 2>/dev/null || echo 0); echo $((n+1)) > /root/w/n; cat /root/w/n"


def rollout(traj, checkpoint: bool):
    """A trainer's code: non-idempotent steps (appends, a counter), file
    writes, a checkpoint in the middle, more steps. Returns what each step
    returned, as comparable values, and the replayed flags."""
    out, replayed = [], []

    def rec(kind, value, was_replayed):
        out.append((kind, value))
        replayed.append(was_replayed)

    r = traj.exec("mkdir -p /root/w && echo start >> /root/w/log")
    rec("exec", (r.exit_code, r.stdout), r.replayed)
    for i in range(3):
        r = traj.exec(f"echo a{i} >> /root/w/log; {COUNT}")
        rec("exec", (r.exit_code, r.stdout), r.replayed)
    w = traj.write_file("/root/w/blob.bin", bytes(range(256)) * 40)
    rec("write", w["size"], w["replayed"])
    if checkpoint:
        img = traj.checkpoint()
        rec("checkpoint", tuple(img.layers), img.raw["replayed"])
    for i in range(3):
        r = traj.exec(f"echo b{i} >> /root/w/log; {COUNT}")
        rec("exec", (r.exit_code, r.stdout), r.replayed)
    w = traj.write_file("/root/w/after.txt", b"written after the checkpoint\n")
    rec("write", w["size"], w["replayed"])
    traj.mkdir("/root/w/d/e")
    rec("mkdir", None, None)
    r = traj.exec("echo doomed > /root/w/tmp; echo c >> /root/w/log")
    rec("exec", (r.exit_code, r.stdout), r.replayed)
    traj.remove("/root/w/tmp")
    rec("remove", None, None)
    r = traj.exec(f"{COUNT}; exit 3")  # a failing command is a step too
    rec("exec", (r.exit_code, r.stdout), r.replayed)
    data = traj.read_file("/root/w/log")
    rec("read", data, None)
    return out, replayed


def state(sb) -> str:
    """The files the rollout touches, as one comparable text."""
    r = sb.exec("cd /root/w && cat log n && ls -lnR . | grep -v '^total' | "
                "awk '{print $1, ($1 ~ /^d/ ? \"-\" : $5), $NF}' && md5sum blob.bin after.txt")
    assert r.exit_code == 0, r
    return r.stdout


@pytest.mark.parametrize("checkpoint", [True, False], ids=["from-checkpoint", "from-image"])
def test_recover_rebuilds_a_lost_sandbox_and_replays(make_sandbox, busybox, client, server,
                                                     checkpoint):
    sb = make_sandbox(busybox, labels={"job": "recover"}, env={"MARK": "m1"}, memory_mb=256)
    t = tid()
    first, flags = rollout(sb.trajectory(t), checkpoint)
    assert not any(f for f in flags if f is not None)
    before = state(sb)
    assert before.count("\n") > 10 and "a0\na1\na2\nb0\nb1\nb2\nc\n" in before
    steps = len(first)
    if checkpoint:
        kill_node(server, client, sb)
    else:
        # Lost another way: destroyed behind the trajectory's back.
        sb.destroy()
    new = client.recover(t)
    make_sandbox.sandboxes.append(new)
    server.created.add(new.id)
    rep = new.recovery
    assert rep["previous_sandbox"] == sb.id and new.id != sb.id and new.state == "running"
    # Made as the lost one was.
    for k in ("labels", "memory_mb", "image", "policy", "user", "cpu", "disk_mb", "pids"):
        assert new.info[k] == sb.info[k], k
    assert new.info["env"]["MARK"] == "m1"
    ckpt_step = 5 if checkpoint else None
    assert rep["checkpoint_step"] == ckpt_step, rep
    # Mutating steps after the checkpoint (or all of them): no reads, no checkpoint.
    kinds = [k for k, _ in first]
    after = kinds[(ckpt_step + 1 if checkpoint else 0):]
    assert rep["reexecuted_steps"] == sum(k in ("exec", "write", "mkdir", "remove")
                                          for k in after), rep
    assert rep["diverged"] == [], rep
    # Each non-idempotent step applied exactly once: the files equal the lost ones.
    assert state(new) == before
    # The trainer replays its code through the new sandbox: the same results,
    # all replayed; then new steps run live, there.
    again, flags = rollout(new.trajectory(t), checkpoint)
    assert again == first
    assert all(f for f in flags if f is not None)
    # What the console shows of it (GET /v1/trajectories/{id}/info).
    st, _, _, info = server.raw("GET", f"/v1/trajectories/{t}/info")
    assert st == 200, info
    assert info["sandbox"] == new.id and info["replaced"] == [sb.id], info
    assert info["steps"] == steps and len(info["recoveries"]) == 1, info
    assert info["recoveries"][0]["checkpoint_step"] == ckpt_step
    assert [c["step"] for c in info["checkpoints"]] == ([5] if checkpoint else [])
    replayed_steps = [i for i, f in enumerate(flags) if f]
    assert all(info["replays"].get(str(i), 0) >= 1 for i in replayed_steps), info["replays"]
    st, _, _, doc = server.raw("GET", "/v1/trajectories/no-such-trajectory/info")
    assert st == 404, doc
    live = new.trajectory(t, start=steps).exec(f"echo live >> /root/w/log; {COUNT}")
    assert not live.replayed and live.exit_code == 0 and live.stdout.strip() == "8"
    # A step sent to the lost sandbox runs in the trajectory's new one.
    routed = sb.exec("echo routed >> /root/w/log", trajectory_id=t, step=steps + 1)
    assert not routed.replayed
    assert new.read_file("/root/w/log").endswith(b"live\nrouted\n")
    # Its sandbox is alive now: recovering again is a conflict naming it,
    # unless forced.
    e = expect_error(lambda: client.recover(t), dsec.Conflict, field="force", status=409)
    assert new.id in str(e)
    if checkpoint:
        forced = client.recover(t, force=True)
        make_sandbox.sandboxes.append(forced)
        server.created.add(forced.id)
        assert forced.recovery["previous_sandbox"] == new.id
        assert forced.recovery["checkpoint_step"] == ckpt_step
        assert state(forced) == state(new)
        forced.destroy()


def test_recover_reports_divergence_and_keeps_write_bytes(make_sandbox, busybox, client, server):
    sb = make_sandbox(busybox)
    t = tid()
    tr = sb.trajectory(t)
    payload = b"\x00kept bytes\xff" * 1000 + t.encode()
    tr.write_file("/root/payload", payload)
    # Outside the trajectory: a recover cannot know of it, so the step that
    # depends on it diverges (reported, not fatal).
    sb.exec("touch /root/marker")
    r = tr.exec("test -f /root/marker")
    assert r.exit_code == 0
    tr.exec("echo one >> /root/count")
    kept = [Path(server.data_dir) / "steps" / hashlib.sha256(payload).hexdigest()]
    assert kept[0].exists(), "the bytes of the write step were not kept"
    # Layer GC leaves the kept bytes alone.
    client.gc(grace_s=0)
    assert all(p.exists() for p in kept)
    sb.destroy()
    new = client.recover(t)
    make_sandbox.sandboxes.append(new)
    server.created.add(new.id)
    rep = new.recovery
    assert rep["checkpoint_step"] is None and rep["reexecuted_steps"] == 3
    assert [d["step"] for d in rep["diverged"]] == [1], rep
    assert rep["diverged"][0]["logged"]["exit_code"] == 0
    assert rep["diverged"][0]["now"]["exit_code"] == 1
    assert new.read_file("/root/payload") == payload
    assert new.read_file("/root/count") == b"one\n"
    # The stored results are unchanged: the replay still says exit code 0.
    assert new.exec("test -f /root/marker", trajectory_id=t, step=1).exit_code == 0
    # Deleting the trajectory releases its bytes.
    new.destroy()
    assert client.delete_trajectory(t) == 3
    assert not any(p.exists() for p in kept)


def test_step_digests_do_not_depend_on_the_sandbox(make_sandbox, busybox):
    a = make_sandbox(busybox)
    b = make_sandbox(busybox)
    t = tid()
    ra = a.exec("echo $RANDOM", trajectory_id=t, step=0)
    wa = a.write_file("/root/x", b"same", trajectory_id=t, step=1)
    rb = b.exec("echo $RANDOM", trajectory_id=t, step=0)
    wb = b.write_file("/root/x", b"same", trajectory_id=t, step=1)
    assert rb.replayed and rb.stdout == ra.stdout
    assert wb["replayed"] and not wa["replayed"]
    assert not b.exists("/root/x")


def test_checkpoint_steps_replay_without_a_new_layer(make_sandbox, busybox, client):
    sb = make_sandbox(busybox)
    t = tid()
    tr = sb.trajectory(t)
    tr.exec("echo 1 > /root/one")
    img = tr.checkpoint()
    assert img.name == "chronus/" + t and img.tag == "step-1" and img.kind == "diff"
    assert img.raw["replayed"] is False and img.raw["step"] == 1
    layers_before = {l["digest"] for l in client.layers()}
    sb.exec("echo 2 > /root/two")  # the sandbox changed: a real pack would differ
    again = sb.trajectory(t, start=1).checkpoint()
    assert again.raw["replayed"] is True and again.layers == img.layers
    assert {l["digest"] for l in client.layers()} == layers_before
    # Another name under the same key is a conflict.
    expect_error(lambda: sb.pack_diff("other", trajectory_id=t, step=1), dsec.Conflict,
                 field="step", status=409)
    # The export shows it as a checkpoint step with its image.
    lines = client.export_trajectory(t)
    assert lines[1]["kind"] == "checkpoint" and lines[1]["result"]["layers"] == img.layers
    client.delete_trajectory(t)
    client.delete_image(img.ref)


def test_recover_bad_input(make_sandbox, busybox, client, server):
    expect_error(lambda: client.recover("no-such-" + uuid.uuid4().hex), dsec.NotFound,
                 field="trajectory_id", status=404)
    sb = make_sandbox(busybox)
    t = tid()
    sb.exec("true", trajectory_id=t, step=0)
    e = expect_error(lambda: client.recover(t), dsec.Conflict, field="force", status=409)
    assert sb.id in str(e)
    for body, field in (({"force": "yes"}, "force"), ({"bogus": 1}, "bogus"), ([1], None)):
        status, _, _, doc = server.raw("POST", f"/v1/trajectories/{t}/recover", body)
        assert status == 400, doc
        if field:
            assert doc["error"]["field"] == field, doc
        assert doc["error"]["code"] == "invalid_argument"
    status, _, _, doc = server.raw("POST", "/v1/trajectories/bad!id/recover", {})
    assert status == 400 and doc["error"]["field"] == "trajectory_id", doc
    status, _, _, doc = server.raw("GET", f"/v1/trajectories/{t}/recover")
    assert status == 400 and doc["error"]["field"] == "method", doc
    # A failed recover leaves nothing behind: the checkpoint's base is fine
    # but a write step's kept bytes are gone.
    t2 = tid()
    sb.exec("echo before > /root/g", trajectory_id=t2, step=0)
    sb.write_file("/root/f", t2.encode(), trajectory_id=t2, step=1)
    (Path(server.data_dir) / "steps" / hashlib.sha256(t2.encode()).hexdigest()).unlink()
    sb.destroy()
    running = {s.id for s in client.list()}
    e = expect_error(lambda: client.recover(t2), dsec.Conflict, field="trajectory_id", status=409)
    assert e.code == "failed_precondition" and "step 1" in str(e), e
    assert {s.id for s in client.list()} == running
    client.delete_trajectory(t2)
    client.delete_trajectory(t)


# ----- a rollout process killed at random steps -----------------------------------

ROLLOUT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {sdk!r})
    import dsec
    url, token, sandbox, tid, n = sys.argv[1:6]
    c = dsec.Client(url, token)
    tr = c.sandbox(sandbox).trajectory(tid)
    for i in range(int(n)):
        if i == 12:
            img = tr.checkpoint()
            print(f"{{i}} checkpoint {{img.raw['replayed']}} {{','.join(img.layers)}}", flush=True)
        elif i % 3 == 0:
            r = tr.exec(f"echo s{{i}} >> /root/log; "
                        "n=$(cat /root/n 2>/dev/null || echo 0); echo $((n+1)) > /root/n; cat /root/n")
            print(f"{{i}} exec {{r.replayed}} {{r.stdout.strip()}}", flush=True)
        elif i % 3 == 1:
            w = tr.write_file(f"/root/f{{i}}", f"file {{i}}\\n".encode())
            print(f"{{i}} write {{w['replayed']}} {{w['size']}}", flush=True)
        else:
            r = tr.exec(f"cat /root/f{{i-1}} >> /root/all")
            print(f"{{i}} exec {{r.replayed}} {{r.exit_code}}", flush=True)
    print("done", flush=True)
""")


def test_a_rollout_killed_at_random_steps_runs_each_step_once(make_sandbox, busybox, server,
                                                               tmp_path):
    sb = make_sandbox(busybox)
    t = tid()
    n = 30
    script = tmp_path / "rollout.py"
    script.write_text(ROLLOUT.format(sdk=str(REPO / "sdk" / "python")))
    seed = int(os.environ.get("DSEC_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (DSEC_TEST_SEED={seed} repeats this run)")
    rnd = random.Random(seed)
    args = [sys.executable, str(script), server.url, server.client.token, sb.id, t, str(n)]
    completed = 0  # steps whose result the process printed
    kills = []
    for _ in range(5):
        # Lines to wait for before the kill: somewhere in the first half of
        # what is left, so the kills spread over the rollout.
        at = rnd.randrange(completed, completed + (n - completed) // 2 + 1)
        delay = rnd.uniform(0, 0.05)  # then a little more, to land mid-step
        kills.append((at, round(delay, 3)))
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        seen = 0
        while seen < at:
            line = p.stdout.readline()
            if not line:
                break
            seen += 1
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        completed = max(completed, seen)
    print(f"kills (lines seen, then delay s): {kills}")
    final = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    lines = final.stdout.splitlines()
    assert lines[-1] == "done" and len(lines) == n + 1, final.stdout
    for line in lines[:-1]:
        i, kind, replayed, value = line.split(" ", 3)
        i = int(i)
        if i < completed:
            assert replayed == "True", f"step {i} was printed before a kill yet ran again: {line}"
        if kind == "exec" and i % 3 == 0:
            assert value == str(i // 3 + 1 - (1 if i > 12 else 0)), line
    # Every step applied exactly once.
    want_log = "".join(f"s{i}\n" for i in range(0, n, 3) if i != 12)
    assert sb.read_file("/root/log").decode() == want_log
    assert sb.read_file("/root/n").decode().strip() == str(want_log.count("\n"))
    want_all = "".join(f"file {i - 1}\n" for i in range(2, n, 3))
    assert sb.read_file("/root/all").decode() == want_all
    # The log holds every step once, in order.
    client = server.client
    assert [l["step"] for l in client.export_trajectory(t)] == list(range(n))
    # A changed command at an already-stored step: 409 naming both digests.
    e = expect_error(lambda: sb.exec("echo changed", trajectory_id=t, step=0), dsec.Conflict,
                     field="step", status=409)
    assert str(e).count("sha256:") == 2, e
    client.delete_trajectory(t)


def test_recover_after_the_platform_died_and_forgot_the_sandbox(tmp_path):
    """The whole node went (dsec up SIGKILLed) and, by the time it is back,
    the sandbox's own record is gone too (purged): the trajectory's record
    still says how it was made, and its write bytes survived."""
    import sqlite3
    from conftest import Server, _check_prerequisites
    _check_prerequisites()
    tar = os.path.join(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"),
                       "busybox.tar")
    srv = Server(tmp_path / "data")
    t = tid()
    try:
        srv.start()
        srv.import_image("busybox:latest", tar)
        sb = srv.client.create("busybox:latest", labels={"who": "lost"}, env={"K": "v"})
        tr = sb.trajectory(t)
        tr.exec("echo 1 >> /root/log")
        tr.write_file("/root/data", b"survives a crash\n")
        tr.exec("echo 2 >> /root/log")
    finally:
        if srv.proc is not None:
            srv.proc.kill()  # SIGKILL: nothing is cleaned up by the process
            srv.proc.wait()
            srv._log.close()
        (tmp_path / "data" / "up.json").unlink()  # stale: the killed run could not remove it
    db = sqlite3.connect(tmp_path / "data" / "state.db")
    with db:
        db.execute("DELETE FROM sandboxes WHERE id=?", (sb.id,))
    db.close()
    srv = Server(tmp_path / "data")
    try:
        srv.start()
        expect_error(lambda: srv.client.get(sb.id), dsec.NotFound)
        new = srv.client.recover(t)
        assert new.recovery["previous_sandbox"] == sb.id
        assert new.recovery["reexecuted_steps"] == 3 and new.recovery["diverged"] == []
        assert new.labels == {"who": "lost"} and new.info["env"]["K"] == "v"
        assert new.read_file("/root/log") == b"1\n2\n"
        assert new.read_file("/root/data") == b"survives a crash\n"
        r = new.trajectory(t).exec("echo 1 >> /root/log")
        assert r.replayed
        new.destroy()
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.stop()
