"""A real nginx from Debian serving a blob directory over HTTP, for the blob
store tests and benchmarks: `/` at full speed, `/slow/` throttled, and with
tls=True an https listener with a self-signed certificate (`ca`).

nginx's limit_rate lets every request send one second's worth of bytes at
once: a 1 MiB range read at 2m is not slowed at all, at 512k it takes about a
second (see set_slow_rate)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    def __init__(self, root: Path, slow_rate: str = "2m", tls: bool = False):
        self.root = Path(root)
        self.slow_rate = slow_rate
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-nginx-"))
        self.port = free_port()
        self.tls_port = free_port() if tls else None
        self.ca = None  # with tls: the PEM file that certifies the server
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def tls_url(self) -> str:
        return f"https://127.0.0.1:{self.tls_port}/"

    @property
    def slow_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/slow/"

    def start(self):
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(exe):
            raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
        t = self.dir
        (t / "tmp").mkdir()
        if self.tls_port:
            # A self-signed certificate for 127.0.0.1; it is its own CA.
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                            "-keyout", str(t / "key.pem"), "-out", str(t / "cert.pem"),
                            "-days", "2", "-subj", "/CN=127.0.0.1",
                            "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True, stdin=subprocess.DEVNULL)
            self.ca = t / "cert.pem"
        conf = self._write_conf()
        self.proc = subprocess.Popen([exe, "-c", str(conf)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("nginx exited: " + self.error_log())
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nginx did not listen: " + self.error_log())

    def _write_conf(self) -> Path:
        t = self.dir
        conf = t / "nginx.conf"
        tls = ""
        if self.tls_port:
            tls = (f"listen 127.0.0.1:{self.tls_port} ssl; ssl_certificate {t}/cert.pem; "
                   f"ssl_certificate_key {t}/key.pem;")
        conf.write_text(f"""
daemon off;
master_process on;
user root root;
worker_processes 2;
pid {t}/nginx.pid;
error_log {t}/error.log;
events {{ worker_connections 1024; }}
http {{
  access_log {t}/access.log;
  client_body_temp_path {t}/tmp; proxy_temp_path {t}/tmp; fastcgi_temp_path {t}/tmp;
  uwsgi_temp_path {t}/tmp; scgi_temp_path {t}/tmp;
  sendfile on;
  server {{
    listen 127.0.0.1:{self.port};
    {tls}
    root {self.root};
    location /slow/ {{ alias {self.root}/; limit_rate {self.slow_rate}; }}
  }}
}}
""")
        return conf

    def set_slow_rate(self, rate: str) -> None:
        """Changes the rate of `/slow/` (nginx reloads its configuration; requests
        in flight finish at the old rate)."""
        self.slow_rate = rate
        self._write_conf()
        self.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)

    def error_log(self) -> str:
        p = self.dir / "error.log"
        return p.read_text()[-2000:] if p.exists() else ""

    def requests(self) -> int:
        p = self.dir / "access.log"
        return len(p.read_text().splitlines()) if p.exists() else 0

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
