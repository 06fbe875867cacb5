"""Bad input: every bad request gets the documented status, code and field, and
leaves nothing behind (no sandbox, no cgroup)."""

from __future__ import annotations

import hashlib
import os

import pytest

import dsec
from helpers import cgroup_ids, expect_error, running_ids, unique, wait_until

RUN = unique("bad")  # label carried by every create in this module that must fail


@pytest.fixture(scope="module")
def cgroups_before(server):
    return cgroup_ids()


def assert_error(resp, status, code, field=None):
    st, _, data, doc = resp
    assert st == status, f"want {status}, got {st}: {data[:300]!r}"
    assert isinstance(doc, dict) and isinstance(doc.get("error"), dict), data[:300]
    err = doc["error"]
    assert err.get("code") == code, err
    assert isinstance(err.get("message"), str) and err["message"], err
    if field is not None:
        assert err.get("field") == field, err
    return err


# ----- auth ---------------------------------------------------------------------

def test_missing_token_is_401(server, cgroups_before):
    for method, path in (("GET", "/v1/sandboxes"), ("POST", "/v1/sandboxes"),
                         ("GET", "/v1/images"), ("GET", "/v1/sandboxes/sb-0000000000000000")):
        body = {"image": "busybox"} if method == "POST" else None
        assert_error(server.raw(method, path, body=body, token=None), 401, "unauthenticated")


def test_wrong_token_is_401(server, busybox, bb, sdk):
    bad = sdk.Client(server.url, token="not-the-token", timeout=10)
    expect_error(lambda: bad.list(), dsec.Unauthenticated, status=401)
    expect_error(lambda: bad.create(busybox, labels={"bad": RUN}), dsec.Unauthenticated)
    expect_error(lambda: bad.sandbox(bb.id).exec("true"), dsec.Unauthenticated)
    expect_error(lambda: bad.sandbox(bb.id).read_file("/etc/passwd"), dsec.Unauthenticated)
    # auth is checked before existence: an unknown id does not answer 404
    expect_error(lambda: bad.get("sb-0000000000000000"), dsec.Unauthenticated)
    st, _, _, _ = server.raw("GET", "/v1/sandboxes", token=None,
                             headers={"Authorization": "Basic " + "dXNlcjpwYXNz"})
    assert st == 401
    st, _, _, _ = server.raw("GET", "/v1/sandboxes", token=server.client.token + "x")
    assert st == 401
    assert bad.health()["status"] == "ok"  # health needs no token


# ----- create ------------------------------------------------------------------

def test_unknown_image_is_404_and_leaves_nothing(client):
    expect_error(lambda: client.create("no-such-image:latest", labels={"bad": RUN}),
                 dsec.NotFound, status=404)
    expect_error(lambda: client.create("sha256:" + "0" * 64, labels={"bad": RUN}),
                 dsec.NotFound, status=404)
    assert client.list(labels={"bad": RUN}) == []


def test_malformed_json_is_400_field_body(server, bb):
    for path in ("/v1/sandboxes", f"/v1/sandboxes/{bb.id}/exec",
                 f"/v1/sandboxes/{bb.id}/files/mkdir", "/v1/images"):
        assert_error(server.raw("POST", path, body=b'{"image": "busybox",'), 400,
                     "invalid_argument", "body")
        assert_error(server.raw("POST", path, body=b"\xff\xfe"), 400, "invalid_argument", "body")
    st, _, _, doc = server.raw("POST", "/v1/sandboxes", body=[1, 2])
    assert st == 400 and doc["error"]["code"] == "invalid_argument", doc
    assert server.client.list(labels={"bad": RUN}) == []


@pytest.mark.parametrize("field,value", [
    ("backend", "nosuchbackend"),
    ("backend", 7),
    ("memory_mb", 15),
    ("memory_mb", 262145),
    ("memory_mb", "512"),
    ("memory_mb", 1.5),
    ("cpu", 0.01),
    ("cpu", 65),
    ("cpu", "1"),
    ("disk_mb", 15),
    ("disk_mb", 1048577),
    ("pids", 15),
    ("pids", 65537),
    ("ttl_s", -1),
    ("ttl_s", 604801),
    ("image", ""),
    ("image", 5),
    ("env", "A=B"),
])
def test_create_rejects_bad_field(server, busybox, field, value):
    body = {"image": busybox, "labels": {"bad": RUN}, field: value}
    assert_error(server.raw("POST", "/v1/sandboxes", body=body), 400, "invalid_argument", field)


@pytest.mark.parametrize("field,value", [
    ("labels", {"bad key!": "v"}),
    ("labels", {"k" * 64: "v"}),
    ("labels", {"k": "v" * 256}),
    ("labels", {"k": 1}),
    ("env", {"K": 1}),
])
def test_create_rejects_bad_map(server, busybox, field, value):
    body = {"image": busybox, field: value}
    if field != "labels":
        body["labels"] = {"bad": RUN}
    err = assert_error(server.raw("POST", "/v1/sandboxes", body=body), 400, "invalid_argument")
    assert (err.get("field") or "").startswith(field), err


def test_create_rejects_unknown_and_missing_fields(server, busybox):
    err = assert_error(server.raw("POST", "/v1/sandboxes",
                                  body={"image": busybox, "labels": {"bad": RUN}, "gpu": 1}),
                       400, "invalid_argument", "gpu")
    assert "gpu" in err["message"]
    assert_error(server.raw("POST", "/v1/sandboxes", body={"labels": {"bad": RUN}}),
                 400, "invalid_argument", "image")
    # the SDK maps it to InvalidArgument with the field
    e = expect_error(lambda: server.client.create(busybox, backend="nosuch",
                                                  labels={"bad": RUN}),
                     dsec.InvalidArgument, field="backend", status=400)
    assert e.code == "invalid_argument"


def test_boundary_values_are_accepted(make_sandbox, busybox):
    sb = make_sandbox(busybox, cpu=0.05, memory_mb=16, disk_mb=16, pids=16, ttl_s=604800)
    assert sb.state == "running"
    assert (sb.info["cpu"], sb.info["memory_mb"], sb.info["pids"]) == (0.05, 16, 16)
    assert sb.exec("echo ok").stdout == "ok\n"


def test_image_without_tag_means_latest(make_sandbox, busybox):
    sb = make_sandbox("busybox")
    assert sb.image == "busybox:latest" and sb.exec("true").ok


# ----- exec --------------------------------------------------------------------

@pytest.mark.parametrize("body,field", [
    ({}, "cmd"),
    ({"cmd": []}, "cmd"),
    ({"cmd": 42}, "cmd"),
    ({"cmd": ["echo", 1]}, "cmd"),
    ({"cmd": ["echo"], "timeout_s": 0}, "timeout_s"),
    ({"cmd": ["echo"], "timeout_s": 86401}, "timeout_s"),
    ({"cmd": ["echo"], "timeout_s": "5"}, "timeout_s"),
    ({"cmd": ["echo"], "max_output_bytes": -1}, "max_output_bytes"),
    ({"cmd": ["echo"], "max_output_bytes": 67108865}, "max_output_bytes"),
    ({"cmd": ["echo"], "stdin_b64": "!!not base64!!"}, "stdin_b64"),
    ({"cmd": ["echo"], "encoding": "latin1"}, "encoding"),
    ({"cmd": ["echo"], "env": {"K": 1}}, "env"),
    ({"cmd": ["echo"], "stream": "yes"}, "stream"),
    ({"cmd": ["echo"], "bogus": True}, "bogus"),
])
def test_exec_rejects_bad_request(server, bb, body, field):
    err = assert_error(server.raw("POST", f"/v1/sandboxes/{bb.id}/exec", body=body),
                       400, "invalid_argument")
    assert (err.get("field") or "").startswith(field), err


def test_exec_rejects_both_stdin_kinds(server, bb):
    body = {"cmd": ["cat"], "stdin": "a", "stdin_b64": "YQ=="}
    err = assert_error(server.raw("POST", f"/v1/sandboxes/{bb.id}/exec", body=body),
                       400, "invalid_argument")
    assert err.get("field") in ("stdin", "stdin_b64"), err


def test_calls_on_unknown_sandbox_are_404(server, client):
    ghost = client.sandbox("sb-0000000000000000")
    expect_error(lambda: ghost.exec("true"), dsec.NotFound, status=404)
    expect_error(lambda: ghost.read_file("/etc/passwd"), dsec.NotFound, status=404)
    expect_error(lambda: ghost.write_file("/tmp/x", b"x"), dsec.NotFound, status=404)
    expect_error(lambda: ghost.list_dir("/"), dsec.NotFound, status=404)
    st, _, _, _ = server.raw("GET", "/v1/no-such-route")
    assert st == 404


def test_file_calls_reject_bad_parameters(server, bb):
    base = f"/v1/sandboxes/{bb.id}"
    assert_error(server.raw("PUT", f"{base}/files?path=/tmp/m&mode=abc", body=b"x"),
                 400, "invalid_argument", "mode")
    assert_error(server.raw("PUT", f"{base}/files?path=/tmp/m&mode=0999", body=b"x"),
                 400, "invalid_argument", "mode")
    assert_error(server.raw("GET", f"{base}/files"), 400, "invalid_argument", "path")
    assert_error(server.raw("GET", f"{base}/files?path=/tmp/a%00b"), 400, "invalid_argument",
                 "path")
    assert_error(server.raw("POST", f"{base}/files/mkdir", body={"path": "/tmp/q", "bogus": 1}),
                 400, "invalid_argument", "bogus")
    assert_error(server.raw("POST", f"{base}/files/mkdir", body={"parents": True}),
                 400, "invalid_argument", "path")
    assert bb.exec(["test", "-e", "/tmp/m"]).exit_code == 1


# ----- blobs and images ---------------------------------------------------------

def test_blob_digest_is_verified(server, client):
    data = os.urandom(4096)
    wrong = "sha256:" + hashlib.sha256(b"something else" + data).hexdigest()
    assert_error(server.raw("PUT", f"/v1/blobs/{wrong}", body=data,
                            headers={"Content-Type": "application/octet-stream"}),
                 400, "invalid_argument", "digest")
    assert client.has_blob(wrong) is False
    assert_error(server.raw("PUT", "/v1/blobs/sha256:xyz", body=data,
                            headers={"Content-Type": "application/octet-stream"}),
                 400, "invalid_argument", "digest")


def test_blob_upload_and_head(client, tmp_path):
    data = os.urandom((1 << 20) + 17)
    p = tmp_path / "blob.bin"
    p.write_bytes(data)
    want = "sha256:" + hashlib.sha256(data).hexdigest()
    assert client.has_blob(want) is False
    assert client.upload_blob(str(p)) == want
    assert client.has_blob(want) is True
    assert client.upload_blob(str(p)) == want  # uploading again is fine


def test_create_image_validates_layers(server, client):
    missing = "sha256:" + "1" * 64
    expect_error(lambda: client.create_image(unique("img"), "v1", [missing]),
                 dsec.InvalidArgument, field="layers", status=400)
    expect_error(lambda: client.create_image(unique("img"), "v1", []),
                 dsec.InvalidArgument, field="layers")
    assert_error(server.raw("POST", "/v1/images", body={"tag": "v1", "layers": [missing]}),
                 400, "invalid_argument", "name")
    expect_error(lambda: client.image("no-such-image:v9"), dsec.NotFound, status=404)
    expect_error(lambda: client.delete_image("no-such-image:v9"), dsec.NotFound, status=404)


def test_image_retag_use_and_delete(client, busybox, make_sandbox):
    base = client.image(busybox)
    assert base.ref == "busybox:latest" and base.name == "busybox" and base.tag == "latest"
    assert base.layers and isinstance(base.size, int)
    name = unique("retag")
    img = client.create_image(name, "v1", base.layers)
    assert (img.ref, img.layers) == (f"{name}:v1", base.layers)
    assert f"{name}:v1" in {i.ref for i in client.images()}
    assert client.image(f"{name}:v1").layers == base.layers
    sb = make_sandbox(f"{name}:v1")
    assert sb.image == f"{name}:v1" and sb.info["layers"] == base.layers
    assert sb.exec("echo ok").stdout == "ok\n"
    expect_error(lambda: client.delete_image(f"{name}:v1"), dsec.Conflict, status=409)
    sb.destroy()
    client.delete_image(f"{name}:v1")
    expect_error(lambda: client.image(f"{name}:v1"), dsec.NotFound)
    assert client.image(busybox).layers == base.layers  # the base is untouched


def test_create_from_layer_digest(client, busybox, make_sandbox):
    layers = client.image(busybox).layers
    if len(layers) != 1:
        pytest.skip(f"busybox test image has {len(layers)} layers; need exactly one")
    sb = make_sandbox(layers[0])
    assert sb.info["layers"] == layers and sb.exec("echo ok").stdout == "ok\n"


# ----- nothing left behind --------------------------------------------------------

def test_zz_failed_requests_left_no_state(client, cgroups_before):
    assert client.list(labels={"bad": RUN}) == []
    # Destroyed sandboxes' cgroups are removed by the edge's cleaner right
    # after the DELETE answers; give it a moment, then nothing may remain.
    def leaks():
        return cgroup_ids() - cgroups_before - running_ids(client)
    wait_until(lambda: not leaks(), timeout=10)
    leaked = leaks()
    assert not leaked, f"cgroups without a running sandbox: {sorted(leaked)}"


def test_oversized_json_body_is_413(bb):
    e = expect_error(lambda: bb.exec("wc -c", stdin=os.urandom(20 << 20), timeout=30),
                     dsec.PayloadTooLarge, status=413)
    assert e.code == "payload_too_large"
    assert bb.exec("echo ok").stdout == "ok\n"
