"""Ranks on different nodes that give one op's name and generation over different groups.

Among the services an op of a group is named by the client's wire id mixed with the
group's context (:meth:`~.thin_nodes.AmongNodes._engine_name`), so nodes that disagree
on the group run ops of different keys, which never meet. The engine's stall inspector
finds them: a service's op that waits probes its group every second
(:meth:`~..engine.stalls.StallInspector.watch`), each PROBE with this node's note of it
(:meth:`NodeClashes._probe_note`: the client's wire id, generation, group context and
the group's ranks, none for the world's; a repeat of the compiled loop that waits is
Python's, adopted with its generation, well before its first probe); a service that
never had the probed op looks (:meth:`NodeClashes._node_clash`, on the arena thread) for
ranks of its node that are members of the prober's group and gave that name and
generation another group: an op among the services that Python started here, an op
Python has (waiting for the node's other members, or completed), one the compiled pass
completed (``arena_pass.DONES``), or a round at the meeting. Then it fails its own side
as a mismatch (a side that completed: its clients raise at their next call) and aborts
the prober's op, so every rank involved raises an ``OpMismatchError`` naming each rank's
group.

:class:`NodeClashes` is a base of :class:`~.thin.ThinService`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import protocol as P
from ..transport import arena as A
from ..transport import meeting as M
from . import arena_pass
from .thin_ops import _CLIENT_TERMS, _GOLDEN, _MASK, _Segments

log = logging.getLogger("totalreduce.daemon")

_W = 8  # bytes per word
#: Seconds between a stalled op's probes among the services (the look's period).
PROBE_EVERY_S = 1.0
#: A note's kinds: a stalled op asks; an op failed as a clash, where the receiver never ran
#: it (it counts the generation of that name).
_ASK, _SKIP = 0, 1
#: A note's kind's flag: its ranks are a bitmap (:func:`_note`).
_BITS = 1 << 8
#: The most ranks a note lists a word each, and the most (a bit each) a note can name
#: (a PROBE's body holds at most ``protocol.MAX_CONTROL_BODY`` bytes).
_LISTED = P.MAX_CONTROL_BODY // _W - 4
_MOST_RANKS = (P.MAX_CONTROL_BODY - 4 * _W) * 8
#: The inverse of ``_GOLDEN`` modulo 2^64 (a name among the services back to its context).
_INVERSE = pow(_GOLDEN, -1, 1 << 64)


class NodeClashes:
    """Finds ranks of different nodes that disagree on an op's group (a base of
    :class:`~.thin.ThinService`; see the module docstring)."""

    engine: Any
    node: int
    nodes: int
    slots: int
    size: int
    _groups: dict[tuple[int, int, int], Any]
    _fast: Any
    _pending: dict[tuple[int, int], list[Any]]
    _running: dict[tuple[int, int, int], Any]
    _fast_running: dict[int, list[Any]]
    _collected: Any
    _meet_on: bool
    _meet_chans: np.ndarray
    _on_arena_thread: Any
    _pass_done: Any
    _fail: Any
    _late: Any
    _fail_clash: Any
    _meet_wire: Any
    _meet_there: Any
    _meet_group_ranks: Any

    def _init_clashes(self) -> None:
        #: the probes already answered as a clash: (wire, generation, context)
        self._clashed: set[tuple[int, int, int]] = set()
        stalls = getattr(getattr(self.engine, "loop", None), "stalls", None)
        if stalls is not None:  # (an engine without a stall inspector: nothing to watch)
            stalls.watch(self._probe_note, self._stray_probe, PROBE_EVERY_S)

    def _in_flight(self) -> list[tuple[tuple[int, int, int], Any]]:
        """The ops among the services in flight that Python started (any thread): each
        client's key (wire id, generation, group context) and its handle there."""
        got = [(op.key, op.handle) for op in list(self._running.values())]
        fast = self._fast
        for item in list(self._fast_running.values()):
            e, h = item[0], item[1]
            ctx = int(fast.descs[e, 0][A.D_CTX])
            got.append(((int(fast.keys[e, 0]), int(fast.keys[e, 1]), ctx), h))
        return got

    def _ranks_of(self, ctx: int) -> tuple[int, ...] | None:
        """The ranks of the clients' group of context ``ctx`` (the world's for 0), if this
        node knows it."""
        if not ctx:
            return tuple(range(self.size))
        for g in list(self._groups.values()):
            if (g.ctx & _MASK) == (ctx & _MASK):
                return tuple(g.ranks)
        got = None
        groups = self._fast.groups
        for i in range(1, arena_pass.GROUPS):
            if groups[i, arena_pass.G_USED] and (int(groups[i, arena_pass.G_CTX]) & _MASK) == (
                ctx & _MASK
            ):
                at = arena_pass.G_HEAD + 2 * self.slots
                got = tuple(int(r) for r in groups[i, at : at + groups[i, arena_pass.G_SIZE]])
                break
        return got

    # ------------------------------------------------------------------ the comm thread

    def _probe_note(self, spec: Any) -> bytes:
        """What a PROBE of the services' op ``spec`` says of it: the client's wire id,
        generation and group context, and the group's ranks (empty: not a client's op)."""
        name, gen = spec.name, spec.key[1]
        key = next(
            (k for k, h in self._in_flight()
             if h is not None and _names(h)[0] == name and h.generation == gen),
            None,
        )  # fmt: skip
        if key is None:  # (no client's op: the services' own, such as a session's)
            return b""
        wire, cgen, ctx = key
        ranks = self._ranks_of(ctx) if ctx else ()  # (none: the world's)
        if ranks is None:
            return b""
        return _note(wire, cgen, ctx, _ASK, ranks)

    def _stray_probe(self, source: int, key: tuple[int, int], body: bytes) -> None:
        """Service ``source`` probes op ``key`` this one never had (comm thread): the arena
        thread looks for this node's side of it."""
        if len(body) % 8 or len(body) < 32:
            return
        w = np.frombuffer(body, dtype=np.int64)
        wire, gen, ctx, what = int(w[0]), int(w[1]), int(w[2]), int(w[3])
        if what == _SKIP:  # the op failed as a clash, where this node never ran it
            self._on_arena_thread(lambda: self._skip_clash(key, wire, gen, ctx), False)
            return
        ranks = _note_ranks(body, what) if ctx else tuple(range(self.size))
        what &= ~_BITS
        if what != _ASK or not ranks or any(not 0 <= r < self.size for r in ranks):
            return
        self._on_arena_thread(lambda: self._node_clash(source, key, wire, gen, ctx, ranks), False)

    # ------------------------------------------------------------------ the arena thread

    def _node_clash(
        self, source: int, key: tuple[int, int], wire: int, gen: int, ctx: int,
        ranks: tuple[int, ...],
    ) -> None:  # fmt: skip
        """Node ``source``'s op ``key`` (the clients' ``wire``, ``gen``, group of context
        ``ctx`` and ``ranks``) waits: fail both sides if ranks of this node in that group
        gave the name and generation another group."""
        mark = (wire, gen, ctx & _MASK)
        if mark in self._clashed:
            return
        base = self.node * self.slots
        theirs = set(ranks)
        said: list[tuple[int, str]] = []
        ops: list[Any] = []
        others: set[int] = set()  # the contexts found
        pending = [o for o in self._pending.get((wire, gen), ()) if not o.over]
        done = self._collected.get((wire, gen)) or self._pass_done(wire, gen)
        for o in pending + ([done] if done is not None and done not in pending else []):
            if (o.key[2] & _MASK) == (ctx & _MASK):
                continue
            here = [base + k for k, x in enumerate(o.descs) if x is not None]
            if not theirs.intersection(here):
                continue
            ops.append(o)
            others.add(o.key[2] & _MASK)
            said += [(r, _group_words(o.grp.ranks, o.key[2])) for r in here]
        rounds = []
        if self._meet_on:
            i = gen % M.DEPTH
            for c in np.nonzero(self._meet_chans[:, 0].copy())[0].tolist():
                if self._meet_wire(c) != wire:
                    continue
                there = self._meet_there(c, i, gen)
                if not theirs.intersection(base + k for k in there):
                    continue
                rounds.append((c, i, there))
                mask = int(self._meet_chans[c, M.K_MASK // _W])
                said += [(base + k, _group_words(self._meet_group_ranks(c), mask)) for k in there]
        running = []  # ops among the services the pass started here, of no Python record
        for k2, h in self._in_flight():
            c2 = k2[2] & _MASK
            if k2[:2] != (wire, gen) or c2 in others or c2 == (ctx & _MASK) or h is None:
                continue
            g2 = self._ranks_of(k2[2])
            if g2 is None:
                continue
            here = [r for r in g2 if r // self.slots == self.node]
            if theirs.intersection(here):
                running.append(h)
                others.add(c2)
                said += [(r, _group_words(g2, k2[2])) for r in here]
        if not said:
            return
        self._clashed.add(mark)
        if len(self._clashed) > 4096:
            self._clashed.clear()
        said += [(r, _group_words(ranks, ctx)) for r in ranks if r // self.slots == source]
        why = "the ranks disagree on the group: " + "; ".join(
            f"rank {r}: {g}" for r, g in sorted(set(said))
        )
        log.info("node %d: generation %d of #%016x: %s", self.node, gen, wire & _MASK, why)
        self._fail_clash(ops, why, [(c, i, gen, there) for c, i, there in rounds])
        # this node's ops among the services: the prober's node never ran them, and counts
        # their generations too (else its next op of that name would meet another one)
        mine = [o.handle for o in ops if o.handle is not None and not o.handle.done()]
        for h in mine:
            self._tell_skip(source, h, wire, gen)
        for h in running:  # (its end answers its clients: thin_fast.py)
            if h.done():
                continue
            self._tell_skip(source, h, wire, gen)
            if isinstance(h, _Segments):
                h.abort(_CLIENT_TERMS + why, True)
            else:
                self.engine.abort(h.name, h.generation, _CLIENT_TERMS + why, True)
        self._abort_theirs(key, wire, gen, ctx, _CLIENT_TERMS + why)

    def _tell_skip(self, dest: int, h: Any, wire: int, gen: int) -> None:
        """Tell service ``dest`` that this node's op among the services of handle ``h``
        (the clients' ``wire`` and ``gen``) failed as a clash, so that it counts the
        generation of that name it never ran."""
        eng = self.engine
        name = _names(h)[0]
        key = (eng._wire_id(name), h.generation)
        ctx = self._ctx_of(name, wire)
        if ctx is not None:
            eng.loop.send_probe(dest, key, _note(wire, gen, ctx, _SKIP, ()))

    def _ctx_of(self, name: Any, wire: int) -> int | None:
        """The clients' group context whose ops among the services of ``wire`` are named
        ``name`` (:meth:`~.thin_nodes.AmongNodes._engine_name`), if one is."""
        if name == wire:
            return 0
        c = ((int(name) ^ wire) & _MASK) * _INVERSE & _MASK
        return A.signed(c) if c and self._name_for(wire, c) == name else None

    @staticmethod
    def _name_for(wire: int, ctx: int) -> int:
        """The name among the services of the clients' ``wire`` over context ``ctx``."""
        return wire if not ctx else A.signed((wire ^ ((ctx & _MASK) * _GOLDEN)) & _MASK)

    def _abort_theirs(self, key: tuple[int, int], wire: int, gen: int, ctx: int, why: str) -> None:
        """Fail op ``key`` among the services (the clients' ``wire``, ``gen`` over context
        ``ctx``) that this node never ran: by taking that generation of its name here,
        so this node counts it as the others do (else its next op of that name would
        meet another one), or, where this node's count differs, by the key alone."""
        eng = self.engine
        name = self._name_for(wire, ctx)
        if (eng._wire_id(name) & _MASK) == (key[0] & _MASK) and (
            eng._names.next_generation(name) == key[1]
        ):
            eng.abort_next(name, why, True)
        else:
            eng.loop.request_abort(key, f"#{wire & _MASK:016x}", why, True)

    def _skip_clash(self, key: tuple[int, int], wire: int, gen: int, ctx: int) -> None:
        """Another node's op ``key`` among the services failed as a clash, and this node
        never ran it: count its generation here too (:meth:`_abort_theirs`)."""
        lane = self.engine.loop.lane
        if lane is not None and key in lane.by_key:
            return  # (it runs here: it failed here as everywhere)
        why = (
            f"{_CLIENT_TERMS}generation {gen} of this name failed as the ranks disagree on its "
            "group (another node's ranks gave it over another group)"
        )
        self._abort_theirs(key, wire, gen, ctx, why)


def _group_words(ranks: Any, ctx: int) -> str:
    """A rank's group in an error text (the world's op: no group)."""
    return f"group {list(ranks)}" if ctx else f"group {list(ranks)} (the world)"


def _names(h: Any) -> tuple[Any, ...]:
    """The names among the services of an op's handle there (a segmented op's: all, its
    own first)."""
    names = getattr(h, "names", None)
    return tuple(names) if names else (h.name,)


def _note(wire: int, gen: int, ctx: int, what: int, ranks: tuple[int, ...]) -> bytes:
    """A PROBE's note: the clients' wire id, generation and group context, its kind, and
    the group's ranks (none for the world's, or for a verdict): a word each, or, for a
    group of more than ``_LISTED`` ranks, one bit each (kind ``| _BITS``; their order is
    then lost, which only the error's text shows), up to ``_MOST_RANKS`` ranks."""
    head = [A.signed(wire & _MASK), gen, A.signed(ctx & _MASK), what]
    if len(ranks) <= _LISTED:
        return np.array(head + list(ranks), dtype=np.int64).tobytes()
    if max(ranks) >= _MOST_RANKS:
        return b""  # (no note: such a clash waits, and the stall warning names the op)
    bits = np.zeros(-(-(max(ranks) + 1) // 64) * 64, dtype=np.uint8)
    bits[list(ranks)] = 1
    head[3] |= _BITS
    return np.array(head, dtype=np.int64).tobytes() + np.packbits(bits).tobytes()


def _note_ranks(body: bytes, what: int) -> tuple[int, ...]:
    """The group's ranks in a note (:func:`_note`)."""
    if what & _BITS:
        bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8, offset=32))
        return tuple(int(r) for r in np.flatnonzero(bits))
    return tuple(int(r) for r in np.frombuffer(body, dtype=np.int64, offset=32))
