"""The service's logic without MPI: P nodes' services as threads, clients as threads.

Covers the three local phases, the mapping of ranks and broadcast roots, the
client's data paths (registered, staged, in place, new result), generations
and jobs, the faults a client can cause, and what a client is refused.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from daemon_cluster import local_cluster, run_clients

import totalreduce as tr
from totalreduce.daemon import protocol, shm
from totalreduce.daemon.client import DaemonClient

NODES = 2


def values(rank: int, count: int, dtype: str, k: int = 0) -> np.ndarray:
    return ((np.arange(count) * 3 + rank * 5 + k) % 40).astype(dtype)


@pytest.mark.parametrize("local_clients", [1, 2, 3])
def test_every_op_and_data_path(tmp_path: Path, local_clients: int) -> None:
    size = NODES * local_clients

    def body(c: DaemonClient) -> str:
        assert (c.rank, c.size) == (c.node * local_clients + c.local_rank, size)
        checks = 0
        for k, (count, dtype, op) in enumerate(
            [
                (0, "float32", "sum"),
                (1, "int64", "avg"),
                (1000, "float64", "max"),
                (3000, "int32", "min"),
                (70_000, "float32", "avg"),
                (5, "float16", "sum"),
            ]
        ):
            stack = np.stack([values(r, count, dtype, k) for r in range(size)]).astype(float)
            want = {
                "sum": stack.sum(0),
                "avg": stack.sum(0) / size
                if dtype.startswith("float")
                else np.floor(stack.sum(0) / size),
                "max": stack.max(0),
                "min": stack.min(0),
            }[op].astype(dtype)
            x = values(c.rank, count, dtype, k)
            # staged input, new result
            assert np.array_equal(c.allreduce(x, name=f"a{k}", op=op), want)
            # staged, in place
            y = x.copy()
            assert c.allreduce(y, name=f"a{k}", op=op, out=y) is not None
            assert np.array_equal(y, want)
            # registered, in place: zero copy
            g = c.empty(count, dtype)
            g[:] = x
            h = c.allreduce_async(g, name=f"a{k}", op=op, out=g)
            res = h.wait(30)
            assert np.array_equal(g, want) and (count == 0 or np.shares_memory(res, g))
            # registered input, plain output array
            o = np.empty(count, dtype)
            g[:] = x
            c.allreduce(g, name=f"a{k}", op=op, out=o)
            assert np.array_equal(o, want)
            checks += 4
        for root in range(size):
            x = np.full((2, 3), c.rank * 100 + root, np.int64)
            assert np.array_equal(c.broadcast(x, root=root), np.full((2, 3), root * 101))
        c.barrier()
        return f"{checks} ok"

    with local_cluster(NODES, local_clients, tmp_path / "s") as cluster:
        assert run_clients(cluster, body, local_clients) == ["24 ok"] * size


def test_random_orders_and_priorities(tmp_path: Path) -> None:
    import random

    def body(c: DaemonClient) -> int:
        rng = random.Random(c.rank)
        order = list(range(30))
        rng.shuffle(order)
        hs = {}
        for k in order:
            hs[k] = c.allreduce_async(
                values(c.rank, 100 + k, "int64", k), name=f"r{k}", priority=rng.randrange(4)
            )
        bad = 0
        for k, h in hs.items():
            want = sum(values(r, 100 + k, "int64", k) for r in range(c.size))
            bad += not np.array_equal(h.wait(30), want)
        return bad

    with local_cluster(NODES, 2, tmp_path / "s") as cluster:
        assert run_clients(cluster, body, 2) == [0, 0, 0, 0]


def test_local_mismatch_fails_everywhere_and_the_name_still_works(tmp_path: Path) -> None:
    def body(c: DaemonClient) -> str:
        count = 13 if c.rank == 1 else 12
        with pytest.raises(tr.OpMismatchError) as info:
            c.allreduce(np.ones(count, np.float32), name="layer")
        assert "'layer' generation 0" in str(info.value)
        # generation 1 of the same name meets generation 1 everywhere
        got = c.allreduce(np.full(4, c.rank, np.int64), name="layer")
        assert np.array_equal(got, np.full(4, 6))
        return str(info.value)

    with local_cluster(NODES, 2, tmp_path / "s") as cluster:
        texts = run_clients(cluster, body, 2)
    assert "12 float32" in texts[0] and "13 float32" in texts[0], texts[0]


def test_clean_leave_fails_later_ops_then_a_new_job_starts_at_generation_zero(
    tmp_path: Path,
) -> None:
    with local_cluster(NODES, 2, tmp_path / "s", abort_timeout=1.0) as cluster:
        first = threading.Barrier(4)

        def body(c: DaemonClient) -> str:
            c.allreduce(np.ones(3), name="w")
            c.allreduce(np.ones(3), name="w")
            first.wait(10)
            if c.rank == 0:
                return "left"  # shut down cleanly by run_clients
            time.sleep(0.2)
            t0 = time.monotonic()
            with pytest.raises(tr.OpFailedError) as info:
                c.allreduce(np.ones(3), name="w", out=None)
            assert time.monotonic() - t0 < 5
            return str(info.value)

        out = run_clients(cluster, body, 2)
        assert out[0] == "left"
        assert all("left the job" in t or "ended" in t for t in out[1:]), out
        # a new job: generations start again at 0 on every node
        gens = run_clients(cluster, lambda c: c.allreduce_async(np.ones(2), name="w").generation, 2)
        assert gens == [0, 0, 0, 0]


def test_client_dying_mid_op_fails_others_and_the_service_goes_on(tmp_path: Path) -> None:
    with local_cluster(NODES, 1, tmp_path / "s", abort_timeout=1.0) as cluster:
        victim = DaemonClient(cluster.socket(0))
        other = DaemonClient(cluster.socket(1))
        h0 = other.allreduce_async(np.ones(2), name="a")
        victim.allreduce(np.ones(2), name="a")  # generation 0 done on node 0
        h0.wait(10)
        h = other.allreduce_async(np.ones(5), name="late")  # node 0 never submits it
        victim._sock.close()  # dies: no goodbye
        t0 = time.monotonic()
        with pytest.raises(tr.OpFailedError) as info:
            h.wait(10)
        assert time.monotonic() - t0 < 5
        assert f"client {victim.client_id}" in str(info.value) and "'late'" in str(info.value)
        other.shutdown()
        got = run_clients(cluster, lambda c: c.allreduce(np.full(2, c.rank + 1.0), name="a"), 1)
        assert [list(g) for g in got] == [[3.0, 3.0]] * 2


def test_refused_attachments(tmp_path: Path) -> None:
    with local_cluster(1, 2, tmp_path / "s") as cluster:
        with pytest.raises(tr.TotalReduceError, match="outside 0..1"):
            DaemonClient(cluster.socket(0), local_rank=2)
        a = DaemonClient(cluster.socket(0), local_rank=1)
        with pytest.raises(tr.TotalReduceError, match="taken"):
            DaemonClient(cluster.socket(0), local_rank=1)
        b = DaemonClient(cluster.socket(0))
        assert b.local_rank == 0
        with pytest.raises(tr.TotalReduceError, match="all 2 local ranks"):
            DaemonClient(cluster.socket(0))
        a.shutdown()
        b.shutdown()
    with pytest.raises(tr.TotalReduceError, match="no totalreduce service"):
        DaemonClient(tmp_path / "nothing.sock")


def test_bad_arguments_raise_at_the_call(tmp_path: Path) -> None:
    with local_cluster(1, 1, tmp_path / "s") as cluster:
        c = DaemonClient(cluster.socket(0))
        x = np.ones(10, np.float32)
        with pytest.raises(tr.InvalidArgumentError, match="C-contiguous"):
            c.allreduce_async(np.ones((4, 4))[:, 1])
        with pytest.raises(tr.InvalidArgumentError):
            c.allreduce_async(x, op="median")
        with pytest.raises(tr.InvalidArgumentError, match="root"):
            c.broadcast_async(x, root=1)
        with pytest.raises(tr.InvalidArgumentError, match="out has"):
            c.allreduce_async(x, out=np.ones(9, np.float32))
        with pytest.raises(tr.InvalidArgumentError, match="overlaps"):
            c.allreduce_async(x[:8], out=x[2:])
        with pytest.raises(tr.InvalidArgumentError, match="daemon mode"):
            c.allreduce_async(x, group=[0])
        with pytest.raises(tr.InvalidArgumentError, match="unknown allreduce algorithm"):
            c.allreduce_async(x, algorithm="nope")
        with pytest.raises(tr.InvalidArgumentError):
            c.allreduce_async(np.ones(3, np.uint8))
        # nothing was sent: the next op of the name is generation 0
        assert c.allreduce_async(x, name="n").generation == 0
        bf = np.array([0x3F80, 0x4000], np.uint16)  # bfloat16 1.0, 2.0
        assert np.array_equal(c.allreduce(bf, name="bf", dtype="bfloat16"), bf)
        c.shutdown()
        with pytest.raises(tr.NotInitializedError):
            c.allreduce_async(x)


def test_module_level_api_in_daemon_mode(tmp_path: Path) -> None:
    with local_cluster(1, 1, tmp_path / "s") as cluster:
        svc = tr.init(service="daemon", socket=cluster.socket(0))
        try:
            assert tr.default_service() is svc and tr.init() is svc
            assert (tr.rank(), tr.size()) == (0, 1)
            h = tr.allreduce_async(np.arange(4.0), name="m", op="avg")
            assert tr.poll(h) in (True, False)
            assert list(tr.synchronize(h, 10)) == [0.0, 1.0, 2.0, 3.0]
            assert list(tr.broadcast(np.arange(3), root=0)) == [0, 1, 2]
            tr.barrier()
        finally:
            tr.shutdown()
        assert svc.closed and not tr.is_initialized()


def test_done_callbacks_run_without_polling(tmp_path: Path) -> None:
    with local_cluster(1, 1, tmp_path / "s") as cluster:
        c = DaemonClient(cluster.socket(0))
        seen = threading.Event()
        h = c.allreduce_async(np.ones(3), name="cb")
        h.add_done_callback(lambda _h: seen.set())
        assert seen.wait(10)
        c.shutdown()


def test_service_gone_fails_waiters(tmp_path: Path) -> None:
    cluster_cm = local_cluster(NODES, 1, tmp_path / "s", drain_timeout=0.5)
    cluster = cluster_cm.__enter__()
    c = DaemonClient(cluster.socket(0))
    h = c.allreduce_async(np.ones(3), name="never")  # node 1 has no client
    cluster_cm.__exit__(None, None, None)
    with pytest.raises(tr.TotalReduceError):
        h.wait(10)
    with pytest.raises(tr.TotalReduceError):
        c.allreduce_async(np.ones(3))
    c.shutdown(timeout=1)


def _raw(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def _reply(s: socket.socket) -> dict | None:
    reader = protocol.MessageReader()
    try:
        return protocol.read_message(s, reader)
    except ConnectionError:
        return None


def test_garbage_gets_an_error_reply_and_the_service_goes_on(tmp_path: Path) -> None:
    with local_cluster(1, 1, tmp_path / "s") as cluster:
        path = cluster.socket(0)
        for junk in [
            b"\xff\xff\xff\x7fgarbage",
            b"\x00\x00\x00\x00",
            b"\x05\x00\x00\x00hello",
            b"\x02\x00\x00\x00[]",
            protocol.encode({"t": "op", "slot": 0}),
            protocol.encode({"t": "hello", "v": 99, "pid": 1, "slots": 4}),
            protocol.encode({"t": "hello", "v": 1, "pid": 1, "slots": 4}),  # no descriptor
        ]:
            s = _raw(path)
            s.sendall(junk)
            reply = _reply(s)
            assert reply is not None and reply["t"] == "error" and reply["fatal"], (junk, reply)
            s.close()
        # an attached client sending a bad op gets an error in the op's slot and an error
        # reply, and stays attached; the op's generation is used up on every node
        c = DaemonClient(path)
        slot = c._control.slots - 1
        c._control.arm(slot, 10**9)
        with c._send_lock:
            protocol.send(
                c._sock,
                {
                    "t": "op",
                    "slot": slot,
                    "seq": 10**9,
                    "kind": "allreduce",
                    "name": "z",
                    "gen": 0,
                    "dtype": "float32",
                    "count": 4,
                    "op": "sum",
                    "prio": 0,
                    "in": [999, 0],
                    "out": [999, 0],
                },
            )
            protocol.send(c._sock, {"t": "frobnicate"})
        assert np.array_equal(c.allreduce(np.ones(2), name="y"), np.ones(2))
        assert c._control.state(slot) == shm.FAILED
        assert "region 999" in c._control.error(slot)[1]
        c._names["z"] = 1  # the raw op above was generation 0
        assert np.array_equal(c.allreduce(np.ones(4, np.float32), name="z"), np.ones(4))
        c.shutdown()


def test_unsealed_memory_is_refused(tmp_path: Path) -> None:
    with local_cluster(1, 1, tmp_path / "s") as cluster:
        c = DaemonClient(cluster.socket(0))
        fd = os.memfd_create("unsealed")
        os.ftruncate(fd, 4096)
        with c._send_lock:
            protocol.send(c._sock, {"t": "register", "region": 77, "size": 4096}, (fd,))
        os.close(fd)
        with pytest.raises(tr.TotalReduceError, match="not sealed"):
            with c._send_lock:
                c._reply("registered", 77)
        c.shutdown()


def test_control_block_and_free_list() -> None:
    block = shm.ControlBlock.create(4)
    block.arm(2, 7)
    assert block.state(2) == shm.PENDING
    assert not block.complete(2, 6)  # a stale sequence number never lands
    assert block.fail(2, 7, shm.ERROR_MISMATCH, "é" * 2000)
    kind, text = block.error(2)
    assert kind == shm.ERROR_MISMATCH and 500 <= len(text) <= 1024
    free = shm.FreeList(1 << 12)
    blocks = [free.alloc(100) for _ in range(10)]
    assert all(b is not None for b in blocks)
    for b in blocks[::2] + blocks[1::2]:
        free.free(b, 100)
    assert free.empty and free.alloc(1 << 12) == 0


def test_message_limits() -> None:
    reader = protocol.MessageReader()
    reader.feed(b"\x00\x00\x01\x00", [])  # 65536: allowed
    assert reader.next() is None
    reader = protocol.MessageReader()
    reader.feed(b"\x01\x00\x01\x00", [])  # 65537: refused before reading it
    with pytest.raises(protocol.ProtocolError) as info:
        reader.next()
    assert info.value.fatal
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(b'{"t": NaN}')
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(b"[" * 100_000)
    f = protocol.Fields({"t": "op", "count": -1, "name": True}, frozenset({"count", "name"}))
    with pytest.raises(protocol.ProtocolError, match="'count'"):
        f.int("count")
    with pytest.raises(protocol.ProtocolError, match="'name'"):
        f.name()
