"""HTTP client for the dsec REST API v1 (standard library only).

Thread safety: a :class:`Client` may be shared by any number of threads. Each
thread gets its own persistent (keep-alive) HTTP connection; a connection the
server closed while idle is replaced transparently, and a request whose body can
be sent again (bytes, or a seekable file) is retried once when the reused
connection turns out to be dead. Streams (``exec_stream``) hold their thread's
connection until they are exhausted or closed. Requests with a small body (up to
64 KiB, or none) and a JSON answer, ``run`` and ``exec`` among them, are framed
by the SDK itself on that connection (one write out, the answer read whole);
larger, file and streamed bodies and streamed answers go through http.client.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import json
import os
import select
import socket
import threading
import time
import urllib.parse
import weakref
from typing import Any, BinaryIO, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from .errors import DeadlineExceeded, DsecError, Unavailable, error_from_response
from .models import ExecEvent, ExecResult, FileEntry, Image

DEFAULT_URL = "http://127.0.0.1:7070"
DEFAULT_DATA_DIR = "/var/lib/dsec"
DEFAULT_TIMEOUT = 30.0
_CHUNK = 1 << 20
_USER_AGENT = "dsec-python/0.1"

class _Stale(Exception):
    """The kept-alive connection was closed before any byte of the answer."""


# Errors that mean "the kept-alive connection was already dead when we used it".
_STALE_ERRORS = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                 ConnectionAbortedError, _Stale)

# A request body up to this size goes out in the same write as its headers.
_COALESCE_MAX = 64 * 1024


class _OneWrite:
    """http.client writes a request's headers and its body separately: with
    TCP_NODELAY (which it sets) those are two segments, and the server wakes
    for each. A small bytes body is appended to the headers instead (one
    write, one segment). Larger, file or chunked bodies go as before."""

    def _send_output(self, message_body: Any = None, encode_chunked: bool = False) -> None:
        buf = getattr(self, "_buffer", None)
        if (isinstance(buf, list) and not encode_chunked
                and isinstance(message_body, (bytes, bytearray))
                and len(message_body) <= _COALESCE_MAX):
            buf.extend((b"", b""))
            msg = b"\r\n".join(buf) + bytes(message_body)
            del buf[:]
            self.send(msg)  # type: ignore[attr-defined]
            return
        super()._send_output(message_body, encode_chunked)  # type: ignore[misc]


class _HTTPConnection(_OneWrite, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_OneWrite, http.client.HTTPSConnection):
    pass


class _BadResponse(Exception):
    """The server's bytes are not an HTTP/1.1 response we can frame."""


def _read_response(sock: socket.socket, method: str) -> Tuple[int, str, bytes, bool]:
    """Reads one whole HTTP/1.1 response from ``sock``: (status, reason, body,
    whether the connection must be closed after it). Bodies are framed by
    Content-Length, chunked encoding, or the connection's end."""
    buf = b""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            lines = buf[:end].decode("latin-1").split("\r\n")
            rest = buf[end + 4:]
            first = lines[0].split(" ", 2)
            if len(first) < 2 or not first[0].startswith("HTTP/1.") or not first[1].isdigit():
                raise _BadResponse(f"bad status line {lines[0][:80]!r}")
            status = int(first[1])
            if 100 <= status < 200:  # an interim answer: the real one follows
                buf = rest
                continue
            break
        if len(buf) > 256 * 1024:
            raise _BadResponse("response headers over 256 KiB")
        chunk = sock.recv(65536)
        if not chunk:
            if not buf:
                raise _Stale("connection closed before the answer")
            raise _BadResponse("connection closed inside the response headers")
        buf += chunk
    reason = first[2] if len(first) > 2 else ""
    length: Optional[int] = None
    chunked = False
    close = first[0] == "HTTP/1.0"
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            try:
                length = int(value.strip())
            except ValueError:
                raise _BadResponse(f"bad Content-Length {value.strip()[:40]!r}") from None
        elif name == "transfer-encoding":
            chunked = "chunked" in value.lower()
        elif name == "connection":
            token = value.strip().lower()
            if token in ("close", "keep-alive"):
                close = token == "close"
    if method == "HEAD" or status in (204, 304):
        return status, reason, b"", close or bool(rest)
    if chunked:
        body, rest = _read_chunked(sock, rest)
        return status, reason, body, close or bool(rest)
    if length is None:  # to the connection's end
        parts = [rest]
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return status, reason, b"".join(parts), True
            parts.append(chunk)
    parts, have = [rest], len(rest)
    while have < length:
        chunk = sock.recv(min(length - have, 1 << 20))
        if not chunk:
            raise _BadResponse("connection closed inside the response body")
        parts.append(chunk)
        have += len(chunk)
    body = b"".join(parts)
    # Bytes past the answer (none from a sane server): not reused.
    return status, reason, body[:length], close or have > length


def _read_line(sock: socket.socket, buf: bytes, where: str) -> Tuple[bytes, bytes]:
    """The next CRLF-ended line of a chunked body, and what follows it."""
    while b"\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise _BadResponse(f"connection closed inside {where}")
        buf += chunk
    line, rest = buf.split(b"\r\n", 1)
    return line, rest


def _read_chunked(sock: socket.socket, buf: bytes) -> Tuple[bytes, bytes]:
    out = []
    while True:
        line, buf = _read_line(sock, buf, "a chunked body")
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            raise _BadResponse(f"bad chunk size {line[:40]!r}") from None
        if size == 0:  # trailers, then the empty line
            while True:
                line, buf = _read_line(sock, buf, "the trailers")
                if not line:
                    return b"".join(out), buf
        while len(buf) < size + 2:
            chunk = sock.recv(65536)
            if not chunk:
                raise _BadResponse("connection closed inside a chunk")
            buf += chunk
        out.append(buf[:size])
        buf = buf[size + 2:]


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


class _Retry(Exception):
    pass


class Client:
    """A connection to one dsec API endpoint.

    Args:
        url: base URL; default ``$DSEC_URL`` or ``http://127.0.0.1:7070``.
        token: bearer token; default ``$DSEC_TOKEN``, else ``<data dir>/token``
            where the data dir is ``$DSEC_DATA_DIR`` or ``/var/lib/dsec``.
        timeout: socket timeout in seconds for ordinary calls. Exec calls wait
            for the command's own timeout plus this much.
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = DEFAULT_TIMEOUT):
        url = url or os.environ.get("DSEC_URL") or DEFAULT_URL
        if "://" not in url:
            url = "http://" + url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {url!r}")
        if not parts.hostname:
            raise ValueError(f"no host in URL {url!r}")
        self.url = url.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._base = parts.path.rstrip("/")
        if token is None:
            token = os.environ.get("DSEC_TOKEN")
        if token is None:
            data_dir = os.environ.get("DSEC_DATA_DIR") or DEFAULT_DATA_DIR
            token = _read_text(os.path.join(data_dir, "token"))
        self.token = token or None
        self.timeout = float(timeout)
        self._local = threading.local()
        # every thread's connection, so that close() reaches them all
        self._all_conns: "weakref.WeakSet[http.client.HTTPConnection]" = weakref.WeakSet()
        self._conns_lock = threading.Lock()

    @classmethod
    def from_data_dir(cls, path: str, timeout: float = DEFAULT_TIMEOUT) -> "Client":
        """A client for the ``dsec up`` whose data dir is ``path`` (reads
        ``up.json`` for the URL and ``token`` for the bearer token)."""
        with open(os.path.join(path, "up.json"), "r", encoding="utf-8") as f:
            up = json.load(f)
        url = up.get("url")
        if not url:
            raise ValueError(f"{path}/up.json has no url")
        token = _read_text(os.path.join(path, "token"))
        if token is None:
            raise ValueError(f"cannot read {path}/token")
        c = cls(url=url, token=token, timeout=timeout)
        c.server_pid = up.get("pid")
        return c

    server_pid: Optional[int] = None

    # ----- connection handling -------------------------------------------------

    def _new_conn(self, timeout: float) -> http.client.HTTPConnection:
        if self._scheme == "https":
            conn: http.client.HTTPConnection = _HTTPSConnection(
                self._host, self._port, timeout=timeout)
        else:
            conn = _HTTPConnection(self._host, self._port, timeout=timeout)
        conn.blocksize = 256 * 1024  # how much of a file body is sent per write
        with self._conns_lock:
            self._all_conns.add(conn)
        return conn

    def _conn(self, timeout: float) -> Tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it is an open, reused one."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._new_conn(timeout)
            self._local.conn = conn
        conn.timeout = timeout
        reused = conn.sock is not None
        if reused and self._peer_closed(conn.sock):
            conn.close()
            reused = False
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, reused

    @staticmethod
    def _peer_closed(sock: socket.socket) -> bool:
        """True if an idle kept-alive socket was closed by the peer (or is unusable).

        An idle connection has nothing to read; if it polls readable, the server
        either closed it (EOF) or sent bytes we did not ask for: drop it either way.
        """
        try:
            p = select.poll()
            p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Closes every kept-alive connection (of all threads)."""
        with self._conns_lock:
            conns = list(self._all_conns)
        for c in conns:
            try:
                c.close()
            except Exception:
                pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _path(self, path: str, query: Optional[Sequence[Tuple[str, str]]] = None) -> str:
        p = self._base + path
        if query:
            p += "?" + urllib.parse.urlencode(list(query), quote_via=urllib.parse.quote)
        return p

    def _headers(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        h = {"User-Agent": _USER_AGENT, "Accept": "application/json"}
        if self.token:
            h["Authorization"] = "Bearer " + self.token
        if extra:
            h.update(extra)
        return h

    def _transport_error(self, e: BaseException, what: str,
                         timeout: float) -> Optional[DsecError]:
        """The error a request that failed on its connection raises (``e``
        from _send or _exchange), or None when ``e`` is no transport failure
        and goes up as it is."""
        if isinstance(e, _STALE_ERRORS):
            return Unavailable("unavailable", f"{what}: connection lost: {e}")
        if isinstance(e, socket.timeout):
            return DeadlineExceeded("deadline_exceeded", f"{what}: no answer within {timeout:g}s")
        if isinstance(e, (OSError, http.client.HTTPException, _BadResponse)):
            return Unavailable("unavailable", f"{what}: cannot reach {self.url}: {e}")
        return None

    def _send(self, method: str, path: str, body: Any = None,
              headers: Optional[Dict[str, str]] = None,
              timeout: Optional[float] = None) -> http.client.HTTPResponse:
        """Sends one request and returns the response (status already checked:
        an error status raises after reading its body). The caller must read the
        response to its end (or call ``_drop_conn``) before the next request."""
        timeout = self.timeout if timeout is None else timeout
        rewind: Optional[int] = None
        resendable = body is None or isinstance(body, (bytes, bytearray, memoryview, str))
        if not resendable and hasattr(body, "seek") and hasattr(body, "tell"):
            try:
                if body.seekable() if hasattr(body, "seekable") else True:
                    rewind = body.tell()
                    resendable = True
            except (OSError, ValueError):
                pass
        hdrs = self._headers(headers)
        for attempt in (0, 1):
            conn, reused = self._conn(timeout)
            try:
                if attempt == 1 and rewind is not None:
                    body.seek(rewind)
                conn.request(method, path, body=body, headers=hdrs)
                resp = conn.getresponse()
            except BaseException as e:
                conn.close()
                if attempt == 0 and reused and resendable and isinstance(e, _STALE_ERRORS):
                    continue
                err = self._transport_error(e, f"{method} {path}", timeout)
                if err is None:
                    raise
                raise err from e
            if resp.status >= 400:
                try:
                    data = resp.read()
                except (OSError, http.client.HTTPException):
                    data = b""
                    conn.close()
                if method == "HEAD":
                    conn.close()  # see _call: no trust in HEAD answers being bodiless
                raise error_from_response(resp.status, data, resp.reason)
            return resp
        raise AssertionError("unreachable")

    def _exchange(self, method: str, path: str, body: Optional[bytes],
                  headers: Dict[str, str], timeout: float) -> Tuple[int, bytes]:
        """A request with a small bytes body (or none) and its whole answer, on
        this thread's kept-alive connection, framed here rather than by
        http.client, whose header parsing (the email package) cost ~0.2 ms
        of client CPU per call: ``client.run`` is called back to back by the
        tens of thousands. Returns (status, body); an error status raises; a
        kept-alive connection found dead before any answer is retried once
        on a new one, as in ``_send``."""
        host = f"[{self._host}]" if self._host and ":" in self._host else self._host
        default = 443 if self._scheme == "https" else 80
        head = [f"{method} {path} HTTP/1.1\r\nHost: {host}"
                + ("" if self._port == default else f":{self._port}")
                + "\r\nAccept-Encoding: identity\r\n"]
        for k, v in headers.items():
            head.append(f"{k}: {v}\r\n")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body or b'')}\r\n")
        head.append("\r\n")
        msg = "".join(head).encode("latin-1") + (body or b"")
        for attempt in (0, 1):
            conn, reused = self._conn(timeout)
            try:
                if conn.sock is None:
                    conn.connect()
                conn.send(msg)
                status, reason, data, close = _read_response(conn.sock, method)
            except BaseException as e:
                conn.close()
                if attempt == 0 and reused and isinstance(e, _STALE_ERRORS):
                    continue
                err = self._transport_error(e, f"{method} {path}", timeout)
                if err is None:
                    raise
                raise err from e
            if close:
                conn.close()
            if status >= 400:
                raise error_from_response(status, data, reason)
            return status, data
        raise AssertionError("unreachable")

    def _read_all(self, resp: http.client.HTTPResponse, what: str) -> bytes:
        try:
            return resp.read()
        except socket.timeout as e:
            self._drop_conn()
            raise DeadlineExceeded("deadline_exceeded", f"{what}: response timed out") from e
        except (OSError, http.client.HTTPException) as e:
            self._drop_conn()
            raise Unavailable("unavailable", f"{what}: connection lost: {e}") from e

    def _call(self, method: str, path: str, *, query: Optional[Sequence[Tuple[str, str]]] = None,
              json_body: Any = None, body: Any = None,
              headers: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
              raw: bool = False) -> Any:
        """One request/response; returns the decoded JSON (or bytes if raw)."""
        hdrs = dict(headers or {})
        if json_body is not None:
            body = json.dumps(json_body, separators=(",", ":")).encode("utf-8")
            hdrs["Content-Type"] = "application/json"
        p = self._path(path, query)
        if method != "HEAD" and (body is None or (isinstance(body, (bytes, bytearray))
                                                  and len(body) <= _COALESCE_MAX)):
            status, data = self._exchange(method, p, None if body is None else bytes(body),
                                          self._headers(hdrs),
                                          self.timeout if timeout is None else timeout)
        else:
            resp = self._send(method, p, body=body, headers=hdrs, timeout=timeout)
            status, data = resp.status, self._read_all(resp, f"{method} {p}")
            if method == "HEAD":
                # A server that wrongly sends a body with a HEAD answer would leave
                # stray bytes on the kept-alive connection; HEAD is rare, so start afresh.
                self._drop_conn()
                return data
        if raw:
            return data
        if not data.strip():
            return {}
        try:
            return json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DsecError("internal", f"{method} {p}: response is not JSON: {data[:200]!r}",
                            status, None, data) from e

    # ----- health ---------------------------------------------------------------

    def health(self) -> Dict[str, Any]:
        """``GET /v1/health`` → ``{"status": "ok", "version": ...}`` (no auth needed)."""
        return self._call("GET", "/v1/health")

    # ----- sandboxes ------------------------------------------------------------

    def create(self, image: Optional[str] = None, backend: str = "container",
               cpu: Optional[float] = None,
               memory_mb: Optional[int] = None, disk_mb: Optional[int] = None,
               pids: Optional[int] = None, ttl_s: Optional[int] = None,
               env: Optional[Dict[str, str]] = None,
               labels: Optional[Dict[str, str]] = None,
               workspaces: Optional[Sequence[str]] = None,
               toolkits: Optional[Sequence[str]] = None,
               diffs: Optional[Sequence[str]] = None,
               snapshot: Optional[str] = None,
               policy: Optional[str] = None,
               user: Optional[Union[str, int]] = None,
               idle_timeout_s: Optional[int] = None, auto_pause_s: Optional[int] = None,
               pool: Optional[str] = None, burstable: Optional[bool] = None,
               timeout: Optional[float] = None, **extra: Any) -> "Sandbox":
        """Creates a sandbox and returns it once it is running (or failed).

        ``workspaces``, ``toolkits`` and ``diffs`` stack more layers on the
        image, in that order (each an image ref of that kind or a layer digest),
        so a toolkit can change without rebuilding the base. ``snapshot`` (an
        image made by ``Sandbox.pack_diff``) restores that sandbox's files on
        the stack it was made on; ``image`` may then be omitted. ``policy``
        names the security policy it starts under (``client.policies()``;
        default ``"default"``); ``Sandbox.set_phase`` switches it later.

        The image's config (``Image.config``, from an imported OCI or Docker
        image) gives the defaults: execs run as its ``user`` in its
        ``working_dir`` (made if missing) with its ``env``. ``user`` (a name,
        uid, ``"name:group"`` or ``"uid:gid"``; ``"root"`` or ``0`` for root)
        replaces the image's user, and ``env`` overrides its variables key by
        key; an exec's own ``user``/``cwd``/``env`` win over both.
        The sandbox belongs to the platform, not to this client: it runs
        until deleted, its ``ttl_s`` passes, or it has had no call for
        ``idle_timeout_s``; ``auto_pause_s`` pauses it (frozen: no CPU, memory
        kept) after that long without a call, and the next call resumes it.
        ``backend="fncall"`` makes a function-call sandbox (docs/fncall.md):
        the image's layers read-only, a tmpfs ``/scratch`` of ``disk_mb`` as the
        only writable place, a warm python zygote; every ``exec`` is a call
        (per-call rlimits, default cwd ``/scratch``, its processes killed when
        it ends), :meth:`Sandbox.run` runs code, and file calls may change
        only ``/scratch``, whose files persist for the sandbox's lifetime.
        ``backend="vm"`` boots a ``disk`` image (``dsec image import --kind
        disk``) as a full QEMU machine (docs/vm.md): exec and files through
        qemu-guest-agent, and :meth:`Sandbox.screenshot`, :meth:`Sandbox.type`,
        :meth:`Sandbox.key`, :meth:`Sandbox.mouse` for computer use.
        ``pool`` names the node pool to place it in (default ``"default"``);
        ``burstable=True`` lets it go to the platform's burst pool while that
        pool is busy (docs/cluster.md).
        Raises NotFound for an unknown image, InvalidArgument (with ``field``)
        for a bad parameter. ``extra`` keys are sent as they are.
        """
        req: Dict[str, Any] = {"backend": backend}
        if image:
            req["image"] = image
        if snapshot is not None:
            req["snapshot"] = snapshot
        for k, v in (("cpu", cpu), ("memory_mb", memory_mb), ("disk_mb", disk_mb),
                     ("pids", pids), ("ttl_s", ttl_s), ("env", env), ("labels", labels),
                     ("workspaces", list(workspaces) if workspaces is not None else None),
                     ("toolkits", list(toolkits) if toolkits is not None else None),
                     ("diffs", list(diffs) if diffs is not None else None),
                     ("policy", policy), ("user", str(user) if user is not None else None),
                     ("idle_timeout_s", idle_timeout_s), ("auto_pause_s", auto_pause_s),
                     ("pool", pool), ("burstable", burstable)):
            if v is not None:
                req[k] = v
        req.update(extra)
        info = self._call("POST", "/v1/sandboxes", json_body=req,
                          timeout=timeout if timeout is not None else max(self.timeout, 120.0))
        return Sandbox(self, info)

    def run(self, code: str, language: str = "python", *, image: Optional[str] = None,
            stdin: Union[None, str, bytes] = None,
            files: Optional[Dict[str, Union[str, bytes]]] = None,
            timeout: Optional[float] = None, limits: Optional[Dict[str, int]] = None,
            env: Optional[Dict[str, str]] = None, max_output_bytes: Optional[int] = None,
            encoding: Optional[str] = None) -> ExecResult:
        """Runs ``code`` once as a function call and returns its ExecResult
        (``POST /v1/run``, docs/fncall.md); no sandbox handle is needed.

        The call runs in a warm ``fncall`` sandbox of ``image`` (default: the
        server's, ``debian:latest``) from a per-node pool: python in a fresh
        fork of a pre-imported interpreter, bash (or a language the node
        configures) exec'd afresh, in a new directory holding ``files``
        (relative path -> text or bytes) that is removed afterwards; nothing a
        call leaves (files, processes, environment, globals) reaches the next.
        ``timeout`` (seconds, default 10) is the wall clock; ``limits`` sets
        rlimits: ``cpu_s``, ``memory_mb``, ``processes``, ``file_size_mb``,
        ``open_files``. The result's ``limit`` says which limit stopped it.
        Errors: InvalidArgument (unknown language, bad field; ``field`` names
        it), PayloadTooLarge (code over 256 KiB, files over 384 KiB, stdin over
        1 MiB), ResourceExhausted (every pool sandbox of the node busy).
        """
        body = _run_body(code, language, stdin, timeout, limits, env, max_output_bytes,
                         encoding)
        if image is not None:
            body["image"] = image
        if files:
            text: Dict[str, str] = {}
            binary: Dict[str, str] = {}
            for name, data in files.items():
                if isinstance(data, bytes):
                    binary[name] = base64.b64encode(data).decode("ascii")
                else:
                    text[name] = data
            if text:
                body["files"] = text
            if binary:
                body["files_b64"] = binary
        t = (10.0 if timeout is None else float(timeout)) + self.timeout
        doc = self._call("POST", "/v1/run", json_body=body, timeout=t)
        return ExecResult.from_json(doc, base64_output=(encoding == "base64"))

    def create_batch(self, count: int, image: Optional[str] = None, *,
                     all_or_nothing: bool = False, wait: bool = False,
                     progress: bool = False, timeout: Optional[float] = None,
                     **spec: Any) -> "Batch":
        """``POST /v1/batches``: ``count`` sandboxes (1..32768) of one spec.

        ``spec`` takes the keyword arguments of :meth:`create` (``backend``,
        ``cpu``, ``memory_mb``, ``labels``, ...). The call returns at once with
        the batch stored (its sandboxes ``pending``); the platform creates them
        in the background and a restart of it resumes the batch.
        ``all_or_nothing=True`` reserves room for all of them first and refuses
        the batch (ResourceExhausted, field ``count``) when not all fit; a
        sandbox failing later destroys the rest. A batch past the tenant's
        quota is refused whole (QuotaExceeded). ``wait=True`` returns after
        :meth:`Batch.wait` (``timeout`` s, a progress bar on stderr with
        ``progress=True``). Bad spec fields raise InvalidArgument with
        ``field`` ``spec.<name>``.
        """
        body: Dict[str, Any] = {"backend": spec.pop("backend", "container")}
        if image:
            body["image"] = image
        if "user" in spec and spec["user"] is not None:
            spec["user"] = str(spec["user"])
        for k in ("workspaces", "toolkits", "diffs", "readonly_paths", "hidden_paths"):
            if spec.get(k) is not None:
                spec[k] = list(spec[k])
        body.update({k: v for k, v in spec.items() if v is not None})
        doc = self._call("POST", "/v1/batches",
                         json_body={"count": count, "spec": body,
                                    "all_or_nothing": all_or_nothing})
        b = Batch(self, doc)
        if wait:
            b.wait(timeout=timeout, progress=progress)
        return b

    def batch(self, batch_id: str) -> "Batch":
        """``GET /v1/batches/{id}``; unknown id → NotFound."""
        return Batch(self, self._call("GET", "/v1/batches/" + _q(batch_id)))

    def batches(self) -> List["Batch"]:
        """``GET /v1/batches``: this tenant's batches (every tenant's for an admin)."""
        return [Batch(self, b) for b in self._call("GET", "/v1/batches").get("batches", [])]

    def destroy_where(self, labels: Optional[Dict[str, str]] = None,
                      batch: Optional[str] = None) -> int:
        """``DELETE /v1/sandboxes?label=k=v&batch=ID``: destroys every live
        sandbox matching all filters (at least one needed); how many."""
        query: List[Tuple[str, str]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if batch:
            query.append(("batch", batch))
        doc = self._call("DELETE", "/v1/sandboxes", query=query, timeout=max(self.timeout, 300.0))
        return int(doc.get("destroyed", 0))

    def get(self, sandbox_id: str) -> "Sandbox":
        """``GET /v1/sandboxes/{id}``; unknown id → NotFound."""
        return Sandbox(self, self._call("GET", "/v1/sandboxes/" + _q(sandbox_id)))

    def sandbox(self, sandbox_id: str) -> "Sandbox":
        """A handle on a sandbox by id, without a request."""
        return Sandbox(self, {"id": sandbox_id})

    def list(self, labels: Optional[Dict[str, str]] = None,
             state: Optional[str] = None, batch: Optional[str] = None) -> List["Sandbox"]:
        """Sandboxes whose labels include all of ``labels`` (and in ``state``,
        and made by batch ``batch``)."""
        query: List[Tuple[str, str]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if state:
            query.append(("state", state))
        if batch:
            query.append(("batch", batch))
        doc = self._call("GET", "/v1/sandboxes", query=query)
        return [Sandbox(self, s) for s in doc.get("sandboxes", [])]

    def destroy(self, sandbox_id: str) -> "Sandbox":
        """``DELETE /v1/sandboxes/{id}`` → the sandbox in state ``stopped``."""
        return Sandbox(self, self._call("DELETE", "/v1/sandboxes/" + _q(sandbox_id),
                                        timeout=max(self.timeout, 60.0)))

    # ----- images and blobs -----------------------------------------------------

    # ----- trajectories (Chronus) ---------------------------------------------

    def trajectories(self) -> List[Dict[str, Any]]:
        """``[{"id","steps","first_at","last_at"}]`` of the stored trajectories."""
        return self._call("GET", "/v1/trajectories")["trajectories"]

    def export_trajectory(self, trajectory_id: str) -> List[Dict[str, Any]]:
        """Every step of a trajectory, in order, as the server's JSON lines:
        request, result (or ``result_b64`` for file bytes), status, timings."""
        data = self._call("GET", "/v1/trajectories/" + _q(trajectory_id), raw=True,
                          headers={"Accept": "application/x-ndjson"})
        return [json.loads(line) for line in data.decode("utf-8").splitlines() if line]

    def recover(self, trajectory_id: str, force: bool = False,
                timeout: Optional[float] = None) -> "Sandbox":
        """Rebuilds a trajectory whose sandbox was lost (its node died; it is
        ``failed``, ``stopped`` or unknown): a new sandbox made as the last one
        was, from the trajectory's latest checkpoint (else from the image),
        with every logged exec, write, mkdir and remove after it re-executed in
        order. It becomes the trajectory's sandbox: steps sent to the old one
        run there. Stored results do not change, so a trainer that replays its
        code through ``new.trajectory(trajectory_id)`` gets them (replayed),
        then goes live.

        Returns the new Sandbox; its ``recovery`` attribute holds the report:
        ``checkpoint_step`` (or None), ``reexecuted_steps``, ``diverged``
        (re-executed steps whose exit status differs from the log, or that
        failed) and ``previous_sandbox``. NotFound for an unknown trajectory;
        Conflict (field ``force``) while its sandbox still runs, unless
        ``force``; FailedPrecondition when it cannot be rebuilt (nothing is
        left behind then)."""
        body: Dict[str, Any] = {"force": True} if force else {}
        report = self._call("POST", "/v1/trajectories/" + _q(trajectory_id) + "/recover",
                            json_body=body,
                            timeout=timeout if timeout is not None else max(self.timeout, 600.0))
        sb = Sandbox(self, report["sandbox"])
        sb.recovery = report
        return sb

    def delete_trajectory(self, trajectory_id: str) -> int:
        """Deletes a trajectory's steps; returns how many. Unknown → NotFound."""
        return self._call("DELETE", "/v1/trajectories/" + _q(trajectory_id))["deleted_steps"]

    # ----- tenants, keys, quotas (docs/tenants.md) ---------------------------

    def whoami(self) -> Dict[str, Any]:
        """``{"tenant","role","key_id","quota","usage"}`` of this client's key."""
        return self._call("GET", "/v1/whoami")

    def create_tenant(self, tenant_id: Optional[str] = None, *, name: Optional[str] = None,
                      role: str = "user", quota: Optional[Dict[str, Any]] = None
                      ) -> Dict[str, Any]:
        """Creates a tenant (admin only): ``tenant_id`` is 1-40 of [a-z0-9-]
        (generated when None); ``role`` is user or admin; ``quota`` any of
        max_sandboxes, max_cpu, max_memory_mb, creates_per_s, create_burst (0:
        no limit). Conflict when the id exists."""
        body: Dict[str, Any] = {"role": role}
        if tenant_id is not None:
            body["id"] = tenant_id
        if name is not None:
            body["name"] = name
        if quota is not None:
            body["quota"] = quota
        return self._call("POST", "/v1/tenants", json_body=body)

    def list_tenants(self) -> List[Dict[str, Any]]:
        """Every tenant with its quota and usage (admin only)."""
        return self._call("GET", "/v1/tenants")["tenants"]

    def tenant(self, tenant_id: str) -> Dict[str, Any]:
        """One tenant with its quota and usage (admin only); unknown → NotFound."""
        return self._call("GET", "/v1/tenants/" + _q(tenant_id))

    def update_tenant(self, tenant_id: str, *, name: Optional[str] = None,
                      role: Optional[str] = None,
                      quota: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Changes a tenant's name, role or quota (the quota fields given; the
        others stay). Admin only."""
        body: Dict[str, Any] = {}
        if name is not None:
            body["name"] = name
        if role is not None:
            body["role"] = role
        if quota is not None:
            body["quota"] = quota
        return self._call("PATCH", "/v1/tenants/" + _q(tenant_id), json_body=body)

    def set_quota(self, tenant_id: str, **quota: Any) -> Dict[str, Any]:
        """``set_quota("acme", max_sandboxes=10, max_memory_mb=8192)``: sets
        those quota fields (0: no limit). Admin only."""
        return self.update_tenant(tenant_id, quota=quota)

    def delete_tenant(self, tenant_id: str) -> Dict[str, Any]:
        """Deletes a tenant and its keys (admin only). Conflict while it has
        live sandboxes; the built-in ``admin`` tenant cannot be deleted."""
        return self._call("DELETE", "/v1/tenants/" + _q(tenant_id))

    def create_key(self, tenant_id: str, name: str = "") -> Dict[str, Any]:
        """A new API key for the tenant (admin only). The returned ``key`` is
        shown this once (the server keeps only its hash); ``id`` names it for
        listing and revoking."""
        return self._call("POST", "/v1/tenants/" + _q(tenant_id) + "/keys",
                          json_body={"name": name})

    def list_keys(self, tenant_id: str) -> List[Dict[str, Any]]:
        """The tenant's keys (id, prefix, name, created_at, revoked_at), never
        the keys themselves. Admin only."""
        return self._call("GET", "/v1/tenants/" + _q(tenant_id) + "/keys")["keys"]

    def revoke_key(self, tenant_id: str, key_id: str) -> Dict[str, Any]:
        """Revokes a key at once (admin only); idempotent."""
        return self._call("DELETE", "/v1/tenants/" + _q(tenant_id) + "/keys/" + _q(key_id))

    def policies(self) -> List[Dict[str, Any]]:
        """The security policies sandboxes can run under: the built-ins
        (default, setup, rollout, eval) and the user's own, each with name,
        description, readonly_paths, hidden_paths, egress, dns, builtin."""
        return self._call("GET", "/v1/policies")["policies"]

    def policy(self, name: str) -> Dict[str, Any]:
        """``GET /v1/policies/{name}``; unknown → NotFound."""
        return self._call("GET", "/v1/policies/" + _q(name))

    def create_policy(self, name: str, *, description: str = "",
                      egress: Optional[Sequence[str]] = None,
                      dns: Optional[Sequence[str]] = None,
                      readonly_paths: Optional[Sequence[str]] = None,
                      hidden_paths: Optional[Sequence[str]] = None,
                      limits: Optional[Dict[str, float]] = None,
                      syscalls: Optional[str] = None) -> Dict[str, Any]:
        """Stores a policy of your own. ``egress`` is an allow-list of
        ``"10.0.0.0/8"``, ``"192.0.2.7:80,443"``, ``"[2001:db8::/32]:443"``
        or ``"mirror.example:80"`` (names resolved by the platform when a
        sandbox switches to the policy); ``dns`` the resolvers written to the
        sandbox's /etc/resolv.conf (allowed on port 53). ``limits`` are
        ceilings while a sandbox runs under the policy: ``cpu``,
        ``memory_mb``, ``pids`` (the lower of these and the sandbox's own
        apply) and ``max_output_bytes``, ``max_exec_timeout_s`` per exec.
        ``syscalls`` is the seccomp profile of execs under it: ``"default"``
        or ``"strict"`` (no ptrace, only unix/inet/inet6/netlink sockets). A
        name in use → Conflict (409)."""
        body: Dict[str, Any] = {"name": name}
        if description:
            body["description"] = description
        for key, val in (("egress", egress), ("dns", dns), ("readonly_paths", readonly_paths),
                         ("hidden_paths", hidden_paths)):
            if val is not None:
                body[key] = list(val)
        if limits is not None:
            body["limits"] = dict(limits)
        if syscalls is not None:
            body["syscalls"] = syscalls
        return self._call("POST", "/v1/policies", json_body=body)

    def delete_policy(self, name: str) -> None:
        """Deletes one of your policies; refused (409) while a live sandbox
        runs under it, and for built-ins."""
        self._call("DELETE", "/v1/policies/" + _q(name))

    def images(self) -> List[Image]:
        return [Image(i) for i in self._call("GET", "/v1/images").get("images", [])]

    def image(self, ref: str) -> Image:
        """``GET /v1/images/{name}[:tag]``; unknown → NotFound."""
        return Image(self._call("GET", "/v1/images/" + _q(ref, safe=":")))

    def delete_image(self, ref: str) -> Dict[str, Any]:
        """Deletes a tag; Conflict while a running sandbox uses it."""
        return self._call("DELETE", "/v1/images/" + _q(ref, safe=":"))

    def create_image(self, name: str, tag: str, layers: Sequence[str],
                     kind: str = "base", config: Optional[Dict[str, Any]] = None,
                     visibility: Optional[str] = None) -> Image:
        """Creates (or replaces) ``name:tag`` from uploaded layer digests, bottom first.

        ``kind`` is base, workspace, toolkit, diff or disk (one bootable blob
        for backend vm, docs/vm.md); a layer keeps the kind of the first image
        that names it (Conflict otherwise). ``config``
        (``{"user": ..., "env": ["K=V", ...], "working_dir": ...}``, each key
        optional) sets the defaults of sandboxes created from the image; a bad
        value raises InvalidArgument with ``field`` ``config.<key>``.

        ``visibility`` is ``"public"`` (every tenant may see and stack it; an
        admin's default, and only admins may publish) or ``"private"`` (its
        tenant only; a user tenant's default, whose image names must start
        with ``"<tenant>/"``).
        """
        body: Dict[str, Any] = {"name": name, "tag": tag, "layers": list(layers), "kind": kind}
        if config is not None:
            body["config"] = config
        if visibility is not None:
            body["visibility"] = visibility
        return Image(self._call("POST", "/v1/images", json_body=body))

    def tag_image(self, source: str, name: str, tag: str = "latest") -> Image:
        """Points ``name:tag`` at the layers (kind and config) of the image ``source``."""
        return Image(self._call("POST", "/v1/images",
                                json_body={"name": name, "tag": tag, "from": source}))

    def layers(self) -> List[Dict[str, Any]]:
        """``GET /v1/layers``: digest, kind, size, created_at, images, in_use."""
        return self._call("GET", "/v1/layers").get("layers", [])

    def layer(self, digest: str) -> Dict[str, Any]:
        return self._call("GET", "/v1/layers/" + _q(digest, safe=":"))

    def delete_layer(self, digest: str) -> Dict[str, Any]:
        """Deletes a layer no image names; Conflict while named or in use."""
        return self._call("DELETE", "/v1/layers/" + _q(digest, safe=":"))

    def gc(self, grace_s: Optional[float] = None) -> List[str]:
        """Deletes layers no image names and no live sandbox stacks that are
        older than ``grace_s`` (server default 600 s); returns their digests."""
        body = {} if grace_s is None else {"grace_s": grace_s}
        return self._call("POST", "/v1/gc", json_body=body).get("removed", [])

    def has_blob(self, digest: str) -> bool:
        """``HEAD /v1/blobs/{digest}``."""
        try:
            self._call("HEAD", "/v1/blobs/" + _q(digest, safe=":"))
            return True
        except DsecError as e:
            if e.status == 404:
                return False
            raise

    def upload_blob(self, path: Union[str, os.PathLike, bytes], skip_existing: bool = False,
                    timeout: Optional[float] = None) -> str:
        """Uploads a layer blob and returns its digest ``sha256:<hex>``.

        ``path`` is a file (hashed first, then streamed) or the blob's bytes.
        With ``skip_existing`` a blob the server already has is not sent again.
        """
        if isinstance(path, (bytes, bytearray, memoryview)):
            data = bytes(path)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            if skip_existing and self.has_blob(digest):
                return digest
            self._put_blob(digest, data, len(data), timeout)
            return digest
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                h.update(chunk)
            size = f.tell()
            digest = "sha256:" + h.hexdigest()
            if skip_existing and self.has_blob(digest):
                return digest
            f.seek(0)
            self._put_blob(digest, f, size, timeout)
        return digest

    def _put_blob(self, digest: str, body: Any, size: int, timeout: Optional[float]) -> None:
        t = timeout if timeout is not None else max(self.timeout, 600.0)
        self._call("PUT", "/v1/blobs/" + _q(digest, safe=":"), body=body, timeout=t,
                   headers={"Content-Type": "application/octet-stream",
                            "Content-Length": str(size)})


def _run_body(code: str, language: str, stdin: Union[None, str, bytes],
              timeout: Optional[float], limits: Optional[Dict[str, int]],
              env: Optional[Dict[str, str]], max_output_bytes: Optional[int],
              encoding: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"code": code, "language": language}
    if isinstance(stdin, bytes):
        body["stdin_b64"] = base64.b64encode(stdin).decode("ascii")
    elif stdin is not None:
        body["stdin"] = stdin
    if timeout is not None:
        body["timeout_s"] = timeout
    if limits:
        body["limits"] = dict(limits)
    if env:
        body["env"] = dict(env)
    if max_output_bytes is not None:
        body["max_output_bytes"] = max_output_bytes
    if encoding is not None:
        body["encoding"] = encoding
    return body


def _q(s: str, safe: str = "") -> str:
    return urllib.parse.quote(str(s), safe=safe)


def _body_and_length(data: Any) -> Tuple[Any, Dict[str, str]]:
    """Request body for an upload and the headers that frame it."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data, {"Content-Length": str(len(data))}
    if hasattr(data, "read"):
        size = None
        try:
            if hasattr(data, "fileno"):
                st = os.fstat(data.fileno())
                import stat as _stat
                if _stat.S_ISREG(st.st_mode):
                    size = st.st_size - data.tell()
        except (OSError, ValueError, io.UnsupportedOperation):
            size = None
        if size is None:
            try:
                if data.seekable():
                    pos = data.tell()
                    end = data.seek(0, io.SEEK_END)
                    data.seek(pos)
                    size = end - pos
            except (OSError, ValueError, AttributeError):
                size = None
        if size is not None:
            return data, {"Content-Length": str(size)}
        # http.client frames a body of unknown length with chunked encoding.
        return _chunks(data), {}
    if isinstance(data, Iterable):
        return data, {}
    raise TypeError(f"cannot send {type(data).__name__} as a file body")


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while True:
        b = f.read(_CHUNK)
        if not b:
            return
        yield b


class Batch:
    """A batch creation (``Client.create_batch``): its last known progress in
    ``info`` (``state``, ``requested``, ``pending``, ``running``, ``failed``,
    ``errors`` by code, ...)."""

    def __init__(self, client: Client, info: Dict[str, Any]):
        self._client = client
        self.info = info
        self.id: str = info["id"]

    def __getattr__(self, name: str) -> Any:
        info = self.__dict__.get("info", {})
        if name in info:
            return info[name]
        raise AttributeError(name)

    def __repr__(self) -> str:
        i = self.info
        return (f"Batch({self.id!r}, state={i.get('state')!r}, running={i.get('running')}, "
                f"pending={i.get('pending')}, failed={i.get('failed')}/{i.get('requested')})")

    def status(self) -> Dict[str, Any]:
        """``GET /v1/batches/{id}``: progress now (also kept in ``info``)."""
        self.info = self._client._call("GET", "/v1/batches/" + _q(self.id))
        return self.info

    def wait(self, timeout: Optional[float] = None, progress: bool = True,
             interval: float = 0.25) -> "Batch":
        """Polls until no sandbox of the batch is pending; with ``progress``
        draws a bar on stderr. DeadlineExceeded after ``timeout`` seconds."""
        import sys
        deadline = None if timeout is None else time.monotonic() + timeout
        tty = progress and sys.stderr.isatty()
        last = ""
        while True:
            i = self.status()
            n = max(1, int(i.get("requested", 1)))
            done = n - int(i.get("pending", 0))
            if progress:
                width = 30
                fill = width * done // n
                line = (f"batch {self.id} [{'#' * fill}{'.' * (width - fill)}] {done}/{n} "
                        f"running {i.get('running', 0)} failed {i.get('failed', 0)} "
                        f"{i.get('state')}")
                if line != last:
                    sys.stderr.write(("\r" + line) if tty else (line + "\n"))
                    sys.stderr.flush()
                    last = line
            if i.get("pending", 0) == 0 and i.get("state") != "running":
                if progress and tty:
                    sys.stderr.write("\n")
                return self
            if deadline is not None and time.monotonic() > deadline:
                from .errors import DeadlineExceeded
                raise DeadlineExceeded(message=f"batch {self.id}: {i.get('pending')} of {n} "
                                               f"still pending after {timeout} s")
            time.sleep(interval)

    def sandboxes(self, state: Optional[str] = None) -> List["Sandbox"]:
        """The batch's sandboxes (``GET /v1/sandboxes?batch=ID``)."""
        return self._client.list(state=state, batch=self.id)

    def destroy(self) -> int:
        """``DELETE /v1/batches/{id}``: destroys its sandboxes; how many."""
        doc = self._client._call("DELETE", "/v1/batches/" + _q(self.id),
                                 timeout=max(self._client.timeout, 300.0))
        self.info = doc
        return int(doc.get("destroyed", 0))


class Sandbox:
    """A sandbox on the server. ``info`` is the last Sandbox object the server
    returned; ``id``, ``state``, ``backend``, ``image``, ``labels``, ``user`` and
    ``working_dir`` come from it and other keys are reachable as attributes
    (``sb.memory_mb``, ``sb.stats``).
    Used as a context manager it is destroyed on exit."""

    def __init__(self, client: Client, info: Dict[str, Any]):
        self.client = client
        self.info: Dict[str, Any] = dict(info)
        self.id: str = self.info["id"]

    # attributes from info
    @property
    def state(self) -> Optional[str]:
        return self.info.get("state")

    @property
    def backend(self) -> Optional[str]:
        return self.info.get("backend")

    @property
    def image(self) -> Optional[str]:
        return self.info.get("image")

    @property
    def labels(self) -> Dict[str, str]:
        return self.info.get("labels") or {}

    @property
    def user(self) -> Optional[str]:
        """Who execs run as when they do not say: the create call's ``user``,
        else the image config's, else ``""`` (root)."""
        return self.info.get("user")

    @property
    def working_dir(self) -> Optional[str]:
        """Where execs start when they give no ``cwd``: the image config's
        working dir, else ``""`` (the user's home directory)."""
        return self.info.get("working_dir")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("client", "info", "id"):
            raise AttributeError(name)
        try:
            return self.info[name]
        except KeyError:
            raise AttributeError(f"Sandbox has no field {name!r}") from None

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.state!r}, image={self.image!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.destroy()
        except DsecError:
            if exc[0] is None:
                raise

    def _p(self, suffix: str = "") -> str:
        return "/v1/sandboxes/" + _q(self.id) + suffix

    def refresh(self) -> "Sandbox":
        """Reloads ``info`` from the server."""
        self.info = self.client._call("GET", self._p())
        return self

    def pack_diff(self, name: str, tag: str = "latest", trajectory_id: Optional[str] = None,
                  step: Optional[int] = None) -> Image:
        """Snapshots the sandbox's changes (while it keeps running; it is frozen
        for the moment of the copy) into a ``diff`` image ``name:tag``; create
        from it with ``client.create(snapshot="name:tag")``. Diffs chain: a
        sandbox made from a snapshot packs into a snapshot of both.

        With ``trajectory_id`` and ``step`` it is a trajectory step of kind
        ``checkpoint`` (see :meth:`Trajectory.checkpoint`): a repeat returns
        the image made the first time (``Image.raw["replayed"]``) without
        packing again."""
        body: Dict[str, Any] = {"name": name, "tag": tag}
        if trajectory_id is not None or step is not None:
            body["trajectory_id"] = trajectory_id
            body["step"] = step
        return Image(self.client._call("POST", f"/v1/sandboxes/{_q(self.id)}/pack_diff",
                                       json_body=body, timeout=max(self.client.timeout, 300.0)))

    def set_phase(self, policy: str, readonly_paths: Optional[Sequence[str]] = None,
                  hidden_paths: Optional[Sequence[str]] = None) -> "Sandbox":
        """Switches the sandbox to another security policy, e.g. ``"eval"``
        once an agent's rollout is done: it takes effect at once for every
        process in the sandbox, running ones included, and is recorded in
        ``info["phases"]``. ``readonly_paths``/``hidden_paths`` add paths to
        the policy's own."""
        body: Dict[str, Any] = {"policy": policy}
        if readonly_paths is not None:
            body["readonly_paths"] = list(readonly_paths)
        if hidden_paths is not None:
            body["hidden_paths"] = list(hidden_paths)
        self.info = self.client._call("POST", f"/v1/sandboxes/{_q(self.id)}/phase", json_body=body)
        return self

    def audit(self) -> dict:
        """What the sandbox tried and was refused: ``{"denied_syscalls":
        {"mount": 2, ...}, "denied_total": 2, "egress_denied": 1,
        "egress_last_denied": "192.0.2.9:443"}`` counted since it started, so
        a trainer can flag trajectories that probed their sandbox or its
        network."""
        return self.client._call("GET", f"/v1/sandboxes/{_q(self.id)}/audit")

    # ----- computer use (backend "vm") --------------------------------------------

    def screenshot(self, timeout: Optional[float] = None) -> bytes:
        """The sandbox's screen as PNG bytes (``GET .../screenshot``). Only a
        ``backend="vm"`` sandbox has a display; others raise
        ``failed_precondition``."""
        return self.client._call("GET", self._p("/screenshot"), raw=True,
                                 headers={"Accept": "image/png"}, timeout=timeout)

    def _input(self, body: Dict[str, Any]) -> None:
        self.client._call("POST", self._p("/input"), json_body=body,
                          timeout=max(self.client.timeout, 60.0))

    def mouse(self, x: int, y: int, button: Optional[str] = "left") -> None:
        """Moves the pointer to screen pixel (x, y) and clicks ``button``
        (``left``, ``right``, ``middle``, ``wheel-up``, ``wheel-down``; None
        only moves)."""
        body: Dict[str, Any] = {"type": "mouse", "x": int(x), "y": int(y)}
        if button:
            body["button"] = button
        self._input(body)

    def type(self, text: str) -> None:
        """Types ``text`` on the keyboard (printable ASCII, ``\\n`` is Return,
        ``\\t`` Tab; US layout)."""
        self._input({"type": "type", "text": text})

    def key(self, combo: str) -> None:
        """Presses a key combination such as ``"ctrl+c"``, ``"Return"`` or
        ``"ctrl+alt+delete"`` (QEMU key names or common aliases)."""
        self._input({"type": "key", "key": combo})

    def destroy(self) -> "Sandbox":
        """Stops and removes the sandbox (repeat calls are fine)."""
        self.info = self.client._call("DELETE", self._p(), timeout=max(self.client.timeout, 60.0))
        return self

    # ----- exec -----------------------------------------------------------------

    @staticmethod
    def _exec_body(cmd: Union[str, Sequence[str]], timeout: Optional[float],
                   env: Optional[Dict[str, str]], cwd: Optional[str], user: Optional[str],
                   stdin: Union[None, str, bytes], max_output_bytes: Optional[int],
                   encoding: Optional[str], stream: bool) -> Dict[str, Any]:
        if isinstance(cmd, (bytes, bytearray)):
            raise TypeError("cmd must be a str (shell) or a sequence of str (argv)")
        body: Dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd)}
        if env is not None:
            body["env"] = env
        if cwd is not None:
            body["cwd"] = cwd
        if user is not None:
            body["user"] = str(user)
        if timeout is not None:
            body["timeout_s"] = timeout
        if stdin is not None:
            if isinstance(stdin, str):
                body["stdin"] = stdin
            else:
                body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode("ascii")
        if max_output_bytes is not None:
            body["max_output_bytes"] = max_output_bytes
        if encoding is not None:
            body["encoding"] = encoding
        if stream:
            body["stream"] = True
        return body

    def _exec_timeout(self, timeout: Optional[float]) -> float:
        return (60.0 if timeout is None else float(timeout)) + self.client.timeout

    def exec(self, cmd: Union[str, Sequence[str]], timeout: Optional[float] = None,
             env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
             user: Optional[Union[str, int]] = None, stdin: Union[None, str, bytes] = None,
             max_output_bytes: Optional[int] = None,
             encoding: Optional[str] = None, trajectory_id: Optional[str] = None,
             step: Optional[int] = None) -> ExecResult:
        """Runs ``cmd`` (a list = argv, a string = ``/bin/sh -c``) and waits.

        A command that fails still returns its ExecResult; errors are raised only
        when the call itself fails (e.g. Conflict if the sandbox is not running).
        ``encoding="base64"`` makes ``stdout_bytes`` / ``stderr_bytes`` exact.
        Without ``user`` / ``cwd`` it runs as the sandbox's ``user`` in its
        ``working_dir`` (see ``Client.create``); ``env`` adds to the sandbox's.
        With ``trajectory_id`` and ``step`` the call is a trajectory step: it
        runs once, and a repeat returns the stored result with
        ``replayed=True`` (see :meth:`trajectory`).
        """
        body = self._exec_body(cmd, timeout, env, cwd, user, stdin, max_output_bytes,
                               encoding, False)
        if trajectory_id is not None or step is not None:
            body["trajectory_id"] = trajectory_id
            body["step"] = step
        doc = self.client._call("POST", self._p("/exec"), json_body=body,
                                timeout=self._exec_timeout(timeout))
        return ExecResult.from_json(doc, base64_output=(encoding == "base64"))

    def run(self, code: str, language: str = "python", *, stdin: Union[None, str, bytes] = None,
            timeout: Optional[float] = None, limits: Optional[Dict[str, int]] = None,
            env: Optional[Dict[str, str]] = None, max_output_bytes: Optional[int] = None,
            encoding: Optional[str] = None) -> ExecResult:
        """Runs ``code`` as one call in this ``fncall`` sandbox
        (``POST /v1/sandboxes/{id}/run``): python forks the sandbox's warm
        zygote, other languages are exec'd; it runs in ``/scratch``, whose files
        persist between calls (write them with :meth:`write_file`), while its
        processes, environment and globals do not. Other arguments as
        :meth:`Client.run`. Conflict on a container sandbox.
        """
        body = _run_body(code, language, stdin, timeout, limits, env, max_output_bytes,
                         encoding)
        t = (10.0 if timeout is None else float(timeout)) + self.client.timeout
        doc = self.client._call("POST", self._p("/run"), json_body=body, timeout=t)
        return ExecResult.from_json(doc, base64_output=(encoding == "base64"))

    def exec_stream(self, cmd: Union[str, Sequence[str]], timeout: Optional[float] = None,
                    env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                    user: Optional[Union[str, int]] = None,
                    stdin: Union[None, str, bytes] = None,
                    max_output_bytes: Optional[int] = None,
                    encoding: Optional[str] = None) -> Iterator[ExecEvent]:
        """Runs ``cmd`` and yields :class:`ExecEvent` objects as output arrives;
        the last one has type "exit" (or "error"). Closing the generator early
        drops the connection (the server then stops sending)."""
        body = self._exec_body(cmd, timeout, env, cwd, user, stdin, max_output_bytes,
                               encoding, True)
        return self.client._stream_ndjson(self._p("/exec"), body, self._exec_timeout(timeout),
                                          encoding == "base64")

    # ----- files ----------------------------------------------------------------

    def read_file(self, path: str, timeout: Optional[float] = None,
                  trajectory_id: Optional[str] = None, step: Optional[int] = None) -> bytes:
        """The whole content of ``path`` (absolute, inside the sandbox); as a
        trajectory step, the content read the first time (at most 64 MiB)."""
        return self.client._call("GET", self._p("/files"),
                                 query=[("path", path)] + _step_query(trajectory_id, step),
                                 raw=True,
                                 headers={"Accept": "application/octet-stream"},
                                 timeout=timeout)

    def read_file_to(self, path: str, out: BinaryIO, timeout: Optional[float] = None) -> int:
        """Streams ``path`` into the writable binary file ``out``; returns the size."""
        c = self.client
        p = c._path(self._p("/files"), [("path", path)])
        resp = c._send("GET", p, headers={"Accept": "application/octet-stream"}, timeout=timeout)
        n = 0
        try:
            while True:
                b = resp.read(_CHUNK)
                if not b:
                    break
                out.write(b)
                n += len(b)
        except BaseException:
            c._drop_conn()
            raise
        return n

    def write_file(self, path: str, data: Union[bytes, str, BinaryIO, Iterable[bytes]],
                   mode: int = 0o644, timeout: Optional[float] = None,
                   trajectory_id: Optional[str] = None,
                   step: Optional[int] = None) -> Dict[str, Any]:
        """Writes ``data`` (bytes, str as UTF-8, a binary file object, or an
        iterable of bytes chunks; streamed) to ``path``; returns ``{"path","size"}``
        (and ``replayed`` for a trajectory step, at most 64 MiB)."""
        body, hdrs = _body_and_length(data)
        hdrs["Content-Type"] = "application/octet-stream"
        t = timeout if timeout is not None else max(self.client.timeout, 300.0)
        return self.client._call("PUT", self._p("/files"),
                                 query=[("path", path), ("mode", format(int(mode), "04o"))]
                                 + _step_query(trajectory_id, step),
                                 body=body, headers=hdrs, timeout=t)

    def list_dir(self, path: str) -> List[FileEntry]:
        doc = self.client._call("GET", self._p("/files/list"), query=[("path", path)])
        return [FileEntry(e) for e in doc.get("entries", [])]

    def stat(self, path: str) -> FileEntry:
        return FileEntry(self.client._call("GET", self._p("/files/stat"), query=[("path", path)]))

    def exists(self, path: str) -> bool:
        from .errors import NotFound
        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def mkdir(self, path: str, parents: bool = True, mode: Optional[int] = None,
              trajectory_id: Optional[str] = None, step: Optional[int] = None) -> None:
        body: Dict[str, Any] = {"path": path, "parents": bool(parents)}
        if mode is not None:
            body["mode"] = int(mode)
        self.client._call("POST", self._p("/files/mkdir"), json_body=body,
                          query=_step_query(trajectory_id, step))

    def remove(self, path: str, recursive: bool = False, trajectory_id: Optional[str] = None,
               step: Optional[int] = None) -> None:
        self.client._call("DELETE", self._p("/files"),
                          query=[("path", path), ("recursive", "true" if recursive else "false")]
                          + _step_query(trajectory_id, step))

    def pause(self, memory: str = "ram") -> "Sandbox":
        """Pauses the sandbox; state ``paused``. The next exec or file call
        (or :meth:`resume`) resumes it.

        ``memory="ram"`` (default): every process frozen, no CPU used, memory
        kept. ``memory="disk"`` (backends ``microvm`` and ``vm``): the VM's
        whole state (RAM, devices) is saved to a file on its node and its
        QEMU exits, so no memory is held while paused; resuming restores it
        exactly (processes, /tmp, everything). ``info["pause_memory"]`` says
        which. Other backends → ``Conflict`` (409, field ``memory``)."""
        if memory not in ("ram", "disk"):
            raise ValueError('memory must be "ram" or "disk"')
        body = None if memory == "ram" else {"memory": memory}
        # Saving a VM's memory takes seconds (minutes under load on TCG).
        timeout = None if memory == "ram" else max(self.client.timeout, 900.0)
        self.info = self.client._call("POST", self._p("/pause"), json_body=body, timeout=timeout)
        return self

    def resume(self) -> "Sandbox":
        """Runs a paused sandbox again (one paused to disk is restored)."""
        self.info = self.client._call("POST", self._p("/resume"),
                                      timeout=max(self.client.timeout, 900.0))
        return self

    def trajectory(self, trajectory_id: str, start: int = 0) -> "Trajectory":
        """Calls on this sandbox numbered as steps of ``trajectory_id``, from
        ``start``: a trainer that is preempted and replays its own code from
        the beginning gets every completed step back from the log (nothing
        runs again: ``echo x >> f`` appends once) and continues live at the
        first new one. The same step with a different call → Conflict (409)."""
        return Trajectory(self, trajectory_id, start)


def _iter_ndjson(resp: Any) -> Iterator[Dict[str, Any]]:
    """Parses newline-delimited JSON from a response (or any object with readline)."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if not line:
            continue
        try:
            doc = json.loads(line.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DsecError("internal", f"bad NDJSON line from server: {line[:200]!r}") from e
        if not isinstance(doc, dict):
            raise DsecError("internal", f"NDJSON event is not an object: {line[:200]!r}")
        yield doc


def _stream_ndjson(self: Client, path: str, body: Dict[str, Any],
                   timeout: float, base64_output: bool = False) -> Iterator[ExecEvent]:
    data = json.dumps(body, separators=(",", ":")).encode("utf-8")
    resp = self._send("POST", path, body=data, timeout=timeout,
                      headers={"Content-Type": "application/json",
                               "Accept": "application/x-ndjson"})
    done = False
    try:
        ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip()
        if ctype == "application/json":
            # Server answered with a whole result; present it as events.
            doc = json.loads(resp.read().decode("utf-8"))
            done = True
            r = ExecResult.from_json(doc, base64_output)
            for kind, b in (("stdout", r.stdout_bytes), ("stderr", r.stderr_bytes)):
                if b:
                    yield ExecEvent({"type": kind, "data_b64": base64.b64encode(b).decode()}
                                    if base64_output else {"type": kind, "data": b.decode()})
            ev = {k: v for k, v in doc.items() if k not in ("stdout", "stderr", "stdout_b64",
                                                            "stderr_b64")}
            ev["type"] = "exit"
            yield ExecEvent(ev)
            return
        final = False
        try:
            for doc in _iter_ndjson(resp):
                ev = ExecEvent(doc)
                if ev.type in ("exit", "error"):
                    final = True
                yield ev
        except socket.timeout as e:
            raise DeadlineExceeded("deadline_exceeded",
                                   f"POST {path}: no event within {timeout:g}s") from e
        except (OSError, http.client.HTTPException) as e:
            raise Unavailable("unavailable", f"POST {path}: stream broken: {e}") from e
        done = resp.isclosed() or final
        if not final:
            raise Unavailable("unavailable", f"POST {path}: stream ended without an exit event")
        # Drain what is left (normally just the chunked terminator).
        resp.read()
        done = True
    finally:
        if not done or not resp.isclosed():
            # Unread bytes would desynchronise the kept-alive connection.
            self._drop_conn()


Client._stream_ndjson = _stream_ndjson  # type: ignore[attr-defined]


def _step_query(trajectory_id: Optional[str], step: Optional[int]) -> List[Tuple[str, str]]:
    if trajectory_id is None and step is None:
        return []
    return [("trajectory_id", "" if trajectory_id is None else str(trajectory_id)),
            ("step", "" if step is None else str(step))]


class Trajectory:
    """Numbers the calls made through it as consecutive steps of one
    trajectory (``sandbox.trajectory(id)``). ``next_step`` is the number the
    next call gets."""

    def __init__(self, sandbox: "Sandbox", trajectory_id: str, start: int = 0):
        self.sandbox = sandbox
        self.id = trajectory_id
        self.next_step = int(start)

    def _take(self) -> int:
        n = self.next_step
        self.next_step += 1
        return n

    def exec(self, cmd: Union[str, Sequence[str]], **kw: Any) -> ExecResult:
        return self.sandbox.exec(cmd, trajectory_id=self.id, step=self._take(), **kw)

    def write_file(self, path: str, data: Any, **kw: Any) -> Dict[str, Any]:
        return self.sandbox.write_file(path, data, trajectory_id=self.id, step=self._take(), **kw)

    def read_file(self, path: str, **kw: Any) -> bytes:
        return self.sandbox.read_file(path, trajectory_id=self.id, step=self._take(), **kw)

    def remove(self, path: str, recursive: bool = False) -> None:
        self.sandbox.remove(path, recursive=recursive, trajectory_id=self.id, step=self._take())

    def mkdir(self, path: str, parents: bool = True, mode: Optional[int] = None) -> None:
        self.sandbox.mkdir(path, parents=parents, mode=mode, trajectory_id=self.id,
                           step=self._take())

    def checkpoint(self, name: Optional[str] = None, tag: Optional[str] = None) -> Image:
        """A step that snapshots the sandbox (``pack_diff``) into a diff image:
        ``client.recover`` starts from the latest checkpoint and re-executes
        only the steps after it. ``name`` defaults to ``chronus/<trajectory
        id>`` (``:`` becomes ``-``, the image name charset) and ``tag`` to
        ``step-<n>``, so a trainer replaying its code asks for the same image
        and gets the one made the first time, replayed."""
        n = self._take()
        if name is None:
            name = "chronus/" + self.id.replace(":", "-")
        if tag is None:
            tag = f"step-{n}"
        return self.sandbox.pack_diff(name, tag, trajectory_id=self.id, step=n)

    def export(self) -> List[Dict[str, Any]]:
        return self.sandbox.client.export_trajectory(self.id)
