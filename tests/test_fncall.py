"""backend="fncall" and one-shot calls (docs/fncall.md).

The snippets run twice: as a one-shot call (client.run, a warm pool sandbox,
python through its zygote) and with `python3 -c` / `bash -c` in a container
sandbox of the same image; results must be identical. Then what is specific
to calls: isolation between calls, limits, fncall sandboxes, bad input.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import threading
import time

import pytest

import dsec
from helpers import cgroup_dirs_named, expect_error, zygote_pids


def _landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(0, libc.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


# Landlock ABI 6 scopes signals: a call cannot signal its zygote or a spare.
SCOPED = _landlock_abi() >= 6


def _host_pid(sandbox_id: str, pid: int) -> int:
    """The host pid of process `pid` of the sandbox's pid namespace."""
    procs = []
    for top in cgroup_dirs_named(sandbox_id):
        for d, _, _ in os.walk(top):  # processes may sit in a child cgroup (v2)
            try:
                procs += open(os.path.join(d, "cgroup.procs")).read().split()
            except OSError:
                continue
    for hp in procs:
        try:
            with open(f"/proc/{hp}/status") as f:
                for line in f:
                    if line.startswith("NSpid:") and int(line.split()[-1]) == pid:
                        return int(hp)
        except OSError:
            continue
    raise AssertionError(f"no process {pid} in sandbox {sandbox_id}")


# Python that lists the zygote's other children (spares) of a sandbox's
# zygote ZYGOTE, waiting up to 30 s for one.
_FIND_SPARES = (
    "import os, time\n"
    "def spares():\n"
    "    out = []\n"
    "    for p in filter(str.isdigit, os.listdir('/proc')):\n"
    "        try:\n"
    "            st = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()\n"
    "        except (OSError, ValueError):\n"
    "            continue\n"
    "        if int(st[1]) == ZYGOTE and int(p) != os.getpid():\n"
    "            out.append(int(p))\n"
    "    return out\n"
    "for _ in range(600):\n"  # the spare is forked after the last call: slow under load
    "    found = spares()\n"
    "    if found:\n"
    "        break\n"
    "    time.sleep(0.05)\n")

# tamper(pid, signals): tries to change process pid's limits, priority,
# CPUs, scheduling class and (with signals) to stop it; one word per try.
_TAMPER = (
    "import os, resource, signal\n"
    "def tamper(t, signals):\n"
    "    tries = [lambda: resource.prlimit(t, resource.RLIMIT_NOFILE, (16, 16)),\n"
    "             lambda: os.setpriority(os.PRIO_PROCESS, t, 19),\n"
    "             lambda: os.setpriority(os.PRIO_USER, 0, 19),\n"
    "             lambda: os.sched_setaffinity(t, {0}),\n"
    "             lambda: os.sched_setscheduler(t, os.SCHED_IDLE, os.sched_param(0))]\n"
    "    if signals:\n"
    "        tries.append(lambda: os.kill(t, signal.SIGSTOP))\n"
    "    out = []\n"
    "    for f in tries:\n"
    "        try:\n"
    "            f()\n"
    "            out.append('done')\n"
    "        except PermissionError:\n"
    "            out.append('EPERM')\n"
    "    return ' '.join(out)\n")

# (name, language, code, run kwargs). Compared on exit code, signal, stdout,
# stderr, truncation and timeout.
SNIPPETS = [
    ("print", "python", "print(1)", {}),
    ("unicode", "python", "print('héllo wörld ✓ 日本語 🚀')", {}),
    ("no_newline", "python", "import sys; sys.stdout.write('no newline')", {}),
    ("exception", "python", "def f():\n    raise ValueError('boom')\nf()", {}),
    ("unicode_exception", "python", "raise KeyError('ключ')", {}),
    ("chained", "python",
     "try:\n    1/0\nexcept Exception as e:\n    raise RuntimeError('x') from e", {}),
    ("syntax_error", "python", "print(", {}),
    ("indentation_error", "python", "if True:\nprint(1)", {}),
    ("exit_code", "python", "import sys; sys.exit(3)", {}),
    ("exit_message", "python", "import sys; sys.exit('bye')", {}),
    ("os_exit", "python", "import os; print('lost', end=''); os._exit(7)", {}),
    ("stdin_line", "python", "print(input()[::-1])", {"stdin": "abc\n"}),
    ("stdin_large", "python", "import sys; d = sys.stdin.read(); print(len(d), d[-5:])",
     {"stdin": "0123456789" * 20000}),
    ("stdin_eof", "python", "print(input())", {}),
    ("large_output", "python", "print('x' * 1000000)", {}),
    ("many_lines", "python", "for i in range(50000): print(i)", {}),
    ("stderr", "python", "import sys; print('out'); print('err', file=sys.stderr)", {}),
    ("binary", "python", "import sys; sys.stdout.buffer.write(bytes(range(256)))",
     {"encoding": "base64"}),
    ("recursion", "python", "def f(): f()\nf()", {}),
    ("thread", "python",
     "import threading, time\ndef w():\n    time.sleep(0.2); print('late')\n"
     "threading.Thread(target=w).start(); print('early')", {}),
    ("atexit", "python", "import atexit; atexit.register(lambda: print('bye')); print('hi')", {}),
    ("name_argv", "python", "import sys; print(__name__, sys.argv, sys.path[0] == '')", {}),
    ("env", "python", "import os; print(os.environ.get('FNCALL_TEST'))",
     {"env": {"FNCALL_TEST": "yes"}}),
    ("subprocess", "python",
     "import subprocess; print(subprocess.run(['echo', 'hi'], capture_output=True).stdout)", {}),
    ("compute", "python",
     "import json, math; print(json.dumps({'pi': round(math.pi, 5), 's': sum(range(10**6))}))",
     {}),
    ("float", "python", "print(0.1 + 0.2, 1e300 * 10, -0.0)", {}),
    ("truncated", "python", "print('y' * 200000)", {"max_output_bytes": 1000}),
    ("infinite_loop", "python", "while True: pass", {"timeout": 1}),
    ("partial_then_hang", "python", "import time; print('a', flush=True); time.sleep(30)",
     {"timeout": 1}),
    ("socket", "python",
     "import socket\ns = socket.socket(); s.settimeout(2)\n"
     "try:\n    s.connect(('1.1.1.1', 80)); print('connected')\n"
     "except OSError as e:\n    print('refused', type(e).__name__)", {}),
    ("bash_basic", "bash", "echo hi; echo err >&2; exit 3", {}),
    ("bash_pipe", "bash", "printf 'ü straße\\n' | tr a-z A-Z; echo ${#BASH_VERSION}", {}),
    ("bash_stdin", "bash", "read x; echo \"got $x\"", {"stdin": "line\n"}),
    ("bash_loop_timeout", "bash", "while :; do :; done", {"timeout": 1}),
]


def _container(deb, language, code, kw):
    argv = ["python3", "-c", code] if language == "python" else ["bash", "-c", code]
    return deb.exec(argv, timeout=kw.get("timeout", 30), stdin=kw.get("stdin"),
                    env=kw.get("env"), max_output_bytes=kw.get("max_output_bytes"),
                    encoding=kw.get("encoding"), cwd="/tmp")


def _run(client, debian, language, code, kw):
    return client.run(code, language=language, image=debian, timeout=kw.get("timeout", 30),
                      stdin=kw.get("stdin"), env=kw.get("env"),
                      max_output_bytes=kw.get("max_output_bytes"),
                      encoding=kw.get("encoding"))


@pytest.mark.parametrize("name,language,code,kw", SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_same_result_as_a_container(client, debian, deb, name, language, code, kw):
    got = _run(client, debian, language, code, kw)
    want = _container(deb, language, code, kw)
    summary = f"fncall {got!r}\ncontainer {want!r}"
    assert got.timed_out == want.timed_out, summary
    if want.timed_out:
        # Both killed by the wall clock; what was flushed before it is kept.
        assert got.limit == "timeout" and got.signal == want.signal == 9, summary
        assert got.stdout_bytes == want.stdout_bytes, summary
        return
    assert (got.exit_code, got.signal) == (want.exit_code, want.signal), summary
    assert got.stdout_bytes == want.stdout_bytes, summary
    assert got.stderr_bytes == want.stderr_bytes, summary
    assert got.truncated == want.truncated, summary
    assert got.limit == ("output" if want.truncated else None), summary


def test_nothing_leaks_between_calls(client, debian):
    first = client.run(
        "import os, socket, subprocess, builtins, sys\n"
        "open('leak.txt', 'w').write('secret')\n"
        "open('/scratch/leak2', 'w').write('secret')\n"
        "os.environ['LEAK'] = '1'; builtins.LEAK = 1; sys.modules['json'].LEAK = 1\n"
        "subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "subprocess.Popen(['sh', '-c', 'sleep 1001 &'])\n"
        "import ctypes; libc = ctypes.CDLL(None)\n"
        "print(libc.shmget(0x1234, 4096, 0o1666), socket.gethostname())",
        image=debian, timeout=10)
    assert first.exit_code == 0, first
    shm_id, host = first.stdout.split()
    assert int(shm_id) >= 0
    # Long enough for its sandbox to settle: the pool then gives the next
    # call the same one (back to back, it would take another if it has one).
    time.sleep(0.1)
    second = client.run(
        "import os, socket, builtins, json, glob\n"
        "procs = [open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()]\n"
        "print(socket.gethostname())\n"
        "print(os.path.exists('leak.txt'), os.path.exists('/scratch/leak2'),\n"
        "      'LEAK' in os.environ, hasattr(builtins, 'LEAK'), hasattr(json, 'LEAK'))\n"
        "print(any('sleep' in p for p in procs), len(open('/proc/sysvipc/shm').readlines()) - 1)\n"
        "print(sorted(os.listdir('/scratch')), glob.glob('/scratch/.run/*') == [os.getcwd()])",
        image=debian, timeout=10)
    assert second.exit_code == 0, second
    lines = second.stdout.splitlines()
    assert lines[0] == host, "the second call ran in another sandbox: the check proves nothing"
    assert lines[1] == "False False False False False", second
    assert lines[2] == "False 0", second
    assert lines[3] == "['.run'] True", second


def test_a_thread_outliving_its_main_thread_is_killed(make_sandbox, debian):
    # A process the call leaves ends its main thread alone (exit(2), not
    # exit_group(2)): it shows as a zombie while its other thread runs on. It
    # must be killed with the rest of what the call left, not taken for dead.
    sb = make_sandbox(debian, backend="fncall", disk_mb=16)
    inner = ("import ctypes, threading, time\n"
             "def later():\n"
             "    time.sleep(1.5)\n"
             "    open('/scratch/escaped', 'w').write('x')\n"
             "threading.Thread(target=later).start()\n"
             "ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: this thread only\n")
    r = sb.run("import subprocess, sys, time\n"
               f"subprocess.Popen([sys.executable, '-c', {inner!r}])\n"
               "time.sleep(0.5)\n"
               "print('main ends')\n", timeout=10)
    assert r.exit_code == 0 and r.stdout == "main ends\n", r
    time.sleep(3)
    r = sb.run("import os; print(os.path.exists('/scratch/escaped'))")
    assert r.stdout == "False\n", "a thread of an ended call ran on: " + r.stdout


def test_a_call_runs_in_a_child_forked_after_the_previous_call_ended(make_sandbox, debian):
    # The spare a call runs in is forked when the previous call has ended
    # (docs/fncall.md): it never existed while that call ran, so nothing that
    # call did can have reached it, and it is a child of the same zygote.
    sb = make_sandbox(debian, backend="fncall", disk_mb=16)
    first = sb.run("import os, json\n"
                   "json.LEAK = 1; os.environ['LEAK'] = '1'\n"
                   "print(os.getppid(), *[p for p in os.listdir('/proc') if p.isdigit()])")
    assert first.exit_code == 0, first
    zygote, *seen = first.stdout.split()
    second = sb.run("import os, json\n"
                    "print(os.getpid(), os.getppid(), hasattr(json, 'LEAK'), 'LEAK' in os.environ)")
    assert second.exit_code == 0, second
    pid, ppid, leak_json, leak_env = second.stdout.split()
    assert ppid == zygote, "not the same zygote: the check proves nothing"
    assert pid not in seen, "the second call's process existed during the first call"
    assert (leak_json, leak_env) == ("False", "False"), second


def test_calls_cannot_tamper_with_their_zygote_or_spare(make_sandbox, debian):
    # A call shares its uid with the zygote (whose later forks serve the next
    # calls, other callers' in the one-shot pool) and with the spare a bash
    # call may run beside: it must not lower their rlimits, raise their nice
    # value, pin or demote them (seccomp, seccomp.h selfOnlyFilter), nor stop
    # them (Landlock signal scoping, ABI 6).
    if not SCOPED:
        print("signals not checked: Landlock ABI %d has no signal scoping (needs 6)"
              % _landlock_abi())
    sb = make_sandbox(debian, backend="fncall", disk_mb=16)
    # What a call inherits from its zygote.
    state = ("import os, resource\n"
             "print(os.getppid(), os.nice(0), resource.getrlimit(resource.RLIMIT_NOFILE),"
             " sorted(os.sched_getaffinity(0)), os.sched_getscheduler(0))")
    before = sb.run(state)
    assert before.exit_code == 0, before
    zygote = before.stdout.split()[0]
    # (kill(-1) succeeds if it may try anyone; `after` shows it stopped no one.)
    everyone = "os.kill(-1, signal.SIGSTOP)\n" if SCOPED else ""
    r = sb.run(_TAMPER + everyone + "print(tamper(os.getppid(), %s))" % SCOPED)
    assert r.exit_code == 0 and r.stdout.split() == ["EPERM"] * (6 if SCOPED else 5), r
    # A bash call runs while the python zygote holds its spare.
    spare_code = (_FIND_SPARES + _TAMPER + "print(len(found), tamper(found[0], %s))" % SCOPED
                  ).replace("ZYGOTE", zygote)
    r = sb.run("python3 -c " + shlex.quote(spare_code), language="bash", timeout=45)
    assert r.exit_code == 0 and r.stdout.split() == ["1"] + ["EPERM"] * (6 if SCOPED else 5), r
    after = sb.run(state, timeout=20)
    assert after.exit_code == 0 and after.stdout == before.stdout, (before, after)
    # Its own limits and priority a call may change.
    r = sb.run("import os, resource\nos.nice(5)\n"
               "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
               "os.sched_setaffinity(0, {0})\nprint(os.nice(0))")
    assert r.exit_code == 0 and r.stdout == "5\n", r


def test_a_dead_spare_is_replaced(make_sandbox, debian):
    # A spare that died unused (here killed from the host; a call cannot,
    # test above) fails the send: the next python call takes a new spare of
    # the same zygote.
    sb = make_sandbox(debian, backend="fncall", disk_mb=16)
    r = sb.run("import os; print(os.getppid())")
    assert r.exit_code == 0, r
    zygote = r.stdout.strip()
    r = sb.run("python3 -c " + shlex.quote((_FIND_SPARES + "print(*found)").replace("ZYGOTE", zygote)),
               language="bash", timeout=45)
    assert r.exit_code == 0 and len(r.stdout.split()) == 1, r
    spare = _host_pid(sb.id, int(r.stdout))
    os.kill(spare, signal.SIGKILL)
    # Gone (reaped by the zygote) before the next call: its socket is closed
    # then, and the send fails. (A spare killed while the request is under
    # way would report that call killed by SIGKILL.)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{spare}") and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(3):
        r = sb.run("import os; print(os.getppid(), %d)" % i, timeout=20)
        assert r.exit_code == 0 and r.stdout == "%s %d\n" % (zygote, i), r


def test_each_call_sees_fresh_random_state(client, debian):
    code = "import random, uuid; print(random.random(), uuid.uuid4())"
    a = client.run(code, image=debian)
    b = client.run(code, image=debian)
    assert a.exit_code == b.exit_code == 0 and a.stdout != b.stdout


def test_hash_seed(client, debian):
    code = "print(hash('x'))"
    # A zygote's forks share its hash secret; it is retired after 64 calls
    # (this server's --fncall-zygote-max-calls), and the next one has a new secret.
    seen = [client.run(code, image=debian).stdout for _ in range(70)]
    assert len(set(seen)) >= 2, "one hash secret for 70 calls"
    assert max(seen.count(v) for v in set(seen)) <= 64, seen
    # PYTHONHASHSEED in a call's env: a fresh interpreter honours it.
    a = client.run(code, image=debian, env={"PYTHONHASHSEED": "random"})
    b = client.run(code, image=debian, env={"PYTHONHASHSEED": "random"})
    assert a.exit_code == b.exit_code == 0 and a.stdout != b.stdout, (a, b)
    a = client.run(code, image=debian, env={"PYTHONHASHSEED": "0"})
    b = client.run(code, image=debian, env={"PYTHONHASHSEED": "0"})
    assert a.exit_code == 0 and a.stdout == b.stdout, (a, b)


def test_a_retired_zygote_is_replaced_by_one_started_ahead(make_sandbox, debian):
    # A zygote forks at most 64 calls (its hash secret's quota,
    # --fncall-zygote-max-calls on this server; 1024 by default); its successor
    # is started once 48 are done, so the 65th call finds it ready instead of
    # waiting for an interpreter to start (docs/fncall.md).
    sb = make_sandbox(debian, backend="fncall", disk_mb=16)
    code = "import os; print(os.getppid(), hash('x'))"
    first = [sb.run(code).stdout.split() for _ in range(48)]
    assert len({z for z, _ in first}) == 1, first
    old = first[0][0]
    listing = ("import os\n"
               "print(*sorted(p for p in filter(str.isdigit, os.listdir('/proc'))\n"
               "      if b'dsec fncall zygote' in open(f'/proc/{p}/cmdline', 'rb').read(100)\n"
               "      and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1] == '1'))")
    r = sb.run("python3 -c " + shlex.quote(listing), language="bash")
    zygotes = r.stdout.split()
    assert r.exit_code == 0 and len(zygotes) == 2 and old in zygotes, r
    successor = [z for z in zygotes if z != old][0]
    rest = [sb.run(code).stdout.split() for _ in range(16)]
    assert all(z == old for z, _ in rest), rest
    new = sb.run(code).stdout.split()
    assert new[0] == successor, (new, zygotes)
    assert new[1] != first[0][1], "the successor shares its predecessor's hash secret"
    r = sb.run("python3 -c " + shlex.quote(listing), language="bash")
    assert r.exit_code == 0 and r.stdout.split() == [successor], r


def test_files_are_given_and_removed(client, debian):
    r = client.run("import os\nprint(open('data/in.txt').read(), open('bin', 'rb').read())\n"
                   "print(os.getcwd().startswith('/scratch/.run/'), os.environ['TMPDIR'] == os.getcwd())",
                   image=debian, files={"data/in.txt": "hello", "bin": b"\x00\xff"})
    assert r.exit_code == 0, r
    assert r.stdout == "hello b'\\x00\\xff'\nTrue True\n"


def test_writes_only_to_scratch(client, debian):
    r = client.run(
        "import errno\n"
        "for p in ['/etc/x', '/tmp/x', '/root/x', '/dev/shm/x', '/usr/bin/python3']:\n"
        "    try:\n        open(p, 'a').write('x'); print(p, 'WROTE')\n"
        "    except OSError as e:\n        print(p, errno.errorcode[e.errno])\n"
        "open('/scratch/ok', 'w').write('x'); print('scratch ok')",
        image=debian)
    assert r.exit_code == 0, r
    lines = r.stdout.splitlines()
    for line in lines[:5]:
        # ETXTBSY: python3 is running (opened for writing, a binary would
        # be EROFS anyway).
        assert line.split()[1] in ("EROFS", "EACCES", "EPERM", "ETXTBSY"), r.stdout
    assert lines[5] == "scratch ok"


def test_fork_bomb_is_contained(client, debian):
    r = client.run("import os\nwhile True:\n    try:\n        os.fork()\n"
                   "    except OSError:\n        pass", image=debian, timeout=2)
    assert r.timed_out and r.limit == "timeout", r
    after = client.run("import os; print(sum(1 for p in os.listdir('/proc') if p.isdigit()))",
                       image=debian)
    # aether, the zygote, its spare and this call.
    assert after.exit_code == 0 and int(after.stdout) <= 5, after


def test_memory_limits(client, debian):
    # RLIMIT_AS: Python raises MemoryError; uncaught, it is the limit that stopped the call.
    r = client.run("x = bytearray(1 << 30)", image=debian, limits={"memory_mb": 200})
    assert r.exit_code == 1 and "MemoryError" in r.stderr and r.limit == "memory", r
    # Raised from one (a handler that re-raises as something else) counts too.
    r = client.run("try:\n    x = bytearray(1 << 30)\nexcept MemoryError:\n    raise SystemError('oom')",
                   image=debian, limits={"memory_mb": 200})
    assert r.exit_code == 1 and r.limit == "memory", r
    # Caught and survived: not stopped by it.
    r = client.run("try:\n    x = bytearray(1 << 30)\nexcept MemoryError:\n    print('survived')",
                   image=debian, limits={"memory_mb": 200})
    assert r.exit_code == 0 and r.stdout == "survived\n" and r.limit is None, r
    # A MemoryError the program raises itself, with no memory_mb: its own error.
    r = client.run("raise MemoryError('mine')", image=debian)
    assert r.exit_code == 1 and r.limit is None, r
    r = client.run("x = []\nwhile True:\n    x.append(bytearray(64 << 20))", image=debian,
                   timeout=30)
    # The pool sandbox's memory cgroup (512 MB) kills it.
    assert r.signal == 9 and r.oom_killed and r.limit == "memory", r


def test_cpu_and_file_size_limits(client, debian):
    r = client.run("while True: pass", image=debian, timeout=20, limits={"cpu_s": 1})
    assert r.signal == 24 and r.limit == "cpu" and not r.timed_out, r  # SIGXCPU
    # Python ignores SIGXFSZ: the write fails with EFBIG instead; uncaught, it
    # is the limit that stopped the call.
    r = client.run("open('big', 'wb').write(b'x' * (3 << 20))", image=debian,
                   limits={"file_size_mb": 1})
    assert r.exit_code == 1 and "File too large" in r.stderr and r.limit == "file_size", r
    r = client.run("import errno\ntry:\n    open('big', 'wb').write(b'x' * (3 << 20))\n"
                   "except OSError as e:\n    print(errno.errorcode[e.errno])",
                   image=debian, limits={"file_size_mb": 1})
    assert r.exit_code == 0 and r.stdout == "EFBIG\n" and r.limit is None, r
    r = client.run("exec head -c 3M /dev/zero > big", language="bash", image=debian,
                   limits={"file_size_mb": 1})
    assert r.signal == 25 and r.limit == "file_size", r  # SIGXFSZ
    # A shell whose command SIGXFSZ killed exits 128+25.
    r = client.run("head -c 3M /dev/zero > big; echo after", language="bash", image=debian,
                   limits={"file_size_mb": 1})
    assert r.stdout == "after\n" and r.limit is None, r  # it went on: not stopped
    r = client.run("head -c 3M /dev/zero > big\nexit $?", language="bash", image=debian,
                   limits={"file_size_mb": 1})
    assert r.exit_code == 153 and r.limit == "file_size", r
    r = client.run("import os\nfds = [os.open('/dev/null', 0) for _ in range(100)]",
                   image=debian, limits={"open_files": 20})
    assert r.exit_code == 1 and "Too many open files" in r.stderr, r


def _cpu_quota(sandbox_id: str) -> float:
    """The CPU quota of the sandbox's cgroup, in cores (v1 or v2)."""
    for top in cgroup_dirs_named(sandbox_id):
        if os.path.exists(os.path.join(top, "cpu.cfs_quota_us")):
            with open(os.path.join(top, "cpu.cfs_quota_us")) as q, \
                    open(os.path.join(top, "cpu.cfs_period_us")) as p:
                return int(q.read()) / int(p.read())
        if os.path.exists(os.path.join(top, "cpu.max")):
            with open(os.path.join(top, "cpu.max")) as f:
                q, p = f.read().split()
            return int(q) / int(p)
    raise AssertionError(f"no cpu cgroup for {sandbox_id}")


def test_a_fncall_sandbox_has_cpu_for_its_zygote_beside_its_calls(client, make_sandbox, debian):
    # The zygote's spares, their exits, the clean-up and a successor's start
    # run in the sandbox's cgroup too: a fncall sandbox's quota is its cpu
    # plus 0.5 core (kFncallCpuOverhead), at create and under a policy's
    # ceiling; a container's is its cpu (docs/fncall.md).
    fn = make_sandbox(debian, backend="fncall", cpu=1, disk_mb=16)
    ct = make_sandbox(debian, backend="container", cpu=1)
    assert _cpu_quota(fn.id) == 1.5 and _cpu_quota(ct.id) == 1.0
    name = "half-cpu-" + str(int(time.time() * 1000) % 100000)
    client.create_policy(name, limits={"cpu": 0.5})
    try:
        fn.set_phase(name)
        ct.set_phase(name)
        assert _cpu_quota(fn.id) == 1.0 and _cpu_quota(ct.id) == 0.5
        assert fn.run("print(1)").stdout == "1\n"
        fn.set_phase("default")
        ct.set_phase("default")
        assert _cpu_quota(fn.id) == 1.5 and _cpu_quota(ct.id) == 1.0
    finally:
        fn.set_phase("default")
        ct.set_phase("default")
        client.delete_policy(name)


def test_a_call_cannot_kill_its_zygote(client, debian):
    if not SCOPED:
        pytest.skip("Landlock ABI %d has no signal scoping (needs 6): a call may "
                    "kill its zygote (the next call starts a new one)" % _landlock_abi())
    r = client.run("import os; os.kill(os.getppid(), 9)", image=debian)
    assert r.exit_code == 1 and "PermissionError" in r.stderr, r
    r = client.run("print(2)", image=debian)
    assert r.exit_code == 0 and r.stdout == "2\n", r


def test_a_call_right_after_its_zygote_died_runs(make_sandbox, debian):
    # The zygote dies while a call runs (killed from the host here; without
    # signal scoping the call itself could kill it). That call's result comes
    # from its own socket, possibly before aether has seen the zygote go:
    # it must be reported whole, and the next call must start a new zygote,
    # not fail.
    sb = make_sandbox(debian, backend="fncall", disk_mb=16)
    for i in range(3):
        r = sb.run("import os; print(os.getppid())")
        assert r.exit_code == 0, r
        inner = int(r.stdout)
        zygote = _host_pid(sb.id, inner)
        results = []
        t = threading.Thread(target=lambda: results.append(
            sb.run("import sys, time; print('up', flush=True); time.sleep(0.5); print('k')",
                   timeout=20)))
        t.start()
        time.sleep(0.25)
        os.kill(zygote, signal.SIGKILL)
        t.join()
        assert results and results[0].exit_code == 0 and results[0].stdout == "up\nk\n", results
        r = sb.run("import os; print(os.getppid() != %d, %d)" % (inner, i))
        assert r.exit_code == 0 and r.stdout == "True %d\n" % i, r


def test_bad_input(client, server, debian):
    expect_error(lambda: client.run("x", language="cobol", image=debian),
                 dsec.InvalidArgument, field="language", status=400)
    expect_error(lambda: client.run("#" * (300 << 10), image=debian),
                 dsec.PayloadTooLarge, field="code", status=413)
    expect_error(lambda: client.run("1", image=debian, limits={"cpu_s": 0}),
                 dsec.InvalidArgument, field="limits.cpu_s")
    expect_error(lambda: client.run("1", image=debian, limits={"bogus": 1}),
                 dsec.InvalidArgument, field="limits.bogus")
    expect_error(lambda: client.run("1", image=debian, files={"../x": "y"}),
                 dsec.InvalidArgument, field="files")
    expect_error(lambda: client.run("1", image="no-such-image"), dsec.NotFound)
    status, _, _, body = server.raw("POST", "/v1/run", body=b'{"code": "print(\xff)"}')
    err = body["error"]
    assert status == 400 and err["field"] == "body" and "UTF-8" in err["message"], err
    status, _, _, body = server.raw("POST", "/v1/run", body=b'{"code": 1}')
    assert status == 400 and body["error"]["field"] == "code"
    status, _, _, body = server.raw("POST", "/v1/run", body=b'{"code": "1", "stdin": "a", '
                                                          b'"stdin_b64": "YQ=="}')
    assert status == 400 and body["error"]["field"] == "stdin"


def test_fncall_sandbox(make_sandbox, server, debian, deb):
    sb = make_sandbox(debian, backend="fncall", disk_mb=32)
    assert sb.backend == "fncall"
    r = sb.exec("pwd; echo kept > f.txt; (sleep 1000 &); echo $TMPDIR")
    assert r.exit_code == 0 and r.stdout == "/scratch\n/scratch\n", r
    assert r.limit is None
    # Files in /scratch persist; processes do not.
    r = sb.run("import os\nprint(open('f.txt').read().strip())\n"
               "print(any(b'sleep' in open(f'/proc/{p}/cmdline', 'rb').read()\n"
               "          for p in os.listdir('/proc') if p.isdigit()))")
    assert r.stdout == "kept\nFalse\n", r
    sb.write_file("/scratch/in.txt", b"from the files API")
    assert sb.run("print(open('in.txt').read())").stdout == "from the files API\n"
    assert sb.read_file("/scratch/f.txt") == b"kept\n"
    assert sb.exec("cat /etc/hostname").exit_code == 0
    r = sb.exec("touch /etc/x")
    assert r.exit_code != 0 and "Read-only" in r.stderr, r
    # Files API errors about the path name the field "path".
    e = expect_error(lambda: sb.write_file("/etc/x", b"y"), dsec.PermissionDenied, status=403,
                     field="path")
    assert "/etc/x" in e.message and "/scratch" in e.message
    expect_error(lambda: sb.mkdir("/root/d"), dsec.PermissionDenied, field="path")
    expect_error(lambda: sb.remove("/etc/hostname"), dsec.PermissionDenied, field="path")
    expect_error(lambda: sb.read_file("/scratch/nope"), dsec.NotFound, field="path")
    expect_error(lambda: sb.write_file("/scratch/f.txt/x", b"y"), dsec.InvalidArgument,
                 field="path")

    r = sb.run("echo $((6*7))", language="bash")
    assert r.stdout == "42\n", r
    r = sb.exec("while :; do :; done", timeout=1)
    assert r.timed_out and r.limit == "timeout", r
    # Scratch is bounded by disk_mb.
    r = sb.exec("head -c 40M /dev/zero > big")
    assert r.exit_code != 0 and "No space left" in r.stderr, r
    status, _, _, body = server.raw("POST", f"/v1/sandboxes/{sb.id}/run",
                                    body={"code": "1", "files": {"a": "b"}})
    assert status == 400 and body["error"]["field"] == "files", body
    expect_error(lambda: deb.run("print(1)"), dsec.Conflict, status=409)


def test_image_update_replaces_its_pool(client, debian, busybox):
    base = client.image(debian).layers
    name = "fnimg-%d" % id(client)
    client.create_image(name, "v", base)
    ref = name + ":v"
    try:
        code = "cat /proc/sys/kernel/hostname; test -e /bin/busybox && echo bb || echo no-bb"
        first = client.run(code, language="bash", image=ref)
        time.sleep(0.1)  # settled: the same sandbox serves the next call
        again = client.run(code, language="bash", image=ref)
        assert first.stdout == again.stdout and first.stdout.endswith("no-bb\n"), (first, again)
        # The tag moves to other layers: the next call runs on them, in a new sandbox.
        client.create_image(name, "v", base + client.image(busybox).layers)
        moved = client.run(code, language="bash", image=ref)
        assert moved.exit_code == 0 and moved.stdout.split()[1] == "bb", moved
        assert moved.stdout.split()[0] != first.stdout.split()[0], (first, moved)
    finally:
        client.delete_image(ref)


def test_back_to_back_calls_alternate_between_two_sandboxes(client, server, debian):
    """A call that finds its pool's only sandbox still getting ready (its last
    call just ended) makes the pool grow to two in the background; back-to-back
    calls then alternate between them, and calls with time between them stay
    on the most recently used one."""
    name = "fnalt-%d" % id(client)
    client.create_image(name, "v", client.image(debian).layers)
    ref = name + ":v"
    code = "import socket; print(socket.gethostname())"
    try:
        # Back to back until the second sandbox (made in the background, which
        # takes longer than a call) serves one. (Which of the two serves each
        # call depends on how long the last one has been idle: timing the unit
        # tests in run_pool_test.cc control.)
        hosts, deadline = [], time.monotonic() + 60
        while len(set(hosts)) < 2 and time.monotonic() < deadline:
            hosts.append(client.run(code, image=ref).stdout)
        assert len(set(hosts)) == 2, hosts[:5]
        more = [client.run(code, image=ref).stdout for _ in range(20)]
        assert set(more) <= set(hosts), (hosts[:5], more)  # no third
        time.sleep(0.1)
        spaced = []
        for _ in range(4):
            spaced.append(client.run(code, image=ref).stdout)
            time.sleep(0.1)
        assert len(set(spaced)) == 1, spaced
        m = _metrics(server)
        assert m["dsec_fncall_pool_sandboxes_grown_total"] >= 1, m
    finally:
        client.delete_image(ref)


def test_fncall_sandboxes_outlive_an_edge_crash(tmp_path_factory, server):
    """A fncall sandbox is a container sandbox underneath: re-adopted after a
    SIGKILL with its /scratch and its zygote; pool sandboxes (no record) are
    destroyed as orphans, and one-shot calls work again."""
    import os
    from pathlib import Path

    from test_restart import _crash, _new_server, _stop_and_check_clean

    s = _new_server(tmp_path_factory)
    try:
        cache = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"))
        s.import_image("debian:latest", cache / "debian.tar")
        sb = s.client.create("debian:latest", backend="fncall", disk_mb=16)
        assert sb.exec("echo kept > keep").exit_code == 0
        assert s.client.run("print(1)").stdout == "1\n"
        _crash(s)
        s.start()
        again = s.client.get(sb.id)
        assert again.state == "running" and again.backend == "fncall", again.info
        r = again.run("print(open('keep').read().strip())")
        assert r.exit_code == 0 and r.stdout == "kept\n", r
        assert again.exec("touch /etc/x").exit_code != 0
        # Re-adopted, it keeps its CPU headroom through a limit change.
        again.set_phase("eval")
        again.set_phase("default")
        assert _cpu_quota(sb.id) == 1.0 + 0.5
        assert s.client.run("print(2)").stdout == "2\n"
        again.destroy()
        _stop_and_check_clean(s)
    finally:
        if s.proc.poll() is None:
            s.stop()


def _metrics(s) -> dict:
    """The server's /metrics as {'name{labels}': value}."""
    status, _, raw, _ = s.raw("GET", "/v1/metrics")
    assert status == 200, status
    text = raw.decode() if isinstance(raw, bytes) else raw
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def test_pool_bounds_languages_and_metrics(tmp_path_factory, server):
    """`dsec up --fncall-pool-max 1 --fncall-language 'perl=perl -e'`: the
    configured language runs from the image, the node keeps at most one pool
    sandbox, and /metrics shows pools, workers, zygote restarts and calls by
    result and limit."""
    import os
    from pathlib import Path

    from test_restart import _new_server, _stop_and_check_clean

    s = _new_server(tmp_path_factory, "--fncall-pool-max", "1",
                    "--fncall-language", "perl=perl -e")
    try:
        cache = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"))
        s.import_image("debian:latest", cache / "debian.tar")
        c = s.client
        r = c.run("print 6*7, qq(\\n)", language="perl")
        assert r.exit_code == 0 and r.stdout == "42\n", r
        e = expect_error(lambda: c.run("x", language="cobol"), dsec.InvalidArgument,
                         field="language")
        assert "perl" in e.message, e
        assert c.run("print(1)").stdout == "1\n"  # another pool: the perl sandbox is recycled
        zygotes = zygote_pids(s.data_dir)
        assert len(zygotes) == 1, zygotes
        os.kill(zygotes[0], 9)  # (a call cannot: test_a_call_cannot_kill_its_zygote)
        r = c.run("print(2)")
        assert r.stdout == "2\n", r
        r = c.run("while True: pass", timeout=1)
        assert r.limit == "timeout", r
        m = _metrics(s)
        assert m["dsec_fncall_pool_max_sandboxes"] == 1, m
        assert m["dsec_fncall_pools"] == 2, m
        idle = sum(v for k, v in m.items() if k.startswith("dsec_fncall_pool_sandboxes{")
                   and 'state="idle"' in k)
        assert idle == 1 and m['dsec_fncall_node_sandboxes{state="idle"}'] == 1, m
        assert m['dsec_fncall_node_sandboxes{state="busy"}'] == 0, m
        assert m["dsec_fncall_pool_sandboxes_created_total"] == 2, m
        assert m["dsec_fncall_zygote_restarts_total"] >= 1, m
        # perl, print(1), print(2)
        assert m['dsec_fncall_calls_total{result="ok",limit="none"}'] == 3, m
        assert m['dsec_fncall_calls_total{result="signal",limit="timeout"}'] == 1, m
        _stop_and_check_clean(s)
    finally:
        if s.proc.poll() is None:
            s.stop()


@pytest.mark.parametrize("args,message", [
    (["--fncall-pool-max", "0"], "--fncall-pool-max"),
    (["--fncall-zygote-max-calls", "0"], "--fncall-zygote-max-calls"),
    (["--fncall-zygote-max-calls", "x"], "--fncall-zygote-max-calls"),
    (["--fncall-language", "python=python3 -c"], "built in"),
    (["--fncall-language", "node"], "NAME=ARGV"),
    (["--fncall-language", "a b=x"], "bad language name"),
])
def test_bad_fncall_flags_stop_the_start(tmp_path_factory, server, args, message):
    from conftest import Server

    s = Server(tmp_path_factory.mktemp("fnflags") / "data", extra_args=args)
    s.data_dir.mkdir()
    with pytest.raises(RuntimeError):
        s.start()
    assert message in s.log_tail(), s.log_tail()
