"""The codes an ERROR frame carries, and the error each becomes on the rank that hears it."""

from __future__ import annotations

from ..errors import (
    FrameError,
    OpFailedError,
    OpMismatchError,
    OpTimeoutError,
    TotalReduceError,
)
from ..protocol import ErrorCode

ERROR_MISMATCH = int(ErrorCode.MISMATCH)
ERROR_FAILED = int(ErrorCode.FAILED)
ERROR_FRAME = int(ErrorCode.FRAME)
ERROR_TIMEOUT = int(ErrorCode.TIMEOUT)


def _error_from_peer(message: str, code: int) -> TotalReduceError:
    if code == ERROR_MISMATCH:
        return OpMismatchError(message)
    if code == ERROR_FRAME:
        return FrameError(message)
    if code == ERROR_TIMEOUT:
        return OpTimeoutError(message)
    return OpFailedError(message)
