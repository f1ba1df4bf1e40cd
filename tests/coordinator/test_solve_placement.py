"""Where the coordinator runs its solve (coordinator.loop.Coordinator._solve): in a worker thread
until it knows the solve's cost, then on the event loop while the last solve took at most
INLINE_SOLVE_FRACTION of an interval of CPU, in the thread again when it took more.

In-process: the real Coordinator, Registry, Models and decide.solve on two reporting nodes (the
session stand-ins of test_problem_inputs drop every plan); only the thread that ran each solve is
recorded, by wrapping decide.solve."""

from __future__ import annotations

import asyncio
import math
import threading

from coordinator import decide, loop
from tests.coordinator.test_problem_inputs import Session, _coordinator, hello, telemetry


def _fleet():
    coord = _coordinator()
    for i, n in enumerate(("node1", "node2")):
        coord.registry.on_hello(hello(n, jobs=(f"job-{n}",)), Session())
        coord.registry.on_telemetry(n, telemetry(n, 1, [(500.0, 490.0, 55.0 + i), (500.0, 480.0, 60.0)]))
    return coord


def test_solve_in_a_thread_first_then_on_the_loop_while_cheap_back_in_the_thread_when_not(monkeypatch):
    coord = _fleet()
    ran_on: list[str] = []
    real = decide.solve

    def recording(problem):
        ran_on.append(threading.current_thread().name)
        return real(problem)

    monkeypatch.setattr(decide, "solve", recording)

    async def ticks():
        loop_thread = threading.current_thread().name
        assert math.isinf(coord._solve_cpu_s)  # nothing known yet
        await coord.tick()
        first_cpu_s = coord._solve_cpu_s
        await coord.tick()
        coord._solve_cpu_s = loop.INLINE_SOLVE_FRACTION * coord.interval_s * 1.01  # as if the last one cost more
        await coord.tick()
        return loop_thread, first_cpu_s

    loop_thread, first_cpu_s = asyncio.run(ticks())
    assert ran_on[0] != loop_thread  # first solve: cost unknown, off the loop
    assert 0.0 < first_cpu_s <= loop.INLINE_SOLVE_FRACTION * coord.interval_s  # two nodes: a few ms of CPU
    assert ran_on[1] == loop_thread  # cheap: on the loop, no GIL hand-offs with a worker
    assert ran_on[2] != loop_thread  # over the fraction: back in the worker
    assert len(coord.solve_s) == 3 and all(s > 0 for s in coord.solve_s)  # every solve recorded as before
