"""`dsec up --store postgresql://...`: the platform's state in PostgreSQL (a
throwaway cluster of our own, tests/pg_cluster.py) end to end: images,
sandboxes, execs, trajectory steps (replay, conflict), policies; a SIGTERM and
a restart on the same database keep them all, and a restart of the database
under a running platform is weathered (its connections are reset); the password never shows in the
log or the process's command line; bad --store values are refused at start
with a message naming the option."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

import dsec
from conftest import Server, _check_prerequisites, dsec_bin, unavailable
from helpers import expect_error
from pg_cluster import Unavailable, start_cluster

BUSYBOX_TAR = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar"
PASSWORD = "pw-" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def pg():
    _check_prerequisites()
    try:
        cluster = start_cluster(PASSWORD)
    except Unavailable as e:
        unavailable(f"PostgreSQL unavailable: {e}")
    yield cluster
    pids = cluster.server_pids()
    cluster.stop()
    for pid in pids:  # the postmaster (and so its children) is gone
        assert not Path(f"/proc/{pid}").exists(), f"postgres {pid} still running"
    assert not cluster.dir.exists()


def _start(data_dir: Path, uri: str) -> Server:
    s = Server(data_dir, ["--store", uri])
    s.start()
    return s


def _stop(s: Server):
    assert s.stop() in (0, -signal.SIGTERM, 128 + signal.SIGTERM), s.log_tail()


def test_state_lives_in_postgres_and_survives_a_restart(pg, tmp_path):
    if not BUSYBOX_TAR.is_file():
        unavailable(f"test image {BUSYBOX_TAR} missing")
    pg.create_database("e2e")
    uri = pg.uri("e2e")
    data = tmp_path / "data"
    t = "pg-" + uuid.uuid4().hex[:8]
    cmd = "date +%s%N; echo x >> /root/f; wc -l < /root/f"

    s = _start(data, uri)
    try:
        assert f"state store postgresql postgresql://dsec:***@127.0.0.1:{pg.port}/e2e" in \
            s.log_tail(200), s.log_tail()
        with open(f"/proc/{s.proc.pid}/cmdline", "rb") as f:
            assert PASSWORD.encode() not in f.read(), "the password shows in `ps`"
        s.import_image("busybox:latest", BUSYBOX_TAR)
        sb = s.client.create("busybox:latest", labels={"store": "pg"})
        assert sb.exec("echo hello").stdout == "hello\n"
        first = sb.exec(cmd, trajectory_id=t, step=0)
        assert not first.replayed
        again = sb.exec(cmd, trajectory_id=t, step=0)
        assert again.replayed and again.stdout == first.stdout
        sb.write_file("/root/data", b"\x00\x01bytes\xff", trajectory_id=t, step=1)
        expect_error(lambda: sb.exec("echo other", trajectory_id=t, step=0), dsec.Conflict,
                     field="step", status=409)
        s.client.create_policy("pg-policy", description="kept in postgres",
                               readonly_paths=["/etc"])
        sb.set_phase("pg-policy")
        sb.write_file("/root/scratch", b"x")
        # The database restarts under the platform: its connections are cut;
        # the next calls reconnect.
        pg.restart_server()
        assert "pg-policy" in [p["name"] for p in s.client.policies()]
        assert not sb.exec("echo after", trajectory_id=t, step=3).replayed
        assert sb.exec("echo after", trajectory_id=t, step=3).replayed
    finally:
        _stop(s)
    assert PASSWORD not in s.log_path.read_text(errors="replace"), "the password is in the log"

    # It is all in the database, and nowhere else: no SQLite file was made.
    assert not (data / "state.db").exists()
    counts = pg.psql("SELECT (SELECT COUNT(*) FROM trajectory_steps WHERE trajectory='" + t +
                     "'), (SELECT COUNT(*) FROM policies WHERE name='pg-policy'), "
                     "(SELECT COUNT(*) FROM images)", db="e2e").strip()
    assert counts == "3|1|1", counts

    s = _start(data, uri)
    try:
        # The sandbox went with the graceful stop, as with SQLite: its record
        # says so; the image, the policy and the steps are all there.
        old = s.client.get(sb.id)
        assert old.state == "stopped", old.info
        assert [i.ref for i in s.client.images()] == ["busybox:latest"]
        assert s.client.policy("pg-policy")["description"] == "kept in postgres"
        steps = s.client.export_trajectory(t)
        assert [st["step"] for st in steps] == [0, 1, 3], steps
        new = s.client.create("busybox:latest")
        replay = new.exec(cmd, trajectory_id=t, step=0)
        assert replay.replayed and replay.stdout == first.stdout
        expect_error(lambda: new.exec("echo other", trajectory_id=t, step=0), dsec.Conflict,
                     field="step", status=409)
        live = new.exec("echo live", trajectory_id=t, step=2)
        assert not live.replayed and live.stdout == "live\n"
        new.destroy()
    finally:
        _stop(s)
    assert pg.psql(f"SELECT COUNT(*) FROM trajectory_steps WHERE trajectory='{t}'",
                   db="e2e").strip() == "4"


@pytest.mark.parametrize("value,expect", [
    ("mysql://root@db/dsec", "must be `sqlite` or a postgres://"),
    ("postgresql://dsec:{pw}@127.0.0.1/e2e?nosuchparameter=1", "nosuchparameter"),
    ("postgresql://dsec:{pw}@127.0.0.1:1/e2e", "cannot connect"),
    ("postgresql://dsec:wrong-{pw}@127.0.0.1:{port}/e2e", "password authentication failed"),
    ("", "--store needs a value"),
])
def test_bad_store_values_are_refused_at_start(pg, tmp_path, value, expect):
    value = value.format(pw=PASSWORD, port=pg.port)
    t0 = time.monotonic()
    r = subprocess.run([str(dsec_bin()), "up", "--data-dir", str(tmp_path / "d"), "--listen",
                        "127.0.0.1:0", "--store", value], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0, r
    assert time.monotonic() - t0 < 15
    assert "--store" in r.stderr and expect in r.stderr, r.stderr
    assert PASSWORD not in r.stderr + r.stdout, r.stderr
    assert not (tmp_path / "d" / "up.json").exists()
