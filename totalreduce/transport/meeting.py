"""The node's meeting place: an op among one node's clients, met in shared memory.

On a service of one node nothing lies between the node's clients but the arena, which each
of them maps: their buffers are there, and so is every client's completion word.  So the
world's allreduces, broadcasts and barriers need neither the service nor a socket nor a
system call: the clients meet here, in a region at the end of the arena, and the last to
arrive runs the op (with the others' help when it is large).  The service keeps what is
rare: ops the meeting cannot run (it hands them to the service's Python, which checks and
runs them as before), a client that died or left, stalls, and the session's reset.

Layout (bytes from the region's start; every word an ``int64``):

- a header page: ``M_GONE`` (nonzero while a client of the session is gone: every op
  waiting for it fails), ``M_RESCAN`` (a client arrived while one was gone: the service
  looks again), the escape queue's tail and head, the counts of ops run here
  (``M_RAN``) and handed to the service (``M_ESCAPED``), each on a line of its own, and
  the text of the last failure the service told (``M_WHY``);
- the escape queue: entries of (sequence, payload) naming op slots handed to the service;
- channels, one per op name: a line whose first word is the name's wire id, claimed by a
  compare-and-swap from 0 by the first client to need it, so every client, probing the
  same sequence, finds the same channel; a name keeps it for the session (the service
  zeroes the region when a session starts);
- in each channel, ``DEPTH`` op slots: generation ``g`` of the name uses slot
  ``g % DEPTH`` in its round ``g // DEPTH + 1``.  An op slot is a state line, a work line
  (the slices claimed and done) and one line per client: its *entry* (generation,
  ticket, shape, count, places, root, priority), which only that client writes.

**The state word** of an op slot: the clients arrived in its round (16 bits), the round
(40 bits), and the flags ``FAILED`` (the service failed the round), ``ESCAPED`` (handed to
the service), ``DONE`` (the op's words are set).  A client arrives with one
compare-and-swap on it, after writing its entry: the first of a round moves the word to
the new round (allowed once the previous round is over, which the client knows since its
own op of that round ended), the others add one.  The one whose arrival makes the count
``L`` is the *finisher*: it checks that the ``L`` entries agree and can run here (else
the op escapes to the service, whose Python names what is wrong), then opens the slices.

**Slices.**  An op is cut into slices of ``SLICE_BYTES``; the work line's claim word,
tagged with the round, hands them out one compare-and-swap each, and every client then
in ``wait()`` on the op claims them too (a large op is reduced by the node's clients in
parallel, each slice read from every client's buffer and written into every output, as
MPICH's release/gather and Gloo's shared-memory allreduce share the work).  Each slice is
reduced in slot order with the raw kernels (:mod:`totalreduce.kernels.raw`): the same
bits as the service's pass.  The client that completes the last slice sets ``DONE``, then
every client's completion word (its ticket, as the service does), and wakes those asleep.

**Waking.**  A client that waits spins on its completion word, then sleeps on the futex
word of its control block (``C_FUTEX``) after adding itself to ``C_SLEEPING``; whoever
sets a word of its (another client, or the service) bumps the futex word and wakes it if
the count is nonzero.  A futex works between processes on shared memory.

**Groups.**  An op over a group of the node's clients meets here too, on a service of
any number of nodes (of several: only groups' ops, ``H_MEET_ON`` ``MEET_GROUPS``), in a
channel of its own: its key mixes the name's wire id with the group's context (two
groups may run ops of one name at once), and the channel's first line holds the group's
slots (a bit each), wire id, size, the slot of its rank 0 and, for a group whose ranks
do not come in ascending order, its slots in group order (6 bits each, at most
:data:`ORDER_SLOTS`), which every member writes alike when it first looks the channel
up.  Only the members' entries count, the round is over when they all arrived, the op is
reduced in group order among them (the rings' order: the same bits) and only their
words are set.  A group's op never escapes: a member checks before it arrives
that the meeting runs its op (else it takes the ring).  **A mismatch** fails at once:
every member that arrives compares its entry with those of the members there already
(an entry counts once its generation and ticket show, which its client writes last); the
first to see a difference claims the op slot's mismatch word (tagged with the round),
writes the two entries' shapes, counts and roots beside it, sets ``FAILED`` and every
arrived member's word to failed, and wakes them; each names both from there
(:func:`mismatch`), and one that arrives later finds the round failed.

**Failures** are otherwise the service's: it alone fails a round (``FAILED``, won by a
compare-and-swap against the completer's ``DONE``) and writes the errors, as it does for
ops of its rings.  A client dies: the service's socket sees it, and it fails every round
that is not over; a client that arrives while one is gone (``M_GONE``) asks it to look
again.  Nothing here blocks without a limit: waits take deadlines and return to Python
every ``CHECK_NS`` to let it look at the service's socket.

The functions are compiled (Numba, ``nogil``) and take the arrays of :func:`config`
(this process's addresses and the layout), the client's private state (tickets, the
completion words in use, its op in flight per op slot) and an op's record
(:func:`record`), so that a call costs a fraction of a microsecond of dispatch.
"""

from __future__ import annotations

import os

import numpy as np
from numba import njit

from ..kernels.raw import (
    DT_BF16,
    DT_F16,
    DT_F32,
    DT_F64,
    DT_I32,
    DT_I64,
    ITEMSIZE,
    average_raw,
    copy_raw,
    reduce3_raw,
    reduce_raw,
)
from ..native.intrinsics import (
    atomic_add_i32,
    atomic_add_i64,
    atomic_cas_i64,
    atomic_load_i32,
    atomic_load_i64,
    atomic_store_i64,
    cpu_relax,
    ld_i64,
    st_i64,
)
from ..native.libc import futex_wait, futex_wake, now_ns, yield_cpu
from . import arena as A

# ---------------------------------------------------------------- layout (arena.meeting_layout)
#: Generations of one name a client may have in flight here (more wait for the oldest).
DEPTH = A.MEET_DEPTH
#: Bytes of one slice of an op (the unit of work shared among the clients).
SLICE_BYTES = 256 << 10
MAX_CHANNELS = A.MEET_CHANNELS
LINE = 64
HEADER_BYTES = A.MEET_HEADER

# header (byte offsets): M_RAN and M_ESCAPED count the ops run here and handed over
M_GONE, M_RESCAN, M_QTAIL, M_QHEAD, M_RAN, M_ESCAPED, M_WHY = 0, 64, 128, 192, 256, 320, 1024
WHY_BYTES = 2048
# op slot (byte offsets)
O_STATE, O_WHY, O_CLAIM, O_SDONE, O_ENTRY = 0, 8, 64, 72, A.MEET_ENTRY
# entry (byte offsets)
E_GEN, E_TICKET, E_SHAPE, E_COUNT, E_IN, E_OUT, E_ROOT, E_PRIO = 0, 8, 16, 24, 32, 40, 48, 56

# state word
CMASK = 0xFFFF
RSHIFT = 16
RMASK = (1 << 40) - 1
FAILED, ESCAPED, DONE = 1 << 56, 1 << 57, 1 << 58
OVER = FAILED | ESCAPED | DONE
# work words: the round << 20 | a slice index or count
WSHIFT = 20
WMASK = (1 << 20) - 1

# the client's control block: the futex word it sleeps on (its low 32 bits)
C_FUTEX = A.C_FUTEX

# ---------------------------------------------------------------- the arrays
# config: this process's addresses and the layout
(CF_MEET, CF_ARENA, CF_L, CF_D, CF_C, CF_CHB, CF_OSB, CF_SLOTB, CF_DATA, CF_ME, CF_QCAP,
 CF_QOFF, CF_CH0, CF_SLICE, CF_PURE) = range(15)  # fmt: skip
CF_WORDS = 16
# the client's private state: the last ticket, how many times its compiled waits slept,
# the submission ring's positions taken (a descriptor's place; the control block's tail
# follows them in order), the repeats among the nodes submitted by a compiled call
# (:mod:`.ring_call`: the route), the late errors seen, a word that holds 1 (an eventfd's write),
# how many times a compiled submission woke the service, then what its compiled calls
# take from here rather than as arguments (each costs a call ~0.1 µs of dispatch): the
# control block's and the arena header's addresses, the service's eventfd, how long a
# wait polls before it yields the core (:func:`.ring_call.bind` sets them);
# then a word per completion word (1: in use), then the ticket of its op in flight per op
# slot (channel * DEPTH + slot), then the ops ended in compiled calls, by ticket % RING:
# (ticket, generation, what: an index the client keeps of the op's kind and name)
ST_TICKET, ST_SLEPT, ST_PLACED, ST_CALLS, ST_LATE, ST_ONE, ST_WOKE = 0, 1, 2, 3, 4, 5, 6
ST_CTL, ST_HDR, ST_EFD, ST_PURE = 7, 8, 9, 10
ST_INUSE = 64
ST_PEND = ST_INUSE + A.RING
ST_ENDED = ST_PEND + MAX_CHANNELS * DEPTH
ST_WORDS = ST_ENDED + 3 * A.RING
# an op's record: its channel (-1: not looked up yet), wire id, packed shape, count, root,
# then, for an op over a group of the node's clients: the group's slots (a bit each; 0:
# the world), the channel's key (the wire id mixed with the group's context) and the
# group's order (ORDER_WORDS words, all 0 where its ranks come in ascending order)
R_CH, R_WIRE, R_SHAPE, R_COUNT, R_ROOT, R_MASK, R_KEY, R_ORDER = range(8)
ORDER_WORDS = 3
R_WORDS = R_ORDER + ORDER_WORDS + 1
# a channel's first line: its key (the wire id of a name of the world), then for a
# group's channel its slots, wire id, member count, the slot of its rank 0 and its order
# (bytes)
K_MASK, K_WIRE, K_N, K_FIRST, K_ORDER = 8, 16, 24, 32, 40
#: Slots a group that meets here may name (its slots are the bits of one word).
GROUP_SLOTS = 63
#: Slots an order word holds (each slot plus one in 6 bits), and so the most members of a
#: group whose ranks do not come in ascending order that meets here (more take the ring).
ORDER_PER_WORD = 10
ORDER_SLOTS = ORDER_PER_WORD * ORDER_WORDS
# a mismatch found at a group's arrival: the claim (state line; the round << 24 | the
# two slots that disagree), their shape, count and root words (work line)
O_MIS, O_MISV = 16, 80
MIS_SHIFT = 24

# what meet_post and meet_now return (the low four bits; WAKE_SERVICE may be added)
P_WAIT, P_DONE, P_ESCAPED, P_BUSY, P_WEIRD, P_FULL, P_FAILED, P_PENDING = range(8)
P_MASK = 15
WAKE_SERVICE = 16
# what meet_wait returns
W_DONE, W_FAILED, W_TIMEOUT, W_CHECK = 1, 2, 3, 4
#: How long a compiled wait sleeps before it returns to Python (which looks at the socket).
CHECK_NS = 50_000_000
#: A deadline that never comes.
FOREVER = 1 << 62

# kinds, ops and flags the meeting runs (OpKind, ReduceOp, arena flags)
_AR, _BC, _BAR = 1, 2, 3
_OP_SUM, _OP_AVG, _OP_BXOR = 1, 2, 8
_F_AVG = A.F_AVG
_HASH = 0x9E3779B97F4A7C15 - (1 << 64)
_HEADER, _CONTROL = A.HEADER_BYTES, A.CONTROL_BYTES
_DONE_WORD, _RING, _C_SLEEPING = A.DONE_WORD, A.RING, A.C_SLEEPING


def pack_shape(kind: int, dtype: int, op: int, flags: int, algorithm: int) -> int:
    """An entry's shape word: what every client of an op must give alike."""
    return kind | dtype << 8 | op << 16 | flags << 24 | algorithm << 32


def unpack_shape(shape: int) -> tuple[int, int, int, int, int]:
    """(kind, dtype, op, flags, algorithm) of a shape word."""
    return shape & 0xFF, shape >> 8 & 0xFF, shape >> 16 & 0xFF, shape >> 24 & 0xFF, shape >> 32


def config(arena: A.Arena, me: int) -> np.ndarray:
    """The config array of slot ``me``'s client (``-1``: the service) of ``arena``, whose
    header says where its meeting region lies."""
    h = arena.header
    slots = int(h[A.H_SLOTS])
    c, chb, osb, _ = A.meeting_layout(slots)
    cf = np.zeros(CF_WORDS, np.int64)
    cf[CF_MEET] = arena.base + int(h[A.H_MEET])
    cf[CF_ARENA] = arena.base
    cf[CF_L], cf[CF_D], cf[CF_C] = slots, DEPTH, c
    cf[CF_CHB], cf[CF_OSB] = chb, osb
    cf[CF_SLOTB], cf[CF_DATA] = arena.slot_bytes, arena.data_bytes
    cf[CF_ME] = me
    cf[CF_QCAP] = c * DEPTH
    cf[CF_QOFF] = HEADER_BYTES
    cf[CF_CH0] = HEADER_BYTES + -(-c * DEPTH * 16 // 4096) * 4096
    cf[CF_SLICE] = SLICE_BYTES
    procs = slots  # (a service of several nodes: its job's processes on the host poll too)
    if int(h[A.H_MEET_ON]) == A.MEET_GROUPS:
        procs = max(slots, int(h[A.H_HOST_PROCS]))
    cf[CF_PURE] = pure_spin_ns(procs)
    return cf


#: How long a waiting client polls its word without yielding its core, where the node's
#: clients do not outnumber the cores.
PURE_SPIN_NS = 5_000


def pure_spin_ns(clients: int) -> int:
    """How long a waiting client polls before each look also yields its core: not at all
    where ``clients``, the processes that poll (the node's clients; on a service of
    several nodes, the job's services and clients on this host, ``H_HOST_PROCS``),
    outnumber this process's cores (the process it waits for may need this core: on 2
    cores, four processes that polled 1,000 times before yielding made a 4 KiB op take
    31-38 µs instead of 4, docs/daemon.md; two nodes of one client each on 2 cores took
    30 µs a blocking 4 KiB op against 15 without the 5 µs unyielding polls), else
    :data:`PURE_SPIN_NS` (a yield hands the core to any other process of the machine for
    as long as the scheduler likes: a waiter that yielded at every poll saw its op end
    16-32 µs late on the loaded 2-core machine; one that never yielded lost a whole time
    slice, 100-200 µs, whenever its peer shared its core)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    forced = os.environ.get("TOTALREDUCE_MEET_PURE_NS")
    if forced:
        return int(forced)
    return 0 if clients > cores else PURE_SPIN_NS


def state(tail: int, late: int = 0) -> np.ndarray:
    """A client's private state, its tickets and ring positions starting after ``tail``
    (the control block's), ``late`` late errors seen."""
    st = np.zeros(ST_WORDS, np.int64)
    st[ST_TICKET] = st[ST_PLACED] = tail
    st[ST_LATE] = late
    st[ST_ONE] = 1
    return st


def record(
    wire: int, shape: int, count: int, root: int, slots: tuple[int, ...] = (), context: int = 0
) -> np.ndarray:
    """An op's record (its channel is looked up at its first post); ``slots``: the node's
    clients of the op's group in group order (empty: the world's op; at most
    :data:`ORDER_SLOTS` where they do not ascend), ``context`` the group's (its ops meet in
    channels of their own: two groups may run ops of one name at once)."""
    r = np.zeros(R_WORDS, np.int64)
    r[R_CH], r[R_WIRE], r[R_SHAPE], r[R_COUNT], r[R_ROOT] = -1, wire, shape, count, root
    r[R_KEY] = wire
    if slots:
        r[R_MASK] = sum(1 << k for k in slots)
        key = (wire ^ (context * 0x9E3779B97F4A7C15)) & ((1 << 64) - 1)
        r[R_KEY] = (key - (1 << 64) if key >= 1 << 63 else key) or 1
        if any(a > b for a, b in zip(slots, slots[1:], strict=False)):
            if len(slots) > ORDER_SLOTS:
                raise ValueError(f"a group of {len(slots)} slots out of order cannot meet")
            for j, k in enumerate(slots):
                w, b = divmod(j, ORDER_PER_WORD)
                r[R_ORDER + w] |= (k + 1) << (6 * b)
    return r


# ---------------------------------------------------------------- addresses


@njit(nogil=True, cache=True)
def _ctl(cf, k):  # type: ignore[no-untyped-def]
    """Slot ``k``'s control block (its address in this process)."""
    return cf[CF_ARENA] + _HEADER + k * cf[CF_SLOTB]


@njit(nogil=True, cache=True)
def _opslot(cf, c, i):  # type: ignore[no-untyped-def]
    return cf[CF_MEET] + cf[CF_CH0] + c * cf[CF_CHB] + LINE + i * cf[CF_OSB]


@njit(nogil=True, cache=True)
def _entry(os, k):  # type: ignore[no-untyped-def]
    return os + O_ENTRY + k * LINE


# ---------------------------------------------------------------- tickets and waking


@njit(nogil=True, cache=True)
def take_ticket(st):  # type: ignore[no-untyped-def]
    """A new ticket whose completion word no op in flight holds (any thread); -1 if every
    word is in use.  Tickets only grow, so a word's old value never reads as a new op's."""
    base = st.ctypes.data
    for _ in range(_RING):
        t = atomic_add_i64(base + 8 * ST_TICKET, 1) + 1
        if atomic_cas_i64(base + 8 * (ST_INUSE + (t - 1) % _RING), 0, 1) == 0:
            return t
    return -1


@njit(nogil=True, cache=True)
def _release(st, ticket, idx):  # type: ignore[no-untyped-def]
    base = st.ctypes.data
    if idx >= 0:
        atomic_cas_i64(base + 8 * (ST_PEND + idx), ticket, 0)
    atomic_store_i64(base + 8 * (ST_INUSE + (ticket - 1) % _RING), 0)


@njit(nogil=True, cache=True)
def release(st, ticket, idx):  # type: ignore[no-untyped-def]
    """The op of ``ticket`` (in op slot ``idx``, -1: none) has ended and been seen: its
    completion word and its op slot are free for this client's next ops."""
    _release(st, ticket, idx)


@njit(nogil=True, cache=True)
def wake_client(ctl):  # type: ignore[no-untyped-def]
    """After setting a word of the client whose control block is at ``ctl``: wake its
    threads asleep on it, if any."""
    if atomic_load_i64(ctl + 8 * _C_SLEEPING) != 0:
        atomic_add_i32(ctl + 8 * C_FUTEX, 1)
        futex_wake(ctl + 8 * C_FUTEX, 1 << 30)


@njit(nogil=True, cache=True)
def futex_seq(ctl):  # type: ignore[no-untyped-def]
    """The futex word's value, read before the last look at what a sleeper waits for."""
    return atomic_load_i32(ctl + 8 * C_FUTEX)


@njit(nogil=True, cache=True)
def sleepers(ctl, delta):  # type: ignore[no-untyped-def]
    """Count a thread in (``delta`` 1) or out (-1) of those asleep on the futex word."""
    atomic_add_i64(ctl + 8 * _C_SLEEPING, delta)


@njit(nogil=True, cache=True)
def sleep(ctl, seq, timeout_ns):  # type: ignore[no-untyped-def]
    """Sleep on the futex word while it holds ``seq`` (at most ``timeout_ns``)."""
    futex_wait(ctl + 8 * C_FUTEX, seq, timeout_ns)


@njit(nogil=True, cache=True)
def _wake_all(cf, os, mask):  # type: ignore[no-untyped-def]
    """Wake every client of op slot ``os`` (of ``mask``) asleep (a large op: they help
    with slices)."""
    me = cf[CF_ME]
    for k in range(cf[CF_L]):
        if k != me and (mask == 0 or ((mask >> k) & 1) != 0):
            wake_client(_ctl(cf, k))


# ---------------------------------------------------------------- channels


@njit(nogil=True, cache=True)
def lookup(cf, wire):  # type: ignore[no-untyped-def]
    """The channel of ``wire`` (claimed now if no client has), or -1 if every channel holds
    another name.  Channels are only claimed, never given back within a session, so every
    client finds the same answer for a name."""
    if wire == 0:
        return -1
    n = cf[CF_C]
    h = ((wire * _HASH) >> 17) & (n - 1)
    base = cf[CF_MEET] + cf[CF_CH0]
    for _ in range(n):
        at = base + h * cf[CF_CHB]
        w = atomic_load_i64(at)
        if w == wire:
            return h
        if w == 0:
            old = atomic_cas_i64(at, 0, wire)
            if old == 0 or old == wire:
                return h
        h = (h + 1) & (n - 1)
    return -1


# ---------------------------------------------------------------- an op


@njit(nogil=True, cache=True)
def _opens(s, srf, rf, n):  # type: ignore[no-untyped-def]
    """Whether a client may open round ``rf`` of an op slot whose state is ``s`` (of round
    ``srf``) among ``n`` clients: the slot never used, or its previous round over (every
    client arrived, or it failed)."""
    if s == 0:
        return rf == 1
    return srf == rf - 1 and ((s & CMASK) == n or (s & FAILED) != 0)


@njit(nogil=True, cache=True)
def _in(mask, k):  # type: ignore[no-untyped-def]
    """Whether slot ``k`` is of the op's clients (``mask`` 0: the world's op, every slot)."""
    return mask == 0 or ((mask >> k) & 1) != 0


@njit(nogil=True, cache=True)
def _line(cf, c):  # type: ignore[no-untyped-def]
    return cf[CF_MEET] + cf[CF_CH0] + c * cf[CF_CHB]


@njit(nogil=True, cache=True)
def _members(cf, c):  # type: ignore[no-untyped-def]
    """(slots mask, how many, the slot of group rank 0, the address of the group's order
    words or 0 where its slots ascend) of channel ``c``'s clients."""
    at = _line(cf, c)
    mask = ld_i64(at + K_MASK)
    if mask == 0:
        return np.int64(0), cf[CF_L], np.int64(0), np.int64(0)
    order = at + K_ORDER if ld_i64(at + K_ORDER) != 0 else 0
    return mask, ld_i64(at + K_N), ld_i64(at + K_FIRST), np.int64(order)


@njit(nogil=True, cache=True)
def _channel(cf, rec):  # type: ignore[no-untyped-def]
    """Look up (or claim) the channel of ``rec``'s key; a group's channel's first line then
    says its clients (every one of them writes the same words).  -1: none free."""
    c = lookup(cf, rec[R_KEY])
    if c < 0:
        return c
    mask = rec[R_MASK]
    if mask != 0:
        n, first = 0, -1
        for k in range(GROUP_SLOTS):
            if (mask >> k) & 1:
                n += 1
                if first < 0:
                    first = k
        if rec[R_ORDER] != 0:
            first = (rec[R_ORDER] & 63) - 1
        at = _line(cf, c)
        st_i64(at + K_WIRE, rec[R_WIRE])
        st_i64(at + K_N, n)
        st_i64(at + K_FIRST, first)
        for w in range(ORDER_WORDS):
            st_i64(at + K_ORDER + 8 * w, rec[R_ORDER + w])
        atomic_store_i64(at + K_MASK, mask)
    rec[R_CH] = c
    return c


@njit(nogil=True, cache=True)
def channel(cf, rec):  # type: ignore[no-untyped-def]
    """The channel of the op of ``rec`` (looked up, or claimed, once), -1 if none is free."""
    c = rec[R_CH]
    if c >= 0:
        return c
    return _channel(cf, rec)


@njit(nogil=True, cache=True)
def _nth(mask, order, j):  # type: ignore[no-untyped-def]
    """The slot of the ``j``-th client of the op (its group rank ``j``; ``order``: the
    address of the group's order words, 0 where its slots ascend)."""
    if order != 0:
        return ((ld_i64(order + 8 * (j // ORDER_PER_WORD)) >> (6 * (j % ORDER_PER_WORD))) & 63) - 1
    if mask == 0:
        return j
    for k in range(GROUP_SLOTS):
        if (mask >> k) & 1:
            if j == 0:
                return k
            j -= 1
    return -1


@njit(nogil=True, cache=True)
def _fields(shape):  # type: ignore[no-untyped-def]
    """(kind, dtype, op, flags) of a shape word."""
    return shape & 0xFF, (shape >> 8) & 0xFF, (shape >> 16) & 0xFF, (shape >> 24) & 0xFF


@njit(nogil=True, cache=True)
def _dtype_ok(dt, op):  # type: ignore[no-untyped-def]
    if dt == DT_I32 or dt == DT_I64:
        return 1 <= op <= _OP_BXOR
    if dt == DT_F32 or dt == DT_F64 or dt == DT_F16 or dt == DT_BF16:
        return 1 <= op <= 5  # SUM, AVG, MAX, MIN, PRODUCT: no bitwise op on floats
    return False


def runs_here(kind: int, dtype: int, op: int, flags: int) -> bool:
    """Whether an op of a group of the node's clients of this shape meets here (the
    meeting hands no group's op to the service: one it cannot run takes the ring)."""
    if kind not in (_AR, _BC, _BAR) or flags & ~_F_AVG:
        return False
    return kind != _AR or bool(_dtype_ok(dtype, op))


@njit(nogil=True, cache=True)
def _runs_here(cf, os, gen):  # type: ignore[no-untyped-def]
    """Whether the ``L`` entries of op slot ``os`` (the world's op) are one op the meeting
    runs: the same generation and shape, a kind and element type of the raw kernels,
    every buffer in its client's part of the arena (else the service's Python says what
    is wrong)."""
    n_slots = cf[CF_L]
    e0 = _entry(os, 0)
    shape, count, root = ld_i64(e0 + E_SHAPE), ld_i64(e0 + E_COUNT), ld_i64(e0 + E_ROOT)
    for k in range(n_slots):
        e = _entry(os, k)
        if ld_i64(e + E_GEN) != gen or ld_i64(e + E_SHAPE) != shape:
            return False
        if ld_i64(e + E_COUNT) != count or ld_i64(e + E_ROOT) != root:
            return False
    kind, dt, op, flags = _fields(shape)
    if kind != _AR and kind != _BC and kind != _BAR:
        return False
    if not _dtype_ok(dt, op) or (flags & ~_F_AVG) != 0 or count < 0:
        return False
    if kind == _BAR:
        return True
    if kind == _BC and not (0 <= root < n_slots):
        return False
    data = cf[CF_DATA]
    span = count * ITEMSIZE[dt]
    if span > data:
        return False
    for k in range(n_slots):
        e = _entry(os, k)
        if not _in_part(cf, k, ld_i64(e + E_IN), ld_i64(e + E_OUT), span):
            return False
    return True


@njit(nogil=True, cache=True)
def _in_part(cf, k, a, b, span):  # type: ignore[no-untyped-def]
    """Whether buffers at arena offsets ``a`` and ``b`` of ``span`` bytes lie in slot
    ``k``'s part of the arena."""
    lo = _HEADER + k * cf[CF_SLOTB] + _CONTROL
    hi = lo + cf[CF_DATA] - span
    return lo <= a <= hi and lo <= b <= hi


@njit(nogil=True, cache=True)
def _group_ok(cf, rec, n, at_in, at_out):  # type: ignore[no-untyped-def]
    """Whether this client's op over a group of ``n`` may arrive here: a broadcast's root
    a rank of the group, its buffers in its part of the arena (a group's op never goes
    to the service from here: one that may not arrive takes the ring)."""
    kind, dt, _, _ = _fields(rec[R_SHAPE])
    count = rec[R_COUNT]
    if kind == _BAR:
        return True
    if count < 0 or (kind == _BC and not (0 <= rec[R_ROOT] < n)):
        return False
    span = count * ITEMSIZE[dt]
    return span <= cf[CF_DATA] and _in_part(cf, cf[CF_ME], at_in, at_out, span)


@njit(nogil=True, cache=True)
def _slices(shape, count, slice_bytes):  # type: ignore[no-untyped-def]
    kind, dt = shape & 0xFF, (shape >> 8) & 0xFF
    if kind == _BAR or count <= 0:
        return 1
    s = -(-(count * ITEMSIZE[dt]) // slice_bytes)
    return max(1, min(s, WMASK))


@njit(nogil=True, cache=True)
def _slice(cf, os, j, n_slices, mask, nm, first, order):  # type: ignore[no-untyped-def]
    """Slice ``j`` of the op in ``os`` among the ``nm`` clients of ``mask`` (group rank 0's
    slot: ``first``; ``order``: the group's order words, 0 where its slots ascend):
    reduced (or copied from the root) into group rank 0's output, in group order, divided
    for ``avg``, and copied into every output."""
    n_slots, arena = cf[CF_L], cf[CF_ARENA]
    e0 = _entry(os, first)
    shape, count = ld_i64(e0 + E_SHAPE), ld_i64(e0 + E_COUNT)
    kind, dt, op, flags = _fields(shape)
    if kind == _BAR:
        return
    per = -(-count // n_slices)
    lo = j * per
    hi = min(count, lo + per)
    if hi <= lo:
        return
    isz = ITEMSIZE[dt]
    n, at = hi - lo, lo * isz
    span = n * isz
    if kind == _AR:
        if op == _OP_AVG:
            op = _OP_SUM  # summed, then divided
        dst = arena + ld_i64(e0 + E_OUT) + at
        if nm == 1:
            copy_raw(dst, arena + ld_i64(e0 + E_IN) + at, span)
        elif order != 0:  # in group order, as the rings reduce it
            a = arena + ld_i64(e0 + E_IN) + at
            b = arena + ld_i64(_entry(os, _nth(mask, order, 1)) + E_IN) + at
            reduce3_raw(dt, op, dst, a, b, n)
            for g in range(2, nm):
                e = _entry(os, _nth(mask, order, g))
                reduce_raw(dt, op, dst, arena + ld_i64(e + E_IN) + at, n)
        else:
            second = first + 1
            while not _in(mask, second):
                second += 1
            a = arena + ld_i64(e0 + E_IN) + at
            b = arena + ld_i64(_entry(os, second) + E_IN) + at
            reduce3_raw(dt, op, dst, a, b, n)
            for k in range(second + 1, n_slots):
                if _in(mask, k):
                    reduce_raw(dt, op, dst, arena + ld_i64(_entry(os, k) + E_IN) + at, n)
        if flags & _F_AVG:
            average_raw(dt, dst, n, nm)
    else:  # a broadcast: the root's input into its output, then everyone's
        er = _entry(os, _nth(mask, order, ld_i64(e0 + E_ROOT)))
        dst = arena + ld_i64(er + E_OUT) + at
        copy_raw(dst, arena + ld_i64(er + E_IN) + at, span)
    for k in range(n_slots):
        if _in(mask, k):
            out = arena + ld_i64(_entry(os, k) + E_OUT) + at
            if out != dst:
                copy_raw(out, dst, span)


@njit(nogil=True, cache=True)
def _complete(cf, os, mask):  # type: ignore[no-untyped-def]
    """Every slice is done: ``DONE`` (unless the round failed first), every client's
    completion word, the sleepers woken."""
    while True:
        s = atomic_load_i64(os + O_STATE)
        if s & FAILED:
            return P_WAIT  # the service answers it
        if atomic_cas_i64(os + O_STATE, s, s | DONE) == s:
            break
    for k in range(cf[CF_L]):
        if _in(mask, k):
            t = ld_i64(_entry(os, k) + E_TICKET)
            atomic_store_i64(_ctl(cf, k) + 8 * (_DONE_WORD + (t - 1) % _RING), t)
    for k in range(cf[CF_L]):
        if _in(mask, k):
            wake_client(_ctl(cf, k))
    atomic_add_i64(cf[CF_MEET] + M_RAN, 1)
    return P_DONE


@njit(nogil=True, cache=True)
def _work(cf, os, rf, mask, nm, first, order):  # type: ignore[no-untyped-def]
    """Claim and run slices of round ``rf`` of ``os`` while any is left; P_DONE if this
    caller ran the last one (and so completed the op)."""
    e0 = _entry(os, first)
    n_slices = _slices(ld_i64(e0 + E_SHAPE), ld_i64(e0 + E_COUNT), cf[CF_SLICE])
    while True:
        if atomic_load_i64(os + O_STATE) & FAILED:
            return P_WAIT
        c = atomic_load_i64(os + O_CLAIM)
        if (c >> WSHIFT) != rf or (c & WMASK) >= n_slices:
            return P_WAIT
        if atomic_cas_i64(os + O_CLAIM, c, c + 1) != c:
            continue
        _slice(cf, os, c & WMASK, n_slices, mask, nm, first, order)
        v = atomic_add_i64(os + O_SDONE, 1)
        if (v & WMASK) + 1 == n_slices:
            return _complete(cf, os, mask)


@njit(nogil=True, cache=True)
def _escape(cf, c, i, os, rf):  # type: ignore[no-untyped-def]
    """Hand the round to the service (its Python takes the ``L`` entries as descriptors)."""
    while True:
        s = atomic_load_i64(os + O_STATE)
        if s & FAILED:
            return P_WAIT
        if atomic_cas_i64(os + O_STATE, s, s | ESCAPED) == s:
            break
    meet = cf[CF_MEET]
    atomic_add_i64(meet + M_ESCAPED, 1)
    pos = atomic_add_i64(meet + M_QTAIL, 1)
    q = meet + cf[CF_QOFF] + 16 * (pos % cf[CF_QCAP])
    st_i64(q + 8, (c * cf[CF_D] + i) << 24 | (rf & 0xFFFFFF))
    atomic_store_i64(q, pos + 1)
    return P_ESCAPED | WAKE_SERVICE


@njit(nogil=True, cache=True)
def _finish(cf, c, i, os, rf, gen, mask, nm, first, order):  # type: ignore[no-untyped-def]
    """The last client of round ``rf`` arrived (this caller): run the op, or (the world's
    op) escape it."""
    if mask == 0 and not _runs_here(cf, os, gen):
        return _escape(cf, c, i, os, rf)
    atomic_store_i64(os + O_SDONE, rf << WSHIFT)
    atomic_store_i64(os + O_CLAIM, rf << WSHIFT)
    e0 = _entry(os, first)
    if _slices(ld_i64(e0 + E_SHAPE), ld_i64(e0 + E_COUNT), cf[CF_SLICE]) > 1:
        _wake_all(cf, os, mask)  # the sleepers help
    return _work(cf, os, rf, mask, nm, first, order)


@njit(nogil=True, cache=True)
def _disagree(cf, os, gen, mask):  # type: ignore[no-untyped-def]
    """A client of the group whose entry of generation ``gen`` in ``os`` differs from this
    caller's in shape, count or root, or -1 (an entry counts once its generation and
    ticket are written, which its client writes last)."""
    me = cf[CF_ME]
    mine = _entry(os, me)
    shape, count, root = ld_i64(mine + E_SHAPE), ld_i64(mine + E_COUNT), ld_i64(mine + E_ROOT)
    for k in range(cf[CF_L]):
        if k == me or not _in(mask, k):
            continue
        e = _entry(os, k)
        if atomic_load_i64(e + E_TICKET) == 0 or atomic_load_i64(e + E_GEN) != gen:
            continue
        if ld_i64(e + E_SHAPE) != shape or ld_i64(e + E_COUNT) != count:
            return k
        if ld_i64(e + E_ROOT) != root:
            return k
    return -1


@njit(nogil=True, cache=True)
def _mismatch(cf, os, rf, gen, mask, k):  # type: ignore[no-untyped-def]
    """This caller's entry and client ``k``'s disagree: the first to see a mismatch in the
    round says which (``O_MIS``, their words), fails it and every arrived client's word,
    and wakes them; each names both from here (:func:`mismatch`)."""
    me = cf[CF_ME]
    a, b = min(me, k), max(me, k)
    while True:
        v = atomic_load_i64(os + O_MIS)
        if (v >> MIS_SHIFT) == rf:
            return P_WAIT  # another client saw it first: it fails the round
        if atomic_cas_i64(os + O_MIS, v, (rf << MIS_SHIFT) | (a << 12) | b) == v:
            break
    for j in range(2):
        e = _entry(os, a if j == 0 else b)
        st_i64(os + O_MISV + 24 * j, ld_i64(e + E_SHAPE))
        st_i64(os + O_MISV + 24 * j + 8, ld_i64(e + E_COUNT))
        st_i64(os + O_MISV + 24 * j + 16, ld_i64(e + E_ROOT))
    while True:
        s = atomic_load_i64(os + O_STATE)
        if s & OVER:
            break
        if atomic_cas_i64(os + O_STATE, s, s | FAILED) == s:
            break
    for j in range(cf[CF_L]):
        if _in(mask, j):
            e = _entry(os, j)
            t = atomic_load_i64(e + E_TICKET)
            if t != 0 and atomic_load_i64(e + E_GEN) == gen:
                ctl = _ctl(cf, j)
                fail_word(ctl, t)
                wake_client(ctl)
    return P_WAIT


@njit(nogil=True, cache=True)
def mismatch(cf, idx, rf, out):  # type: ignore[no-untyped-def]
    """Whether a mismatch failed round ``rf`` of op slot ``idx``: then ``out`` holds the
    two slots that disagree and each one's shape, count and root words."""
    os = _opslot(cf, idx // cf[CF_D], idx % cf[CF_D])
    v = atomic_load_i64(os + O_MIS)
    if (v >> MIS_SHIFT) != rf:
        return False
    out[0], out[1] = (v >> 12) & 0xFFF, v & 0xFFF
    for j in range(6):
        out[2 + j] = ld_i64(os + O_MISV + 8 * j)
    return True


@njit(nogil=True, cache=True)
def meet_post(cf, st, rec, gen, ticket, prio, at_in, at_out):  # type: ignore[no-untyped-def]
    """Arrive at generation ``gen`` of the op of ``rec`` with ``ticket`` (its completion
    word) and buffers at arena offsets ``at_in``, ``at_out``.  Returns P_WAIT (arrived;
    others will end it), P_DONE (arrived last and ended it), P_ESCAPED (arrived last;
    the service has it), P_FAILED (the round had failed: not arrived), or, having
    arrived nowhere: P_BUSY (this client's op of the previous round of its slot has not
    been seen to end), P_FULL (no channel), P_WEIRD (the slot's state makes no sense for
    this generation: a new process of an old slot; or a group's op that may not meet);
    plus WAKE_SERVICE when the service must be woken.  An op over a group whose entry
    disagrees with another client's fails the round at once (:func:`mismatch`)."""
    c = rec[R_CH]
    if c < 0:
        c = _channel(cf, rec)
        if c < 0:
            return P_FULL
    mask, nm, first, order = _members(cf, c)
    if mask != 0 and not _group_ok(cf, rec, nm, at_in, at_out):
        return P_WEIRD
    d = cf[CF_D]
    i = gen % d
    rf = gen // d + 1
    idx = c * d + i
    if st[ST_PEND + idx] != 0:
        return P_BUSY
    os = _opslot(cf, c, i)
    s = atomic_load_i64(os + O_STATE)
    srf = (s >> RSHIFT) & RMASK
    if srf == rf:
        if s & FAILED:
            return P_FAILED
        if s & OVER or (s & CMASK) >= nm:
            return P_WEIRD
    elif not _opens(s, srf, rf, nm):
        return P_WEIRD
    e = _entry(os, cf[CF_ME])
    st_i64(e + E_SHAPE, rec[R_SHAPE])
    st_i64(e + E_COUNT, rec[R_COUNT])
    st_i64(e + E_IN, at_in)
    st_i64(e + E_OUT, at_out)
    st_i64(e + E_ROOT, rec[R_ROOT])
    st_i64(e + E_PRIO, prio)
    atomic_store_i64(e + E_GEN, gen)  # (last: the entry is whole once they show)
    atomic_store_i64(e + E_TICKET, ticket)
    while True:
        s = atomic_load_i64(os + O_STATE)
        srf = (s >> RSHIFT) & RMASK
        if srf == rf:
            if s & FAILED:
                return P_FAILED
            if s & OVER or (s & CMASK) >= nm:
                return P_WEIRD
            new = s + 1
        elif _opens(s, srf, rf, nm):
            new = (rf << RSHIFT) | 1
        else:
            return P_WEIRD
        if atomic_cas_i64(os + O_STATE, s, new) == s:
            break
    st[ST_PEND + idx] = ticket
    code = P_WAIT
    meet = cf[CF_MEET]
    if atomic_load_i64(meet + M_GONE) != 0:  # (after arriving: the service's scan or this)
        atomic_store_i64(meet + M_RESCAN, 1)
        code = WAKE_SERVICE
    if mask != 0:
        k = _disagree(cf, os, gen, mask)
        if k >= 0:
            return code | _mismatch(cf, os, rf, gen, mask, k)
    if (new & CMASK) == nm:
        return code | _finish(cf, c, i, os, rf, gen, mask, nm, first, order)
    return code


@njit(nogil=True, cache=True)
def meet_wait(cf, st, ticket, idx, rf, deadline_ns, spin_ns, check_ns):  # type: ignore[no-untyped-def]
    """Wait for the op of ``ticket`` in op slot ``idx``, round ``rf``, helping with its
    slices: W_DONE, W_FAILED (its word says it failed: the error ring, or a mismatch of
    the op slot, has why), W_TIMEOUT (``deadline_ns`` of :func:`now` passed), W_CHECK
    (``check_ns`` passed: Python looks at the socket, and calls again).  Spins
    ``spin_ns`` (yielding the core after the first polls), then sleeps on the futex word."""
    me = cf[CF_ME]
    ctl = _ctl(cf, me)
    word = ctl + 8 * (_DONE_WORD + (ticket - 1) % _RING)
    c = idx // cf[CF_D]
    os = _opslot(cf, c, idx % cf[CF_D])
    mask, nm, first, order = _members(cf, c)
    t0 = now_ns()
    while True:
        w = atomic_load_i64(word)
        if w == ticket:
            return W_DONE
        if w == -ticket:
            return W_FAILED
        s = atomic_load_i64(os + O_STATE)
        if ((s >> RSHIFT) & RMASK) == rf and (s & CMASK) == nm and (s & OVER) == 0:
            cl = atomic_load_i64(os + O_CLAIM)
            if (cl >> WSHIFT) == rf:
                e0 = _entry(os, first)
                if (cl & WMASK) < _slices(ld_i64(e0 + E_SHAPE), ld_i64(e0 + E_COUNT), cf[CF_SLICE]):
                    _work(cf, os, rf, mask, nm, first, order)
                    continue
        t = now_ns()
        if t >= deadline_ns:
            return W_TIMEOUT
        if t - t0 >= check_ns:
            return W_CHECK
        if t - t0 < spin_ns:
            if t - t0 < cf[CF_PURE]:
                cpu_relax()
            else:
                yield_cpu()
            continue
        seq = futex_seq(ctl)
        sleepers(ctl, 1)
        w = atomic_load_i64(word)
        if w != ticket and w != -ticket:
            left = min(deadline_ns - t, check_ns - (t - t0))
            atomic_add_i64(st.ctypes.data + 8 * ST_SLEPT, 1)
            sleep(ctl, np.int64(seq), max(left, 1000))
        sleepers(ctl, -1)


@njit(nogil=True, cache=True)
def meet_now(cf, st, rec, gen, ticket, prio, at, spin_ns, budget_ns):  # type: ignore[no-untyped-def]
    """A blocking op in place at ``at``: arrive and wait, in one call.  P_DONE (ended well,
    its ticket and op slot given back), or what :func:`meet_post` returns that is not
    P_WAIT, or P_PENDING (on its way after ``budget_ns``, or the word says it failed:
    Python waits the usual way)."""
    code = meet_post(cf, st, rec, gen, ticket, prio, at, at)
    kind = code & P_MASK
    d = cf[CF_D]
    idx = rec[R_CH] * d + gen % d
    if kind == P_DONE:
        _release(st, ticket, idx)
        return code
    if code != P_WAIT:
        return code
    t = now_ns()
    w = meet_wait(cf, st, ticket, idx, gen // d + 1, t + budget_ns, spin_ns, budget_ns)
    if w == W_DONE:
        _release(st, ticket, idx)
        return P_DONE
    return P_PENDING


@njit(nogil=True, cache=True)
def now():  # type: ignore[no-untyped-def]
    """The clock of the deadlines (ns)."""
    return now_ns()


# ---------------------------------------------------------------- the service's side


@njit(nogil=True, cache=True)
def fail_round(cf, c, i, why_code):  # type: ignore[no-untyped-def]
    """The service fails op slot (``c``, ``i``)'s round if it is not over: its state
    word with ``FAILED``, or -1 if it was over (or never used)."""
    os = _opslot(cf, c, i)
    while True:
        s = atomic_load_i64(os + O_STATE)
        if s == 0 or s & OVER:
            return -1
        st_i64(os + O_WHY, why_code)
        if atomic_cas_i64(os + O_STATE, s, s | FAILED) == s:
            return s


@njit(nogil=True, cache=True)
def fail_word(ctl, ticket):  # type: ignore[no-untyped-def]
    """Set the completion word of op ``ticket`` of the client at ``ctl`` to failed, unless
    it holds that op's end already or a later op's ticket."""
    word = ctl + 8 * (_DONE_WORD + (ticket - 1) % _RING)
    while True:
        v = atomic_load_i64(word)
        if v == ticket or v == -ticket or abs(v) > ticket:
            return
        if atomic_cas_i64(word, v, -ticket) == v:
            return


@njit(nogil=True, cache=True)
def queue_take(cf, head):  # type: ignore[no-untyped-def]
    """The escape queue's entry ``head`` (its payload), or -1 if not written yet."""
    meet = cf[CF_MEET]
    if head >= atomic_load_i64(meet + M_QTAIL):
        return -1
    q = meet + cf[CF_QOFF] + 16 * (head % cf[CF_QCAP])
    if atomic_load_i64(q) != head + 1:
        return -1
    return ld_i64(q + 8)


def prepare() -> None:
    """Compile the meeting's functions (or load them from Numba's cache)."""
    arena = A.Arena.create(2, 1 << 16)
    try:
        arena.header[A.H_MEET_ON] = 1
        cf = config(arena, 0)
        st = state(0)
        rec = record(12345, pack_shape(_BAR, DT_I64, _OP_SUM, 0, 0), 0, 0)
        t = int(take_ticket(st))
        meet_post(cf, st, rec, 0, t, 0, -1, -1)
        meet_wait(cf, st, t, int(rec[R_CH]) * DEPTH, 1, now(), 0, 0)
        release(st, t, int(rec[R_CH]) * DEPTH)
        t = int(take_ticket(st))
        meet_now(cf, st, rec, 1, t, 0, -1, 0, 0)
        grec = record(54321, pack_shape(_AR, DT_I64, _OP_SUM, 0, 0), 1, 0, (1, 0), 7)
        channel(cf, grec)
        mismatch(cf, int(grec[R_CH]) * DEPTH, 1, np.zeros(8, np.int64))
        t = int(take_ticket(st))
        at = _HEADER + _CONTROL
        meet_now(cf, st, grec, 0, t, 0, at, 0, 0)
        fail_round(cf, int(rec[R_CH]), 1, 0)
        fail_word(arena.base + arena.slot_start(1), 3)
        queue_take(cf, 0)
        ctl = arena.base + arena.slot_start(0)
        wake_client(ctl)
        sleepers(ctl, 1)
        sleepers(ctl, -1)
        futex_seq(ctl)
        sleep(ctl, -1, 0)
    finally:
        arena.close()
