"""Report timing against the real coordinator (docs/protocol.md, "Report timing"): agents that
follow ``CapPlan.report_in_s`` have every report in the very next reconcile's snapshot, sent at
most the advised lead before it; a job start's early reconcile does not move the grid; a restarted
coordinator (a new grid) re-aligns them. Real coordinator process, real gRPC on a unix socket,
fake agents of tests/coordinator/fakeagent.py."""

from __future__ import annotations

import time

import pytest

from coordinator import tickphase
from tests.coordinator.conftest import wait_for, write_policy
from tests.coordinator.fakeagent import FakeAgent, FakeGpu, Ledger

pytestmark = pytest.mark.integration

INTERVAL_S = 0.3
TOL_S = 0.06
"""Slack (s) for the plan's delivery and the agents' thread wake-ups."""


def _lags_s(agent: FakeAgent, t0_mono: float, t1_mono: float) -> list[float]:
    """For each report ``agent`` sent in [t0, t1] (monotonic s): the time from its sending to the
    snapshot of the first reconcile that included it (plan.snapshot_time_s, Unix s)."""
    snaps = sorted(p.snapshot_time_s for _, p in list(agent.plans) if p.snapshot_time_s > 0)
    out = []
    for wall, mono in list(agent.reports):
        if t0_mono <= mono <= t1_mono:
            nxt = next((s for s in snaps if s >= wall), None)
            assert nxt is not None, f"report at {wall} in no snapshot"
            out.append(nxt - wall)
    return out


def _check_window(fleet: list[FakeAgent], seconds: float) -> list[float]:
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    time.sleep(INTERVAL_S)  # the reconcile after the last report
    lags = [x for a in fleet for x in _lags_s(a, t0, t1)]
    assert len(lags) >= len(fleet) * (int(seconds / INTERVAL_S) - 1), lags
    bound = tickphase.LEAD_MAX_FRACTION * INTERVAL_S + TOL_S
    assert max(lags) <= bound, sorted(round(x, 3) for x in lags)
    return lags


def test_advised_reports_make_the_next_snapshot_across_early_ticks_and_a_restart(tmp_path, start_coordinator, agents):
    policy = write_policy(tmp_path / "p.yaml", nodes=["a1", "a2", "a3"], budget_w=3000.0, interval_s=INTERVAL_S,
                          lease_s=5.0, gpus_per_node=2)
    listen = f"unix:{tmp_path}/coord.sock"
    coord = start_coordinator(policy, listen=listen)
    ledger = Ledger()
    for name in ("a1", "a2", "a3"):
        agents.append(FakeAgent(name, coord.address, [FakeGpu(0), FakeGpu(1)], ledger, interval_s=INTERVAL_S,
                                follow_advice=True).start())
    wait_for(lambda: all(len(a.plans) >= 3 for a in agents), 10, "plans to every agent")
    time.sleep(INTERVAL_S)  # one advised report each
    # early reconciles (job starts, mid-interval) run between grid ticks without moving them
    agents[0].start_job("77", [0, 1])
    time.sleep(INTERVAL_S * 0.5)
    agents[1].start_job("78", [0])
    _check_window(agents, 1.0)

    # a restarted coordinator has another grid: the agents follow it from its first plans
    coord.stop()
    n_before = [len(a.plans) for a in agents]
    coord2 = start_coordinator(policy, listen=listen, state_dir=coord.state_dir)
    wait_for(lambda: all(len(a.plans) >= n + 2 for a, n in zip(agents, n_before)), 15, "plans of the new coordinator")
    time.sleep(INTERVAL_S)
    _check_window(agents, 0.7)
    assert coord2.proc.poll() is None and "Traceback" not in coord2.log()
