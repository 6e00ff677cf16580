"""The C library from compiled code: memory, the monotonic clock, futexes, yielding.

The functions are linked by name (``malloc``, ``clock_gettime``, ``syscall``...), which
the process always has, so compiled code that calls them caches on disk.  Futexes are
the one way compiled code sleeps and wakes: a thread waits on a 32-bit word while it
holds an expected value, and whoever changes the word wakes it.  They work between
processes on shared memory too (the wait is not ``FUTEX_PRIVATE``).
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

malloc = types.ExternalFunction("malloc", types.int64(types.int64))
calloc = types.ExternalFunction("calloc", types.int64(types.int64, types.int64))
realloc = types.ExternalFunction("realloc", types.int64(types.int64, types.int64))
free = types.ExternalFunction("free", types.void(types.int64))
memcpy = types.ExternalFunction("memcpy", types.int64(types.int64, types.int64, types.int64))
memmove = types.ExternalFunction("memmove", types.int64(types.int64, types.int64, types.int64))
memset = types.ExternalFunction("memset", types.int64(types.int64, types.int32, types.int64))
sched_yield = types.ExternalFunction("sched_yield", types.int32())

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(
    platform.machine().lower(), 202
)
FUTEX_WAIT = 0
FUTEX_WAKE = 1
CLOCK_MONOTONIC = 1

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_TIMESPEC = ir.LiteralStructType([_I64, _I64])


def _declare(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


@intrinsic
def now_ns(typingctx):
    """Nanoseconds of the monotonic clock (a vDSO call: no system call)."""

    def codegen(context, builder, signature, args):
        ts = cgutils.alloca_once(builder, _TIMESPEC)
        fn = _declare(builder, "clock_gettime", _I32, [_I32, _TIMESPEC.as_pointer()])
        builder.call(fn, [ir.Constant(_I32, CLOCK_MONOTONIC), ts])
        sec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 0))
        nsec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 1))
        return builder.add(builder.mul(sec, ir.Constant(_I64, 1_000_000_000)), nsec)

    return types.int64(), codegen


@intrinsic
def _futex(typingctx, addr, op, value, timeout_ns, count):
    """syscall(SYS_futex, addr, op, value, timeout or NULL, NULL, 0) -> result."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        addr_, op_, value_, timeout_, _count = args
        syscall = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I64, [_I64], var_arg=True), "syscall"
        )
        ts = cgutils.alloca_once(builder, _TIMESPEC)
        billion = ir.Constant(_I64, 1_000_000_000)
        builder.store(builder.sdiv(timeout_, billion), cgutils.gep_inbounds(builder, ts, 0, 0))
        builder.store(builder.srem(timeout_, billion), cgutils.gep_inbounds(builder, ts, 0, 1))
        has_timeout = builder.icmp_signed(">=", timeout_, ir.Constant(_I64, 0))
        ts_int = builder.select(has_timeout, builder.ptrtoint(ts, _I64), ir.Constant(_I64, 0))
        # A WAKE takes the number of threads to wake where a WAIT takes the value.
        return builder.call(
            syscall,
            [
                ir.Constant(_I64, _SYS_FUTEX),
                addr_,
                builder.trunc(op_, _I32),
                builder.trunc(value_, _I32),
                ts_int,
                ir.Constant(_I64, 0),
                ir.Constant(_I32, 0),
            ],
        )

    return sig, codegen


@njit(nogil=True, cache=True)
def futex_wait(addr: int, expected: int, timeout_ns: int) -> int:
    """Sleep while the 32-bit word at ``addr`` holds ``expected``, at most ``timeout_ns``
    (negative: no limit).  Returns at once if the word differs; may return early."""
    return _futex(addr, FUTEX_WAIT, expected, timeout_ns, 0)


@njit(nogil=True, cache=True)
def futex_wake(addr: int, count: int) -> int:
    """Wake up to ``count`` threads sleeping on the word at ``addr``."""
    return _futex(addr, FUTEX_WAKE, count, -1, 0)


@njit(nogil=True, cache=True)
def yield_cpu() -> None:
    """Let another runnable thread have this core (a real yield, unlike a zero sleep)."""
    sched_yield()
