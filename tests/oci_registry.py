"""A real CNCF distribution registry (Debian's `docker-registry`, 2.8) on
loopback for the `dsec image pull` tests, pushed to and read with Debian's
skopeo.

    with Registry(tmp_path, auth="token", tls=True) as reg:
        reg.push_oci(layout.dir, "app", "v1")      # oci_build.OciLayout
        reg.inspect("app", "v1")                   # the manifest, parsed
        reg.ref("app", "v1")                       # "127.0.0.1:PORT/app:v1"

auth: None (anonymous push and pull), "htpasswd" (Basic, bcrypt file) or
"token" (distribution's bearer token auth against TokenServer, run here in a
thread: RS256 JWTs, signing cert in the registry's rootcertbundle). users:
name -> password. tls=True: https with a self-signed certificate for
127.0.0.1 (`ca_file`, `cert_dir` for skopeo's --cert-dir). redirect=True:
blob GETs and HEADs answer 307 to a file server over the storage directory
(distribution's `redirect` storage middleware, as S3 or GCS storage would).

stop() stops the registry process, kill() SIGKILLs it, restart() starts it
again on the same port and storage (also after stop/kill); close() (and the
end of the `with`) stops everything. The token and redirect servers keep
running across restarts.

Findings against distribution 2.8.2 and skopeo 1.9.3 (test_registry_harness.py):
  * token header: `x5c` (base64 DER of the signing cert, itself the whole
    rootcertbundle) and `kid` (the libtrust key id) are both accepted;
    token_header= picks one (default x5c). aud is sent as a string.
  * no credentials, wrong Basic credentials: 401, `WWW-Authenticate: Basic
    realm="dsec-test-registry"` or `Bearer realm=...,service=...,scope=...`,
    body errors[0].code UNAUTHORIZED. A valid token without the action (denied
    repository, anonymous user): 401 too, the challenge adds
    error="insufficient_scope"; never 403. skopeo then says "denied: requested
    access to the resource is denied". The token server answers wrong
    credentials with 401 itself.
  * exp has 60 s of leeway: a token expired 30 s ago is still accepted.
  * an OCI manifest or index is served only to a client whose Accept lists its
    media type: otherwise (no Accept, */*, docker types only) 404
    MANIFEST_UNKNOWN "OCI manifest found, but accept header does not support
    OCI manifests", by tag and by digest alike.
  * the filesystem storage never redirects; with redirect=True (the `redirect`
    storage middleware) blob GET *and* HEAD answer 307 to the storage URL.
  * blob GETs do Range (206, Content-Range, Accept-Ranges: bytes).
  * htpasswd works over plain HTTP (no TLS required).
  * start to /v2/ answering: ~30-60 ms, also after kill and restart.
  * skopeo keeps +zstd layers of an oci: source (and the manifest's bytes:
    its digest is the layout's), but gzips uncompressed layers on the way to
    a registry (push_raw keeps them); --format v2s2 refuses zstd layers;
    without --all only the host platform of an index is pushed.
  * skopeo neither retries nor resumes a blob (no Range after a cut, no retry
    after a 500); it fetches layers in parallel.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import http.server
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Optional

import pytest

from nginx_store import free_port

SERVICE = "dsec-test-registry"
ISSUER = "dsec-test-issuer"
START_TIMEOUT_S = 20
_DEFAULT = object()


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


def self_signed(dir: Path, cn: str = "127.0.0.1", name: str = "cert") -> tuple:
    """openssl's self-signed RSA cert for IP `cn` (its own CA): (cert, key) paths."""
    cert, key = dir / f"{name}.pem", dir / f"{name}-key.pem"
    san = f"IP:{cn}" if re.fullmatch(r"[\d.]+", cn) else f"DNS:{cn}"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={cn}",
                    "-addext", f"subjectAltName={san}"],
                   check=True, capture_output=True, stdin=subprocess.DEVNULL)
    return cert, key


def libtrust_key_id(der_spki: bytes) -> str:
    """docker/libtrust's key id: base32 of the first 240 bits of the sha256 of
    the DER SubjectPublicKeyInfo, in 12 groups of 4 joined by ':'."""
    b32 = base64.b32encode(hashlib.sha256(der_spki).digest()[:30]).decode().rstrip("=")
    return ":".join(b32[i:i + 4] for i in range(0, len(b32), 4))


class _Quiet(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        pass  # a client that hangs up is no news


def _serve(handler, port: int = 0):
    srv = _Quiet(("127.0.0.1", port), handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return srv


# ----- the token server ------------------------------------------------------------

class TokenServer:
    """Docker's token auth (https://distribution.github.io/distribution/spec/auth/token/):
    GET /token?service=S&scope=repository:NAME:pull,push[&scope=...] with Basic
    credentials, or POST /token (OAuth2 form: grant_type=password with
    username/password, or grant_type=refresh_token). Answers {"token",
    "access_token", "expires_in", "issued_at"} (and "refresh_token" for POST).

    Valid users get every action they ask for on every repository but those in
    `deny` (empty actions: the registry then refuses); anonymous requests (no
    Authorization) get a token with no access, except pull on `public`
    repositories ("*": all); wrong credentials get 401. `policy(user, type,
    name, actions) -> actions` may be replaced. `fail_next(n, status)` makes the
    next n requests fail. Every request is recorded in `requests` (method,
    path, params, scopes, user, status, time, agent); `count` leaves out the
    harness's own; `issued` holds the claims of every token given out."""

    def __init__(self, dir: Path, users: dict, service: str = SERVICE, issuer: str = ISSUER,
                 deny=(), public=(), expires_in: int = 300, header: str = "x5c"):
        import jwt  # noqa: F401  (python3-jwt; fail early)
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        self.users = dict(users)
        self.service, self.issuer = service, issuer
        self.deny, self.public = set(deny), set(public)
        self.expires_in = expires_in
        self.header = header  # "x5c" or "kid"
        self.requests = []    # {"method", "user", "scopes", "status", "params", "time"}
        self.issued = []      # the claims of every token issued
        self._fail = []       # statuses of the next requests to fail
        self._lock = threading.Lock()
        self.cert, keyfile = self_signed(dir, ISSUER, "token-signer")
        self.key_pem = keyfile.read_bytes()
        cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        self.x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.kid = libtrust_key_id(cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))
        self.server = None
        self.port = None

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    @property
    def count(self) -> int:
        """How many token requests came from clients (any outcome), leaving out the
        harness's own (Registry.token, push_raw: User-Agent dsec-test-harness)."""
        return len([r for r in self.requests if r["agent"] != "dsec-test-harness"])

    def fail_next(self, n: int = 1, status: int = 500) -> None:
        with self._lock:
            self._fail += [status] * n

    def policy(self, user: Optional[str], type_: str, name: str, actions: list) -> list:
        if user is None:
            pub = "*" in self.public or name in self.public
            return ["pull"] if pub and "pull" in actions and type_ == "repository" else []
        if type_ == "repository" and name in self.deny:
            return []
        return list(actions)

    def make_token(self, user: Optional[str], scopes: list, expires_in: Optional[int] = None,
                   now: Optional[float] = None) -> str:
        """A signed token for `user` (None: anonymous) granting what policy() allows
        of `scopes` ("repository:NAME:pull,push" strings)."""
        import jwt
        now = int(time.time() if now is None else now)
        access = []
        for scope in scopes:
            parts = scope.split(":")
            if len(parts) < 3:
                continue
            type_, name, actions = parts[0], ":".join(parts[1:-1]), parts[-1].split(",")
            access.append({"type": type_, "name": name,
                           "actions": self.policy(user, type_, name, actions)})
        claims = {"iss": self.issuer, "sub": user or "", "aud": self.service,
                  "exp": now + (self.expires_in if expires_in is None else expires_in),
                  "nbf": now - 1, "iat": now, "jti": uuid.uuid4().hex, "access": access}
        headers = {"x5c": [self.x5c]} if self.header == "x5c" else {"kid": self.kid}
        with self._lock:
            self.issued.append(claims)
        return jwt.encode(claims, self.key_pem, algorithm="RS256", headers=headers)

    def start(self) -> "TokenServer":
        ts = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _answer(self, status: int, doc: dict, extra=()):
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _handle(self, params: dict, user_pw):
                rec = {"method": self.command, "path": self.path, "params": params,
                       "scopes": params.get("scope", []), "user": None, "status": None,
                       "time": time.time(), "agent": self.headers.get("User-Agent", "")}
                with ts._lock:
                    ts.requests.append(rec)
                    fail = ts._fail.pop(0) if ts._fail else None
                if fail is not None:
                    rec["status"] = fail
                    return self._answer(fail, {"details": "injected failure"})
                if not self.path.startswith("/token"):
                    rec["status"] = 404
                    return self._answer(404, {"details": "not found"})
                scopes = [s for v in params.get("scope", []) for s in v.split(" ") if s]
                rec["scopes"] = scopes
                if user_pw is not None:
                    user, pw = user_pw
                    if ts.users.get(user) != pw:
                        rec["status"], rec["user"] = 401, user
                        return self._answer(401, {"details": "incorrect username or password"},
                                            [("WWW-Authenticate", 'Basic realm="dsec-test-token"')])
                    rec["user"] = user
                else:
                    user = None
                tok = ts.make_token(user, scopes)
                rec["status"] = 200
                doc = {"token": tok, "access_token": tok, "expires_in": ts.expires_in,
                       "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                if self.command == "POST" and user is not None:
                    doc["refresh_token"] = "refresh-" + user
                self._answer(200, doc)

            def _basic(self):
                h = self.headers.get("Authorization", "")
                if not h.lower().startswith("basic "):
                    return None
                try:
                    u, _, p = base64.b64decode(h[6:].strip()).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    return ("", "\0bad")
                return (u, p)

            def do_GET(self):
                q = urllib.parse.urlsplit(self.path).query
                self._handle(urllib.parse.parse_qs(q), self._basic())

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                params = urllib.parse.parse_qs(self.rfile.read(n).decode())
                grant = params.get("grant_type", [""])[0]
                user_pw = None
                if grant == "password":
                    user_pw = (params.get("username", [""])[0], params.get("password", [""])[0])
                elif grant == "refresh_token":
                    rt = params.get("refresh_token", [""])[0]
                    u = rt[len("refresh-"):] if rt.startswith("refresh-") else ""
                    user_pw = (u, ts.users.get(u, "\0none"))
                self._handle(params, user_pw)

        self.server = _serve(Handler)
        self.port = self.server.server_address[1]
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


# ----- the redirect target ---------------------------------------------------------

class FileServer:
    """GET/HEAD of files under `root`, with single Range requests (206, 416), for
    distribution's redirect middleware. Counts requests per path in `hits`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.hits = {}
        self.ranges = []  # (path, Range header) of ranged requests
        self.server = None
        self.port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> "FileServer":
        fs = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self.do_GET(body=False)

            def do_GET(self, body=True):
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                fs.hits[path] = fs.hits.get(path, 0) + 1
                p = (fs.root / path.lstrip("/")).resolve()
                if fs.root.resolve() not in p.parents or not p.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = p.stat().st_size
                start, end, status = 0, size - 1, 200
                rng = self.headers.get("Range")
                if rng:
                    fs.ranges.append((path, rng))
                    m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
                    if m and (m.group(1) or m.group(2)):
                        if m.group(1):
                            start = int(m.group(1))
                            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                        else:
                            start = max(0, size - int(m.group(2)))
                        status = 206
                        if start >= size or start > end:
                            self.send_response(416)
                            self.send_header("Content-Range", f"bytes */{size}")
                            self.send_header("Content-Length", "0")
                            self.end_headers()
                            return
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start + 1))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if body:
                    with open(p, "rb") as f:
                        f.seek(start)
                        left = end - start + 1
                        while left > 0:
                            chunk = f.read(min(left, 1 << 20))
                            if not chunk:
                                break
                            self.wfile.write(chunk)
                            left -= len(chunk)

        self.server = _serve(Handler)
        self.port = self.server.server_address[1]
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


# ----- the registry ----------------------------------------------------------------

def _creds_str(creds) -> Optional[str]:
    if creds is None:
        return None
    return creds if isinstance(creds, str) else f"{creds[0]}:{creds[1]}"


class Registry:
    """One `docker-registry serve` on 127.0.0.1 (see the module docstring)."""

    def __init__(self, tmp_path, auth: Optional[str] = None, tls: bool = False,
                 users: Optional[dict] = None, deny=(), public=(), redirect: bool = False,
                 token_header: str = "x5c", expires_in: int = 300):
        if auth not in (None, "htpasswd", "token"):
            raise ValueError(f"auth={auth!r}: want None, 'htpasswd' or 'token'")
        for tool in ("docker-registry", "skopeo"):
            if not shutil.which(tool):
                pytest.skip(f"{tool} not installed (scripts/install-deps.sh)")
        self.auth, self.tls, self.redirect = auth, tls, redirect
        self.users = dict(users if users is not None else {"alice": "secret"})
        self.dir = Path(tempfile.mkdtemp(prefix="registry-", dir=tmp_path))
        self.storage = self.dir / "storage"
        self.storage.mkdir()
        self.log_path = self.dir / "registry.log"
        self.config_path = self.dir / "config.yml"
        self.port = free_port()
        self.proc = None
        self._log = None
        self.start_seconds = []  # how long each start took to answer /v2/
        self.ca_file = None
        self.cert_dir = None
        self.token_server = None
        self.file_server = None
        self._token_opts = dict(deny=deny, public=public, header=token_header,
                                expires_in=expires_in)
        self._closed = False

    # addresses

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}"

    def ref(self, repo: str, tag: str = "latest", host: Optional[str] = None) -> str:
        sep = "@" if tag.startswith("sha256:") else ":"
        return f"{host or self.host}/{repo}{sep}{tag}"

    @property
    def creds(self) -> Optional[str]:
        """"user:password" of the first user when auth is on, else None."""
        if self.auth is None or not self.users:
            return None
        u = next(iter(self.users))
        return f"{u}:{self.users[u]}"

    def blob_path(self, digest: str) -> Path:
        """Where the filesystem storage keeps a blob (to corrupt or remove it)."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def log_tail(self, n: int = 40) -> str:
        return _tail(self.log_path, n)

    # life cycle

    def _write_config(self) -> None:
        d = self.dir
        lines = ["version: 0.1",
                 "log:", "  level: info", "  formatter: text",
                 "storage:",
                 "  filesystem:", f"    rootdirectory: {self.storage}",
                 "  delete:", "    enabled: true",
                 "  maintenance:", "    uploadpurging:", "      enabled: false",
                 "http:", f"  addr: {self.host}",
                 # fixed, so that an upload started before a restart stays valid
                 f"  secret: dsec-test-{self.port}",
                 "  headers:", "    X-Content-Type-Options: [nosniff]"]
        if self.tls:
            cert, key = self_signed(d, "127.0.0.1", "tls")
            self.ca_file = cert
            self.cert_dir = d / "certs"
            self.cert_dir.mkdir(exist_ok=True)
            shutil.copyfile(cert, self.cert_dir / "ca.crt")
            lines += ["  tls:", f"    certificate: {cert}", f"    key: {key}"]
        if self.auth == "htpasswd":
            import bcrypt
            pw = d / "htpasswd"
            pw.write_text("".join(
                f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt(rounds=5)).decode()}\n"
                for u, p in self.users.items()))
            lines += ["auth:", "  htpasswd:", f"    realm: {SERVICE}", f"    path: {pw}"]
        elif self.auth == "token":
            if self.token_server is None:
                self.token_server = TokenServer(d, self.users, **self._token_opts).start()
            ts = self.token_server
            lines += ["auth:", "  token:", f"    realm: {ts.realm}", f"    service: {SERVICE}",
                      f"    issuer: {ISSUER}", f"    rootcertbundle: {ts.cert}"]
        if self.redirect:
            if self.file_server is None:
                self.file_server = FileServer(self.storage).start()
            lines += ["middleware:", "  storage:", "    - name: redirect", "      options:",
                      f"        baseurl: {self.file_server.url}"]
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self) -> "Registry":
        if not self.config_path.exists():
            self._write_config()
        self._log = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(["docker-registry", "serve", str(self.config_path)],
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.proc.returncode}; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                status, _, _ = self.request("GET", "/v2/", timeout=2)
                if status in (200, 401):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self._terminate(signal.SIGKILL)
                raise RuntimeError(f"docker-registry did not answer /v2/ within "
                                   f"{START_TIMEOUT_S} s; log tail:\n{self.log_tail()}")
            time.sleep(0.02)
        self.start_seconds.append(time.monotonic() - t0)
        return self

    def _terminate(self, sig) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def stop(self) -> Optional[int]:
        """SIGTERM to the registry process (the token/redirect servers stay)."""
        return self._terminate(signal.SIGTERM)

    def kill(self) -> Optional[int]:
        """SIGKILL to the registry process, at once (e.g. mid-blob)."""
        return self._terminate(signal.SIGKILL)

    def restart(self) -> "Registry":
        """The registry again, same port and storage (after stop/kill, or running)."""
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        for s in (self.token_server, self.file_server):
            if s is not None:
                s.stop()

    def __enter__(self) -> "Registry":
        if self.proc is None:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # raw HTTP

    def connection(self, timeout: float = 30, port: Optional[int] = None):
        if self.tls:
            ctx = ssl.create_default_context(cafile=str(self.ca_file))
            return http.client.HTTPSConnection("127.0.0.1", port or self.port, timeout=timeout,
                                               context=ctx)
        return http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=timeout)

    def token(self, scopes=(), creds=_DEFAULT) -> str:
        """A bearer token from the token server (as a client would get one)."""
        creds = self.creds if creds is _DEFAULT else _creds_str(creds)
        q = urllib.parse.urlencode([("service", SERVICE)] + [("scope", s) for s in scopes])
        conn = http.client.HTTPConnection("127.0.0.1", self.token_server.port, timeout=10)
        hdrs = {"User-Agent": "dsec-test-harness"}
        if creds:
            hdrs["Authorization"] = "Basic " + base64.b64encode(creds.encode()).decode()
        try:
            conn.request("GET", "/token?" + q, headers=hdrs)
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"token server: {r.status} {body!r}")
            return json.loads(body)["token"]
        finally:
            conn.close()

    def request(self, method: str, path: str, headers=None, body=None, creds=None,
                bearer: Optional[str] = None, timeout: float = 30):
        """One request to the registry: (status, headers (lower-case keys), body).
        creds "u:p" sends Basic; bearer sends that token."""
        hdrs = {"User-Agent": "dsec-test-harness", **(headers or {})}
        if creds is not None:
            hdrs["Authorization"] = "Basic " + base64.b64encode(
                _creds_str(creds).encode()).decode()
        if bearer is not None:
            hdrs["Authorization"] = "Bearer " + bearer
        conn = self.connection(timeout)
        try:
            conn.request(method, path, body=body, headers=hdrs)
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            conn.close()

    def _push_auth(self, repo: str, creds) -> dict:
        creds = self.creds if creds is _DEFAULT else _creds_str(creds)
        if self.auth == "htpasswd" and creds:
            return {"creds": creds}
        if self.auth == "token":
            return {"bearer": self.token([f"repository:{repo}:pull,push"], creds=creds)}
        return {}

    def put_blob(self, repo: str, data, creds=_DEFAULT, auth: Optional[dict] = None) -> str:
        """Uploads a blob (bytes, or a path streamed from disk) unless present:
        POST, then PUT ?digest= of the whole. Returns its digest."""
        auth = self._push_auth(repo, creds) if auth is None else auth
        if isinstance(data, (bytes, bytearray)):
            digest, size = "sha256:" + hashlib.sha256(data).hexdigest(), len(data)
        else:
            h = hashlib.sha256()
            with open(data, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            digest, size = "sha256:" + h.hexdigest(), os.path.getsize(data)
        st, _, _ = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", **auth)
        if st == 200:
            return digest
        st, h, body = self.request("POST", f"/v2/{repo}/blobs/uploads/", **auth)
        if st != 202:
            raise RuntimeError(f"POST blob upload to {repo}: {st} {body!r}")
        loc = urllib.parse.urlsplit(urllib.parse.urljoin(self.url + "/", h["location"]))
        q = urllib.parse.parse_qsl(loc.query) + [("digest", digest)]
        path = loc.path + "?" + urllib.parse.urlencode(q)
        hdrs = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        if isinstance(data, (bytes, bytearray)):
            st, _, body = self.request("PUT", path, headers=hdrs, body=bytes(data), **auth)
        else:
            with open(data, "rb") as f:
                st, _, body = self.request("PUT", path, headers=hdrs, body=f, **auth)
        if st != 201:
            raise RuntimeError(f"PUT blob {digest} to {repo}: {st} {body!r}")
        return digest

    def put_manifest(self, repo: str, ref: str, raw: bytes, media_type: str, creds=_DEFAULT,
                     auth: Optional[dict] = None) -> str:
        """PUT /v2/REPO/manifests/REF as is; returns Docker-Content-Digest."""
        auth = self._push_auth(repo, creds) if auth is None else auth
        st, h, body = self.request("PUT", f"/v2/{repo}/manifests/{ref}", body=raw,
                                   headers={"Content-Type": media_type}, **auth)
        if st != 201:
            raise RuntimeError(f"PUT manifest {repo}:{ref}: {st} {body!r}")
        return h.get("docker-content-digest", "")

    def push_raw(self, layout_dir, repo: str, tag: str = "latest", src_tag: Optional[str] = None,
                 creds=_DEFAULT) -> str:
        """Pushes the image (or image index) tagged `src_tag` (default `tag`) in
        an OCI layout directory through the registry API, byte for byte: no
        recompression (skopeo gzips uncompressed layers on the way to a
        registry), media types and digests kept. Returns the manifest digest."""
        layout_dir = Path(layout_dir)
        index = json.loads((layout_dir / "index.json").read_bytes())
        want = src_tag or tag
        descs = [m for m in index["manifests"]
                 if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == want]
        if not descs and len(index["manifests"]) == 1:
            descs = index["manifests"]
        if not descs:
            raise KeyError(f"no manifest tagged {want!r} in {layout_dir}/index.json")
        auth = self._push_auth(repo, creds)
        blob = lambda d: layout_dir / "blobs" / d.split(":")[0] / d.split(":")[1]  # noqa: E731

        def push(desc: dict, ref: str) -> str:
            raw = blob(desc["digest"]).read_bytes()
            doc = json.loads(raw)
            for child in doc.get("manifests", []):
                push(child, child["digest"])
            for b in ([doc["config"]] if "config" in doc else []) + doc.get("layers", []):
                self.put_blob(repo, blob(b["digest"]), auth=auth)
            mt = desc.get("mediaType") or doc.get("mediaType")
            return self.put_manifest(repo, ref, raw, mt, auth=auth)

        return push(descs[0], tag)

    # skopeo

    def skopeo(self, *args, timeout: float = 300, check: bool = False,
               override_arch: Optional[str] = None) -> subprocess.CompletedProcess:
        """Runs skopeo isolated from the host's configuration: HOME, auth file,
        registries.conf and tmpdir in this registry's directory, and (as root)
        /var/lib of a private mount namespace bound to it, so that the blob info
        cache (/var/lib/containers/cache) is this registry's own."""
        d = self.dir / "skopeo"
        for sub in ("home", "tmp", "varlib"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        conf = d / "registries.conf"
        if not conf.exists():
            conf.write_text("unqualified-search-registries = []\n")
        env = dict(os.environ, HOME=str(d / "home"), XDG_CONFIG_HOME=str(d / "home/.config"),
                   XDG_DATA_HOME=str(d / "home/.local/share"),
                   XDG_RUNTIME_DIR=str(d / "home"), REGISTRY_AUTH_FILE=str(d / "auth.json"),
                   CONTAINERS_REGISTRIES_CONF=str(conf))
        glob = ["--insecure-policy", "--tmpdir", str(d / "tmp")]
        if override_arch:
            glob += ["--override-arch", override_arch]
        cmd = ["skopeo", *glob, *map(str, args)]
        if os.geteuid() == 0 and shutil.which("unshare"):
            cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                   'mount --bind "$0" /var/lib && exec "$@"', str(d / "varlib"), *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                           stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise AssertionError(f"skopeo {' '.join(map(str, args))} exited {r.returncode}:\n"
                                 f"{r.stderr}\nregistry log tail:\n{self.log_tail(20)}")
        return r

    def _tls_args(self, prefix: str, host: Optional[str], tls_verify: bool) -> list:
        pre = f"--{prefix}-" if prefix else "--"
        if self.tls and (host is None or host == self.host) and tls_verify:
            return [f"{pre}cert-dir={self.cert_dir}", f"{pre}tls-verify=true"]
        return [f"{pre}tls-verify=false"]

    def _creds_args(self, prefix: str, creds) -> list:
        c = self.creds if creds is _DEFAULT else _creds_str(creds)
        if c is None:
            return [f"--{prefix}-no-creds" if prefix else "--no-creds"]
        return [f"--{prefix}-creds={c}" if prefix else f"--creds={c}"]

    def push_oci(self, layout_dir, repo: str, tag: str = "latest", all_platforms: bool = False,
                 fmt: Optional[str] = None, creds=_DEFAULT, src_tag: Optional[str] = None,
                 host: Optional[str] = None, tls_verify: bool = True, check: bool = True,
                 extra=()) -> subprocess.CompletedProcess:
        """skopeo copy [--all] [--format FMT] oci:DIR:SRC_TAG docker://HOST/REPO:TAG.
        fmt: None (kept: OCI), "v2s2" or "oci". creds: "u:p", None (anonymous) or
        the first user's by default. host: push through another address (a proxy)."""
        args = ["copy", *(["--all"] if all_platforms else []),
                *(["--format", fmt] if fmt else []),
                *self._tls_args("dest", host, tls_verify), *self._creds_args("dest", creds),
                *extra, f"oci:{layout_dir}:{src_tag or tag}",
                f"docker://{self.ref(repo, tag, host)}"]
        return self.skopeo(*args, check=check)

    def pull_oci(self, repo: str, tag: str, dest_dir, dest_tag: Optional[str] = None,
                 all_platforms: bool = False, creds=_DEFAULT, host: Optional[str] = None,
                 tls_verify: bool = True, check: bool = True, extra=(),
                 override_arch: Optional[str] = None) -> subprocess.CompletedProcess:
        """skopeo copy docker://HOST/REPO:TAG oci:DEST_DIR:DEST_TAG (host: e.g. a proxy)."""
        args = ["copy", *(["--all"] if all_platforms else []),
                *self._tls_args("src", host, tls_verify), *self._creds_args("src", creds),
                *extra, f"docker://{self.ref(repo, tag, host)}",
                f"oci:{dest_dir}:{dest_tag or tag.replace('sha256:', 'sha256-')}"]
        return self.skopeo(*args, check=check, override_arch=override_arch)

    def inspect(self, repo: str, tag: str = "latest", creds=_DEFAULT, raw: bool = True,
                config: bool = False, arch: Optional[str] = None, host: Optional[str] = None,
                tls_verify: bool = True):
        """skopeo inspect [--raw] [--config]: the parsed JSON. With raw (default)
        the manifest (or index) as stored; raw=False: skopeo's summary of the image
        for this platform (arch: --override-arch, e.g. "arm64")."""
        args = ["inspect", *(["--raw"] if raw else []), *(["--config"] if config else []),
                *self._tls_args("", host, tls_verify), *self._creds_args("", creds),
                f"docker://{self.ref(repo, tag, host)}"]
        r = self.skopeo(*args, check=True, override_arch=arch)
        return json.loads(r.stdout)

    def delete(self, repo: str, ref: str, creds=_DEFAULT) -> subprocess.CompletedProcess:
        return self.skopeo("delete", *self._tls_args("", None, True),
                           *self._creds_args("", creds), f"docker://{self.ref(repo, ref)}")


# ----- fixtures --------------------------------------------------------------------

@pytest.fixture
def make_registry(tmp_path):
    """make_registry(**Registry kwargs) -> a started Registry, closed after the test."""
    made = []

    def make(**kw) -> Registry:
        r = Registry(tmp_path, **kw)
        made.append(r)
        return r.__enter__()
    yield make
    for r in made:
        r.close()


@pytest.fixture
def registry(tmp_path):
    """A registry without auth, plain HTTP."""
    with Registry(tmp_path) as r:
        yield r


@pytest.fixture
def htpasswd_registry(tmp_path):
    """Basic auth (alice:secret), plain HTTP."""
    with Registry(tmp_path, auth="htpasswd") as r:
        yield r


@pytest.fixture
def token_registry(tmp_path):
    """Bearer token auth (alice:secret; repository `denied` refused), plain HTTP."""
    with Registry(tmp_path, auth="token", deny={"denied"}) as r:
        yield r


@pytest.fixture
def tls_registry(tmp_path):
    """No auth, https with a self-signed certificate (`ca_file`, `cert_dir`)."""
    with Registry(tmp_path, tls=True) as r:
        yield r
