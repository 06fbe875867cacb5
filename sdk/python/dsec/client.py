"""The synchronous client for the dsec REST API v1 (standard library only).

Every call is an operation of _core.py run by this module's driver on
blocking sockets; :mod:`dsec.aio` runs the same operations on asyncio.

Thread safety: a :class:`Client` may be shared by any number of threads. Each
thread gets its own persistent (keep-alive) HTTP connection; a connection the
server closed while idle is replaced transparently, and a request whose body can
be sent again (bytes, or a seekable file) is sent once more on a new connection
when the reused one turns out to be dead before any byte of the answer. Streams
(``exec_stream``, ``read_file_to``) hold a connection until they are exhausted
or closed (another call on the same thread meanwhile opens its own). Requests
with a body up to 64 KiB (or none) go out in one write; every answer is framed
by the SDK's own HTTP/1.1 parser (_http.py).

Calls that are safe to repeat are retried on 503 and 429 and on connections
refused or lost before the answer (see :class:`dsec.Retry`).
"""

from __future__ import annotations

import itertools
import select
import socket
import ssl
import threading
import time
import weakref
from typing import Any, Iterator, Optional, Sequence, Tuple, Union

from ._core import (DEFAULT_DATA_DIR, DEFAULT_RETRY, DEFAULT_TIMEOUT, DEFAULT_URL, READ,
                    BatchOps, Blocking, Body, Call, ClientOps, Emit, Op, Request, Response, Retry,
                    ProcessOps, SandboxOps, Sleep, TrajectoryOps, TransportFailure, _iter_ndjson,
                    request_pieces)
from ._http import END, NEED_DATA, ProtocolError, ResponseParser
from .errors import DsecError

__all__ = ["Client", "Sandbox", "Batch", "Trajectory", "DEFAULT_URL", "DEFAULT_DATA_DIR",
           "DEFAULT_TIMEOUT", "_iter_ndjson"]

_RECV = 64 * 1024  # larger makes each recv allocate (mmap) a buffer it then shrinks


class _Conn:
    """One kept-alive connection."""

    __slots__ = ("sock", "__weakref__")

    def __init__(self, sock: socket.socket):
        self.sock: Optional[socket.socket] = sock

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)  # type: ignore[union-attr]

    def close(self) -> None:
        s, self.sock = self.sock, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass


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


def _set_timeout(sock: socket.socket, timeout: float) -> None:
    if sock.gettimeout() != timeout:  # settimeout is a system call
        sock.settimeout(timeout)


def _recv_into(conn: _Conn, p: ResponseParser, deadline: Optional[float]) -> None:
    """Feeds ``p`` the next bytes; with a deadline, the socket's timeout is
    brought down to what is left of it (give or take 50 ms: not a system
    call per read)."""
    sock = conn.sock
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("timed out")
        if left < sock.gettimeout() - 0.05:  # type: ignore[union-attr, operator]
            sock.settimeout(left)  # type: ignore[union-attr]
    p.feed(sock.recv(_RECV))  # type: ignore[union-attr]


class _Stream:
    """The body of a streamed answer, read piece by piece; the connection
    goes back to its thread when the body was read to its end."""

    __slots__ = ("client", "conn", "parser")

    def __init__(self, client: "Client", conn: _Conn, parser: ResponseParser):
        self.client = client
        self.conn: Optional[_Conn] = conn
        self.parser = parser

    def read(self) -> bytes:
        conn, p = self.conn, self.parser
        if conn is None:
            return b""
        try:
            while True:
                ev = p.next_event()
                if ev is NEED_DATA:
                    _recv_into(conn, p, None)  # the socket's timeout: per piece
                    continue
                if ev is END:
                    self.conn = None
                    if p.keep_alive:
                        self.client._checkin(conn)
                    else:
                        conn.close()
                    return b""
                return ev
        except (OSError, ProtocolError) as e:
            self.close()
            raise TransportFailure.of(e, started=True) from None

    def close(self) -> None:
        """Drops the connection unless the body was read to its end (unread
        bytes would desynchronise it)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class Client(ClientOps, driver="sync"):
    """A connection to one dsec API endpoint.

    Args:
        url: base URL; default ``$DSEC_URL`` or ``http://127.0.0.1:7070``.
        token: bearer token; default ``$DSEC_TOKEN``, else ``<data dir>/token``
            where the data dir is ``$DSEC_DATA_DIR`` or ``/var/lib/dsec``.
        timeout: seconds for ordinary calls: connecting, each write, and the
            whole answer once the request is sent (a streamed answer: each
            piece). Exec calls wait for the command's own timeout plus this much.
        retries: the :class:`dsec.Retry` policy of calls safe to repeat; an
            int for that many retries, None or 0 for none.
        connect_timeout: a shorter bound on connecting (default ``timeout``).
        local_addrs: source addresses to spread new connections over, in
            turn (e.g. ``["127.0.0.2", "127.0.0.3"]``).
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = DEFAULT_TIMEOUT, *,
                 retries: Union[Retry, int, None] = DEFAULT_RETRY,
                 connect_timeout: Optional[float] = None,
                 local_addrs: Optional[Sequence[str]] = None):
        super().__init__(url, token, timeout, retries=retries, connect_timeout=connect_timeout,
                         local_addrs=local_addrs)
        self._local = threading.local()
        # every thread's connection, so that close() reaches them all
        self._all_conns: "weakref.WeakSet[_Conn]" = weakref.WeakSet()
        self._conns_lock = threading.Lock()
        self._addr_turn = itertools.count()
        self._ssl: Optional[ssl.SSLContext] = None

    # ----- connections -----------------------------------------------------------

    def _connect(self, timeout: float) -> _Conn:
        src = None
        if self.local_addrs:
            src = (self.local_addrs[next(self._addr_turn) % len(self.local_addrs)], 0)
        try:
            sock = socket.create_connection((self._host, self._port),
                                            self._connect_timeout(timeout),
                                            source_address=src)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._scheme == "https":
                    if self._ssl is None:
                        self._ssl = ssl.create_default_context()
                    sock = self._ssl.wrap_socket(sock, server_hostname=self._host)
            except BaseException:
                sock.close()
                raise
        except OSError as e:
            raise TransportFailure.of(e, connecting=True) from None
        conn = _Conn(sock)
        with self._conns_lock:
            self._all_conns.add(conn)
        return conn

    def _checkout(self, req: Request) -> Tuple[_Conn, bool]:
        """This thread's idle connection (taken from it while in use), and
        whether it is a reused one; else a new connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            self._local.conn = None
            if not req.fresh and not _peer_closed(conn.sock):
                return conn, True
            conn.close()
        return self._connect(req.timeout), False

    def _checkin(self, conn: _Conn) -> None:
        """Keeps ``conn`` as this thread's connection, unless it has one."""
        cur = getattr(self._local, "conn", None)
        if cur is None or cur.sock is None:
            self._local.conn = conn
        else:
            conn.close()

    def close(self) -> None:
        """Closes every kept-alive connection (of all threads)."""
        with self._conns_lock:
            conns = list(self._all_conns)
        for c in conns:
            c.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- the driver -------------------------------------------------------------

    def _send_request(self, conn: _Conn, req: Request) -> None:
        for piece in request_pieces(req, self._host_header):  # not an AITER: see _perform
            conn.send(piece)

    def _perform(self, req: Request) -> Response:
        """Sends ``req`` on this thread's connection and reads its answer:
        whole, or for a streamed 2xx answer only its head (the body on
        :class:`_Stream`). Raises TransportFailure when the connection fails."""
        if req.body.kind == Body.AITER:
            raise TypeError("an async iterable body needs dsec.AsyncClient")
        conn, reused = self._checkout(req)
        p = ResponseParser(req.method)
        done = False
        try:
            _set_timeout(conn.sock, req.timeout)  # type: ignore[arg-type]
            self._send_request(conn, req)
            deadline = time.monotonic() + req.timeout
            while True:
                _recv_into(conn, p, deadline)  # nothing to parse before the first read
                head = p.next_event()
                if head is not NEED_DATA:
                    break
            if req.stream and head.status < 400 and not p.done:
                _set_timeout(conn.sock, req.timeout)  # type: ignore[arg-type]
                done = True
                return Response(head.status, head.reason, head.headers, None,
                                _Stream(self, conn, p))
            parts = []
            while True:
                ev = p.next_event()
                if ev is NEED_DATA:
                    _recv_into(conn, p, deadline)
                elif ev is END:
                    break
                else:
                    parts.append(ev)
            done = True
        except (OSError, ProtocolError) as e:
            raise TransportFailure.of(e, reused=reused, started=p.started) from None
        finally:
            if not done:
                conn.close()
        if p.keep_alive:
            self._checkin(conn)
        else:
            conn.close()
        return Response(head.status, head.reason, head.headers,
                        parts[0] if len(parts) == 1 else b"".join(parts))

    def _pump(self, gen: Op) -> Iterator[Any]:
        """Runs operation ``gen``: performs what it yields, yields what it
        emits, returns its result."""
        stream: Optional[_Stream] = None
        try:
            eff = gen.send(None)
            while True:
                cls = eff.__class__
                try:
                    if cls is Request:
                        if stream is not None:
                            stream.close()
                        val = self._perform(eff)
                        stream = val.stream
                    elif eff is READ:
                        val = stream.read()  # type: ignore[union-attr]
                    elif cls is Emit:
                        yield eff.value
                        val = None
                    elif cls is Sleep:
                        time.sleep(eff.seconds)
                        val = None
                    elif cls is Call or cls is Blocking:
                        val = eff.fn(*eff.args)
                    else:
                        raise TypeError(f"operation yielded {eff!r}")
                except TransportFailure as f:
                    eff = gen.throw(f)
                    continue
                eff = gen.send(val)
        except StopIteration as e:
            return e.value
        finally:
            if stream is not None:
                stream.close()
            gen.close()

    def _drive(self, gen: Op) -> Any:
        pump = self._pump(gen)
        try:
            pump.send(None)
        except StopIteration as e:
            return e.value
        pump.close()
        raise TypeError("a streaming operation was called as a plain one")

    def _drive_stream(self, gen: Op) -> Iterator[Any]:
        return self._pump(gen)


class Batch(BatchOps, driver="sync"):
    """A batch creation (``Client.create_batch``): its last known progress in
    ``info`` (``state``, ``requested``, ``pending``, ``running``, ``failed``,
    ``errors`` by code, ...)."""


class Sandbox(SandboxOps, driver="sync"):
    """A sandbox on the server. ``info`` is the last Sandbox object the server
    returned; ``id``, ``state``, ``backend``, ``image``, ``labels``, ``user`` and
    ``working_dir`` come from it and other keys are reachable as attributes
    (``sb.memory_mb``, ``sb.stats``).
    Used as a context manager it is destroyed on exit."""

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.destroy()
        except DsecError:
            if exc[0] is None:
                raise


class Process(ProcessOps, driver="sync"):
    """A process session (``Sandbox.pty``, ``Sandbox.start_process``,
    ``Sandbox.process``). Iterating it yields its output as bytes, from
    where the last read stopped, until it ends."""

    __doc__ = (__doc__ or "") + "\n\n" + (ProcessOps.__doc__ or "")

    def __iter__(self) -> Iterator[bytes]:
        for ev in self.events():
            if ev.data:
                yield ev.data


class Trajectory(TrajectoryOps):
    __doc__ = TrajectoryOps.__doc__


Client._sandbox_class = Sandbox
Client._batch_class = Batch
Sandbox._trajectory_class = Trajectory
Sandbox._process_class = Process
