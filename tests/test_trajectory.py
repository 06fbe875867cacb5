"""Chronus: calls keyed by (trajectory_id, step) run once; repeats replay the
stored result without running anything, a different call under the same key
is a conflict, concurrent repeats wait for the first, and the log survives a
restart of the platform."""

from __future__ import annotations

import signal
import threading
import uuid

import pytest

import dsec
from helpers import expect_error


def tid() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def test_a_step_runs_once_and_replays(make_sandbox, busybox):
    sb = make_sandbox(busybox)
    t = tid()
    cmd = "echo x >> /root/f; wc -l < /root/f"
    first = sb.exec(cmd, trajectory_id=t, step=0)
    assert first.stdout.strip() == "1" and not first.replayed
    again = sb.exec(cmd, trajectory_id=t, step=0)
    assert again.replayed and again.stdout == first.stdout and again.exit_code == 0
    # Nothing ran the second time: the file has one line.
    assert sb.exec("wc -l < /root/f").stdout.strip() == "1"
    # The same key with another call is never run: 409 naming both digests.
    e = expect_error(lambda: sb.exec("echo other", trajectory_id=t, step=0), dsec.Conflict,
                     field="step", status=409)
    assert str(e).count("sha256:") == 2, e
    # A failed call is not a step: the sandbox had no such file, so a read
    # step fails and a repeat after creating it runs.
    expect_error(lambda: sb.read_file("/root/nope", trajectory_id=t, step=1), dsec.NotFound)
    sb.write_file("/root/nope", b"now\n")
    assert sb.read_file("/root/nope", trajectory_id=t, step=1) == b"now\n"


def test_a_resumed_trainer_fast_forwards_then_goes_live(make_sandbox, busybox, client):
    sb = make_sandbox(busybox)
    t = tid()

    def rollout(traj, n):
        out = []
        for i in range(n):
            out.append(traj.exec(f"echo step{i} >> /root/log; cat /root/log | wc -l"))
        return out

    first = rollout(sb.trajectory(t), 3)
    assert [r.stdout.strip() for r in first] == ["1", "2", "3"]
    # Preempted; the trainer replays its own code from the start.
    resumed = rollout(sb.trajectory(t), 5)
    assert [r.replayed for r in resumed] == [True, True, True, False, False]
    assert [r.stdout.strip() for r in resumed] == ["1", "2", "3", "4", "5"]
    assert sb.exec("wc -l < /root/log").stdout.strip() == "5"
    # File steps: a replayed write does not write again; a replayed read
    # returns what was read the first time.
    tr = sb.trajectory(t, start=5)
    tr.write_file("/root/answer", b"42\n")
    assert tr.read_file("/root/answer") == b"42\n"
    sb.write_file("/root/answer", b"changed\n")
    tr = sb.trajectory(t, start=5)
    assert tr.write_file("/root/answer", b"42\n")["replayed"] is True
    assert tr.read_file("/root/answer") == b"42\n"
    assert sb.read_file("/root/answer") == b"changed\n"
    # Export for training data: every step in order.
    lines = client.export_trajectory(t)
    assert [l["step"] for l in lines] == list(range(7))
    assert lines[0]["kind"] == "exec" and lines[0]["request"]["cmd"].startswith("echo step0")
    assert lines[0]["result"]["stdout"] == "1\n" and lines[0]["duration_ms"] >= 0
    assert lines[5]["kind"] == "write" and lines[5]["request"]["size"] == 3
    assert lines[6]["kind"] == "read" and lines[6]["result_b64"]
    assert any(x["id"] == t and x["steps"] == 7 for x in client.trajectories())
    assert client.delete_trajectory(t) == 7
    expect_error(lambda: client.export_trajectory(t), dsec.NotFound)
    expect_error(lambda: client.delete_trajectory(t), dsec.NotFound)


def test_a_repeat_of_a_step_in_flight_waits_for_it(make_sandbox, busybox):
    sb = make_sandbox(busybox)
    t = tid()
    cmd = "echo run >> /root/runs; sleep 1; wc -l < /root/runs"
    results = []

    def call():
        results.append(sb.exec(cmd, trajectory_id=t, step=7))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(results) == 3
    assert sorted(r.replayed for r in results) == [False, True, True]
    assert {r.stdout for r in results} == {"1\n"}
    assert sb.exec("wc -l < /root/runs").stdout.strip() == "1"
    # Other steps of the same trajectory run concurrently.
    other = [threading.Thread(target=lambda i=i: sb.exec("sleep 0.5", trajectory_id=t, step=10 + i))
             for i in range(3)]
    for th in other:
        th.start()
    for th in other:
        th.join(60)


def test_bad_trajectory_keys_get_clear_errors(make_sandbox, busybox, server):
    sb = make_sandbox(busybox)
    expect_error(lambda: sb.exec("true", trajectory_id="t"), dsec.InvalidArgument, field="step")
    expect_error(lambda: sb.exec("true", step=1), dsec.InvalidArgument, field="trajectory_id")
    expect_error(lambda: sb.exec("true", trajectory_id="bad id", step=0), dsec.InvalidArgument,
                 field="trajectory_id")
    expect_error(lambda: sb.exec("true", trajectory_id="t", step=-1), dsec.InvalidArgument,
                 field="step")
    expect_error(lambda: sb.read_file("/etc/hostname", trajectory_id="t", step="x"),
                 dsec.InvalidArgument, field="step")
    status, _, _, doc = server.raw("POST", f"/v1/sandboxes/{sb.id}/exec",
                                   {"cmd": "true", "trajectory_id": "t", "step": 0, "stream": True})
    assert status == 400 and doc["error"]["field"] == "stream"


def test_the_log_survives_a_platform_restart(tmp_path):
    from conftest import Server, _check_prerequisites
    _check_prerequisites()
    import os
    tar = os.path.join(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"),
                       "busybox.tar")
    srv = Server(tmp_path / "data")
    srv.start()
    try:
        srv.import_image("busybox:latest", tar)
        sb = srv.client.create("busybox:latest")
        r = sb.exec("date +%s%N", trajectory_id="durable", step=0)
    finally:
        assert srv.stop() in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    srv = Server(tmp_path / "data")
    srv.start()
    try:
        # The sandbox went with the old process; its step did not.
        again = srv.client.get(sb.id).exec("date +%s%N", trajectory_id="durable", step=0)
        assert again.replayed and again.stdout == r.stdout
    finally:
        srv.stop()
