"""The web console (/ui, docs/console.md) in a real browser (issue 34 items 4
and 5): tests/console/console.test.mjs drives Debian's chromium with
playwright-core (pinned in tests/console/package.json) against the session's
`dsec up`, under Node's test runner.

This module prepares what the browser needs and passes it in the environment:
two user tenants A and B with a key each, the debian image, a trajectory id
and where the screenshots go ($DSEC_ARTIFACTS/console/, else
tests/artifacts/console/). While the browser is open, SDK actions run through
tests/console/sdk_helper.py. Afterwards it removes what the run made: the
tenants' sandboxes, the trajectory, the checkpoint images, the tenants, and
checks that no chromium process is left.

Skips (with the reason) only when /usr/bin/chromium is missing
(scripts/install-deps.sh installs it); needs node >= 18 and npm, as the
console's build does. `npm ci` runs here when tests/console/node_modules is
missing or older than the lock. Never downloads a browser.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import dsec
from conftest import REPO
from helpers import npm_ci

CONSOLE_DIR = Path(__file__).resolve().parent / "console"
CHROMIUM = Path("/usr/bin/chromium")
NPM_CI_TIMEOUT_S = 300
RUN_TIMEOUT_S = 900
MIN_NODE = 18


def shots_dir() -> Path:
    base = os.environ.get("DSEC_ARTIFACTS")
    return (Path(base) if base else REPO / "tests" / "artifacts") / "console"


def _chromium_pids(user_dir_marker: str) -> list:
    """Chromium processes started by this test's run (their command line names
    the run's profile directory)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "chromium" in cmd and user_dir_marker in cmd:
            out.append(int(d.name))
    return out


@pytest.fixture(scope="module")
def node() -> str:
    """Path of node, with tests/console/node_modules installed from the lock."""
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing (scripts/install-deps.sh installs chromium): "
                    "the console's browser test cannot run")
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (the console's browser test runs playwright-core)",
                    pytrace=False)
    r = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    try:
        major = int(r.stdout.strip().lstrip("v").split(".")[0])
    except ValueError:
        major = 0
    if major < MIN_NODE:
        pytest.fail(f"{node} is {r.stdout.strip()}; playwright-core needs node >= {MIN_NODE}",
                    pytrace=False)
    lock = CONSOLE_DIR / "package-lock.json"
    installed = CONSOLE_DIR / "node_modules" / ".package-lock.json"
    if not installed.is_file() or installed.stat().st_mtime < lock.stat().st_mtime:
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail(f"npm is not installed and {CONSOLE_DIR}/node_modules is missing or stale",
                        pytrace=False)
        npm_ci(npm, CONSOLE_DIR, NPM_CI_TIMEOUT_S)
    return node


class _Tenant:
    def __init__(self, admin: dsec.Client, url: str, prefix: str):
        self.admin = admin
        self.id = f"{prefix}-{uuid.uuid4().hex[:8]}"
        admin.create_tenant(self.id, name=f"console test {prefix}")
        self.key = admin.create_key(self.id, name="console test")["key"]
        self.client = dsec.Client(url=url, token=self.key, timeout=60)

    def cleanup(self, trajectory: str, problems: list):
        """Its sandboxes, the trajectory and its images, then the tenant."""
        for sb in self.admin.list():
            if sb.info.get("owner") == self.id and sb.state not in ("stopped", "failed"):
                with contextlib.suppress(dsec.NotFound):
                    self.admin.destroy(sb.id)
        with contextlib.suppress(dsec.NotFound):
            self.client.delete_trajectory(trajectory)
        for img in self.client.images():
            if img.raw.get("owner") == self.id:
                try:
                    self.client.delete_image(img.ref)
                except dsec.DsecError as e:
                    problems.append(f"could not delete {self.id}'s image {img.ref}: {e}")
        self.client.close()
        try:
            self.admin.delete_tenant(self.id)
        except dsec.NotFound:
            pass
        except dsec.DsecError as e:
            problems.append(f"could not delete tenant {self.id}: {e}")


@pytest.mark.slow
def test_console_in_a_browser(node, server, debian):
    shots = shots_dir()
    shots.mkdir(parents=True, exist_ok=True)
    for old in shots.glob("*.png"):
        old.unlink()
    trajectory = "console-" + uuid.uuid4().hex[:10]
    profile = tempfile.mkdtemp(prefix="dsec-console-chromium-")
    tenants = []
    a = _Tenant(server.client, server.url, "console-a")
    tenants.append(a)
    try:
        b = _Tenant(server.client, server.url, "console-b")
    except Exception:
        a.cleanup(trajectory, [])
        raise
    tenants.append(b)
    env = dict(os.environ)
    env.update({
        "DSEC_URL": server.url,
        "DSEC_ADMIN_TOKEN": server.client.token,
        "DSEC_TENANT_A": a.id,
        "DSEC_KEY_A": a.key,
        "DSEC_TENANT_B": b.id,
        "DSEC_KEY_B": b.key,
        "DSEC_IMAGE": debian,
        "DSEC_TRAJECTORY_ID": trajectory,
        "DSEC_SHOTS": str(shots),
        "DSEC_PORT_SERVER": str(REPO / "tests" / "port_server.py"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "sdk" / "python"),
                                                    env.get("PYTHONPATH")])),
        "DSEC_CHROMIUM_PROFILE": profile,
        "NO_COLOR": "1",
    })
    cmd = [node, "--test", "--test-concurrency=1", "--test-reporter=spec", "console.test.mjs"]
    started = time.monotonic()
    problems = []
    try:
        # A session of its own: on a timeout the runner and its test process
        # are killed together (chromium, below).
        proc = subprocess.Popen(cmd, cwd=CONSOLE_DIR, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"console.test.mjs did not finish within {RUN_TIMEOUT_S} s\n"
                        f"stdout:\n{out}\nstderr:\n{err}\nscreenshots: {shots}", pytrace=False)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything of its group still there
    finally:
        # Chromium goes with the browser context when the run ends well;
        # playwright starts it in a process group of its own, so after a
        # killed run it is found by its profile directory and killed here.
        deadline = time.monotonic() + 10
        while _chromium_pids(profile) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _chromium_pids(profile)
        if left:
            problems.append(f"chromium processes left by the run: {left}")
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(profile, ignore_errors=True)
        for t in tenants:
            t.cleanup(trajectory, problems)
    print(out)  # shown with pytest -s or -rP
    print(f"browser run: {time.monotonic() - started:.1f} s; screenshots in {shots}")
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd[1:])}` in {CONSOLE_DIR} exited {proc.returncode}\n"
                    f"stdout:\n{out}\nstderr:\n{err}\nscreenshots: {shots}", pytrace=False)
    assert not problems, "cleanup: " + "; ".join(problems)
    assert sorted(p.name for p in shots.glob("[0-9][0-9]-*.png") if "FAILED" not in p.name) == [
        "01-login.png", "02-sandboxes.png", "03-sandbox-stats.png", "03-sandbox.png",
        "04-terminal.png", "05-files.png",
        "06-trajectory-recovered.png", "06-trajectory.png", "07-port-page.png", "07-ports.png",
        "08-stopped.png", "09-tenant-b.png", "10-images.png", "10-nodes.png", "10-rates.png"]
