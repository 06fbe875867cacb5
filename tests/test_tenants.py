"""Tenants, API keys, roles and quotas (issue 7 item 4; docs/tenants.md), through
the real SDK against a real `dsec up`.

Two user tenants A and B: neither can see or touch the other's sandboxes (every
sandbox route of api/openapi.yaml is tried, so a new route is covered the day
it is added), private images or trajectories; a user key cannot manage
tenants; a revoked key is refused at once; quotas refuse with clear errors and
leave nothing behind; keys are stored hashed; a restart keeps it all."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import pytest

import dsec
from helpers import wait_until

yaml = pytest.importorskip("yaml", reason="python3-yaml is needed to read api/openapi.yaml")

SPEC = yaml.safe_load((Path(__file__).resolve().parent.parent / "api" / "openapi.yaml")
                      .read_text())
METHODS = ("get", "post", "put", "delete", "patch", "head")


def _uid() -> str:
    return uuid.uuid4().hex[:8]


class Tenant:
    """A user tenant made for one test, with a key and a client on it."""

    def __init__(self, admin: dsec.Client, server, sdk, prefix: str, **quota):
        self.admin = admin
        self.server = server
        self.id = f"{prefix}-{_uid()}"
        self.info = admin.create_tenant(self.id, name=f"test {prefix}", quota=quota or None)
        self.key = admin.create_key(self.id, name="test")
        self.client = sdk.Client(url=server.url, token=self.key["key"], timeout=60)

    def cleanup(self):
        for sb in self.admin.list():
            if sb.info.get("owner") == self.id and sb.state not in ("stopped", "failed"):
                try:
                    self.admin.destroy(sb.id)
                except dsec.NotFound:
                    pass
        self.client.close()
        try:
            self.admin.delete_tenant(self.id)
        except dsec.NotFound:
            pass


@pytest.fixture
def make_tenant(server, client, sdk):
    made = []

    def make(prefix="t", **quota) -> Tenant:
        t = Tenant(client, server, sdk, prefix, **quota)
        made.append(t)
        return t

    yield make
    for t in made:
        t.cleanup()


@pytest.fixture
def ab(make_tenant):
    return make_tenant("ta"), make_tenant("tb")


def _raw(server, method, path, token, body=None, headers=None):
    return server.raw(method, path, body=body, token=token, headers=headers)


def _sandbox_routes():
    """Every (method, path) of the contract that addresses one sandbox."""
    out = []
    for path, ops in SPEC["paths"].items():
        if path.startswith("/v1/sandboxes/{id}"):
            out += [(m.upper(), path) for m in ops if m in METHODS]
    assert len(out) >= 14, out  # the routes as of this test; more is fine
    return out


def _fill(path: str, sandbox_id: str) -> str:
    path = path.replace("{id}", sandbox_id)
    if "/files" in path:
        path += "?path=/tmp/secret"
    return path


def _body_for(method: str, path: str):
    if method not in ("POST", "PUT"):
        return None
    if path.endswith("/exec"):
        return {"cmd": ["sh", "-c", "echo pwned > /tmp/secret"]}
    if path.endswith("/run"):
        return {"code": "print(1)"}
    if path.endswith("/pack_diff"):
        return {"name": "tb/stolen"}
    if path.endswith("/phase"):
        return {"policy": "default"}
    if path.endswith("/mkdir"):
        return {"path": "/tmp/x"}
    if "/files" in path:
        return b"pwned"
    return {}


# ----- keys ------------------------------------------------------------------------

def test_whoami_names_the_tenant_and_role(ab, client):
    a, _ = ab
    me = a.client.whoami()
    assert me["tenant"] == a.id and me["role"] == "user" and me["key_id"] == a.key["id"]
    admin = client.whoami()
    assert admin["tenant"] == "admin" and admin["role"] == "admin" and admin["key_id"] is None


def test_a_key_is_shown_once_and_stored_only_as_a_hash(ab, client, server):
    a, _ = ab
    key = a.key["key"]
    assert re.fullmatch(r"dsk_[0-9a-f]{12}_[0-9a-f]{64}", key)
    assert a.key["prefix"] == "dsk_" + a.key["id"] and key.startswith(a.key["prefix"])
    listed = client.list_keys(a.id)
    assert [k["id"] for k in listed] == [a.key["id"]]
    assert all("key" not in k and "hash" not in k for k in listed)
    # The store holds the SHA-256 of the key, never the key.
    db = sqlite3.connect(f"file:{server.data_dir / 'state.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT doc FROM api_keys WHERE id=?", (a.key["id"],)).fetchall()
        everything = "\n".join(str(r) for t in ("api_keys", "tenants")
                               for r in db.execute(f"SELECT * FROM {t}").fetchall())
    finally:
        db.close()
    assert len(rows) == 1
    assert json.loads(rows[0][0])["hash"] == hashlib.sha256(key.encode()).hexdigest()
    secret = key.rsplit("_", 1)[1]
    assert secret not in everything and key not in everything
    for f in server.data_dir.glob("state.db*"):
        assert secret.encode() not in f.read_bytes(), f


def test_bad_and_revoked_keys_are_refused_at_once(ab, client, server, sdk):
    a, _ = ab
    second = client.create_key(a.id, name="second")
    c2 = sdk.Client(url=server.url, token=second["key"])
    assert c2.whoami()["key_id"] == second["id"]
    forged = second["key"][:-1] + ("0" if second["key"][-1] != "0" else "1")
    status, headers, _, doc = _raw(server, "GET", "/v1/whoami", forged)
    assert status == 401 and doc["error"]["code"] == "unauthenticated"
    assert headers.get("WWW-Authenticate") == "Bearer"
    revoked = client.revoke_key(a.id, second["id"])
    assert revoked["revoked_at"] is not None
    with pytest.raises(dsec.Unauthenticated):
        c2.whoami()
    assert client.revoke_key(a.id, second["id"])["revoked_at"] == revoked["revoked_at"]
    # The tenant's other key is untouched; a key id of another tenant is not found.
    assert a.client.whoami()["tenant"] == a.id
    with pytest.raises(dsec.NotFound):
        client.revoke_key("admin", a.key["id"])
    c2.close()


def test_a_deleted_tenant_s_keys_are_refused(make_tenant, client):
    t = make_tenant("gone")
    assert t.client.whoami()["tenant"] == t.id
    out = client.delete_tenant(t.id)
    assert out["deleted_keys"] == 1
    with pytest.raises(dsec.Unauthenticated):
        t.client.whoami()
    with pytest.raises(dsec.NotFound):
        client.tenant(t.id)


def test_the_bootstrap_admin_cannot_be_deleted_or_demoted(client):
    with pytest.raises(dsec.Conflict):
        client.delete_tenant("admin")
    with pytest.raises(dsec.InvalidArgument) as e:
        client.update_tenant("admin", role="user")
    assert e.value.field == "role"
    assert any(t["id"] == "admin" and t["role"] == "admin" for t in client.list_tenants())


def test_tenant_requests_are_validated(client):
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create_tenant("Bad_Id")
    assert e.value.field == "id"
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create_tenant(f"q-{_uid()}", quota={"max_cpu": -1})
    assert e.value.field == "quota.max_cpu"
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create_tenant(f"q-{_uid()}", quota={"gpus": 1})
    assert e.value.field == "quota.gpus"
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create_tenant(f"q-{_uid()}", role="root")
    assert e.value.field == "role"
    tid = f"dup-{_uid()}"
    client.create_tenant(tid)
    try:
        with pytest.raises(dsec.Conflict) as e:
            client.create_tenant(tid)
        assert e.value.code == "already_exists"
    finally:
        client.delete_tenant(tid)


# ----- roles -------------------------------------------------------------------------

def test_a_user_key_cannot_manage_tenants_or_the_node(ab, server):
    a, b = ab
    c = a.client
    for call in (lambda: c.create_tenant(f"x-{_uid()}"), c.list_tenants,
                 lambda: c.tenant(a.id), lambda: c.create_key(a.id),
                 lambda: c.list_keys(a.id), lambda: c.revoke_key(a.id, a.key["id"]),
                 lambda: c.set_quota(a.id, max_sandboxes=1000), lambda: c.delete_tenant(b.id),
                 c.layers, lambda: c.gc(), lambda: c.create_policy(f"p{_uid()}"),
                 lambda: c.delete_policy("default")):
        with pytest.raises(dsec.PermissionDenied) as e:
            call()
        assert e.value.code == "permission_denied"
    # Every admin-only route of the contract, raw.
    for path, ops in SPEC["paths"].items():
        if not path.startswith(("/v1/tenants", "/v1/layers", "/v1/gc", "/v1/node",
                                "/v1/metrics")):
            continue
        for m in ops:
            if m not in METHODS:
                continue
            p = (path.replace("{id}", a.id).replace("{key_id}", a.key["id"])
                 .replace("{digest}", "sha256:" + "0" * 64))
            status, _, _, doc = _raw(server, m.upper(), p, a.key["key"],
                                     body={} if m in ("post", "patch") else None)
            assert status == 403, (m, p, status, doc)
            assert doc["error"]["code"] == "permission_denied"
    # Still themselves, unchanged.
    assert a.client.whoami()["quota"]["max_sandboxes"] == 0
    assert b.client.whoami()["tenant"] == b.id


# ----- isolation ---------------------------------------------------------------------

def test_another_tenant_s_sandbox_is_not_found_on_every_route(ab, busybox, server, client):
    a, b = ab
    sa = a.client.create(busybox)
    sa.write_file("/tmp/secret", b"a's secret")
    ghost = "sb-" + "0" * 16
    for method, path in _sandbox_routes():
        body = _body_for(method, path)
        status, _, _, doc = _raw(server, method, _fill(path, sa.id), b.key["key"], body=body)
        # The same answer as for a sandbox that does not exist: nothing leaks.
        gstatus, _, _, gdoc = _raw(server, method, _fill(path, ghost), b.key["key"], body=body)
        assert status == 404, (method, path, status, doc)
        assert doc["error"]["code"] == "not_found", (method, path, doc)
        assert gstatus == 404 and doc["error"]["message"].replace(sa.id, ghost) == \
            gdoc["error"]["message"], (method, path, doc, gdoc)
    # Nothing happened to it.
    sa.refresh()
    assert sa.state == "running"
    assert sa.read_file("/tmp/secret") == b"a's secret"
    assert not sa.exists("/tmp/x")
    assert sa.phases[-1]["policy"] == "default" and len(sa.phases) == 1
    # Lists are per tenant; the admin sees all, with owners.
    assert [s.id for s in b.client.list()] == []
    assert [s.id for s in a.client.list()] == [sa.id]
    assert {s.id: s.info["owner"] for s in client.list()}[sa.id] == a.id
    with pytest.raises(dsec.NotFound):
        b.client.destroy(sa.id)
    assert client.get(sa.id).state == "running"
    sa.destroy()


def test_trajectories_are_per_tenant(ab, busybox, client):
    a, b = ab
    sa = a.client.create(busybox)
    sb = b.client.create(busybox)
    tid = f"shared-{_uid()}"
    ra = sa.exec("echo from-a", trajectory_id=tid, step=0)
    assert ra.stdout == "from-a\n" and not ra.replayed and ra.raw["trajectory_id"] == tid
    # The same id in B is B's own trajectory: it runs, neither replays A's
    # result nor conflicts with it.
    rb = sb.exec("echo from-b", trajectory_id=tid, step=0)
    assert rb.stdout == "from-b\n" and not rb.replayed and rb.raw["trajectory_id"] == tid
    # B sending A's step to its own sandbox gets its own log, not A's result.
    assert sb.exec("echo from-b", trajectory_id=tid, step=0).replayed
    assert [t["id"] for t in a.client.trajectories()] == [tid]
    assert [t["id"] for t in b.client.trajectories()] == [tid]
    (ea,) = a.client.export_trajectory(tid)
    (eb,) = b.client.export_trajectory(tid)
    assert ea["result"]["stdout"] == "from-a\n" and ea["trajectory_id"] == tid
    assert eb["result"]["stdout"] == "from-b\n" and eb["trajectory_id"] == tid
    # One only A has: not found for B on every trajectory route.
    only_a = f"only-a-{_uid()}"
    sa.exec("true", trajectory_id=only_a, step=0)
    with pytest.raises(dsec.NotFound):
        b.client.export_trajectory(only_a)
    with pytest.raises(dsec.NotFound):
        b.client.delete_trajectory(only_a)
    with pytest.raises(dsec.NotFound):
        b.client.recover(only_a, force=True)
    # A's file steps and checkpoints are A's too.
    sa.write_file("/tmp/f", b"a", trajectory_id=only_a, step=1)
    # A checkpoint with the SDK's default name lands under A's own prefix.
    img = sa.trajectory(only_a, start=2).checkpoint()
    assert img.name == f"{a.id}/chronus/{only_a}" and img.tag == "step-2", img.raw
    assert len(a.client.export_trajectory(only_a)) == 3
    # The admin sees both, each under its tenant.
    ids = {t["id"] for t in client.trajectories()}
    assert {f"{tid}@{a.id}", f"{tid}@{b.id}", f"{only_a}@{a.id}"} <= ids
    assert b.client.delete_trajectory(tid) == 1
    assert len(a.client.export_trajectory(tid)) == 1
    assert client.delete_trajectory(f"{tid}@{a.id}") == 1
    # A recovers its own: the new sandbox is A's (and counts for A), not B's.
    rec = a.client.recover(only_a, force=True)
    assert rec.info["owner"] == a.id and rec.recovery["trajectory_id"] == only_a
    assert rec.id in [s.id for s in a.client.list()]
    assert rec.id not in [s.id for s in b.client.list()]
    assert rec.read_file("/tmp/f") == b"a"
    rec.destroy()
    a.client.delete_trajectory(only_a)
    a.client.delete_image(f"{img.name}:{img.tag}")
    sa.destroy()
    sb.destroy()


def test_private_images_are_invisible_and_unusable_to_others(ab, busybox, client):
    a, b = ab
    base = client.image(busybox)
    assert base.raw["visibility"] == "public" and base.raw["owner"] == "admin"
    # A user tenant's images are private and under its name.
    with pytest.raises(dsec.InvalidArgument) as e:
        a.client.create_image("mine", "v1", base.layers)
    assert e.value.field == "name"
    with pytest.raises(dsec.PermissionDenied) as e:
        a.client.create_image(f"{a.id}/pub", "v1", base.layers, visibility="public")
    assert e.value.field == "visibility"
    img = a.client.create_image(f"{a.id}/bb", "v1", base.layers)
    assert img.raw["visibility"] == "private" and img.raw["owner"] == a.id
    ref = f"{a.id}/bb:v1"
    # A snapshot of A's sandbox: a diff layer no image B can see names.
    sa = a.client.create(ref)
    sa.write_file("/tmp/mark", b"a")
    snap = sa.pack_diff(f"{a.id}/snap")
    assert snap.raw["visibility"] == "private" and snap.raw["owner"] == a.id
    diff = snap.layers[-1]
    with pytest.raises(dsec.InvalidArgument) as e:
        sa.pack_diff("elsewhere/snap")
    assert e.value.field == "name"
    refs = {i.ref for i in b.client.images()}
    assert ref not in refs and f"{a.id}/snap:latest" not in refs and busybox in refs
    for call in (lambda: b.client.image(ref), lambda: b.client.create(ref),
                 lambda: b.client.create(busybox, diffs=[diff]),
                 lambda: b.client.create(busybox, diffs=[f"{a.id}/snap"]),
                 lambda: b.client.create(snapshot=f"{a.id}/snap"),
                 lambda: b.client.delete_image(ref),
                 lambda: b.client.tag_image(ref, f"{b.id}/copy"),
                 lambda: b.client.create_image(f"{b.id}/copy", "v1", [diff], kind="diff")):
        with pytest.raises((dsec.NotFound, dsec.InvalidArgument)) as e:
            call()
        assert "not found" in e.value.message or "not been uploaded" in e.value.message
    # Public images stay visible but are not B's to delete.
    with pytest.raises(dsec.PermissionDenied):
        b.client.delete_image(busybox)
    # The admin and A see them.
    assert ref in {i.ref for i in client.images()}
    assert ref in {i.ref for i in a.client.images()}
    sa.destroy()
    a.client.delete_image(f"{a.id}/snap")
    a.client.delete_image(ref)


# ----- quotas ------------------------------------------------------------------------

def _live(client, tenant_id):
    return [s for s in client.list() if s.info["owner"] == tenant_id
            and s.state not in ("stopped", "failed")]


def test_max_sandboxes_refuses_with_the_field_and_leaves_nothing(make_tenant, busybox, client):
    t = make_tenant("qn", max_sandboxes=2)
    s1 = t.client.create(busybox)
    t.client.create(busybox)
    with pytest.raises(dsec.QuotaExceeded) as e:
        t.client.create(busybox)
    assert e.value.status == 403 and e.value.code == "quota_exceeded"
    assert e.value.field == "max_sandboxes" and "2" in e.value.message
    assert isinstance(e.value, dsec.PermissionDenied)
    assert len(_live(client, t.id)) == 2 and len(t.client.list()) == 2
    usage = t.client.whoami()["usage"]
    assert usage["sandboxes"] == 2
    s1.destroy()
    t.client.create(busybox)  # room again
    # Raising the quota takes effect at once.
    client.set_quota(t.id, max_sandboxes=3)
    t.client.create(busybox)
    assert len(_live(client, t.id)) == 3


def test_cpu_and_memory_quotas_name_their_field(make_tenant, busybox, client):
    t = make_tenant("qc", max_cpu=1.0, max_memory_mb=300)
    t.client.create(busybox, cpu=0.5, memory_mb=100)
    with pytest.raises(dsec.QuotaExceeded) as e:
        t.client.create(busybox, cpu=0.6, memory_mb=100)
    assert e.value.field == "max_cpu"
    t.client.create(busybox, cpu=0.5, memory_mb=100)  # exactly full
    client.set_quota(t.id, max_cpu=0)  # no cpu limit; memory still
    with pytest.raises(dsec.QuotaExceeded) as e:
        t.client.create(busybox, cpu=0.1, memory_mb=101)
    assert e.value.field == "max_memory_mb"
    t.client.create(busybox, cpu=0.1, memory_mb=100)
    assert len(_live(client, t.id)) == 3
    info = client.tenant(t.id)
    assert info["usage"]["memory_mb"] == 300 and info["quota"]["max_memory_mb"] == 300


def test_creation_rate_is_limited_with_429(make_tenant, busybox, client, server):
    t = make_tenant("qr", creates_per_s=0.5, create_burst=2)
    t.client.create(busybox)
    t.client.create(busybox)
    with pytest.raises(dsec.RateLimited) as e:
        t.client.create(busybox)
    assert e.value.status == 429 and e.value.code == "rate_limited"
    assert e.value.field == "creates_per_s" and "retry in" in e.value.message
    assert len(_live(client, t.id)) == 2
    time.sleep(2.1)
    t.client.create(busybox)
    # Other tenants are not slowed by it.
    other = make_tenant("qr2")
    for _ in range(3):
        other.client.create(busybox)
    metrics = server.raw("GET", "/v1/metrics")[2].decode()
    assert re.search(r'^dsec_api_errors_total\{code="rate_limited"\} [1-9]', metrics, re.M)


def test_concurrent_creates_never_exceed_the_quota(make_tenant, busybox, client, sdk):
    t = make_tenant("qx", max_sandboxes=3)
    results = []
    lock = threading.Lock()

    def create():
        c = sdk.Client(url=t.client.url, token=t.key["key"], timeout=120)
        try:
            r = c.create(busybox)
            out = ("ok", r.id)
        except dsec.DsecError as e:
            out = (e.code, e.field)
        finally:
            c.close()
        with lock:
            results.append(out)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(180)
    assert sorted(r[0] for r in results) == ["ok"] * 3 + ["quota_exceeded"] * 5, results
    assert all(r[1] == "max_sandboxes" for r in results if r[0] != "ok")
    assert len(_live(client, t.id)) == 3


def test_one_shot_runs_count_against_the_quotas(make_tenant, debian, busybox, client, sdk):
    # POST /v1/run: each call is a creation (creates_per_s) and, while it
    # runs, one warm sandbox (max_sandboxes, max_cpu, max_memory_mb).
    t = make_tenant("qrun", max_sandboxes=1)
    assert t.client.run("print(6 * 7)", image=debian, timeout=60).stdout == "42\n"
    assert t.client.whoami()["usage"]["runs"] == 0
    done = {}

    def slow():
        c = sdk.Client(url=t.client.url, token=t.key["key"], timeout=120)
        try:
            done["r"] = c.run("import time; time.sleep(4); print('slept')", image=debian,
                              timeout=60)
        finally:
            c.close()
    th = threading.Thread(target=slow)
    th.start()
    try:
        assert wait_until(lambda: t.client.whoami()["usage"]["runs"] == 1, 30)
        usage = t.client.whoami()["usage"]
        assert usage["sandboxes"] == 0 and usage["cpu"] > 0 and usage["memory_mb"] > 0
        with pytest.raises(dsec.QuotaExceeded) as e:
            t.client.run("print(1)", image=debian)
        assert e.value.status == 403 and e.value.field == "max_sandboxes"
        assert "runs under way" in e.value.message
        with pytest.raises(dsec.QuotaExceeded) as e:  # a sandbox create sees the run too
            t.client.create(busybox)
        assert e.value.field == "max_sandboxes"
    finally:
        th.join(120)
    assert done["r"].stdout == "slept\n"
    assert t.client.whoami()["usage"]["runs"] == 0
    assert t.client.run("print(2)", image=debian).stdout == "2\n"  # room again
    assert _live(client, t.id) == []
    # The pool's sandbox is 512 MB: a smaller memory quota refuses the call.
    m = make_tenant("qrunm", max_memory_mb=256)
    with pytest.raises(dsec.QuotaExceeded) as e:
        m.client.run("print(1)", image=debian)
    assert e.value.field == "max_memory_mb"
    # The creation rate: runs and creates share the tenant's bucket.
    r = make_tenant("qrunr", creates_per_s=0.5, create_burst=2)
    r.client.run("print(1)", image=debian)
    r.client.run("print(1)", image=debian)
    with pytest.raises(dsec.RateLimited) as e:
        r.client.run("print(1)", image=debian)
    assert e.value.status == 429 and e.value.field == "creates_per_s"
    with pytest.raises(dsec.RateLimited):
        r.client.create(busybox)
    time.sleep(2.1)
    assert r.client.run("print(3)", image=debian).stdout == "3\n"


# ----- restart -----------------------------------------------------------------------

def test_a_restart_keeps_tenants_keys_quotas_and_ownership(tmp_path):
    import os
    import signal
    from conftest import Server, _check_prerequisites
    _check_prerequisites()
    tar = os.path.join(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"),
                       "busybox.tar")
    srv = Server(tmp_path / "data", ["--live-restore", "yes"])
    srv.start()
    try:
        srv.import_image("busybox:latest", tar)
        admin = srv.client
        admin.create_tenant("acme", quota={"max_sandboxes": 1})
        key = admin.create_key("acme")["key"]
        gone = admin.create_key("acme")
        admin.revoke_key("acme", gone["id"])
        acme = dsec.Client(url=srv.url, token=key)
        sb = acme.create("busybox:latest")
        sb.exec("echo 1", trajectory_id="t", step=0)
        acme.close()
    finally:
        assert srv.stop() in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    srv = Server(tmp_path / "data", ["--live-restore", "yes"])
    srv.start()
    try:
        acme = dsec.Client(url=srv.url, token=key)
        assert acme.whoami()["tenant"] == "acme"
        with pytest.raises(dsec.Unauthenticated):
            dsec.Client(url=srv.url, token=gone["key"]).whoami()
        # Its re-adopted sandbox is still its own and still counts.
        assert [s.id for s in acme.list()] == [sb.id]
        with pytest.raises(dsec.QuotaExceeded):
            acme.create("busybox:latest")
        assert acme.get(sb.id).exec("echo 1", trajectory_id="t", step=0).replayed
        assert [t["id"] for t in srv.client.trajectories()] == ["t@acme"]
        acme.destroy(sb.id)
        acme.close()
    finally:
        srv.stop()


# ----- CLI ---------------------------------------------------------------------------

def test_cli_manages_tenants_and_keys(server, client):
    tid = f"cli-{_uid()}"
    d = ("--data-dir", server.data_dir)
    r = server.cli("tenant", "create", tid, *d, "--max-sandboxes", "2", "--max-cpu", "1.5")
    assert r.returncode == 0 and r.stdout.strip() == tid, r.stderr
    assert client.tenant(tid)["quota"]["max_sandboxes"] == 2
    r = server.cli("tenant", "quota", tid, *d, "--creates-per-s", "3")
    assert r.returncode == 0, r.stderr
    assert client.tenant(tid)["quota"]["creates_per_s"] == 3
    assert client.tenant(tid)["quota"]["max_cpu"] == 1.5
    r = server.cli("tenant", "ls", *d)
    assert r.returncode == 0 and re.search(rf"^{tid}\s+user\s", r.stdout, re.M), r.stdout
    r = server.cli("key", "create", tid, *d, "--name", "cli")
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert re.fullmatch(r"dsk_[0-9a-f]{12}_[0-9a-f]{64}", key)
    kid = key[4:16]
    r = server.cli("whoami", "--url", server.url, "--token", key)
    assert r.returncode == 0 and r.stdout.split() == [tid, "user"], (r.stdout, r.stderr)
    # A user key is refused by admin commands, with the API's code.
    r = server.cli("tenant", "ls", "--url", server.url, "--token", key)
    assert r.returncode == 1 and "permission_denied" in r.stderr
    r = server.cli("key", "ls", tid, *d)
    assert r.returncode == 0 and kid in r.stdout and key not in r.stdout
    r = server.cli("key", "rm", tid, kid, *d)
    assert r.returncode == 0, r.stderr
    r = server.cli("whoami", "--url", server.url, "--token", key)
    assert r.returncode == 1 and "unauthenticated" in r.stderr
    r = server.cli("tenant", "rm", tid, *d)
    assert r.returncode == 0, r.stderr
    with pytest.raises(dsec.NotFound):
        client.tenant(tid)
