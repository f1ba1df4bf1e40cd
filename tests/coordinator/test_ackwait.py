"""Phase 1's wait (coordinator/ackwait.py): one future resolved when every decrease's waiter is,
whichever way (acknowledged, stream closed, forgotten), each waiter once."""

from __future__ import annotations

import asyncio

from coordinator import ackwait


def test_all_done_when_every_waiter_is_resolved_once():
    async def main():
        wait = ackwait.AckWait()
        a, b, c = wait.waiter(), wait.waiter(), wait.waiter()
        assert (wait.made, wait.left) == (3, 3) and not a.done()
        a.set_result("ack a")
        a.set_result(None)  # a second result changes nothing (the callers check done() first)
        b.set_result(None)  # stream closed
        assert (wait.left, a.result, a.done()) == (1, "ack a", True) and not wait.all_done.done()
        c.set_result("ack c")
        assert wait.left == 0 and wait.all_done.done()
        await asyncio.wait_for(wait.all_done, 1.0)
        return wait

    wait = asyncio.run(main())
    assert wait.made == 3


def test_wait_times_out_with_waiters_open():
    async def main():
        wait = ackwait.AckWait()
        w = wait.waiter()
        done, _ = await asyncio.wait([wait.all_done], timeout=0.01)
        assert not done and not w.done()
        w.set_result(None)
        return wait.all_done.done()

    assert asyncio.run(main())
