"""The abuse suite's common check: every attack must fail AND leave the host,
the platform and a neighbouring sandbox as they were. After each test here:
the platform answers, a neighbour sandbox made before the attack still runs
commands and still has its files, a canary file on the host is unchanged, the
host's hostname is unchanged, and the host mount namespace gained no mounts
outside the server's data dir."""

from __future__ import annotations

import os
import socket
import uuid

import pytest


def _host_mounts(exclude: str) -> set:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f if exclude not in line}


@pytest.fixture(scope="session")
def neighbour(server, busybox):
    sb = server.client.create("busybox:latest", labels={"role": "neighbour"})
    sb.write_file("/root/precious", b"neighbour data\n")
    yield sb
    sb.destroy()


@pytest.fixture(scope="session")
def host_canary(tmp_path_factory):
    path = tmp_path_factory.mktemp("canary") / "canary"
    data = uuid.uuid4().hex.encode()
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path, data


@pytest.fixture(autouse=True)
def host_platform_and_neighbour_unaffected(server, neighbour, host_canary):
    hostname = socket.gethostname()
    mounts = _host_mounts(str(server.data_dir))
    yield
    status, _, _, _ = server.raw("GET", "/v1/health", token=None)
    assert status == 200, "the platform stopped answering"
    r = neighbour.exec("cat /root/precious", timeout=30)
    assert r.exit_code == 0 and r.stdout == "neighbour data\n", f"the neighbour was affected: {r!r}"
    path, data = host_canary
    assert path.read_bytes() == data, "a host file changed"
    assert socket.gethostname() == hostname, "the host's hostname changed"
    added = _host_mounts(str(server.data_dir)) - mounts
    assert not added, f"mounts appeared on the host: {sorted(added)[:5]}"
