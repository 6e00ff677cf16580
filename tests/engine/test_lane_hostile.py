"""The compiled lane against a hostile or hurried peer, through the transport.

Rank 1 of a local world is a rogue: it writes the lane's messages itself and sends them
on the lane's tag through the world's compiled message layer (what ``MPI_Isend`` is to the
lane under MPI).  Rank 0 runs a service with the lane; rank 2, where there is one, is an
honest service.  Whatever the rogue sends, rank 0 holds at most the lane's share of
``floating_pool_bytes`` for ops it has not submitted (counted by the lane, and seen in the
process's resident memory), refuses what breaks the protocol with a ``FrameError`` naming
the rogue, fails every op with it, and goes on with everyone else.  A hurried peer (an
honest service far ahead) stays within the same bound, and every op still completes.
"""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

import totalreduce as tr
from conftest import local_services, run_ranks
from totalreduce import protocol as L
from totalreduce.engine.wire import wire_id
from totalreduce.service.config import Config
from totalreduce.service.service import Service
from totalreduce.transport import mpi_native
from totalreduce.transport.local import LocalWorld

_MSG = struct.Struct(L.MSG_FORMAT)
_FRAME = struct.Struct(L.FRAME_FORMAT)
MIB = 1 << 20
_U64 = (1 << 64) - 1  # a field written as the bits of a (maybe negative) int64


def frame(ftype: int, name: str, nbytes: int = 0, *, credited: bool = False, gen: int = 0,
          aux: int = 0, body: bytes | None = None) -> bytes:  # fmt: skip
    """One lane frame of an allreduce of float64 (its body padded to 8 bytes)."""
    flags = L.FLAG_CREDIT if credited else 0
    head = _FRAME.pack(ftype, 11, 0, 1, 0, flags, 0, aux, 0, 0, 0, wire_id(name), gen,
                       nbytes & _U64, max(1, nbytes // 8), 0, 0)  # fmt: skip
    if body is None:
        body = b"\x00" * (nbytes if ftype == L.DATA and nbytes > 0 else 0)
    return head + body + b"\x00" * (-len(body) % 8)


def message(frames: list[bytes], *, credit: int = 0, sender: int = 1, count: int | None = None,
            magic: int = L.LANE_MAGIC, version: int = L.LANE_VERSION) -> bytes:  # fmt: skip
    n = len(frames) if count is None else count
    return _MSG.pack(magic, version, 0, n, sender, 0, credit & _U64) + b"".join(frames)


class Rogue:
    """Rank 1's raw sends on the lane's tag, one message at a time (each waits until rank
    0 took it, so the rogue's own memory stays a few buffers)."""

    def __init__(self, world: LocalWorld, rank: int = 1) -> None:
        self.b = world.native().binding(rank)
        self.req = mpi_native.request_array(self.b, 1)
        self.sent = 0

    def send(self, raw: bytes, timeout: float = 10.0) -> None:
        buf = np.frombuffer(raw, dtype=np.uint8).copy()
        rc = mpi_native.mpi_isend(self.b, buf.ctypes.data, buf.nbytes, 0, L.LANE_TAG,
                                  self.req.ctypes.data)  # fmt: skip
        assert rc == 0, rc
        deadline = time.monotonic() + timeout
        while mpi_native.mpi_test(self.b, self.req.ctypes.data, 0) == 0:
            assert time.monotonic() < deadline, "rank 0 did not take the rogue's message"
            time.sleep(0.0002)
        self.sent += 1


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def lane_of(svc: Service):  # type: ignore[no-untyped-def]
    lane = svc.loop.lane
    assert lane is not None, "the lane is off"
    return lane


def settle(svc: Service, received: int, timeout: float = 10.0) -> None:
    """Wait until rank 0's lane has taken ``received`` messages in all."""
    deadline = time.monotonic() + timeout
    while lane_of(svc).stats()["messages_received"] < received:
        assert time.monotonic() < deadline, lane_of(svc).stats()
        time.sleep(0.002)
    time.sleep(0.02)  # and handed its events to Python


def refused(svc: Service, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while 1 not in svc.loop.peers.bad and time.monotonic() < deadline:
        time.sleep(0.005)
    return 1 in svc.loop.peers.bad


POOL = 8 * MIB


@pytest.fixture
def rogue_world():  # type: ignore[no-untyped-def]
    """Rank 0 and rank 2 run services (the lane on), rank 1 is the rogue."""
    world = LocalWorld(3)
    cfg = Config.load(env={}, floating_pool_bytes=POOL)
    svc0 = Service(world.transport(0), cfg)
    svc2 = Service(world.transport(2), cfg)
    assert svc0.loop.lane is not None and svc2.loop.lane is not None  # both engines, now
    try:
        yield world, svc0, svc2, Rogue(world)
    finally:
        svc0.shutdown(timeout=0.3)
        svc2.shutdown(timeout=0.3)


def still_works(svc0: Service, svc2: Service) -> None:
    """Rank 0 goes on with rank 2 after the rogue; ops with the rogue fail naming it."""
    h = svc0.allreduce_async(np.ones(4), name="with the rogue")
    with pytest.raises(tr.FrameError, match="from rank 1"):
        h.wait(timeout=5)
    pair = tr.Group([0, 2])
    hs = [s.allreduce_async(np.arange(5.0) + s.rank, group=pair, name="pair") for s in (svc0, svc2)]
    for h in hs:
        np.testing.assert_array_equal(h.wait(timeout=10), 2 * np.arange(5.0) + 2)
    assert svc0.loop.fatal is None


def test_credited_frames_beyond_the_credit_are_refused_and_what_floated_is_freed(
    rogue_world,
) -> None:
    world, svc0, svc2, rogue = rogue_world
    lane = lane_of(svc0)
    credit = lane.stats()["credit"]
    slot = int(lane.mem[L.C_SLOT])
    assert credit > 0
    body = 64 << 10
    for k in range(credit):
        rogue.send(message([frame(L.DATA, f"early.{k}", body, credited=True)]))
    settle(svc0, credit)
    assert 1 not in svc0.loop.peers.bad  # within the credit: kept
    assert lane.floating_bytes == credit * slot <= lane.pool_bytes
    rss0 = rss_bytes()
    for k in range(credit, credit + 2000):  # an honest peer would announce these instead
        rogue.send(message([frame(L.DATA, f"early.{k}", body, credited=True)]))
    assert refused(svc0)
    assert "beyond the credit" in str(svc0.loop.peers.bad[1])
    assert lane.floating_bytes == 0  # what it left here is freed
    assert lane.floating_peak_bytes <= lane.pool_bytes
    assert rss_bytes() - rss0 < 8 * MIB, "frames beyond the credit were kept"
    still_works(svc0, svc2)


def test_coalesced_small_frames_beyond_the_credit_in_one_message(rogue_world) -> None:
    world, svc0, svc2, rogue = rogue_world
    lane = lane_of(svc0)
    credit = lane.stats()["credit"]
    frames = [frame(L.DATA, f"small.{k}", 32, credited=True) for k in range(2000)]
    rss0 = rss_bytes()
    rogue.send(message(frames))
    assert refused(svc0)
    assert lane.floating_peak_bytes == credit * int(lane.mem[L.C_SLOT]) <= lane.pool_bytes
    assert lane.floating_bytes == 0
    assert rss_bytes() - rss0 < lane.pool_bytes + 4 * MIB
    still_works(svc0, svc2)


@pytest.mark.parametrize("ftype", [L.RTS, L.NEED])
def test_announcements_of_ops_nobody_submits_are_charged_and_capped(rogue_world, ftype) -> None:
    """RTS (the rogue holds frames for us) and NEED (a thread there waits): both kept for
    an op not submitted here in records charged against the pool, as many as fit."""
    world, svc0, svc2, rogue = rogue_world
    lane = lane_of(svc0)
    cap = int(lane.mem[L.C_ANNCAP])
    n = 20_000
    assert cap < n
    rogue.send(message([frame(ftype, "ann.warm")]))  # code loaded once, before the baseline
    settle(svc0, 1)
    # The rogue's messages are made before the baseline: they live in this process too, and
    # what is measured is what the receiver keeps of them.
    flood = [
        message([frame(ftype, f"ann.{k}") for k in range(first, first + 500)])
        for first in range(0, n, 500)
    ]
    rss0 = rss_bytes()
    for m in flood:
        rogue.send(m)
    settle(svc0, 1 + n // 500)
    st = lane.stats()
    assert 1 not in svc0.loop.peers.bad  # announcing is allowed
    assert st["announcements"] == cap
    if ftype == L.RTS:
        assert st["announcements_not_kept"] == n + 1 - cap
    else:  # a NEED not kept is a hint lost; no READY is owed for it
        assert st["needs_kept"] == cap and st["announcements_not_kept"] == 0
    assert lane.floating_bytes == cap * L.ANN_CHARGE <= lane.pool_bytes // 4
    assert st["pool_slots"] == int(lane.mem[L.C_NSLOTS])  # no slot, no growth
    assert rss_bytes() - rss0 < 4 * MIB
    # Garbage now: everything it left here goes.
    rogue.send(message([frame(77, "garbage")]))
    assert refused(svc0)
    assert lane.floating_bytes == 0 and lane.stats()["announcements"] == 0
    still_works(svc0, svc2)


def test_a_bad_peer_s_flood_is_dropped(rogue_world) -> None:
    world, svc0, svc2, rogue = rogue_world
    lane = lane_of(svc0)
    rogue.send(message([frame(L.DATA, "x", 16)]))  # uncredited, for an op not submitted
    assert refused(svc0)
    got0 = lane.stats()["messages_received"]
    rss0 = rss_bytes()
    body = 64 << 10
    for k in range(1000):
        rogue.send(message([frame(L.DATA, f"late.{k}", body, credited=True),
                            frame(L.RTS, f"late.ann.{k}")]))  # fmt: skip
    settle(svc0, got0 + 1000)
    assert lane.floating_bytes == 0 and lane.floating_peak_bytes <= lane.pool_bytes
    assert lane.stats()["announcements"] == 0
    assert rss_bytes() - rss0 < 8 * MIB, "a bad peer's frames were kept"
    still_works(svc0, svc2)


MALFORMED = {
    "short": lambda: message([])[:10],
    "bad magic": lambda: message([frame(L.READY, "m")], magic=0x12345678),
    "bad version": lambda: message([frame(L.READY, "m")], version=L.LANE_VERSION + 1),
    "another sender": lambda: message([frame(L.READY, "m")], sender=2),
    "negative credit": lambda: message([], credit=-1),
    "credit never spent": lambda: message([], credit=1),
    "frame count past the end": lambda: message([frame(L.READY, "m")], count=3),
    "stray bytes": lambda: message([frame(L.READY, "m")]) + b"\x00" * 8,
    "too long": lambda: message([frame(L.READY, "m")]) + b"\x00" * (8 * MIB),
    "DATA body over micro_bytes": lambda: message([frame(L.DATA, "m", 128 << 10, credited=True)]),
    "DATA negative size": lambda: message([frame(L.DATA, "m", -8, credited=True, body=b"")]),
    "DATA truncated body": lambda: message([frame(L.DATA, "m", 4096, credited=True)])[:-100],
    "DATA uncredited, op not submitted": lambda: message([frame(L.DATA, "m", 64)]),
    "RTS truncated": lambda: message([frame(L.RTS, "m")])[:-1],
    "READY truncated": lambda: message([frame(L.READY, "m")])[:-8],
    "CTS truncated": lambda: message([frame(L.CTS, "m")])[:-30],
    "ASK truncated": lambda: message([frame(L.ASK, "m")])[:-71],
    "type 0": lambda: message([frame(0, "m")]),
    "type 4 (the retired REJECT)": lambda: message([frame(4, "m")]),
    "NEED truncated": lambda: message([frame(L.NEED, "m")])[:-40],
    "ERROR body over 4096 bytes": lambda: message([frame(L.ERROR, "m", 4104, body=b"e" * 4104)]),
    "ERROR negative size": lambda: message([frame(L.ERROR, "m", -8, body=b"")]),
    "ERROR truncated body": lambda: message([frame(L.ERROR, "m", 64, body=b"e" * 64)])[:-16],
    "ERROR truncated": lambda: message([frame(L.ERROR, "m")])[:-2],
    "PROBE body over 4096 bytes": lambda: message([frame(L.PROBE, "m", 4104, body=b"p" * 4104)]),
    "PROBE truncated": lambda: message([frame(L.PROBE, "m")])[:-9],
    "HAVE with a body": lambda: message([frame(L.HAVE, "m", 8, body=b"h" * 8)]),
    "HAVE truncated": lambda: message([frame(L.HAVE, "m")])[:-33],
    "BYE with a body": lambda: message([frame(L.BYE, "m", 16, body=b"b" * 16)]),
    "BYE truncated": lambda: message([frame(L.BYE, "m")])[:-1],
    "GONE with a body": lambda: message([frame(L.GONE, "m", 8, body=b"g" * 8)]),
    "GONE truncated": lambda: message([frame(L.GONE, "m")])[:-50],
    "JOIN with a body": lambda: message([frame(L.JOIN, "m", 8, body=b"j" * 8)]),
    "JOIN truncated": lambda: message([frame(L.JOIN, "m")])[:-4],
    "control frames past the per-message bound": lambda: message(
        [frame(L.PROBE, f"m.{k}") for k in range(L.CONTROL_PER_MESSAGE + 1)]
    ),
    "type 14": lambda: message([frame(max(L.FrameType) + 1, "m")]),
    "type 255": lambda: message([frame(255, "m")]),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_lane_message_is_a_frame_error_and_the_loop_lives(what: str) -> None:
    world = LocalWorld(2)
    svc = Service(world.transport(0), Config.load(env={}, floating_pool_bytes=POOL))
    try:
        assert svc.loop.lane is not None  # the engine and its lane, now
        Rogue(world).send(MALFORMED[what]())
        assert refused(svc), f"{what}: the message was not refused"
        err = svc.loop.peers.bad[1]
        assert isinstance(err, tr.FrameError) and "from rank 1" in str(err), err
        h = svc.allreduce_async(np.ones(4), name="x")
        with pytest.raises(tr.FrameError, match="from rank 1"):
            h.wait(timeout=5)
        assert svc.loop.fatal is None
        me = tr.Group([0])
        np.testing.assert_array_equal(svc.allreduce(np.arange(3.0), group=me), np.arange(3.0))
        assert lane_of(svc).floating_bytes == 0
    finally:
        svc.shutdown(timeout=0.3)


def test_a_flood_of_control_frames_stays_within_the_bound(rogue_world) -> None:
    """Messages full of control frames (PROBEs and ERRORs with the longest text, of ops
    nobody submits): each is within the protocol, so none is refused; the lane keeps at
    most its fixed control buffer of them until Python took them, and rank 0's memory
    stays flat."""
    world, svc0, svc2, rogue = rogue_world
    lane = lane_of(svc0)
    text = b"x" * L.MAX_CONTROL_BODY
    n_msgs = 24
    per = L.CONTROL_PER_MESSAGE
    rogue.send(message([frame(L.PROBE, "warm")]))
    settle(svc0, 1)
    rss0 = rss_bytes()
    got0 = lane.stats()["messages_received"]
    for m in range(n_msgs):
        if m % 2:  # ERRORs: each as long as an ERROR may be (8 per message: its length)
            frames = [frame(L.ERROR, f"gone.{m}.{k}", len(text), body=text) for k in range(48)]
        else:
            frames = [frame(L.PROBE, f"probe.{m}.{k}") for k in range(per)]
        rogue.send(message(frames))
        assert int(lane.mem[L.C_NCTL]) <= L.CONTROL_EVENTS
        assert int(lane.mem[L.C_CTLBLEN]) <= L.CONTROL_BODY_BYTES
    settle(svc0, got0 + n_msgs)
    assert 1 not in svc0.loop.peers.bad, svc0.loop.peers.bad.get(1)
    counts = svc0.loop.stats.lane_control
    assert counts.get(L.PROBE, 0) >= per * (n_msgs // 2)
    assert counts.get(L.ERROR, 0) == 48 * (n_msgs // 2)
    # what Python remembers of errors for ops not submitted here is its own bounded table
    assert rss_bytes() - rss0 < 8 * MIB, "control frames were kept beyond the bound"
    assert lane.floating_bytes == 0
    # the rogue's error for an op rank 0 then submits fails it, naming the text
    h = svc0.allreduce_async(np.ones(4), name="gone.1.0")
    with pytest.raises(tr.OpFailedError, match="xxxx"):
        h.wait(timeout=5)


def test_a_clear_naming_a_tag_outside_the_body_tags_is_refused() -> None:
    """A CTS for an op active here, naming a tag the lane never posts on."""
    world = LocalWorld(2)
    svc = Service(world.transport(0), Config.load(env={}, floating_pool_bytes=POOL))
    try:
        lane = lane_of(svc)
        h = svc.allreduce_async(np.ones(1 << 17), name="big")  # 1 MiB: large segments
        deadline = time.monotonic() + 5
        while not lane.by_key and time.monotonic() < deadline:
            time.sleep(0.001)
        (lop,) = lane.by_key.values()
        o = int(lane.mem[L.C_OPS]) + lop.slot * L.O_N
        w = [int(lane.mem[o + k]) for k in (L.O_DT, L.O_KIND, L.O_ALGO, L.O_ROP, L.O_WID,
                                            L.O_GEN, L.O_COUNT, L.O_PARAM, L.O_CTX)]  # fmt: skip
        assert int(lane.mem[L.C_BTAG]) > 5
        # The op's own shape and key, so that only the tag (5) is wrong.
        head = _FRAME.pack(L.CTS, w[0], w[1], w[2], w[3], 0, 0, 5, 0, 0, 0, w[4] & _U64, w[5],
                           512 << 10, w[6], w[7], w[8] & _U64)  # fmt: skip
        raw = message([head])
        Rogue(world).send(bytes(raw))
        assert refused(svc)
        assert "tag" in str(svc.loop.peers.bad[1])
        with pytest.raises(tr.FrameError, match="from rank 1"):
            h.wait(timeout=5)
    finally:
        svc.shutdown(timeout=0.3)


# ---------------------------------------------------------------------- hurried peers


@pytest.mark.parametrize(
    "n_ops,count,micro,pool",
    [
        (96, 256 << 10, 1 << 20, 32 * MIB),  # 2 MiB allreduces in eager bodies of 1 MiB
        (4000, 4 << 10, 64 << 10, 32 * MIB),  # 32 KiB ones, frames coalesced
    ],
)
def test_early_ops_of_an_honest_peer_stay_within_the_pool(n_ops, count, micro, pool) -> None:
    """Rank 1 submits every op at once; rank 0 submits them only later, in reverse."""

    def rank_main(s):
        xs = [np.full(count, k + s.rank, np.float64) for k in range(n_ops)]
        if s.rank == 1:
            hs = [s.allreduce_async(xs[k], name=f"e{k}") for k in range(n_ops)]
            return [h.wait(timeout=120) for h in hs], None
        time.sleep(1.0)  # rank 1's frames pile up here meanwhile
        lane = lane_of(s)
        deadline = time.monotonic() + 60  # (a loaded machine's rank 1 may take longer)
        while lane.stats()["announcements"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = lane.floating_bytes, lane.stats()
        hs = {k: s.allreduce_async(xs[k], name=f"e{k}") for k in reversed(range(n_ops))}
        return [hs[k].wait(timeout=120) for k in range(n_ops)], held

    with local_services(2, micro_bytes=micro, floating_pool_bytes=pool) as svcs:
        results = run_ranks(svcs, rank_main, timeout=300)
        lane = lane_of(svcs[0])
        peak = lane.floating_peak_bytes
        share = lane.pool_bytes
        both = svcs[0].loop.floating_peak_bytes
    held, st = results[0][1]
    for r in range(2):
        for k in range(0, n_ops, 7):
            np.testing.assert_array_equal(results[r][0][k], np.full(count, 2 * k + 1.0))
    assert 0 < held <= share and peak <= share, (held, peak, share, st)
    assert both <= pool
    assert st["announcements"] > 0  # beyond the credit, rank 1 announced instead


def test_announcements_not_kept_still_get_their_ready() -> None:
    """No credit and room for 16 announcements: rank 0 announces 200 ops that rank 1
    submits later in reverse order, blocking on each.  The announcements it could not
    keep are answered when each op starts (the peer was marked), so nothing hangs."""
    n_ops = 200
    pool = 16 * 4 * L.ANN_CHARGE  # a quarter of it: 16 announcements; no credit

    def rank_main(s):
        if s.rank == 0:
            hs = [s.allreduce_async(np.full(100, k, np.int64), name=f"a{k}") for k in range(n_ops)]
            return [h.wait(timeout=120) for h in hs], None
        time.sleep(0.5)
        st = lane_of(s).stats()
        out = {k: s.allreduce(np.full(100, k, np.int64), name=f"a{k}")
               for k in reversed(range(n_ops))}  # fmt: skip
        return [out[k] for k in range(n_ops)], st

    with local_services(2, floating_pool_bytes=pool) as svcs:
        assert lane_of(svcs[1]).stats()["credit"] == 0
        results = run_ranks(svcs, rank_main, timeout=300)
    st = results[1][1]
    assert st["announcements"] == 16 and st["announcements_not_kept"] > 0, st
    for r in range(2):
        for k in range(n_ops):
            np.testing.assert_array_equal(results[r][0][k], np.full(100, 2 * k))


def test_a_peer_s_urgency_raises_the_op_here_and_travels_on_in_the_clears() -> None:
    """An ``ASK`` with ``FLAG_NEED`` (a thread on the peer waits for the op) raises the op
    here, though nobody here waits for it; the clear that answers it carries the flag on."""
    world = LocalWorld(2)
    svc = Service(world.transport(0), Config.load(env={}, floating_pool_bytes=POOL))
    try:
        lane = lane_of(svc)
        h = svc.allreduce_async(np.ones(1 << 17), name="big", algorithm="ring")  # bodies
        deadline = time.monotonic() + 5
        while not lane.by_key and time.monotonic() < deadline:
            time.sleep(0.001)
        (lop,) = lane.by_key.values()
        o = int(lane.mem[L.C_OPS]) + lop.slot * L.O_N
        assert lane.mem[o + L.O_URGENT] == 0
        w = [int(lane.mem[o + k]) for k in (L.O_DT, L.O_KIND, L.O_ALGO, L.O_ROP, L.O_WID,
                                            L.O_GEN, L.O_COUNT, L.O_PARAM, L.O_CTX)]  # fmt: skip
        r = int(lane.prog[int(lane.mem[o + L.O_PLAN]) + L.PL_RECVS])  # its first receive
        step, seg, nbytes = (int(lane.prog[r + k]) for k in (L.G_STEP, L.G_SEG, L.G_NBYTES))
        assert nbytes > int(lane.mem[L.C_MICRO])
        head = _FRAME.pack(L.ASK, w[0], w[1], w[2], w[3], L.FLAG_NEED, 0, 0, step, seg, 0,
                           w[4] & _U64, w[5], nbytes, w[6], w[7], w[8] & _U64)  # fmt: skip
        rogue = Rogue(world)
        rogue.send(message([head]))
        deadline = time.monotonic() + 5
        while lane.mem[o + L.O_URGENT] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert lane.mem[o + L.O_URGENT] == 1, "the peer's NEED did not raise the op"
        # What rank 0 sent rank 1 since: its answer to the ASK is a clear with the flag.
        buf = np.zeros(1 << 16, dtype=np.uint8)
        flagged = []
        deadline = time.monotonic() + 5
        while not flagged and time.monotonic() < deadline:
            rc = mpi_native.mpi_irecv(rogue.b, buf.ctypes.data, buf.nbytes, 0, L.LANE_TAG,
                                      rogue.req.ctypes.data)  # fmt: skip
            assert rc == 0, rc
            while mpi_native.mpi_test(rogue.b, rogue.req.ctypes.data, 0) == 0:
                assert time.monotonic() < deadline, "no clear with the flag came"
                time.sleep(0.0002)
            n = _MSG.unpack_from(buf, 0)[3]
            for k in range(n):  # rank 0 sends rank 1 no eager body here: headers only
                f = _FRAME.unpack_from(buf, _MSG.size + k * _FRAME.size)
                if f[0] == L.CTS and f[5] & L.FLAG_NEED and (f[8], f[9]) == (step, seg):
                    flagged.append(f)
        assert flagged
        svc.abort("big", 0, "the test is over")
        with pytest.raises(tr.OpFailedError):
            h.wait(timeout=5)
    finally:
        svc.shutdown(timeout=0.3)


def test_a_need_for_an_op_not_submitted_here_is_kept_and_a_waiter_asks_for_its_own() -> None:
    """A ``NEED`` from rank 1 for an op rank 0 has not submitted is kept (an announcement
    record, charged); the op then starts raised, though nothing else of rank 1's came.
    And rank 0's thread that waits for it past ``need_after_s`` asks rank 1 with a NEED
    of its own."""
    world = LocalWorld(2)
    svc = Service(world.transport(0), Config.load(env={}, floating_pool_bytes=POOL))
    try:
        lane = lane_of(svc)
        rogue = Rogue(world)
        f = bytearray(frame(L.NEED, "wanted"))
        f[5] = L.FLAG_NEED
        rogue.send(message([bytes(f)]))
        deadline = time.monotonic() + 5
        while lane.stats()["needs_kept"] == 0:
            assert time.monotonic() < deadline, lane.stats()
            time.sleep(0.001)
        assert lane.floating_bytes == L.ANN_CHARGE and 1 not in svc.loop.peers.bad
        h = svc.allreduce_async(np.ones(1), name="wanted")  # the frame's shape: one float64
        deadline = time.monotonic() + 5
        while not lane.by_key and time.monotonic() < deadline:
            time.sleep(0.001)
        (lop,) = lane.by_key.values()
        o = int(lane.mem[L.C_OPS]) + lop.slot * L.O_N
        assert lane.mem[o + L.O_URGENT] == 1, "the kept NEED did not raise the op"
        st = lane.stats()
        assert st["needs_used"] == 1 and st["announcements"] == 0 and lane.floating_bytes == 0
        with pytest.raises((tr.TotalReduceError, TimeoutError)):
            h.wait(timeout=0.05)  # rank 1 never sends: the waiter asks it after 0.5 ms
        buf = np.zeros(1 << 16, dtype=np.uint8)
        needs = []
        deadline = time.monotonic() + 5
        while not needs:
            rc = mpi_native.mpi_irecv(rogue.b, buf.ctypes.data, buf.nbytes, 0, L.LANE_TAG,
                                      rogue.req.ctypes.data)  # fmt: skip
            assert rc == 0, rc
            while mpi_native.mpi_test(rogue.b, rogue.req.ctypes.data, 0) == 0:
                assert time.monotonic() < deadline, "no NEED came"
                time.sleep(0.0002)
            n = _MSG.unpack_from(buf, 0)[3]
            at = _MSG.size
            for _ in range(n):
                g = _FRAME.unpack_from(buf, at)
                body = g[L.F_NBYTES] if g[L.F_TYPE] == L.DATA else 0
                at += _FRAME.size + ((body + 7) & ~7)
                if g[L.F_TYPE] == L.NEED and g[L.F_WID] == wire_id("wanted"):
                    assert g[L.F_FLAGS] & L.FLAG_NEED
                    needs.append(g)
        assert len(needs) == 1
        svc.abort("wanted", 0, "the test is over")
        with pytest.raises(tr.OpFailedError):
            h.wait(timeout=5)
    finally:
        svc.shutdown(timeout=0.3)
