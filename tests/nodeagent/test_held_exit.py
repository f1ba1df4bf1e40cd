"""A GPU leaving a held state (UNSUPPORTED_CONSTRAINTS, LOST) is never raised by the agent on its own
initiative: real agent core on a simulated node through pynvml, checked with the simulated driver's
enforced-limit journal.

While a GPU is held the coordinator counts it at its current limit and forgets a cap it sent once
the ack says the write failed; the agent kept that cap as the GPU's target (desired cap, allowance,
start cap, restore ceiling) and wrote it when the GPU became readable again: 609.8 -> 648.1 W,
4831.4 W on a 4800 W budget until the coordinator's next plan (found by a try-out with
``capctl-simgpu fault ... bad_constraints --gpu 2 --value 0 --max-w 0`` then ``--clear``).
"""

from __future__ import annotations

import time

import pytest

from capctl import capstates
from capctl.simgpu.journal import read_journal
from capctl.v1 import capctl_pb2
from nodeagent.caps import CapManager
from nodeagent.daemon import Agent
from tests.nodeagent.test_agent_logic import RecordingLink

pytestmark = pytest.mark.integration

LEASE_S = 60.0
SAFE = {i: 400.0 for i in range(4)}


def make_agent(tmp_path, backend, start_cap_w: float) -> Agent:
    """An agent on ``backend``, connected through a link that records what it sends (the tests call
    its methods and read what they return)."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700, exist_ok=True)
    agent = Agent("n2", "unix:/nonexistent", str(tmp_path / "agent.sock"), state_dir, backend,
                  CapManager(backend, state_dir), start_cap_w=start_cap_w, policy_safe_cap_w=None, interval_s=1.0)
    agent.link = RecordingLink(True)
    return agent


def plan(seq: int, caps: dict[int, float]):
    """A ``CapPlan`` (phase increase) whose lease runs out ``LEASE_S`` s from now."""
    return capctl_pb2.CapPlan(
        seq=seq, phase="increase", lease_s=LEASE_S, lease_expiry_s=time.time() + LEASE_S,
        caps=[capctl_pb2.CapAssignment(index=i, cap_w=c) for i, c in caps.items()],
        safe_caps=[capctl_pb2.CapAssignment(index=i, cap_w=c) for i, c in SAFE.items()])


def job_start(agent: Agent, job_id: str, *gpus: int):
    return agent.job_start(capctl_pb2.JobStartRequest(
        job_id=job_id, gpu_ids=[str(g) for g in gpus], gpu_id_kind=capctl_pb2.GPU_ID_MINOR, user="alice"))


def journal_w(node, index: int, since_ns: int) -> list[float]:
    """GPU ``index``'s enforced limits (W) the driver journaled after ``since_ns`` (CLOCK_MONOTONIC)."""
    recs = read_journal(node.path).records
    return [round(float(r["enforced_w"]), 3) for r in recs if r["gpu"] == index and int(r["t_ns"]) > since_ns]


FAULTS = {
    "bad_constraints": (dict(value=0.0, max_w=0.0), capstates.UNSUPPORTED_CONSTRAINTS),
    "gpu_lost": ({}, capstates.LOST),
}


def held_during_job_300(node, agent, fault: str) -> None:
    """Job 300 on GPU 2 at 609.8 W (plan 1), then ``fault`` on GPU 2 and a raise to 648.1 W (plan 2)
    that cannot be written: the ack says so and the coordinator keeps counting 609.8 W."""
    job_start(agent, "300", 2)
    assert agent.on_plan(plan(1, {2: 609.8})).ok
    assert node.read(2)["enforced_w"] == 609.8
    kwargs, state = FAULTS[fault]
    node.inject(2, fault, **kwargs)
    agent.tick()
    assert agent.caps.states()[2] == state
    ack = agent.on_plan(plan(2, {2: 648.1}))
    assert ack is not None and not ack.ok
    assert node.read(2)["enforced_w"] == 609.8


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_gpu_back_from_a_held_state_is_not_raised_to_a_target_the_coordinator_forgot(
        make_node, open_backend, tmp_path, fault):
    """The try-out's sequence: job 300 ends and job 400 starts on GPUs 2 and 3 while GPU 2 is held
    (its start cap: the stale allowance 648.1 W); the fault clears. Before the fix the next tick wrote
    648.1 W (journal 609.8 -> 648.1); now the GPU stays at 609.8 W until a plan newer than its recovery,
    which may raise it."""
    node = make_node(gpus=4)
    agent = make_agent(tmp_path, open_backend(), start_cap_w=700.0)
    held_during_job_300(node, agent, fault)
    agent.job_end(capctl_pb2.JobEndRequest(job_id="300"))
    job_start(agent, "400", 2, 3)
    since_ns = time.monotonic_ns()
    node.clear(2, fault)
    for _ in range(3):
        agent.tick()
    assert journal_w(node, 2, since_ns) == [] and node.read(2)["enforced_w"] == 609.8
    assert agent.caps.states()[2] == capstates.OK
    ack = agent.on_plan(plan(3, {2: 648.1}))  # a fresh plan: the coordinator counts its raise
    assert ack.ok and journal_w(node, 2, since_ns) == [648.1]
    agent.tick()
    assert node.read(2)["enforced_w"] == 648.1


def test_an_idle_gpu_back_from_a_held_state_is_not_restored_above_its_limit(make_node, open_backend, tmp_path):
    """Job 300 ends while GPU 2 is held (never written: the restore stays pending, its ceiling the
    stale allowance 648.1 W; pre-job limit 700 W); the fault clears. Before the fix the retried restore
    wrote 648.1 W; now it is held at 609.8 W, pending, until a plan newer than the recovery."""
    node = make_node(gpus=4)
    agent = make_agent(tmp_path, open_backend(), start_cap_w=300.0)
    held_during_job_300(node, agent, "bad_constraints")
    reply = agent.job_end(capctl_pb2.JobEndRequest(job_id="300"))
    assert reply.ok and "GPU 2 held at 609.8 W: unsupported limit constraints (limit constraints read from the " \
        "device: min 0 W, max 0 W;" in reply.message and "its pre-job limit 700 W not restored by capctl" in reply.message
    since_ns = time.monotonic_ns()
    node.clear(2, "bad_constraints")
    for _ in range(3):
        agent.tick()
    assert journal_w(node, 2, since_ns) == [] and node.read(2)["enforced_w"] == 609.8
    assert agent.caps.saved_limits_w() == {2: 700.0} and agent.caps.held_restores([2]) == {2: (609.8, 700.0)}
    assert agent.on_plan(plan(3, {2: 650.0})).ok  # the coordinator's allowance for the idle GPU
    assert journal_w(node, 2, since_ns) == [650.0]


def test_a_refused_raise_is_not_retried_above_the_limit_once_writes_work_again(make_node, open_backend, tmp_path):
    """A raise refused by the driver (NO_PERMISSION: SET_FAILED) is acknowledged as failed and the
    coordinator counts the GPU at its read-back; the agent kept the raise as its target and retried
    it each interval, so once writes worked again it wrote a cap the coordinator no longer counted
    (648.1 W over a counted 609.8 W until the next telemetry). Now a refused write bounds the GPU at
    its limit until a plan names it again; a refused decrease is still retried."""
    node = make_node(gpus=4)
    agent = make_agent(tmp_path, open_backend(), start_cap_w=700.0)
    job_start(agent, "300", 2, 3)
    assert agent.on_plan(plan(1, {2: 609.8, 3: 609.8})).ok
    node.inject(2, "set_no_permission")
    node.inject(3, "set_no_permission")
    ack = agent.on_plan(plan(2, {2: 648.1, 3: 500.0}))  # a raise and a decrease, both refused
    assert ack is not None and not ack.ok
    assert agent.caps.states()[2] == capstates.SET_FAILED
    since_ns = time.monotonic_ns()
    node.clear(2, "set_no_permission")
    node.clear(3, "set_no_permission")
    for _ in range(3):
        agent.tick()
    assert journal_w(node, 2, since_ns) == [] and node.read(2)["enforced_w"] == 609.8
    assert journal_w(node, 3, since_ns) == [500.0]  # the decrease: retried and written
    assert agent.on_plan(plan(3, {2: 648.1})).ok  # the coordinator plans the raise again: it counts it
    assert journal_w(node, 2, since_ns) == [648.1]
