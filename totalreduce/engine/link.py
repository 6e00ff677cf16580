"""One peer's link in the main loop: its outgoing messages, the credits both ways, body tags.

The main loop (:mod:`.sending`, :mod:`.receiving`, :mod:`.peers`) keeps one :class:`Link`
per world rank.  Frames for a peer are packed into the message being built (the
*outbox*); a full outbox goes to the *backlog*, and a message leaves only within the
peer's control credit (``ctl_credit``: bytes of messages the peer has room for).  Eager
bodies also need eager credit (``eager_credit``: bytes of the peer's floating pool this
rank may fill).  Credit the peer's messages used here is *owed* back and travels in the
header of the next message the other way.  Sends that found no credit wait in
``blocked`` until credit comes.  Large bodies travel on their own tags, one per body, in
a cycle per peer (``next_tag``).  Flow control as a whole: ``docs/architecture.md``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .wire import MSG_SIZE

#: A send waiting for credit: the send heap's entry, pushed back when credit comes.
Blocked = tuple[Any, ...]


class Link:
    """This rank's side of the main loop's messaging with one peer (module docstring)."""

    __slots__ = (
        "msg_cap", "window", "eager_share", "out", "out_frames", "backlog", "ctl_credit",
        "queued", "eager_credit", "owe_ctl", "owe_eager", "next_tag", "blocked",
    )  # fmt: skip

    def __init__(self, msg_cap: int, window: int, eager_share: int) -> None:
        self.msg_cap = msg_cap  # largest message
        self.window = window  # control credit a peer grants at first
        self.eager_share = eager_share  # eager credit a peer grants at first
        self.backlog: deque[tuple[bytearray, int]] = deque()  # (message, frames in it)
        self.blocked: list[Blocked] = []
        self.reset()

    def reset(self) -> None:
        """Back to the state of a new link."""
        self.out: bytearray | None = None  # the message being built
        self.out_frames = 0
        self.backlog.clear()
        self.ctl_credit = self.window
        self.queued = 0  # bytes in the outbox and the backlog, not sent yet
        self.eager_credit = self.eager_share
        self.owe_ctl = 0
        self.owe_eager = 0
        self.next_tag = 0
        self.blocked.clear()

    # ------------------------------------------------------------------ sending

    def room(self, nbytes: int) -> bool:
        """Would ``nbytes`` more of frames fit in the control credit, after what waits?"""
        return self.ctl_credit - self.queued >= nbytes

    def outbox(self, need: int) -> bytearray:
        """The message to append ``need`` bytes of frames to (a new one when full)."""
        ob = self.out
        if ob is None:
            ob = bytearray(MSG_SIZE)
        elif len(ob) + need > self.msg_cap:
            self.backlog.append((ob, self.out_frames))
            self.out_frames = 0
            ob = bytearray(MSG_SIZE)
        self.out = ob
        self.queued += need
        return ob

    def close(self) -> None:
        """The message being built goes to the backlog, to leave when credit allows."""
        if self.out is not None:
            self.backlog.append((self.out, self.out_frames))
            self.out = None
            self.out_frames = 0

    def next_message(self) -> tuple[bytearray, int] | None:
        """The oldest waiting message if the peer has room for it, else None."""
        backlog = self.backlog
        if backlog and self.ctl_credit >= len(backlog[0][0]):
            return backlog.popleft()
        return None

    def charge(self, nbytes: int, nframes: int) -> None:
        """A message of ``nbytes`` (``nframes`` frames; 0: credit alone) is on its way."""
        if nframes:
            self.ctl_credit -= nbytes
            self.queued -= nbytes - MSG_SIZE

    # ------------------------------------------------------------------ credit

    def owe(self, ctl: int, eager: int) -> None:
        """The peer's messages used this much of our room: give it back."""
        self.owe_ctl += ctl
        self.owe_eager += eager

    def take_owed(self) -> tuple[int, int]:
        """The credit owed, for the header of the message leaving now (then none is)."""
        owed = (self.owe_ctl, self.owe_eager)
        self.owe_ctl = self.owe_eager = 0
        return owed

    def owes(self, half_ctl: int, half_eager: int, waiting: bool) -> bool:
        """Should owed credit travel alone now?  When a lot is owed, or when messages of
        ours wait for credit: the peer may be waiting for it to send what returns ours."""
        if not (self.owe_ctl or self.owe_eager):
            return False
        return waiting or self.owe_ctl >= half_ctl or self.owe_eager >= half_eager

    def credit(self, ctl: int, eager: int) -> list[Blocked]:
        """Credit came back: the sends that waited for it, to try again."""
        self.ctl_credit += ctl
        self.eager_credit += eager
        blocked, self.blocked = self.blocked, []
        return blocked

    # ------------------------------------------------------------------ bodies

    def body_tag(self) -> int:
        """The tag (an offset from the body tags' base) the next body takes."""
        return self.next_tag

    def tag_used(self, span: int) -> None:
        """The tag from :meth:`body_tag` went to a body: the next one comes after it."""
        self.next_tag = (self.next_tag + 1) % span
