"""Phase 1's wait for the acknowledgements of its decreases (:meth:`coordinator.loop.Coordinator._send_phase1`).

Every decrease plan puts one waiter in its session's ``waiters`` (plan seq -> waiter); the waiter is
resolved once, by the plan's ``CapAck`` (:meth:`coordinator.loop.Coordinator.on_ack`) or with None
(its stream closed, coordinator/server.py ``AgentSession.close``; the plan forgotten after
``SENT_MEMORY_S``), through the two methods of an asyncio future those callers use (``done()``,
``set_result()``). :class:`AckWait` counts the waiters of one interval still open and resolves its
one future, :attr:`AckWait.all_done`, when none is left: phase 1 awaits that future alone.

Why not one asyncio future per decrease and ``asyncio.wait`` over them: each costs a future, a done
callback added and removed, and an event-loop callback when it resolves. Measured 7 Dec 2026 on the
2-core host (590 decreases, their acks scheduled on the loop): 1.3 -> 0.5 ms the wait, with the
futures' creation ~0.3 ms more (bench/interval_cost.py at 8,000 GPUs: ~0.1-0.2 us per GPU of stage
``send``). Pure: imports nothing of ours.
"""

from __future__ import annotations

import asyncio


class AckWait:
    """The waiters of one phase 1: ``made`` (how many), ``left`` (how many still open) and
    :attr:`all_done`, an asyncio future of the running loop resolved (None) when the last open one
    is resolved."""

    __slots__ = ("made", "left", "all_done")

    def __init__(self) -> None:
        self.made = 0
        self.left = 0
        self.all_done = asyncio.get_running_loop().create_future()

    def waiter(self) -> "AckWaiter":
        """A new open waiter counted here (one per decrease plan sent)."""
        self.made += 1
        self.left += 1
        return AckWaiter(self)

    def _resolved(self) -> None:
        self.left -= 1
        if not self.left and not self.all_done.done():
            self.all_done.set_result(None)


class AckWaiter:
    """One decrease plan's acknowledgement: resolved once (later results are ignored, as the
    callers check ``done()`` first); ``result`` is its ``CapAck``, or None."""

    __slots__ = ("group", "resolved", "result")

    def __init__(self, group: AckWait) -> None:
        self.group = group
        self.resolved = False
        self.result = None

    def done(self) -> bool:
        return self.resolved

    def set_result(self, value) -> None:
        """Resolve with ``value`` (a ``CapAck`` or None); a second call changes nothing."""
        if self.resolved:
            return
        self.resolved = True
        self.result = value
        self.group._resolved()
