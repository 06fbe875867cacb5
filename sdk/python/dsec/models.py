"""Plain result objects returned by the SDK.

Each keeps the server's raw dict (``.info`` / ``.raw``) and exposes its keys as
attributes and through ``obj["key"]`` so that fields the SDK does not know yet
remain reachable.
"""

from __future__ import annotations

import base64
from typing import Any, Dict, Optional


class Record:
    """A read-only view of one JSON object: ``r.key``, ``r["key"]``, ``r.get(key)``."""

    __slots__ = ("raw",)

    def __init__(self, raw: Dict[str, Any]):
        object.__setattr__(self, "raw", dict(raw or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self.raw[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.raw)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Record):
            return type(self) is type(other) and self.raw == other.raw
        if isinstance(other, dict):
            return self.raw == other
        return NotImplemented

    __hash__ = None  # mutable-looking; compare by value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.raw!r})"


class FileEntry(Record):
    """One entry of ``list_dir`` or the result of ``stat``: name, path (stat only),
    type ("file" | "dir" | "symlink" | "char" | "block" | "fifo" | "socket"), size, mode (int, permission bits),
    mtime, uid, gid."""

    __slots__ = ()

    @property
    def is_dir(self) -> bool:
        return self.raw.get("type") in ("dir", "directory")

    @property
    def is_file(self) -> bool:
        return self.raw.get("type") == "file"


class Exposure(Record):
    """An exposed port of a sandbox (``sandbox.expose``): port, gen, token
    (the URL token, ``dpt_...``), url (the host form, for browsers; it
    carries the token once, then a cookie does), path_url (the path form,
    for programs: send the token as ``Dsec-Port-Token`` or ``Authorization:
    Bearer``, or use your API key), created_at, expires_at (None: while the
    sandbox lives)."""

    __slots__ = ()

    @property
    def headers(self) -> Dict[str, str]:
        """The header that authorises a request to ``path_url``."""
        return {"Dsec-Port-Token": self.raw.get("token", "")}


class Image(Record):
    """An image: name, tag, ref ("name:tag"), kind, layers (bottom first), size,
    created_at, parent, and config."""

    __slots__ = ()

    @property
    def config(self) -> Dict[str, Any]:
        """``{"user": str, "env": ["K=V", ...], "working_dir": str,
        "entrypoint": [...], "cmd": [...], "labels": {...}}`` from the
        OCI/Docker image it was imported, pulled or built from (empty values
        when it had none). user, env and working_dir are the defaults of
        sandboxes created from it; entrypoint, cmd and labels are recorded."""
        return self.raw.get("config") or {"user": "", "env": [], "working_dir": ""}


def _decode(value: Optional[str], b64: Optional[str]) -> bytes:
    if b64 is not None:
        return base64.b64decode(b64)
    if value is None:
        return b""
    return value.encode("utf-8")


class ExecResult:
    """The outcome of one exec.

    ``stdout`` / ``stderr`` are always ``str`` (with encoding="base64" they are the
    bytes decoded as UTF-8 with replacement); ``stdout_bytes`` / ``stderr_bytes``
    are the exact bytes when the exec asked for base64, else the UTF-8 text encoded.
    ``duration`` is in seconds, ``duration_ms`` in milliseconds. ``limit`` names
    the limit that stopped a fncall call (``"timeout"``, ``"cpu"``, ``"memory"``,
    ``"file_size"``, ``"output"``), else None.
    """

    __slots__ = ("exit_code", "signal", "stdout_bytes", "stderr_bytes", "truncated",
                 "timed_out", "oom_killed", "duration_ms", "replayed", "limit", "raw")

    def __init__(self, raw: Dict[str, Any], stdout: bytes = b"", stderr: bytes = b""):
        self.raw = dict(raw)
        self.exit_code = raw.get("exit_code")
        self.signal = raw.get("signal") or 0
        self.truncated = bool(raw.get("truncated", False))
        self.timed_out = bool(raw.get("timed_out", False))
        self.oom_killed = bool(raw.get("oom_killed", False))
        dm = raw.get("duration_ms")
        self.duration_ms = float(dm) if dm is not None else 0.0
        # A trajectory step answered from the log, without running anything.
        self.replayed = bool(raw.get("replayed", False))
        # fncall calls (Client.run, Sandbox.run, exec in a fncall sandbox): the
        # limit that stopped the call ("timeout", "cpu", "memory", "file_size",
        # "output"), else None.
        self.limit = raw.get("limit")
        self.stdout_bytes = stdout
        self.stderr_bytes = stderr

    @classmethod
    def from_json(cls, raw: Dict[str, Any], base64_output: bool = False) -> "ExecResult":
        """Builds the result of an exec; with ``base64_output`` (the exec asked for
        ``encoding="base64"``) ``stdout`` / ``stderr`` hold base64 text."""
        if base64_output:
            out = _decode(None, raw.get("stdout_b64", raw.get("stdout")) or "")
            err = _decode(None, raw.get("stderr_b64", raw.get("stderr")) or "")
        else:
            out = _decode(raw.get("stdout"), raw.get("stdout_b64"))
            err = _decode(raw.get("stderr"), raw.get("stderr_b64"))
        return cls(raw, out, err)

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def duration(self) -> float:
        return self.duration_ms / 1000.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def __repr__(self) -> str:
        return (f"ExecResult(exit_code={self.exit_code!r}, signal={self.signal!r}, "
                f"stdout={_short(self.stdout)!r}, stderr={_short(self.stderr)!r}, "
                f"truncated={self.truncated}, timed_out={self.timed_out}, "
                f"oom_killed={self.oom_killed}, duration_ms={self.duration_ms:.1f})")


def _short(s: str, n: int = 200) -> str:
    return s if len(s) <= n else s[:n] + f"...(+{len(s) - n})"


class ExecEvent(Record):
    """One NDJSON event of a streamed exec.

    ``type`` is "stdout", "stderr", "exit" or "error". For output events
    ``data`` is the text (decoded from ``data_b64`` when the exec asked for base64)
    and ``data_bytes`` the exact bytes. For "exit", ``result`` is an
    :class:`ExecResult` (without output) and the exit fields are attributes too.
    For "error", ``error`` is the :class:`~dsec.errors.DsecError`.
    """

    __slots__ = ()

    @property
    def type(self) -> str:
        return self.raw.get("type", "")

    @property
    def data_bytes(self) -> bytes:
        return _decode(self.raw.get("data"), self.raw.get("data_b64"))

    @property
    def data(self) -> Optional[str]:
        if "data" in self.raw:
            return self.raw["data"]
        if "data_b64" in self.raw:
            return self.data_bytes.decode("utf-8", "replace")
        return None

    @property
    def result(self) -> Optional[ExecResult]:
        if self.type != "exit":
            return None
        return ExecResult.from_json(self.raw)

    @property
    def error(self):
        if self.type != "error":
            return None
        from .errors import error_from_code
        err = self.raw.get("error") or {}
        if not isinstance(err, dict):
            err = {"message": str(err)}
        return error_from_code(err.get("code") or "internal", err.get("message") or "",
                               None, err.get("field"))

    def __getitem__(self, key: str) -> Any:
        if key == "data" and "data" not in self.raw and "data_b64" in self.raw:
            return self.data
        return self.raw[key]
