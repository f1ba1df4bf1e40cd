"""Process faults: kill -9 of the coordinator mid reallocation, kill -9 / SIGSTOP of an agent, and
a wall-clock jump on the coordinator. Each case: invariants sampled throughout (tests/faults/rig.py)."""

from __future__ import annotations

import ast
import signal
import time

import pytest

from capctl.demo.processes import wait_until
from capctl.v1 import capctl_pb2 as pb
from tests.faults.rig import INTERVAL_S, LEASE_S, RECONNECT_MAX_S

pytestmark = pytest.mark.faults


def test_kill9_coordinator_mid_reallocation_then_restart(rig):
    # a reallocation: the budget drops by 500 W; phase 1 lowers caps, acks come back, phase 2 follows
    before = {n: rig.enforced(n) for n in rig.sims}
    reply = rig.admin("SetBudget", pb.SetBudgetRequest(budget_w=2300.0))
    assert reply.ok, reply.message
    # kill -9 as soon as the first decrease reached a device (phase 1 applied, the rest pending or racing)
    def decreased():
        now = {n: rig.enforced(n) for n in rig.sims}
        return any(now[n][i] < before[n][i] - 1.0 for n in now for i in range(len(now[n])))
    wait_until(decreased, 5.0, 0.005, "a phase-1 decrease on a device")
    rig.coordinator.kill()
    killed_at = {n: rig.enforced(n) for n in rig.sims}
    time.sleep(LEASE_S + 3 * INTERVAL_S)  # agents fall back to their safe caps meanwhile
    assert {"n1", "n2"} <= rig.safe_cap_seen, "agents did not report SAFE_CAP after their lease ran out"
    after_fallback = {n: rig.enforced(n) for n in rig.sims}
    for n in rig.sims:  # never raised by the failsafe
        assert all(a <= k + 0.5 for a, k in zip(after_fallback[n], killed_at[n])), (n, killed_at[n], after_fallback[n])
    t_restart = time.monotonic()
    rig.start_coordinator()
    t_serving = time.monotonic()
    # bindings rebuilt from the agents' hellos: within 2 intervals of the agents' reconnect backoff
    wait_until(rig.bindings_complete, 10.0, 0.02, "bindings rebuilt at the restarted coordinator")
    rebuilt_s = time.monotonic() - t_serving
    assert rebuilt_s <= RECONNECT_MAX_S + 2 * INTERVAL_S + 0.5, rebuilt_s
    assert rig.coordinator_jobs() == {"100": ["n1", "n2"], "200": ["n1"], "300": ["n2"]}
    assert rig.status().budget_w == 2300.0  # the admin change survived the restart (state directory)
    reply = rig.admin("SetBudget", pb.SetBudgetRequest(budget_w=2800.0))
    assert reply.ok, reply.message
    rig.wait_settled()
    assert time.monotonic() - t_restart < 30


def test_kill9_agent_then_restart_keeps_caps_and_bindings(rig):
    caps_before = rig.enforced("n2")
    rig.agents["n2"].kill()
    # the coordinator counts n2 as stale at its caps; n1 must not take n2's power
    wait_until(lambda: any(n.stale for n in rig.status().nodes if n.name == "n2"), LEASE_S + 5, 0.05,
               "n2 stale at the coordinator")
    time.sleep(3 * INTERVAL_S)
    assert rig.enforced("n2") == caps_before  # nobody touched its devices
    rig.start_agent("n2").wait_ready(20.0, connected=True)
    local = rig.agents["n2"].status()
    assert sorted(j.job_id for j in local.jobs) == ["100", "300"]
    wait_until(rig.bindings_complete, 10.0, 0.05, "bindings at the coordinator after the agent restart")
    rig.wait_settled()


def test_sigstop_agent_beyond_its_lease_then_sigcont(rig):
    agent = rig.agents["n1"]
    caps_before = rig.enforced("n1")
    failsafe_lines_before = agent.log_path.read_text().count("lease expired: applying safe caps")
    agent.signal(signal.SIGSTOP)
    rig.paused["n1"] = True
    try:
        wait_until(lambda: any(n.stale for n in rig.status().nodes if n.name == "n1"), LEASE_S + 5, 0.05,
                   "n1 stale at the coordinator")
        time.sleep(LEASE_S)
        # frozen agent: its devices keep their caps, and the coordinator keeps counting them as spent
        assert rig.enforced("n1") == caps_before
    finally:
        agent.signal(signal.SIGCONT)
        rig.paused["n1"] = False
    # on SIGCONT the agent finds its lease expired and applies its safe caps, each at most the cap the
    # GPU had (never above its last assignment, never the default), then resyncs
    def failsafe_line():
        lines = [ln for ln in agent.log_path.read_text().splitlines() if "lease expired: applying safe caps" in ln]
        return lines[-1] if len(lines) > failsafe_lines_before else None
    line = wait_until(failsafe_line, 10.0, 0.05, "the agent's failsafe after SIGCONT")
    applied = ast.literal_eval(line.split("applying safe caps ", 1)[1])
    assert all(applied[i] <= caps_before[i] + 1.0 for i in applied), (applied, caps_before)
    wait_until(rig.healthy, 15.0, 0.1, "n1 live again with its bindings")
    rig.wait_settled()


def test_wall_clock_jump_on_the_coordinator(rig):
    """Leases and intervals run on the coordinator's monotonic clock: a wall-clock jump of an hour
    either way sends no agent to its failsafe and makes no node stale."""
    ticks = rig.status().last_solve_time_s
    for offset in (-3600.0, 3600.0, 0.0):
        rig.clock_file.write_text(repr(offset))
        deadline = time.monotonic() + LEASE_S + 4 * INTERVAL_S
        while time.monotonic() < deadline:
            st = rig.status()
            assert not any(n.stale for n in st.nodes), f"a node turned stale after a clock jump of {offset:+.0f} s"
            time.sleep(0.1)
        assert not rig.safe_cap_seen, f"agents fell back to safe caps after a clock jump of {offset:+.0f} s"
        assert st.last_solve_time_s != ticks  # the reconcile loop kept running
        ticks = st.last_solve_time_s
    assert rig.bindings_complete()
