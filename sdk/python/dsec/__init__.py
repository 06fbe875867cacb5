"""dsec: Python SDK for the dsec sandbox platform (REST API v1).

    from dsec import Client
    c = Client.from_data_dir("/var/lib/dsec")     # or Client(url, token)
    with c.create("debian:latest", memory_mb=256) as sb:
        r = sb.exec(["python3", "-c", "print(6*7)"])
        assert r.ok and r.stdout == "42\\n"
        sb.write_file("/tmp/x", b"data")
        for ev in sb.exec_stream("for i in 1 2 3; do echo $i; sleep 1; done"):
            print(ev.type, ev.data)

The same on asyncio (every call a coroutine, ``exec_stream`` an async
generator, a bounded pool of kept-alive connections):

    from dsec import AsyncClient
    async with AsyncClient.from_data_dir("/var/lib/dsec") as c:
        async with await c.create("debian:latest") as sb:
            r = await sb.exec(["python3", "-c", "print(6*7)"])
"""

from ._core import DEFAULT_RETRY, ProcessEvent, Retry
from .aio import AsyncBatch, AsyncClient, AsyncProcess, AsyncSandbox, AsyncTrajectory
from .client import DEFAULT_URL, Batch, Client, Process, Sandbox, Trajectory
from .errors import (Conflict, DeadlineExceeded, DsecError, InternalError, InvalidArgument,
                     NotFound, PayloadTooLarge, PermissionDenied, QuotaExceeded, RateLimited,
                     ResourceExhausted, Unauthenticated, Unavailable, error_from_code,
                     error_from_response)
from .models import ExecEvent, ExecResult, Exposure, FileEntry, Image, Record

__version__ = "0.1.0"

__all__ = [
    "Client", "Sandbox", "Batch", "Trajectory",
    "AsyncClient", "AsyncSandbox", "AsyncBatch", "AsyncTrajectory", "Retry", "DEFAULT_RETRY",
    "Process", "AsyncProcess", "ProcessEvent",
    "ExecResult", "ExecEvent", "Exposure", "FileEntry", "Image", "Record",
    "DsecError", "InvalidArgument", "Unauthenticated", "PermissionDenied", "NotFound",
    "Conflict", "PayloadTooLarge", "ResourceExhausted", "Unavailable", "DeadlineExceeded",
    "InternalError", "QuotaExceeded", "RateLimited", "error_from_code", "error_from_response", "DEFAULT_URL",
]
