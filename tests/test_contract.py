"""The server's answers conform to api/openapi.yaml (status codes and schemas).

A small validator for the subset of JSON Schema the spec uses keeps this free of
third-party packages beyond PyYAML (Debian's python3-yaml)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from helpers import unique

yaml = pytest.importorskip("yaml", reason="python3-yaml is needed to read api/openapi.yaml")

SPEC = yaml.safe_load((Path(__file__).resolve().parent.parent / "api" / "openapi.yaml")
                      .read_text())


def resolve(schema):
    while "$ref" in schema:
        node = SPEC
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def check(value, schema, where="$"):
    """Returns a list of violations of `schema` by `value`."""
    schema = resolve(schema)
    errs = []
    if value is None:
        return [] if schema.get("nullable") else [f"{where}: null not allowed"]
    for sub in schema.get("allOf", []):
        errs += check(value, sub, where)
    if "oneOf" in schema:
        if sum(1 for sub in schema["oneOf"] if not check(value, sub, where)) != 1:
            errs.append(f"{where}: matches not exactly one of oneOf")
    t = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if t in types and not isinstance(value, types[t]):
        return errs + [f"{where}: {value!r} is not {t}"]
    if t == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return errs + [f"{where}: {value!r} is not integer"]
    if t == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return errs + [f"{where}: {value!r} is not number"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{where}: {value!r} not in {schema['enum']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errs.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        for k in schema.get("required", []):
            if k not in value:
                errs.append(f"{where}: missing {k}")
        props = schema.get("properties", {})
        for k, v in value.items():
            if k in props:
                errs += check(v, props[k], f"{where}.{k}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errs += check(v, schema["additionalProperties"], f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{where}: unexpected {k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errs += check(v, schema["items"], f"{where}[{i}]")
    return errs


def response_schema(path, method, status, ctype="application/json"):
    resp = SPEC["paths"][path][method.lower()]["responses"][str(status)]
    resp = resolve(resp)
    return resp["content"][ctype]["schema"]


def conforms(resp, path, method, ctype="application/json"):
    status, headers, data, doc = resp
    assert str(status) in SPEC["paths"][path][method.lower()]["responses"], \
        f"{method} {path}: status {status} is not documented ({data[:200]!r})"
    errs = check(doc, response_schema(path, method, status, ctype))
    assert not errs, f"{method} {path} -> {status}: " + "; ".join(errs) + f"\n{doc}"
    return doc


def test_spec_is_openapi_3():
    assert SPEC["openapi"] == "3.0.3"
    assert SPEC["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for name in ("Sandbox", "CreateSandbox", "ExecRequest", "ExecResult", "ExecEvent",
                 "FileEntry", "Image", "Error"):
        assert name in SPEC["components"]["schemas"]


def test_sandbox_and_exec_answers_conform(server, busybox):
    r = server.raw("POST", "/v1/sandboxes", body={"image": busybox, "labels": {"c": "1"}})
    sb = conforms(r, "/v1/sandboxes", "POST")
    server.created.add(sb["id"])
    sid = sb["id"]
    try:
        one = "/v1/sandboxes/{id}"
        got = conforms(server.raw("GET", f"/v1/sandboxes/{sid}"), one, "GET")
        assert "stats" in got
        conforms(server.raw("GET", "/v1/sandboxes?label=c=1"), "/v1/sandboxes", "GET")
        ex = "/v1/sandboxes/{id}/exec"
        res = conforms(server.raw("POST", f"/v1/sandboxes/{sid}/exec",
                                  body={"cmd": "echo hi; echo e >&2"}), ex, "POST")
        assert res["stdout"] == "hi\n"
        status, headers, data, _ = server.raw("POST", f"/v1/sandboxes/{sid}/exec",
                                              body={"cmd": "echo a; exit 2", "stream": True})
        assert status == 200
        assert headers.get("Content-Type", "").startswith("application/x-ndjson"), headers
        events = [json.loads(line) for line in data.splitlines() if line.strip()]
        schema = response_schema(ex, "POST", 200, "application/x-ndjson")
        for ev in events:
            assert not check(ev, schema), (ev, check(ev, schema))
        assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 2
        status, headers, data, _ = server.raw("POST", f"/v1/sandboxes/{sid}/exec",
                                              body={"cmd": ["true"]},
                                              headers={"Accept": "application/x-ndjson"})
        assert headers.get("Content-Type", "").startswith("application/x-ndjson"), headers
        assert json.loads(data.splitlines()[-1])["type"] == "exit"

        files = "/v1/sandboxes/{id}/files"
        conforms(server.raw("PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/c&mode=0600",
                            body=b"abc", headers={"Content-Type": "application/octet-stream"}),
                 files, "PUT")
        status, headers, data, _ = server.raw("GET", f"/v1/sandboxes/{sid}/files?path=/tmp/c")
        assert (status, data) == (200, b"abc")
        assert headers.get("Content-Type") == "application/octet-stream", headers
        st = conforms(server.raw("GET", f"/v1/sandboxes/{sid}/files/stat?path=/tmp/c"),
                      files + "/stat", "GET")
        assert st["mode"] == 0o600 and st["type"] == "file"
        conforms(server.raw("GET", f"/v1/sandboxes/{sid}/files/list?path=/tmp"),
                 files + "/list", "GET")
        conforms(server.raw("POST", f"/v1/sandboxes/{sid}/files/mkdir",
                            body={"path": "/tmp/cd", "parents": True, "mode": 493}),
                 files + "/mkdir", "POST")
        conforms(server.raw("DELETE", f"/v1/sandboxes/{sid}/files?path=/tmp/cd&recursive=true"),
                 files, "DELETE")
        conforms(server.raw("GET", f"/v1/sandboxes/{sid}/files?path=rel"), files, "GET")
        conforms(server.raw("GET", f"/v1/sandboxes/{sid}/files?path=/nope"), files, "GET")
    finally:
        gone = conforms(server.raw("DELETE", f"/v1/sandboxes/{sid}"), one, "DELETE")
    assert gone["state"] == "stopped"
    conforms(server.raw("POST", f"/v1/sandboxes/{sid}/exec", body={"cmd": "true"}), ex, "POST")


def test_error_answers_conform(server, busybox):
    conforms(server.raw("GET", "/v1/sandboxes", token=None), "/v1/sandboxes", "GET")
    conforms(server.raw("POST", "/v1/sandboxes", body={"image": busybox, "memory_mb": 1}),
             "/v1/sandboxes", "POST")
    conforms(server.raw("POST", "/v1/sandboxes", body={"image": "nope-" + unique()}),
             "/v1/sandboxes", "POST")
    conforms(server.raw("GET", "/v1/sandboxes/sb-0000000000000000"), "/v1/sandboxes/{id}",
             "GET")
    conforms(server.raw("GET", "/v1/images/nope:v0"), "/v1/images/{ref}", "GET")


def test_checkpoint_and_recover_answers_conform(server, busybox, make_sandbox):
    sb = make_sandbox(busybox)
    t = unique("ct")
    pd = "/v1/sandboxes/{id}/pack_diff"
    conforms(server.raw("POST", f"/v1/sandboxes/{sb.id}/exec",
                        body={"cmd": "echo a > /root/a", "trajectory_id": t, "step": 0}),
             "/v1/sandboxes/{id}/exec", "POST")
    name = unique("ckpt")
    img = conforms(server.raw("POST", f"/v1/sandboxes/{sb.id}/pack_diff",
                              body={"name": name, "trajectory_id": t, "step": 1}), pd, "POST")
    assert img["replayed"] is False and img["step"] == 1
    conforms(server.raw("POST", f"/v1/sandboxes/{sb.id}/pack_diff",
                        body={"name": name + "x", "trajectory_id": t, "step": 1}), pd, "POST")
    rec = "/v1/trajectories/{trajectory_id}/recover"
    conforms(server.raw("POST", f"/v1/trajectories/{t}/recover", body={}), rec, "POST")
    conforms(server.raw("POST", f"/v1/trajectories/{t}/recover", body={"force": 1}), rec, "POST")
    conforms(server.raw("POST", f"/v1/trajectories/{unique('no')}/recover", body={}), rec,
             "POST")
    sb.destroy()
    doc = conforms(server.raw("POST", f"/v1/trajectories/{t}/recover", body={}), rec, "POST")
    server.created.add(doc["sandbox"]["id"])
    make_sandbox.sandboxes.append(server.client.sandbox(doc["sandbox"]["id"]))
    assert doc["checkpoint_step"] == 1 and doc["reexecuted_steps"] == 0
    server.client.delete_trajectory(t)


def test_image_and_blob_answers_conform(server, busybox):
    conforms(server.raw("GET", "/v1/health", token=None), "/v1/health", "GET")
    conforms(server.raw("GET", "/v1/images"), "/v1/images", "GET")
    img = conforms(server.raw("GET", f"/v1/images/{busybox}"), "/v1/images/{ref}", "GET")
    data = os.urandom(1000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob = "/v1/blobs/{digest}"
    put = conforms(server.raw("PUT", f"/v1/blobs/{digest}", body=data,
                              headers={"Content-Type": "application/octet-stream"}), blob, "PUT")
    assert put == {"digest": digest, "size": 1000}
    assert server.raw("HEAD", f"/v1/blobs/{digest}")[0] == 200
    assert server.raw("HEAD", "/v1/blobs/sha256:" + "2" * 64)[0] == 404
    name = unique("ct")
    new = conforms(server.raw("POST", "/v1/images",
                              body={"name": name, "tag": "t", "layers": img["layers"]}),
                   "/v1/images", "POST")
    assert new["ref"] == f"{name}:t"
    conforms(server.raw("DELETE", f"/v1/images/{name}:t"), "/v1/images/{ref}", "DELETE")


def test_validator_catches_violations():
    sandbox = SPEC["components"]["schemas"]["Sandbox"]
    errs = check({"id": "x", "state": "weird", "cpu": "1", "expires_at": None}, sandbox)
    text = "; ".join(errs)
    assert "missing layers" in text and "'weird' not in" in text
    assert "does not match" in text and "'1' is not number" in text
    assert "expires_at" not in text  # nullable
    assert check({"error": {"code": "not_found", "message": "m"}},
                 SPEC["components"]["schemas"]["Error"]) == []
    assert check({"error": {"code": "nope", "message": 1}}, SPEC["components"]["schemas"]["Error"])


def test_head_answers_carry_no_body(server):
    """RFC 9110 §9.3.2: a HEAD answer has headers only. A body desynchronises
    kept-alive connections (the next answer starts with stray bytes)."""
    import socket
    import urllib.parse
    data = os.urandom(64)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert server.client.upload_blob(data) == digest
    u = urllib.parse.urlsplit(server.url)
    tok = server.client.token
    for target in (digest, "sha256:" + "3" * 64):
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall((f"HEAD /v1/blobs/{target} HTTP/1.1\r\nHost: t\r\n"
                       f"Authorization: Bearer {tok}\r\n\r\n"
                       "GET /v1/health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                      .encode())
            buf = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        head, sep, rest = buf.partition(b"\r\n\r\n")
        assert sep and head.split(b" ")[1] in (b"200", b"404"), buf[:200]
        assert rest.startswith(b"HTTP/1.1 "), (
            f"HEAD /v1/blobs/{target[:20]}… answered with a body: {rest[:120]!r}")


def test_node_and_metrics_answers_conform(server, busybox, make_sandbox):
    make_sandbox(busybox)
    node = conforms(server.raw("GET", "/v1/node"), "/v1/node", "GET")
    assert node["loader"] == "direct" and node["blob_store"].startswith("file://")
    assert node["loader_pids"] == []
    status, headers, data, _ = server.raw("GET", "/v1/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b"# TYPE dsec_node_cache_bytes gauge" in data
    conforms(server.raw("GET", "/v1/node", token=None), "/v1/node", "GET")


def test_run_answers_conform(server, debian):
    r = server.raw("POST", "/v1/run", body={"code": "print(1)", "image": debian})
    doc = conforms(r, "/v1/run", "POST")
    assert doc["stdout"] == "1\n" and doc["limit"] is None
    conforms(server.raw("POST", "/v1/run", body={"code": "1", "language": "cobol"}),
             "/v1/run", "POST")
    conforms(server.raw("POST", "/v1/run", body={"code": "#" * (300 << 10)}), "/v1/run", "POST")
    r = server.raw("POST", "/v1/sandboxes", body={"image": debian, "backend": "fncall"})
    sb = conforms(r, "/v1/sandboxes", "POST")
    server.created.add(sb["id"])
    try:
        r = server.raw("POST", f"/v1/sandboxes/{sb['id']}/run",
                       body={"code": "while True: pass", "timeout_s": 0.5})
        assert conforms(r, "/v1/sandboxes/{id}/run", "POST")["limit"] == "timeout"
        r = server.raw("POST", f"/v1/sandboxes/{sb['id']}/exec", body={"cmd": "true"})
        assert conforms(r, "/v1/sandboxes/{id}/exec", "POST")["limit"] is None
    finally:
        server.raw("DELETE", f"/v1/sandboxes/{sb['id']}")


def test_tenant_and_key_answers_conform(server, busybox):
    tid = "c-" + unique().lower()[:12]
    t = conforms(server.raw("POST", "/v1/tenants",
                            body={"id": tid, "quota": {"max_sandboxes": 1, "creates_per_s": 5}}),
                 "/v1/tenants", "POST")
    assert t["id"] == tid and t["role"] == "user" and t["usage"]["sandboxes"] == 0
    try:
        conforms(server.raw("POST", "/v1/tenants", body={"id": tid}), "/v1/tenants", "POST")
        conforms(server.raw("POST", "/v1/tenants", body={"id": "Bad!"}), "/v1/tenants", "POST")
        lst = conforms(server.raw("GET", "/v1/tenants"), "/v1/tenants", "GET")
        assert tid in [x["id"] for x in lst["tenants"]]
        one = "/v1/tenants/{id}"
        conforms(server.raw("GET", f"/v1/tenants/{tid}"), one, "GET")
        conforms(server.raw("GET", "/v1/tenants/nope-x"), one, "GET")
        conforms(server.raw("PATCH", f"/v1/tenants/{tid}", body={"quota": {"max_cpu": 2}}),
                 one, "PATCH")
        conforms(server.raw("PATCH", f"/v1/tenants/{tid}", body={"quota": {"max_cpu": -2}}),
                 one, "PATCH")
        keys = "/v1/tenants/{id}/keys"
        k = conforms(server.raw("POST", f"/v1/tenants/{tid}/keys", body={"name": "c"}), keys,
                     "POST")
        conforms(server.raw("GET", f"/v1/tenants/{tid}/keys"), keys, "GET")
        me = conforms(server.raw("GET", "/v1/whoami", token=k["key"]), "/v1/whoami", "GET")
        assert me["tenant"] == tid and me["key_id"] == k["id"]
        conforms(server.raw("GET", "/v1/whoami"), "/v1/whoami", "GET")
        # A user's answers: 403 on admin routes, quotas on create.
        conforms(server.raw("GET", "/v1/tenants", token=k["key"]), "/v1/tenants", "GET")
        conforms(server.raw("GET", "/v1/layers", token=k["key"]), "/v1/layers", "GET")
        sb = conforms(server.raw("POST", "/v1/sandboxes", body={"image": busybox},
                                 token=k["key"]), "/v1/sandboxes", "POST")
        assert sb["owner"] == tid
        conforms(server.raw("POST", "/v1/sandboxes", body={"image": busybox}, token=k["key"]),
                 "/v1/sandboxes", "POST")
        conforms(server.raw("DELETE", f"/v1/tenants/{tid}"), one, "DELETE")  # 409: live
        conforms(server.raw("DELETE", f"/v1/sandboxes/{sb['id']}"), "/v1/sandboxes/{id}",
                 "DELETE")
        one_key = "/v1/tenants/{id}/keys/{key_id}"
        r = conforms(server.raw("DELETE", f"/v1/tenants/{tid}/keys/{k['id']}"), one_key, "DELETE")
        assert r["revoked_at"] is not None
        conforms(server.raw("DELETE", f"/v1/tenants/{tid}/keys/000000000000"), one_key, "DELETE")
        conforms(server.raw("GET", "/v1/whoami", token=k["key"]), "/v1/whoami", "GET")
    finally:
        conforms(server.raw("DELETE", f"/v1/tenants/{tid}"), "/v1/tenants/{id}", "DELETE")
