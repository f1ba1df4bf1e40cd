"""A domain counted above its limit in two intervals in a row gets its every decrease sent, however
small (coordinator.planner.OVER_AGAIN_TICKS, counted_over; Coordinator._over_ticks).

Found with the exact journal of tests/coordinator/test_foreign_writer_budget.py: a GPU counted at its
foreign writer's 700 W, its job-mates' cut split so that their last watts were decreases of 1.19 W
each, under the planner's 2 W deadband: nothing sent, the cluster 3.58 W over its 2,800 W budget for
4 s, until an unrelated change (and for good in a steady state). Sub-deadband decreases of a domain
counted over its limit were sent only in the first intervals after a start or a policy change.

The real Coordinator, registry and planner; the solve is replaced by one returning the desired caps
the test sets (a small logic test: the real solve's split is not the point)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from capctl import plancaps
from capctl.policy.validate import parse_policy
from coordinator import decide, planner
from coordinator.loop import Coordinator
from tests.coordinator.test_problem_inputs import POLICY, Recording, hello, telemetry

BUDGET_W = 2000.0
OVER_W = 1.5
"""The fleet's accounted caps sum to the budget plus this (W): three GPUs 0.5 W each above their desired caps."""


def _coordinator(monkeypatch) -> tuple[Coordinator, dict]:
    policy = parse_policy(POLICY.replace("budget_w: 20000", f"budget_w: {BUDGET_W:g}").replace("limit_w: 4500", "limit_w: 2000"))
    coord = Coordinator(policy, "<test>")
    sessions = {n: Recording() for n in ("node1", "node2")}
    for n, s in sessions.items():
        coord.registry.on_hello(hello(n, jobs=(f"job-{n}",)), s)
    coord._tick_policy, coord._ticks_since_policy = coord.policy, 10  # long after a start or a change
    real = decide.solve

    def solve(problem):  # the real solve, its desired caps replaced: 700 W + 3 x 433.33 W = the budget
        sol = real(problem)
        want = {k: (700.0 if k == ("node1", 0) else (BUDGET_W - 700.0) / 3) for k in sol.desired_w}
        at = np.array([want[g.key] for g in problem.inputs.gpus], float)
        return dataclasses.replace(sol, desired_w=want, desired_at=at)
    monkeypatch.setattr(decide, "solve", solve)
    return coord, sessions


def _interval(coord: Coordinator, sessions: dict, seq: int) -> dict:
    """One report per node (node1's GPU 0 FOREIGN_WRITER at 700 W, the rest 0.5 W above their
    desired caps), one interval; (node, index) -> cap of the decreases sent."""
    w = (BUDGET_W - 700.0 + OVER_W) / 3
    for n, rows in (("node1", [(700.0, 690.0, 35.0), (w, w, 35.0)]), ("node2", [(w, w, 35.0), (w, w, 35.0)])):
        msg = telemetry(n, seq, rows)
        if n == "node1":
            msg.gpus[0].cap_state_name = "FOREIGN_WRITER"
        coord.registry.on_telemetry(n, msg)
    for s in sessions.values():
        s.msgs.clear()
    asyncio.run(coord.tick())
    out = {}
    for n, s in sessions.items():
        for m in s.msgs:
            if m.plan.phase == "decrease":
                out.update({(n, i): c for i, c in plancaps.of_plan(m.plan)[0].items()})
    return out


def test_sub_deadband_decreases_are_sent_when_a_domain_stays_counted_over_its_limit(monkeypatch):
    coord, sessions = _coordinator(monkeypatch)
    assert planner.OVER_AGAIN_TICKS == 1
    first = _interval(coord, sessions, 1)
    assert first == {} and coord._over_ticks == 1  # over once: maybe the readings' lag, nothing sent
    second = _interval(coord, sessions, 2)  # over again: the 0.5 W decreases are sent
    want = (BUDGET_W - 700.0) / 3
    assert sorted(second) == [("node1", 1), ("node2", 0), ("node2", 1)]
    assert all(abs(c - want) < 0.002 for c in second.values()), second
    assert 700.0 + sum(second.values()) <= BUDGET_W + 1e-6


def test_counted_over_is_a_sum_per_domain():
    keys = [("n", i) for i in range(4)]
    acc = np.array([100.0, 200.0, 300.0, 400.0])
    p = planner.PlanArrays(keys=keys, desired_w=acc, observed_w=acc, accounted_w=acc, min_cap_w=acc * 0,
                           max_cap_w=acc + 1000, live=np.ones(4, bool), prev_safe_w=acc)
    doms = [(300.0, np.array([0, 1])), (1000.0, np.array([0, 1, 2, 3])), (5.0, np.array([], np.int64))]
    assert not planner.counted_over(p, doms)
    assert planner.counted_over(p, doms[:1] + [(699.9, np.array([2, 3]))])
    assert planner.counted_over(p, [(299.9, np.array([0, 1]))]) and not planner.counted_over(p, [])
