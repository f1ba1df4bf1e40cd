"""Device faults on one node: driver reload (limits back to the default), a GPU lost, NVML errors
on one GPU. Each case: invariants sampled throughout (tests/faults/rig.py)."""

from __future__ import annotations

import time

import pytest

from capctl.capstates import of as cap_state_of
from capctl.demo.processes import wait_until
from capctl.v1 import capctl_pb2 as pb
from tests.faults.rig import DOMAINS, INTERVAL_S, NODES

pytestmark = pytest.mark.faults

RECOVERY_S = 5.0
"""A fault that moves limits by itself (driver reload) must be undone within this bound (s); the agent's
drift check re-applies at its next interval (~0.3 s here), the bound leaves room for a loaded machine."""


def test_driver_reload_on_one_node(rig):
    caps = rig.enforced("n1")
    sim = rig.sims["n1"]
    default = sim.read(0)["default_limit_w"]
    assert all(c < default - 50 for c in caps)
    rig.sampler.excuse(RECOVERY_S)  # the reload itself puts every limit at the default
    t0 = time.monotonic()
    sim.driver_reload()
    assert rig.enforced("n1")[0] == default
    def reapplied() -> bool:
        # back under the coordinator's caps: the allocation it holds now (its models may have moved
        # the caps by a few watts since the sample above), far below the default limit
        now = rig.enforced("n1")
        if not all(c < default - 50 for c in now):
            return False
        desired = {g.index: g.cap_w for n in rig.status().nodes if n.name == "n1" for g in n.gpus}
        return all(abs(now[i] - desired.get(i, caps[i])) <= 25.0 for i in range(len(now)))
    wait_until(reapplied, RECOVERY_S, 0.01, "n1's caps back after the driver reload")
    recovered_s = time.monotonic() - t0
    assert recovered_s <= RECOVERY_S
    time.sleep(3 * INTERVAL_S)  # and they stay (sampled)
    assert sorted(j.job_id for j in rig.agents["n1"].status().jobs) == ["100", "200"]


def test_gpu_lost_is_counted_at_its_cap(rig):
    sim = rig.sims["n2"]
    lost_cap = sim.read(3)["enforced_w"]
    sim.inject(3, "gpu_lost")
    try:
        def reported_lost():
            st = rig.status()
            g = next(x for n in st.nodes if n.name == "n2" for x in n.gpus if x.index == 3)
            return cap_state_of(g) == "LOST"
        wait_until(reported_lost, 5.0, 0.05, "GPU n2/3 reported LOST")
        # the budget keeps counting the lost GPU at its cap: the others cannot take its watts
        time.sleep(4 * INTERVAL_S)
        others = sum(sum(rig.enforced(n)) for n in NODES) - sim.read(3)["enforced_w"]
        assert others + lost_cap <= DOMAINS["cluster"][0] + 0.5
        assert sum(rig.enforced("n2")) <= DOMAINS["rack-b"][0] + 0.5
    finally:
        sim.clear(3, "gpu_lost")
    wait_until(lambda: all(cap_state_of(g) in ("OK", "") for n in rig.status().nodes for g in n.gpus), 10.0, 0.1,
               "GPU n2/3 back")
    rig.wait_settled()


def test_nvml_errors_on_one_gpu_hold_its_watts(rig):
    """GPU n1/0 refuses limit changes (NVML NO_PERMISSION): a budget cut cannot lower it, so the
    coordinator must take the watts from the other GPUs, never assume n1/0 freed its share."""
    sim = rig.sims["n1"]
    stuck = sim.read(0)["enforced_w"]
    sim.inject(0, "set_no_permission")
    try:
        reply = rig.admin("SetBudget", pb.SetBudgetRequest(budget_w=2200.0))
        assert reply.ok, reply.message

        def within_new_budget():
            return sum(sum(rig.enforced(n)) for n in NODES) <= 2200.0 + 0.5
        wait_until(within_new_budget, 6.0, 0.05, "sum of enforced limits within the cut budget")
        assert sim.read(0)["enforced_w"] == stuck  # the faulty GPU really kept its limit
        st = rig.status()
        g = next(x for n in st.nodes if n.name == "n1" for x in n.gpus if x.index == 0)
        assert abs(g.enforced_w - stuck) <= 1.0  # the coordinator knows it (read-back)
        time.sleep(3 * INTERVAL_S)
        assert within_new_budget()
    finally:
        sim.clear(0, "set_no_permission")
        rig.admin("SetBudget", pb.SetBudgetRequest(budget_w=2800.0))
    rig.wait_settled()


def test_reboot_applies_the_safe_cap_before_ready(rig):
    """A node reboots (agent gone, driver reloaded: every limit at the default): the restarted agent
    applies its saved safe caps before it reports ready, so Slurm's health check never sees a ready
    node at the default limit."""
    agent = rig.agents["n2"]
    safe_before = rig.enforced("n2")
    rig.sampler.excuse(30.0)  # the reboot itself puts the limits at the default until the agent is back
    agent.stop()
    sim = rig.sims["n2"]
    sim.driver_reload()
    default = sim.read(0)["default_limit_w"]
    assert rig.enforced("n2") == [default] * sim.gpu_count
    agent = rig.start_agent("n2")
    st = wait_until(lambda: (s := agent.status(timeout_s=0.5)).ready and s, 20.0, 0.01, "agent n2 ready", proc=agent)
    at_ready = rig.enforced("n2")
    assert all(c < default - 50 for c in at_ready), at_ready
    assert all(c <= b + 0.5 for c, b in zip(at_ready, safe_before)), (at_ready, safe_before)  # never above the last caps
    assert sorted(j.job_id for j in st.jobs) == ["100", "300"]
    rig.sampler.excuse(0.0)
    with rig.sampler._lock:
        rig.sampler._excused_until = 0.0
    rig.wait_settled()
