"""Report timing (docs/protocol.md, "Report timing"): the real agent (a process on a simulated node)
moves its reports to the coordinator's ``CapPlan.report_in_s`` and keeps them there every interval;
a new grid (a restarted coordinator, a new leader) re-aligns it at its first plan; an advice out of
bounds is ignored. Real gRPC against the in-test AgentLink server (tests/agent/fakecoord.py)."""

from __future__ import annotations

import time

import pytest

from tests.agent.fakecoord import FakeCoordinator
from tests.support.processes import sim_node, start_agent, wait_until

pytestmark = pytest.mark.integration

INTERVAL_S = 0.4
TOL_S = 0.1
"""Allowed distance (s) of a report from its advised phase: a quarter of the half-interval shift
between the two grids below, so a report on the old grid can never pass for the new one."""


def _phase_error_s(t: float, anchor: float) -> float:
    """Distance (s) of ``t`` from the grid ``anchor + k * INTERVAL_S`` (any integer k)."""
    d = (t - anchor) % INTERVAL_S
    return min(d, INTERVAL_S - d)


def _reports_after(fc: FakeCoordinator, t0: float, n: int) -> list[float]:
    """Receipt times (monotonic s) of the first ``n`` reports after ``t0`` (waits for them)."""
    return wait_until(lambda: (ts := [t for t in list(fc.telemetry_mono) if t > t0])[n - 1:] and ts[:n],
                      10, what=f"{n} reports after the advice")


def test_agent_follows_the_coordinators_report_timing_and_realigns(tmp_path):
    node = sim_node(tmp_path / "sim", 1, seed=5)
    fc = FakeCoordinator(f"unix:{tmp_path}/fc.sock", interval_s=INTERVAL_S, lease_s=30.0).start()
    a = start_agent(tmp_path, "n1", fc.address, sim_env=node.env(), interval_s=INTERVAL_S, reconnect_max_s=0.5)
    try:
        a.wait_ready(20, connected=True)
        wait_until(lambda: len(fc.telemetry_mono) >= 2, 10, what="the agent's own reports")

        # grid 1: the next report 0.25 s after the plan, then every interval on that phase
        t1 = time.monotonic()
        fc.push_plan("n1", {}, phase="hold", report_in_s=0.25)
        anchor1 = t1 + 0.25
        got = _reports_after(fc, t1 + 0.05, 3)
        assert abs(got[0] - anchor1) <= TOL_S, (got, anchor1)
        assert all(_phase_error_s(t, anchor1) <= TOL_S for t in got), [round(t - anchor1, 3) for t in got]

        # grid 2 (another coordinator's phase, half an interval off): re-aligned from its first plan
        t2 = got[-1] + 0.05
        while time.monotonic() < t2:
            time.sleep(0.01)
        now = time.monotonic()
        anchor2 = anchor1 + INTERVAL_S / 2
        advice = (anchor2 - now) % INTERVAL_S or INTERVAL_S
        fc.push_plan("n1", {}, phase="hold", report_in_s=advice)
        got2 = _reports_after(fc, now + 0.05, 3)
        assert all(_phase_error_s(t, anchor2) <= TOL_S for t in got2), [round(t - anchor2, 3) for t in got2]
        assert all(_phase_error_s(t, anchor1) > TOL_S for t in got2)

        # an advice out of bounds (50 s, more than two intervals) is ignored: the period goes on
        t3 = time.monotonic()
        fc.push_plan("n1", {}, phase="hold", report_in_s=50.0)
        got3 = _reports_after(fc, t3, 2)
        assert all(_phase_error_s(t, anchor2) <= TOL_S for t in got3), [round(t - anchor2, 3) for t in got3]
        assert "Traceback" not in a.log_path.read_text()
    finally:
        a.stop()
        fc.stop()
        node.close()
