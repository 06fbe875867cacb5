"""Typed errors raised by the dsec SDK.

Every failed API call raises a subclass of :class:`DsecError`, chosen by the
``error.code`` the server returned (or, when the body is not a dsec error, by
the HTTP status). Transport failures (connection refused, reset, client-side
socket timeout) raise :class:`Unavailable` / :class:`DeadlineExceeded` with
``status`` set to ``None``.
"""

from __future__ import annotations

import json
from typing import Optional


class DsecError(Exception):
    """Base class of every error the SDK raises.

    Attributes:
        code: the API error code, e.g. ``"not_found"``.
        message: the human-readable message from the server.
        status: the HTTP status, or ``None`` for transport errors.
        field: the request field at fault, when the server named one.
        body: the raw response body (bytes), when there was one.
    """

    default_code = "unknown"

    def __init__(self, code: Optional[str] = None, message: str = "",
                 status: Optional[int] = None, field: Optional[str] = None,
                 body: Optional[bytes] = None):
        self.code = code or self.default_code
        self.message = message
        self.status = status
        self.field = field
        self.body = body
        # `build_image`: the Dockerfile line at fault, when there is one.
        self.line: Optional[int] = None
        super().__init__(self.__str__())

    def __str__(self) -> str:
        s = self.code
        if self.status is not None:
            s = f"{self.status} {s}"
        if self.field:
            s += f" [field {self.field}]"
        if self.message:
            s += f": {self.message}"
        return s

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, "
                f"status={self.status!r}, field={self.field!r})")


class InvalidArgument(DsecError):
    default_code = "invalid_argument"


class Unauthenticated(DsecError):
    default_code = "unauthenticated"


class PermissionDenied(DsecError):
    default_code = "permission_denied"


class NotFound(DsecError):
    default_code = "not_found"


class Conflict(DsecError):
    """conflict, already_exists and failed_precondition (all HTTP 409)."""
    default_code = "conflict"


class PayloadTooLarge(DsecError):
    default_code = "payload_too_large"


class ResourceExhausted(DsecError):
    default_code = "resource_exhausted"


class QuotaExceeded(PermissionDenied):
    """A tenant's quota (``field``: max_sandboxes, max_cpu or max_memory_mb)
    would be exceeded; HTTP 403. Nothing was made."""
    default_code = "quota_exceeded"


class RateLimited(ResourceExhausted):
    """A tenant's rate quota (``field``: creates_per_s) is used up; HTTP 429.
    Retry later."""
    default_code = "rate_limited"


class Unavailable(DsecError):
    default_code = "unavailable"


class DeadlineExceeded(DsecError):
    default_code = "deadline_exceeded"


class InternalError(DsecError):
    default_code = "internal"


CODE_TO_CLASS = {
    "invalid_argument": InvalidArgument,
    "unauthenticated": Unauthenticated,
    "permission_denied": PermissionDenied,
    "not_found": NotFound,
    "already_exists": Conflict,
    "conflict": Conflict,
    "failed_precondition": Conflict,
    "aborted": Conflict,
    "payload_too_large": PayloadTooLarge,
    "resource_exhausted": ResourceExhausted,
    "quota_exceeded": QuotaExceeded,
    "rate_limited": RateLimited,
    "internal": InternalError,
    "unknown": InternalError,
    "unavailable": Unavailable,
    "deadline_exceeded": DeadlineExceeded,
}

STATUS_TO_CLASS = {
    400: InvalidArgument,
    401: Unauthenticated,
    403: PermissionDenied,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    429: ResourceExhausted,
    500: InternalError,
    503: Unavailable,
    504: DeadlineExceeded,
}

_STATUS_DEFAULT_CODE = {
    400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied",
    404: "not_found", 409: "conflict", 413: "payload_too_large",
    429: "resource_exhausted", 500: "internal", 503: "unavailable",
    504: "deadline_exceeded",
}


def error_from_code(code: Optional[str], message: str = "", status: Optional[int] = None,
                    field: Optional[str] = None, body: Optional[bytes] = None) -> DsecError:
    """Builds the typed error for an API error code (falling back to the status)."""
    cls = CODE_TO_CLASS.get(code or "")
    if cls is None and status is not None:
        cls = STATUS_TO_CLASS.get(status)
        if cls is None:
            cls = InvalidArgument if 400 <= status < 500 else InternalError
    if cls is None:
        cls = DsecError
    return cls(code or _STATUS_DEFAULT_CODE.get(status or 0), message, status, field, body)


def error_from_response(status: int, body: bytes, reason: str = "") -> DsecError:
    """Parses ``{"error": {"code", "message", "field"}}``; tolerates any body."""
    code = message = field = None
    try:
        doc = json.loads(body.decode("utf-8")) if body else None
    except (ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        err = doc["error"]
        code = err.get("code") if isinstance(err.get("code"), str) else None
        message = err.get("message") if isinstance(err.get("message"), str) else None
        field = err.get("field") if isinstance(err.get("field"), str) else None
    if message is None:
        text = body[:500].decode("utf-8", "replace").strip() if body else ""
        message = text or reason or f"HTTP {status}"
    return error_from_code(code, message, status, field, body)
