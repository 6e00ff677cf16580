"""The exception hierarchy: everything totalreduce raises derives from TotalReduceError."""

from __future__ import annotations


class TotalReduceError(RuntimeError):
    """Base of every error totalreduce raises."""


class NotInitializedError(TotalReduceError):
    """An API call before ``init()`` or after ``shutdown()``."""


class OpMismatchError(TotalReduceError):
    """Two ranks submitted the same name and generation with different arguments."""


class OpFailedError(TotalReduceError):
    """An op failed on this or another rank; the message says where and why."""


class OpTimeoutError(TotalReduceError, TimeoutError):
    """``wait(timeout=...)`` ran out before the op completed."""


class FrameError(TotalReduceError):
    """A malformed frame arrived (bad magic, version, codes or sizes)."""


class TransportError(TotalReduceError):
    """The transport failed (MPI error, unsupported thread level)."""


class InvalidArgumentError(TotalReduceError, ValueError):
    """A call's arguments are invalid; raised at the call, before anything is sent."""
