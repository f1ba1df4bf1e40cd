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

    from capctl import plancaps, readings

    bench = ic.IntervalBench(512, seed=1)
    pb = bench.fleet.pb
    named: dict = {}  # (node, plan seq) -> GPU indices of the plan's caps
    seen = []  # (GPU indices of the plan's caps, GPU indices of its ack)
    for s in bench.sessions:
        send, ack = s.send, s._ack

        def spy_send(msg, send=send, s=s):
            named[(s.node, msg.plan.seq)] = set(plancaps.of_plan(msg.plan)[0])  # (packed, as to nodeagent)
            return send(msg)

        def spy_ack(data, ack=ack, s=s):
            msg = pb.AgentMessage.FromString(data).ack
            assert not msg.gpus  # packed, as the real agent answers this coordinator
            seen.append((named[(s.node, msg.seq)], {r[readings.R_INDEX] for r in readings.rows_of(msg)}))
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


def test_no_increase_is_sent_under_a_policy_changed_during_the_interval():
    """``budget set`` (or a reload) landing during an interval's solve or phase-1 wait: its
    increases were planned under the old limits and are not sent (found by a real-agent test: a
    budget cut acknowledged to the admin, then an increase 12 W over the new budget for 85 ms).
    The same intervals without a change send increases."""
    import interval_cost as ic

    bench = ic.IntervalBench(512, seed=2)
    coord = bench.coord
    phases: list = []
    for s in bench.sessions:
        def spy_send(msg, send=s.send):
            phases.append(msg.plan.phase)
            return send(msg)
        s.send = spy_send
    change = {"on": False}
    phase1 = coord._send_phase1

    async def phase1_then_change(decision, *rest):
        out = await phase1(decision, *rest)
        if change["on"]:  # what an admin's budget set does on the event loop during the wait
            coord.policy = coord.file_policy.with_budget(coord.policy.budget_w - 1.0)
        return out

    coord._send_phase1 = phase1_then_change

    async def intervals(n: int) -> list:
        counts = []
        for it in range(n):
            bench.fleet.step(len(counts) + it)
            bench.ingest([bench.fleet.telemetry_bytes(k) for k in range(bench.n_nodes)])
            coord._tick_policy = coord.policy  # (Coordinator.tick does this first)
            del phases[:]
            await bench.one_interval()
            counts.append(phases.count("increase"))
            bench.now_s += ic.INTERVAL_S
        return counts

    async def main():
        plain = await intervals(8)
        change["on"] = True
        changed = await intervals(8)
        return plain, changed

    plain, changed = asyncio.run(main())
    assert sum(plain) > 0, plain
    assert changed == [0] * 8, changed
    assert coord.policy.budget_w < coord.file_policy.budget_w
