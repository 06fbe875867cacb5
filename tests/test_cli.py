"""The dsec CLI against the running server: image import (in the fixtures),
sandbox create / ls / rm and exec."""

from __future__ import annotations

import subprocess

from conftest import dsec_bin
from helpers import SB_ID_RE


def test_cli_sandbox_lifecycle_and_exec(server, busybox, client):
    d = server.data_dir
    r = server.cli("sandbox", "create", "--data-dir", d, "--image", "busybox")
    assert r.returncode == 0, r
    m = SB_ID_RE.search(r.stdout)
    assert m, f"no sandbox id in {r.stdout!r}"
    sid = m.group(0)
    server.created.add(sid)
    try:
        assert client.get(sid).state == "running"

        r = server.cli("sandbox", "ls", "--data-dir", d)
        assert r.returncode == 0 and sid in r.stdout, r

        r = server.cli("exec", "--data-dir", d, sid, "--", "echo", "hi")
        assert (r.returncode, r.stdout) == (0, "hi\n"), r

        r = server.cli("exec", "--data-dir", d, sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
        assert r.returncode == 3, r
        assert r.stdout == "out\n" and "err" in r.stderr, r

        r = server.cli("exec", "--data-dir", d, sid, "--", "hostname")
        assert r.stdout.strip() == sid
    finally:
        r = server.cli("sandbox", "rm", "--data-dir", d, sid)
    assert r.returncode == 0, r
    assert client.get(sid).state == "stopped"


def test_cli_exec_on_unknown_sandbox_fails(server):
    r = server.cli("exec", "--data-dir", server.data_dir, "sb-0000000000000000", "--", "true")
    assert r.returncode != 0
    assert r.stderr.strip(), "an error must be explained on stderr"


def test_cli_image_import_is_listed(server, busybox, client):
    img = client.image(busybox)
    assert img.ref == busybox
    # `dsec image import` printed the digest of the layer it stored
    assert server.images[busybox] in img.layers, (server.images[busybox], img)
    assert busybox in {i.ref for i in client.images()}


def test_cli_exec_output_is_byte_exact(server, busybox):
    r = server.cli("sandbox", "create", "--data-dir", server.data_dir, "--image", busybox)
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    server.created.add(sid)
    try:
        out = subprocess.run([str(dsec_bin()), "exec", "--data-dir", str(server.data_dir), sid,
                              "--", "printf", r"\377\000\200x"],
                             capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        assert out.stdout == b"\xff\x00\x80x"
    finally:
        server.cli("sandbox", "rm", "--data-dir", server.data_dir, sid)


def test_up_logs_to_a_bounded_rotated_file(tmp_path):
    import signal
    import time
    from conftest import Server, _check_prerequisites
    _check_prerequisites()
    log = tmp_path / "dsec.log"
    srv = Server(tmp_path / "data", ["--log-file", log, "--log-max-mb", "1"])
    srv.start()
    try:
        assert "dsec up: serving" in log.read_text()
        assert srv.log_tail().strip() == "", "with --log-file nothing should go to stderr"
    finally:
        assert srv.stop() in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    assert "dsec up: stopped" in log.read_text()
    assert log.stat().st_mode & 0o077 == 0
    for bad, needle in ((["--log-file", tmp_path / "no" / "such" / "dir.log"], "--log-file"),
                        (["--log-file", log, "--log-max-mb", "0"], "--log-max-mb")):
        r = subprocess.run([str(dsec_bin()), "up", "--data-dir", str(tmp_path / "d2"),
                            "--listen", "127.0.0.1:0", *map(str, bad)],
                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode != 0 and needle in r.stderr, r.stderr
    assert not (tmp_path / "d2").exists()


def test_cli_policy_phase_and_audit(server, busybox, client):
    d = server.data_dir
    r = server.cli("sandbox", "create", "--data-dir", d, "--image", "busybox", "--policy", "rollout")
    assert r.returncode == 0, r
    sid = SB_ID_RE.search(r.stdout).group(0)
    server.created.add(sid)
    try:
        assert client.get(sid).info["policy"] == "rollout"
        r = server.cli("sandbox", "phase", "--data-dir", d, sid, "eval", "--hide", "/root")
        assert r.returncode == 0, r
        assert [l.split()[1] for l in r.stdout.splitlines()] == ["rollout", "eval"]
        assert client.get(sid).info["hidden_paths"] == ["/root"]
        r = server.cli("exec", "--data-dir", d, sid, "--", "sh", "-c", "mount -t tmpfs x /mnt; true")
        r = server.cli("sandbox", "audit", "--data-dir", d, sid)
        assert r.returncode == 0 and "mount 1" in r.stdout and "total 1" in r.stdout, r
        r = server.cli("sandbox", "phase", "--data-dir", d, sid, "nope")
        assert r.returncode != 0 and "policy" in r.stderr, r
    finally:
        server.cli("sandbox", "rm", "--data-dir", d, sid)
