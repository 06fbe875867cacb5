"""Unit tests of the SDK's client logic against a tiny in-process HTTP fake.

This is the only place a fake server is used: it checks what the SDK sends and
how it reads answers (error mapping, NDJSON streaming, keep-alive and
reconnects, uploads), not the behaviour of dsec itself. No root needed.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import http.server
import io
import json
import os
import socket
import threading
import time
import urllib.parse

import pytest

import dsec
from dsec.client import _iter_ndjson
from sdk_flavors import FLAVORS


class FakeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self):
        srv = self.server
        body = b"" if self.command in ("GET", "HEAD") and "Content-Length" not in self.headers \
            and "Transfer-Encoding" not in self.headers else self._body()
        u = urllib.parse.urlsplit(self.path)
        req = {"method": self.command, "path": u.path,
               "query": urllib.parse.parse_qsl(u.query, keep_blank_values=True),
               "headers": dict(self.headers), "body": body,
               "peer": self.client_address, "conn": id(self.connection)}
        srv.requests.append(req)
        route = srv.routes.get((self.command, u.path)) or srv.routes.get(("*", "*"))
        if route is None:
            return self.send_json(404, {"error": {"code": "not_found", "message": "no route"}})
        route(self, req)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

    def send_json(self, status, doc, close=False, headers=None):
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        if close:  # drop the connection without announcing it (idle timeout)
            self.wfile.flush()
            self.close_connection = True

    def send_raw(self, status, data: bytes, ctype="application/octet-stream"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_chunked(self, status=200, ctype="application/x-ndjson"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_chunks(self):
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class Fake(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port=0):
        super().__init__(("127.0.0.1", port), FakeHandler)
        self.routes = {}
        self.requests = []
        self.accepted = 0

    def get_request(self):
        r = super().get_request()
        self.accepted += 1
        return r

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def route(self, method, path):
        def deco(fn):
            self.routes[(method, path)] = fn
            return fn
        return deco


@pytest.fixture
def fake():
    srv = Fake()
    t = threading.Thread(target=srv.serve_forever, args=(0.02,), daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(params=FLAVORS, ids=str)
def flavor(request):
    """Each test taking it (or ``cl``) runs with dsec.Client and with
    dsec.AsyncClient (behind the synchronous facade of sdk_flavors.py)."""
    return request.param


@pytest.fixture
def cl(fake, flavor):
    c = flavor.Client(fake.url, token="tok123", timeout=5)
    yield c
    c.close()


@pytest.fixture
def scl(fake):
    """The sync client only (thread and write-level checks)."""
    c = dsec.Client(fake.url, token="tok123", timeout=5)
    yield c
    c.close()


SB = {"id": "sb-00000000000000aa", "backend": "container", "image": "busybox:latest",
      "state": "running", "labels": {"a": "b"}, "memory_mb": 512}


# ----- errors -------------------------------------------------------------------

@pytest.mark.parametrize("code,status,cls", [
    ("invalid_argument", 400, dsec.InvalidArgument),
    ("unauthenticated", 401, dsec.Unauthenticated),
    ("permission_denied", 403, dsec.PermissionDenied),
    ("not_found", 404, dsec.NotFound),
    ("already_exists", 409, dsec.Conflict),
    ("conflict", 409, dsec.Conflict),
    ("failed_precondition", 409, dsec.Conflict),
    ("payload_too_large", 413, dsec.PayloadTooLarge),
    ("resource_exhausted", 429, dsec.ResourceExhausted),
    ("quota_exceeded", 403, dsec.QuotaExceeded),
    ("rate_limited", 429, dsec.RateLimited),
    ("internal", 500, dsec.InternalError),
    ("unavailable", 503, dsec.Unavailable),
    ("deadline_exceeded", 504, dsec.DeadlineExceeded),
])
def test_error_code_maps_to_exception(fake, cl, code, status, cls):
    @fake.route("GET", "/v1/sandboxes/sb-x")
    def _(h, req):
        h.send_json(status, {"error": {"code": code, "message": "boom", "field": "memory_mb"}})

    with pytest.raises(cls) as ei:
        cl.get("sb-x")
    e = ei.value
    assert isinstance(e, dsec.DsecError)
    assert (e.code, e.message, e.status, e.field) == (code, "boom", status, "memory_mb")
    # the connection stays usable after an error answer
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
    assert cl.health()["status"] == "ok"
    assert fake.accepted == 1


def test_error_without_json_body_maps_by_status():
    e = dsec.error_from_response(404, b"<html>nope</html>", "Not Found")
    assert type(e) is dsec.NotFound and e.code == "not_found" and e.field is None
    assert "nope" in e.message
    e = dsec.error_from_response(502, b"", "Bad Gateway")
    assert type(e) is dsec.InternalError and e.status == 502
    e = dsec.error_from_response(418, b"{}", "teapot")
    assert type(e) is dsec.InvalidArgument
    # unknown code but known status: class by status, code kept
    e = dsec.error_from_response(409, json.dumps({"error": {"code": "aborted2",
                                                            "message": "m"}}).encode())
    assert type(e) is dsec.Conflict and e.code == "aborted2"


def test_error_without_field_has_none(fake, cl):
    fake.routes[("GET", "/v1/images/busybox:latest")] = lambda h, r: h.send_json(
        404, {"error": {"code": "not_found", "message": "no image"}})
    with pytest.raises(dsec.NotFound) as ei:
        cl.image("busybox:latest")
    assert ei.value.field is None


def test_connection_refused_is_unavailable(flavor):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(dsec.Unavailable) as ei:
        flavor.Client(f"http://127.0.0.1:{port}", token="t", timeout=2, retries=0).health()
    assert ei.value.status is None


def test_slow_server_is_deadline_exceeded(fake, flavor):
    fake.routes[("GET", "/v1/health")] = lambda h, r: (time.sleep(1.5),
                                                       h.send_json(200, {"status": "ok"}))
    c = flavor.Client(fake.url, token="t", timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(dsec.DeadlineExceeded):
        c.health()
    assert time.monotonic() - t0 < 1.2


# ----- requests the SDK builds ---------------------------------------------------

def test_auth_header_and_create_body(fake, cl):
    fake.routes[("POST", "/v1/sandboxes")] = lambda h, r: h.send_json(201, SB)
    sb = cl.create("busybox:latest", memory_mb=128, labels={"k": "v"}, env={"A": "1"})
    req = fake.requests[-1]
    assert req["headers"]["Authorization"] == "Bearer tok123"
    assert req["headers"]["Content-Type"] == "application/json"
    assert json.loads(req["body"]) == {"image": "busybox:latest", "backend": "container",
                                       "memory_mb": 128, "labels": {"k": "v"},
                                       "env": {"A": "1"}}
    assert (sb.id, sb.state, sb.backend, sb.image, sb.labels) == (
        SB["id"], "running", "container", "busybox:latest", {"a": "b"})
    assert sb.memory_mb == 512 and sb.info == SB


def test_create_user_and_sandbox_user(fake, cl):
    answer = dict(SB, user="1000", working_dir="/work")
    fake.routes[("POST", "/v1/sandboxes")] = lambda h, r: h.send_json(201, answer)
    sb = cl.create("app:1", user=1000)
    assert json.loads(fake.requests[-1]["body"]) == {"image": "app:1", "backend": "container",
                                                     "user": "1000"}
    assert (sb.user, sb.working_dir) == ("1000", "/work")
    cl.create("app:1")
    assert "user" not in json.loads(fake.requests[-1]["body"])


def test_no_token_sends_no_auth_header(fake, flavor, monkeypatch, tmp_path):
    monkeypatch.delenv("DSEC_TOKEN", raising=False)
    monkeypatch.setenv("DSEC_DATA_DIR", str(tmp_path))  # holds no token file
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
    flavor.Client(fake.url).health()
    assert "Authorization" not in fake.requests[-1]["headers"]


def test_env_defaults_and_from_data_dir(fake, flavor, monkeypatch, tmp_path):
    monkeypatch.setenv("DSEC_URL", fake.url)
    monkeypatch.setenv("DSEC_TOKEN", "envtok")
    c = flavor.Client()
    assert c.url == fake.url and c.token == "envtok"
    monkeypatch.delenv("DSEC_URL")
    monkeypatch.delenv("DSEC_TOKEN")
    monkeypatch.setenv("DSEC_DATA_DIR", str(tmp_path))
    (tmp_path / "token").write_text("filetok\n")
    c = flavor.Client()
    assert c.url == "http://127.0.0.1:7070" and c.token == "filetok"
    (tmp_path / "up.json").write_text(json.dumps({"url": fake.url, "pid": 4242}))
    c = flavor.from_data_dir(str(tmp_path))
    assert (c.url, c.token, c.server_pid) == (fake.url, "filetok", 4242)
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
    assert c.health() == {"status": "ok"}
    assert fake.requests[-1]["headers"]["Authorization"] == "Bearer filetok"


def test_list_label_and_state_query(fake, cl):
    fake.routes[("GET", "/v1/sandboxes")] = lambda h, r: h.send_json(200, {"sandboxes": [SB]})
    out = cl.list(labels={"job": "a=b", "x": "y z"}, state="running")
    assert [s.id for s in out] == [SB["id"]]
    assert fake.requests[-1]["query"] == [("label", "job=a=b"), ("label", "x=y z"),
                                          ("state", "running")]


def test_exec_body_and_result(fake, cl):
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = lambda h, r: h.send_json(200, {
        "exit_code": 3, "signal": 0, "stdout": "out\n", "stderr": "err", "truncated": False,
        "timed_out": False, "oom_killed": False, "duration_ms": 12.5})
    sb = cl.sandbox("sb-1")
    r = sb.exec(["ls", "-l"], timeout=5, env={"K": "V"}, cwd="/tmp", user=65534,
                stdin=b"\x00\xff", max_output_bytes=100)
    body = json.loads(fake.requests[-1]["body"])
    assert body == {"cmd": ["ls", "-l"], "env": {"K": "V"}, "cwd": "/tmp", "user": "65534",
                    "timeout_s": 5, "stdin_b64": base64.b64encode(b"\x00\xff").decode(),
                    "max_output_bytes": 100}
    assert (r.exit_code, r.signal, r.stdout, r.stderr, r.ok) == (3, 0, "out\n", "err", False)
    assert r.duration_ms == 12.5 and abs(r.duration - 0.0125) < 1e-9
    sb.exec("echo $HOME", stdin="text")
    assert json.loads(fake.requests[-1]["body"]) == {"cmd": "echo $HOME", "stdin": "text"}


def test_a_small_body_goes_out_with_its_headers(fake, scl, monkeypatch):
    # One write per small request (one segment: the server wakes once), the
    # body intact; a body over 64 KiB still goes separately.
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = lambda h, r: h.send_json(200, {
        "exit_code": 0, "stdout": "", "stderr": ""})
    writes = []
    real = dsec.client._Conn.send

    def send(self, data):
        writes.append(len(data) if isinstance(data, (bytes, bytearray)) else -1)
        return real(self, data)

    monkeypatch.setattr(dsec.client._Conn, "send", send)
    sb = scl.sandbox("sb-1")
    sb.exec(["echo", "ü"])
    assert len(writes) == 1, writes
    assert json.loads(fake.requests[-1]["body"]) == {"cmd": ["echo", "ü"]}
    writes.clear()
    big = "x" * (70 * 1024)
    sb.exec(["echo"], stdin=big)
    assert len(writes) == 2, writes
    assert json.loads(fake.requests[-1]["body"])["stdin"] == big


def test_exec_base64_output(fake, cl):
    raw = bytes(range(256))
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = lambda h, r: h.send_json(200, {
        "exit_code": 0, "signal": 0, "stdout": base64.b64encode(raw).decode(),
        "stderr": "", "truncated": False, "timed_out": False, "oom_killed": False,
        "duration_ms": 1})
    r = cl.sandbox("sb-1").exec(["cat"], encoding="base64")
    assert json.loads(fake.requests[-1]["body"])["encoding"] == "base64"
    assert r.stdout_bytes == raw and r.stderr_bytes == b"" and r.ok
    assert isinstance(r.stdout, str)


def test_file_calls(fake, cl):
    got = {}

    def put(h, req):
        got["put"] = req
        h.send_json(200, {"path": "/a b", "size": len(req["body"])})

    fake.routes[("PUT", "/v1/sandboxes/sb-1/files")] = put
    fake.routes[("GET", "/v1/sandboxes/sb-1/files")] = lambda h, r: h.send_raw(200, b"\x00data")
    fake.routes[("GET", "/v1/sandboxes/sb-1/files/list")] = lambda h, r: h.send_json(200, {
        "entries": [{"name": "x", "type": "dir", "size": 0, "mode": 493}]})
    fake.routes[("GET", "/v1/sandboxes/sb-1/files/stat")] = lambda h, r: h.send_json(200, {
        "name": "x", "path": "/x", "type": "file", "size": 3, "mode": 420})
    fake.routes[("POST", "/v1/sandboxes/sb-1/files/mkdir")] = lambda h, r: h.send_json(200, {})
    fake.routes[("DELETE", "/v1/sandboxes/sb-1/files")] = lambda h, r: h.send_json(200, {})
    sb = cl.sandbox("sb-1")

    assert sb.write_file("/a b", "héllo", mode=0o600)["size"] == len("héllo".encode())
    req = got["put"]
    assert req["query"] == [("path", "/a b"), ("mode", "0600")]
    assert req["body"] == "héllo".encode()
    assert req["headers"]["Content-Length"] == str(len(req["body"]))

    payload = os.urandom(300_000)
    sb.write_file("/f", io.BytesIO(payload))  # seekable: sent with a length
    assert got["put"]["body"] == payload
    assert got["put"]["headers"]["Content-Length"] == str(len(payload))

    sb.write_file("/g", (payload[i:i + 70_000] for i in range(0, len(payload), 70_000)))
    assert got["put"]["body"] == payload  # an iterable goes out chunked
    assert got["put"]["headers"].get("Transfer-Encoding") == "chunked"

    assert sb.read_file("/x") == b"\x00data"
    assert fake.requests[-1]["query"] == [("path", "/x")]
    buf = io.BytesIO()
    assert sb.read_file_to("/x", buf) == 5 and buf.getvalue() == b"\x00data"

    ents = sb.list_dir("/")
    assert ents[0].name == "x" and ents[0]["type"] == "dir" and ents[0].is_dir
    st = sb.stat("/x")
    assert st.size == 3 and st.mode == 0o644 and st.is_file
    sb.mkdir("/d/e", parents=True, mode=0o700)
    assert json.loads(fake.requests[-1]["body"]) == {"path": "/d/e", "parents": True,
                                                     "mode": 0o700}
    sb.remove("/d", recursive=True)
    assert fake.requests[-1]["query"] == [("path", "/d"), ("recursive", "true")]
    # everything above went over one kept-alive connection
    assert fake.accepted == 1


def test_upload_blob_hashes_then_streams(fake, cl, tmp_path):
    data = os.urandom(1_000_003)
    p = tmp_path / "layer.erofs"
    p.write_bytes(data)
    hexd = hashlib.sha256(data).hexdigest()
    fake.routes[("*", "*")] = lambda h, r: h.send_json(
        201, {"digest": "sha256:" + hexd, "size": len(r["body"])})
    assert cl.upload_blob(str(p)) == "sha256:" + hexd
    req = fake.requests[-1]
    assert (req["method"], req["path"]) == ("PUT", "/v1/blobs/sha256:" + hexd)
    assert req["headers"]["Content-Length"] == str(len(data))
    assert req["body"] == data
    assert cl.upload_blob(b"abc") == "sha256:" + hashlib.sha256(b"abc").hexdigest()


def test_has_blob_and_images(fake, cl):
    img = {"name": "deb", "tag": "v1", "ref": "deb:v1", "layers": ["sha256:aa"], "size": 1}
    fake.routes[("HEAD", "/v1/blobs/sha256:aa")] = lambda h, r: h.send_json(200, {})
    fake.routes[("POST", "/v1/images")] = lambda h, r: h.send_json(201, img)
    fake.routes[("GET", "/v1/images")] = lambda h, r: h.send_json(200, {"images": [img]})
    fake.routes[("DELETE", "/v1/images/deb:v1")] = lambda h, r: h.send_json(200, {})
    assert cl.has_blob("sha256:aa") is True
    assert cl.has_blob("sha256:bb") is False
    im = cl.create_image("deb", "v1", ["sha256:aa"])
    assert json.loads(fake.requests[-1]["body"]) == {"name": "deb", "tag": "v1",
                                                     "layers": ["sha256:aa"], "kind": "base"}
    assert im.ref == "deb:v1" and im.layers == ["sha256:aa"]
    # an answer without config (an older server) reads as an empty one
    assert im.config == {"user": "", "env": [], "working_dir": ""}
    cfg = {"user": "app", "env": ["A=1"], "working_dir": "/w"}
    cl.create_image("deb", "v1", ["sha256:aa"], config=cfg)
    assert json.loads(fake.requests[-1]["body"])["config"] == cfg
    assert dsec.Image(dict(img, config=cfg)).config == cfg
    assert [i.ref for i in cl.images()] == ["deb:v1"]
    cl.delete_image("deb:v1")
    assert fake.requests[-1]["path"] == "/v1/images/deb:v1"


def test_sandbox_context_manager_destroys(fake, cl):
    fake.routes[("POST", "/v1/sandboxes")] = lambda h, r: h.send_json(201, SB)
    fake.routes[("DELETE", "/v1/sandboxes/" + SB["id"])] = lambda h, r: h.send_json(
        200, dict(SB, state="stopped"))
    with cl.create("busybox") as sb:
        pass
    assert fake.requests[-1]["method"] == "DELETE" and sb.state == "stopped"


# ----- NDJSON streaming ----------------------------------------------------------

def test_iter_ndjson_parses_lines_and_skips_blank():
    f = io.BytesIO(b'{"type":"stdout","data":"a"}\n\n{"type":"exit","exit_code":0}\n')
    assert [d["type"] for d in _iter_ndjson(f)] == ["stdout", "exit"]
    with pytest.raises(dsec.DsecError):
        list(_iter_ndjson(io.BytesIO(b'{"type":\n')))


def test_exec_stream_yields_events_as_they_arrive(fake, cl):
    gate = threading.Event()
    seen_before_gate = []

    def stream(h, req):
        h.start_chunked()
        h.chunk(b'{"type":"stdout","data":"1\\n"}\n')
        # the rest only once the client has seen the first event
        seen_before_gate.append(gate.wait(3))
        h.chunk(b'{"type":"stderr","data_b64":"' + base64.b64encode(b"\xffe") + b'"}\n'
                b'{"type":"stdout",')
        h.chunk(b'"data":"2\\n"}\n{"type":"exit","exit_code":0,"signal":0,'
                b'"truncated":false,"timed_out":false,"oom_killed":false,"duration_ms":5}\n')
        h.end_chunks()

    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = stream
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
    events = []
    for ev in cl.sandbox("sb-1").exec_stream("for i in 1 2; do echo $i; done", timeout=10):
        events.append(ev)
        gate.set()
    assert seen_before_gate == [True]
    body = json.loads(fake.requests[-1]["body"])
    assert body["stream"] is True and body["timeout_s"] == 10
    assert fake.requests[-1]["headers"]["Accept"] == "application/x-ndjson"
    assert [e.type for e in events] == ["stdout", "stderr", "stdout", "exit"]
    assert events[0].data == "1\n" and events[0]["data"] == "1\n"
    assert events[1].data_bytes == b"\xffe"
    assert events[3].result.exit_code == 0 and events[3].exit_code == 0
    assert events[3].result.duration_ms == 5
    cl.health()  # the connection is reusable after a complete stream
    assert fake.accepted == 1


def test_exec_stream_error_event(fake, cl):
    def stream(h, req):
        h.start_chunked()
        h.chunk(b'{"type":"error","error":{"code":"unavailable","message":"agent died"}}\n')
        h.end_chunks()

    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = stream
    evs = list(cl.sandbox("sb-1").exec_stream(["true"]))
    assert [e.type for e in evs] == ["error"]
    assert isinstance(evs[0].error, dsec.Unavailable) and evs[0].error.message == "agent died"


def test_exec_stream_without_exit_event_raises(fake, cl):
    def stream(h, req):
        h.start_chunked()
        h.chunk(b'{"type":"stdout","data":"x"}\n')
        h.end_chunks()

    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = stream
    with pytest.raises(dsec.Unavailable):
        list(cl.sandbox("sb-1").exec_stream(["true"]))


def test_exec_stream_http_error_raises_before_events(fake, cl):
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = lambda h, r: h.send_json(
        409, {"error": {"code": "failed_precondition", "message": "stopped"}})
    with pytest.raises(dsec.Conflict):
        next(iter(cl.sandbox("sb-1").exec_stream(["true"])))


def test_exec_stream_closed_early_drops_connection(fake, cl):
    def stream(h, req):
        h.start_chunked()
        try:
            for i in range(50):
                h.chunk(b'{"type":"stdout","data":"%d\\n"}\n' % i)
                time.sleep(0.01)
            h.chunk(b'{"type":"exit","exit_code":0}\n')
            h.end_chunks()
        except OSError:
            pass

    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = stream
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
    gen = cl.sandbox("sb-1").exec_stream(["yes"])
    assert next(gen).data == "0\n"
    gen.close()
    assert cl.health()["status"] == "ok"  # a new connection, not a desynchronised one
    assert fake.accepted == 2


# ----- keep-alive and reconnects -------------------------------------------------

def test_keepalive_one_connection_per_thread(fake, scl):
    cl = scl
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
    for _ in range(5):
        cl.health()
    assert fake.accepted == 1

    conns = {}

    def worker(i):
        for _ in range(4):
            cl.health()
        conns[i] = True

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(conns) == 4
    assert fake.accepted == 1 + 4
    per_conn = {}
    for r in fake.requests:
        per_conn[r["conn"]] = per_conn.get(r["conn"], 0) + 1
    assert sorted(per_conn.values()) == [4, 4, 4, 4, 5]


def test_reconnects_after_server_closed_idle_connection(fake, cl):
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"},
                                                                  close=True)
    assert cl.health()["status"] == "ok"
    time.sleep(0.1)  # the server has closed the idle connection by now
    assert cl.health()["status"] == "ok"
    # also with a body that cannot be sent twice (the dead socket is noticed first)
    fake.routes[("PUT", "/v1/sandboxes/sb-1/files")] = lambda h, r: h.send_json(
        200, {"path": "/x", "size": len(r["body"])}, close=True)
    time.sleep(0.1)
    assert cl.sandbox("sb-1").write_file("/x", iter([b"ab", b"cd"]))["size"] == 4
    assert fake.accepted == 3


class _RawServer:
    """A loopback HTTP server on a bare socket, for answers http.server will
    not give: each connection goes to ``_serve(conn, f)`` (``f`` reads it)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def _read_request(f):
        """The next request's body, or None at the connection's end."""
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            c = f.read(1)
            if not c:
                return None
            head += c
        hdrs = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if line)
        body = b""
        if "Content-Length" in hdrs:
            body = f.read(int(hdrs["Content-Length"]))
        elif hdrs.get("Transfer-Encoding") == "chunked":
            while True:
                n = int(f.readline().strip(), 16)
                body += f.read(n)
                f.readline()
                if n == 0:
                    break
        return body

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            f = conn.makefile("rb")
            self._serve(conn, f)
            f.close()
            conn.close()


class _DropOnce(_RawServer):
    """Serves the first request, then reads the next one and closes without an
    answer (the race where the server's idle close crosses our request)."""

    def __init__(self):
        self.bodies = []
        super().__init__()

    def _answer(self, conn, body):
        data = json.dumps({"path": "/x", "size": len(body)}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))

    def _serve(self, conn, f):
        first = self.accepted == 1
        while True:
            body = self._read_request(f)
            if body is None:
                break
            self.bodies.append(body)
            if first and len(self.bodies) == 2:
                break  # drop it unanswered
            self._answer(conn, body)
        conn.shutdown(socket.SHUT_RDWR)


def test_retries_once_a_resendable_request_on_a_dead_connection(flavor):
    srv = _DropOnce()
    c = flavor.Client(srv.url, token="t", timeout=5)
    sb = c.sandbox("sb-1")
    assert sb.write_file("/x", b"first")["size"] == 5
    assert sb.write_file("/x", b"second!")["size"] == 7  # dropped, then resent
    assert srv.bodies == [b"first", b"second!", b"second!"]
    assert srv.accepted == 2


def test_does_not_resend_a_streamed_body(flavor):
    srv = _DropOnce()
    c = flavor.Client(srv.url, token="t", timeout=5)
    sb = c.sandbox("sb-1")
    sb.write_file("/x", b"first")
    with pytest.raises(dsec.Unavailable):
        sb.write_file("/x", (b for b in [b"one", b"shot"]))
    assert srv.accepted == 1


# ----- the SDK's own response framing (small JSON exchanges) ----------------------

RUN_RESULT = {"exit_code": 0, "signal": 0, "stdout": "1\n", "stderr": "", "duration_ms": 1.5,
              "timed_out": False, "truncated": False, "limit": None}


def test_run_reads_a_chunked_answer_and_keeps_the_connection(fake, cl):
    def chunked(h, r):
        data = json.dumps(RUN_RESULT).encode()
        h.start_chunked(200, "application/json")
        h.chunk(data[:7])
        h.chunk(data[7:])
        h.end_chunks()
    fake.routes[("POST", "/v1/run")] = chunked
    for _ in range(3):
        r = cl.run("print(1)")
        assert (r.exit_code, r.stdout) == (0, "1\n")
    assert fake.accepted == 1
    assert json.loads(fake.requests[-1]["body"])["code"] == "print(1)"
    assert fake.requests[-1]["headers"]["Authorization"] == "Bearer tok123"
    assert fake.requests[-1]["headers"]["Content-Type"] == "application/json"


def test_run_reads_an_answer_framed_by_the_connections_end(fake, cl):
    def to_eof(h, r):
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(json.dumps(RUN_RESULT).encode())
        h.close_connection = True
    fake.routes[("POST", "/v1/run")] = to_eof
    assert cl.run("print(1)").stdout == "1\n"
    assert cl.run("print(1)").stdout == "1\n"  # on a new connection
    assert fake.accepted == 2


class _RawAnswer(_RawServer):
    """Answers every request on a connection with the given raw bytes (and
    then closes it, with ``close``)."""

    def __init__(self, answer: bytes, close: bool = False):
        self.answer = answer
        self.close = close
        super().__init__()

    def _serve(self, conn, f):
        while self._read_request(f) is not None:
            conn.sendall(self.answer)
            if self.close:
                break


def test_run_skips_an_interim_answer(flavor):
    data = json.dumps(RUN_RESULT).encode()
    srv = _RawAnswer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(data), data))
    c = flavor.Client(srv.url, token="t", timeout=5)
    assert c.run("print(1)").stdout == "1\n"
    assert c.run("print(1)").stdout == "1\n"


@pytest.mark.parametrize("answer", [
    b"SPDY/3 200 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"short\":",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\"",
])
def test_a_malformed_or_cut_answer_is_unavailable(flavor, answer):
    srv = _RawAnswer(answer, close=True)
    c = flavor.Client(srv.url, token="t", timeout=2)
    with pytest.raises(dsec.Unavailable):
        c.run("print(1)")


def test_an_error_status_from_the_lean_path_keeps_code_and_field(fake, cl):
    fake.routes[("POST", "/v1/run")] = lambda h, r: h.send_json(
        400, {"error": {"code": "invalid_argument", "message": "unknown language 'cobol'",
                        "field": "language"}})
    with pytest.raises(dsec.InvalidArgument) as e:
        cl.run("x", language="cobol")
    assert (e.value.status, e.value.field) == (400, "language")
    fake.routes[("POST", "/v1/run")] = lambda h, r: h.send_json(200, RUN_RESULT)
    assert cl.run("print(1)").exit_code == 0
    assert fake.accepted == 1  # an error answer leaves the connection usable


# ----- the async client's surface -------------------------------------------------

@pytest.mark.parametrize("sync_cls,async_cls", [
    (dsec.Client, dsec.AsyncClient), (dsec.Sandbox, dsec.AsyncSandbox),
    (dsec.Batch, dsec.AsyncBatch), (dsec.Trajectory, dsec.AsyncTrajectory)])
def test_the_async_classes_have_the_whole_sync_surface(sync_cls, async_cls):
    import inspect
    public = {n for n in dir(sync_cls) if not n.startswith("_")}
    assert public - {"close"} <= set(dir(async_cls))
    for name in public - {"close"}:
        s, a = getattr(sync_cls, name), getattr(async_cls, name)
        if not callable(s) or isinstance(s, type):
            continue
        if name in ("sandbox", "trajectory", "from_data_dir"):
            assert not inspect.iscoroutinefunction(a), name
        elif name == "exec_stream":
            pass  # returns an async generator: test_async_exec_stream_and_async_bodies
        elif sync_cls is not dsec.Trajectory and name not in ("set_quota", "sandboxes"):
            assert inspect.iscoroutinefunction(a), name
        assert inspect.signature(s) == inspect.signature(a), name
        assert s.__doc__ == a.__doc__, name
    assert inspect.iscoroutinefunction(dsec.AsyncClient.aclose)


def test_retry_policy_values():
    assert dsec.DEFAULT_RETRY == dsec.Retry()
    assert dsec.Client("http://x", token="t").retries == dsec.AsyncClient("http://x").retries
    assert dsec.Client("http://x", retries=None).retries.max_attempts == 1
    assert dsec.Client("http://x", retries=0).retries.max_attempts == 1
    assert dsec.AsyncClient("http://x", retries=2).retries.max_attempts == 3
    with pytest.raises(TypeError):
        dsec.Client("http://x", retries="often")
    with pytest.raises(ValueError):
        dsec.Retry(max_attempts=0)
    r = dsec.Retry(backoff=1, max_backoff=4)
    for n, cap in ((1, 1), (2, 2), (3, 4), (4, 4), (9, 4)):
        d = [r.delay(n) for _ in range(50)]
        assert all(cap / 2 <= x <= cap for x in d) and len(set(d)) > 1
    from dsec._core import parse_retry_after
    assert parse_retry_after("3") == 3 and parse_retry_after("0.5") == 0.5
    assert parse_retry_after("garbage") is None and parse_retry_after(None) is None
    import email.utils
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < parse_retry_after(later) <= 31


# ----- retries (both clients) ---------------------------------------------------

FAST = dsec.Retry(max_attempts=4, backoff=0.01, max_backoff=0.05, total=10)


def _scripted(fake, method, path, answers, ok=None):
    """A route answering ``answers`` in turn ((status, headers) pairs; 200
    sends ``ok``); returns the list of the times it was called."""
    times = []

    def route(h, r):
        times.append(time.monotonic())
        status, hdrs = answers[min(len(times), len(answers)) - 1]
        if status < 400:
            h.send_json(status, ok if ok is not None else {"status": "ok"}, headers=hdrs)
        else:
            h.send_json(status, {"error": {"code": "unavailable" if status == 503
                                           else "rate_limited", "message": "busy"}},
                        headers=hdrs)
    fake.routes[(method, path)] = route
    return times


def test_a_read_is_retried_on_503_and_429_honouring_retry_after(fake, flavor):
    times = _scripted(fake, "GET", "/v1/health",
                      [(503, {}), (429, {"Retry-After": "1"}), (503, {"Retry-After": "0"}),
                       (200, {})])
    c = flavor.Client(fake.url, token="t", timeout=5, retries=FAST)
    assert c.health() == {"status": "ok"}
    assert len(times) == 4
    assert times[1] - times[0] < 0.5          # FAST's backoff: at most 50 ms
    assert times[2] - times[1] >= 0.95        # Retry-After: 1, over FAST's cap
    assert fake.accepted == 1                 # error answers keep the connection


def test_retries_are_bounded_by_attempts_and_total_time(fake, flavor):
    times = _scripted(fake, "GET", "/v1/sandboxes/sb-1", [(503, {})])
    c = flavor.Client(fake.url, token="t", timeout=5,
                      retries=dsec.Retry(max_attempts=3, backoff=0.01))
    with pytest.raises(dsec.Unavailable) as ei:
        c.get("sb-1")
    assert ei.value.status == 503 and ei.value.message == "busy"
    assert len(times) == 3
    # a Retry-After past the total budget: raised at once, not waited for
    times = _scripted(fake, "GET", "/v1/sandboxes/sb-2", [(429, {"Retry-After": "30"})])
    c = flavor.Client(fake.url, token="t", timeout=5, retries=dsec.Retry(total=5))
    t0 = time.monotonic()
    with pytest.raises(dsec.RateLimited):
        c.get("sb-2")
    assert len(times) == 1 and time.monotonic() - t0 < 1
    # no retries at all
    times = _scripted(fake, "GET", "/v1/sandboxes/sb-3", [(503, {})])
    with pytest.raises(dsec.Unavailable):
        flavor.Client(fake.url, token="t", retries=None).get("sb-3")
    assert len(times) == 1


EXEC_OK = {"exit_code": 0, "stdout": "", "stderr": ""}


def test_only_calls_safe_to_repeat_are_retried(fake, flavor):
    c = flavor.Client(fake.url, token="t", timeout=5, retries=FAST)
    sb = c.sandbox("sb-1")
    busy = [(503, {}), (200, {})]
    # never repeated: creates, plain execs, runs, writes without a step, deletes
    for method, path, call in [
            ("POST", "/v1/sandboxes", lambda: c.create("busybox")),
            ("POST", "/v1/batches", lambda: c.create_batch(2, "busybox")),
            ("POST", "/v1/sandboxes/sb-1/exec", lambda: sb.exec(["true"])),
            ("POST", "/v1/run", lambda: c.run("print(1)")),
            ("POST", "/v1/sandboxes/sb-1/run", lambda: sb.run("print(1)")),
            ("PUT", "/v1/sandboxes/sb-1/files", lambda: sb.write_file("/x", b"x")),
            ("POST", "/v1/sandboxes/sb-1/files/mkdir", lambda: sb.mkdir("/d")),
            ("DELETE", "/v1/sandboxes/sb-1", lambda: sb.destroy()),
            ("POST", "/v1/sandboxes/sb-1/pause", lambda: sb.pause())]:
        times = _scripted(fake, method, path, busy)
        with pytest.raises(dsec.Unavailable):
            call()
        assert len(times) == 1, path
    # trajectory steps are: the server's log answers a repeat with the stored result
    for method, path, call in [
            ("POST", "/v1/sandboxes/sb-1/exec",
             lambda: sb.exec(["true"], trajectory_id="t1", step=0)),
            ("PUT", "/v1/sandboxes/sb-1/files",
             lambda: sb.write_file("/x", b"x", trajectory_id="t1", step=1)),
            ("POST", "/v1/sandboxes/sb-1/files/mkdir",
             lambda: sb.trajectory("t2").mkdir("/d")),
            ("DELETE", "/v1/sandboxes/sb-1/files",
             lambda: sb.trajectory("t3").remove("/d")),
            ("GET", "/v1/sandboxes/sb-1/files/list", lambda: sb.list_dir("/"))]:
        times = _scripted(fake, method, path, busy, ok=dict(EXEC_OK, entries=[]))
        call()
        assert len(times) == 2, path
    # ... unless the body cannot be sent twice
    times = _scripted(fake, "PUT", "/v1/sandboxes/sb-1/files", busy)
    with pytest.raises(dsec.Unavailable):
        sb.write_file("/x", iter([b"a", b"b"]), trajectory_id="t1", step=2)
    assert len(times) == 1
    # a seekable file is rewound for the repeat
    bodies = []

    def put(h, r):
        bodies.append(r["body"])
        if len(bodies) == 1:
            h.send_json(503, {"error": {"code": "unavailable", "message": "busy"}})
        else:
            h.send_json(200, {"path": "/x", "size": len(r["body"])})
    fake.routes[("PUT", "/v1/sandboxes/sb-1/files")] = put
    f = io.BytesIO(b"skip:payload")
    f.seek(5)
    assert sb.write_file("/x", f, trajectory_id="t1", step=3)["size"] == 7
    assert bodies == [b"payload", b"payload"]


class _ResetFirst(_RawServer):
    """Resets (RST) the first ``n`` connections after reading a request, then
    answers every request with a JSON object."""

    def __init__(self, n=1):
        self.n = n
        self.requests = 0
        super().__init__()

    def _serve(self, conn, f):
        import struct
        while self._read_request(f) is not None:
            self.requests += 1
            if self.accepted <= self.n:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            data = json.dumps(dict(SB, status="ok")).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


def test_a_reset_before_the_answer_is_retried_only_when_safe(flavor):
    srv = _ResetFirst(n=1)
    c = flavor.Client(srv.url, token="t", timeout=5, retries=FAST)
    assert c.get("sb-1").id == SB["id"]  # a read: sent again on a new connection
    assert (srv.accepted, srv.requests) == (2, 2)
    srv = _ResetFirst(n=1)
    c = flavor.Client(srv.url, token="t", timeout=5, retries=FAST)
    with pytest.raises(dsec.Unavailable) as ei:
        c.create("busybox")  # a create: never repeated
    assert ei.value.status is None
    assert (srv.accepted, srv.requests) == (1, 1)


def test_a_refused_read_is_retried_until_the_server_listens(flavor):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    late = {}

    def listen_later():
        time.sleep(0.4)
        srv = Fake(port)
        srv.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
        late["srv"] = srv
        srv.serve_forever(0.02)
    threading.Thread(target=listen_later, daemon=True).start()
    c = flavor.Client(f"http://127.0.0.1:{port}", token="t", timeout=5,
                      retries=dsec.Retry(max_attempts=20, backoff=0.05, max_backoff=0.1))
    try:
        assert c.health() == {"status": "ok"}
    finally:
        while "srv" not in late:
            time.sleep(0.05)
        late["srv"].shutdown()
        late["srv"].server_close()


# ----- timeouts (both clients) ----------------------------------------------------

def test_exec_timeout_extends_the_answer_deadline(fake, flavor):
    def slow(h, r):
        time.sleep(0.8)
        h.send_json(200, dict(EXEC_OK, stdout="late"))
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = slow
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
    c = flavor.Client(fake.url, token="t", timeout=0.3)
    sb = c.sandbox("sb-1")
    assert sb.exec(["sleep", "1"], timeout=1).stdout == "late"  # waits 1 + 0.3 s
    t0 = time.monotonic()
    with pytest.raises(dsec.DeadlineExceeded):
        sb.exec(["sleep", "1"], timeout=0.1)  # waits 0.1 + 0.3 s
    assert 0.35 < time.monotonic() - t0 < 0.75
    # the timed-out connection is not reused: the next answer is its own
    assert c.health() == {"status": "ok"}
    assert fake.accepted == 2
    # a plain exec that timed out is not repeated
    assert len([r for r in fake.requests if r["path"].endswith("/exec")]) == 2


def test_connect_timeout_bounds_connecting(flavor):
    # a listening socket whose backlog is full: connects hang
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    fillers = []
    for _ in range(8):
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(s.getsockname())
        fillers.append(f)
    c = flavor.Client(f"http://127.0.0.1:{s.getsockname()[1]}", token="t", timeout=10,
                      connect_timeout=0.3, retries=0)
    t0 = time.monotonic()
    with pytest.raises(dsec.DeadlineExceeded) as ei:
        c.health()
    assert time.monotonic() - t0 < 3
    assert ei.value.status is None
    for f in fillers:
        f.close()
    s.close()


# ----- the async client: pool, cancellation, async bodies --------------------------

def _wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


async def _until(pred, timeout=5.0):
    import asyncio
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def test_async_pool_is_bounded_and_the_next_call_waits(fake):
    import asyncio
    gate = threading.Event()

    def held(h, r):
        gate.wait(5)
        h.send_json(200, {"status": "ok"})
    fake.routes[("GET", "/v1/health")] = held

    async def main():
        c = dsec.AsyncClient(fake.url, token="t", max_connections=2)
        tasks = [asyncio.create_task(c.health()) for _ in range(3)]
        await _until(lambda: len(fake.requests) == 2)
        await asyncio.sleep(0.2)
        assert len(fake.requests) == 2 and c.connections == 2  # the third waits
        assert not any(t.done() for t in tasks)
        gate.set()
        assert await asyncio.gather(*tasks) == [{"status": "ok"}] * 3
        assert len(fake.requests) == 3 and fake.accepted == 2  # on a freed connection
        for _ in range(10):  # sequential calls reuse one kept-alive connection
            await c.health()
        assert fake.accepted == 2 and c.connections == 2
        await c.aclose()
        assert c.connections == 0
        await c.health()  # usable after aclose: reconnects
        assert fake.accepted == 3
        await c.aclose()
    asyncio.run(main())


def _wait_peer_close(h, seen):
    """In a fake route: blocks until the client closes the connection."""
    seen["request"] = True
    h.connection.settimeout(10)
    try:
        while h.connection.recv(1024):
            pass
    except OSError:
        pass
    seen["closed"] = True
    h.close_connection = True


def test_cancelling_an_async_exec_closes_its_connection(fake):
    import asyncio
    seen = {}
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = lambda h, r: _wait_peer_close(h, seen)
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})

    async def main():
        c = dsec.AsyncClient(fake.url, token="t", max_connections=1)
        await c.health()
        task = asyncio.create_task(c.sandbox("sb-1").exec("sleep 100", timeout=100))
        await _until(lambda: seen.get("request"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: seen.get("closed"))  # the server saw the client go away
        assert c.connections == 0  # not back in the pool
        assert await c.health() == {"status": "ok"}  # the one slot is free again
        assert fake.accepted == 2
        await c.aclose()
    asyncio.run(main())


def test_cancelling_a_half_read_answer_never_pools_the_connection(fake):
    import asyncio
    seen = {}

    def partial(h, r):
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b'{"exit_code": 0, ')
        h.wfile.flush()
        _wait_peer_close(h, seen)
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = partial
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})

    async def main():
        c = dsec.AsyncClient(fake.url, token="t")
        task = asyncio.create_task(c.sandbox("sb-1").exec("x"))
        await _until(lambda: seen.get("request"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: seen.get("closed"))
        assert c.connections == 0
        assert await c.health() == {"status": "ok"}
        await c.aclose()
    asyncio.run(main())


def test_async_exec_stream_cancelled_or_left_closes_the_connection(fake):
    import asyncio
    seen = {}

    def stream(h, r):
        h.start_chunked()
        h.chunk(b'{"type":"stdout","data":"1\\n"}\n')
        _wait_peer_close(h, seen)
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = stream

    async def main():
        c = dsec.AsyncClient(fake.url, token="t")
        sb = c.sandbox("sb-1")
        got = []

        async def consume():
            async for ev in sb.exec_stream("yes"):
                got.append(ev)
        task = asyncio.create_task(consume())
        await _until(lambda: got)
        assert got[0].type == "stdout" and got[0].data == "1\n"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: seen.get("closed"))
        assert c.connections == 0
        # leaving the loop early, then aclose(): the same
        seen.clear()
        agen = sb.exec_stream("yes")
        async for ev in agen:
            break
        await agen.aclose()
        await _until(lambda: seen.get("closed"))
        assert c.connections == 0
        await c.aclose()
    asyncio.run(main())


def test_async_exec_stream_and_async_bodies(fake):
    import asyncio

    def stream(h, r):
        h.start_chunked()
        h.chunk(b'{"type":"stdout","data":"a"}\n{"type":"stderr","data_b64":"/w=="}\n')
        h.chunk(b'{"type":"exit","exit_code":3}\n')
        h.end_chunks()

    def put(h, r):
        h.send_json(200, {"path": "/x", "size": len(r["body"]), "body": r["body"].decode()})
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = stream
    fake.routes[("PUT", "/v1/sandboxes/sb-1/files")] = put
    fake.routes[("GET", "/v1/sandboxes/sb-1/files")] = lambda h, r: h.send_raw(
        200, b"0123456789" * 100_000)

    async def main():
        async with dsec.AsyncClient(fake.url, token="t") as c:
            sb = c.sandbox("sb-1")
            assert isinstance(sb, dsec.AsyncSandbox)
            evs = [ev async for ev in sb.exec_stream(["x"])]
            assert [e.type for e in evs] == ["stdout", "stderr", "exit"]
            assert evs[1].data_bytes == b"\xff" and evs[2].result.exit_code == 3

            async def chunks():
                for part in (b"ab", b"", b"cd"):
                    await asyncio.sleep(0)
                    yield part
            r = await sb.write_file("/x", chunks())
            assert r["body"] == "abcd"
            assert fake.requests[-1]["headers"].get("Transfer-Encoding") == "chunked"
            assert (await sb.write_file("/x", io.BytesIO(b"file")))["body"] == "file"
            assert (await sb.write_file("/x", [b"it", b"er"]))["body"] == "iter"

            class AsyncOut:
                def __init__(self):
                    self.data = b""

                async def write(self, b):
                    self.data += b
            out = AsyncOut()
            assert await sb.read_file_to("/big", out) == 1_000_000
            assert out.data == b"0123456789" * 100_000
            buf = io.BytesIO()
            assert await sb.read_file_to("/big", buf) == 1_000_000
            assert fake.accepted == 1
    asyncio.run(main())


def test_sync_client_refuses_an_async_body(scl, fake):
    async def chunks():
        yield b"x"
    with pytest.raises(TypeError):
        scl.sandbox("sb-1").write_file("/x", chunks())
    assert fake.requests == []


def test_async_trajectory_takes_steps_at_call_time(fake):
    import asyncio
    steps = []

    def exec_(h, r):
        steps.append(json.loads(r["body"])["step"])
        h.send_json(200, EXEC_OK)
    fake.routes[("POST", "/v1/sandboxes/sb-1/exec")] = exec_

    async def main():
        async with dsec.AsyncClient(fake.url, token="t") as c:
            t = c.sandbox("sb-1").trajectory("tr", start=5)
            assert isinstance(t, dsec.AsyncTrajectory)
            coros = [t.exec(["echo", str(i)]) for i in range(3)]
            assert t.next_step == 8
            await asyncio.gather(*reversed(coros))
    asyncio.run(main())
    assert sorted(steps) == [5, 6, 7]


def test_async_local_addrs_spread_connections(fake):
    import asyncio
    gate = threading.Event()

    def held(h, r):
        gate.wait(5)
        h.send_json(200, {"status": "ok"})
    fake.routes[("GET", "/v1/health")] = held

    async def main():
        c = dsec.AsyncClient(fake.url, token="t", local_addrs=["127.0.0.2", "127.0.0.3"])
        tasks = [asyncio.create_task(c.health()) for _ in range(4)]
        await _until(lambda: len(fake.requests) == 4)
        gate.set()
        await asyncio.gather(*tasks)
        await c.aclose()
    asyncio.run(main())
    assert sorted(r["peer"][0] for r in fake.requests) == ["127.0.0.2", "127.0.0.2",
                                                           "127.0.0.3", "127.0.0.3"]


# ----- the HTTP/1.1 response parser both clients feed -------------------------------

def _parse(raw: bytes, method="GET", piece=None):
    """(status, headers, body, keep_alive) of ``raw`` fed whole or ``piece``
    bytes at a time, then the connection's end."""
    from dsec._http import END, NEED_DATA, ResponseParser
    p = ResponseParser(method)
    pieces = [raw] if piece is None else [raw[i:i + piece] for i in range(0, len(raw), piece)]
    pieces.append(b"")
    head, body = None, b""
    while True:
        ev = p.next_event()
        if ev is NEED_DATA:
            p.feed(pieces.pop(0))
        elif ev is END:
            return head.status, head.headers, body, p.keep_alive
        elif isinstance(ev, bytes):
            body += ev
        else:
            head = ev


@pytest.mark.parametrize("piece", [None, 1, 7])
def test_response_parser_frames_every_kind_of_answer(piece):
    import dsec._http as h
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in (b"a" * 300, b"b", b"c\n" * 9))
    cases = [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello", "GET",
         (200, "hello", True), {"content-length": "5", "x-a": "1, 2"}),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n",
         "POST", (201, "", True), None),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks
         + b"0\r\nTrailer: t\r\n\r\n", "GET",
         (200, "a" * 300 + "b" + "c\n" * 9, True), None),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nto the end", "GET",
         (200, "to the end", False), None),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", "GET", (200, "ok", False), None),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", "GET",
         (200, "ok", True), None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", "HEAD", (200, "", False), None),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "DELETE", (204, "", True), None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", "GET", (200, "ok", False), None),
    ]
    for raw, method, (status, body, keep), headers in cases:
        if piece is not None and raw.endswith(b"EXTRA"):
            continue  # bytes past the answer are seen only when they come with it
        st, hd, b, k = _parse(raw, method, piece)
        assert (st, b.decode(), k) == (status, body, keep), raw[:60]
        if headers:
            assert hd == headers
    for bad in (b"SPDY/3 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX"):
        with pytest.raises(h.ProtocolError):
            _parse(bad, "GET", piece)
    with pytest.raises(h.NoResponse):
        _parse(b"", "GET", piece)


def test_response_parser_is_linear_in_many_small_chunks():
    n = 20000
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"".join(b"%x\r\n%s\r\n" % (len(b"{}\n"), b"{}\n") for _ in range(n)) + b"0\r\n\r\n")
    t0 = time.monotonic()
    assert _parse(raw)[2] == b"{}\n" * n
    assert time.monotonic() - t0 < 2


def test_an_async_client_used_under_two_event_loops_starts_afresh(fake):
    import asyncio
    fake.routes[("GET", "/v1/health")] = lambda h, r: h.send_json(200, {"status": "ok"})
    c = dsec.AsyncClient(fake.url, token="t")
    for _ in range(2):  # two asyncio.run, one client: its first pool's loop is gone
        assert asyncio.run(c.health()) == {"status": "ok"}
        assert c.connections == 1
    assert fake.accepted == 2
