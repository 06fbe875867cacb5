"""Per-phase security policies: a sandbox starts under one and switches live;
the file rules bind every process, running ones included, whatever the uid."""

from __future__ import annotations

import time

import pytest

import dsec
from helpers import expect_error, wait_until


def test_builtin_policies_are_listed(client):
    names = {p["name"]: p for p in client.policies()}
    assert {"default", "setup", "rollout", "eval"} <= set(names)
    assert "/usr" in names["eval"]["readonly_paths"]
    # Only setup has egress, and only what `dsec up --setup-egress/--setup-dns` gave it.
    assert all(p["egress"] == [] and p["dns"] == [] for n, p in names.items()
               if p["builtin"] and n != "setup")
    assert names["setup"]["egress"] == ["10.89.0.2:8080"] and names["setup"]["dns"] == ["10.89.0.2"]


def test_eval_phase_stops_bash_tampering_even_for_a_running_process(make_sandbox, debian):
    sb = make_sandbox(debian)
    assert sb.info["policy"] == "default" and [p["policy"] for p in sb.info["phases"]] == ["default"]
    # Tampering works while the phase allows it (the sandbox's own files)...
    assert sb.exec("cp /bin/true /usr/local/bin/probe && rm /usr/local/bin/probe").exit_code == 0
    # ...a process started before the switch keeps trying to write system paths.
    r = sb.exec("(while :; do if echo x > /usr/bin/tamper 2>/dev/null; then echo ok; "
                "else echo denied; fi > /tmp/loop.out; sleep 0.1; done) >/dev/null 2>&1 & echo bg")
    assert r.stdout == "bg\n"
    # (Polled: each round truncates the file before it writes, so a read can
    # fall between the two and see it empty.)
    out = lambda: sb.exec("cat /tmp/loop.out").stdout
    assert wait_until(lambda: out() == "ok\n", 5), out()

    sb.set_phase("eval", hidden_paths=["/root/answers"], readonly_paths=["/opt"])
    assert sb.info["policy"] == "eval"
    assert [p["policy"] for p in sb.info["phases"]] == ["default", "eval"]
    assert wait_until(lambda: out() == "denied\n", 5), "a running process still writes: %r" % out()
    for cmd in ("cp /bin/sh /bin/bash", "echo evil >> /etc/passwd", "rm /usr/bin/env",
                "touch /lib/x", "touch /opt/x"):
        r = sb.exec(cmd)
        assert r.exit_code != 0 and "Read-only file system" in r.stderr, (cmd, r)
    # The rest of the sandbox is the agent's to use.
    assert sb.exec("echo fine > /tmp/ok && echo fine > /root/ok && cat /tmp/ok").stdout == "fine\n"
    # Execs from now on also run in a Landlock domain: beyond the read-only
    # mounts, not even a new top-level entry (where no mount is) can be made.
    r = sb.exec("mkdir /newtop")
    assert r.exit_code != 0 and "Permission denied" in r.stderr, r
    # As any user, and no way to undo it from inside.
    assert sb.exec("touch /usr/x", user="nobody").exit_code != 0
    r = sb.exec("mount -o remount,rw /usr; umount /usr; touch /usr/x")
    assert r.exit_code != 0

    # Back to rollout: writable again; the history is kept, also across GETs.
    sb.set_phase("rollout")
    assert sb.exec("touch /usr/x && rm /usr/x && mkdir /newtop && rmdir /newtop").exit_code == 0
    got = sb.client.get(sb.id).info
    assert [p["policy"] for p in got["phases"]] == ["default", "eval", "rollout"]


def test_hidden_paths_are_invisible(make_sandbox, debian):
    sb = make_sandbox(debian)
    assert sb.exec("mkdir -p /srv/answers && echo 42 > /srv/answers/key && "
                   "echo secret > /srv/grader.txt").exit_code == 0
    sb.set_phase("eval", hidden_paths=["/srv/answers", "/srv/grader.txt"])
    r = sb.exec("cat /srv/answers/key; ls /srv/answers; cat /srv/grader.txt")
    assert "42" not in r.stdout and "secret" not in r.stdout
    assert sb.exec("echo x > /srv/answers/new").exit_code != 0
    sb.set_phase("rollout")
    assert sb.exec("cat /srv/answers/key").stdout == "42\n"


def test_policy_can_be_chosen_at_create(make_sandbox, busybox, server):
    from test_contract import conforms
    sb = make_sandbox(busybox, policy="eval")
    assert sb.info["policy"] == "eval"
    r = sb.exec("touch /bin/x")
    assert r.exit_code != 0 and "Read-only" in r.stderr
    doc = conforms(server.raw("POST", f"/v1/sandboxes/{sb.id}/phase", body={"policy": "rollout"}),
                   "/v1/sandboxes/{id}/phase", "POST")
    assert doc["policy"] == "rollout"
    conforms(server.raw("GET", "/v1/policies"), "/v1/policies", "GET")


def test_bad_policies_and_paths_are_refused(client, server, busybox, bb):
    before = {s.id for s in client.list()}
    expect_error(lambda: client.create(busybox, policy="nope"), dsec.InvalidArgument, "policy")
    expect_error(lambda: client.create(busybox, policy="eval", readonly_paths=["relative"]),
                 dsec.InvalidArgument, "readonly_paths")
    assert {s.id for s in client.list()} == before, "a refused create left a sandbox"
    for body, field in (({"policy": "nope"}, "policy"), ({}, "policy"),
                        ({"policy": "eval", "hidden_paths": ["/proc/self"]}, "hidden_paths"),
                        ({"policy": "eval", "readonly_paths": ["/a/../b"]}, "readonly_paths"),
                        ({"policy": "eval", "readonly_paths": "/usr"}, "readonly_paths"),
                        ({"policy": "eval", "bogus": 1}, "bogus")):
        status, _, _, doc = server.raw("POST", f"/v1/sandboxes/{bb.id}/phase", body=body)
        assert status == 400 and doc["error"]["field"] == field, (body, doc)
    assert bb.client.get(bb.id).info["policy"] == "default"
    status, _, _, doc = server.raw("POST", "/v1/sandboxes/sb-0000000000000000/phase",
                                   body={"policy": "eval"})
    assert status == 404


def test_policy_limits_cap_a_running_sandbox_and_lift_on_leaving(client, make_sandbox, debian):
    name = "tight-" + str(int(time.time() * 1000) % 100000)
    client.create_policy(name, limits={"pids": 32, "max_output_bytes": 100,
                                       "max_exec_timeout_s": 1, "memory_mb": 64})
    try:
        sb = make_sandbox(debian, memory_mb=512)
        assert len(sb.exec("head -c 1000 /dev/zero | tr '\\0' x").stdout) == 1000
        sb.set_phase(name)
        # Output and time: the exec's own asks are capped.
        r = sb.exec("head -c 1000 /dev/zero | tr '\\0' x", max_output_bytes=10000)
        assert len(r.stdout) == 100 and r.truncated, r
        r = sb.exec("sleep 5", timeout=30)
        assert r.timed_out, r
        # Processes: the cgroup's pids limit came down (32 < the sandbox's 1024).
        r = sb.exec("python3 -c \"import os, time\nn=0\ntry:\n  for i in range(64):\n"
                    "    if os.fork()==0:\n      time.sleep(0.3); os._exit(0)\n    n+=1\n"
                    "except OSError as e: print('refused after', n)\n"
                    "while True:\n  try: os.wait()\n  except ChildProcessError: break\"", timeout=30)
        assert "refused after" in r.stdout and int(r.stdout.split()[-1]) < 32, r
        # Memory: 64 MB now, so a 200 MB hog is killed.
        r = sb.exec("python3 -c \"b = bytearray(200 << 20); print('survived')\"", timeout=30)
        assert "survived" not in r.stdout and (r.oom_killed or r.exit_code != 0), r
        # Leaving the policy lifts its ceilings.
        sb.set_phase("default")
        r = sb.exec("python3 -c \"b = bytearray(200 << 20); print('survived')\"", timeout=30)
        assert r.stdout == "survived\n", r
        assert len(sb.exec("head -c 1000 /dev/zero | tr '\\0' x").stdout) == 1000
    finally:
        if "sb" in locals():
            sb.destroy()
        client.delete_policy(name)


STRICT_PROBE = r'''
import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
def err(fn):
    try:
        fn(); return 0
    except OSError as e:
        return e.errno
print(libc.ptrace(0, 0, 0, 0) == 0 or ctypes.get_errno(),   # PTRACE_TRACEME
      err(lambda: socket.socket(38, socket.SOCK_SEQPACKET)),  # AF_ALG
      err(lambda: socket.socket(40, socket.SOCK_STREAM)),     # AF_VSOCK
      err(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
      err(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)))
'''


def test_eval_runs_later_execs_under_the_strict_syscall_profile(make_sandbox, debian):
    sb = make_sandbox(debian)
    # default: ptrace works, AF_ALG is simply absent here, vsock is refused.
    ok, alg, vsock, inet, unix = sb.exec(["python3", "-c", STRICT_PROBE]).stdout.split()
    assert ok == "True" and alg != "1" and vsock == "1" and inet == unix == "0"
    before = sb.audit()["denied_syscalls"]
    sb.set_phase("eval")
    ok, alg, vsock, inet, unix = sb.exec(["python3", "-c", STRICT_PROBE]).stdout.split()
    assert ok == "1" and alg == "1" and vsock == "1" and inet == unix == "0"
    after = sb.audit()["denied_syscalls"]
    assert after.get("ptrace", 0) > before.get("ptrace", 0), after
    assert after.get("socket", 0) >= before.get("socket", 0) + 2, after
    # Back to rollout: later execs get the default profile again.
    sb.set_phase("rollout")
    ok = sb.exec(["python3", "-c", STRICT_PROBE]).stdout.split()[0]
    assert ok == "True"
