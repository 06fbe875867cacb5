"""The two SDK clients behind one synchronous face, so that one test body
drives both: ``SYNC`` is dsec.Client itself; ``ASYNC`` runs dsec.AsyncClient
and its AsyncSandbox / AsyncBatch / AsyncTrajectory on a background event
loop thread, each call a coroutine run there (``run_coroutine_threadsafe``),
so the tests exercise the real async code paths (pool, streams, retries).

    flavor.Client(url, token=..., timeout=...)      # a Client, or a facade
    flavor.from_data_dir(path)
    flavor.wrap_like(sync_client)                   # the same endpoint in this flavor
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import dsec


class _LoopThread:
    """One event loop on a daemon thread, started on first use."""

    def __init__(self):
        self._lock = threading.Lock()
        self.loop = None
        self._thread = None

    def _start(self):
        with self._lock:
            if self.loop is None:
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, name="sdk-async-loop", daemon=True)
                t.start()
                self._thread = t
                self.loop = loop
        return self.loop

    def run(self, coro):
        loop = self.loop or self._start()
        if threading.current_thread() is self._thread:
            raise RuntimeError("a facade call from inside the loop thread")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def close_soon(self, agen):
        """Closes an async generator: at once, or, when the garbage collector
        finalises its facade on the loop thread itself, as a task there."""
        if threading.current_thread() is self._thread:
            self.loop.create_task(agen.aclose())
        else:
            self.run(agen.aclose())


_LOOP = _LoopThread()
_ASYNC_TYPES = (dsec.AsyncClient, dsec.AsyncSandbox, dsec.AsyncBatch, dsec.AsyncTrajectory,
                dsec.AsyncProcess)


async def _invoke(fn, args, kwargs):
    r = fn(*args, **kwargs)
    if inspect.isawaitable(r):
        r = await r
    return r


def _wrap(v: Any) -> Any:
    if isinstance(v, _ASYNC_TYPES):
        return Facade(v)
    if inspect.isasyncgen(v):
        return _iterate(v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    return v


def _iterate(agen):
    """An async generator as a sync one (closing it closes the async one)."""
    try:
        while True:
            try:
                item = _LOOP.run(agen.__anext__())
            except StopAsyncIteration:
                return
            yield _wrap(item)
    finally:
        _LOOP.close_soon(agen)


class Facade:
    """A synchronous view of an async SDK object (AsyncClient, AsyncSandbox,
    AsyncBatch, AsyncTrajectory): methods run on the loop thread and return
    their awaited result, async results wrapped in turn; attributes read and
    write through."""

    __slots__ = ("_obj",)

    def __init__(self, obj):
        object.__setattr__(self, "_obj", obj)

    def __getattr__(self, name):
        obj = object.__getattribute__(self, "_obj")
        if name == "close" and isinstance(obj, dsec.AsyncClient):
            name = "aclose"
        v = getattr(obj, name)
        if callable(v) and not isinstance(v, type) and inspect.ismethod(v):
            def call(*args, **kwargs):
                return _wrap(_LOOP.run(_invoke(v, args, kwargs)))
            call.__name__ = name
            call.__doc__ = v.__doc__
            return call
        return _wrap(v)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_obj"), name, value)

    def __enter__(self):
        _LOOP.run(self._obj.__aenter__())
        return self

    def __exit__(self, *exc):
        return _LOOP.run(self._obj.__aexit__(*exc))

    def __repr__(self):
        return f"Facade({self._obj!r})"

    @property
    def unwrapped(self):
        """The async object itself."""
        return self._obj


class Flavor:
    def __init__(self, name: str):
        self.name = name
        self.is_async = name == "async"

    def __repr__(self):
        return self.name

    def Client(self, *args, **kwargs):
        if self.is_async:
            return Facade(dsec.AsyncClient(*args, **kwargs))
        return dsec.Client(*args, **kwargs)

    def from_data_dir(self, path, **kwargs):
        if self.is_async:
            return Facade(dsec.AsyncClient.from_data_dir(path, **kwargs))
        return dsec.Client.from_data_dir(path, **kwargs)

    def wrap_like(self, client: dsec.Client, **kwargs):
        """``client`` itself (sync), or an AsyncClient facade for its URL and token."""
        if not self.is_async:
            return client
        kwargs.setdefault("timeout", client.timeout)
        return self.Client(client.url, token=client.token, **kwargs)

    def run(self, coro):
        """Runs a coroutine on the async flavor's loop (for tests of async-only API)."""
        return _LOOP.run(coro)


SYNC = Flavor("sync")
ASYNC = Flavor("async")
FLAVORS = (SYNC, ASYNC)
