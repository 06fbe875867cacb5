"""Waiting for a server inside a sandbox, for the pytest suites and for the
console's sdk_helper.py (which runs under any python3, without pytest): no
import here may need pytest."""

from __future__ import annotations

import time


def wait_listening(sb, port: int, timeout: float = 30.0) -> None:
    """Waits until something listens on 127.0.0.1:port inside sandbox `sb`
    (which has python3): a server just started there (test_ports, the
    console's browser test)."""
    probe = ("import socket\n"
             f"s=socket.socket(); s.settimeout(1); s.connect(('127.0.0.1',{port}))\n")
    deadline = time.monotonic() + timeout
    while True:
        r = sb.exec(["python3", "-c", probe])
        if r.exit_code == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on {port} in {sb.id}: {r.stderr}")
        time.sleep(0.2)
