"""HTTP/1.1 on the wire, without any I/O (sans-I/O).

Both transports (the sync client's sockets, the async client's streams) build
their requests with :func:`request_head` / :func:`chunk` and frame every answer
with one :class:`ResponseParser`: they only move bytes between it and the
network.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Union

# A response head larger than this is refused (a dsec head is a few hundred bytes).
MAX_HEAD = 256 * 1024

LAST_CHUNK = b"0\r\n\r\n"


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 answer we can frame (or the
    connection ended inside one)."""


class NoResponse(ProtocolError):
    """The connection ended before any byte of the answer: on a kept-alive
    connection, the server closed it while it was idle (the request was not
    read), so it may be sent again on a new one."""


def request_head(method: str, target: str, host: str, headers: Mapping[str, str],
                 length: Optional[int], chunked: bool = False) -> bytes:
    """The request line and headers, ending with the empty line. ``length`` is
    the body's size (None: no body); ``chunked`` frames it with chunked
    encoding instead. POST, PUT and PATCH always carry a length (0 without a
    body), as http.client does."""
    parts = [method, " ", target, " HTTP/1.1\r\nHost: ", host,
             "\r\nAccept-Encoding: identity\r\n"]
    for k, v in headers.items():
        parts += (k, ": ", v, "\r\n")
    if chunked:
        parts.append("Transfer-Encoding: chunked\r\n")
    elif length is not None or method in ("POST", "PUT", "PATCH"):
        parts += ("Content-Length: ", str(length or 0), "\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1")


def chunk(data: Union[bytes, bytearray, memoryview]) -> bytes:
    """One chunk of a chunked body (``data`` must not be empty)."""
    return b"%x\r\n" % len(data) + bytes(data) + b"\r\n"


class Head:
    """The status line and headers of an answer; header names are lower case,
    repeated headers joined with ", "."""

    __slots__ = ("status", "reason", "headers")

    def __init__(self, status: int, reason: str, headers: Dict[str, str]):
        self.status = status
        self.reason = reason
        self.headers = headers


# Events of ResponseParser.next_event (besides a Head and body bytes).
NEED_DATA = "NEED_DATA"
END = "END"

_HEAD, _LENGTH, _TO_EOF, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _DONE = range(8)


class ResponseParser:
    """Frames one HTTP/1.1 response: feed it the bytes read from the
    connection (``b""`` at the connection's end) and take its events.

    ``next_event()`` returns :data:`NEED_DATA` (feed more), a :class:`Head`
    (once; interim 1xx answers are skipped), non-empty ``bytes`` of the body
    (de-chunked), then :data:`END`. Bodies are framed by Content-Length,
    chunked encoding, or the connection's end; HEAD answers and 204/304 have
    none. After END, ``keep_alive`` says whether the connection may carry the
    next request. ``started`` is true once any byte arrived. Malformed input
    raises :class:`ProtocolError`; the end of the connection before any byte
    raises :class:`NoResponse`.
    """

    # The unread bytes are _buf[_pos:]: an answer read in one piece is
    # parsed without copying it, and a piece holding many small chunks is
    # consumed in one pass.
    __slots__ = ("_method", "_buf", "_pos", "_eof", "_state", "_left", "started", "head",
                 "keep_alive")

    def __init__(self, method: str = "GET"):
        self._method = method
        self._buf = b""
        self._pos = 0
        self._eof = False
        self._state = _HEAD
        self._left = 0
        self.started = False
        self.head: Optional[Head] = None
        self.keep_alive = False

    def feed(self, data: bytes) -> None:
        if data:
            self.started = True
            if self._pos >= len(self._buf):
                self._buf = bytes(data)
            else:
                self._buf = self._buf[self._pos:] + data
            self._pos = 0
        else:
            self._eof = True

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def _take(self, n: int) -> bytes:
        """Up to ``n`` unread bytes (at least one must be unread)."""
        buf, pos = self._buf, self._pos
        end = pos + n
        if pos == 0 and end >= len(buf):
            self._pos = len(buf)
            return buf
        data = buf[pos:end]
        self._pos = pos + len(data)
        return data

    def next_event(self):
        while True:
            st = self._state
            have = len(self._buf) - self._pos
            if st == _LENGTH:
                if self._left == 0:
                    return self._end()
                if have:
                    data = self._take(self._left)
                    self._left -= len(data)
                    return data
                if self._eof:
                    raise ProtocolError("connection closed inside the response body")
                return NEED_DATA
            if st == _HEAD:
                ev = self._parse_head()
                if ev is not None:
                    return ev
                continue
            if st == _CHUNK_DATA:
                if have:
                    data = self._take(self._left)
                    self._left -= len(data)
                    if self._left == 0:
                        self._state = _CHUNK_CRLF
                    return data
                if self._eof:
                    raise ProtocolError("connection closed inside a chunk")
                return NEED_DATA
            if st == _TO_EOF:
                if have:
                    return self._take(have)
                if self._eof:
                    return self._end()
                return NEED_DATA
            if st == _DONE:
                return END
            # the line-oriented states of a chunked body
            i = self._buf.find(b"\r\n", self._pos)
            if i < 0:
                if self._eof:
                    raise ProtocolError("connection closed inside a chunked body")
                if have > MAX_HEAD:
                    raise ProtocolError("chunk header line too long")
                return NEED_DATA
            line = self._buf[self._pos:i]
            self._pos = i + 2
            if st == _CHUNK_SIZE:
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line[:40]!r}") from None
                if size < 0:
                    raise ProtocolError(f"bad chunk size {line[:40]!r}")
                if size == 0:
                    self._state = _TRAILERS
                else:
                    self._left = size
                    self._state = _CHUNK_DATA
            elif st == _CHUNK_CRLF:
                if line:
                    raise ProtocolError("chunk not followed by CRLF")
                self._state = _CHUNK_SIZE
            else:  # _TRAILERS: skipped up to the empty line
                if not line:
                    return self._end()

    def _end(self) -> str:
        self._state = _DONE
        if self._pos < len(self._buf):
            # Bytes past the answer (none from a sane server): not reused.
            self.keep_alive = False
        return END

    def _parse_head(self) -> Optional[Union[Head, str]]:
        buf, pos = self._buf, self._pos
        end = buf.find(b"\r\n\r\n", pos)
        if end < 0:
            if self._eof:
                if not self.started:
                    raise NoResponse("connection closed before the answer")
                raise ProtocolError("connection closed inside the response headers")
            if len(buf) - pos > MAX_HEAD:
                raise ProtocolError("response headers over 256 KiB")
            return NEED_DATA
        lines = buf[pos:end].decode("latin-1").split("\r\n")
        self._pos = end + 4
        first = lines[0].split(" ", 2)
        if len(first) < 2 or not first[0].startswith("HTTP/1.") or not first[1].isdigit():
            raise ProtocolError(f"bad status line {lines[0][:80]!r}")
        status = int(first[1])
        if 100 <= status < 200:  # an interim answer: the real one follows
            return None
        headers: Dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            value = value.strip()
            if name in headers:
                headers[name] += ", " + value
            else:
                headers[name] = value
        self.head = Head(status, first[2] if len(first) > 2 else "", headers)
        keep = first[0] != "HTTP/1.0"
        conn = headers.get("connection")
        if conn is not None:
            conn = conn.lower()
            if conn in ("close", "keep-alive"):
                keep = conn == "keep-alive"
        self.keep_alive = keep
        te = headers.get("transfer-encoding")
        if self._method == "HEAD":
            # A server that wrongly sends a body with a HEAD answer would leave
            # stray bytes on the kept-alive connection; HEAD is rare, so the
            # connection is not reused after one.
            self.keep_alive = False
            self._state = _DONE
        elif status in (204, 304):
            self._state = _DONE
        elif te is not None and "chunked" in te.lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            v = headers["content-length"]
            try:
                self._left = int(v)
            except ValueError:
                raise ProtocolError(f"bad Content-Length {v[:40]!r}") from None
            if self._left < 0:
                raise ProtocolError(f"bad Content-Length {v[:40]!r}")
            self._state = _LENGTH
        else:  # to the connection's end
            self.keep_alive = False
            self._state = _TO_EOF
        if self._state == _DONE and self._pos < len(buf):
            self.keep_alive = False
        return self.head
