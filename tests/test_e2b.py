"""E2B compatibility: the unmodified `e2b` npm SDK (pinned in tests/e2b/package.json)
drives dsec sandboxes through the server's E2B surface.

Each tests/e2b/*.test.mjs file runs under Node's test runner as one pytest
test, against the session's `dsec up`, with the SDK configured only by the
environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY (the server's token)
and DSEC_E2B_TEMPLATE (the debian test image). Needs `node` (>= 20.18.1, as
e2b@2.51.0 requires) and, the first time, `npm ci` from the npm registry.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import unavailable
from helpers import npm_ci

# Where the server serves the E2B control API and the envd gateway, relative
# to server.url (the SDK appends /v2/sandboxes, /process.Process/Start, ...).
E2B_PREFIXES = {"api": "/e2b/api", "envd": "/e2b/envd"}

E2B_DIR = Path(__file__).resolve().parent / "e2b"
TEST_FILES = sorted(p.name for p in E2B_DIR.glob("*.test.mjs"))
NPM_CI_TIMEOUT_S = 300
FILE_TIMEOUT_S = 600
MIN_NODE = (20, 18, 1)  # e2b@2.51.0: "node": ">=20.18.1 <21 || >=22"


def _node_version(node: str):
    r = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    m = re.match(r"v(\d+)\.(\d+)\.(\d+)", r.stdout.strip())
    return tuple(int(x) for x in m.groups()) if m else None


@pytest.fixture(scope="module")
def node() -> str:
    """Path of a usable node, with tests/e2b/node_modules installed."""
    node = shutil.which("node")
    if node is None:
        unavailable("node is not installed (the E2B compatibility tests run the e2b npm SDK)")
    version = _node_version(node)
    if version is None or version < MIN_NODE or version[0] == 21:
        unavailable(f"{node} is version {version}; e2b@2.51.0 needs >= 20.18.1 (not 21)")
    if not (E2B_DIR / "node_modules" / "e2b" / "package.json").is_file():
        npm = shutil.which("npm")
        if npm is None:
            unavailable(f"npm is not installed and {E2B_DIR}/node_modules is missing")
        npm_ci(npm, E2B_DIR, NPM_CI_TIMEOUT_S)
    return node


@pytest.mark.slow
@pytest.mark.parametrize("test_file", TEST_FILES)
def test_e2b_sdk(node, server, debian, test_file):
    env = dict(os.environ)
    for name in list(env):
        if name.startswith("E2B_"):  # nothing from the caller's environment
            del env[name]
    env.update({
        "E2B_API_URL": server.url.rstrip("/") + E2B_PREFIXES["api"],
        "E2B_SANDBOX_URL": server.url.rstrip("/") + E2B_PREFIXES["envd"],
        "E2B_API_KEY": server.client.token,
        "DSEC_E2B_TEMPLATE": debian,
        "NO_COLOR": "1",
    })
    cmd = [node, "--test", "--test-concurrency=1", "--test-reporter=spec", test_file]
    # A session of its own: on a timeout the runner and the test process it
    # spawned for the file are killed together.
    proc = subprocess.Popen(cmd, cwd=E2B_DIR, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=FILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{test_file} did not finish within {FILE_TIMEOUT_S} s\n"
                    f"stdout:\n{out}\nstderr:\n{err}", pytrace=False)
    print(out)  # shown with pytest -s or -rP
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd[1:])}` in {E2B_DIR} exited {proc.returncode}\n"
                    f"stdout:\n{out}\nstderr:\n{err}", pytrace=False)


def test_polled_watchers_of_the_python_sdk(server, debian):
    """E2B's Python SDK watches directories with CreateWatcher /
    GetWatcherEvents / RemoveWatcher (its sync watch_dir); PyPI is out of
    reach here, so the calls are made raw, as that SDK sends them (Connect
    unary, JSON codec, pretty-printed)."""
    key = {"X-API-Key": server.client.token}
    st, _, _, sb = server.raw("POST", E2B_PREFIXES["api"] + "/v2/sandboxes",
                              {"templateID": debian, "timeout": 120}, token=None, headers=key)
    assert st == 201, sb
    envd = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"],
            "Content-Type": "application/json"}

    def rpc(method, msg):
        body = json.dumps(msg, indent=2).encode()  # MessageToJson pretty-prints
        return server.raw("POST", f"{E2B_PREFIXES['envd']}/filesystem.Filesystem/{method}",
                          body, token=None, headers=envd)

    try:
        assert rpc("MakeDir", {"path": "/tmp/w"})[0] == 200
        st, _, _, j = rpc("CreateWatcher", {"path": "/tmp/w", "recursive": True})
        assert st == 200 and j["watcherId"], j
        wid = j["watcherId"]
        st, _, _, j = rpc("GetWatcherEvents", {"watcherId": wid})
        assert st == 200 and j["events"] == [], j  # nothing since the first look
        st, _, _, _ = server.raw("POST", f"{E2B_PREFIXES['envd']}/files?path=/tmp/w/sub/a.txt",
                                 b"hello", token=None,
                                 headers={**envd, "Content-Type": "application/octet-stream"})
        assert st == 200
        st, _, _, j = rpc("GetWatcherEvents", {"watcherId": wid})
        got = {(e["name"], e["type"]) for e in j["events"]}
        assert ("sub", "EVENT_TYPE_CREATE") in got and ("sub/a.txt", "EVENT_TYPE_CREATE") in got, j
        assert rpc("Remove", {"path": "/tmp/w/sub/a.txt"})[0] == 200
        st, _, _, j = rpc("GetWatcherEvents", {"watcherId": wid})
        assert [(e["name"], e["type"]) for e in j["events"]] == [("sub/a.txt", "EVENT_TYPE_REMOVE")], j
        assert rpc("RemoveWatcher", {"watcherId": wid})[0] == 200
        st, _, _, j = rpc("GetWatcherEvents", {"watcherId": wid})
        assert st == 404 and j["code"] == "not_found", j
        # A path that is no directory, or none at all.
        st, _, _, j = rpc("CreateWatcher", {"path": "/tmp/w/none"})
        assert st == 404 and j["code"] == "not_found", j
        st, _, _, j = rpc("CreateWatcher", {"path": "/etc/hostname"})
        assert st == 400 and j["code"] == "invalid_argument", j
        # Another sandbox's token is no access.
        st, _, _, j = server.raw("POST", f"{E2B_PREFIXES['envd']}/filesystem.Filesystem/Stat",
                                 b'{"path":"/"}', token=None,
                                 headers={**envd, "X-Access-Token": "ea_" + "0" * 64})
        assert st == 401 and j["code"] == "unauthenticated", j
    finally:
        st, _, _, _ = server.raw("DELETE", f"{E2B_PREFIXES['api']}/sandboxes/{sb['sandboxID']}",
                                 token=None, headers=key)
        assert st == 204
