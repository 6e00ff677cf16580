"""The lane's pool of large buffers (``lane/lane_pool.py``): as many of a size as were in
use at once come back from it, within its byte bound."""

from __future__ import annotations

from totalreduce.lane.lane_pool import BufferPool


def test_a_burst_of_one_size_comes_back_whole_from_the_pool() -> None:
    pool = BufferPool(max_bytes=1 << 30, min_per_size=4)
    first = [pool.take(4096) for _ in range(60)]
    assert pool.in_use(4096) == 60 and pool.peak(4096) == 60
    assert all(b.size == 4096 and b.dtype.name == "uint8" for b in first)
    for b in first:
        pool.give(b)
    assert pool.in_use(4096) == 0 and pool.pooled_bytes == 60 * 4096
    again = [pool.take(4096) for _ in range(60)]
    assert {id(b) for b in again} == {id(b) for b in first}  # no fresh pages
    assert pool.pooled_bytes == 0
    fresh = pool.take(4096)  # the 61st is new
    assert all(fresh is not b for b in first)


def test_at_least_min_per_size_kept_and_never_more_than_max_bytes() -> None:
    pool = BufferPool(max_bytes=3 * 1000, min_per_size=2)
    a = pool.take(1000)
    pool.give(a)
    assert pool.take(1000) is a  # one in use at most, but up to two are kept
    many = [pool.take(1000) for _ in range(5)]
    for b in many:
        pool.give(b)
    assert pool.pooled_bytes == 3 * 1000  # the byte bound, not the peak of 6 (one is out)
    assert pool.in_use(1000) == 1


def test_a_size_nothing_is_kept_of_is_forgotten() -> None:
    pool = BufferPool(max_bytes=100, min_per_size=4)
    big = pool.take(1000)  # larger than the pool: never kept
    pool.give(big)
    assert pool.peak(1000) == 0 and pool.in_use(1000) == 0 and 1000 not in pool.free
    small = [pool.take(10) for _ in range(3)]
    for b in small:
        pool.give(b)
    assert pool.peak(10) == 3  # remembered while buffers of the size are kept
