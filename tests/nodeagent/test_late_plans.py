"""Plans that reach the agent after their lease expiry (an agent SIGSTOPped past its lease, a
stream backlog), in-process on a simulated node through the real pynvml.

Such a plan raises no cap and renews no lease: only its decreases are applied, and its ack says
why (``ok`` false). It took its raises and renewed the lease, then the failsafe applied
min(current, safe cap) to the raised cap: 405 W on a GPU that had 397 W before (a flaky
tests/faults/test_processes.py::test_sigstop_agent_beyond_its_lease_then_sigcont).
"""

from __future__ import annotations

import time

import pytest

from capctl.v1 import capctl_pb2
from nodeagent.caps import CapManager
from nodeagent.daemon import Agent

pytestmark = pytest.mark.integration

LEASE_S = 30.0


def make_agent(tmp_path, backend) -> Agent:
    """An agent on ``backend`` (no link: the tests call its methods and read what they return)."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700, exist_ok=True)
    return Agent("n1", "unix:/nonexistent", str(tmp_path / "agent.sock"), state_dir, backend,
                 CapManager(backend, state_dir), start_cap_w=300.0, policy_safe_cap_w=None, interval_s=1.0)


def plan(seq: int, caps: dict[int, float], *, safe: dict[int, float] | None = None, expiry_in_s: float = LEASE_S,
         phase: str = "increase"):
    """A ``CapPlan`` whose lease (``LEASE_S``) runs out ``expiry_in_s`` s from now on this host's clock."""
    return capctl_pb2.CapPlan(
        seq=seq, phase=phase, lease_s=LEASE_S, lease_expiry_s=time.time() + expiry_in_s,
        caps=[capctl_pb2.CapAssignment(index=i, cap_w=c) for i, c in caps.items()],
        safe_caps=[capctl_pb2.CapAssignment(index=i, cap_w=c) for i, c in (safe or {}).items()])


def enforced_w(backend, node, index: int) -> float:
    """GPU ``index``'s enforced limit (W) through pynvml, checked against the simulated device's own."""
    value = backend.get_enforced_w(index)
    assert value == node.read(index)["enforced_w"]
    return value


def test_a_plan_past_its_lease_expiry_applies_only_its_decreases_and_renews_nothing(make_node, open_backend,
                                                                                   tmp_path):
    node = make_node(gpus=4)
    backend = open_backend()
    agent = make_agent(tmp_path, backend)
    assert agent.on_plan(plan(1, {0: 400.0, 1: 400.0, 2: 400.0}, safe={0: 350.0, 1: 350.0, 2: 350.0})).ok
    expiry = agent.lease.expiry_mono_s
    writes = [node.read(i)["set_count"] for i in range(4)]
    # 12 s after its expiry: a raise (GPU 0), a decrease (GPU 1), no change (GPU 2); a safe cap
    # raise (GPU 0) and decrease (GPU 1)
    ack = agent.on_plan(plan(2, {0: 500.0, 1: 300.0, 2: 400.0}, safe={0: 450.0, 1: 320.0}, expiry_in_s=-12.0))
    assert ack is not None and not ack.ok
    assert "plan 2 arrived 12." in ack.error and "s after its lease expiry: only its decreases applied" in ack.error
    assert [enforced_w(backend, node, i) for i in range(3)] == [400.0, 300.0, 400.0]
    assert node.read(0)["set_count"] == writes[0] and node.read(2)["set_count"] == writes[2]  # never written
    assert {g.index: g.enforced_w for g in ack.gpus} == {0: 400.0, 1: 300.0, 2: 400.0}  # the read-back
    assert agent.desired_w[0] == 400.0 and agent.allowed_w[0] == 400.0 and agent.allowed_w[1] == 300.0
    assert agent.lease.safe_caps_w == {0: 350.0, 1: 320.0, 2: 350.0}  # safe caps: only lowered
    # the lease is not renewed: ended at once (the plan says the coordinator's lease ran out)
    assert agent.lease.expiry_mono_s <= time.monotonic() and agent.lease.expiry_mono_s < expiry
    assert agent.stream_seq == 2 and agent.last_plan_seq == 2  # taken: a replay of it is refused
    agent.tick()  # the failsafe: min(current, safe cap), never up
    assert [enforced_w(backend, node, i) for i in range(3)] == [350.0, 300.0, 350.0]
    assert agent.safe_mode == {0, 1, 2}
    ack = agent.on_plan(plan(3, {0: 380.0}, safe={0: 350.0}))  # a plan in time renews and leaves the failsafe
    assert ack.ok and agent.lease.active() and agent.safe_mode == set() and enforced_w(backend, node, 0) == 380.0


def test_after_a_stop_past_the_lease_queued_plans_never_leave_a_gpu_above_its_cap(make_node, open_backend,
                                                                                 tmp_path):
    """The SIGSTOP case (397 W, safe cap 405 W, a queued raise to 420 W): whether the failsafe
    runs before or after the queued plans, GPU 0 never goes above 397 W, and a late plan does
    not take the GPUs out of the failsafe."""
    node = make_node(gpus=4)
    backend = open_backend()
    agent = make_agent(tmp_path, backend)
    assert agent.on_plan(plan(1, {0: 397.0, 1: 500.0}, safe={0: 405.0, 1: 405.0})).ok
    agent.lease.expiry_mono_s = time.monotonic() - 1.0  # stopped past its lease
    writes0 = node.read(0)["set_count"]
    ack = agent.on_plan(plan(2, {0: 420.0}, expiry_in_s=-3.0))  # queued while stopped: handled first
    assert not ack.ok and "plan 2 arrived 3." in ack.error
    assert enforced_w(backend, node, 0) == 397.0 and node.read(0)["set_count"] == writes0
    agent.tick()
    assert enforced_w(backend, node, 0) == 397.0 and enforced_w(backend, node, 1) == 405.0
    assert agent.safe_mode == {0, 1}
    # the failsafe first, then more late plans (a hold among them): still nothing goes up
    ack = agent.on_plan(plan(3, {0: 420.0, 1: 450.0}, phase="decrease", expiry_in_s=-2.0))
    assert not ack.ok and "arrived" in ack.error
    hold = agent.on_plan(plan(4, {}, safe={0: 500.0}, phase="hold", expiry_in_s=-1.0))
    assert hold is not None and not hold.ok and "plan 4 arrived 1." in hold.error and len(hold.gpus) == 0
    agent.tick()
    assert enforced_w(backend, node, 0) == 397.0 and enforced_w(backend, node, 1) == 405.0
    assert agent.safe_mode == {0, 1} and agent.lease.expired() and agent.lease.safe_caps_w[0] == 405.0
    assert node.read(0)["set_count"] == writes0
