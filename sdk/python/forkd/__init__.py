"""forkd: Python SDK of forkd, microVM sandboxes for AI agents.

Two levels:

- :class:`Controller`: every operation of the daemon's REST API v1 (``forkd
  serve``), typed (dataclasses in :mod:`forkd.types`).
- :class:`Sandbox` (and :class:`AsyncSandbox`): E2B-shaped sandboxes
  (``commands``, ``files``, ``run_code``) with forkd's ``branch`` and
  ``fork``.

Errors are :class:`ForkdError` subclasses, one per API error code.
Standard library only.
"""

from .aio import AsyncCommandHandle, AsyncSandbox
from .controller import Controller
from .errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    ForkdError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from .sandbox import (
    CommandExitException,
    CommandHandle,
    CommandResult,
    CommandTimeoutError,
    EntryInfo,
    Execution,
    ExecutionError,
    FileType,
    Logs,
    ProcessInfo,
    Result,
    Sandbox,
    SandboxInfo,
    WriteInfo,
)
from .types import Limits, NetworkRule, NetworkSpec, OCISource

__version__ = "0.1.0"

#: E2B's names for the same errors.
SandboxException = ForkdError
NotFoundException = NotFoundError
TimeoutException = DeadlineExceededError
InvalidArgumentException = InvalidArgumentError
AuthenticationException = UnauthenticatedError
RateLimitException = ResourceExhaustedError

__all__ = [
    "Controller",
    "Sandbox",
    "AsyncSandbox",
    "AsyncCommandHandle",
    "SandboxInfo",
    "CommandResult",
    "CommandHandle",
    "CommandExitException",
    "CommandTimeoutError",
    "ProcessInfo",
    "EntryInfo",
    "WriteInfo",
    "FileType",
    "Execution",
    "Result",
    "Logs",
    "ExecutionError",
    "Limits",
    "NetworkRule",
    "NetworkSpec",
    "OCISource",
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
    "SandboxException",
    "NotFoundException",
    "TimeoutException",
    "InvalidArgumentException",
    "AuthenticationException",
    "RateLimitException",
]
