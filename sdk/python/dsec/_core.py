"""The dsec API written once, without I/O, for both clients.

Every API call is an *operation*: a generator function that builds its
requests, yields each one as a :class:`Request`, receives the
:class:`Response` (or has a :class:`TransportFailure` thrown in), and returns
the typed result. Operations may also yield :class:`Sleep` (a retry's back-off,
a batch's polling), :data:`READ` (the next piece of a streamed answer body),
:class:`Call` (hand bytes to the caller's file) or :class:`Blocking` (work to
keep off an event loop), and streaming ones :class:`Emit` (a value for the
caller's iterator).

``Client`` (client.py) and ``AsyncClient`` (aio.py) are two drivers over the
same operations: they subclass :class:`ClientOps`, :class:`SandboxOps` and
:class:`BatchOps` with ``driver="sync"`` or ``driver="async"``, which turns each
operation into a plain method or a coroutine of the same name, signature and
docstring that runs the generator against their transport. Request building
(paths, queries, bodies, validation), retries, and response and error mapping
exist only here; HTTP/1.1 framing only in _http.py.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import functools
import hashlib
import io
import json
import os
import random
import re
import socket
import stat as _stat
import sys
import time
import urllib.parse
from typing import (TYPE_CHECKING, Any, BinaryIO, Callable, Dict, Generator, Iterable, Iterator,
                    List, Optional, Sequence, Tuple, Union)

from ._http import LAST_CHUNK, NoResponse, ProtocolError, chunk, request_head
from .errors import (DeadlineExceeded, DsecError, NotFound, Unavailable, error_from_code,
                     error_from_response)
from .models import ExecEvent, ExecResult, Exposure, FileEntry, Image

if TYPE_CHECKING:  # the results' types as the sync client names them
    from .client import Batch, Sandbox

DEFAULT_URL = "http://127.0.0.1:7070"
DEFAULT_DATA_DIR = "/var/lib/dsec"
DEFAULT_TIMEOUT = 30.0
USER_AGENT = "dsec-python/0.1"
# How much of a file is read per piece (hashing, read_file_to).
CHUNK = 1 << 20
# How much of a file body is sent per write.
SEND_BLOCK = 256 * 1024
# A request body up to this size goes out in the same write as its headers
# (with TCP_NODELAY, headers and body apart are two segments: the server wakes twice).
COALESCE_MAX = 64 * 1024


# ----- retries -----------------------------------------------------------------

class Retry:
    """When a call that is safe to repeat is sent again, and how long to wait.

    Only calls whose repeat cannot do anything twice are retried: reads (GET
    and HEAD), and exec, file and checkpoint calls that carry
    ``trajectory_id`` and ``step`` (the server's trajectory log answers a
    repeat with the stored result). A create, a plain exec, ``run`` and every
    other write are never retried: a 429 or 503 on them goes up to the caller.
    A request whose body cannot be sent twice (an iterator) is not retried.

    A retried call is sent again after an answer with a status in
    ``statuses`` (429 and 503: the server refused it without doing it), or
    when the connection could not be made or broke before any byte of the
    answer (refused, reset, closed). Never after a timeout (the server may
    still be working on it) or once part of the answer has arrived.

    The n-th retry waits ``min(max_backoff, backoff * 2**(n-1))`` seconds
    times a random factor in [0.5, 1] (jitter, so that many clients refused
    together do not come back together), or exactly the answer's
    ``Retry-After`` when it has one. At most ``max_attempts`` sends in all,
    and no retry whose wait would end more than ``total`` seconds after the
    first send: then the last error is raised.

    ``retries=`` of both clients takes a Retry, an int (that many retries with
    the default waits) or None / 0 (none). Both default to :data:`DEFAULT_RETRY`.
    """

    __slots__ = ("max_attempts", "backoff", "max_backoff", "total", "statuses")

    def __init__(self, max_attempts: int = 5, backoff: float = 0.25, max_backoff: float = 8.0,
                 total: float = 60.0, statuses: Sequence[int] = (429, 503)):
        if int(max_attempts) < 1:
            raise ValueError("max_attempts must be at least 1")
        if backoff < 0 or max_backoff < 0 or total < 0:
            raise ValueError("backoff, max_backoff and total must not be negative")
        self.max_attempts = int(max_attempts)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.total = float(total)
        self.statuses = frozenset(int(s) for s in statuses)

    def delay(self, retry: int) -> float:
        """The jittered wait before the ``retry``-th retry (1-based)."""
        d = min(self.max_backoff, self.backoff * (2 ** (retry - 1)))
        return d * random.uniform(0.5, 1.0)

    def __repr__(self) -> str:
        return (f"Retry(max_attempts={self.max_attempts}, backoff={self.backoff}, "
                f"max_backoff={self.max_backoff}, total={self.total}, "
                f"statuses={tuple(sorted(self.statuses))})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Retry):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]


DEFAULT_RETRY = Retry()
NO_RETRY = Retry(max_attempts=1)


def retry_policy(value: Union[Retry, int, None, bool]) -> Retry:
    if value is None or value is False:
        return NO_RETRY
    if value is True:
        return DEFAULT_RETRY
    if isinstance(value, Retry):
        return value
    if isinstance(value, int):
        if value < 0:
            raise ValueError("retries must not be negative")
        return Retry(max_attempts=value + 1)
    raise TypeError(f"retries must be a dsec.Retry, an int or None, not {type(value).__name__}")


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP-date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())


# ----- what operations yield and receive ---------------------------------------

class Body:
    """A request body: none, bytes, a file (with a known size or not), or an
    iterable (sync or async) of bytes. ``length`` None means chunked."""

    __slots__ = ("kind", "data", "length", "_pos")

    NONE, BYTES, FILE, ITER, AITER = range(5)

    def __init__(self, kind: int, data: Any = None, length: Optional[int] = None,
                 pos: Optional[int] = None):
        self.kind = kind
        self.data = data
        self.length = length
        self._pos = pos

    @classmethod
    def of(cls, data: Any) -> "Body":
        """An upload's body (``write_file``): bytes, str (UTF-8), a binary file
        (its size from fstat or seeking, else chunked), an iterable of bytes
        chunks or an async iterable of them (chunked)."""
        if data is None:
            return NO_BODY
        if isinstance(data, str):
            data = data.encode("utf-8")
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data)
            return cls(cls.BYTES, data, len(data))
        if hasattr(data, "read"):
            size = pos = None
            try:
                pos = data.tell()
            except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
                pos = None
            try:
                if hasattr(data, "fileno"):
                    st = os.fstat(data.fileno())
                    if _stat.S_ISREG(st.st_mode) and pos is not None:
                        size = st.st_size - pos
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
                seekable = False
                try:
                    seekable = bool(data.seekable()) if hasattr(data, "seekable") else False
                except (OSError, ValueError):
                    pass
                return cls(cls.FILE, data, size, pos if seekable else None)
            return cls(cls.ITER, _file_chunks(data))
        if hasattr(data, "__aiter__"):
            return cls(cls.AITER, data)
        if isinstance(data, Iterable):
            return cls(cls.ITER, data)
        raise TypeError(f"cannot send {type(data).__name__} as a file body")

    @property
    def resendable(self) -> bool:
        """Whether the body can be sent again (bytes, or a seekable file)."""
        return self.kind in (Body.NONE, Body.BYTES) or self._pos is not None

    def rewind(self) -> None:
        if self._pos is not None:
            self.data.seek(self._pos)

    def file_pieces(self) -> Iterator[bytes]:
        """A FILE body's bytes, SEND_BLOCK at a time, exactly ``length`` of them."""
        left = self.length or 0
        read = self.data.read
        while left > 0:
            b = read(min(SEND_BLOCK, left))
            if not b:
                raise ValueError(f"the file body ended {left} bytes short of its size")
            if isinstance(b, str):
                b = b.encode("utf-8")
            left -= len(b)
            yield b


NO_BODY = Body(Body.NONE)


def _file_chunks(f: BinaryIO) -> Iterator[bytes]:
    while True:
        b = f.read(CHUNK)
        if not b:
            return
        yield b


def as_bytes(piece: Any) -> bytes:
    """A chunk of an iterable body as bytes (str is UTF-8)."""
    if isinstance(piece, str):
        return piece.encode("utf-8")
    return bytes(piece)


class Request:
    """One HTTP request for a driver to perform.

    ``timeout`` bounds connecting, each write, and the whole answer once the
    request is sent (for a ``stream`` request: its head, then each piece of
    its body). ``retry``: safe to send again (see :class:`Retry`). ``stream``:
    a 2xx answer's body is not read by the driver but handed out piece by
    piece on :data:`READ`. ``fresh``: do not use an idle kept-alive connection.
    """

    __slots__ = ("method", "target", "headers", "body", "timeout", "retry", "stream", "fresh")

    def __init__(self, method: str, target: str, headers: Dict[str, str], body: Body,
                 timeout: float, retry: bool = False, stream: bool = False):
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.timeout = timeout
        self.retry = retry
        self.stream = stream
        self.fresh = False

    def __repr__(self) -> str:
        return f"Request({self.method} {self.target})"


def request_pieces(req: Request, host: str) -> Iterator[bytes]:
    """``req`` on the wire, as the pieces to write in turn: a body up to
    COALESCE_MAX goes in one piece with the head; a file in SEND_BLOCK
    pieces; an iterable as chunks. For an async iterable only the head: the
    async driver writes its chunks (with :func:`_http.chunk`) and the last one."""
    body = req.body
    kind = body.kind
    if kind == Body.NONE:
        yield request_head(req.method, req.target, host, req.headers, None)
    elif kind == Body.BYTES:
        head = request_head(req.method, req.target, host, req.headers, body.length)
        if body.length <= COALESCE_MAX:
            yield head + body.data
        else:
            yield head
            yield body.data
    elif kind == Body.FILE:
        yield request_head(req.method, req.target, host, req.headers, body.length)
        yield from body.file_pieces()
    else:
        yield request_head(req.method, req.target, host, req.headers, None, chunked=True)
        if kind == Body.ITER:
            for piece in body.data:
                b = as_bytes(piece)
                if b:
                    yield chunk(b)
            yield LAST_CHUNK


class Response:
    """The answer to a Request: status, reason, headers (lower-case names) and
    the whole body; for a streamed 2xx answer ``body`` is None and the body
    comes on READ."""

    __slots__ = ("status", "reason", "headers", "body", "stream")

    def __init__(self, status: int, reason: str, headers: Dict[str, str],
                 body: Optional[bytes], stream: Any = None):
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.stream = stream


class Sleep:
    __slots__ = ("seconds",)

    def __init__(self, seconds: float):
        self.seconds = seconds


class Call:
    """Calls ``fn(*args)`` (awaiting the result when it is awaitable, under the
    async driver): handing bytes to the caller's file object."""

    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self.fn = fn
        self.args = args


class Blocking(Call):
    """Like Call, but run on a worker thread under the async driver (hashing
    a file): it must not hold the event loop."""

    __slots__ = ()


class Emit:
    """A value for the caller of a streaming operation."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class _Read:
    def __repr__(self) -> str:
        return "READ"


READ = _Read()  # the next piece of the streamed answer's body (b"" at its end)

Op = Generator[Any, Any, Any]


class TransportFailure(Exception):
    """Thrown into an operation by its driver when the connection failed.

    ``kind``: ``"connect"`` (no connection could be made), ``"lost"`` (the
    connection broke or ended), ``"timeout"`` or ``"protocol"`` (bytes that are
    no HTTP/1.1 answer). ``reused``: it was a kept-alive connection from an
    earlier request. ``started``: some of the answer had arrived.
    """

    def __init__(self, kind: str, cause: BaseException, reused: bool = False,
                 started: bool = False):
        super().__init__(kind, cause)
        self.kind = kind
        self.cause = cause
        self.reused = reused
        self.started = started

    @classmethod
    def of(cls, exc: BaseException, *, connecting: bool = False, reused: bool = False,
           started: bool = False) -> "TransportFailure":
        if isinstance(exc, (TimeoutError, socket.timeout)):
            kind = "timeout"
        elif isinstance(exc, NoResponse):
            kind = "lost"
        elif isinstance(exc, ProtocolError):
            kind = "protocol"
        elif connecting and isinstance(exc, ConnectionError):
            kind = "connect"  # refused, reset: nothing was sent
        elif isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
                              EOFError)):
            kind = "lost"
        else:
            kind = "other"
        return cls(kind, exc, reused, started)

    @property
    def stale(self) -> bool:
        """A kept-alive connection the server had closed while idle: nothing
        of the request was read, so it can go again on a new connection."""
        return self.reused and not self.started and self.kind == "lost"

    def error(self, req: Request, url: str) -> DsecError:
        what = f"{req.method} {req.target}"
        if self.kind == "timeout":
            return DeadlineExceeded("deadline_exceeded",
                                    f"{what}: no answer within {req.timeout:g}s")
        if self.kind == "lost":
            return Unavailable("unavailable", f"{what}: connection lost: {self.cause}")
        return Unavailable("unavailable", f"{what}: cannot reach {url}: {self.cause}")


# ----- turning operations into methods -----------------------------------------

def op(fn: Callable[..., Op]) -> Callable[..., Op]:
    """Marks a generator method as an API call: the driven class gets a method
    (sync) or coroutine (async) of the same name returning its result."""
    fn._dsec_op = "call"  # type: ignore[attr-defined]
    return fn


def stream_op(fn: Callable[..., Op]) -> Callable[..., Op]:
    """Marks a generator method whose Emit values form an iterator: a generator
    (sync) or async generator (async) of them."""
    fn._dsec_op = "stream"  # type: ignore[attr-defined]
    return fn


def _sync_method(fn: Callable[..., Op]) -> Callable[..., Any]:
    if fn._dsec_op == "stream":  # type: ignore[attr-defined]
        @functools.wraps(fn)
        def stream_method(self, *args, **kwargs):
            return self._driver._drive_stream(fn(self, *args, **kwargs))
        return stream_method

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        return self._driver._drive(fn(self, *args, **kwargs))
    return method


def _async_method(fn: Callable[..., Op]) -> Callable[..., Any]:
    if fn._dsec_op == "stream":  # type: ignore[attr-defined]
        @functools.wraps(fn)
        def stream_method(self, *args, **kwargs):
            return self._driver._drive_stream(fn(self, *args, **kwargs))
        return stream_method

    @functools.wraps(fn)
    async def method(self, *args, **kwargs):
        return await self._driver._drive(fn(self, *args, **kwargs))
    return method


class _Driven:
    """Base of the shared classes: ``class Client(ClientOps, driver="sync")``
    gets a method for each operation of its bases."""

    def __init_subclass__(cls, driver: Optional[str] = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if driver is None:
            return
        make = {"sync": _sync_method, "async": _async_method}[driver]
        for base in reversed(cls.__mro__[1:]):
            for name, fn in vars(base).items():
                if getattr(fn, "_dsec_op", None) and name not in cls.__dict__:
                    setattr(cls, name, make(fn))


# ----- small helpers ----------------------------------------------------------

def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _q(s: str, safe: str = "") -> str:
    return urllib.parse.quote(str(s), safe=safe)


def _step_query(trajectory_id: Optional[str], step: Optional[int]) -> List[Tuple[str, str]]:
    if trajectory_id is None and step is None:
        return []
    return [("trajectory_id", "" if trajectory_id is None else str(trajectory_id)),
            ("step", "" if step is None else str(step))]


def _is_step(trajectory_id: Optional[str], step: Optional[int]) -> bool:
    """A trajectory step: the server's log makes a repeat return the stored result."""
    return trajectory_id is not None and step is not None


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


def _ndjson_doc(line: bytes) -> Optional[Dict[str, Any]]:
    """One line of an NDJSON stream as a dict (None for a blank line)."""
    line = line.strip()
    if not line:
        return None
    try:
        doc = json.loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DsecError("internal", f"bad NDJSON line from server: {line[:200]!r}") from e
    if not isinstance(doc, dict):
        raise DsecError("internal", f"NDJSON event is not an object: {line[:200]!r}")
    return doc


class _NdjsonReader:
    """The events of a streamed NDJSON answer, a piece of the body at a time
    (``yield from rd.next_docs()`` inside an operation)."""

    def __init__(self, client: "ClientOps", req: "Request"):
        self.client = client
        self.req = req
        self.buf = b""
        self.done = False

    def next_docs(self) -> Op:
        """The events the next piece completes (maybe none); sets ``done`` at
        the end of the body."""
        piece = yield from _read(self.client, self.req)
        if piece:
            self.buf += piece
            *lines, self.buf = self.buf.split(b"\n")
            return [d for d in map(_ndjson_doc, lines) if d is not None]
        self.done = True
        doc = _ndjson_doc(self.buf)  # a last line without its newline
        self.buf = b""
        return [] if doc is None else [doc]


def _iter_ndjson(resp: Any) -> Iterator[Dict[str, Any]]:
    """Parses newline-delimited JSON from any object with readline."""
    while True:
        line = resp.readline()
        if not line:
            return
        doc = _ndjson_doc(line)
        if doc is not None:
            yield doc


def _image_events(client: "ClientOps", req: Request,
                  progress: Optional[Callable[[Dict[str, Any]], None]], what: str) -> Op:
    """Reads the NDJSON events of an image pull or build: each goes to
    ``progress``; an ``error`` event raises its typed error (with ``line``
    for a build's); ``done`` carries the image returned."""
    image: Optional[Image] = None
    buf = b""
    while True:
        piece = yield from _read(client, req)
        buf += piece
        lines = buf.split(b"\n")
        buf = lines.pop() if piece else b""
        for line in lines if piece else lines + [buf]:
            doc = _ndjson_doc(line)
            if doc is None:
                continue
            if doc.get("type") == "error":
                err = doc.get("error") or {}
                exc = error_from_code(err.get("code"), err.get("message", what + " failed"),
                                      None, err.get("field"))
                if "line" in err:
                    exc.line = err.get("line")
                raise exc
            if progress is not None:
                progress(doc)
            if doc.get("type") == "done":
                image = Image(doc.get("image") or {})
        if not piece:
            break
    if image is None:
        raise Unavailable("unavailable", f"POST /v1/images/{what}: stream ended without a result")
    return image


def _hash_file(path: Union[str, os.PathLike]) -> Tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


def _error_line(body: Optional[bytes]) -> Optional[int]:
    """The Dockerfile line an error answer names ({"error": {"line": N}}), if any."""
    try:
        line = json.loads(body or b"{}").get("error", {}).get("line")
    except (ValueError, AttributeError):
        return None
    return line if isinstance(line, int) else None


def _ignore_regex(pattern: str) -> "re.Pattern[str]":
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                out.append(".*")
                i += 2
                if pattern.startswith("/", i):
                    out[-1] = "(?:.*/)?"
                    i += 1
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                cls = pattern[i + 1:j]
                out.append("[" + ("^" + cls[1:] if cls.startswith("^") else cls) + "]")
                i = j
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _pack_context(context_dir: str) -> str:
    """Tars ``context_dir`` into a temporary file (PAX, names in byte order,
    owners 0:0, whole-second mtimes) and returns its path. What the context's
    .dockerignore excludes is left out when it has no ``!`` exceptions (the
    server applies it exactly either way)."""
    import tarfile
    import tempfile
    patterns: List["re.Pattern[str]"] = []
    ignore = os.path.join(context_dir, ".dockerignore")
    if os.path.isfile(ignore):
        with open(ignore, "r", encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.read().lstrip("\ufeff").splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("#")]
        if not any(ln.startswith("!") for ln in lines):
            for ln in lines:
                p = os.path.normpath(ln).lstrip("/")
                if p and p != ".":
                    patterns.append(_ignore_regex(p))

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        for n in range(1, len(parts) + 1):
            prefix = "/".join(parts[:n])
            if any(p.match(prefix) for p in patterns):
                return True
        return False

    fd, tmp = tempfile.mkstemp(prefix="dsec-context-", suffix=".tar")
    os.close(fd)
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
            def add(abs_path: str, rel: str) -> None:
                st = os.lstat(abs_path)
                ti = tarfile.TarInfo(rel)
                ti.mode = _stat.S_IMODE(st.st_mode)
                ti.mtime = int(st.st_mtime)
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = ""
                if _stat.S_ISDIR(st.st_mode):
                    ti.type = tarfile.DIRTYPE
                    tf.addfile(ti)
                elif _stat.S_ISLNK(st.st_mode):
                    ti.type = tarfile.SYMTYPE
                    ti.linkname = os.readlink(abs_path)
                    tf.addfile(ti)
                elif _stat.S_ISREG(st.st_mode):
                    ti.size = st.st_size
                    with open(abs_path, "rb") as f:
                        tf.addfile(ti, f)

            def walk(abs_dir: str, rel_dir: str) -> None:
                for name in sorted(os.listdir(abs_dir)):
                    abs_path = os.path.join(abs_dir, name)
                    rel = f"{rel_dir}/{name}" if rel_dir else name
                    if patterns and excluded(rel):
                        continue
                    add(abs_path, rel)
                    if os.path.isdir(abs_path) and not os.path.islink(abs_path):
                        walk(abs_path, rel)

            walk(context_dir, "")
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _read(client: "ClientOps", req: Request) -> Op:
    """The next piece of a streamed answer's body (b"" at its end)."""
    try:
        return (yield READ)
    except TransportFailure as f:
        raise f.error(req, client.url) from f.cause


def _read_rest(client: "ClientOps", req: Request) -> Op:
    parts = []
    while True:
        b = yield from _read(client, req)
        if not b:
            return b"".join(parts)
        parts.append(b)


# ----- the client ---------------------------------------------------------------

class ClientOps(_Driven):
    """What :class:`dsec.Client` and :class:`dsec.AsyncClient` share: their
    configuration and every API call (see the module's docstring)."""

    _sandbox_class: type
    _batch_class: type
    server_pid: Optional[int] = None

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = DEFAULT_TIMEOUT, *,
                 retries: Union[Retry, int, None] = DEFAULT_RETRY,
                 connect_timeout: Optional[float] = None,
                 local_addrs: Optional[Sequence[str]] = None):
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
        host = f"[{self._host}]" if ":" in self._host else self._host
        default = 443 if self._scheme == "https" else 80
        self._host_header = host if self._port == default else f"{host}:{self._port}"
        if token is None:
            token = os.environ.get("DSEC_TOKEN")
        if token is None:
            data_dir = os.environ.get("DSEC_DATA_DIR") or DEFAULT_DATA_DIR
            token = _read_text(os.path.join(data_dir, "token"))
        self.token = token or None
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout) if connect_timeout is not None else None
        self.retries = retry_policy(retries)
        self.local_addrs = tuple(local_addrs or ())
        self._base_headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.token:
            self._base_headers["Authorization"] = "Bearer " + self.token

    @classmethod
    def from_data_dir(cls, path: str, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any):
        """A client for the ``dsec up`` whose data dir is ``path`` (reads
        ``up.json`` for the URL and ``token`` for the bearer token). Other
        keyword arguments go to the constructor."""
        with open(os.path.join(path, "up.json"), "r", encoding="utf-8") as f:
            up = json.load(f)
        url = up.get("url")
        if not url:
            raise ValueError(f"{path}/up.json has no url")
        token = _read_text(os.path.join(path, "token"))
        if token is None:
            raise ValueError(f"cannot read {path}/token")
        c = cls(url=url, token=token, timeout=timeout, **kwargs)
        c.server_pid = up.get("pid")
        return c

    @property
    def _driver(self) -> "ClientOps":
        return self

    def _connect_timeout(self, timeout: float) -> float:
        if self.connect_timeout is None:
            return timeout
        return min(timeout, self.connect_timeout)

    # ----- requests ----------------------------------------------------------

    def _request(self, method: str, path: str, *,
                 query: Optional[Sequence[Tuple[str, str]]] = None, json_body: Any = None,
                 body: Optional[Body] = None, headers: Optional[Dict[str, str]] = None,
                 timeout: Optional[float] = None, retry: Optional[bool] = None,
                 stream: bool = False) -> Request:
        hdrs = dict(self._base_headers)
        if json_body is not None:
            data = json.dumps(json_body, separators=(",", ":")).encode("utf-8")
            body = Body(Body.BYTES, data, len(data))
            hdrs["Content-Type"] = "application/json"
        if headers:
            hdrs.update(headers)
        target = self._base + path
        if query:
            target += "?" + urllib.parse.urlencode(list(query), quote_via=urllib.parse.quote)
        if retry is None:
            retry = method in ("GET", "HEAD")
        return Request(method, target, hdrs, body or NO_BODY,
                       self.timeout if timeout is None else float(timeout), retry, stream)

    def _exchange(self, req: Request) -> Op:
        """Sends ``req`` (again, as the retry policy allows) and returns its
        Response; an error status raises its typed error."""
        policy = self.retries
        attempt = 1
        start = time.monotonic()
        stale_retried = False
        while True:
            try:
                resp = yield req
            except TransportFailure as f:
                if f.stale and req.body.resendable and not stale_retried:
                    # The server closed the idle kept-alive connection; it never
                    # read the request. Once, on a new connection, for any call.
                    stale_retried = True
                    req.fresh = True
                    req.body.rewind()
                    continue
                if (req.retry and req.body.resendable and not f.started
                        and f.kind in ("connect", "lost") and attempt < policy.max_attempts):
                    wait = policy.delay(attempt)
                    if time.monotonic() + wait - start <= policy.total:
                        yield Sleep(wait)
                        attempt += 1
                        req.fresh = True
                        req.body.rewind()
                        continue
                raise f.error(req, self.url) from f.cause
            status = resp.status
            if status < 400:
                return resp
            if (status in policy.statuses and req.retry and req.body.resendable
                    and attempt < policy.max_attempts):
                wait = parse_retry_after(resp.headers.get("retry-after"))
                if wait is None:
                    wait = policy.delay(attempt)
                if time.monotonic() + wait - start <= policy.total:
                    yield Sleep(wait)
                    attempt += 1
                    req.body.rewind()
                    continue
            raise error_from_response(status, resp.body or b"", resp.reason)

    def _call(self, method: str, path: str, *, raw: bool = False, **kw: Any) -> Op:
        """One request/response; returns the decoded JSON (or bytes if raw)."""
        req = self._request(method, path, **kw)
        resp = yield from self._exchange(req)
        data = resp.body
        if raw or method == "HEAD":
            return data
        if not data.strip():
            return {}
        try:
            return json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DsecError("internal",
                            f"{method} {req.target}: response is not JSON: {data[:200]!r}",
                            resp.status, None, data) from e

    def sandbox(self, sandbox_id: str):
        """A handle on a sandbox by id, without a request."""
        return self._sandbox_class(self, {"id": sandbox_id})

    # ----- health -------------------------------------------------------------

    @op
    def health(self) -> Dict[str, Any]:
        """``GET /v1/health`` → ``{"status": "ok", "version": ...}`` (no auth needed)."""
        return (yield from self._call("GET", "/v1/health"))

    # ----- sandboxes ----------------------------------------------------------

    @op
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
        """Creates a sandbox and returns it (a Sandbox; an AsyncSandbox from
        AsyncClient) once it is running (or failed).

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
        A create is never retried (see :class:`Retry`).
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
        info = yield from self._call(
            "POST", "/v1/sandboxes", json_body=req,
            timeout=timeout if timeout is not None else max(self.timeout, 120.0))
        return self._sandbox_class(self, info)

    @op
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
        Not retried. With AsyncClient, cancelling the awaiting task closes the
        connection: the server takes that as the caller going away.
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
        doc = yield from self._call("POST", "/v1/run", json_body=body, timeout=t)
        return ExecResult.from_json(doc, base64_output=(encoding == "base64"))

    @op
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
        ``field`` ``spec.<name>``. Returns a Batch (AsyncBatch from AsyncClient).
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
        doc = yield from self._call("POST", "/v1/batches",
                                    json_body={"count": count, "spec": body,
                                               "all_or_nothing": all_or_nothing})
        b = self._batch_class(self, doc)
        if wait:
            yield from BatchOps.wait(b, timeout=timeout, progress=progress)
        return b

    @op
    def batch(self, batch_id: str) -> "Batch":
        """``GET /v1/batches/{id}``; unknown id → NotFound."""
        info = yield from self._call("GET", "/v1/batches/" + _q(batch_id))
        return self._batch_class(self, info)

    @op
    def batches(self) -> List["Batch"]:
        """``GET /v1/batches``: this tenant's batches (every tenant's for an admin)."""
        doc = yield from self._call("GET", "/v1/batches")
        return [self._batch_class(self, b) for b in doc.get("batches", [])]

    @op
    def destroy_where(self, labels: Optional[Dict[str, str]] = None,
                      batch: Optional[str] = None) -> int:
        """``DELETE /v1/sandboxes?label=k=v&batch=ID``: destroys every live
        sandbox matching all filters (at least one needed); how many."""
        query: List[Tuple[str, str]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if batch:
            query.append(("batch", batch))
        doc = yield from self._call("DELETE", "/v1/sandboxes", query=query,
                                    timeout=max(self.timeout, 300.0))
        return int(doc.get("destroyed", 0))

    @op
    def get(self, sandbox_id: str) -> "Sandbox":
        """``GET /v1/sandboxes/{id}``; unknown id → NotFound."""
        info = yield from self._call("GET", "/v1/sandboxes/" + _q(sandbox_id))
        return self._sandbox_class(self, info)

    @op
    def list(self, labels: Optional[Dict[str, str]] = None,
             state: Optional[str] = None, batch: Optional[str] = None) -> List["Sandbox"]:
        """Sandboxes whose labels include all of ``labels`` (and in ``state``,
        and made by batch ``batch``)."""
        query: List[Tuple[str, str]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if state:
            query.append(("state", state))
        if batch:
            query.append(("batch", batch))
        doc = yield from self._call("GET", "/v1/sandboxes", query=query)
        return [self._sandbox_class(self, s) for s in doc.get("sandboxes", [])]

    @op
    def destroy(self, sandbox_id: str) -> "Sandbox":
        """``DELETE /v1/sandboxes/{id}`` → the sandbox in state ``stopped``."""
        info = yield from self._call("DELETE", "/v1/sandboxes/" + _q(sandbox_id),
                                     timeout=max(self.timeout, 60.0))
        return self._sandbox_class(self, info)

    # ----- trajectories (Chronus) -------------------------------------------

    @op
    def trajectories(self) -> List[Dict[str, Any]]:
        """``[{"id","steps","first_at","last_at"}]`` of the stored trajectories."""
        return (yield from self._call("GET", "/v1/trajectories"))["trajectories"]

    @op
    def export_trajectory(self, trajectory_id: str) -> List[Dict[str, Any]]:
        """Every step of a trajectory, in order, as the server's JSON lines:
        request, result (or ``result_b64`` for file bytes), status, timings."""
        data = yield from self._call("GET", "/v1/trajectories/" + _q(trajectory_id), raw=True,
                                     headers={"Accept": "application/x-ndjson"})
        return [json.loads(line) for line in data.decode("utf-8").splitlines() if line]

    @op
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
        report = yield from self._call(
            "POST", "/v1/trajectories/" + _q(trajectory_id) + "/recover", json_body=body,
            timeout=timeout if timeout is not None else max(self.timeout, 600.0))
        sb = self._sandbox_class(self, report["sandbox"])
        sb.recovery = report
        return sb

    @op
    def delete_trajectory(self, trajectory_id: str) -> int:
        """Deletes a trajectory's steps; returns how many. Unknown → NotFound."""
        doc = yield from self._call("DELETE", "/v1/trajectories/" + _q(trajectory_id))
        return doc["deleted_steps"]

    # ----- tenants, keys, quotas (docs/tenants.md) ---------------------------

    @op
    def whoami(self) -> Dict[str, Any]:
        """``{"tenant","role","key_id","quota","usage"}`` of this client's key."""
        return (yield from self._call("GET", "/v1/whoami"))

    @op
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
        return (yield from self._call("POST", "/v1/tenants", json_body=body))

    @op
    def list_tenants(self) -> List[Dict[str, Any]]:
        """Every tenant with its quota and usage (admin only)."""
        return (yield from self._call("GET", "/v1/tenants"))["tenants"]

    @op
    def tenant(self, tenant_id: str) -> Dict[str, Any]:
        """One tenant with its quota and usage (admin only); unknown → NotFound."""
        return (yield from self._call("GET", "/v1/tenants/" + _q(tenant_id)))

    @op
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
        return (yield from self._call("PATCH", "/v1/tenants/" + _q(tenant_id), json_body=body))

    def set_quota(self, tenant_id: str, **quota: Any) -> Dict[str, Any]:
        """``set_quota("acme", max_sandboxes=10, max_memory_mb=8192)``: sets
        those quota fields (0: no limit). Admin only."""
        return self.update_tenant(tenant_id, quota=quota)

    @op
    def delete_tenant(self, tenant_id: str) -> Dict[str, Any]:
        """Deletes a tenant and its keys (admin only). Conflict while it has
        live sandboxes; the built-in ``admin`` tenant cannot be deleted."""
        return (yield from self._call("DELETE", "/v1/tenants/" + _q(tenant_id)))

    @op
    def create_key(self, tenant_id: str, name: str = "") -> Dict[str, Any]:
        """A new API key for the tenant (admin only). The returned ``key`` is
        shown this once (the server keeps only its hash); ``id`` names it for
        listing and revoking."""
        return (yield from self._call("POST", "/v1/tenants/" + _q(tenant_id) + "/keys",
                                      json_body={"name": name}))

    @op
    def list_keys(self, tenant_id: str) -> List[Dict[str, Any]]:
        """The tenant's keys (id, prefix, name, created_at, revoked_at), never
        the keys themselves. Admin only."""
        return (yield from self._call("GET", "/v1/tenants/" + _q(tenant_id) + "/keys"))["keys"]

    @op
    def revoke_key(self, tenant_id: str, key_id: str) -> Dict[str, Any]:
        """Revokes a key at once (admin only); idempotent."""
        return (yield from self._call(
            "DELETE", "/v1/tenants/" + _q(tenant_id) + "/keys/" + _q(key_id)))

    # ----- policies -----------------------------------------------------------

    @op
    def policies(self) -> List[Dict[str, Any]]:
        """The security policies sandboxes can run under: the built-ins
        (default, setup, rollout, eval) and the user's own, each with name,
        description, readonly_paths, hidden_paths, egress, dns, builtin."""
        return (yield from self._call("GET", "/v1/policies"))["policies"]

    @op
    def policy(self, name: str) -> Dict[str, Any]:
        """``GET /v1/policies/{name}``; unknown → NotFound."""
        return (yield from self._call("GET", "/v1/policies/" + _q(name)))

    @op
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
        return (yield from self._call("POST", "/v1/policies", json_body=body))

    @op
    def delete_policy(self, name: str) -> None:
        """Deletes one of your policies; refused (409) while a live sandbox
        runs under it, and for built-ins."""
        yield from self._call("DELETE", "/v1/policies/" + _q(name))

    # ----- images, layers and blobs -----------------------------------------

    @op
    def images(self) -> List[Image]:
        """``GET /v1/images``: every image this tenant can see."""
        doc = yield from self._call("GET", "/v1/images")
        return [Image(i) for i in doc.get("images", [])]

    @op
    def image(self, ref: str) -> Image:
        """``GET /v1/images/{name}[:tag]``; unknown → NotFound."""
        return Image((yield from self._call("GET", "/v1/images/" + _q(ref, safe=":"))))

    @op
    def delete_image(self, ref: str) -> Dict[str, Any]:
        """Deletes a tag; Conflict while a running sandbox uses it."""
        return (yield from self._call("DELETE", "/v1/images/" + _q(ref, safe=":")))

    @op
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
        return Image((yield from self._call("POST", "/v1/images", json_body=body)))

    @op
    def pull_image(self, ref: str, *, platform: Optional[str] = None,
                   name: Optional[str] = None, tag: Optional[str] = None,
                   insecure_registry: bool = False,
                   auth: Optional[Union[Tuple[str, str], Dict[str, str]]] = None,
                   visibility: Optional[str] = None,
                   progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                   timeout: Optional[float] = None) -> Image:
        """``POST /v1/images/pull``: pulls ``ref`` (``debian:12``,
        ``ghcr.io/org/app@sha256:...``, ``127.0.0.1:5000/x:1``) from its OCI
        registry and returns the image, named ``HOST/REPO:TAG`` unless ``name``
        / ``tag`` say otherwise. The platform fetches and converts each layer
        once: layers it has are not fetched again, and pulling a digest it
        holds under that name is a no-op.

        ``platform`` picks from a multi-platform index (default
        ``linux/amd64``); ``insecure_registry`` reaches the registry over plain
        http; ``auth`` is ``(username, password)`` or
        ``{"identity_token": ...}`` (else the platform's ``--registry-auth``).
        ``progress`` is called with each event as it comes: ``{"type":
        "resolved", "layers": [...]}``, then ``{"type": "layer", "digest",
        "status": "exists"|"waiting"|"downloading"|"converting"|"done",
        "bytes", "total"}``. Errors before the first event raise with their
        HTTP status (NotFound for a missing tag, Unauthenticated for bad
        credentials); errors after it raise the same typed errors. ``timeout``
        bounds each silence (default: the client's, at least 600 s). Not
        retried.
        """
        body: Dict[str, Any] = {"ref": ref}
        if platform is not None:
            body["platform"] = platform
        if name is not None:
            body["name"] = name
        if tag is not None:
            body["tag"] = tag
        if insecure_registry:
            body["insecure_registry"] = True
        if visibility is not None:
            body["visibility"] = visibility
        if isinstance(auth, (tuple, list)):
            body["auth"] = {"username": auth[0], "password": auth[1]}
        elif auth is not None:
            body["auth"] = dict(auth)
        t = timeout if timeout is not None else max(self.timeout, 600.0)
        req = self._request("POST", "/v1/images/pull", json_body=body,
                            headers={"Accept": "application/x-ndjson"},
                            timeout=t, retry=False, stream=True)
        yield from self._exchange(req)
        return (yield from _image_events(self, req, progress, "pull"))

    @op
    def build_image(self, context_dir: Optional[Union[str, os.PathLike]] = None,
                    dockerfile: str = "Dockerfile", *, tag: str,
                    dockerfile_text: Optional[str] = None,
                    build_args: Optional[Dict[str, str]] = None, target: Optional[str] = None,
                    network: bool = False, no_cache: bool = False,
                    platform: Optional[str] = None, insecure_registry: bool = False,
                    visibility: Optional[str] = None,
                    progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                    timeout: Optional[float] = None) -> Image:
        """``POST /v1/images/build``: builds ``tag`` (``name[:tag]``) from a
        Dockerfile and returns the image (docs/images.md, "Building from a
        Dockerfile").

        ``context_dir`` is tarred here (PAX, names in order, owners 0:0),
        leaving out what its ``.dockerignore`` excludes (the server applies it
        again, exactly), uploaded as a blob and sent by digest; None sends no
        context (COPY then has nothing to copy). ``dockerfile`` is a path in
        the context directory (or, without one, a path), ``dockerfile_text``
        the Dockerfile itself. ``build_args`` are ``--build-arg``s;
        ``target`` the stage to build; ``network`` lets RUN reach what the
        ``setup`` policy allows (no egress otherwise); ``no_cache`` runs
        every step again. FROM images missing here are pulled (``platform``,
        ``insecure_registry`` as for :meth:`pull_image`).

        ``progress`` is called with each event as it comes: ``{"type":
        "step", "stage", "line", "instruction", "cached"?}``, ``{"type":
        "output", "line", "stream", "data"}`` (RUN output), ``{"type":
        "layer", "line", "layer", "cached"}``, ``{"type": "pull"|"pulled",
        "ref", "image"}``. A Dockerfile that does not parse raises
        InvalidArgument (HTTP 400) with ``field`` ``"dockerfile"``; a step
        that fails raises the typed error of its code, ``field``
        ``"dockerfile"``; either has ``.line``, the Dockerfile line, when
        there is one. A failed build stores no image. ``timeout`` bounds each
        silence (default: the client's, at least 3600 s). Not retried.
        """
        if dockerfile_text is None:
            path = dockerfile
            if context_dir is not None and not os.path.isabs(path):
                path = os.path.join(os.fspath(context_dir), path)
            with open(path, "r", encoding="utf-8") as f:
                dockerfile_text = f.read()
        name, _, tag_part = tag.rpartition(":")
        if not name or "/" in tag_part:
            name, tag_part = tag, "latest"
        body: Dict[str, Any] = {"dockerfile": dockerfile_text, "name": name, "tag": tag_part}
        if context_dir is not None:
            tmp = yield Blocking(_pack_context, os.fspath(context_dir))
            try:
                body["context"] = yield from ClientOps.upload_blob(self, tmp, skip_existing=True,
                                                                   timeout=timeout)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        if build_args:
            body["build_args"] = {str(k): str(v) for k, v in build_args.items()}
        if target is not None:
            body["target"] = target
        if network:
            body["network"] = True
        if no_cache:
            body["no_cache"] = True
        if platform is not None:
            body["platform"] = platform
        if insecure_registry:
            body["insecure_registry"] = True
        if visibility is not None:
            body["visibility"] = visibility
        t = timeout if timeout is not None else max(self.timeout, 3600.0)
        req = self._request("POST", "/v1/images/build", json_body=body,
                            headers={"Accept": "application/x-ndjson"},
                            timeout=t, retry=False, stream=True)
        try:
            yield from self._exchange(req)
        except DsecError as e:
            e.line = _error_line(e.body)
            raise
        return (yield from _image_events(self, req, progress, "build"))

    @op
    def tag_image(self, source: str, name: str, tag: str = "latest") -> Image:
        """Points ``name:tag`` at the layers (kind and config) of the image ``source``."""
        return Image((yield from self._call("POST", "/v1/images",
                                            json_body={"name": name, "tag": tag,
                                                       "from": source})))

    @op
    def layers(self) -> List[Dict[str, Any]]:
        """``GET /v1/layers``: digest, kind, size, created_at, images, in_use."""
        return (yield from self._call("GET", "/v1/layers")).get("layers", [])

    @op
    def layer(self, digest: str) -> Dict[str, Any]:
        """``GET /v1/layers/{digest}``; unknown → NotFound."""
        return (yield from self._call("GET", "/v1/layers/" + _q(digest, safe=":")))

    @op
    def delete_layer(self, digest: str) -> Dict[str, Any]:
        """Deletes a layer no image names; Conflict while named or in use."""
        return (yield from self._call("DELETE", "/v1/layers/" + _q(digest, safe=":")))

    @op
    def gc(self, grace_s: Optional[float] = None) -> List[str]:
        """Deletes layers no image names and no live sandbox stacks that are
        older than ``grace_s`` (server default 600 s); returns their digests."""
        body = {} if grace_s is None else {"grace_s": grace_s}
        return (yield from self._call("POST", "/v1/gc", json_body=body)).get("removed", [])

    @op
    def has_blob(self, digest: str) -> bool:
        """``HEAD /v1/blobs/{digest}``."""
        try:
            yield from self._call("HEAD", "/v1/blobs/" + _q(digest, safe=":"))
            return True
        except DsecError as e:
            if e.status == 404:
                return False
            raise

    @op
    def upload_blob(self, path: Union[str, os.PathLike, bytes], skip_existing: bool = False,
                    timeout: Optional[float] = None) -> str:
        """Uploads a layer blob and returns its digest ``sha256:<hex>``.

        ``path`` is a file (hashed first, then streamed) or the blob's bytes.
        With ``skip_existing`` a blob the server already has is not sent again.
        """
        if isinstance(path, (bytes, bytearray, memoryview)):
            data = bytes(path)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            if skip_existing and (yield from ClientOps.has_blob(self, digest)):
                return digest
            yield from self._put_blob(digest, data, timeout)
            return digest
        digest, size = yield Blocking(_hash_file, path)
        if skip_existing and (yield from ClientOps.has_blob(self, digest)):
            return digest
        with open(path, "rb") as f:
            yield from self._put_blob(digest, f, timeout)
        return digest

    def _put_blob(self, digest: str, data: Any, timeout: Optional[float]) -> Op:
        t = timeout if timeout is not None else max(self.timeout, 600.0)
        yield from self._call("PUT", "/v1/blobs/" + _q(digest, safe=":"), body=Body.of(data),
                              timeout=t, headers={"Content-Type": "application/octet-stream"})


# ----- batches --------------------------------------------------------------------

class BatchOps(_Driven):
    """What Batch and AsyncBatch share: a batch creation
    (``Client.create_batch``) and its last known progress in ``info``
    (``state``, ``requested``, ``pending``, ``running``, ``failed``, ``errors``
    by code, ...)."""

    def __init__(self, client: ClientOps, info: Dict[str, Any]):
        self._client = client
        self.info = info
        self.id: str = info["id"]

    @property
    def _driver(self) -> ClientOps:
        return self._client

    def __getattr__(self, name: str) -> Any:
        info = self.__dict__.get("info", {})
        if name in info:
            return info[name]
        raise AttributeError(name)

    def __repr__(self) -> str:
        i = self.info
        return (f"{type(self).__name__}({self.id!r}, state={i.get('state')!r}, "
                f"running={i.get('running')}, pending={i.get('pending')}, "
                f"failed={i.get('failed')}/{i.get('requested')})")

    @op
    def status(self) -> Dict[str, Any]:
        """``GET /v1/batches/{id}``: progress now (also kept in ``info``)."""
        self.info = yield from self._client._call("GET", "/v1/batches/" + _q(self.id))
        return self.info

    @op
    def wait(self, timeout: Optional[float] = None, progress: bool = True,
             interval: float = 0.25) -> "Batch":
        """Polls until no sandbox of the batch is pending; with ``progress``
        draws a bar on stderr. DeadlineExceeded after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tty = progress and sys.stderr.isatty()
        last = ""
        while True:
            i = yield from BatchOps.status(self)
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
                raise DeadlineExceeded(message=f"batch {self.id}: {i.get('pending')} of {n} "
                                               f"still pending after {timeout} s")
            yield Sleep(interval)

    def sandboxes(self, state: Optional[str] = None):
        """The batch's sandboxes (``GET /v1/sandboxes?batch=ID``)."""
        return self._client.list(state=state, batch=self.id)

    @op
    def destroy(self) -> int:
        """``DELETE /v1/batches/{id}``: destroys its sandboxes; how many."""
        doc = yield from self._client._call("DELETE", "/v1/batches/" + _q(self.id),
                                            timeout=max(self._client.timeout, 300.0))
        self.info = doc
        return int(doc.get("destroyed", 0))


# ----- process sessions ------------------------------------------------------------

# An interactive shell: bash where the image has it, else sh.
_DEFAULT_SHELL = ["/bin/sh", "-c", "[ -x /bin/bash ] && exec /bin/bash -i; exec /bin/sh -i"]


class ProcessEvent:
    """One event of a process session's output (``GET .../processes/{pid}/output``):
    ``type`` is ``stdout`` or ``stderr`` (``data`` holds the bytes; a
    terminal's output is all ``stdout``), ``gap`` (output that left the
    server's 1 MiB window before it was read: ``next`` is where reading goes
    on), ``keepalive``, ``exit`` (``exit_code``, ``signal``, ``timed_out``,
    ``duration_ms``) or ``error``. ``offset`` counts bytes of both streams."""

    def __init__(self, doc: Dict[str, Any]):
        self.raw = doc
        self.type: str = doc.get("type", "")
        self.offset: Optional[int] = doc.get("offset")
        if "data_b64" in doc:
            self.data = base64.b64decode(doc["data_b64"])
        else:
            self.data = str(doc.get("data", "")).encode("utf-8")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("raw", "type", "offset", "data"):
            raise AttributeError(name)
        try:
            return self.raw[name]
        except KeyError:
            raise AttributeError(f"ProcessEvent has no field {name!r}") from None

    def __repr__(self) -> str:
        return f"ProcessEvent({self.raw!r})"


class ProcessOps(_Driven):
    """What Process and AsyncProcess share: a command that runs apart from
    any one request (``Sandbox.pty``, ``Sandbox.start_process``), with or
    without a terminal. Its output stays on the server (the latest 1 MiB),
    so iterating again, from this object or another one made by
    ``Sandbox.process(pid)`` after a dropped connection, goes on where the
    last reader stopped. ``info`` is the last Process object the server
    returned; ``pid`` names it."""

    def __init__(self, sandbox: "SandboxOps", info: Dict[str, Any]):
        self.sandbox = sandbox
        self.client = sandbox.client
        self.info: Dict[str, Any] = dict(info)
        self.pid: int = int(self.info["pid"])
        self.offset = 0  # where the next read of output starts
        self.exit: Optional[ProcessEvent] = None

    @property
    def _driver(self) -> "ClientOps":
        return self.client

    def _p(self, suffix: str = "") -> str:
        return self.sandbox._p(f"/processes/{self.pid}{suffix}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(pid={self.pid}, sandbox={self.sandbox.id!r}, "
                f"running={self.info.get('running')!r})")

    @property
    def running(self) -> bool:
        return bool(self.info.get("running"))

    @property
    def exit_code(self) -> Optional[int]:
        return self.info.get("exit_code")

    @op
    def refresh(self) -> "ProcessOps":
        self.info = yield from self.client._call("GET", self._p())
        return self

    @op
    def send(self, data: Union[str, bytes]) -> None:
        """Input for the process (a terminal's keystrokes: ``"\\x03"`` is ^C)."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        yield from self.client._call("POST", self._p("/input"),
                                     json_body={"data_b64": base64.b64encode(raw).decode()})

    @op
    def close_stdin(self) -> None:
        """No more input (the program reads end of file; a terminal stays)."""
        yield from self.client._call("POST", self._p("/input"), json_body={"eof": True})

    @op
    def resize(self, rows: int, cols: int) -> None:
        """A terminal's new size: its foreground program gets SIGWINCH."""
        yield from self.client._call("POST", self._p("/resize"),
                                     json_body={"rows": int(rows), "cols": int(cols)})

    @op
    def signal(self, sig: Union[int, str]) -> None:
        """Sends ``sig`` (a number or a name such as ``"SIGINT"``) to its process
        group; on a terminal, as a typed ^C would, to its foreground process
        group (the job its shell runs, or the shell at its prompt)."""
        yield from self.client._call("POST", self._p("/signal"), json_body={"signal": sig})

    @op
    def kill(self) -> "ProcessOps":
        """SIGKILL to its process group (and a terminal's foreground job)."""
        self.info = yield from self.client._call("DELETE", self._p())
        return self

    @stream_op
    def events(self, offset: Optional[int] = None, follow: bool = True) -> Iterator[ProcessEvent]:
        """Its output as :class:`ProcessEvent` objects from ``offset`` (default:
        where this object's last read stopped), then its ``exit``; with
        ``follow=False`` only what is there now. A quiet process sends a
        ``keepalive`` event every 15 s (a loop can check its own deadline).
        Leaving early just stops reading: the process goes on."""
        start = self.offset if offset is None else int(offset)
        c = self.client
        req = self._output_request(start, follow)
        yield from c._exchange(req)
        final = False
        rd = _NdjsonReader(c, req)
        while not rd.done:
            for doc in (yield from rd.next_docs()):
                ev = self._track(ProcessEvent(doc))
                final = final or ev.type in ("exit", "error")
                yield Emit(ev)
        if follow and not final:
            raise Unavailable("unavailable",
                              f"GET {req.target}: stream ended without an exit event")

    def _output_request(self, start: int, follow: bool) -> "Request":
        c = self.client
        return c._request("GET", self._p("/output"),
                          query=[("offset", str(start)), ("follow", "true" if follow else "false")],
                          headers={"Accept": "application/x-ndjson"},
                          timeout=max(c.timeout, 60.0), retry=True, stream=True)

    def _track(self, ev: ProcessEvent) -> ProcessEvent:
        """Moves ``offset`` past ``ev`` and records an end."""
        if ev.type in ("stdout", "stderr") and ev.offset is not None:
            self.offset = ev.offset + len(ev.data)
        elif ev.type == "gap":
            self.offset = int(ev.raw.get("next", self.offset))
        elif ev.type in ("exit", "error"):
            self.exit = ev
            self.info["running"] = False
            if ev.type == "exit":
                self.info["exit_code"] = ev.raw.get("exit_code")
        return ev

    @op
    def wait(self) -> Dict[str, Any]:
        """Reads its output to the end (from where the last read stopped) and
        returns the process's final info (``exit_code``, ``signal``...)."""
        c = self.client
        while True:  # a stream that broke off is read again from its offset
            req = self._output_request(self.offset, True)
            yield from c._exchange(req)
            rd = _NdjsonReader(c, req)
            while not rd.done:
                for doc in (yield from rd.next_docs()):
                    if self._track(ProcessEvent(doc)).type in ("exit", "error"):
                        self.info = yield from c._call("GET", self._p())
                        return self.info


# ----- sandboxes ------------------------------------------------------------------

class SandboxOps(_Driven):
    """What Sandbox and AsyncSandbox share. ``info`` is the last Sandbox
    object the server returned; ``id``, ``state``, ``backend``, ``image``,
    ``labels``, ``user`` and ``working_dir`` come from it and other keys are
    reachable as attributes (``sb.memory_mb``, ``sb.stats``)."""

    _trajectory_class: type
    _process_class: type

    def __init__(self, client: ClientOps, info: Dict[str, Any]):
        self.client = client
        self.info: Dict[str, Any] = dict(info)
        self.id: str = self.info["id"]

    @property
    def _driver(self) -> ClientOps:
        return self.client

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
        return f"{type(self).__name__}(id={self.id!r}, state={self.state!r}, image={self.image!r})"

    def _p(self, suffix: str = "") -> str:
        return "/v1/sandboxes/" + _q(self.id) + suffix

    def _exec_timeout(self, timeout: Optional[float]) -> float:
        return (60.0 if timeout is None else float(timeout)) + self.client.timeout

    @op
    def refresh(self) -> "Sandbox":
        """Reloads ``info`` from the server."""
        self.info = yield from self.client._call("GET", self._p())
        return self

    @op
    def pack_diff(self, name: str, tag: str = "latest", trajectory_id: Optional[str] = None,
                  step: Optional[int] = None) -> Image:
        """Snapshots the sandbox's changes (while it keeps running; it is frozen
        for the moment of the copy) into a ``diff`` image ``name:tag``; create
        from it with ``client.create(snapshot="name:tag")``. Diffs chain: a
        sandbox made from a snapshot packs into a snapshot of both.

        With ``trajectory_id`` and ``step`` it is a trajectory step of kind
        ``checkpoint`` (see :meth:`Trajectory.checkpoint`): a repeat returns
        the image made the first time (``Image.raw["replayed"]``) without
        packing again (and so it may be retried)."""
        body: Dict[str, Any] = {"name": name, "tag": tag}
        if trajectory_id is not None or step is not None:
            body["trajectory_id"] = trajectory_id
            body["step"] = step
        return Image((yield from self.client._call(
            "POST", self._p("/pack_diff"), json_body=body,
            timeout=max(self.client.timeout, 300.0), retry=_is_step(trajectory_id, step))))

    @op
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
        self.info = yield from self.client._call("POST", self._p("/phase"), json_body=body)
        return self

    @op
    def audit(self) -> dict:
        """What the sandbox tried and was refused: ``{"denied_syscalls":
        {"mount": 2, ...}, "denied_total": 2, "egress_denied": 1,
        "egress_last_denied": "192.0.2.9:443"}`` counted since it started, so
        a trainer can flag trajectories that probed their sandbox or its
        network."""
        return (yield from self.client._call("GET", self._p("/audit")))

    # ----- computer use (backend "vm") -----------------------------------

    @op
    def screenshot(self, timeout: Optional[float] = None) -> bytes:
        """The sandbox's screen as PNG bytes (``GET .../screenshot``). Only a
        ``backend="vm"`` sandbox has a display; others raise
        ``failed_precondition``."""
        return (yield from self.client._call("GET", self._p("/screenshot"), raw=True,
                                             headers={"Accept": "image/png"}, timeout=timeout))

    def _input(self, body: Dict[str, Any]) -> Op:
        yield from self.client._call("POST", self._p("/input"), json_body=body,
                                     timeout=max(self.client.timeout, 60.0))

    @op
    def mouse(self, x: int, y: int, button: Optional[str] = "left") -> None:
        """Moves the pointer to screen pixel (x, y) and clicks ``button``
        (``left``, ``right``, ``middle``, ``wheel-up``, ``wheel-down``; None
        only moves)."""
        body: Dict[str, Any] = {"type": "mouse", "x": int(x), "y": int(y)}
        if button:
            body["button"] = button
        yield from self._input(body)

    @op
    def type(self, text: str) -> None:
        """Types ``text`` on the keyboard (printable ASCII, ``\\n`` is Return,
        ``\\t`` Tab; US layout)."""
        yield from self._input({"type": "type", "text": text})

    @op
    def key(self, combo: str) -> None:
        """Presses a key combination such as ``"ctrl+c"``, ``"Return"`` or
        ``"ctrl+alt+delete"`` (QEMU key names or common aliases)."""
        yield from self._input({"type": "key", "key": combo})

    @op
    def destroy(self) -> "Sandbox":
        """Stops and removes the sandbox (repeat calls are fine)."""
        self.info = yield from self.client._call("DELETE", self._p(),
                                                 timeout=max(self.client.timeout, 60.0))
        return self

    # ----- exec -----------------------------------------------------------

    @op
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
        ``replayed=True`` (see :meth:`trajectory`); such a call is retried on
        503/429 and on a connection lost before the answer, a plain exec never.
        The answer may take the command's ``timeout`` (default 60 s) plus the
        client's timeout.

        With AsyncClient, cancelling the task that awaits it closes the
        connection, which the server takes as the caller going away: it kills
        the command's process group (docs/sdk.md, Cancellation: where the
        server is with that).
        """
        body = _exec_body(cmd, timeout, env, cwd, user, stdin, max_output_bytes, encoding, False)
        if trajectory_id is not None or step is not None:
            body["trajectory_id"] = trajectory_id
            body["step"] = step
        doc = yield from self.client._call("POST", self._p("/exec"), json_body=body,
                                           timeout=self._exec_timeout(timeout),
                                           retry=_is_step(trajectory_id, step))
        return ExecResult.from_json(doc, base64_output=(encoding == "base64"))

    @op
    def run(self, code: str, language: str = "python", *, stdin: Union[None, str, bytes] = None,
            timeout: Optional[float] = None, limits: Optional[Dict[str, int]] = None,
            env: Optional[Dict[str, str]] = None, max_output_bytes: Optional[int] = None,
            encoding: Optional[str] = None) -> ExecResult:
        """Runs ``code`` as one call in this ``fncall`` sandbox
        (``POST /v1/sandboxes/{id}/run``): python forks the sandbox's warm
        zygote, other languages are exec'd; it runs in ``/scratch``, whose files
        persist between calls (write them with :meth:`write_file`), while its
        processes, environment and globals do not. Other arguments as
        :meth:`Client.run`. Conflict on a container sandbox. Not retried;
        cancelling an AsyncSandbox's call closes its connection.
        """
        body = _run_body(code, language, stdin, timeout, limits, env, max_output_bytes,
                         encoding)
        t = (10.0 if timeout is None else float(timeout)) + self.client.timeout
        doc = yield from self.client._call("POST", self._p("/run"), json_body=body, timeout=t)
        return ExecResult.from_json(doc, base64_output=(encoding == "base64"))

    @stream_op
    def exec_stream(self, cmd: Union[str, Sequence[str]], timeout: Optional[float] = None,
                    env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                    user: Optional[Union[str, int]] = None,
                    stdin: Union[None, str, bytes] = None,
                    max_output_bytes: Optional[int] = None,
                    encoding: Optional[str] = None) -> Iterator[ExecEvent]:
        """Runs ``cmd`` and yields :class:`ExecEvent` objects as output arrives;
        the last one has type "exit" (or "error"). Closing the generator early
        drops the connection; the server then stops the command. Each event
        must come within the command's ``timeout`` plus the client's. Not
        retried.

        From AsyncSandbox it is an async generator (``async for ev in
        sb.exec_stream(...)``); leaving it early, ``aclose()``, or cancelling
        the task iterating it closes the connection, and the server kills the
        command's process group. Use ``contextlib.aclosing`` to close it at
        once when you stop early.
        """
        body = _exec_body(cmd, timeout, env, cwd, user, stdin, max_output_bytes, encoding, True)
        c = self.client
        req = c._request("POST", self._p("/exec"), json_body=body,
                         headers={"Accept": "application/x-ndjson"},
                         timeout=self._exec_timeout(timeout), retry=False, stream=True)
        resp = yield from c._exchange(req)
        b64 = encoding == "base64"
        ctype = resp.headers.get("content-type", "").split(";")[0].strip()
        if ctype == "application/json":
            # The server answered with a whole result; present it as events.
            data = yield from _read_rest(c, req)
            doc = json.loads(data.decode("utf-8"))
            r = ExecResult.from_json(doc, b64)
            for kind, b in (("stdout", r.stdout_bytes), ("stderr", r.stderr_bytes)):
                if b:
                    yield Emit(ExecEvent({"type": kind, "data_b64": base64.b64encode(b).decode()}
                                         if b64 else {"type": kind, "data": b.decode()}))
            ev = {k: v for k, v in doc.items()
                  if k not in ("stdout", "stderr", "stdout_b64", "stderr_b64")}
            ev["type"] = "exit"
            yield Emit(ExecEvent(ev))
            return
        final = False
        rd = _NdjsonReader(c, req)
        while not rd.done:
            for doc in (yield from rd.next_docs()):
                ev = ExecEvent(doc)
                final = final or ev.type in ("exit", "error")
                yield Emit(ev)
        if not final:
            raise Unavailable("unavailable",
                              f"POST {req.target}: stream ended without an exit event")

    # ----- process sessions --------------------------------------------

    def _process_body(self, cmd: Union[None, str, Sequence[str]], env: Optional[Dict[str, str]],
                      cwd: Optional[str], user: Optional[Union[str, int]],
                      timeout: Optional[float], tag: Optional[str]) -> Dict[str, Any]:
        if cmd is None:
            cmd = _DEFAULT_SHELL
        body = _exec_body(cmd, timeout, env, cwd, user, None, None, None, False)
        if tag is not None:
            body["tag"] = tag
        return body

    @op
    def pty(self, cmd: Union[None, str, Sequence[str]] = None, rows: int = 24, cols: int = 80,
            *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
            user: Optional[Union[str, int]] = None, timeout: Optional[float] = None,
            tag: Optional[str] = None) -> "ProcessOps":
        """Starts ``cmd`` (default: an interactive shell, ``$SHELL`` or
        ``/bin/sh``) on a new pseudo-terminal of ``rows`` x ``cols`` and
        returns its :class:`Process` at once: ``send`` keystrokes, ``resize``,
        iterate its output (bytes), ``kill``. It runs until it exits or is
        killed (or for ``timeout`` seconds), whoever is reading; set
        ``TERM`` in ``env`` for programs that need one (default
        ``xterm-256color``)."""
        body = self._process_body(cmd, env, cwd, user, timeout, tag)
        body.setdefault("env", {})
        body["env"] = dict(body["env"])
        body["env"].setdefault("TERM", "xterm-256color")
        body["pty"] = {"rows": int(rows), "cols": int(cols)}
        doc = yield from self.client._call("POST", self._p("/processes"), json_body=body)
        return self._process_class(self, doc)

    @op
    def start_process(self, cmd: Union[str, Sequence[str]], *, stdin: bool = False,
                      env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                      user: Optional[Union[str, int]] = None, timeout: Optional[float] = None,
                      tag: Optional[str] = None) -> "ProcessOps":
        """Starts ``cmd`` in the background, without a terminal, and returns its
        :class:`Process` (stdout and stderr apart in its events; ``stdin=True``
        keeps its input open for ``send``)."""
        body = self._process_body(cmd, env, cwd, user, timeout, tag)
        body["stdin"] = bool(stdin)
        doc = yield from self.client._call("POST", self._p("/processes"), json_body=body)
        return self._process_class(self, doc)

    @op
    def processes(self) -> List["ProcessOps"]:
        """The sandbox's process sessions, running and recently ended."""
        doc = yield from self.client._call("GET", self._p("/processes"))
        return [self._process_class(self, p) for p in doc.get("processes", [])]

    @op
    def process(self, pid: int) -> "ProcessOps":
        """Reconnects to process session ``pid`` (NotFound when there is none)."""
        doc = yield from self.client._call("GET", self._p(f"/processes/{int(pid)}"))
        return self._process_class(self, doc)

    # ----- exposed ports --------------------------------------------------

    @op
    def expose(self, port: int, *, ttl_s: Optional[float] = None,
               rotate: bool = False) -> "Exposure":
        """Makes ``port`` (a server on the sandbox's loopback or any address)
        reachable through the platform and returns its :class:`Exposure`:
        ``url`` for a browser, ``path_url`` plus ``headers`` for a program.
        Exposing a port again returns the same token; ``rotate=True`` makes a
        new one (the old one stops working and its connections are cut);
        ``ttl_s`` ends the exposure after that many seconds."""
        body: Dict[str, Any] = {"port": int(port)}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        if rotate:
            body["rotate"] = True
        doc = yield from self.client._call("POST", self._p("/ports"), json_body=body)
        return Exposure(doc)

    @op
    def unexpose(self, port: int) -> None:
        """Ends the exposure of ``port``: its URLs stop working and open
        connections through them are cut."""
        yield from self.client._call("DELETE", self._p(f"/ports/{int(port)}"))

    @op
    def exposures(self) -> List["Exposure"]:
        """The sandbox's exposed ports."""
        doc = yield from self.client._call("GET", self._p("/ports"))
        return [Exposure(p) for p in doc.get("ports", [])]

    # ----- files ----------------------------------------------------------

    @op
    def read_file(self, path: str, timeout: Optional[float] = None,
                  trajectory_id: Optional[str] = None, step: Optional[int] = None) -> bytes:
        """The whole content of ``path`` (absolute, inside the sandbox); as a
        trajectory step, the content read the first time (at most 64 MiB)."""
        return (yield from self.client._call(
            "GET", self._p("/files"), query=[("path", path)] + _step_query(trajectory_id, step),
            raw=True, headers={"Accept": "application/octet-stream"}, timeout=timeout))

    @op
    def read_file_to(self, path: str, out: BinaryIO, timeout: Optional[float] = None) -> int:
        """Streams ``path`` into the writable binary file ``out``; returns the
        size. ``timeout`` bounds the wait for each piece. With AsyncSandbox,
        ``out.write`` may also be a coroutine function."""
        c = self.client
        req = c._request("GET", self._p("/files"), query=[("path", path)],
                         headers={"Accept": "application/octet-stream"}, timeout=timeout,
                         stream=True)
        yield from c._exchange(req)
        n = 0
        while True:
            b = yield from _read(c, req)
            if not b:
                return n
            yield Call(out.write, b)
            n += len(b)

    @op
    def write_file(self, path: str, data: Union[bytes, str, BinaryIO, Iterable[bytes]],
                   mode: int = 0o644, timeout: Optional[float] = None,
                   trajectory_id: Optional[str] = None,
                   step: Optional[int] = None) -> Dict[str, Any]:
        """Writes ``data`` (bytes, str as UTF-8, a binary file object, or an
        iterable of bytes chunks; streamed) to ``path``; returns ``{"path","size"}``
        (and ``replayed`` for a trajectory step, at most 64 MiB). AsyncSandbox
        also takes an async iterable of bytes."""
        body = Body.of(data)
        t = timeout if timeout is not None else max(self.client.timeout, 300.0)
        return (yield from self.client._call(
            "PUT", self._p("/files"),
            query=[("path", path), ("mode", format(int(mode), "04o"))]
            + _step_query(trajectory_id, step),
            body=body, headers={"Content-Type": "application/octet-stream"}, timeout=t,
            retry=_is_step(trajectory_id, step)))

    @op
    def list_dir(self, path: str) -> List[FileEntry]:
        """The entries of the directory ``path``."""
        doc = yield from self.client._call("GET", self._p("/files/list"), query=[("path", path)])
        return [FileEntry(e) for e in doc.get("entries", [])]

    @op
    def stat(self, path: str) -> FileEntry:
        """What ``path`` is (not following a final symlink); NotFound if nothing."""
        return FileEntry((yield from self.client._call("GET", self._p("/files/stat"),
                                                       query=[("path", path)])))

    @op
    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (a stat that is not NotFound)."""
        try:
            yield from SandboxOps.stat(self, path)
            return True
        except NotFound:
            return False

    @op
    def mkdir(self, path: str, parents: bool = True, mode: Optional[int] = None,
              trajectory_id: Optional[str] = None, step: Optional[int] = None) -> None:
        """Makes the directory ``path`` (and its parents with ``parents``)."""
        body: Dict[str, Any] = {"path": path, "parents": bool(parents)}
        if mode is not None:
            body["mode"] = int(mode)
        yield from self.client._call("POST", self._p("/files/mkdir"), json_body=body,
                                     query=_step_query(trajectory_id, step),
                                     retry=_is_step(trajectory_id, step))

    @op
    def remove(self, path: str, recursive: bool = False, trajectory_id: Optional[str] = None,
               step: Optional[int] = None) -> None:
        """Removes ``path`` (a directory's contents too with ``recursive``)."""
        yield from self.client._call(
            "DELETE", self._p("/files"),
            query=[("path", path), ("recursive", "true" if recursive else "false")]
            + _step_query(trajectory_id, step), retry=_is_step(trajectory_id, step))

    @op
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
        self.info = yield from self.client._call("POST", self._p("/pause"), json_body=body,
                                                 timeout=timeout)
        return self

    @op
    def resume(self) -> "Sandbox":
        """Runs a paused sandbox again (one paused to disk is restored)."""
        self.info = yield from self.client._call("POST", self._p("/resume"),
                                                 timeout=max(self.client.timeout, 900.0))
        return self

    def trajectory(self, trajectory_id: str, start: int = 0):
        """Calls on this sandbox numbered as steps of ``trajectory_id``, from
        ``start``: a trainer that is preempted and replays its own code from
        the beginning gets every completed step back from the log (nothing
        runs again: ``echo x >> f`` appends once) and continues live at the
        first new one. The same step with a different call → Conflict (409).
        A Trajectory (an AsyncTrajectory on an AsyncSandbox)."""
        return self._trajectory_class(self, trajectory_id, start)


# ----- trajectories ------------------------------------------------------------

class TrajectoryOps:
    """Numbers the calls made through it as consecutive steps of one
    trajectory (``sandbox.trajectory(id)``). ``next_step`` is the number the
    next call gets; it is taken when the method is called (on an
    AsyncTrajectory, before the returned coroutine is awaited), so steps
    follow the order of the calls."""

    def __init__(self, sandbox: SandboxOps, trajectory_id: str, start: int = 0):
        self.sandbox = sandbox
        self.id = trajectory_id
        self.next_step = int(start)

    def _take(self) -> int:
        n = self.next_step
        self.next_step += 1
        return n

    def exec(self, cmd: Union[str, Sequence[str]], **kw: Any):
        """``sandbox.exec`` as the next step."""
        return self.sandbox.exec(cmd, trajectory_id=self.id, step=self._take(), **kw)

    def write_file(self, path: str, data: Any, **kw: Any):
        """``sandbox.write_file`` as the next step."""
        return self.sandbox.write_file(path, data, trajectory_id=self.id, step=self._take(), **kw)

    def read_file(self, path: str, **kw: Any):
        """``sandbox.read_file`` as the next step."""
        return self.sandbox.read_file(path, trajectory_id=self.id, step=self._take(), **kw)

    def remove(self, path: str, recursive: bool = False):
        """``sandbox.remove`` as the next step."""
        return self.sandbox.remove(path, recursive=recursive, trajectory_id=self.id,
                                   step=self._take())

    def mkdir(self, path: str, parents: bool = True, mode: Optional[int] = None):
        """``sandbox.mkdir`` as the next step."""
        return self.sandbox.mkdir(path, parents=parents, mode=mode, trajectory_id=self.id,
                                  step=self._take())

    def checkpoint(self, name: Optional[str] = None, tag: Optional[str] = None):
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

    def export(self):
        """``client.export_trajectory`` of this trajectory."""
        return self.sandbox.client.export_trajectory(self.id)
