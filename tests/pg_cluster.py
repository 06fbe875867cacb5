"""A throwaway PostgreSQL cluster for tests (the pytest twin of
src/platform/pg_test_cluster.h): `initdb` into a temp dir, the server on a
Unix socket in that dir and on a free 127.0.0.1 port, run as the unprivileged
`postgres` user when we are root; `stop()` stops it and removes the dir. No
system-wide service is involved and nothing is left behind: the server is our
child (not daemonized by pg_ctl), so stop() waits for it.

TCP connections need a password (scram-sha-256), so a test can check that
`dsec up` never prints it; the Unix socket is trusted (for the helper's own
admin commands).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SUPERUSER = "dsec"


class Unavailable(Exception):
    """This host cannot run a cluster; the message says why (the test skips)."""


def _bin_dir() -> Path:
    env = os.environ.get("DSEC_PG_BIN")
    candidates = [env] if env else sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for d in candidates:
        if d and os.access(os.path.join(d, "initdb"), os.X_OK) and \
                os.access(os.path.join(d, "pg_ctl"), os.X_OK):
            return Path(d)
    raise Unavailable("PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb "
                      "or $DSEC_PG_BIN; Debian package postgresql, installed by "
                      "scripts/install-deps.sh)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    def __init__(self, password: str):
        self.password = password
        self.bin = _bin_dir()
        self.user = None
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")  # the server refuses to run as root
            except KeyError:
                raise Unavailable("running as root and there is no `postgres` user") from None
            self.user = "postgres"
            self._uid, self._gid = pw.pw_uid, pw.pw_gid
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-pg-", dir="/tmp"))
        self.port = 0
        self.log = self.dir / "server.log"
        self.proc = None  # the postmaster

    def _run(self, *argv):
        cmd = (["runuser", "-u", self.user, "--"] if self.user else []) + [str(a) for a in argv]
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout}{r.stderr}"
                               f"{self.log.read_text() if self.log.exists() else ''}")
        return r.stdout

    def start(self) -> "PgCluster":
        try:
            if self.user:
                os.chown(self.dir, self._uid, self._gid)
            pwfile = self.dir / "pw"
            pwfile.write_text(self.password + "\n")
            if self.user:
                os.chown(pwfile, self._uid, self._gid)
            self._run(self.bin / "initdb", "-D", self.dir / "data", "-U", SUPERUSER,
                      "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}",
                      "--no-sync", "-E", "UTF8", "--locale=C")
            pwfile.unlink()
            for attempt in range(3):
                self.port = _free_port()
                if self._start_server():
                    break
                if attempt == 2:  # the port was taken between _free_port() and the bind?
                    raise RuntimeError(f"postgres exited at start:\n{self.log.read_text()}")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_server(self) -> bool:
        """Starts postgres as our child; True once it answers, False if it exited."""
        kw = {"user": self._uid, "group": self._gid, "extra_groups": []} if self.user else {}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.dir / "data"), "-k", str(self.dir),
                 "-p", str(self.port), "-c", "listen_addresses=127.0.0.1"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, **kw)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                return False
            r = subprocess.run([str(self.bin / "pg_isready"), "-q", "-h", str(self.dir), "-p",
                                str(self.port), "-U", SUPERUSER, "-d", "postgres"],
                               stdin=subprocess.DEVNULL, capture_output=True)
            if r.returncode == 0:
                return True
            time.sleep(0.05)
        raise RuntimeError(f"postgres did not answer within 30 s:\n{self.log.read_text()}")

    def psql(self, sql: str, db: str = "postgres") -> str:
        """Runs SQL over the trusted Unix socket; returns psql's unaligned output."""
        return self._run(self.bin / "psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                         "-h", self.dir, "-p", self.port, "-U", SUPERUSER, "-d", db, "-c", sql)

    def create_database(self, name: str) -> None:
        self.psql(f"CREATE DATABASE {name}")

    def uri(self, db: str, password: bool = True) -> str:
        """TCP URI of `db` as the superuser (with the password unless told not to)."""
        auth = f"{SUPERUSER}:{self.password}" if password else SUPERUSER
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{db}"

    def server_pids(self) -> list:
        """The postmaster and its children (backends, checkpointer, ...)."""
        if self.proc is None:
            return []
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)],
                             capture_output=True, text=True).stdout
        return [self.proc.pid] + [int(p) for p in out.split()]

    def restart_server(self) -> None:
        """Stops the server (fast shutdown: its sessions are cut) and starts it
        again on the same data and port, as a database restart or failover
        does to its clients."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)
        if not self._start_server():
            raise RuntimeError(f"postgres did not come back:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


def start_cluster(password: str) -> PgCluster:
    """Starts a cluster (raises Unavailable, saying why, where it cannot run)."""
    return PgCluster(password).start()
