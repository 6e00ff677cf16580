"""Daemon mode's shared memory: sealed regions checked on attach, and eventfd sleeps."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import numpy as np
import pytest

from totalreduce.errors import TotalReduceError
from totalreduce.transport.shm import (
    SharedRegion,
    drain_eventfd,
    fence,
    new_eventfd,
    signal_eventfd,
    sleep_on,
)

SIZE = 1 << 16


def test_a_region_is_sealed_and_shared() -> None:
    region = SharedRegion.create(SIZE, "test")
    assert region.fd is not None
    seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    other = SharedRegion.attach(os.dup(region.fd), SIZE)
    region.array(64, 4, np.int64)[:] = [1, 2, 3, 4]
    fence()
    assert list(other.array(64, 4, np.int64)) == [1, 2, 3, 4]
    with pytest.raises(OSError):  # sealed: the other side cannot take the memory away
        os.ftruncate(region.fd, SIZE // 2)
    region.close_fd()


def test_attach_refuses_unsealed_files_wrong_sizes_and_other_descriptors() -> None:
    fd = os.memfd_create("plain", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    with pytest.raises(TotalReduceError, match="not sealed"):
        SharedRegion.attach(fd, SIZE)
    region = SharedRegion.create(SIZE, "sized")
    assert region.fd is not None
    with pytest.raises(TotalReduceError, match=f"has {SIZE} bytes, not {SIZE + 4096}"):
        SharedRegion.attach(os.dup(region.fd), SIZE + 4096)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(TotalReduceError, match="not a memory file"):
        SharedRegion.attach(r, SIZE)
    region.close_fd()


def test_a_sleeper_wakes_when_its_eventfd_is_written_and_not_before() -> None:
    efd = new_eventfd()
    try:
        t0 = time.monotonic()
        sleep_on(efd, 0.05)  # nothing written: the whole timeout
        assert time.monotonic() - t0 >= 0.04
        threading.Timer(0.05, signal_eventfd, (efd,)).start()
        t0 = time.monotonic()
        sleep_on(efd, 10.0)
        assert time.monotonic() - t0 < 5.0
        signal_eventfd(efd)
        drain_eventfd(efd)  # drained: the next sleep waits again
        t0 = time.monotonic()
        sleep_on(efd, 0.05)
        assert time.monotonic() - t0 >= 0.04
    finally:
        os.close(efd)
