"""Sandboxes outlive their clients: pause and resume by call, auto-pause after
an idle period, idle timeout; a call to a paused sandbox resumes it."""

from __future__ import annotations

import time

import dsec
from helpers import expect_error, wait_until

# Each value is written aside and renamed over /tmp/n: a read never sees the
# file truncated and not yet rewritten (a pause can freeze the loop right
# there, and an empty file would read as 0).
COUNTER = ("(n=0; while :; do n=$((n+1)); echo $n > /tmp/n.t; mv /tmp/n.t /tmp/n; sleep 0.05;"
           " done) >/dev/null 2>&1 & echo bg")


def count(sb) -> int:
    try:
        return int(sb.read_file("/tmp/n").decode().strip() or 0)
    except (dsec.NotFound, ValueError):
        return 0


def test_pause_freezes_and_a_call_resumes(make_sandbox, busybox, server):
    sb = make_sandbox(busybox)
    assert sb.exec(COUNTER).stdout == "bg\n"
    assert wait_until(lambda: count(sb) > 3, 5)
    sb.pause()
    assert sb.info["state"] == "paused"
    assert server.client.get(sb.id).info["state"] == "paused"
    # Frozen: the loop makes no progress (read the host side of the upper dir
    # would need root paths; instead compare across an explicit resume).
    time.sleep(0.5)
    sb.resume()
    before = count(sb)  # this call ran on a resumed sandbox
    assert sb.info["state"] == "running"
    assert wait_until(lambda: count(sb) > before, 5)
    # A paused sandbox resumes on its next call.
    sb.pause()
    frozen_at = time.monotonic()
    r = sb.exec("echo hi")
    assert r.stdout == "hi\n" and server.client.get(sb.id).info["state"] == "running"
    assert time.monotonic() - frozen_at < 10
    # Repeats are fine; a stopped sandbox cannot be paused.
    sb.pause()
    sb.pause()
    sb.destroy()  # destroying a paused (frozen) sandbox works
    assert sb.info["state"] == "stopped"
    expect_error(sb.pause, dsec.Conflict, status=409)
    expect_error(lambda: server.client.get("sb-0000000000000000").pause(), dsec.NotFound)


def test_frozen_processes_make_no_progress(make_sandbox, busybox):
    sb = make_sandbox(busybox)
    sb.exec(COUNTER)
    assert wait_until(lambda: count(sb) > 3, 5)
    sb.pause()
    # While paused nothing runs: the file keeps its value. The check itself
    # is a call and would resume the sandbox, so look after resuming at how
    # far the counter got in the paused second: at most a step or two.
    n0 = None
    sb.resume()
    n0 = count(sb)
    sb.pause()
    time.sleep(1.0)
    sb.resume()
    n1 = count(sb)
    assert n1 - n0 <= 3, (n0, n1)  # ~20 steps had it been running


def test_auto_pause_and_idle_timeout(make_sandbox, busybox, server):
    paused = make_sandbox(busybox, auto_pause_s=1)
    assert paused.info["auto_pause_s"] == 1
    assert wait_until(lambda: server.client.get(paused.id).info["state"] == "paused", 6)
    assert paused.exec("echo awake").stdout == "awake\n"
    assert server.client.get(paused.id).info["state"] == "running"
    # Calls keep an idle sandbox alive; without them it goes.
    idle = make_sandbox(busybox, idle_timeout_s=2)
    assert idle.info["idle_timeout_s"] == 2
    for _ in range(4):
        time.sleep(0.7)
        idle.exec("true")
    assert server.client.get(idle.id).info["state"] == "running"
    # A call that runs longer than the idle timeout is activity throughout.
    r = idle.exec("sleep 4; echo done")
    assert r.stdout == "done\n"
    assert server.client.get(idle.id).info["state"] == "running"
    assert wait_until(lambda: server.client.get(idle.id).info["state"] == "stopped", 6)
    assert server.client.get(idle.id).info["error"] == "idle timeout"
    for bad in ({"idle_timeout_s": -1}, {"auto_pause_s": "x"}, {"idle_timeout_s": 10 ** 7}):
        field = next(iter(bad))
        expect_error(lambda: server.client.create("busybox:latest", **bad), dsec.InvalidArgument,
                     field=field)


def _cpu_usage_usec(server, sandbox_id):
    """The sandbox's CPU time from its cgroup v2 group (pure v2, or the
    controller-less twin a hybrid host has): cpu.stat's usage_usec."""
    from helpers import edge_cgroup
    edge = edge_cgroup(server.data_dir)
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        path = f"{root}/dsec/{edge}/{sandbox_id}/cpu.stat"
        try:
            with open(path) as f:
                for line in f:
                    k, v = line.split()
                    if k == "usage_usec":
                        return int(v)
        except OSError:
            continue
    return None


def test_pause_stops_cpu_use_by_the_cgroups_count(make_sandbox, busybox, server):
    import pytest
    sb = make_sandbox(busybox)
    if _cpu_usage_usec(server, sb.id) is None:
        pytest.skip("no cgroup v2 cpu.stat for the sandbox on this host")
    assert sb.exec("(while :; do :; done) >/dev/null 2>&1 & echo bg").stdout == "bg\n"
    a = _cpu_usage_usec(server, sb.id)
    time.sleep(1.0)
    b = _cpu_usage_usec(server, sb.id)
    # Loose: on a loaded host the loop gets less than a core.
    assert b - a > 50_000, f"the busy loop used only {b - a} us in 1 s"
    sb.pause()
    time.sleep(0.2)  # let the freeze settle
    c = _cpu_usage_usec(server, sb.id)
    time.sleep(1.0)
    d = _cpu_usage_usec(server, sb.id)
    assert d - c < 20_000, f"a paused sandbox used {d - c} us of CPU in 1 s"
    sb.resume()
    e = _cpu_usage_usec(server, sb.id)
    time.sleep(1.0)
    assert _cpu_usage_usec(server, sb.id) - e > 50_000
