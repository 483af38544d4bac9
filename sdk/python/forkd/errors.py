"""Errors of the forkd SDK: one class per API error code.

Every error the daemon answers is ``{"error": {"code": ..., "message": ...}}``;
the code names one class below, all under :class:`ForkdError`, which carries
``.code``, ``.status`` (the HTTP status, 0 when no response came) and
``.message``.
"""

from __future__ import annotations

import builtins
from typing import Dict, Optional, Type

__all__ = [
    "ForkdError",
    "NotFoundError",
    "AlreadyExistsError",
    "InvalidArgumentError",
    "FailedPreconditionError",
    "ResourceExhaustedError",
    "UnavailableError",
    "UnimplementedError",
    "UnauthenticatedError",
    "DeadlineExceededError",
    "InternalError",
    "error_for",
]


class ForkdError(Exception):
    """An error of the forkd daemon or of this SDK talking to it."""

    code: str = "unknown"
    #: The HTTP status that goes with the code.
    default_status: int = 0

    def __init__(self, message: str, *, code: Optional[str] = None, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.status = self.default_status if status is None else status

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, status={self.status}, message={self.message!r})"


class NotFoundError(ForkdError):
    """``not_found`` (404): no such snapshot, sandbox, file, process..."""

    code = "not_found"
    default_status = 404


class AlreadyExistsError(ForkdError):
    """``already_exists`` (409)."""

    code = "already_exists"
    default_status = 409


class InvalidArgumentError(ForkdError):
    """``invalid_argument`` (400; 413 for a body over the limit, 415 for a
    body that is not JSON)."""

    code = "invalid_argument"
    default_status = 400


class FailedPreconditionError(ForkdError):
    """``failed_precondition`` (409): the state does not allow it (a snapshot
    in use, a sandbox still starting...)."""

    code = "failed_precondition"
    default_status = 409


class ResourceExhaustedError(ForkdError):
    """``resource_exhausted`` (429): a limit of the daemon (sandboxes, ports,
    bodies in flight). The SDK retries these a few times before raising."""

    code = "resource_exhausted"
    default_status = 429


class UnavailableError(ForkdError):
    """``unavailable`` (503), or no daemon could be reached."""

    code = "unavailable"
    default_status = 503


class UnimplementedError(ForkdError, builtins.NotImplementedError):
    """``not_implemented`` (501): e.g. eval in an image without Python.
    Also a :class:`NotImplementedError`."""

    code = "not_implemented"
    default_status = 501


class UnauthenticatedError(ForkdError):
    """``unauthenticated`` (401): a missing or wrong token."""

    code = "unauthenticated"
    default_status = 401


class DeadlineExceededError(ForkdError):
    """``deadline_exceeded`` (504; 408 for a body that came too slowly), or a
    call of this SDK that ran out of time."""

    code = "deadline_exceeded"
    default_status = 504


class InternalError(ForkdError):
    """``internal`` (500)."""

    code = "internal"
    default_status = 500


_BY_CODE: Dict[str, Type[ForkdError]] = {
    c.code: c
    for c in (
        NotFoundError,
        AlreadyExistsError,
        InvalidArgumentError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnavailableError,
        UnimplementedError,
        UnauthenticatedError,
        DeadlineExceededError,
        InternalError,
    )
}

# Statuses without a code (a proxy's answer, a body that is not JSON).
_BY_STATUS: Dict[int, Type[ForkdError]] = {
    400: InvalidArgumentError,
    401: UnauthenticatedError,
    403: UnauthenticatedError,
    404: NotFoundError,
    405: InvalidArgumentError,
    408: DeadlineExceededError,
    409: FailedPreconditionError,
    413: InvalidArgumentError,
    415: InvalidArgumentError,
    429: ResourceExhaustedError,
    500: InternalError,
    501: UnimplementedError,
    502: UnavailableError,
    503: UnavailableError,
    504: DeadlineExceededError,
}


def error_for(code: Optional[str], message: str, status: int = 0) -> ForkdError:
    """The error of class ``code`` (else of HTTP ``status``) with ``message``.
    An unknown code keeps its name in ``.code`` on a plain ForkdError."""
    cls = _BY_CODE.get(code or "")
    if cls is not None:
        return cls(message, status=status or cls.default_status)
    cls = _BY_STATUS.get(status)
    if cls is None:
        cls = InternalError if status >= 500 else ForkdError
    err = cls(message, status=status)
    if code:
        err.code = code
    return err
