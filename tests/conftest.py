"""End-to-end test harness: drives the real `dsec up` through the Python SDK.

Contract (see also tests/README.md):
  * binaries: build/bin/dsec and build/bin/dsec-aether under the repo root
    ($DSEC_BIN overrides the dsec path; dsec-aether is looked up beside it);
  * test images: busybox.tar and debian.tar (rootfs tarballs) in
    $DSEC_IMAGE_CACHE (default /var/cache/dsec/test-images);
  * root is needed. Missing prerequisites skip with the reason printed;
    with DSEC_TESTS_STRICT=1 they fail instead (for CI, where a skip would hide
    a broken build).

One `dsec up` serves the whole session, on a fresh data dir and a free port. At
the end it gets SIGTERM and must exit within 30 s leaving no mounts, no loop
devices on its data dir, no sandbox cgroups and no dsec-aether processes behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sdk" / "python"))

import dsec  # noqa: E402

STRICT = os.environ.get("DSEC_TESTS_STRICT") == "1"
IMAGE_CACHE = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"))
UP_TIMEOUT_S = 20
STOP_TIMEOUT_S = 30

_SERVER = None  # the running Server, for failure reports


def dsec_bin() -> Path:
    return Path(os.environ.get("DSEC_BIN") or REPO / "build" / "bin" / "dsec")


def aether_bin() -> Path:
    env = os.environ.get("DSEC_AETHER_BIN")
    if env:
        return Path(env)
    beside = dsec_bin().parent / "dsec-aether"
    return beside if beside.exists() else REPO / "build" / "bin" / "dsec-aether"


def unavailable(reason: str):
    """Skips (or, with DSEC_TESTS_STRICT=1, fails) because a prerequisite is missing."""
    if STRICT:
        pytest.fail(f"prerequisite missing (DSEC_TESTS_STRICT=1): {reason}", pytrace=False)
    pytest.skip(reason)


from helpers import (DIGEST_RE, HOST_ENV_MARKER, aether_pids, edge_cgroup, loop_devices_backed_by,  # noqa: E402
                     mounts_containing, sandbox_cgroup_dirs, tail, wait_until)
from outside_host import ADDR as OUTSIDE_ADDR  # noqa: E402
from sdk_flavors import ASYNC, SYNC  # noqa: E402


# ----- both SDK clients ----------------------------------------------------------
# The tests of these modules that drive the SDK (through the `sdk`, `client`,
# `make_sandbox`, `module_sandboxes`, `bb` or `deb` fixtures) run twice: with
# dsec.Client, then with dsec.AsyncClient behind the synchronous facade of
# sdk_flavors.py (each call a coroutine on a background event loop), so one
# test body covers both. $DSEC_TESTS_SDK=sync (or async) runs one of them only.
BOTH_CLIENTS = frozenset({
    "test_sandbox", "test_exec", "test_files", "test_trajectory", "test_batches",
    "test_pause", "test_errors", "test_tenants", "test_lifecycle", "test_pack_diff",
    "test_pty",
})


def _flavors_wanted():
    want = os.environ.get("DSEC_TESTS_SDK", "both")
    if want not in ("both", "sync", "async"):
        raise pytest.UsageError(f"DSEC_TESTS_SDK={want!r}: want both, sync or async")
    return {"both": [SYNC, ASYNC], "sync": [SYNC], "async": [ASYNC]}[want]


def pytest_generate_tests(metafunc):
    if "sdk" in metafunc.fixturenames and Path(metafunc.module.__file__).stem in BOTH_CLIENTS:
        flavors = _flavors_wanted()
        metafunc.parametrize("sdk", flavors, ids=[f.name for f in flavors], indirect=True,
                             scope="module")


@pytest.fixture(scope="module")
def sdk(request):
    """The SDK flavor (sdk_flavors.SYNC or ASYNC) this module's run drives:
    ``sdk.Client(...)``, ``sdk.from_data_dir(...)``. SYNC outside BOTH_CLIENTS."""
    return getattr(request, "param", SYNC)


# ----- the server -----------------------------------------------------------------

# Servers of one session run at once (the session's, and one a test starts):
# each gets a window of host ids of its own for its sandboxes' ranges, as two
# edges on one host must (docs/security.md). 6 windows of 2^28 ids (4,096
# ranges of 65536) in the default window, taken in turn.
_USERNS_WINDOWS = [(524288 + k * 2**28, 524288 + (k + 1) * 2**28 - 1) for k in range(6)]
_next_window = [0]


class Server:
    def __init__(self, data_dir: Path, extra_args=(), sdk=SYNC):
        self.data_dir = data_dir
        self.sdk = sdk  # the flavor of self.client
        # More `dsec up` options; $DSEC_UP_ARGS adds to every server's (e.g.
        # `--userns off` to run the suite without user namespaces).
        self.extra_args = [str(a) for a in extra_args] + shlex.split(
            os.environ.get("DSEC_UP_ARGS", ""))
        if "--userns-window" not in self.extra_args:
            first, last = _USERNS_WINDOWS[_next_window[0] % len(_USERNS_WINDOWS)]
            _next_window[0] += 1
            self.extra_args += ["--userns-window", f"{first}-{last}"]
        self.log_path = data_dir.parent / (data_dir.name + ".log")
        self.proc = None
        self.client = None
        self.url = None
        self.pid = None
        self.images = {}  # name -> digest printed by `dsec image import`
        self.created = set()  # ids of sandboxes created by the tests

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)

    def cli(self, *args, timeout: float = 60, input=None) -> subprocess.CompletedProcess:
        """Runs `dsec ARGS...` (text mode) and returns the finished process."""
        return subprocess.run([str(dsec_bin()), *map(str, args)], capture_output=True,
                              text=True, timeout=timeout, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL)

    def raw(self, method: str, path: str, body=None, token=True, headers=None,
            timeout: float = 30):
        """One raw HTTP request (no SDK): returns (status, headers, bytes, json-or-None).
        `body` may be bytes (sent as is) or any JSON value; token=True sends the
        server's token, a str sends that, None sends no Authorization header."""
        import http.client
        u = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        hdrs = dict(headers or {})
        if token is True:
            token = self.client.token
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        if body is not None and not isinstance(body, (bytes, bytearray)):
            body = json.dumps(body).encode()
        if body is not None:
            hdrs.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read()
            try:
                doc = json.loads(data) if data else None
            except ValueError:
                doc = None
            return resp.status, dict(resp.getheaders()), data, doc
        finally:
            conn.close()

    def start(self):
        self._log = open(self.log_path, "wb")
        env = dict(os.environ)
        env[HOST_ENV_MARKER] = "host-only-value"  # must never show up inside a sandbox
        self.proc = subprocess.Popen(
            [str(dsec_bin()), "up", "--data-dir", str(self.data_dir), "--listen", "127.0.0.1:0",
             *self.extra_args],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env)
        up = self.data_dir / "up.json"
        deadline = time.monotonic() + UP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`dsec up` exited with {self.proc.returncode} before "
                                   f"writing up.json; log tail:\n{self.log_tail()}")
            if up.exists():
                try:
                    json.loads(up.read_text())
                    break
                except ValueError:
                    pass  # it is written atomically; be lenient anyway
            if time.monotonic() > deadline:
                raise RuntimeError(f"`dsec up` wrote no {up} within {UP_TIMEOUT_S} s; "
                                   f"log tail:\n{self.log_tail()}")
            time.sleep(0.05)
        self.client = self.sdk.from_data_dir(str(self.data_dir), timeout=30)
        self.url = self.client.url
        self.pid = self.client.server_pid or self.proc.pid
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        status, _, _, node = self.raw("GET", "/v1/node")
        egress = (node or {}).get("egress", {}) if status == 200 else {}
        self.egress_tag = egress.get("tag", "")
        self.egress_unavailable = egress.get("unavailable_reason", "no /v1/node")
        token = self.data_dir / "token"
        mode = token.stat().st_mode & 0o777
        if mode & 0o077:
            raise RuntimeError(f"{token} has mode {mode:o}; want 0600")

    def import_image(self, name: str, tar: Path) -> str:
        r = self.cli("image", "import", "--data-dir", self.data_dir, "--name", name, tar,
                     timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"`dsec image import --name {name} {tar}` exited "
                               f"{r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        m = DIGEST_RE.search(r.stdout)
        if not m:
            raise RuntimeError(f"`dsec image import` printed no digest: {r.stdout!r}")
        self.images[name] = m.group(0)
        return m.group(0)

    def stop(self) -> int:
        """SIGTERM, wait; returns the exit status (raises if it did not stop)."""
        if self.client is not None:
            self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"`dsec up` did not exit within {STOP_TIMEOUT_S} s of "
                                     f"SIGTERM; log tail:\n{self.log_tail()}")
        self._log.close()
        return self.proc.returncode


def _check_prerequisites():
    if os.geteuid() != 0:
        unavailable("the end-to-end tests need root (namespaces, cgroups, mounts)")
    if not dsec_bin().is_file():
        unavailable(f"{dsec_bin()} not built (cmake --build build)")
    if not aether_bin().is_file():
        unavailable(f"{aether_bin()} not built (cmake --build build)")


@pytest.fixture(scope="session")
def server():
    """The running `dsec up` (a Server); checks for leftovers at session end."""
    global _SERVER
    _check_prerequisites()
    data_dir = Path(tempfile.mkdtemp(prefix="dsec-t-", dir="/tmp"))
    # Only this server's sandboxes count: other dsec instances may run on the host.
    edge = edge_cgroup(data_dir)
    cg_before = sandbox_cgroup_dirs(edge)
    aether_before = aether_pids(edge)
    # The built-in `setup` policy may reach the test's outside host (tests/outside_host.py).
    # Zygotes retire after 64 calls (default 1024), so that tests see a retirement.
    srv = Server(data_dir, extra_args=["--setup-egress", f"{OUTSIDE_ADDR}:8080",
                                       "--setup-dns", OUTSIDE_ADDR,
                                       "--fncall-zygote-max-calls", "64"])
    try:
        srv.start()
    except Exception as e:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
        pytest.fail(str(e), pytrace=False)
    _SERVER = srv
    yield srv
    _SERVER = None

    # Sandboxes left running on purpose are torn down by the server's shutdown;
    # that it does so cleanly is part of what is checked below.
    problems = []
    if "busybox:latest" in srv.images:
        # Leave a busy sandbox running: shutdown must tear it down too.
        try:
            sb = srv.client.create("busybox:latest", labels={"left": "running"})
            r = sb.exec("sleep 1000 >/dev/null 2>&1 </dev/null & echo started", timeout=10)
            if r.stdout != "started\n":
                problems.append(f"could not start a background process: {r!r}")
        except dsec.DsecError as e:
            problems.append(f"could not create the sandbox left running at shutdown: {e!r}")
    try:
        rc = srv.stop()
    except AssertionError as e:
        problems.append(str(e))
        rc = srv.proc.returncode
    if rc not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
        problems.append(f"`dsec up` exited with status {rc} on SIGTERM")
    mounts = mounts_containing(str(data_dir))
    if mounts:
        problems.append(f"mounts left under the data dir: {mounts[:10]}")
    # An autoclear loop device goes once the kernel lets go of its filesystem.
    if not wait_until(lambda: not loop_devices_backed_by(str(data_dir)), 5):
        problems.append(f"loop devices left on the data dir: {loop_devices_backed_by(str(data_dir))}")
    if srv.egress_tag:
        def veths():
            links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                   text=True).stdout
            return [l for l in links.splitlines() if f"dsec {srv.egress_tag} " in l]
        # A veth goes with its sandbox's netns, which the kernel frees in the background.
        wait_until(lambda: not veths(), 10)
        left = veths()
        if left:
            problems.append(f"sandbox veths left: {left[:5]}")
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        if f"dsec_{srv.egress_tag}" in tables:
            problems.append(f"nftables table dsec_{srv.egress_tag} left")
    cgroups = sorted(sandbox_cgroup_dirs(edge) - cg_before)
    if cgroups:
        problems.append(f"sandbox cgroups left: {cgroups[:10]}")
    stray = aether_pids(edge) - aether_before
    if stray:
        problems.append(f"dsec-aether processes left: {sorted(stray)}")
    log = srv.log_tail(400)
    for marker in ("AddressSanitizer", "runtime error:", "LeakSanitizer"):
        if marker in log:
            problems.append(f"sanitizer report in the server log ({marker})")
    if problems:
        pytest.fail("server teardown:\n  " + "\n  ".join(problems) +
                    f"\nlog tail ({srv.log_path}):\n{srv.log_tail()}", pytrace=False)
    if not mounts:
        shutil.rmtree(data_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            srv.log_path.unlink()


@pytest.fixture(scope="module")
def client(server, sdk) -> dsec.Client:
    """The session server's client: dsec.Client, or (the async run of a
    BOTH_CLIENTS module) an AsyncClient on it behind the sync facade."""
    if not sdk.is_async:
        yield server.client
        return
    c = sdk.wrap_like(server.client)
    yield c
    c.close()


def _image_fixture(server, name: str, tarname: str) -> str:
    tar = IMAGE_CACHE / tarname
    if not tar.is_file():
        unavailable(f"test image {tar} missing (built by the test-image script; "
                    f"set DSEC_IMAGE_CACHE to use another directory)")
    if name not in server.images:
        try:
            server.import_image(name, tar)
        except Exception as e:  # a broken import is a failure, not a skip
            pytest.fail(f"{e}\nlog tail:\n{server.log_tail()}", pytrace=False)
    return name


@pytest.fixture(scope="session")
def busybox(server) -> str:
    """Image ref of the imported busybox test image."""
    return _image_fixture(server, "busybox:latest", "busybox.tar")


@pytest.fixture(scope="session")
def debian(server) -> str:
    """Image ref of the imported debian (with python3) test image."""
    return _image_fixture(server, "debian:latest", "debian.tar")


class SandboxFactory:
    """Creates sandboxes and destroys them when the owning fixture ends."""

    def __init__(self, server: Server, client):
        self.server = server
        self.client = client
        self.sandboxes = []

    def __call__(self, image: str, **kw) -> dsec.Sandbox:
        sb = self.client.create(image, **kw)
        self.server.created.add(sb.id)
        self.sandboxes.append(sb)
        return sb

    def cleanup(self):
        for sb in self.sandboxes:
            with contextlib.suppress(dsec.NotFound):
                sb.destroy()


@pytest.fixture
def make_sandbox(server, client):
    """make_sandbox(image, **create_kwargs) -> Sandbox, destroyed after the test."""
    f = SandboxFactory(server, client)
    yield f
    f.cleanup()


@pytest.fixture(scope="module")
def module_sandboxes(server, client):
    """Like make_sandbox, but the sandboxes live for the whole module."""
    f = SandboxFactory(server, client)
    yield f
    f.cleanup()


@pytest.fixture(scope="module")
def bb(module_sandboxes, busybox) -> dsec.Sandbox:
    """A busybox sandbox shared by the tests of one module."""
    return module_sandboxes(busybox, labels={"suite": "e2e"})


@pytest.fixture(scope="module")
def deb(module_sandboxes, debian) -> dsec.Sandbox:
    """A debian sandbox shared by the tests of one module."""
    return module_sandboxes(debian, labels={"suite": "e2e"})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and _SERVER is not None and "server" in getattr(item, "fixturenames", ()):
        rep.sections.append((f"dsec up log tail ({_SERVER.log_path})", _SERVER.log_tail()))


# ----- the abuse suite's common check -------------------------------------------
# Every attack in tests/security must fail AND leave the host, the platform and
# a neighbouring sandbox as they were. After each test there: the platform
# answers, a neighbour sandbox made before the attack still runs commands and
# still has its files, a canary file on the host is unchanged, the host's
# hostname is unchanged, and the host mount namespace gained no mounts outside
# the server's data dir (or another dsec instance's, when suites run side by
# side).

def _in_other_dsec(mount_point: str) -> bool:
    """Beneath the data dir of some dsec instance (a directory holding a
    `token` and a `state.db`): another suite's server, run side by side."""
    d = os.path.dirname(mount_point)
    while d not in ("/", ""):
        if os.path.exists(os.path.join(d, "token")) and os.path.exists(os.path.join(d, "state.db")):
            return True
        d = os.path.dirname(d)
    return False


def _host_mounts(exclude: str) -> set:
    with open("/proc/self/mountinfo") as f:
        points = {line.split()[4] for line in f if exclude not in line}
    return {p for p in points if not _in_other_dsec(p)}


@pytest.fixture(scope="session")
def neighbour(server, busybox):
    sb = server.client.create("busybox:latest", labels={"role": "neighbour"})
    sb.write_file("/root/precious", b"neighbour data\n")
    yield sb
    sb.destroy()


@pytest.fixture(scope="session")
def host_canary(tmp_path_factory):
    import uuid
    path = tmp_path_factory.mktemp("canary") / "canary"
    data = uuid.uuid4().hex.encode()
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path, data


@pytest.fixture(autouse=True)
def _abuse_leaves_everything_as_it_was(request):
    if f"{os.sep}security{os.sep}" not in str(request.node.fspath):
        yield
        return
    import socket
    server = request.getfixturevalue("server")
    neighbour = request.getfixturevalue("neighbour")
    path, data = request.getfixturevalue("host_canary")
    hostname = socket.gethostname()
    mounts = _host_mounts(str(server.data_dir))
    yield
    status, _, _, _ = server.raw("GET", "/v1/health", token=None)
    assert status == 200, "the platform stopped answering"
    r = neighbour.exec("cat /root/precious", timeout=30)
    assert r.exit_code == 0 and r.stdout == "neighbour data\n", f"the neighbour was affected: {r!r}"
    assert path.read_bytes() == data, "a host file changed"
    assert socket.gethostname() == hostname, "the host's hostname changed"
    added = _host_mounts(str(server.data_dir)) - mounts
    assert not added, f"mounts appeared on the host: {sorted(added)[:5]}"
