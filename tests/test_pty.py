"""Process sessions and terminals (docs/processes.md): a shell on a real
pseudo-terminal (size, resize, ^C, signals to the foreground job),
background processes with their output kept for clients that reconnect,
input, kill, listing, errors, and `dsec sandbox shell` in raw mode."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time

import pytest

import dsec
from conftest import dsec_bin


def read_until(proc, want: bytes, timeout: float = 15.0) -> bytes:
    """Output events from where ``proc`` last stopped until ``want`` shows."""
    got = b""
    deadline = time.monotonic() + timeout
    for ev in proc.events():  # a keepalive every 15 s bounds the wait
        if ev.type in ("stdout", "stderr"):
            got += ev.data
            if want in got:
                return got
        elif ev.type in ("exit", "error"):
            break
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"{want!r} not seen; got {got[-500:]!r}")


def drain(proc) -> tuple[bytes, dict]:
    out = b""
    last = None
    for ev in proc.events():
        if ev.type in ("stdout", "stderr"):
            out += ev.data
        elif ev.type != "keepalive":
            last = ev.raw
    return out, last


def test_pty_is_a_real_controlling_terminal_of_its_size(deb):
    # Field 7 of /proc/PID/stat is the controlling terminal's device (0: none).
    p = deb.pty(["/bin/sh", "-c", "tty; stty size; test -t 0 && test -t 1 && test -t 2 && "
                 "echo all-tty; echo ctty=$(cut -d' ' -f7 /proc/$$/stat); echo err >&2"],
                rows=33, cols=101)
    assert p.pid > 0 and p.info["pty"] == {"rows": 33, "cols": 101}
    out, last = drain(p)
    assert last["type"] == "exit" and last["exit_code"] == 0, (out, last)
    text = out.decode()
    assert "/dev/pts/" in text and "33 101\r\n" in text and "all-tty" in text, text
    assert "err\r\n" in text  # stderr is the terminal too
    assert "ctty=" in text and "ctty=0\r" not in text, text


def test_interactive_shell_input_resize_interrupt_and_exit(deb):
    p = deb.pty(["/bin/bash", "--norc", "-i"], rows=24, cols=80, env={"PS1": "$ "})
    read_until(p, b"$ ")
    p.send("echo hel''lo\n")
    read_until(p, b"hello\r\n")
    # Resize: the foreground program sees the new size (and SIGWINCH).
    p.resize(50, 132)
    p.send("stty size\n")
    read_until(p, b"50 132")
    # ^C typed interrupts the foreground job, not the shell.
    p.send("sleep 100\n")
    time.sleep(0.5)
    p.send("\x03")
    p.send("echo after=$?\n")
    read_until(p, b"after=130")
    # A signal through the API reaches the foreground job too.
    p.send("sleep 100; echo rc=$?\n")
    time.sleep(0.5)
    p.signal("SIGTERM")
    read_until(p, b"rc=143")
    p.send("exit 7\n")
    out, last = drain(p)
    assert last["type"] == "exit" and last["exit_code"] == 7, last
    p.refresh()
    assert p.info["running"] is False and p.info["exit_code"] == 7


def test_output_is_kept_for_a_client_that_reconnects(deb):
    p = deb.start_process("for i in 1 2 3; do echo line$i; echo err$i >&2; sleep 0.2; done",
                          tag="bg")
    assert p.info["tag"] == "bg" and p.info["pty"] is None
    time.sleep(1.5)
    # Another object, as after a dropped connection: everything from offset 0.
    again = deb.process(p.pid)
    out = {"stdout": b"", "stderr": b""}
    last = None
    for ev in again.events(offset=0):
        if ev.type in out:
            out[ev.type] += ev.data
        elif ev.type != "keepalive":
            last = ev.raw
    assert out == {"stdout": b"line1\nline2\nline3\n", "stderr": b"err1\nerr2\nerr3\n"}
    assert last["type"] == "exit" and last["exit_code"] == 0
    # Reading from the middle, and without following.
    part = deb.process(p.pid)
    evs = list(part.events(offset=6, follow=False))
    assert evs[0].offset == 6
    # The ended session is still listed (with its exit) until the sandbox goes.
    listed = {x.pid: x for x in deb.processes()}
    assert p.pid in listed and listed[p.pid].info["running"] is False


def test_reading_resumes_where_the_last_read_stopped(deb):
    p = deb.pty(["/bin/sh", "-c", "echo one; read x; echo two-$x"])
    read_until(p, b"one")
    p.send("Z\n")
    rest, last = drain(p)
    assert b"one" not in rest and b"two-Z" in rest, rest
    assert last["exit_code"] == 0


def test_stdin_of_a_background_process_and_eof(deb):
    p = deb.start_process(["sh", "-c", "cat; echo done"], stdin=True)
    p.send(b"abc\x00\xff\n")
    p.close_stdin()
    out, last = drain(p)
    assert out == b"abc\x00\xff\ndone\n" and last["exit_code"] == 0
    # Without stdin=True there is no input to send.
    q = deb.start_process(["sleep", "30"])
    with pytest.raises(dsec.Conflict) as e:
        q.send("x")
    assert e.value.field == "interactive"
    q.kill()
    _, last = drain(q)
    assert last["signal"] == 9


def test_kill_ends_a_shell_and_its_foreground_job(deb):
    p = deb.pty(["/bin/bash", "--norc", "-i"], env={"PS1": "$ "})
    read_until(p, b"$ ")
    p.send("sleep 1000\n")
    time.sleep(0.5)
    p.kill()
    _, last = drain(p)
    assert last["type"] == "exit" and last["signal"] == 9
    r = deb.exec("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done 2>/dev/null"
                 " | grep -c '^sleep 1000' || true")
    assert r.stdout.strip() == "0", r


def test_timeout_ends_a_session(deb):
    p = deb.pty(["sleep", "100"], timeout=0.5)
    _, last = drain(p)
    assert last["timed_out"] is True and last["signal"] == 9


def test_bad_requests_are_clear_errors(server, deb):
    base = f"/v1/sandboxes/{deb.id}/processes"
    for body, field in [({"cmd": "sh", "pty": {"rows": 0, "cols": 80}}, "rows"),
                        ({"cmd": "sh", "pty": {"rows": 10, "cols": 70000}}, "cols"),
                        ({"cmd": "sh", "pty": "big"}, "pty"),
                        ({"cmd": "sh", "pty": {"rows": 10, "cols": 10}, "stdin": False}, "stdin"),
                        ({"pty": {"rows": 10, "cols": 10}}, "cmd"),
                        ({"cmd": "sh", "bogus": 1}, "bogus")]:
        st, _, _, j = server.raw("POST", base, body)
        assert st == 400 and j["error"]["field"] == field, (body, st, j)
    st, _, _, j = server.raw("GET", base + "/999999")
    assert st == 404 and j["error"]["field"] == "pid"
    st, _, _, j = server.raw("GET", base + "/abc")
    assert st == 400 and j["error"]["field"] == "pid"
    p = deb.start_process(["sleep", "30"])
    try:
        st, _, _, j = server.raw("POST", f"{base}/{p.pid}/resize", {"rows": 5, "cols": 5})
        assert st == 400 and j["error"]["field"] == "pty"
        st, _, _, j = server.raw("POST", f"{base}/{p.pid}/signal", {"signal": "SIGNOPE"})
        assert st == 400 and j["error"]["field"] == "signal"
        st, _, _, j = server.raw("GET", f"{base}/{p.pid}/output?offset=-1")
        assert st == 400 and j["error"]["field"] == "offset"
    finally:
        p.kill()
    st, _, _, j = server.raw("POST", "/v1/sandboxes/nope/processes", {"cmd": "true"})
    assert st == 404


def test_sessions_of_a_destroyed_sandbox_go_with_it(make_sandbox, debian, server):
    sb = make_sandbox(debian)
    p = sb.pty(["sleep", "1000"])
    sb.destroy()
    st, _, _, _ = server.raw("GET", f"/v1/sandboxes/{sb.id}/processes/{p.pid}")
    assert st in (404, 409)


def _run_shell(server, sandbox_id: str, keys: list[bytes], timeout: float = 30.0):
    """`dsec sandbox shell` on a real terminal of ours: types `keys` (each
    once the previous output settled) and returns (exit status, output)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.environ["DSEC_URL"] = server.url
        os.environ["DSEC_TOKEN"] = server.client.token
        os.execv(str(dsec_bin()), [str(dsec_bin()), "sandbox", "shell", sandbox_id, "--",
                                   "/bin/bash", "--norc", "-i"])
    import fcntl
    import struct
    import termios
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    out = b""
    deadline = time.monotonic() + timeout
    pending = list(keys)
    quiet_since = time.monotonic()
    status = None
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            out += chunk
            quiet_since = time.monotonic()
        elif pending and time.monotonic() - quiet_since > 0.7:
            os.write(fd, pending.pop(0))
            quiet_since = time.monotonic()
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out


def test_cli_shell_raw_mode_size_and_exit_code(server, deb):
    code, out = _run_shell(server, deb.id, [b"stty size; tty\r", b"echo $((6*7))\r",
                                            b"sleep 100\r", b"\x03", b"exit 5\r"])
    text = out.decode(errors="replace")
    assert code == 5, text
    assert "40 120" in text and "/dev/pts/" in text and "42" in text, text
