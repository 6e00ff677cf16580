"""The protocol, declared once: what travels between ranks and what lies in shared arrays.

Every number two sides must agree on lives here and nowhere else
(``tests/test_protocol.py`` fails if one is written in another module):

- the transport's tags (the compiled lane's messages, its bodies);
- the message header and the frame header: their ``struct`` formats, the byte offset of
  every field (compiled code reads and writes frames at these offsets), the magic and
  version of the lane's messages;
- the frame types and the frame flags;
- the error codes an ``ERROR`` frame or a daemon client's error entry carries, with the
  error class and the words of each; the reasons a message is refused (``MF_*``), with
  their words;
- the compiled lane's words and records: the control words of ``mem`` (``C_*``), the op
  table (``O_*``), hash marks (``H_*``), per-op segment state (``D_*``, ``SS_*``,
  ``SB_*``, ``RS_*``), pool slot and announcement records, per-peer words (``P_*``),
  events (``EV_*``), body requests (``BR_*``), plan records in ``prog`` (``PL_*``,
  ``G_*``, ``L_*``) and the schedule codes compiled code acts on.

Python modules take what they need from here (``lane*.py`` star-import the words, which
Numba folds into constants; ``control.py`` reads control frames with these formats), and
``docs/architecture.md``'s tables of frame types and header fields are checked against
this module by ``tests/test_protocol.py``.

Message header (``MSG_SIZE`` = 24 bytes, little-endian)::

    magic u32 | version u8 | reserved u8 | frame count u16 | sender i32 |
    reserved u32 (0) | credit returned u64

Frame header (``FRAME_SIZE`` = 72 bytes)::

    type u8 | dtype u8 | kind u8 | algorithm u8 | reduce op u8 | flags u8 | reserved u16 |
    aux u32 | step u32 | segment u32 | priority i32 (as u32) |
    wire id u64 | generation u64 | byte count u64 | element count u64 | param i64 |
    context u64
"""

from __future__ import annotations

import enum

# -- tags on the transport's communicator ----------------------------------------------
CLOSE_TAG = 2  # a transport's last message to each peer (transport/mpi.py)
LANE_TAG = 3  # the compiled lane's messages
BODY_TAG_BASE = 16  # the lane's bodies, on tags of their own from here
LANE_BODY_SPAN = (1 << 20) - BODY_TAG_BASE  # the lane's body tags rotate through these per
#                                           peer: an MPI_TAG_UB of 2^20 - 1 holds them

# -- the message header ------------------------------------------------------------------
MSG_FORMAT = "<IBBHiIQ"
MSG_SIZE = 24
MH_MAGIC = 0  # u32
MH_VERSION = 4  # u8
MH_NFRAMES = 6  # u16
MH_SENDER = 8  # i32
MH_RESERVED = 12  # u32: reserved, 0
MH_CREDIT = 16  # u64: credit returned (pool slots)

# -- the frame header --------------------------------------------------------------------
FRAME_FORMAT = "<BBBBBBHIIIIQQQQqQ"
FRAME_SIZE = 72
FH_TYPE = 0  # u8
FH_DTYPE = 1  # u8
FH_KIND = 2  # u8
FH_ALGO = 3  # u8
FH_ROP = 4  # u8
FH_FLAGS = 5  # u8
FH_AUX = 8  # u32
FH_STEP = 12  # u32
FH_SEGMENT = 16  # u32
FH_PRIO = 20  # u32
FH_WID = 24  # u64
FH_GEN = 32  # u64
FH_NBYTES = 40  # u64
FH_COUNT = 48  # u64
FH_PARAM = 56  # i64
FH_CONTEXT = 64  # u64
# The same fields' positions in a frame unpacked with FRAME_FORMAT (a tuple of 17).
F_TYPE, F_DTYPE, F_KIND, F_ALGO, F_OP, F_FLAGS = 0, 1, 2, 3, 4, 5
F_AUX, F_STEP, F_SEGMENT, F_PRIO = 7, 8, 9, 10
F_WID, F_GEN, F_NBYTES, F_COUNT, F_PARAM, F_CONTEXT = 11, 12, 13, 14, 15, 16

# -- magic and version -----------------------------------------------------------------------
LANE_MAGIC = 0x4C445254  # b"TRDL": the compiled lane's messages
LANE_VERSION = 5  # 2: frame types numbered as the interpreted loop's (CTS 3, ASK 13);
#                   3: NEED; 4: the control frames (ERROR, PROBE, HAVE, BYE, GONE, JOIN);
#                   5: body tags from BODY_TAG_BASE (the interpreted loop's tags are gone)


# -- frame types ---------------------------------------------------------------------------
class FrameType(enum.IntEnum):
    """What a frame is.  The control frames, ERROR to JOIN, are handed up to Python.  (4,
    the interpreted loop's REJECT, is retired: a frame of type 4 is refused.)"""

    DATA = 1  # an eager body follows the header (padded to 8 bytes)
    RTS = 2  # "I hold frames of this op for you, and no credit", answered by READY
    CTS = 3  # clear to send: the receive is posted, on the tag in ``aux``
    READY = 5  # the op is submitted here: send (again, or without credit)
    NEED = 6  # the sender waits for this op: raise it (kept if the op is not submitted here,
    #           which then starts raised; the lane keeps it within floating_pool_bytes)
    ERROR = 7  # the op failed: the body is the UTF-8 message, ``param`` its ErrorCode
    PROBE = 8  # who has submitted this stalled op?
    HAVE = 9  # I have
    BYE = 10  # the sender's service stopped
    GONE = 11  # daemon mode: a node's client rank ``aux`` died
    JOIN = 12  # daemon mode: a new process has client rank ``aux`` (step 1: session ended)
    ASK = 13  # this large segment is ready here and I have no clear: answered by CTS


DATA = int(FrameType.DATA)
RTS = int(FrameType.RTS)
CTS = int(FrameType.CTS)
READY = int(FrameType.READY)
NEED = int(FrameType.NEED)
ERROR = int(FrameType.ERROR)
PROBE = int(FrameType.PROBE)
HAVE = int(FrameType.HAVE)
BYE = int(FrameType.BYE)
GONE = int(FrameType.GONE)
JOIN = int(FrameType.JOIN)
ASK = int(FrameType.ASK)
#: The control frames: the lane hands each one up to Python (``EV_CONTROL``), whose
#: handlers act on it.
CONTROL_FRAME_TYPES = frozenset({ERROR, PROBE, HAVE, BYE, GONE, JOIN})
#: The frame types the lane takes; anything else is refused (``MF_TYPE``).
LANE_FRAME_TYPES = frozenset({DATA, RTS, CTS, READY, NEED, ASK}) | CONTROL_FRAME_TYPES
#: The longest body a control frame may carry (an ERROR's UTF-8 text, a PROBE's note of
#: its op by the loop's owner, ``engine/stalls.py``; the others carry none); a longer one
#: is malformed (``MF_CONTROL``).
MAX_CONTROL_BODY = 4096
#: The most control frames one lane message may carry (a sender starts a new message
#: after this many); a message with more is a flood (``MF_FLOOD``).  The receiver keeps
#: what Python has not taken yet in a fixed buffer that holds two such messages
#: (``CONTROL_EVENTS`` frames, ``CONTROL_BODY_BYTES`` of bodies) and, when it is full,
#: leaves the rest of a message in the landing buffer until Python has taken them.
CONTROL_PER_MESSAGE = 256
CONTROL_EVENTS = 2 * CONTROL_PER_MESSAGE
CONTROL_BODY_BYTES = 2 * CONTROL_PER_MESSAGE * MAX_CONTROL_BODY

# -- frame flags ---------------------------------------------------------------------------
FLAG_NEED = 1  # someone on the sender waits for this op
FLAG_CREDIT = 2  # the frame spent a slot of the receiver's credit

#: Largest body a frame may announce; anything above is malformed.
MAX_BODY_BYTES = 1 << 34


# -- error codes -----------------------------------------------------------------------------
class ErrorCode(enum.IntEnum):
    """What an op's failure was, as an ERROR frame (its ``param``) or a daemon client's error
    entry carries it; each becomes the same error class on every rank that hears it."""

    FAILED = 1  # OpFailedError: a peer died or stopped, an abort, an MPI error
    MISMATCH = 2  # OpMismatchError: ranks disagree about the op
    INVALID = 3  # InvalidArgumentError: an argument the service refused
    TRANSPORT = 4  # TransportError: the transport failed
    FRAME = 5  # FrameError: a peer sent what the protocol refuses
    TIMEOUT = 6  # OpTimeoutError: stalled past stall_shutdown_s


#: The error class (by name, in totalreduce.errors) of each code.
ERROR_CLASSES = {
    ErrorCode.FAILED: "OpFailedError",
    ErrorCode.MISMATCH: "OpMismatchError",
    ErrorCode.FRAME: "FrameError",
    ErrorCode.TIMEOUT: "OpTimeoutError",
    ErrorCode.INVALID: "InvalidArgumentError",
    ErrorCode.TRANSPORT: "TransportError",
}

# Why the lane refused a message (its EV_MALFORMED event's ``a``), with the words of the
# FrameError that names the peer.
MF_SHORT = 1
MF_MAGIC = 2
MF_SENDER = 3
MF_TRUNCATED = 4
MF_TYPE = 5
MF_BODY = 6
MF_CREDIT = 7
MF_LONG = 8
MF_TAG = 9
MF_OVERCREDIT = 10
MF_CONTROL = 11
MF_FLOOD = 12
MALFORMED_TEXTS = {
    MF_SHORT: "shorter than its header",
    MF_MAGIC: "bad magic or protocol version",
    MF_SENDER: "names another sender",
    MF_TRUNCATED: "truncated frame",
    MF_TYPE: "unknown frame type",
    MF_BODY: "eager body over micro_bytes",
    MF_CREDIT: (
        "a credited frame beyond the credit this rank granted it (do all ranks use the same "
        "floating_pool_bytes and micro_bytes?)"
    ),
    MF_LONG: "longer than any message a peer may send",
    MF_TAG: "a clear naming a tag outside the lane's body tags",
    MF_OVERCREDIT: "credit returned beyond what this rank spent",
    MF_CONTROL: "a control frame with a body it may not carry (over 4096 bytes, or any on a "
    "frame type that carries none)",
    MF_FLOOD: "more control frames in one message than a sender may put there (256)",
}


# ============================================================================================
# The compiled lane's words and records.
#
# The lane keeps all of its state in preallocated arrays that Python and compiled code
# share: ``mem`` (int64: the control words, the op table, the key hash tables, the per-op
# segment state, the pool's slot records, the announcement records, the per-peer words,
# the event and completion queues and a work stack), ``prog`` (int64: compiled plans and
# groups, appended by Python when a new shape first runs), ``arena`` (uint8: send buffers,
# the landing buffer, event frames) and the pool's slots (an array of its own).  Every
# record is a fixed number of int64 words at an offset kept in ``mem``'s control words
# (``C_*``), so compiled code indexes them without Python objects.
# ============================================================================================

# -- control words: mem[C_*] -------------------------------------------------------
C_RANK = 0
C_WORLD = 1
C_NOPS = 2  # op table capacity
C_HCAP = 3  # hash capacity (power of two)
C_NSLOTS = 4
C_SLOT = 5  # bytes per pool slot
C_OUTCAP = 6  # bytes per outbox / send buffer / landing buffer
C_NSB = 7  # send buffers
C_CREDIT = 8  # slots each peer may fill here (and we there)
C_MICRO = 9
C_TAG = 10
C_SEQ = 11
C_OPS = 12  # offsets of the tables in mem
C_HASH = 13
C_FHASH = 14
C_DYN = 15
C_META = 16
C_FREESLOT = 17
C_NFREE = 18
C_FREEOP = 19
C_NFREEOP = 20
C_PEERS = 21
C_EVQ = 22
C_NEV = 23
C_EVCAP = 24
C_DONEQ = 25
C_NDONE = 26
C_STK = 27
C_STKCAP = 28
C_SBSTATE = 29
C_FAILQ = 30
C_FAILCAP = 31
C_FAILHEAD = 32
C_A_SLOTS = 33  # offsets in the arena
C_A_OUT = 34  # (unused: outboxes are written in send buffers)
C_A_SB = 35
C_A_REQ = 36
C_A_LAND = 37
C_A_STATUS = 38
C_A_MSG = 39
C_A_EVB = 40
C_INFLIGHT = 41  # ops in the table
C_FLOATING = 42  # slots holding frames of ops not submitted here
C_PEAK = 43  # most slots held at once
C_SEGCAP = 44
C_FULL = 45  # 1: a frame waits in the landing buffer for a free slot; 2: for room among the
#              control events (Python takes them, the pass goes on: nothing to grow)
C_LANDLEN = 46
C_LANDSRC = 47
C_LANDPOS = 48
C_SENT_MSGS = 49
C_SENT_FRAMES = 50
C_RECV_MSGS = 51
# (words 52 and 53: unused since every message goes through the lane)
C_NSBBUSY = 54
C_OPS_DONE = 55
C_RQ = 56  # answers owed (op slot, its submission number, peer, what: RQ_*), sent as room allows
C_RQCAP = 57
C_NRQ = 58
C_KICK = 59  # Python wants the comm thread back: lane_drive returns at its next check
C_BTAG = 60  # first tag of the bodies of large segments (-1: the lane runs no large ops)
C_BSPAN = 61  # body tags rotate through this many values per peer
C_BREQ = 62  # the body request table (entries of BR_N words; handles in the arena)
C_NBREQ = 63  # body requests posted
C_BREQCAP = 64
C_BREQH = 65  # mem offset of the body requests' handles (an MPI_Request array in mem's words)
C_ORPHANS = 66  # body requests of failed ops still posted (their buffers must live)
C_BODYCAP = 67  # body sends in flight to one peer at most (later ones wait, by priority)
C_DEFER = 68  # room for ready sends a pass puts off (a peer at C_BODYCAP)
C_BODIES_SENT = 69
C_BODIES_RECV = 70
C_BFULL = 71  # 1: a body waits for a free request: Python grows the table (Lane.grow)
C_PQ = 72  # large receives waiting for a free request (op slot, its submission, segment)
C_NPQ = 73
C_PQCAP = 74
C_PROGRESS = 75  # passes of lane_drive that moved something (a waiter tells silence from work)
C_BIDX = 77  # mem offset of MPI_Testsome's indices (C ints) for the body requests
C_BST = 78  # and of its statuses
C_ORPHAN_NS = 76  # an orphan receive is cancelled once this long an orphan (nothing will come)
C_AQ = 80  # empty messages owed on body tags (peer, tag): clears held by an op that failed
C_NAQ = 81
C_AQCAP = 82
C_WATCH = 83  # the op slot a waiting thread's lane_drive waits for (-1: none), and
C_WATCHSEQ = 84  # its submission: a pass stops receiving once that op ended, the last
C_CTLSKIP = 85  # quiet passes since the last test of the send buffers (see lane_pass)
C_SBNEXT = 86  # where the search for a free send buffer starts (see lane_tables._free_sb)
C_NAP_NS = 87  # Config.nap_s: a waiter's sleep between polls on a large op (0: it yields)
C_NAP_WORD = 88  # always 0: the word those sleeps wait on (a futex with a timeout)
C_MOVED_NS = 89  # now_ns() of the last pass of lane_drive that moved something
# Outer words (Lane.watch_outer): a waiter that asks (lane_drive's DRIVE_OUTER) returns
# OUTER as soon as the sum of C_OUTER_N int64 words, C_OUTER_STRIDE bytes apart from the
# address C_OUTER_AT, differs from the word at address C_OUTER_SEEN, or the word at
# address C_OUTER_FLAG is not 0 (a node service's arena thread: a client submitted, or
# another thread handed it work).  C_OUTER_N 0: none.
C_OUTER_AT = 90
C_OUTER_STRIDE = 91
C_OUTER_N = 92
C_OUTER_SEEN = 93
C_OUTER_FLAG = 94
# The pool's slots live in an array of their own (Lane.pool) at this address, so that
# growing the pool never moves the arena (whose send buffers MPI may still read).
C_POOL = 95
# Announcements (RTS) and NEED frames of ops not submitted here: records of A_N words, at
# most C_ANNCAP, taken from a free stack (C_ANNFREE, C_NANNFREE) or past the high-water
# mark C_ANNTOP.
C_ANN = 96
C_ANNCAP = 97
C_ANNFREE = 98
C_NANNFREE = 99
C_ANNTOP = 100
C_ANNS = 101  # announcements kept now
C_ANNDROPS = 102  # announcements not kept (the table was full): their peers get READY
C_FLOATBYTES = 103  # bytes held for ops not submitted here: slots and announcements
C_FLOATPEAK = 104  # the most of those held at once
C_PASSIVE = 105  # standing receives among the ops in the table (a window's: they may wait
#                  for ever, and keep no thread polling)
C_KTAB = 106  # mem offset of the kernel table: K_KINDS rows of K_TYPES C addresses (0: none
#               yet: Python fills a type's kernels when a plan of that type is first made)
C_NEED_NS = 107  # Config.need_after_s: a waiter that waited this long sends NEED to the ranks
#                  its op still expects frames from
C_NEEDS_KEPT = 108  # NEED frames kept for ops not submitted here (records, as announcements)
C_NEEDS_USED = 109  # ops that started raised because a peer's NEED (frame or flag) waited here
C_CTLB = 110  # arena offset of the control frames' bodies (Python takes them with the events)
C_CTLBLEN = 111  # bytes of it used
C_NCTL = 112  # control events queued (at most CONTROL_EVENTS)
C_LANDCTL = 113  # control frames read so far in the landed message (at most CONTROL_PER_MESSAGE)
C_LEN = 114

# -- the op table: mem[ops + slot * O_N + O_*] ---------------------------------------
O_STATE = 0
O_WID = 1
O_GEN = 2
O_DT = 3
O_KIND = 4
O_ALGO = 5
O_ROP = 6
O_COUNT = 7
O_PARAM = 8
O_CTX = 9
O_PRIO = 10
O_PLAN = 11
O_GROUP = 12
O_GSIZE = 13
O_IN = 14
O_OUT = 15
O_WORK = 16
O_SLEFT = 17
O_RLEFT = 18
O_SEQ = 19
O_ME = 20
O_ERR = 21
O_URGENT = 22
O_NREQ = 23  # body requests of the op posted and not complete
O_SCR = 24  # address of the op's scratch: where large receive segments land
O_PASSIVE = 25  # 1: a standing receive (OpSpec.passive)
O_WAITED = 26  # 0: no thread here waited for the op yet; > 0: when the first began (ns);
#               -1: its NEED frames are sent (C_NEED_NS after that)
O_N = 27

# op states
S_FREE = 0
S_ACTIVE = 2
S_DONE = 4
S_FAILED = 5

# -- hash tables: mem[hash + i * 3 + {0: wire id, 1: generation, 2: value}] ---------
H_EMPTY = -1
H_TOMB = -2
# (-3: unused since the lane runs every op)
H_FAILED = -4  # an op that failed here: its late frames are dropped
H_DONE = -5  # an op finished here: a frame for it means the ranks disagree (EV_LATE)

# -- per-op segment state: mem[dyn + slot * D_N * SEGCAP + D_* * SEGCAP + i] --------
D_SW = 0  # waits left, per send segment
D_SS = 1  # state, per send segment (SS_* in the low 3 bits, SB_* bits above)
D_RW = 2  # waits left, per receive segment
D_RS = 3  # state, per receive segment
D_RSLOT = 4  # pool slot holding a body that came before its turn; a large one's tag
D_STAG = 5  # a large send segment's tag, from the receiver's CTS
D_N = 6
# send segment states
SS_WAIT = 0
SS_HELD = 1  # ready, no credit: announced, waits for READY
SS_SENT = 2
SS_ASKED = 3  # a large segment, ready, no clear yet: ASK sent, waits for CTS
SS_BODY = 4  # a large segment's body is on the wire (MPI_Isend from the op's buffer)
SB_READY = 8  # the peer said READY for the op: no credit needed
SB_ANNOUNCED = 16  # the op's frames were announced (RTS) to the peer
SB_CLEARED = 32  # a large segment's CTS came: its tag is in D_STAG
# receive segment states
RS_WAIT = 0
RS_STAGED = 1
RS_DONE = 2
RS_POSTED = 3  # a large segment's receive is posted into the op's scratch

# -- pool slot records: mem[meta + slot * M_N + M_*] ---------------------------------
M_NEXT = 0
M_SOURCE = 1
M_TYPE = 2  # 1: a DATA frame (header and body), 2: an announcement (header only)
M_CREDITED = 3
M_N = 4

# -- announcement records: mem[ann + r * A_N + A_*] -----------------------------------
A_NEXT = 0  # the next record of its key's chain (a slot, ANN_BASE + a record, or -1)
A_SOURCE = 1
A_TYPE = 2  # RTS (the peer holds the op's frames: answered READY) or NEED (a thread waits)
A_FLAGS = 3  # the frame's flags (FLAG_NEED: the op starts raised here)
A_N = 4
#: Chains of floating frames mix pool slots (their numbers) and announcement records
#: (ANN_BASE + their number) under one key of the floating hash.
ANN_BASE = 1 << 40
#: What one kept announcement is charged against the pool: a frame header.
ANN_CHARGE = 72

# -- peers: mem[peers + peer * P_N + P_*] --------------------------------------------
P_CREDIT = 0  # slots we may still fill at the peer
P_OWED = 1  # slots freed here that the peer has not been told of
P_OUTLEN = 2  # bytes in the outbox (0: empty; else header and frames)
P_NFRAMES = 3
P_NEXTTAG = 4  # the next body tag (an offset from C_BTAG) for a receive from the peer
P_BODIES = 5  # body sends to the peer in flight
P_OUTSB = 6  # the send buffer its outbox is written in (-1: none yet)
P_HELD = 7  # credited frames of the peer floating here (with P_OWED: within C_CREDIT)
P_ANN = 8  # announcements of the peer kept here
P_BAD = 9  # 1: the peer sent garbage (or Python marked it bad): its messages are dropped
P_ANNDROP = 10  # 1: an announcement of the peer was not kept: each op started here that
#                 receives from it answers READY at once (the peer may hold its frames)
P_MARK = 11  # scratch: the op submission that last looked at the peer (lane_submit)
P_OUTCTL = 12  # control frames in the outbox (a new message after CONTROL_PER_MESSAGE)
P_N = 13

# -- what an answer owed is (mem[rq + i * 4 + 3]): the CTS of large receive segment q >= 0,
RQ_READY = -1  # or READY (the peer announced frames of the op),
RQ_NEED = -2  # or NEED (a thread here waits for the op, and expects frames from the peer)

# -- events: mem[evq + i * E_N + E_*] ------------------------------------------------
E_TYPE = 0
E_SLOT = 1
E_SOURCE = 2
E_A = 3
E_B = 4
E_N = 6
EV_MISMATCH = 1  # frame's shape differs from the op's (frame in the event bytes)
EV_UNEXPECTED = 2  # no receive segment of the op takes the frame
# (3: unused since the lane runs every op)
EV_MALFORMED = 4  # a message that does not parse (a = what)
EV_MPI = 5  # an MPI call failed (a = -code, b = peer)
EV_FULL = 6  # no free pool slot: grow the arena
EV_SIZE = 7  # a frame's byte count differs from its segment's (a = theirs, b = ours)
EV_KERNEL = 8  # a kernel refused a dtype or op (a bug)
EV_LOST = 9  # the pass's work stack overflowed (a bug)
EV_LATE = 10  # a frame for an op finished here (frame in the event bytes)
EV_CONTROL = 11  # a control frame (in the event bytes; its body: a = offset in C_CTLB, b = bytes)

# -- body requests: mem[breq + i * BR_N + BR_*] (dense; swap-remove) -----------------
BR_SLOT = 0  # the op's slot (-1: its op failed, the request is an orphan)
BR_WHAT = 1  # send segment i (>= 0) or receive segment q (-q - 1)
BR_PEER = 2
BR_CANCEL = 3  # 1: an orphan receive already cancelled (or a send it never is); 2: came empty
BR_T = 4  # when its op failed (ns; an orphan receive waits C_ORPHAN_NS for its sender)
BR_N = 5

# -- plan records in prog --------------------------------------------------------------
PL_NS = 0
PL_NR = 1
PL_NPRO = 2
PL_NEPI = 3
PL_SENDS = 4
PL_RECVS = 5
PL_LOCS = 6
PL_ISZ = 7
PL_SCR = 8  # bytes of scratch an op of the plan needs (its large receive segments)
PL_NLARGE = 9  # large receive segments (posted when the op starts)
PL_N = 10
# segment rows
G_STEP = 0
G_SEG = 1
G_PEER = 2  # group rank
G_BUF = 3
G_OFF = 4  # bytes
G_NBYTES = 5
G_ACTION = 6
G_NWAIT = 7
G_SUCC = 8  # offset of its successors in prog
G_NSUCC = 9
G_SBUF = 10  # a receive's base: dst = base (op) body (-1: dst itself)
G_SOFF = 11
G_SCR = 12  # a large receive segment's offset in the op's scratch (-1: eager; SCR_DIRECT)
G_W = 13  # an ACCUMULATE receive's weight (the bits of a float64)
G_N = 14
SCR_DIRECT = -2  # a large copy: received straight into its place, posted when its waits end
# local op rows
L_KIND = 0
L_DBUF = 1
L_DOFF = 2
L_SBUF = 3
L_SOFF = 4
L_NBYTES = 5
L_DIV = 6
L_W = 7  # a SCALE or ACCUMULATE's weight (the bits of a float64)
L_N = 8

# -- the kernel table: mem[ktab + K_* * K_TYPES + dtype code] (kernels/raw_calls.py) -----
K_REDUCE = 0  # (dst, src, n, op): dst (op)= src
K_REDUCE3 = 1  # (dst, a, b, n, op): dst = a (op) b (the native sums in one pass)
K_AVERAGE = 2  # (dst, n, divisor): dst /= divisor
K_SCALE = 3  # (dst, src, n, weight): dst = weight * src
K_ACCUMULATE = 4  # (dst, src, n, weight): dst += weight * src
K_KINDS = 5
K_TYPES = 11  # DType codes 1..10

# Schedule codes, repeated (algorithms.schedule.Action / LocalKind).
ACT_COPY = 1
ACT_REDUCE = 2
ACT_ACCUMULATE = 3
LK_COPY = 1
LK_SCALE = 2
LK_AVERAGE = 3
LK_ACCUMULATE = 4

# ============================================================================================
# The binding record: how the compiled lane reaches the MPI library (transport/mpi_native.py
# fills it from the library mpi4py loaded, or from the in-process world's C layer).
# ============================================================================================

#: Function addresses.
B_ISEND = 0
B_IRECV = 1
B_TEST = 2
B_TESTALL = 3
B_TESTSOME = 4
B_IPROBE = 5
B_IMPROBE = 6
B_MRECV = 7
B_CANCEL = 8
B_REQUEST_FREE = 9
B_GET_COUNT = 10
B_TEST_CANCELLED = 11
#: The ABI: bytes per handle (4: MPICH's int handles, 8: Open MPI's pointers).
B_HANDLE_BYTES = 16
#: Handle values, sign-extended from the ABI's width.
B_BYTE = 17
B_COMM = 18
B_REQUEST_NULL = 19
B_MESSAGE_NULL = 20
#: ``MPI_Status``: its size and the byte offsets of its public fields.
B_STATUS_BYTES = 21
B_STATUS_SOURCE = 22
B_STATUS_TAG = 23
B_STATUS_ERROR = 24
#: Constants of the library.
B_ANY_SOURCE = 25
B_ANY_TAG = 26
B_UNDEFINED = 27
B_RANK = 28
B_SIZE = 29
#: Which library the functions are: ``KIND_MPI`` (the MPI library mpi4py loaded) or
#: ``KIND_LOCAL`` (:mod:`.local_native`: ranks that are threads of this process).
B_KIND = 30
B_LEN = 32

KIND_MPI = 0
KIND_LOCAL = 1

# ============================================================================================
# The daemon's arena (transport/arena.py): a node's shared memory between its service and
# its thin clients.  A header page, then per client slot a control block (the descriptor
# ring, completion words, the error ring) and its data; after the slots the meeting place.
# transport/arena.py reads these under their names without the AR_ prefix.
# ============================================================================================

AR_MAGIC = 0x7472_6172_656E_6102  # "tr arena", version 2 (the meeting place after the slots)

# ---------------------------------------------------------------- the header page (int64 words)
AR_H_MAGIC, AR_H_SLOTS, AR_H_SLOT_BYTES, AR_H_CONTROL_BYTES, AR_H_SERVICE_SLEEPING = 0, 1, 2, 3, 8
#: the meeting place's arena offset, and whether the clients meet there (the service says):
#: 0 not, AR_MEET_WORLD the world's ops and groups' (a service of one node), AR_MEET_GROUPS
#: only the ops of groups of the node's clients (a service of several nodes)
AR_H_MEET, AR_H_MEET_ON = 9, 10
AR_MEET_WORLD, AR_MEET_GROUPS = 1, 2
#: repeats among the nodes the service's compiled loop entered into the services' lane
#: (from their descriptors), and of those the ones it ran to their completion words (the
#: others ended in Python: their nodes were late); counts (:mod:`totalreduce.daemon.service_loop`)
AR_H_LOOP_ENTERED, AR_H_LOOP_RAN = 11, 12
#: the processes of the service's job on its host that wait by polling: its nodes' services
#: there and their clients (0: not said, a service of one node's tests), what a client's
#: wait weighs against the cores before it polls without yielding
#: (:func:`totalreduce.transport.meeting.pure_spin_ns`)
AR_H_HOST_PROCS = 13
#: ops over a group whose members all live on this node that the service's compiled pass
#: ran from their descriptors to their completion words (:mod:`totalreduce.daemon.arena_pass`)
AR_H_PASS_GROUP = 14
AR_HEADER_BYTES = 4096

# ---------------------------------------------------------------- a slot's control block
#: Ops a client may have in flight (ring entries and completion words).
AR_RING = 4096
#: int64 words per descriptor.
AR_D_WORDS = 16
# descriptor fields
(AR_D_TICKET, AR_D_KIND, AR_D_WIRE, AR_D_GEN, AR_D_DTYPE, AR_D_COUNT, AR_D_OP, AR_D_ROOT,
 AR_D_PRIO, AR_D_IN, AR_D_OUT, AR_D_FLAGS, AR_D_GROUP, AR_D_CTX, AR_D_AUX,
 AR_D_ALGO) = range(16)  # fmt: skip
# AR_D_GROUP: offset of [n, ranks...] (int64) of the op's group; AR_D_CTX its context (0: the world,
# AR_D_GROUP unread); AR_D_AUX: offset of [n, parts...], elements per group rank (reduce-scatter,
# all-gather), else -1; AR_D_ALGO: the algorithm among the services (an AlgorithmCode, 0: auto)
#: AR_D_FLAGS bits (AR_F_PASSIVE: a window's standing receive, which may wait for ever)
AR_F_AVG, AR_F_UNNAMED, AR_F_PASSIVE = 1, 2, 4
# control words (AR_C_SLEEPING: how many of the client's threads sleep on the futex word
# AR_C_FUTEX: whoever sets one of its words wakes them, :func:`.meeting.wake_client`)
AR_C_TAIL, AR_C_HEAD, AR_C_SLEEPING, AR_C_ERR_TAIL = 0, 1, 2, 3
#: late errors the service posted (an op that completed here failed elsewhere): the k-th is
#: in the error ring under ticket -k, its text "<the op's ticket>\x1e<why>"
AR_C_LATE = 4
#: the futex word a client's sleeping threads wait on (:func:`.meeting.wake_client` bumps it)
AR_C_FUTEX = 5
AR_RING_WORD = 16
AR_DONE_WORD = AR_RING_WORD + AR_RING * AR_D_WORDS
AR_ERRORS = 64
AR_ERROR_BYTES = 1024
AR_ERROR_WORD = AR_DONE_WORD + AR_RING
#: the control block's bytes, rounded up to a MiB
AR_CONTROL_BYTES = -(-(AR_ERROR_WORD + AR_ERRORS * AR_ERROR_BYTES // 8) * 8 // (1 << 20)) << 20
#: error kinds in an error entry
AR_E_FAILED, AR_E_MISMATCH, AR_E_INVALID, AR_E_TRANSPORT = (
    int(ErrorCode.FAILED),
    int(ErrorCode.MISMATCH),
    int(ErrorCode.INVALID),
    int(ErrorCode.TRANSPORT),
)

# ---------------------------------------------------------------------------------------------
# Fault-tolerant mode (daemon/ft.py, daemon/ft_quorum.py, transport/ft_frames.py).
# A member's messages on ft{n}.sock: u32 header length, u64 payload length, JSON, payload.
FT_VERSION = 2
FT_MAX_HEADER = 1 << 16
FT_MAX_PAYLOAD = 1 << 40
#: A round's table: one row of int64 words per node, summed among the services.  A row is a
#: header (node 0's clock in ms, members busy in a request, node 0's --first-quorum), then
#: FT_MAX_MEMBERS slots of FT_FIELDS words: token, committed step, asks, min_replica_size,
#: quorum timeout (ms), the quorum voted on, the vote, the replica id's length, flags
#: (FT_F_*), the replica id's bytes.
FT_MAX_MEMBERS = 16
FT_RID_BYTES = 64
FT_CLOCK, FT_ACTIVE, FT_FIRST = 0, 1, 2
FT_HEADER = 3
FT_TOKEN, FT_STEP, FT_ASK, FT_MIN, FT_TIMEOUT_MS, FT_VOTE_Q, FT_VOTE_OK, FT_RID_LEN, FT_FLAGS = (
    range(9)
)
FT_FIELDS = 9 + FT_RID_BYTES // 8
#: Flags of a member's slot: its ask came with its vote (its step is the one before the vote,
#: plus one if the voted quorum commits); its service dropped it this round for silence
#: (no message, heartbeats included, within its timeout: hung or stopped); it left cleanly
#: (a bye) this round, having taken no part in the current quorum's step (no op, no vote).
FT_F_NEXT, FT_F_HUNG, FT_F_LEFT = 1, 2, 4
FT_ROW = FT_HEADER + FT_MAX_MEMBERS * FT_FIELDS
#: A member's token: its node above this bit, the node's count of its hellos below.
FT_TOKEN_NODE_SHIFT = 32
