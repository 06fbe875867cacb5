"""Exposed ports (docs/ports.md): a server inside a sandbox reached through the
platform's listener, in the path form (/ports/{id}/{port}/...) and the host
form ({port}-{id}.localhost), with URL tokens, API keys, cookies, streaming
bodies both ways, server-sent events, WebSockets, and the cuts: unexpose,
rotate, ttl and destroy close what was open."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import socket
import struct
import time
from pathlib import Path

import pytest

import dsec
from listening import wait_listening
from test_tenants import make_tenant  # noqa: F401  (fixture)

HERE = Path(__file__).parent
PORT = 8000


@pytest.fixture(scope="module")
def web(module_sandboxes, debian):
    sb = module_sandboxes(debian, labels={"suite": "ports"})
    sb.write_file("/tmp/port_server.py", (HERE / "port_server.py").read_bytes())
    sb.start_process(["python3", "/tmp/port_server.py", str(PORT)])
    wait_listening(sb, PORT)
    return sb


def conn(server, timeout=30) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)


def request(server, method, path, headers=None, body=None, timeout=30):
    c = conn(server, timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data, r.getheader("Set-Cookie")
    finally:
        c.close()


def path_of(exposure, rest=""):
    u = exposure.path_url
    return u[u.index("/ports/"):] + rest


def host_of(server, sb, port=PORT):
    return f"{port}-{sb.id}.localhost:{server.port}"


def echo_headers(data: bytes) -> dict:
    doc = json.loads(data)
    return doc, {k.lower(): v for k, v in doc["headers"]}


# ---------------------------------------------------------------- websockets

def ws_open(server, path, headers):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [f"GET {path} HTTP/1.1", "Connection: Upgrade", "Upgrade: websocket",
             "Sec-WebSocket-Version: 13", f"Sec-WebSocket-Key: {key}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    status = head.split(b"\r\n", 1)[0]
    assert b" 101 " in status, head
    want = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11")
                                         .encode()).digest())
    assert want in head, head
    return s, head.split(b"\r\n\r\n", 1)[1]


def ws_send(s, payload: bytes, op=1):
    mask = os.urandom(4)
    n = len(payload)
    hdr = bytes([0x80 | op])
    if n < 126:
        hdr += bytes([0x80 | n])
    elif n < 65536:
        hdr += bytes([0x80 | 126]) + struct.pack(">H", n)
    else:
        hdr += bytes([0x80 | 127]) + struct.pack(">Q", n)
    s.sendall(hdr + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def ws_recv(s, buf=b""):
    def need(k):
        nonlocal buf
        while len(buf) < k:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
    need(2)
    n = buf[1] & 0x7F
    off = 2
    if n == 126:
        need(4)
        n = struct.unpack(">H", buf[2:4])[0]
        off = 4
    elif n == 127:
        need(10)
        n = struct.unpack(">Q", buf[2:10])[0]
        off = 10
    need(off + n)
    data = buf[off:off + n]
    return data, buf[off + n:]


def closed_within(s, seconds: float) -> bool:
    s.settimeout(seconds)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


# ---------------------------------------------------------------- tests

def test_expose_returns_urls_and_is_idempotent(web, server):
    e = web.expose(PORT)
    assert e.port == PORT and e.token.startswith("dpt_") and e.gen >= 1
    assert e.url.startswith(f"http://{PORT}-{web.id}.localhost:{server.port}/?dsec_token=")
    assert e.path_url == f"{server.url}/ports/{web.id}/{PORT}/"
    again = web.expose(PORT)
    assert again.token == e.token and again.gen == e.gen
    assert [x.port for x in web.exposures()] == [PORT]
    status, _, _, doc = server.raw("GET", f"/v1/sandboxes/{web.id}/ports/{PORT}")
    assert status == 200 and doc["token"] == e.token


def test_path_form_with_token_strips_every_credential(web, server):
    e = web.expose(PORT)
    for how in ("query", "header", "bearer"):
        headers = {"Cookie": "app=1"}
        path = path_of(e, "echo/a%20b?x=1")
        if how == "query":
            path += "&dsec_token=" + e.token
        elif how == "header":
            headers["Dsec-Port-Token"] = e.token
        else:
            headers["Authorization"] = "Bearer " + e.token
        status, hdrs, data, _ = request(server, "GET", path, headers)
        assert status == 200, (how, data)
        doc, seen = echo_headers(data)
        assert doc["path"] == "/echo/a%20b?x=1", doc
        assert "authorization" not in seen and "dsec-port-token" not in seen, seen
        assert "dsec_token" not in doc["path"]
        assert seen.get("cookie") == "app=1"
        assert seen["x-forwarded-for"] == "127.0.0.1"
        assert seen["x-forwarded-prefix"] == f"/ports/{web.id}/{PORT}"
        # The page runs in an opaque origin, and the connection is not kept.
        assert hdrs["content-security-policy"].startswith("sandbox")
        assert hdrs.get("connection") == "close"


def test_path_form_with_the_owners_key(web, server):
    web.expose(PORT)
    status, _, data, _ = request(server, "GET", f"/ports/{web.id}/{PORT}/echo",
                                 {"Authorization": f"Bearer {server.client.token}"})
    assert status == 200, data
    _, seen = echo_headers(data)
    assert "authorization" not in seen


def test_host_form_trades_the_token_for_a_cookie(web, server):
    e = web.expose(PORT)
    host = host_of(server, web)
    status, hdrs, _, cookie = request(server, "GET", f"/echo?x=2&dsec_token={e.token}",
                                      {"Host": host})
    assert status == 302, hdrs
    assert hdrs["location"] == "/echo?x=2"
    assert cookie.startswith(f"dsec_port={e.token};") and "HttpOnly" in cookie, cookie
    c = conn(server)
    try:
        # Keep-alive: several requests, each checked, on one connection.
        for i in range(3):
            c.request("GET", f"/echo?i={i}", headers={"Host": host,
                                                     "Cookie": f"a=1; dsec_port={e.token}; b=2"})
            r = c.getresponse()
            data = r.read()
            assert r.status == 200, data
            doc, seen = echo_headers(data)
            assert doc["path"] == f"/echo?i={i}"
            assert seen["cookie"] == "a=1; b=2"
            assert seen["x-forwarded-host"] == host
            assert "content-security-policy" not in {k.lower() for k, _ in r.getheaders()}
    finally:
        c.close()
    # HEAD answers its head only.
    status, hdrs, data, _ = request(server, "HEAD", "/", {"Host": host, "Cookie": f"dsec_port={e.token}"})
    assert status == 200 and data == b"" and hdrs["content-length"] == "1234"


def test_credentials_are_refused_precisely(web, server, make_tenant):
    e = web.expose(PORT)
    base = f"/ports/{web.id}/{PORT}/echo"
    assert request(server, "GET", base)[0] == 401
    status, hdrs, data, _ = request(server, "GET", base, {"Dsec-Port-Token": "dpt_" + "0" * 64})
    assert status == 401 and json.loads(data)["error"]["code"] == "unauthenticated"
    # Another port's token opens nothing here.
    other = web.expose(PORT + 1)
    assert request(server, "GET", base, {"Dsec-Port-Token": other.token})[0] == 401
    web.unexpose(PORT + 1)
    # A bad key, and a tenant that does not own the sandbox: 401, then 404.
    assert request(server, "GET", base, {"Authorization": "Bearer nope"})[0] == 401
    t = make_tenant("ports")
    status, _, data, _ = request(server, "GET", base, {"Authorization": f"Bearer {t.key['key']}"})
    assert status == 404, data
    with pytest.raises(dsec.NotFound):
        t.client.get(web.id).expose(PORT)
    status, _, _, doc = server.raw("POST", f"/v1/sandboxes/{web.id}/ports", {"port": PORT},
                                   token=t.key["key"])
    assert status == 404
    # The owner's key on a port not exposed.
    status, _, data, _ = request(server, "GET", f"/ports/{web.id}/9999/",
                                 {"Authorization": f"Bearer {server.client.token}"})
    assert status == 404 and json.loads(data)["error"]["field"] == "port"
    # Bad input to the API.
    for body, field in (({"port": 0}, "port"), ({"port": 70000}, "port"), ({}, "port"),
                        ({"port": PORT, "ttl_s": -1}, "ttl_s"), ({"port": "x"}, "port"),
                        ({"port": PORT, "bogus": 1}, "bogus")):
        status, _, _, doc = server.raw("POST", f"/v1/sandboxes/{web.id}/ports", body)
        assert status == 400 and doc["error"]["field"] == field, (body, doc)
    status, _, _, doc = server.raw("DELETE", f"/v1/sandboxes/{web.id}/ports/4444")
    assert status == 404 and doc["error"]["field"] == "port"
    status, _, _, doc = server.raw("POST", "/v1/sandboxes/sb-nope/ports", {"port": PORT})
    assert status == 404
    assert request(server, "GET", f"/ports/{web.id}/0/", {"Dsec-Port-Token": e.token})[0] == 400


def test_nothing_listening_is_502(web, server):
    e = web.expose(8099)
    try:
        status, _, data, _ = request(server, "GET", path_of(e), {"Dsec-Port-Token": e.token})
        assert status == 502, data
        assert "8099" in json.loads(data)["error"]["message"]
    finally:
        web.unexpose(8099)


def test_big_bodies_stream_both_ways(web, server):
    e = web.expose(PORT)
    rss0 = rss_kb(server.pid)
    n = 512 << 20
    c = conn(server, timeout=120)
    c.request("GET", path_of(e, f"big?n={n}"), headers={"Dsec-Port-Token": e.token})
    r = c.getresponse()
    assert r.status == 200 and int(r.getheader("Content-Length")) == n
    got = 0
    h = hashlib.sha256()
    while True:
        chunk = r.read(1 << 20)
        if not chunk:
            break
        h.update(chunk)
        got += len(chunk)
    c.close()
    want = hashlib.sha256()
    pattern = bytes(range(256)) * 4096
    for _ in range(n // len(pattern)):
        want.update(pattern)
    assert got == n and h.hexdigest() == want.hexdigest()
    # Upload, chunked (no Content-Length), as a generator: never whole in memory.
    size = 128 << 20
    block = os.urandom(1 << 20)
    up = hashlib.sha256()
    for _ in range(size // len(block)):
        up.update(block)

    def gen():
        for _ in range(size // len(block)):
            yield block
    c = conn(server, timeout=120)
    c.request("POST", path_of(e, "upload"), body=gen(),
              headers={"Dsec-Port-Token": e.token, "Transfer-Encoding": "chunked"},
              encode_chunked=True)
    r = c.getresponse()
    doc = json.loads(r.read())
    c.close()
    assert doc == {"bytes": size, "sha256": up.hexdigest()}
    grew_mb = (rss_kb(server.pid) - rss0) / 1024
    assert grew_mb < 64, f"dsec up grew {grew_mb:.0f} MiB relaying 640 MiB"


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_server_sent_events_arrive_as_sent(web, server):
    e = web.expose(PORT)
    web.exec(["rm", "-f", "/tmp/sse-go"])
    c = conn(server, timeout=20)
    c.request("GET", path_of(e, "sse"), headers={"Dsec-Port-Token": e.token})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    first = r.read1(100) if hasattr(r, "read1") else r.read(11)
    assert first.startswith(b"data: one"), first  # before the second was written
    web.exec(["touch", "/tmp/sse-go"])
    rest = r.read()
    assert b"data: two" in rest
    c.close()


def test_websocket_echo_then_unexpose_cuts_it(web, server):
    e = web.expose(PORT)
    s, buf = ws_open(server, path_of(e, "ws"), {"Dsec-Port-Token": e.token})
    ws_send(s, b"hello")
    data, buf = ws_recv(s, buf)
    assert data == b"hello"
    big = os.urandom(200_000)
    ws_send(s, big, op=2)
    data, buf = ws_recv(s, buf)
    assert data == big
    # The host form too, with the cookie.
    s2, buf2 = ws_open(server, "/ws", {"Host": host_of(server, web), "Cookie": f"dsec_port={e.token}"})
    ws_send(s2, b"two")
    assert ws_recv(s2, buf2)[0] == b"two"
    web.unexpose(PORT)
    assert closed_within(s, 3), "unexpose left a WebSocket open"
    assert closed_within(s2, 3), "unexpose left a WebSocket open"
    s.close()
    s2.close()
    assert request(server, "GET", path_of(e, "echo"), {"Dsec-Port-Token": e.token})[0] == 401


def test_rotate_voids_the_old_token_and_its_connections(web, server):
    old = web.expose(PORT)
    s, buf = ws_open(server, path_of(old, "ws"), {"Dsec-Port-Token": old.token})
    ws_send(s, b"x")
    assert ws_recv(s, buf)[0] == b"x"
    new = web.expose(PORT, rotate=True)
    assert new.token != old.token and new.gen == old.gen + 1
    assert closed_within(s, 3), "rotate left a connection of the old token open"
    s.close()
    assert request(server, "GET", path_of(old, "echo"), {"Dsec-Port-Token": old.token})[0] == 401
    assert request(server, "GET", path_of(new, "echo"), {"Dsec-Port-Token": new.token})[0] == 200


def test_ttl_ends_the_exposure(web, server):
    e = web.expose(8001, ttl_s=1)
    assert e.expires_at is not None
    time.sleep(2.5)
    status, _, data, _ = request(server, "GET", path_of(e), {"Dsec-Port-Token": e.token})
    assert status == 401, data
    assert 8001 not in [x.port for x in web.exposures()]


def test_cli_expose_ports_unexpose(web, server):
    r = server.cli("sandbox", "expose", "--data-dir", server.data_dir, web.id, "8002")
    assert r.returncode == 0, r.stderr
    assert f"/ports/{web.id}/8002/" in r.stdout and "dpt_" in r.stdout
    r = server.cli("sandbox", "ports", "--data-dir", server.data_dir, web.id)
    assert r.returncode == 0 and "8002 " in r.stdout, r
    r = server.cli("sandbox", "unexpose", "--data-dir", server.data_dir, web.id, "8002")
    assert r.returncode == 0, r.stderr
    r = server.cli("sandbox", "unexpose", "--data-dir", server.data_dir, web.id, "8002")
    assert r.returncode != 0 and "port" in r.stderr


def test_destroy_closes_connections(make_sandbox, debian, server):
    sb = make_sandbox(debian)
    sb.write_file("/tmp/port_server.py", (HERE / "port_server.py").read_bytes())
    sb.start_process(["python3", "/tmp/port_server.py", str(PORT)])
    wait_listening(sb, PORT)
    e = sb.expose(PORT)
    s, buf = ws_open(server, path_of(e, "ws"), {"Dsec-Port-Token": e.token})
    ws_send(s, b"ping")
    assert ws_recv(s, buf)[0] == b"ping"
    sb.destroy()
    assert closed_within(s, 5), "destroy left a proxied connection open"
    s.close()
    status, _, _, _ = request(server, "GET", path_of(e, "echo"), {"Dsec-Port-Token": e.token})
    assert status in (404, 409)


def test_an_exposed_sandbox_still_has_no_egress(web, server):
    web.expose(PORT)
    r = web.exec(["python3", "-c",
                  "import socket; s=socket.socket(); s.settimeout(2); "
                  f"s.connect(('127.0.0.1', {server.port}))"])
    assert r.exit_code != 0  # the host's listener is not reachable from inside


def test_fncall_cannot_expose(server, make_sandbox, debian):
    sb = make_sandbox(debian, backend="fncall", disk_mb=16)
    status, _, _, doc = server.raw("POST", f"/v1/sandboxes/{sb.id}/ports", {"port": 80})
    assert status == 409 and doc["error"]["field"] == "backend", doc


def test_an_open_websocket_holds_off_the_idle_timeout(make_sandbox, debian, server):
    sb = make_sandbox(debian, idle_timeout_s=2)
    sb.write_file("/tmp/port_server.py", (HERE / "port_server.py").read_bytes())
    sb.start_process(["python3", "/tmp/port_server.py", str(PORT)])
    wait_listening(sb, PORT)
    e = sb.expose(PORT)
    s, buf = ws_open(server, path_of(e, "ws"), {"Dsec-Port-Token": e.token})
    for i in range(5):  # 5 s of a connection with no new request
        time.sleep(1)
        ws_send(s, b"tick%d" % i)
        data, buf = ws_recv(s, buf)
        assert data == b"tick%d" % i
    status, _, _, doc = server.raw("GET", f"/v1/sandboxes/{sb.id}")
    assert doc["state"] == "running", doc
    s.close()
