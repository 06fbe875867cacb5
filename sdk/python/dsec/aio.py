"""The asyncio client for the dsec REST API v1 (standard library only).

:class:`AsyncClient` has every call of :class:`dsec.Client`, as coroutines
with the same arguments, results and errors: both run the same operations
(_core.py); this module is their driver on asyncio streams, over a bounded
pool of kept-alive HTTP/1.1 connections.

    async with dsec.AsyncClient.from_data_dir("/var/lib/dsec") as c:
        sb = await c.create("debian:latest")
        r = await sb.exec(["python3", "-c", "print(6*7)"])
        async for ev in sb.exec_stream("for i in 1 2 3; do echo $i; done"):
            print(ev.type, ev.data)
        await sb.destroy()

An AsyncClient's connections belong to the event loop that opened them; used
under another loop (a second ``asyncio.run``) it starts a new pool. Call it
from its loop's thread only.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import ssl
from typing import Any, AsyncIterator, List, Optional, Sequence, Tuple, Union

from ._core import (DEFAULT_RETRY, DEFAULT_TIMEOUT, READ, BatchOps, Blocking, Body, Call,
                    ClientOps, Emit, Op, ProcessOps, Request, Response, Retry, SandboxOps, Sleep,
                    TrajectoryOps,
                    TransportFailure, as_bytes, request_pieces)
from ._http import END, LAST_CHUNK, NEED_DATA, ProtocolError, ResponseParser, chunk
from .errors import DsecError

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncBatch", "AsyncTrajectory"]

DEFAULT_MAX_CONNECTIONS = 100
# Writes wait for the socket past this much buffered (a file body is not read ahead whole).
_HIGH_WATER = 1 << 20
_RECV = 256 * 1024  # StreamReader.read copies what it has: no large allocation

if hasattr(asyncio, "timeout"):  # Python 3.11+
    _timeout = asyncio.timeout
else:
    class _timeout:  # type: ignore[no-redef]
        """asyncio.timeout for Python < 3.11: TimeoutError when the block
        takes longer than ``delay`` seconds."""

        def __init__(self, delay: Optional[float]):
            self._delay = delay
            self._handle: Optional[asyncio.TimerHandle] = None
            self._fired = False

        async def __aenter__(self) -> "_timeout":
            if self._delay is not None:
                task = asyncio.current_task()

                def fire() -> None:
                    self._fired = True
                    task.cancel()  # type: ignore[union-attr]
                self._handle = asyncio.get_running_loop().call_later(max(self._delay, 0), fire)
            return self

        async def __aexit__(self, et: Any, e: Any, tb: Any) -> bool:
            if self._handle is not None:
                self._handle.cancel()
            if et is asyncio.CancelledError and self._fired:
                raise TimeoutError("timed out") from e
            return False


class _Conn:
    """One kept-alive connection."""

    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        """False once the server closed it (or it broke) while idle."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    def abort(self) -> None:
        """Closes it at once, unread bytes and all: the server sees the client gone."""
        self.writer.transport.abort()


class _Pool:
    """At most ``size`` connections, in use or idle. A call takes the most
    recently used idle one, else opens one while fewer than ``size`` are
    open, else waits (first come, first served) for one to be handed back.
    Only a connection whose answer was read to its end goes back idle; one
    given up half-way (error, timeout, cancellation) is aborted."""

    def __init__(self, client: "AsyncClient", size: int):
        self._client = client
        self.loop = asyncio.get_running_loop()
        self.size = size
        self._slots = asyncio.Semaphore(size)
        self._idle: List[_Conn] = []
        self.open = 0  # connections open or opening, in use or idle
        self._generation = 0

    async def acquire(self, req: Request) -> Tuple[_Conn, bool, int]:
        await self._slots.acquire()
        try:
            if not req.fresh:
                while self._idle:
                    conn = self._idle.pop()
                    if conn.usable():
                        return conn, True, self._generation
                    self._drop(conn)
            if self.open >= self.size and self._idle:
                self._drop(self._idle.pop(0))  # the least recently used
            gen = self._generation
            self.open += 1  # counted while it connects, so that others see it
            try:
                conn = await self._client._connect(req.timeout)
            except BaseException:
                self.open -= 1
                raise
            return conn, False, gen
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: _Conn, reuse: bool, generation: int) -> None:
        if reuse and generation == self._generation and conn.usable():
            self._idle.append(conn)
        else:
            self._drop(conn)
        self._slots.release()

    def _drop(self, conn: _Conn) -> None:
        conn.abort()
        self.open -= 1

    def forget(self) -> None:
        """Drops the idle connections of a loop no longer running (closing
        what can still be closed)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            try:
                conn.abort()
            except RuntimeError:  # its loop is closed
                pass
        self.open = 0

    def close_idle(self) -> None:
        """Closes the idle connections; those in use close when handed back."""
        self._generation += 1
        while self._idle:
            self._drop(self._idle.pop())


class _Stream:
    """The body of a streamed answer, read piece by piece; the connection
    goes back to the pool when the body was read to its end."""

    __slots__ = ("pool", "conn", "parser", "timeout", "generation")

    def __init__(self, pool: _Pool, conn: _Conn, parser: ResponseParser, timeout: float,
                 generation: int):
        self.pool = pool
        self.conn: Optional[_Conn] = conn
        self.parser = parser
        self.timeout = timeout
        self.generation = generation

    async def read(self) -> bytes:
        conn, p = self.conn, self.parser
        if conn is None:
            return b""
        try:
            async with _timeout(self.timeout):
                while True:
                    ev = p.next_event()
                    if ev is NEED_DATA:
                        p.feed(await conn.reader.read(_RECV))
                        continue
                    if ev is END:
                        self.conn = None
                        self.pool.release(conn, p.keep_alive, self.generation)
                        return b""
                    return ev
        except (OSError, ProtocolError) as e:
            self.close()
            raise TransportFailure.of(e, started=True) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Aborts the connection unless the body was read to its end."""
        conn, self.conn = self.conn, None
        if conn is not None:
            self.pool.release(conn, False, self.generation)


class _Done:
    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class AsyncClient(ClientOps, driver="async"):
    """A connection pool to one dsec API endpoint, for asyncio.

    Every call of :class:`dsec.Client` is a coroutine here, with the same
    arguments, results (sandboxes are :class:`AsyncSandbox`, batches
    :class:`AsyncBatch`) and errors; ``exec_stream`` is an async generator.
    Use it as ``async with AsyncClient(...) as c:`` or call :meth:`aclose`.

    Args:
        url, token, timeout, retries, connect_timeout, local_addrs: as
            :class:`dsec.Client` (the same defaults; ``timeout`` bounds
            connecting, each write, and the whole answer once sent).
        max_connections: at most this many HTTP/1.1 connections (each
            carries one call at a time; those idle are kept alive for the
            next calls). A call beyond it waits for a connection to come
            free, without a time limit: a trainer with 32,768 execs in
            flight sets it to 32768. ``local_addrs`` spreads them over
            several source addresses when that is more than one address's
            ephemeral ports.

    Cancelling the task that awaits a call (an ``exec``, a ``run``, the
    iteration of an ``exec_stream``) aborts that call's connection, which
    never goes back to the pool half-read; the server takes the closed
    connection as the caller going away and stops the call (for an exec, it
    kills the command's process group).
    """

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = DEFAULT_TIMEOUT, *,
                 retries: Union[Retry, int, None] = DEFAULT_RETRY,
                 connect_timeout: Optional[float] = None,
                 local_addrs: Optional[Sequence[str]] = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        super().__init__(url, token, timeout, retries=retries, connect_timeout=connect_timeout,
                         local_addrs=local_addrs)
        if int(max_connections) < 1:
            raise ValueError("max_connections must be at least 1")
        self.max_connections = int(max_connections)
        self._pool_: Optional[_Pool] = None  # made on the first call, in its event loop
        self._addr_turn = itertools.count()
        self._ssl: Optional[ssl.SSLContext] = None

    # ----- connections -----------------------------------------------------------

    async def _connect(self, timeout: float) -> _Conn:
        src = None
        if self.local_addrs:
            src = (self.local_addrs[next(self._addr_turn) % len(self.local_addrs)], 0)
        ctx = None
        if self._scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        try:
            async with _timeout(self._connect_timeout(timeout)):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, ssl=ctx, local_addr=src, limit=1 << 20)
        except OSError as e:  # TimeoutError included
            raise TransportFailure.of(e, connecting=True) from None
        return _Conn(reader, writer)

    @property
    def _pool(self) -> _Pool:
        """The pool of the running event loop. Connections belong to the loop
        that opened them: a client used again under another loop (a second
        ``asyncio.run``) drops those of the old one and starts afresh."""
        pool = self._pool_
        if pool is None or pool.loop is not asyncio.get_running_loop():
            if pool is not None:
                pool.forget()
            pool = self._pool_ = _Pool(self, self.max_connections)
        return pool

    async def aclose(self) -> None:
        """Closes every idle kept-alive connection; those carrying a call
        close when it ends. The client may still be used (it reconnects)."""
        if self._pool_ is not None:
            self._pool_.close_idle()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def connections(self) -> int:
        """How many connections are open (in use or idle)."""
        return self._pool_.open if self._pool_ is not None else 0

    # ----- the driver -------------------------------------------------------------

    async def _send_request(self, conn: _Conn, req: Request) -> None:
        """Writes ``req``, waiting (at most its timeout each time) while the
        socket's buffer is full."""
        w = conn.writer
        t = req.timeout
        for piece in request_pieces(req, self._host_header):
            w.write(piece)
            if w.transport.get_write_buffer_size() > _HIGH_WATER:
                async with _timeout(t):
                    await w.drain()
        if req.body.kind == Body.AITER:
            async for piece in req.body.data:
                b = as_bytes(piece)
                if b:
                    w.write(chunk(b))
                    async with _timeout(t):
                        await w.drain()
            w.write(LAST_CHUNK)
        async with _timeout(t):
            await w.drain()

    async def _perform(self, req: Request) -> Response:
        """Sends ``req`` on a pooled connection and reads its answer: whole,
        or for a streamed 2xx answer only its head (the body on
        :class:`_Stream`). Raises TransportFailure when the connection fails."""
        pool = self._pool
        conn, reused, generation = await pool.acquire(req)
        p = ResponseParser(req.method)
        done = False
        try:
            await self._send_request(conn, req)
            reader = conn.reader
            async with _timeout(req.timeout):
                while True:
                    p.feed(await reader.read(_RECV))  # nothing to parse before the first read
                    head = p.next_event()
                    if head is not NEED_DATA:
                        break
                if req.stream and head.status < 400 and not p.done:
                    done = True
                    return Response(head.status, head.reason, head.headers, None,
                                    _Stream(pool, conn, p, req.timeout, generation))
                parts = []
                while True:
                    ev = p.next_event()
                    if ev is NEED_DATA:
                        p.feed(await reader.read(_RECV))
                    elif ev is END:
                        break
                    else:
                        parts.append(ev)
            done = True
        except (OSError, ProtocolError) as e:
            raise TransportFailure.of(e, reused=reused, started=p.started) from None
        finally:
            if not done:  # failed, timed out or cancelled half-way: never reused
                pool.release(conn, False, generation)
        pool.release(conn, p.keep_alive, generation)
        return Response(head.status, head.reason, head.headers,
                        parts[0] if len(parts) == 1 else b"".join(parts))

    async def _pump(self, gen: Op) -> AsyncIterator[Any]:
        """Runs operation ``gen``: performs what it yields, yields what it
        emits, and last its result wrapped in _Done."""
        stream: Optional[_Stream] = None
        try:
            eff = gen.send(None)
            while True:
                cls = eff.__class__
                try:
                    if cls is Request:
                        if stream is not None:
                            stream.close()
                        val = await self._perform(eff)
                        stream = val.stream
                    elif eff is READ:
                        val = await stream.read()  # type: ignore[union-attr]
                    elif cls is Emit:
                        yield eff.value
                        val = None
                    elif cls is Sleep:
                        await asyncio.sleep(eff.seconds)
                        val = None
                    elif cls is Blocking:
                        val = await asyncio.get_running_loop().run_in_executor(
                            None, eff.fn, *eff.args)
                    elif cls is Call:
                        val = eff.fn(*eff.args)
                        if inspect.isawaitable(val):
                            val = await val
                    else:
                        raise TypeError(f"operation yielded {eff!r}")
                except TransportFailure as f:
                    eff = gen.throw(f)
                    continue
                eff = gen.send(val)
        except StopIteration as e:
            result = _Done(e.value)
        finally:
            if stream is not None:
                stream.close()
            gen.close()
        yield result

    async def _drive(self, gen: Op) -> Any:
        pump = self._pump(gen)
        try:
            out = await pump.__anext__()
        finally:
            await pump.aclose()
        if out.__class__ is not _Done:
            raise TypeError("a streaming operation was called as a plain one")
        return out.value

    async def _drive_stream(self, gen: Op) -> AsyncIterator[Any]:
        pump = self._pump(gen)
        try:
            async for v in pump:
                if v.__class__ is _Done:
                    return
                yield v
        finally:
            await pump.aclose()


class AsyncBatch(BatchOps, driver="async"):
    """A batch creation (``AsyncClient.create_batch``), as :class:`dsec.Batch`
    with coroutines: ``await b.wait()``, ``await b.status()``,
    ``await b.sandboxes()``, ``await b.destroy()``."""


class AsyncSandbox(SandboxOps, driver="async"):
    """A sandbox on the server, as :class:`dsec.Sandbox` with coroutines
    (``await sb.exec(...)``) and ``exec_stream`` an async generator. Used as
    ``async with`` it is destroyed on exit.

    Cancelling the task awaiting a call aborts that call's connection; for
    ``exec``, ``run`` and ``exec_stream`` the server takes it as the caller
    going away and kills the command's process group."""

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.destroy()
        except DsecError:
            if exc[0] is None:
                raise


class AsyncProcess(ProcessOps, driver="async"):
    """A process session, as :class:`dsec.Process` with coroutines; ``async
    for chunk in proc`` yields its output as bytes until it ends."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for ev in self.events():
            if ev.data:
                yield ev.data


class AsyncTrajectory(TrajectoryOps):
    """As :class:`dsec.Trajectory` on an AsyncSandbox: each method takes its
    step number when called and returns the coroutine of the call
    (``await traj.exec(...)``)."""


AsyncClient._sandbox_class = AsyncSandbox
AsyncClient._batch_class = AsyncBatch
AsyncSandbox._trajectory_class = AsyncTrajectory
AsyncSandbox._process_class = AsyncProcess
