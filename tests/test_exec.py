"""Exec: argv vs shell, env/cwd/user, stdin, exit codes, timeouts, signals,
streaming, output caps and binary output."""

from __future__ import annotations

import os
import time

import pytest

import dsec
from helpers import HOST_ENV_MARKER, proc_rss_kb


def test_argv_is_not_interpreted_by_a_shell(bb):
    r = bb.exec(["echo", "a;b", "$HOME", "*"])
    assert (r.exit_code, r.stdout) == (0, "a;b $HOME *\n")


def test_string_runs_through_sh(bb):
    r = bb.exec("echo a b | tr a-z A-Z; echo $((6*7))")
    assert (r.exit_code, r.stdout) == (0, "A B\n42\n")
    r = bb.exec(["sh", "-c", 'X=1; echo "x=$X"'])
    assert r.stdout == "x=1\n"


def test_stdout_and_stderr_are_separate(bb):
    r = bb.exec("echo out; echo err >&2; printf 'no newline'")
    assert r.stdout == "out\nno newline" and r.stderr == "err\n"


def test_unicode_round_trip(bb):
    r = bb.exec(["echo", "héllo ✓ 日本"])
    assert r.stdout == "héllo ✓ 日本\n"


@pytest.mark.parametrize("cmd,code", [
    ("exit 42", 42),
    (["false"], 1),
    (["true"], 0),
    ("exit 255", 255),
])
def test_exit_codes(bb, cmd, code):
    r = bb.exec(cmd)
    assert r.exit_code == code and r.signal == 0 and r.ok == (code == 0)
    assert not r.timed_out


def test_command_not_found_is_127(bb):
    r = bb.exec(["/no/such/binary"])
    assert r.exit_code == 127, r
    r = bb.exec(["no-such-command-xyz"])
    assert r.exit_code == 127, r
    r = bb.exec("no-such-command-xyz")
    assert r.exit_code == 127 and "not found" in r.stderr, r


def test_env_cwd_and_no_host_env_leak(bb):
    r = bb.exec("echo \"$FOO|$BAR\"", env={"FOO": "bar baz", "BAR": "x=y"})
    assert r.stdout == "bar baz|x=y\n"
    r = bb.exec(["pwd"], cwd="/tmp")
    assert r.stdout == "/tmp\n"
    r = bb.exec("pwd", cwd="/etc")
    assert r.stdout == "/etc\n"
    env = bb.exec(["env"]).stdout
    assert HOST_ENV_MARKER not in env, "the server's environment leaked into the sandbox"
    assert "DSEC_TOKEN" not in env


def test_missing_cwd_fails(bb):
    try:
        r = bb.exec(["pwd"], cwd="/no/such/dir")
    except dsec.DsecError as e:
        assert isinstance(e, (dsec.InvalidArgument, dsec.NotFound)), repr(e)
        return
    assert r.exit_code != 0 and r.stdout != "/no/such/dir\n", r


def test_user_by_uid_and_uid_gid(bb):
    r = bb.exec("id -u; id -g", user="65534")
    uid, gid = r.stdout.split()
    assert uid == "65534" and gid != "0", r  # never the root group by default
    r = bb.exec("id -u; id -g", user="1000:1000")
    assert r.stdout == "1000\n1000\n", r
    r = bb.exec("id -u", user="root")
    assert r.stdout == "0\n", r


def test_unprivileged_user_cannot_write_root_owned_dirs(bb):
    assert bb.exec("mkdir -p /root/private && chmod 700 /root", user="root").ok
    r = bb.exec("touch /root/private/x", user="65534")
    assert r.exit_code != 0, r
    assert bb.exec("test -e /root/private/x", user="root").exit_code == 1


def test_user_by_name(deb):
    r = deb.exec(["id", "-u"], user="nobody")
    assert r.stdout == "65534\n", r


def test_unknown_user_does_not_run_as_root(bb):
    try:
        r = bb.exec("id -u", user="no-such-user")
    except dsec.DsecError as e:
        assert isinstance(e, (dsec.InvalidArgument, dsec.NotFound)), repr(e)
        return
    assert not (r.ok and r.stdout == "0\n"), "unknown user ran the command as root"


def test_stdin_text(bb):
    r = bb.exec(["cat"], stdin="hello\nworld\n")
    assert r.stdout == "hello\nworld\n"
    assert bb.exec("wc -l", stdin="a\nb\nc\n").stdout.strip() == "3"


def test_stdin_binary_and_base64_output(bb):
    data = bytes(range(256)) * 4
    assert bb.exec("wc -c", stdin=data).stdout.strip() == str(len(data))
    r = bb.exec(["cat"], stdin=data, encoding="base64")
    assert r.stdout_bytes == data and r.ok


def test_large_stdin(bb):
    data = os.urandom(256 * 1024)
    r = bb.exec("wc -c", stdin=data, timeout=20)
    assert r.stdout.strip() == str(len(data))


def test_no_stdin_means_eof(bb):
    t0 = time.monotonic()
    r = bb.exec(["cat"], timeout=5)
    assert (r.exit_code, r.stdout, r.timed_out) == (0, "", False), r
    assert time.monotonic() - t0 < 3


def test_binary_output_utf8_replaces_invalid_bytes(bb):
    cmd = r"printf 'a\000b\377c'"
    r = bb.exec(cmd, encoding="base64")
    assert r.stdout_bytes == b"a\x00b\xffc"
    r = bb.exec(cmd)
    assert r.stdout == "a\x00b\ufffdc", repr(r.stdout)


def test_timeout_kills_command(bb):
    t0 = time.monotonic()
    r = bb.exec("sleep 30", timeout=1)
    wall = time.monotonic() - t0
    assert r.timed_out, r
    assert not r.ok
    assert wall < 5, f"exec with timeout 1 returned after {wall:.1f} s"
    assert 0.9 <= r.duration < 5, r.duration


def test_timeout_kills_the_whole_process_tree(bb):
    r = bb.exec("sleep 31 & sleep 32 & sleep 33; wait", timeout=1)
    assert r.timed_out
    left = wait_no_process(bb, ("sleep 31", "sleep 32", "sleep 33"))
    assert not left, f"still running after the exec timed out:\n{left}"


def wait_no_process(sb, needles, timeout=3.0):
    """The ps lines that still match after `timeout` seconds ('' if none)."""
    deadline = time.monotonic() + timeout
    while True:
        ps = sb.exec(["ps", "-o", "pid,args"]).stdout
        hits = "\n".join(line for line in ps.splitlines() if any(n in line for n in needles))
        if not hits or time.monotonic() > deadline:
            return hits
        time.sleep(0.2)


def test_fractional_timeout(bb):
    t0 = time.monotonic()
    r = bb.exec("sleep 5", timeout=0.5)
    assert r.timed_out and time.monotonic() - t0 < 3


@pytest.mark.parametrize("sig", [9, 15])
def test_killed_by_signal(bb, sig):
    r = bb.exec(f"kill -{sig} $$; sleep 5", timeout=10)
    assert r.signal == sig, r
    assert not r.ok and not r.timed_out


def test_duration_is_measured(bb):
    r = bb.exec("sleep 0.3")
    assert 250 <= r.duration_ms < 5000, r
    assert abs(r.duration - r.duration_ms / 1000) < 1e-9


def test_exec_stream_delivers_output_as_it_happens(bb):
    t0 = time.monotonic()
    events = []
    for ev in bb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.2; done; echo e >&2"):
        events.append((time.monotonic() - t0, ev))
    types = [ev.type for _, ev in events]
    assert types[-1] == "exit", types
    assert types.count("exit") == 1
    out = "".join(ev.data for _, ev in events if ev.type == "stdout")
    err = "".join(ev.data for _, ev in events if ev.type == "stderr")
    assert (out, err) == ("1\n2\n3\n", "e\n")
    first_out = next(t for t, ev in events if ev.type == "stdout")
    t_exit = events[-1][0]
    assert t_exit - first_out >= 0.3, (
        f"first stdout event came {t_exit - first_out:.2f} s before exit: output was buffered")
    ex = events[-1][1]
    assert ex.exit_code == 0 and ex.result.ok and not ex.result.timed_out
    assert "stdout" not in ex.raw and "stderr" not in ex.raw


def test_exec_stream_exit_code_timeout_and_base64(bb):
    evs = list(bb.exec_stream("echo x; exit 7"))
    assert evs[-1].type == "exit" and evs[-1].exit_code == 7
    t0 = time.monotonic()
    evs = list(bb.exec_stream("sleep 10", timeout=1))
    assert evs[-1].type == "exit" and evs[-1].timed_out is True
    assert time.monotonic() - t0 < 5
    evs = list(bb.exec_stream(r"printf '\000\377'; printf '\001' >&2", encoding="base64"))
    assert b"".join(e.data_bytes for e in evs if e.type == "stdout") == b"\x00\xff"
    assert b"".join(e.data_bytes for e in evs if e.type == "stderr") == b"\x01"


def test_exec_stream_with_stdin(bb):
    evs = list(bb.exec_stream(["cat"], stdin="streamed\n"))
    assert "".join(e.data for e in evs if e.type == "stdout") == "streamed\n"
    assert evs[-1].exit_code == 0


def test_output_flood_is_capped_and_server_memory_stays_bounded(bb, server):
    rss0 = proc_rss_kb(server.pid)
    t0 = time.monotonic()
    r = bb.exec("yes", max_output_bytes=10000, timeout=2)
    wall = time.monotonic() - t0
    assert r.truncated, r
    assert len(r.stdout) == 10000 and r.stdout == "y\n" * 5000
    assert wall < 6, f"took {wall:.1f} s"
    r = bb.exec("yes >&2", max_output_bytes=10000, timeout=2)
    assert r.truncated and len(r.stderr) == 10000 and r.stdout == ""
    r = bb.exec("yes", timeout=2)  # default cap: 1 MiB per stream
    assert r.truncated and len(r.stdout) == 1048576
    grew_mb = (proc_rss_kb(server.pid) - rss0) / 1024
    assert grew_mb < 64, f"server RSS grew by {grew_mb:.0f} MiB during output floods"


def test_output_cap_in_streaming_mode(bb, server):
    rss0 = proc_rss_kb(server.pid)
    evs = list(bb.exec_stream("yes", max_output_bytes=10000, timeout=2))
    got = "".join(e.data for e in evs if e.type == "stdout")
    assert len(got) == 10000, len(got)
    assert evs[-1].type == "exit" and evs[-1].truncated is True
    assert (proc_rss_kb(server.pid) - rss0) / 1024 < 64


def test_small_output_is_not_truncated(bb):
    r = bb.exec("head -c 5000 /dev/zero | tr '\\0' x", max_output_bytes=5000)
    assert len(r.stdout) == 5000 and not r.truncated
    r = bb.exec("echo hi", max_output_bytes=0)
    assert r.stdout == "" and r.truncated


def test_debian_python3_exec(deb):
    r = deb.exec(["python3", "-c", "import sys; sys.stdout.write('x'*3); sys.exit(5)"])
    assert (r.exit_code, r.stdout) == (5, "xxx")
    r = deb.exec(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin="abc")
    assert r.stdout == "cba\n"


def test_many_small_writes_arrive_complete_and_in_order(bb):
    want = "".join(f"{i}\n" for i in range(1, 20001))
    r = bb.exec("seq 1 20000; seq 1 20000 >&2")
    assert r.stdout == want and r.stderr == want and not r.truncated
    evs = list(bb.exec_stream("seq 1 20000; seq 1 20000 >&2"))
    assert "".join(e.data for e in evs if e.type == "stdout") == want
    assert "".join(e.data for e in evs if e.type == "stderr") == want


# ----- cancellation through the async client ------------------------------------------

def _cancel_midway(server, busybox, make_call, pattern, within=10):
    """Creates a sandbox with an AsyncClient, starts ``make_call(sb)``, cancels
    its task once a process whose command line matches ``pattern`` (grep)
    runs, and returns whether none is left ``within`` seconds later."""
    import asyncio

    async def main():
        async with dsec.AsyncClient(server.url, token=server.client.token) as c:
            async with await c.create(busybox, labels={"suite": "e2e-cancel"}) as sb:
                server.created.add(sb.id)
                task = asyncio.create_task(make_call(sb))

                async def running():
                    r = await sb.exec(f"ps -o args | grep -c '{pattern}'")
                    return r.stdout.strip() != "0"
                deadline = time.monotonic() + 10
                while not await running():
                    assert time.monotonic() < deadline, "the command never started"
                    await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert c.connections <= 1  # the cancelled call's connection was dropped

                async def gone():
                    return not await running()
                deadline = time.monotonic() + within
                while not await gone():
                    if time.monotonic() > deadline:
                        return False
                    await asyncio.sleep(0.2)
                return True
    return asyncio.run(main())


def test_cancelling_an_async_exec_stream_stops_the_command(server, busybox):
    # Today's server notices a streaming client gone when it next writes
    # output to it: the command prints.
    async def call(sb):
        async for _ in sb.exec_stream("while :; do echo 7771; sleep 0.2; done", timeout=600):
            pass
    assert _cancel_midway(server, busybox, call, "[e]cho 7771"), \
        "the streamed exec's command outlived its cancelled caller"


def test_cancelling_an_async_exec_stops_the_command(server, busybox):
    async def call(sb):
        await sb.exec(["sleep", "7772"], timeout=600)
    assert _cancel_midway(server, busybox, call, "^sleep 7772$", within=5), \
        "the exec's command outlived its cancelled caller"
