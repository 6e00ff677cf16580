"""The native layer: values at addresses, atomics, futexes and C calls from compiled code."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
from numba import carray, njit

from totalreduce.native import libc
from totalreduce.native.intrinsics import (
    atomic_add_i32,
    atomic_add_i64,
    atomic_cas_i64,
    atomic_load_i64,
    atomic_store_i32,
    atomic_xchg_i64,
    ccall_i32,
    ccall_i64,
    cpu_relax,
    fence,
    ld_f64,
    ld_i16,
    ld_i64,
    ld_u32,
    ptr_i64,
    st_f64,
    st_i16,
    st_i64,
    st_u32,
)


@njit(nogil=True, cache=True)
def _roundtrip(buf: np.ndarray) -> tuple[int, int, int, float]:
    base = buf.ctypes.data
    st_i64(base + 3, -0x1122334455667788)  # unaligned on purpose
    st_u32(base + 13, 0xFFFFFFFE)
    st_i16(base + 17, -2)
    st_f64(base + 19, 2.5)
    return ld_i64(base + 3), ld_u32(base + 13), ld_i16(base + 17), ld_f64(base + 19)


def test_values_at_any_byte_address() -> None:
    buf = np.zeros(32, dtype=np.uint8)
    assert _roundtrip(buf) == (-0x1122334455667788, 0xFFFFFFFE, -2, 2.5)
    assert buf[3:11].view(np.int64)[0] == -0x1122334455667788  # little-endian, as numpy


@njit(nogil=True, cache=True)
def _atomics(words: np.ndarray) -> tuple[int, int, int, int, int, int]:
    a = words.ctypes.data
    first = atomic_cas_i64(a, 0, 7)  # succeeds: held 0
    second = atomic_cas_i64(a, 0, 9)  # fails: holds 7
    before = atomic_add_i64(a, 5)
    old = atomic_xchg_i64(a + 8, 42)
    fence()
    view = carray(ptr_i64(a), 2)
    return first, second, before, atomic_load_i64(a), old, view[1]


def test_atomics() -> None:
    words = np.zeros(2, dtype=np.int64)
    assert _atomics(words) == (0, 7, 7, 12, 0, 42)


@njit(nogil=True, cache=True)
def _count_up(word: np.ndarray, times: int) -> None:
    a = word.ctypes.data
    for _ in range(times):
        atomic_add_i32(a, 1)
        cpu_relax()


def test_atomic_add_from_threads_loses_nothing() -> None:
    word = np.zeros(1, dtype=np.int32)
    threads = [threading.Thread(target=_count_up, args=(word, 100_000)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert word[0] == 400_000


@njit(nogil=True, cache=True)
def _wait(word: np.ndarray, expected: int, timeout_ns: int) -> int:
    t0 = libc.now_ns()
    libc.futex_wait(word.ctypes.data, expected, timeout_ns)
    return libc.now_ns() - t0


@njit(nogil=True, cache=True)
def _wake(word: np.ndarray) -> int:
    atomic_store_i32(word.ctypes.data, 1)
    return libc.futex_wake(word.ctypes.data, 8)


def test_futex_times_out_and_wakes() -> None:
    word = np.zeros(1, dtype=np.int32)
    slept = _wait(word, 0, 2_000_000)
    assert 1_500_000 <= slept < 1_000_000_000
    assert _wait(word, 1, 1_000_000_000) < 100_000_000  # the word differs: no sleep
    took: list[int] = []
    sleeper = threading.Thread(target=lambda: took.append(_wait(word, 0, 10_000_000_000)))
    sleeper.start()
    time.sleep(0.05)
    _wake(word)
    sleeper.join(timeout=5)
    assert took and took[0] < 5_000_000_000


@njit(nogil=True, cache=True)
def _call(memcpy: int, getpid: int, dst: np.ndarray, src: np.ndarray) -> tuple[int, int]:
    tmp = libc.malloc(src.size)
    libc.memcpy(tmp, src.ctypes.data, src.size)
    ccall_i64(memcpy, (dst.ctypes.data, tmp, np.int64(src.size)))
    libc.free(tmp)
    return ccall_i32(getpid, ()), libc.now_ns()


def test_c_calls_through_addresses() -> None:
    c = ctypes.CDLL(None)
    memcpy = ctypes.cast(c.memcpy, ctypes.c_void_p).value
    getpid = ctypes.cast(c.getpid, ctypes.c_void_p).value
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    pid, t = _call(memcpy, getpid, dst, src)
    assert np.array_equal(dst, src)
    assert pid == __import__("os").getpid()
    assert t > 0
