"""A threaded HTTP reverse proxy on loopback in front of a registry (an
oci_registry.Registry, plain or TLS upstream; the proxy itself speaks plain
HTTP), with faults to inject into what a client reads:

    with RegistryProxy(reg) as px:                 # px.host: "127.0.0.1:PORT"
        px.corrupt(digest)                         # flip a byte of that blob's body
        px.cut(digest, after=1000, times=2)        # hang up after 1000 body bytes, twice
        px.stall(5, digest, after=0)               # 5 s of silence after 0 body bytes
        px.refuse(3, status=500)                   # answer 500 to the next 3 requests
        reg.pull_oci("app", "v1", dest, host=px.host)
        px.hits[f"/v2/app/blobs/{digest}"], px.ranges, px.requests

Faults apply to blob GETs (/v2/NAME/blobs/sha256:HEX) of `digest`, or of every
blob with digest=None; refuse() to any request matching `path` (a regex, None:
all). `times` counts the responses a fault is applied to (None: always).

Everything else passes through as is: status, body, and headers but the
hop-by-hop ones (WWW-Authenticate, Location, Docker-Content-Digest,
Content-Range, ...); HEAD is forwarded as HEAD. The client's Host header is
forwarded unchanged, so that the upload Locations distribution builds from it
point back at the proxy; absolute Locations at the upstream address are
rewritten to the proxy's. Redirects elsewhere (a redirect=True registry's
storage) are passed through and bypass the proxy. Request bodies are read whole
(chunked or not) and forwarded with a Content-Length.
"""

from __future__ import annotations

import http.client
import http.server
import re
import socket
import ssl
import threading
import time
from typing import Optional

BLOB_RE = re.compile(r"^/v2/(?P<name>.+)/blobs/(?P<digest>[a-z0-9]+:[a-f0-9]+)$")
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
       "trailers", "transfer-encoding", "upgrade"}


class _Fault:
    def __init__(self, kind: str, digest: Optional[str], times: Optional[int], **kw):
        self.kind, self.digest, self.left = kind, digest, times
        self.applied = 0  # how many responses it was applied to
        self.__dict__.update(kw)

    def matches(self, digest: Optional[str]) -> bool:
        return (digest is not None and (self.digest is None or self.digest == digest) and
                (self.left is None or self.left > 0))

    def take(self) -> bool:
        if self.left is not None:
            if self.left <= 0:
                return False
            self.left -= 1
        self.applied += 1
        return True


class RegistryProxy:
    def __init__(self, upstream, port: int = 0, chunk: int = 64 * 1024):
        """upstream: a Registry (its port, tls and ca_file are used) or "host:port"
        (plain HTTP)."""
        if isinstance(upstream, str):
            h, _, p = upstream.rpartition(":")
            self.up_host, self.up_port, self.up_tls, self.up_ca = h, int(p), False, None
            self._registry = None
        else:
            self._registry = upstream
            self.up_host, self.up_port = "127.0.0.1", None
            self.up_tls, self.up_ca = upstream.tls, upstream.ca_file
        self.chunk = chunk
        self._want_port = port
        self.server = None
        self.port = None
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.reset()

    # addresses

    @property
    def upstream_port(self) -> int:
        # a Registry's port is read each time: it may be restarted elsewhere
        return self.up_port if self._registry is None else self._registry.port

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    # knobs

    def reset(self) -> None:
        """Drops every fault and every count."""
        with self.lock:
            self.faults = []
            self.refusals = []
            self.requests = []   # {"method", "path", "status", "range", "sent", "faults"}
            self.hits = {}       # path (no query) -> requests
            self.ranges = []     # (path, Range header) of requests that had one

    def corrupt(self, digest: Optional[str] = None, times: Optional[int] = None,
                offset: Optional[int] = None) -> _Fault:
        """Flips one byte (xor 0xff) of the body of blob responses: at `offset` of
        the body sent (default: its middle)."""
        return self._add(_Fault("corrupt", digest, times, offset=offset))

    def cut(self, digest: Optional[str] = None, after: int = 0, times: Optional[int] = 1) -> _Fault:
        """Sends the headers and `after` bytes of the body, then closes the
        connection (the client sees a short body)."""
        return self._add(_Fault("cut", digest, times, after=after))

    def stall(self, seconds: float, digest: Optional[str] = None, after: Optional[int] = 0,
              times: Optional[int] = 1) -> _Fault:
        """Pauses `seconds` after `after` body bytes (after=None: before asking
        upstream, i.e. before any header), then goes on."""
        return self._add(_Fault("stall", digest, times, seconds=seconds, after=after))

    def refuse(self, times: int = 1, status: int = 500, path: Optional[str] = None,
               method: Optional[str] = None, headers: Optional[dict] = None) -> _Fault:
        """Answers `status` (no upstream request) to the next `times` requests
        whose path matches the regex `path` (and `method`); headers e.g.
        {"Retry-After": "1"}."""
        f = _Fault("refuse", None, times, status=status,
                   path=re.compile(path) if path else None, method=method,
                   headers=dict(headers or {}))
        with self.lock:
            self.refusals.append(f)
        return f

    def _add(self, f: _Fault) -> _Fault:
        with self.lock:
            self.faults.append(f)
        return f

    def count(self, path: Optional[str] = None, method: Optional[str] = None,
              blob: Optional[str] = None) -> int:
        """Requests seen: all, or those of `path` (exact, no query; or a compiled
        regex), `method`, or blob digest `blob`."""
        n = 0
        for r in list(self.requests):
            if method and r["method"] != method:
                continue
            if blob and r["digest"] != blob:
                continue
            if isinstance(path, re.Pattern):
                if not path.search(r["path"]):
                    continue
            elif path is not None and r["path"] != path:
                continue
            n += 1
        return n

    # the server

    def start(self) -> "RegistryProxy":
        px = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                px._forward(self)

            do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request, client_address):
                pass

        self.server = Server(("127.0.0.1", self._want_port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return self

    def close(self) -> None:
        self.closing.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    stop = close

    def __enter__(self) -> "RegistryProxy":
        return self.start() if self.server is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # forwarding

    def _sleep(self, seconds: float) -> None:
        self.closing.wait(seconds)

    def _read_body(self, h) -> bytes:
        te = h.headers.get("Transfer-Encoding", "").lower()
        if "chunked" in te:
            out = []
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(out)
                out.append(h.rfile.read(size))
                h.rfile.readline()
        n = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(n) if n else b""

    def _upstream(self):
        if self.up_tls:
            ctx = ssl.create_default_context(cafile=str(self.up_ca) if self.up_ca else None)
            return http.client.HTTPSConnection(self.up_host, self.upstream_port, timeout=60,
                                               context=ctx)
        return http.client.HTTPConnection(self.up_host, self.upstream_port, timeout=60)

    def _forward(self, h) -> None:
        path_only = h.path.split("?", 1)[0]
        m = BLOB_RE.match(path_only)
        digest = m.group("digest") if m and h.command == "GET" else None
        rec = {"method": h.command, "path": path_only, "full_path": h.path, "status": None,
               "range": h.headers.get("Range"), "sent": 0, "faults": [],
               "digest": m.group("digest") if m else None, "time": time.time()}
        with self.lock:
            self.requests.append(rec)
            self.hits[path_only] = self.hits.get(path_only, 0) + 1
            if rec["range"]:
                self.ranges.append((path_only, rec["range"]))
            refusal = None
            for f in self.refusals:
                if ((f.path is None or f.path.search(path_only)) and
                        (f.method is None or f.method == h.command) and f.take()):
                    refusal = f
                    break
            pre = [f for f in self.faults if f.kind == "stall" and f.after is None and
                   f.matches(digest) and f.take()]
            # body faults are spent on a 2xx answer only (not on a 401 before a token)
            candidates = [f for f in self.faults if f.matches(digest) and f not in pre and
                          not (f.kind == "stall" and f.after is None)]
        body = self._read_body(h)
        if refusal is not None:
            rec["status"], rec["faults"] = refusal.status, ["refuse"]
            data = b'{"errors":[{"code":"UNKNOWN","message":"injected by registry_proxy"}]}\n'
            h.send_response(refusal.status)
            for k, v in refusal.headers.items():
                h.send_header(k, v)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
            return
        rec["faults"] = [f.kind for f in pre]
        for f in pre:
            self._sleep(f.seconds)
        # a list: headers may repeat (distribution reads every Accept line)
        hdrs = [(k, v) for k, v in h.headers.items() if k.lower() not in HOP and
                k.lower() != "content-length"]
        if self.up_tls:
            hdrs.append(("X-Forwarded-Proto", "http"))
        if body or h.command in ("POST", "PUT", "PATCH"):
            hdrs.append(("Content-Length", str(len(body))))
        conn = self._upstream()
        try:
            conn.putrequest(h.command, h.path, skip_host=True, skip_accept_encoding=True)
            for k, v in hdrs:
                conn.putheader(k, v)
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
        except OSError as e:
            conn.close()
            rec["status"] = 502
            data = f"upstream: {e}\n".encode()
            h.send_response(502)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
            return
        try:
            self._relay(h, resp, rec, candidates)
        finally:
            conn.close()

    def _relay(self, h, resp, rec, candidates) -> None:
        rec["status"] = resp.status
        length = resp.getheader("Content-Length")
        headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP]
        if h.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200:
            resp.read()
            self._send_head(h, resp.status, headers)
            return
        if length is None:  # re-frame what came chunked or until EOF
            data = resp.read()
            headers.append(("Content-Length", str(len(data))))
            self._send_head(h, resp.status, headers)
            h.wfile.write(data)
            rec["sent"] = len(data)
            return
        total = int(length)
        self._send_head(h, resp.status, headers)
        body_faults = []
        if 200 <= resp.status < 300:
            with self.lock:
                body_faults = [f for f in candidates if f.take()]
            rec["faults"] += [f.kind for f in body_faults]
        flip = {}
        for f in body_faults:
            if f.kind == "corrupt" and total > 0:
                off = total // 2 if f.offset is None else min(f.offset, total - 1)
                flip[off] = True
        cut = min([f.after for f in body_faults if f.kind == "cut"], default=None)
        stalls = sorted((f.after, f.seconds) for f in body_faults
                        if f.kind == "stall" and f.after is not None)
        sent = 0
        while sent < total:
            want = min(self.chunk, total - sent)
            # stop at the next fault boundary
            for b in [cut] + [a for a, _ in stalls]:
                if b is not None and sent <= b < sent + want and b != sent:
                    want = b - sent
            if stalls and stalls[0][0] <= sent:
                self._sleep(stalls.pop(0)[1])
                continue
            if cut is not None and sent >= cut:
                rec["sent"] = sent
                h.wfile.flush()
                h.close_connection = True
                try:
                    h.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            data = resp.read(want)
            if not data:
                break  # upstream hung up: so do we
            if flip:
                buf = bytearray(data)
                for off in list(flip):
                    if sent <= off < sent + len(buf):
                        buf[off - sent] ^= 0xFF
                        del flip[off]
                data = bytes(buf)
            try:
                h.wfile.write(data)
            except OSError:
                h.close_connection = True
                break
            sent += len(data)
        rec["sent"] = sent
        if sent < total:
            h.close_connection = True

    def _send_head(self, h, status: int, headers: list) -> None:
        h.send_response_only(status)
        for k, v in headers:
            if k.lower() == "location":
                v = re.sub(rf"^https?://(127\.0\.0\.1|localhost):{self.upstream_port}",
                           f"http://{self.host}", v)
            if k.lower() in ("date", "server"):
                continue
            h.send_header(k, v)
        h.send_header("Date", h.date_time_string())
        h.end_headers()
