"""bench/interval_cost.py's stand-in agents report NVML's utilization rates, so the cost figure
includes the models' memory-bound share update: after a few intervals every busy GPU has an
estimate near its job's share (coordinator/membound.py inverts what the stand-ins report). Not
timed (the figures are bench/'s)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_stand_in_agents_send_utilization_rates_and_the_models_estimate_each_jobs_share():
    import interval_cost as ic

    bench = ic.IntervalBench(1024, seed=3)
    asyncio.run(bench.run(2, 3, ""))
    shares = bench.coord.models.memory_bounds()
    fleet = bench.fleet
    busy = {(ic.node_name(k), i): int(j) for k, j in enumerate(fleet.job_of_node) if j >= 0
            for i in range(ic.GPUS_PER_NODE)}
    assert len(busy) > 500 and set(shares) == set(busy)  # every busy GPU, no idle one
    for key, est in shares.items():
        assert est == pytest.approx(float(fleet.mem_share[busy[key]]), abs=0.02), key
    assert max(fleet.mem_share) > 0.3  # shares that flatten curves, not only ~0
