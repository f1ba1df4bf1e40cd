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


def test_stand_in_acks_read_back_the_gpus_the_plan_named_as_nodeagent_does():
    import interval_cost as ic

    bench = ic.IntervalBench(512, seed=1)
    pb = bench.fleet.pb
    named: dict = {}  # (node, plan seq) -> GPU indices of the plan's caps
    seen = []  # (GPU indices of the plan's caps, GPU indices of its ack)
    for s in bench.sessions:
        send, ack = s.send, s._ack

        def spy_send(msg, send=send, s=s):
            named[(s.node, msg.plan.seq)] = {c.index for c in msg.plan.caps}
            return send(msg)

        def spy_ack(data, ack=ack, s=s):
            msg = pb.AgentMessage.FromString(data).ack
            seen.append((named[(s.node, msg.seq)], {g.index for g in msg.gpus}))
            return ack(data)

        s.send, s._ack = spy_send, spy_ack
    asyncio.run(bench.run(3, 2, ""))
    assert len(seen) > 32
    partial = [(named, acked) for named, acked in seen if named and len(named) < ic.GPUS_PER_NODE]
    assert partial  # plans naming some GPUs only: their acks read back those
    for named, acked in seen:
        assert acked == (named or set(range(ic.GPUS_PER_NODE)))


def test_refits_are_their_own_stage_and_not_charged_to_inputs():
    import interval_cost as ic

    r = ic.measure(512, intervals=3, warmup=2, seed=2)
    per = r["us_per_gpu"]
    assert set(per) == set(ic.STAGES)
    assert r["refits"] > 0 and per["refit"] > 0.0
    assert r["beyond_solver_us"] == pytest.approx(sum(v for k, v in per.items() if k not in ("solve", "view")),
                                                  abs=0.05)
