"""The pace loop end to end on a plant steeper than the cube law: a real coordinator process, fake
agents over real gRPC (tests/coordinator/fakeagent.py) whose GPUs differ (power factors 0.9-1.3)
and run where the fake agent's curve (the allocator's H100 prior) is steep, ~380 W a GPU: there
its slope is a third to a fifth of the cube law's bound, where the loop by the model's slope alone
swung for good or pinned GPUs at their limits. With the measured slope (coordinator/paceslope.py) each cap changes direction at most once
and the job settles at equal pace."""

from __future__ import annotations

import time

import pytest

from coordinator import paceloop
from tests.coordinator.conftest import wait_for, write_policy
from tests.coordinator.fakeagent import FakeAgent, FakeGpu, Ledger

pytestmark = pytest.mark.integration

FACTORS = (1.0, 1.15, 0.9, 1.3)
BAND_W = 5.0  # 1 % of the 200..700 W range: smaller moves are not direction changes (bench/load_step.py)


def _quiet(agents_, window_s: float) -> bool:
    t = time.monotonic()
    time.sleep(window_s)
    return all(not p.caps for a in agents_ for p in a.plans_since(t))


def _turns(caps: list[float]) -> int:
    moves = [b - a for a, b in zip(caps, caps[1:]) if abs(b - a) >= BAND_W]
    return sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))


def test_unequal_gpus_on_a_steep_plant_settle_at_equal_pace_turning_at_most_once(tmp_path, start_coordinator, agents):
    interval = 0.25
    budget = 8 * 380.0
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1", "n2"], budget_w=budget, interval_s=interval)
    coord = start_coordinator(policy)
    ledger = Ledger()
    fleet = [FakeAgent(n, coord.address, [FakeGpu(i, power_factor=FACTORS[i], demand_w=650.0 * FACTORS[i])
                                          for i in range(4)], ledger, interval_s=interval) for n in ("n1", "n2")]
    agents += [a.start() for a in fleet]
    wait_for(lambda: all(a.connected.is_set() for a in fleet), 10, "agents connected")
    t0 = time.monotonic()
    for a in fleet:
        a.start_job("J", [0, 1, 2, 3])
    wait_for(lambda: _quiet(fleet, 8 * interval), 40, "caps settled (only hold plans)")
    for a in fleet:
        for i in range(4):
            caps = [c.cap_w for p in a.plans_since(t0) for c in p.caps if c.index == i]
            start = next(k for k, c in enumerate(caps) if c > 200.0 + BAND_W)  # the job's first share
            assert _turns(caps[start:]) <= 1, (a.node, i, [round(c) for c in caps])
    clocks = [g.clocks()[0] for a in fleet for g in a.gpus.values()]
    assert all(g.clocks()[1] == ["SW_POWER_CAP"] for a in fleet for g in a.gpus.values())  # the cap sets every clock
    assert (max(clocks) - min(clocks)) / 1980.0 <= paceloop.PACE_DEADBAND + 1 / 1980.0  # equal pace
    assert ledger.max_sum_w <= budget + 1e-6
    assert ledger.total() >= budget - 8 * BAND_W  # the job's watts spent
