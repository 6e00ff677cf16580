# ruff: noqa: F405 - the field constants come from totalreduce.protocol by a star import (Numba
# folds module globals into constants; listing ~100 names would only repeat them)
"""The compiled lane: one ``nopython``, ``nogil`` pass over MPI for the engine's small ops.

Everything here is a Numba function over the lane's three arrays (``mem``, ``prog``,
``arena``; field positions in :mod:`totalreduce.protocol`) and the MPI record ``b`` of
:mod:`totalreduce.transport.mpi_native`.  A pass receives every message waiting on
the lane's tag (``MPI_Improbe``/``MPI_Mrecv``), places each frame by a hash of its op
key, applies bodies with the kernels of :mod:`totalreduce.kernels.raw` (or keeps
them in a pool slot until their turn, or until their op is submitted here), releases
the segments that waited for them, sends ready segments in priority order (coalesced
per peer, within credit), returns credit, and marks ops done.  No Python object is
created per frame, segment or op; what compiled code cannot decide (a mismatch, a
malformed message, an MPI error, a full pool) becomes an event for Python.

Flow control, as in the main loop: each peer may fill ``C_CREDIT`` pool slots here.
A frame that finds no credit is announced instead (``RTS``, header only); the
receiver answers ``READY`` once the op is submitted there, and the sender then sends
that op's frames without credit (they are consumed on arrival).  So early frames stay
within the credit, an op submitted everywhere always has a path, and no order of
submissions deadlocks.

This module holds the pass, the drivers and submission; the receiving side (frames placed
by op key) is :mod:`.lane_receive`, the tables, outboxes and ready heap
:mod:`.lane_tables`, op progress and sending :mod:`.lane_progress`, answers and the
rendezvous of large segments :mod:`.lane_bodies`.
"""

from __future__ import annotations

from numba import njit

from ..native.intrinsics import (
    atomic_load_i64,
    cpu_relax,
)
from ..native.libc import futex_wait, now_ns, yield_cpu
from ..protocol import *  # noqa: F403 - the protocol's words and fields
from ..transport.mpi_native import (
    B_ANY_SOURCE,
    mpi_get_count,
    mpi_improbe,
    mpi_mrecv,
    status_source,
)
from .lane_bodies import (
    _ask_peers,
    _owe,
    _post_waiting,
    _reap_bodies,
    _send_abandons,
    _send_readies,
    want_recv,
)
from .lane_progress import (
    _drain_stack,
    _fail,
    _locals,
    _push_stack,
    _send_ready,
    remember_failed,
    remember_key,
)
from .lane_receive import _consume, _place
from .lane_tables import (  # noqa: F401 - control_frame: an entry point, named here
    _chain_need,
    _chain_next,
    _chain_set_next,
    _chain_source,
    _dyn,
    _event,
    _heap_push,
    _op,
    _raise,
    _reap,
    _slot_addr,
    control_frame,
    flush_all,
    hash_find,
    hash_put,
    hash_rebuild,
    hash_value,
    slot_give,
    unfloat,
)

# ------------------------------------------------------------------ the pass


@njit(nogil=True, cache=True)
def lane_pass(mem, prog, arena, b, budget):
    """One pass: receive up to ``budget`` messages, send what is ready, return credit,
    test sends.  Returns the number of messages received and segments completed."""
    abase = arena.ctypes.data
    done0 = mem[C_OPS_DONE]
    got = 0
    if mem[C_FULL]:
        if not _consume(mem, prog, arena, b):
            return 0
    msg = abase + mem[C_A_MSG]
    status = abase + mem[C_A_STATUS]
    for _ in range(budget):
        r = mpi_improbe(b, b[B_ANY_SOURCE], mem[C_TAG], msg, status)
        if r < 0:
            _event(mem, arena, EV_MPI, -1, -1, r, 0, 0)
            break
        if r == 0:
            break
        src = status_source(b, status)
        count = mpi_get_count(b, status)
        got += 1
        mem[C_RECV_MSGS] += 1
        if count < 0 or count > mem[C_OUTCAP]:
            # Too long for any message a peer may send: take it, refuse it.
            mpi_mrecv(b, abase + mem[C_A_LAND], mem[C_OUTCAP], msg, status)
            _event(mem, arena, EV_MALFORMED, -1, src, MF_LONG, count, 0)
            continue
        rc = mpi_mrecv(b, abase + mem[C_A_LAND], count, msg, status)
        if rc < 0:
            _event(mem, arena, EV_MPI, -1, src, rc, 0, 0)
            continue
        if mem[mem[C_PEERS] + src * P_N + P_BAD]:
            continue  # a peer that sent garbage: what it sends now is taken and dropped
        mem[C_LANDLEN] = count
        mem[C_LANDSRC] = src
        mem[C_LANDPOS] = 0
        if not _consume(mem, prog, arena, b):
            break
        w = mem[C_WATCH]
        if w >= 0 and mem[C_INFLIGHT] == 0:
            ow = _op(mem, w)
            if mem[ow + O_SEQ] != mem[C_WATCHSEQ] or mem[ow + O_STATE] != S_ACTIVE:
                break  # the op a thread waits for ended, and no other is in flight
    if mem[C_NAQ]:
        _send_abandons(mem, arena, b)
    if mem[C_NBREQ]:
        # Clears owed and bodies ready go out before the bodies in flight are tested: that
        # test may copy an arriving body (MPICH's CMA copies in the receiver's progress)
        # and apply it, hundreds of µs during which the peer would wait for them.
        _send_all(mem, prog, arena, b)
        got += _reap_bodies(mem, prog, arena, b)
    if mem[C_NPQ]:
        _post_waiting(mem, prog, arena, b)
    _send_all(mem, prog, arena, b)
    # Each MPI call polls the library's queues (0.2-0.5 us each on a small machine, and a
    # waiting thread polls again at once): while no body is in flight, only every
    # _CTL_SKIPS-th pass tests the send buffers (or any pass, once more than half are
    # busy: a send looking for one tests them, _free_sb), so a pass that finds nothing is
    # one probe long and an arriving frame is found sooner.  (Measured at P = 2, 4 KiB:
    # 1.7 empty passes per op.)  With bodies in flight every call stays: each one also
    # moves the library's large transfers.
    quiet = mem[C_NBREQ] == 0 and mem[C_CTLSKIP] < _CTL_SKIPS
    if quiet:
        mem[C_CTLSKIP] += 1
    else:
        mem[C_CTLSKIP] = 0
    if mem[C_NSBBUSY] and (not quiet or 2 * mem[C_NSBBUSY] > mem[C_NSB]):
        _reap(mem, b, abase)
    return got + (mem[C_OPS_DONE] - done0)


@njit(nogil=True, cache=True)
def _send_all(mem, prog, arena, b):
    """Send the answers owed (``READY``, ``CTS``) and the segments ready, then flush.  While
    bodies are in flight the answers are flushed first: a clear must not wait behind the
    bodies posted after it (the peer's MPI may copy those before it sees the clear)."""
    if mem[C_NRQ]:
        _send_readies(mem, prog, arena, b)
        if mem[C_NBREQ]:
            flush_all(mem, arena, b)
    _send_ready(mem, prog, arena, b)
    flush_all(mem, arena, b)


#: Passes without a body in flight between two that test the send buffers.
_CTL_SKIPS = 8


#: Polls without progress before a waiting thread yields its core between polls.
_POLLS_BEFORE_YIELD = 64
#: With naps on (``C_NAP_NS``, ``Config.nap_s``): a thread waiting for an op of at least
#: this many bytes sleeps between polls once the lane has been silent this long (since
#: ``C_MOVED_NS``, whichever thread's call saw the last move: a thread that drives in
#: spans, a node service's arena thread, is not back to spinning at each).
_NAP_MIN_BYTES = 256 << 10
_NAP_AFTER_NS = 50_000
#: lane_drive's ``take``: bits.  DRIVE_TAKE: a waiter's first try (the op is taken out
#: when it ends well, 2); DRIVE_OUTER: return OUTER once the outer words moved.
DRIVE_TAKE = 1
DRIVE_OUTER = 2
#: What lane_drive returns when the outer words moved (the waiter's op goes on).
OUTER = 3


@njit(nogil=True, cache=True)
def lane_own(mem, slot):
    """Whether op ``slot`` is the one op done, done well, with no event and nothing full
    waiting for Python; if so it is taken (the done queue emptied)."""
    if (
        mem[C_NDONE] != 1
        or mem[C_NEV] != 0
        or mem[C_FULL] != 0
        or mem[C_BFULL] != 0
        or mem[mem[C_DONEQ]] != slot
        or mem[mem[C_OPS] + slot * O_N + O_STATE] != S_DONE
    ):
        return False
    mem[C_NDONE] = 0
    return True


@njit(nogil=True, cache=True)
def lane_drive(mem, prog, arena, b, slot, seq, max_ns, spin_ns, take):
    """Passes without the interpreter lock until a condition or ``max_ns``; spins
    ``spin_ns`` after the last progress, then yields the core between passes.

    ``slot >= 0``, a waiting thread's: until that op (submission ``seq``) left the table
    (1), or an event waits (0); the op is urgent from now on.  ``slot < 0``, the comm
    thread's while the lane alone has work: until something needs Python (1: an op ended,
    an event, ``C_KICK``), or nothing is left in flight (0).
    With ``take & DRIVE_TAKE`` (a waiter's first try), 2 when the op ended and
    :func:`lane_own` took it.  With
    ``take & DRIVE_OUTER``, OUTER (3) as soon as the outer words moved (``C_OUTER_*``:
    the caller has work outside the lane; its op goes on, not ended).
    One entry point for both: each entry point links and optimizes the whole pass again
    when it is first compiled."""
    if slot < 0:
        return _drive(mem, prog, arena, b, slot, seq, max_ns, spin_ns, 0)
    first = take & DRIVE_TAKE
    mem[C_WATCH] = slot
    mem[C_WATCHSEQ] = seq
    outer = mem[C_OUTER_N] if take & DRIVE_OUTER else 0
    r = _drive(mem, prog, arena, b, slot, seq, max_ns, spin_ns, outer)
    mem[C_WATCH] = -1
    if r == 1 and first != 0 and lane_own(mem, slot):
        return 2
    return r


@njit(nogil=True, cache=True)
def _outer_moved(mem, n):
    """Whether the ``n`` outer words moved (see ``C_OUTER_AT``)."""
    if atomic_load_i64(mem[C_OUTER_FLAG]) != 0:
        return True
    at = mem[C_OUTER_AT]
    stride = mem[C_OUTER_STRIDE]
    total = 0
    for i in range(n):
        total += atomic_load_i64(at + i * stride)
    return total != atomic_load_i64(mem[C_OUTER_SEEN])


@njit(nogil=True, cache=True)
def _drive(mem, prog, arena, b, slot, seq, max_ns, spin_ns, outer):
    """lane_drive's loop (``outer``: how many outer words to watch, 0: none)."""
    t0 = now_ns()
    last = t0
    idle = 0
    o = _op(mem, slot) if slot >= 0 else 0
    nap = 0
    if slot >= 0 and mem[o + O_SEQ] == seq:
        if mem[o + O_WAITED] == 0:
            # A thread waits for it: among equal priorities it goes first (its sends in the
            # heap too), and after C_NEED_NS its peers are asked to raise it (_ask_peers).
            mem[o + O_WAITED] = t0
            _raise(mem, slot)
        if mem[o + O_COUNT] * prog[mem[o + O_PLAN] + PL_ISZ] >= _NAP_MIN_BYTES:
            nap = mem[C_NAP_NS]
    while True:
        if slot >= 0:
            if mem[o + O_SEQ] != seq or mem[o + O_STATE] != S_ACTIVE:
                return 1
        elif mem[C_KICK]:
            return 1
        if lane_pass(mem, prog, arena, b, 64) > 0:
            last = now_ns()
            idle = 0
            mem[C_PROGRESS] += 1
            mem[C_MOVED_NS] = last
        needs = mem[C_NEV] > 0 or mem[C_FULL] != 0 or mem[C_BFULL] != 0
        if slot >= 0:
            if mem[o + O_SEQ] != seq or mem[o + O_STATE] != S_ACTIVE:
                return 1
            if needs:
                return 0
            if outer > 0 and _outer_moved(mem, outer):
                return OUTER
        else:
            if needs or mem[C_NDONE] > 0:
                return 1
            if mem[C_INFLIGHT] == mem[C_PASSIVE] and mem[C_NSBBUSY] == 0:
                return 0
        t = now_ns()
        if slot >= 0 and mem[o + O_WAITED] > 0 and t - mem[o + O_WAITED] > mem[C_NEED_NS]:
            _ask_peers(mem, prog, arena, slot)  # (sent in the next pass)
        if t - t0 > max_ns:
            return 0
        idle += 1
        # A few polls with the spin hint, then the core goes to whoever needs it (the
        # peer an op waits for may share it: more ranks than cores); after ``spin_ns``
        # without progress, only yields.  With naps on (Config.nap_s), a thread waiting
        # for a large op yields between polls from the first, and once the lane has been
        # silent for _NAP_AFTER_NS sleeps instead: a spinning or yielding thread still
        # takes its share of a core that another process wants for computing (a node's
        # training process), one asleep takes none, and a large op's time dwarfs the
        # sleep's end.
        if nap > 0:
            if t - mem[C_MOVED_NS] > _NAP_AFTER_NS:  # (never past max_ns by more than 1 µs)
                futex_wait(mem.ctypes.data + 8 * C_NAP_WORD, 0, min(nap, max_ns - (t - t0) + 1000))
            else:
                yield_cpu()
        elif idle > _POLLS_BEFORE_YIELD or t - last > spin_ns:
            yield_cpu()
        else:
            cpu_relax()


# ------------------------------------------------------------------ submission


@njit(nogil=True, cache=True)
def buffer_addresses(inb, outb, addrs):
    """Write the data addresses of an op's input and output into ``addrs[0:2]`` (one
    compiled call: reading ``__array_interface__`` twice from Python costs more).
    Numba has no float16 arrays: those come as uint16 views."""
    addrs[0] = inb.ctypes.data
    addrs[1] = outb.ctypes.data


@njit(nogil=True, cache=True)
def lane_submit(mem, prog, arena, b, fields, addrs):
    """Enter an op: ``fields`` holds (wid, gen, dt, kind, algo, rop, count, param, ctx,
    prio, plan, group, gsize, me, urgent, passive); ``addrs`` the INPUT, OUTPUT and WORK
    addresses (and the scratch's).
    Runs its prologue, places its floating frames, answers announcements, queues its
    ready sends and sends them.  Returns the op's slot, or -1 when the table is full."""
    nf = mem[C_NFREEOP]
    if nf == 0:
        return -1
    slot = mem[mem[C_FREEOP] + nf - 1]
    mem[C_NFREEOP] = nf - 1
    o = _op(mem, slot)
    wid = fields[0]
    gen = fields[1]
    mem[o + O_WID] = wid
    mem[o + O_GEN] = gen
    mem[o + O_DT] = fields[2]
    mem[o + O_KIND] = fields[3]
    mem[o + O_ALGO] = fields[4]
    mem[o + O_ROP] = fields[5]
    mem[o + O_COUNT] = fields[6]
    mem[o + O_PARAM] = fields[7]
    mem[o + O_CTX] = fields[8]
    mem[o + O_PRIO] = fields[9]
    plan = fields[10]
    mem[o + O_PLAN] = plan
    mem[o + O_GROUP] = fields[11]
    mem[o + O_GSIZE] = fields[12]
    mem[o + O_ME] = fields[13]
    mem[o + O_URGENT] = fields[14]
    mem[o + O_PASSIVE] = fields[15]
    mem[C_PASSIVE] += fields[15]
    mem[o + O_IN] = addrs[0]
    mem[o + O_OUT] = addrs[1]
    mem[o + O_WORK] = addrs[2]
    mem[o + O_SCR] = addrs[3]
    mem[o + O_NREQ] = 0
    mem[o + O_WAITED] = 0
    ns = prog[plan + PL_NS]
    nr = prog[plan + PL_NR]
    mem[o + O_SLEFT] = ns
    mem[o + O_RLEFT] = nr
    mem[C_SEQ] += 1
    mem[o + O_SEQ] = mem[C_SEQ]
    if mem[C_SEQ] % (mem[C_HCAP] // 4) == 0:  # sweep the tombstones now and then
        hash_rebuild(mem, mem[C_HASH])
        hash_rebuild(mem, mem[C_FHASH])
    mem[o + O_STATE] = S_ACTIVE
    mem[C_INFLIGHT] += 1
    sw = _dyn(mem, slot, D_SW)
    ss = _dyn(mem, slot, D_SS)
    s0 = prog[plan + PL_SENDS]
    for i in range(ns):
        mem[sw + i] = prog[s0 + i * G_N + G_NWAIT]
        mem[ss + i] = SS_WAIT
    rw = _dyn(mem, slot, D_RW)
    rs = _dyn(mem, slot, D_RS)
    r0 = prog[plan + PL_RECVS]
    for q in range(nr):
        mem[rw + q] = prog[r0 + q * G_N + G_NWAIT]
        mem[rs + q] = RS_WAIT
    # A peer that waits for the op said so before it was submitted here (a NEED, or a
    # frame with FLAG_NEED, kept with its floating frames): it starts raised, before its
    # first sends enter the heap.
    fe = hash_find(mem, mem[C_FHASH], wid, gen)
    if fe >= 0 and mem[o + O_URGENT] == 0:
        x = mem[fe + 2]
        while x >= 0:
            if _chain_need(mem, x):
                mem[o + O_URGENT] = 1
                mem[C_NEEDS_USED] += 1
                break
            x = _chain_next(mem, x)
    e = hash_put(mem, mem[C_HASH], wid, gen, slot)
    if e < 0:
        hash_rebuild(mem, mem[C_HASH])
        hash_put(mem, mem[C_HASH], wid, gen, slot)
    if _locals(mem, prog, slot, prog[plan + PL_LOCS], prog[plan + PL_NPRO]) < 0:
        _fail(mem, prog, arena, slot)
        _event(mem, arena, EV_KERNEL, slot, -1, 0, 0, 0)
        return slot
    for i in range(ns):  # before placing early frames: they release the rest
        if mem[sw + i] == 0:
            _heap_push(mem, slot, i)
    if prog[plan + PL_NLARGE]:  # large receives: posted now, their CTS sent unasked
        for q in range(nr):  # (one landing in place, once its waits end: _release)
            scr = prog[r0 + q * G_N + G_SCR]
            if scr == -1 or (scr == SCR_DIRECT and mem[rw + q]):
                continue
            if not want_recv(mem, prog, arena, b, slot, q):
                _fail(mem, prog, arena, slot)
                _event(mem, arena, EV_LOST, slot, -1, q, 3, 0)
                return slot
    # Frames that came before the op: place them (their slots become its staging), and
    # answer its announcements (READY: their senders hold the op's frames).
    abase = arena.ctypes.data
    if fe >= 0:  # (nothing since the look above touched the floating hash)
        x = mem[fe + 2]
        mem[fe + 2] = H_TOMB
        while x >= 0:
            nxt = _chain_next(mem, x)
            src = _chain_source(mem, x)
            if x >= ANN_BASE:
                if mem[mem[C_ANN] + (x - ANN_BASE) * A_N + A_TYPE] == RTS:
                    _owe(mem, arena, slot, src, RQ_READY)
                unfloat(mem, x, False)
            else:
                # The slot stays taken (it becomes the op's staging, or is given back by
                # _place): only its floating charge and credit end here.
                m = mem[C_META] + x * M_N
                if mem[m + M_CREDITED]:
                    pw = mem[C_PEERS] + src * P_N
                    mem[pw + P_HELD] -= 1
                    mem[pw + P_OWED] += 1
                mem[C_FLOATING] -= 1
                mem[C_FLOATBYTES] -= mem[C_SLOT]
                if mem[o + O_STATE] == S_ACTIVE:
                    _place(mem, prog, arena, b, slot, src, _slot_addr(mem, abase, x), x)
                else:
                    slot_give(mem, x)
            x = nxt
    if mem[C_ANNDROPS] and mem[o + O_STATE] == S_ACTIVE:
        # Announcements were not kept (the table was full): each peer that may hold this
        # op's frames for want of an answer is answered now, once.
        g0 = mem[o + O_GROUP]
        seq = mem[o + O_SEQ]
        for q in range(nr):
            src = prog[g0 + prog[r0 + q * G_N + G_PEER]]
            pw = mem[C_PEERS] + src * P_N
            if mem[pw + P_ANNDROP] and mem[pw + P_MARK] != seq:
                mem[pw + P_MARK] = seq
                _owe(mem, arena, slot, src, -1)
    if mem[o + O_STATE] == S_ACTIVE:
        _push_stack(mem, arena, slot, -1)
        _drain_stack(mem, prog, arena)
    if mem[C_NRQ]:
        _send_readies(mem, prog, arena, b)
    _send_ready(mem, prog, arena, b)
    flush_all(mem, arena, b)
    return slot


@njit(nogil=True, cache=True)
def lane_enter(mem, prog, arena, b, fields, addrs, gen, prio, urgent):
    """Submission's entry point: the op's generation, priority and urgency into
    ``fields`` (a shape's fields, kept between repeats), then :func:`lane_submit`.
    Returns (slot, seq, whether ops ended or events wait for Python); slot -1 when the
    table is full.  One signature for every element type (the buffers come as addresses:
    :func:`buffer_addresses`), so the submission code is linked once, not once per type."""
    fields[1] = gen
    fields[9] = prio
    fields[14] = urgent
    slot = lane_submit(mem, prog, arena, b, fields, addrs)
    return slot, mem[C_SEQ], mem[C_NDONE] != 0 or mem[C_NEV] != 0


@njit(nogil=True, cache=True)
def lane_once(mem, prog, arena, b, fields, addrs, gen, prio, urgent, max_ns, spin_ns):
    """A repeat's one compiled call, the blocking and the async form's alike: the op's
    generation, priority and urgency into ``fields`` (its shape's, kept between repeats),
    entered (:func:`lane_submit`), its slot, submission and whether ops ended or events
    wait for Python into ``addrs[4:7]``; then, with ``max_ns >= 0`` (a blocking call),
    driven as a waiter's first try (:func:`lane_drive` with ``DRIVE_TAKE``).  Returns -1
    when the table is full (nothing entered); else the drive's result (2: it ended well
    and left the table), or 0 with ``max_ns < 0`` (entered, not driven)."""
    fields[1] = gen
    fields[9] = prio
    fields[14] = urgent
    slot = lane_submit(mem, prog, arena, b, fields, addrs)
    if slot < 0:
        return -1
    seq = mem[C_SEQ]
    addrs[4] = slot
    addrs[5] = seq
    addrs[6] = 1 if mem[C_NDONE] != 0 or mem[C_NEV] != 0 else 0
    if max_ns < 0:
        return 0
    return lane_drive(mem, prog, arena, b, slot, seq, max_ns, spin_ns, DRIVE_TAKE)


@njit(nogil=True, cache=True)
def lane_fail(mem, prog, arena, slot):
    """Python fails op ``slot`` (an error from a peer, a peer gone, shutdown)."""
    _fail(mem, prog, arena, slot)


@njit(nogil=True, cache=True)
def lane_drop_floating(mem, wid, gen):
    """Forget the floating frames of key (wid, gen), returning their credit; how many."""
    fe = hash_find(mem, mem[C_FHASH], wid, gen)
    if fe < 0:
        return 0
    x = mem[fe + 2]
    mem[fe + 2] = H_TOMB
    k = 0
    while x >= 0:
        nxt = _chain_next(mem, x)
        unfloat(mem, x, True)
        k += 1
        x = nxt
    return k


@njit(nogil=True, cache=True)
def lane_drop_peer(mem, peer):
    """``peer`` is bad (it sent garbage, or it failed): drop its messages from now on, and
    what it left floating here (no credit goes back to it); a message of its that waits
    for a free slot is dropped too.  How many frames and announcements were dropped."""
    mem[mem[C_PEERS] + peer * P_N + P_BAD] = 1
    if mem[C_FULL] and mem[C_LANDSRC] == peer:
        mem[C_LANDLEN] = 0
        mem[C_LANDPOS] = 0
        mem[C_FULL] = 0
    pw = mem[C_PEERS] + peer * P_N
    if mem[pw + P_HELD] == 0 and mem[pw + P_ANN] == 0:
        return 0
    base = mem[C_FHASH]
    k = 0
    for i in range(mem[C_HCAP]):
        e = base + i * 3
        x = mem[e + 2]
        if x < 0:
            continue
        head = -1
        tail = -1
        while x >= 0:
            nxt = _chain_next(mem, x)
            if _chain_source(mem, x) == peer:
                unfloat(mem, x, False)
                k += 1
            else:
                if tail < 0:
                    head = x
                else:
                    _chain_set_next(mem, tail, x)
                tail = x
            x = nxt
        if tail >= 0:
            _chain_set_next(mem, tail, -1)
            mem[e + 2] = head
        else:
            mem[e + 2] = H_TOMB
    return k


#: How long the lane's first compile takes, for the line that says it runs (measured on
#: the 2-core development machine: 24-25 s of one core, the reduction kernels compiled
#: apart when an op first needs them; more on a busy machine; see docs/faq.md).
COMPILE_TAKES = "about half a minute on a small machine"


def compile_all() -> None:
    """Compile (or load from Numba's cache) every entry point of the lane, by signature.

    A lane calls this when it is made, so the compiling happens in ``init()`` and not
    inside a first op, where a peer's stall timer would count it.  Nothing runs.  Once per
    installation (:mod:`.compile_once`): the first process to find the cache incomplete
    compiles, saying so in one line, while the others (the job's other ranks) wait and
    then load it; a complete cache loads with nothing said."""
    from .compile_once import compile_once
    from .lane_cache import cache_is_current, forget_stale_cache

    compile_once(
        _compile_entry_points,
        lane_pass,
        name="lane_core",
        what="the compiled lane",
        takes=COMPILE_TAKES,
        current=lambda: cache_is_current(lane_pass),
        forget=lambda: forget_stale_cache(lane_pass),
    )


def _compile_entry_points() -> None:
    from numba import types

    from .plain_constants import plain_constants

    mem = types.Array(types.int64, 1, "C")
    arena = types.Array(types.uint8, 1, "C")
    i64 = types.int64
    # Constants passed between the lane's functions typed as int64: one specialization per
    # argument types (122, not 170), a fifth less to compile.
    with plain_constants():
        lane_pass.compile((mem, mem, arena, mem, i64))
        lane_enter.compile((mem, mem, arena, mem, mem, mem, i64, i64, i64))
        for dt in (types.uint16, types.float32, types.float64, types.int32, types.int64,
                   types.uint8, types.int8, types.int16, types.boolean):  # fmt: skip
            buf = types.Array(dt, 1, "C")
            buffer_addresses.compile((buf, buf, mem))
        lane_drive.compile((mem, mem, arena, mem, i64, i64, i64, i64, i64))
        lane_once.compile((mem, mem, arena, mem, mem, mem, i64, i64, i64, i64, i64))
        lane_fail.compile((mem, mem, arena, i64))
        control_frame.compile((mem, arena, mem, i64, mem, arena, i64))
        flush_all.compile((mem, arena, mem))
        lane_drop_floating.compile((mem, i64, i64))
        lane_drop_peer.compile((mem, i64))
        hash_value.compile((mem, i64, i64, i64))
        hash_find.compile((mem, i64, i64, i64))
        hash_put.compile((mem, i64, i64, i64, i64))
        remember_failed.compile((mem, i64, i64))
        remember_key.compile((mem, i64, i64, i64))
