"""Agent logic in-process on a pure-Python device: no processes, no gRPC servers, no C library.

The agent is built as ``nodeagent.daemon.run`` builds it (a CapManager on the backend and the state
directory), but on :class:`tests.nodeagent.puredevice.PureDevice`; its link is a recorder and its
methods (``on_plan``, ``job_start``, ``job_end``, ``tick``, ...) are called directly.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from capctl import capstates, plancaps
from capctl.v1 import capctl_pb2
from nodeagent.backend import GpuBackend, NvmlPermissionError
from nodeagent.caps import CapManager
from nodeagent.daemon import Agent
from nodeagent.nvml import NvmlBackend
from tests.nodeagent.puredevice import PureDevice


def _as_backend(backend: NvmlBackend) -> GpuBackend:
    """Static check (mypy/pyright): NvmlBackend is a GpuBackend."""
    return backend


class RecordingLink:
    """Stands in for the AgentLink client: records what the agent sends."""

    def __init__(self, connected: bool = True) -> None:
        self.connected = connected
        self.sent: list = []

    def send(self, message, *, droppable: bool = False) -> bool:
        self.sent.append(message)
        return True


def make_agent(tmp_path, device: PureDevice, *, start_cap_w: float = 300.0, safe_cap_w: float | None = None,
               connected: bool = True) -> Agent:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700, exist_ok=True)
    agent = Agent("n1", "unix:/nonexistent", str(tmp_path / "agent.sock"), state_dir, device,
                  CapManager(device, state_dir), start_cap_w=start_cap_w, policy_safe_cap_w=safe_cap_w,
                  interval_s=1.0)
    agent.link = RecordingLink(connected)
    return agent


def plan(seq: int, caps: dict[int, float], *, safe: dict[int, float] | None = None, lease_s: float = 60.0):
    return capctl_pb2.CapPlan(
        seq=seq, lease_s=lease_s,
        caps=[capctl_pb2.CapAssignment(index=i, cap_w=c) for i, c in caps.items()],
        safe_caps=[capctl_pb2.CapAssignment(index=i, cap_w=c) for i, c in (safe or {}).items()])


def job_start(agent: Agent, job_id: str, *gpus: int):
    return agent.job_start(capctl_pb2.JobStartRequest(
        job_id=job_id, gpu_ids=[str(g) for g in gpus], gpu_id_kind=capctl_pb2.GPU_ID_MINOR, user="alice"))


def cap_states(message) -> dict[int, str]:
    return {g.index: capctl_pb2.CapState.Name(g.cap_state) for g in message.gpus}


# --- the protocol -------------------------------------------------------------------------------


def test_nvml_backend_and_the_pure_device_implement_gpu_backend():
    members = {n for n in vars(GpuBackend) if not n.startswith("_")} | set(GpuBackend.__annotations__)
    assert members == {"driver_version", "simulated", "devices", "telemetry_all", "telemetry", "clamp_cap_mw",
                       "get_cap_w", "get_enforced_w", "set_cap_w"}
    assert isinstance(NvmlBackend("simulated"), GpuBackend)  # not opened: the C library is not loaded
    assert isinstance(PureDevice(), GpuBackend)
    assert not isinstance(object(), GpuBackend)


# --- plans --------------------------------------------------------------------------------------


def test_plan_lowers_before_raising_and_reports_the_read_back(tmp_path):
    dev = PureDevice(4, limit_w=400.0)
    agent = make_agent(tmp_path, dev)
    ack = agent.on_plan(plan(1, {0: 600.0, 1: 250.0, 2: 550.0, 3: 300.0}))
    assert ack.ok and ack.seq == 1 and ack.error == ""
    assert dev.writes == [(1, 250.0), (3, 300.0), (2, 550.0), (0, 600.0)]  # decreases first, largest first
    assert {g.index: g.cap_w for g in ack.gpus} == {0: 600.0, 1: 250.0, 2: 550.0, 3: 300.0}
    assert agent.allowed_w == agent.desired_w == {0: 600.0, 1: 250.0, 2: 550.0, 3: 300.0}
    assert agent.last_plan_seq == 1


def test_a_hold_renews_the_lease_and_safe_caps_and_is_not_acknowledged(tmp_path):
    dev = PureDevice(4, limit_w=400.0)
    agent = make_agent(tmp_path, dev)
    agent.on_plan(plan(1, {0: 300.0}, safe={0: 350.0, 1: 350.0}))
    reads = [0]
    inner = dev.telemetry_all

    def counted():
        reads[0] += 1
        return inner()

    dev.telemetry_all = counted
    writes = len(dev.writes)
    agent.lease.expiry_mono_s = time.monotonic() - 1.0  # expired: the hold renews it
    assert agent.on_plan(plan(2, {}, safe={0: 320.0, 1: 330.0}, lease_s=30.0)) is None
    assert agent.lease.expiry_mono_s > time.monotonic() + 20.0
    assert agent.lease.safe_caps_w == {0: 320.0, 1: 330.0}
    assert agent.last_plan_seq == 2 and len(dev.writes) == writes and reads[0] == 0  # no write, no NVML read
    assert agent.link.sent == []  # nothing else went out either
    ack = agent.on_plan(plan(3, {1: 250.0}))  # a plan with caps: acknowledged with its GPUs' read-back
    assert ack.seq == 3 and [g.index for g in ack.gpus] == [1] and reads[0] == 1


def test_packed_plans_and_bad_safe_caps(tmp_path):
    """A packed plan (capctl.plancaps) applies as the per-GPU one; rows that cannot be read are
    not taken at all (no cap, no safe cap, no lease renewal, seq not recorded) and answered not ok,
    a hold too; a safe cap that is no finite watts above 0 (NaN, 0, -5), in either form, is refused
    and the GPU keeps its last one (a NaN won the failsafe's min before)."""
    import math

    from capctl import plancaps

    dev = PureDevice(4, limit_w=400.0)
    agent = make_agent(tmp_path, dev)
    ack = agent.on_plan(capctl_pb2.CapPlan(seq=1, lease_s=60.0, caps_rows=plancaps.pack({0: 300.0, 2: 350.0}),
                                           safe_caps_rows=plancaps.pack({0: 250.0, 1: 260.0})))
    assert ack.ok and {g.index: g.cap_w for g in ack.gpus} == {0: 300.0, 2: 350.0}
    assert agent.lease.safe_caps_w == {0: 250.0, 1: 260.0} and agent.last_plan_seq == 1
    expiry, writes = agent.lease.expiry_mono_s, len(dev.writes)
    for bad in (capctl_pb2.CapPlan(seq=2, lease_s=600.0, caps_rows=plancaps.pack({0: 200.0})[:-1]),
                capctl_pb2.CapPlan(seq=3, lease_s=600.0, safe_caps_rows=plancaps.pack({0: 200.0}) * 65),
                capctl_pb2.CapPlan(seq=4, lease_s=600.0, caps=[capctl_pb2.CapAssignment(index=1, cap_w=250.0)],
                                   caps_rows=plancaps.pack({0: 200.0}))):
        ack = agent.on_plan(bad)
        assert ack is not None and not ack.ok and "CapPlan." in ack.error and ack.seq == bad.seq
        assert len(dev.writes) == writes and agent.lease.expiry_mono_s == expiry and agent.last_plan_seq == 1
        assert agent.lease.safe_caps_w == {0: 250.0, 1: 260.0}
    ack = agent.on_plan(plan(5, {3: 320.0}, safe={0: math.nan, 1: 0.0, 2: -5.0, 3: 300.0}))
    assert not ack.ok and "GPU 0: safe cap nan W refused" in ack.error and "GPU 2: safe cap -5.0 W refused" in ack.error
    assert agent.lease.safe_caps_w == {0: 250.0, 1: 260.0, 3: 300.0} and agent.desired_w[3] == 320.0
    assert agent.on_plan(capctl_pb2.CapPlan(seq=6, lease_s=60.0, safe_caps_rows=plancaps.pack({1: math.inf}))) is None
    assert agent.lease.safe_caps_w[1] == 260.0  # a hold: not acknowledged, its bad safe cap refused all the same


def test_plans_with_too_many_caps_an_endless_lease_or_safe_caps_of_no_gpu_are_refused(tmp_path):
    """Found by a review: 65 per-GPU caps were taken (65 packed ones refused), 200,000 per-GPU safe
    caps were all kept and saved, a plan with ``lease_s`` inf renewed the lease forever (the
    failsafe never fired), and a refused plan's report advice was still followed. Now: more than
    64 caps in either form and a lease that is no finite time up to a day make the plan unreadable
    (not taken at all, answered not ok); a safe cap for a GPU the node does not have is refused
    (not kept), the plan's other parts are taken."""
    import math

    dev = PureDevice(4, limit_w=400.0)
    agent = make_agent(tmp_path, dev)
    assert agent.on_plan(plan(1, {0: 300.0}, safe={0: 250.0})).ok
    expiry, writes, advised = agent.lease.expiry_mono_s, len(dev.writes), agent.report_clock.advised
    many = {i: 300.0 for i in range(65)}
    for bad, why in ((plan(2, many), "CapPlan.caps: 65 caps, at most 64"),
                     (plan(3, {}, safe=many), "CapPlan.safe_caps: 65 caps, at most 64"),
                     (plan(4, {0: 310.0}, lease_s=math.inf), "CapPlan.lease_s inf: need 0 to 86400 s"),
                     (plan(5, {0: 310.0}, lease_s=1e300), "CapPlan.lease_s 1e+300"),
                     (plan(6, {0: 310.0}, lease_s=-1.0), "CapPlan.lease_s -1.0"),
                     (capctl_pb2.CapPlan(seq=7, lease_s=60.0, lease_expiry_s=math.nan, report_in_s=0.3),
                      "CapPlan.lease_expiry_s nan")):
        bad.report_in_s = 0.3
        ack = agent.on_plan(bad)
        assert ack is not None and not ack.ok and why in ack.error, (why, ack.error)
        assert len(dev.writes) == writes and agent.lease.expiry_mono_s == expiry and agent.last_plan_seq == 1
        assert agent.lease.safe_caps_w == {0: 250.0} and agent.report_clock.advised == advised
    ack = agent.on_plan(plan(8, {1: 320.0}, safe={1: 300.0, 9: 300.0, 4294967295: 300.0}))
    assert not ack.ok and "GPU 9 does not exist on n1: its safe cap not kept" in ack.error
    assert agent.lease.safe_caps_w == {0: 250.0, 1: 300.0} and agent.desired_w[1] == 320.0
    assert agent.last_plan_seq == 8 and agent.lease.expiry_mono_s > expiry
    # the Welcome's initial safe caps: the same rule (a GPU of this node, finite watts above 0)
    agent.on_welcome(capctl_pb2.Welcome(protocol_version="capctl.v1", coordinator_id="c2", interval_s=1.0,
                                        safe_caps=[capctl_pb2.CapAssignment(index=i, cap_w=w)
                                                   for i, w in ((0, 240.0), (2, math.nan), (9, 300.0))]))
    assert agent.lease.safe_caps_w == {0: 240.0, 1: 300.0}


def test_replayed_reordered_or_ambiguous_plans_are_refused(tmp_path):
    """Found by a try-out with a fake coordinator: a plan whose seq went back on the same stream
    (seq 1 after 11) was applied, so was a plan naming one GPU twice (the last cap won) and one of
    a phase the protocol does not define. Now none of them is taken (no cap, no lease renewed),
    each answered not ok with why; a new stream (a Welcome) starts the seqs again."""
    dev = PureDevice(4, limit_w=400.0)
    agent = make_agent(tmp_path, dev)
    assert agent.on_plan(plan(11, {0: 300.0}, safe={0: 250.0})).ok
    expiry, writes = agent.lease.expiry_mono_s, len(dev.writes)
    twice = capctl_pb2.CapPlan(seq=13, lease_s=60.0, caps=[capctl_pb2.CapAssignment(index=1, cap_w=250.0),
                                                           capctl_pb2.CapAssignment(index=1, cap_w=650.0)])
    packed_twice = capctl_pb2.CapPlan(seq=14, lease_s=60.0,
                                      caps_rows=plancaps.CAP.pack(2, 250.0) + plancaps.CAP.pack(2, 650.0))
    bogus = plan(15, {0: 350.0})
    bogus.phase = "bogus"
    for bad, why in ((plan(1, {0: 650.0}), "CapPlan.seq 1 not above 11"),
                     (plan(11, {0: 650.0}), "CapPlan.seq 11 not above 11"),
                     (twice, "CapPlan.caps: GPU index 1 twice"),
                     (packed_twice, "CapPlan.caps_rows: GPU index 2 twice"),
                     (bogus, "CapPlan.phase 'bogus': need decrease, increase or hold")):
        ack = agent.on_plan(bad)
        assert ack is not None and not ack.ok and why in ack.error, (why, ack.error)
        assert len(dev.writes) == writes and agent.lease.expiry_mono_s == expiry
    assert agent.on_plan(plan(12, {0: 320.0})).ok  # the next seq: taken
    agent.on_welcome(capctl_pb2.Welcome(protocol_version="capctl.v1", coordinator_id="c2", interval_s=1.0))
    assert agent.on_plan(plan(1, {0: 310.0})).ok and agent.desired_w[0] == 310.0  # a new stream


def test_plan_clamps_to_the_constraints_and_refuses_bad_caps_per_gpu(tmp_path):
    dev = PureDevice(3, limit_w=400.0)
    agent = make_agent(tmp_path, dev)
    ack = agent.on_plan(plan(1, {0: 900.0, 1: -5.0, 7: 300.0}))
    assert not ack.ok
    assert "GPU 1: cap -5.0 W refused" in ack.error and "GPU 7 does not exist on n1" in ack.error
    assert dev.limits_w() == [700.0, 400.0, 400.0]  # 900 W clamped to the 700 W maximum


def test_a_refused_write_fails_only_its_gpu(tmp_path):
    dev = PureDevice(3, limit_w=400.0)
    dev.fail("set", 1, NvmlPermissionError("GPU 1: setting the power limit failed: NO_PERMISSION", gpu_index=1))
    agent = make_agent(tmp_path, dev)
    ack = agent.on_plan(plan(1, {0: 300.0, 1: 300.0, 2: 350.0}))
    assert not ack.ok and "NO_PERMISSION" in ack.error
    assert dev.limits_w() == [300.0, 400.0, 350.0]
    assert cap_states(ack)[1] == capstates.SET_FAILED and "NO_PERMISSION" in agent.gpu_error[1]


# --- jobs ---------------------------------------------------------------------------------------


def test_job_start_applies_the_start_cap_and_lowers_the_allowance(tmp_path):
    dev = PureDevice(4)  # at the 700 W default (the site limit)
    agent = make_agent(tmp_path, dev, start_cap_w=300.0)
    agent.on_plan(plan(1, {0: 500.0, 1: 250.0}))
    reply = job_start(agent, "42", 0)
    assert reply.ok and reply.coordinator_connected
    assert dev.limit_w(0) == 300.0 and agent.allowed_w[0] == 300.0 and agent.desired_w[0] == 300.0
    assert agent.caps.saved_limits_w() == {0: 700.0, 1: 700.0}
    sent = agent.link.sent[-1]
    assert sent.WhichOneof("body") == "job_started" and list(sent.job_started.binding.gpu_indices) == [0]
    reply = job_start(agent, "43", 1)  # the start cap never goes above the coordinator's allowance
    assert reply.ok and dev.limit_w(1) == 250.0 and agent.allowed_w[1] == 250.0
    writes = len(dev.writes)
    again = job_start(agent, "42", 0)  # idempotent: nothing written again
    assert again.ok and "already bound" in again.message and len(dev.writes) == writes


def test_job_start_without_a_lease_stays_at_or_below_the_safe_cap(tmp_path):
    dev = PureDevice(2)
    agent = make_agent(tmp_path, dev, start_cap_w=300.0, safe_cap_w=260.0, connected=False)
    reply = job_start(agent, "42", 0, 1)
    assert reply.ok and not reply.coordinator_connected
    assert dev.limits_w() == [260.0, 260.0] and agent.allowed_w == {}  # no allowance without a coordinator


def test_job_end_restores_only_within_the_allowance(tmp_path):
    dev = PureDevice(2)  # site (pre-job) limit 700 W
    agent = make_agent(tmp_path, dev, start_cap_w=300.0)
    agent.on_plan(plan(1, {0: 500.0}))
    job_start(agent, "42", 0)
    writes = len(dev.writes)
    reply = agent.job_end(capctl_pb2.JobEndRequest(job_id="42"))
    assert reply.ok and agent.jobs == {} and 0 not in agent.desired_w
    assert all(w <= 300.0 for _, w in dev.writes[writes:]) and dev.limit_w(0) == 300.0  # held at the allowance
    assert agent.caps.saved_limits_w() == {0: 700.0}  # the restore is still to complete
    assert agent.link.sent[-1].WhichOneof("body") == "job_ended"
    agent.tick()
    assert dev.limit_w(0) == 300.0  # a tick does not raise it either
    agent.on_plan(plan(2, {0: 700.0}))  # the coordinator hands the watts back: the restore completes
    assert dev.limit_w(0) == 700.0 and agent.safe_mode == set()  # back at its pre-job limit, planned again


def test_job_end_without_an_allowance_restores_the_site_limit(tmp_path):
    dev = PureDevice(2, limit_w=250.0)  # site limit 250 W, default 700 W
    agent = make_agent(tmp_path, dev, start_cap_w=300.0, connected=False)
    job_start(agent, "42", 0)
    assert dev.limit_w(0) == 250.0  # no allowance known: the start cap never raises a GPU (review)
    agent.job_end(capctl_pb2.JobEndRequest(job_id="42"))
    agent = make_agent(tmp_path, dev, start_cap_w=220.0, connected=False)
    job_start(agent, "42", 1)
    assert dev.limit_w(1) == 220.0
    reply = agent.job_end(capctl_pb2.JobEndRequest(job_id="42"))
    assert reply.ok and dev.limits_w() == [250.0, 250.0] and agent.caps.saved_limits_w() == {}
    again = agent.job_end(capctl_pb2.JobEndRequest(job_id="42"))  # idempotent
    assert again.ok and "nothing to restore" in again.message


# --- failsafe and boot --------------------------------------------------------------------------


def test_failsafe_on_lease_expiry_never_raises_a_cap(tmp_path):
    dev = PureDevice(4)
    agent = make_agent(tmp_path, dev)
    agent.on_plan(plan(1, {0: 250.0, 1: 600.0, 2: 450.0}, safe={0: 400.0, 1: 400.0, 2: 400.0}))
    before = dev.limits_w()
    writes = len(dev.writes)
    agent.lease.expiry_mono_s = time.monotonic() - 1.0
    agent.tick()
    assert dev.limits_w() == [250.0, 400.0, 400.0, 700.0]  # min(current, safe); GPU 3 unmanaged
    assert all(w <= before[i] for i, w in dev.writes[writes:])
    assert agent.safe_mode == {0, 1, 2} and agent.allowed_w == {0: 250.0, 1: 400.0, 2: 400.0}
    telemetry = agent.link.sent[-1].telemetry
    assert cap_states(telemetry) == {0: capstates.SAFE_CAP, 1: capstates.SAFE_CAP, 2: capstates.SAFE_CAP,
                                     3: capstates.OK}
    writes = len(dev.writes)
    agent.tick()  # applied once per expiry
    assert len(dev.writes) == writes
    agent.on_plan(plan(2, {1: 450.0}))  # a new plan renews the lease and leaves the failsafe
    assert agent.safe_mode == set() and dev.limit_w(1) == 450.0


def test_an_agent_restarted_without_a_coordinator_applies_the_failsafe_after_its_saved_lease(tmp_path):
    """An agent restarted while its coordinator is down held no lease: its bound GPUs stayed at the
    coordinator's last caps for good (550 W, the safe cap 350 W; found by a review). At start it
    now gives itself the last lease a plan gave (saved: 3 s here), then the failsafe applies
    min(current, safe cap) as after any expiry; a plan before then renews it as usual."""
    import json

    dev = PureDevice(4, limit_w=700.0)
    agent = make_agent(tmp_path, dev)
    assert job_start(agent, "11", 0, 1).ok
    agent.on_plan(plan(1, {0: 550.0, 1: 550.0}, safe={0: 350.0, 1: 350.0, 2: 350.0, 3: 350.0}, lease_s=3.0))
    agent.save_state()
    assert json.loads((tmp_path / "state" / "agent-state.json").read_text())["lease_s"] == 3.0
    again = make_agent(tmp_path, dev)  # the restart: same devices, same state directory
    again.load_state()
    again.boot_safe_caps()
    t0 = time.monotonic()
    again.arm_boot_lease(now_mono_s=t0)
    assert again.lease.remaining_s(t0) == 3.0 and not again.lease.expired(t0 + 2.9)
    again.tick()
    assert dev.limit_w(0) == dev.limit_w(1) == 550.0  # within the lease: untouched
    again.lease.expiry_mono_s = time.monotonic() - 0.1  # (the lease ran out)
    again.tick()
    assert dev.limit_w(0) == dev.limit_w(1) == 350.0 and again.safe_mode >= {0, 1}


def test_a_state_file_out_of_range_is_read_with_named_defaults(tmp_path, caplog):
    """``last_plan_seq`` -5 or 1e30 made every hello fail with a traceback, a term of 2**63 refused
    every plan, a NaN safe cap or a bad lease were taken (found by a review): each is logged with
    the file, the field, the value and what is allowed, and its default used."""
    import json
    import logging

    from nodeagent import agentstate

    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "agent-state.json").write_text(json.dumps({
        "last_plan_seq": -5, "coordinator_term": 2 ** 63, "lease_s": 1e9,
        "safe_caps_w": {"0": 300.0, "1": "nan", "99": 300.0}}))
    with caplog.at_level(logging.ERROR, logger="capctl.agent"):
        agent = make_agent(tmp_path, PureDevice(2))
        agent.load_state()
    assert agent.last_plan_seq == 0 and agent.fence.newest == 0 and agent.lease_s == agentstate.DEFAULT_LEASE_S
    assert agent.lease.safe_caps_w == {0: 300.0}
    text = caplog.text
    for needle in ("last_plan_seq -5 is not allowed (allowed: an integer 0 to 9223372036854775807); using 0",
                   "coordinator_term 9223372036854775808 is not allowed", "lease_s 1000000000.0 is not allowed",
                   "safe_caps_w['1'] 'nan' is not allowed", "safe_caps_w['99'] 300.0 is not allowed"):
        assert needle in text, (needle, text)
    assert "agent-state.json" in text
    agent.hello()  # a hello is built (it raised ValueError: Value out of range before)


def test_a_lost_gpu_is_reported_and_does_not_stop_the_failsafe(tmp_path):
    dev = PureDevice(3)
    agent = make_agent(tmp_path, dev)
    agent.on_plan(plan(1, {0: 600.0, 1: 600.0, 2: 600.0}, safe={0: 300.0, 1: 300.0, 2: 300.0}))
    dev.lose(1)
    agent.lease.expiry_mono_s = time.monotonic() - 1.0
    agent.tick()
    assert dev.limit_w(0) == 300.0 and dev.limit_w(2) == 300.0
    states = cap_states(agent.link.sent[-1].telemetry)
    assert states[1] == capstates.LOST and states[0] == states[2] == capstates.SAFE_CAP


def test_boot_moves_gpus_at_their_default_to_the_saved_safe_cap(tmp_path):
    dev = PureDevice(3)
    dev.set_limit_w(1, 500.0)  # not at its default: left alone
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "agent-state.json").write_text(json.dumps(
        {"safe_caps_w": {"0": 350.0, "1": 350.0}, "last_plan_seq": 17, "jobs": {}}))
    agent = make_agent(tmp_path, dev)
    agent.load_state()
    agent.boot_safe_caps()
    assert dev.limits_w() == [350.0, 500.0, 700.0] and agent.last_plan_seq == 17
    assert agent.caps.saved_limits_w() == {}  # unbound GPUs: no pre-job limit saved
    agent.save_state()
    saved = json.loads((state_dir / "agent-state.json").read_text())
    assert saved["safe_caps_w"] == {"0": 350.0, "1": 350.0} and saved["last_plan_seq"] == 17


@pytest.mark.parametrize("kind, ids", [
    (capctl_pb2.GPU_ID_UUID, ["GPU-PURE-0002"]),
    (capctl_pb2.GPU_ID_PCI_BUS_ID, ["0000:1a:00.0"]),
    (capctl_pb2.GPU_ID_MINOR, ["2", "2"]),
])
def test_gpu_ids_map_to_indices(tmp_path, kind, ids):
    agent = make_agent(tmp_path, PureDevice(4))
    assert agent.map_gpu_ids(ids, kind) == [2]


def test_job_end_names_only_the_gpus_it_restored(tmp_path):
    from nodeagent.backend import NvmlPermissionError

    dev = PureDevice(2, limit_w=650.0)
    agent = make_agent(tmp_path, dev, start_cap_w=300.0, connected=False)
    job_start(agent, "42", 0, 1)
    dev.fail("set", 1, NvmlPermissionError("no permission", gpu_index=1))
    reply = agent.job_end(capctl_pb2.JobEndRequest(job_id="42"))
    assert not reply.ok and dev.limits_w() == [650.0, 300.0]
    assert "restored GPUs [0]" in reply.message and "GPUs [1] could not be restored" in reply.message


def test_a_restarted_agent_keeps_a_held_restore_below_the_allowance_it_no_longer_knows(tmp_path):
    dev = PureDevice(2)  # pre-job limit 700 W
    agent = make_agent(tmp_path, dev, start_cap_w=300.0)
    agent.on_plan(plan(1, {0: 450.0}, safe={0: 350.0, 1: 350.0}))
    job_start(agent, "42", 0)
    reply = agent.job_end(capctl_pb2.JobEndRequest(job_id="42"))
    assert dev.limit_w(0) == 300.0 and agent.caps.saved_limits_w() == {0: 700.0}  # held at the allowance
    # said as held, not as restored (the epilog logged "restored 1 GPU(s)" for it: a try-out)
    assert reply.ok and "restored GPUs" not in reply.message
    assert "held below the pre-job limit by the coordinator's allowance" in reply.message
    assert "GPU 0 at 300 W of 700 W" in reply.message
    agent.save_state()
    again = make_agent(tmp_path, dev, start_cap_w=300.0)  # a restart: allowances are not saved
    again.load_state()
    again.tick()
    assert dev.limit_w(0) == 350.0  # at most its safe cap without a lease, never the 700 W pre-job limit
    again.on_plan(plan(2, {0: 700.0}, safe={0: 350.0, 1: 350.0}))  # the coordinator hands the watts back
    assert dev.limit_w(0) == 700.0 and again.caps.saved_limits_w() == {}


def test_jobs_left_in_the_drop_box_are_ended_at_the_next_interval(tmp_path):
    from capctl import endedjobs

    dev = PureDevice(2, limit_w=650.0)
    agent = make_agent(tmp_path, dev, start_cap_w=300.0, connected=False)
    job_start(agent, "42", 0, 1)
    agent.tick()
    assert set(agent.jobs) == {"42"} and dev.limits_w() == [300.0, 300.0]
    left = endedjobs.leave(agent.socket_path, "42")  # the epilog could not reach the agent
    started = agent.energy.jobs["42"].start_time_s = time.time() - 10.0  # (as if started 10 s ago)
    os.utime(left, (started + 0.5, started + 0.5))  # it ran then; the agent takes it later
    endedjobs.leave(agent.socket_path, "7")  # an end that did arrive, or a job never bound here
    (tmp_path / "agent.sock.ended" / "bad name").write_text("")  # not a job id: ignored
    agent.tick()
    assert agent.jobs == {} and dev.limits_w() == [650.0, 650.0]  # unbound, pre-job limits restored
    assert endedjobs.waiting(agent.socket_path) == [] and agent.link.sent[-2].WhichOneof("body") == "job_ended"
    # its end is when the epilog left it, not when the agent took it (a try-out: 41 s for a 26 s job)
    (ended,) = [m.job_ended for m in agent.link.sent if m.WhichOneof("body") == "job_ended" and m.job_ended.job_id == "42"]
    assert ended.energy.end_time_s == pytest.approx(started + 0.5, abs=1e-3)


def test_the_failsafe_also_lowers_an_idle_gpu_whose_restore_is_held(tmp_path):
    """A job ends while the coordinator is away: its GPU's restore is held at the last allowance
    (600 W of the 700 W pre-job limit). When the lease expires, that GPU goes to the safe cap too
    (before: only bound GPUs and GPUs with a desired cap; it kept 600 W, state OK)."""
    dev = PureDevice(2)  # pre-job limits 700 W
    agent = make_agent(tmp_path, dev)
    agent.on_plan(plan(1, {0: 600.0, 1: 500.0}, safe={0: 350.0, 1: 350.0}))
    assert job_start(agent, "J", 0).ok
    agent.on_plan(plan(2, {0: 600.0, 1: 500.0}, safe={0: 350.0, 1: 350.0}))
    assert dev.limit_w(0) == 600.0
    agent.link.connected = False  # the coordinator goes away
    agent.job_end(capctl_pb2.JobEndRequest(job_id="J"))
    assert dev.limit_w(0) == 600.0 and agent.caps.saved_limits_w()[0] == 700.0  # held at the allowance
    assert agent.caps.held_restores([0]) == {0: (600.0, 700.0)} and 0 not in agent.desired_w
    agent.lease.expiry_mono_s = time.monotonic() - 1.0
    agent.tick()
    assert dev.limit_w(0) == 350.0 and dev.limit_w(1) == 350.0  # both at the safe cap
    assert 0 in agent.safe_mode and agent.caps.saved_limits_w()[0] == 700.0  # still to be restored later
    agent.link.connected = True
    agent.on_plan(plan(3, {0: 700.0, 1: 500.0}, safe={0: 350.0, 1: 350.0}))  # the coordinator allows it
    agent.tick()
    assert dev.limit_w(0) == 700.0 and agent.safe_mode == set()  # back at its pre-job limit, planned again


def test_job_end_takes_the_job_ids_job_start_takes(tmp_path):
    """JobEnd checked only the length: ``1; rm -rf /`` went into its log lines and ``JobEnded``
    while JobStart refused it (found by a review). Both take Slurm job ids only; array and
    heterogeneous ids pass."""
    from capctl.errors import UserInputError

    agent = make_agent(tmp_path, PureDevice(2, limit_w=400.0))
    for bad in ("1; rm -rf /", "../../x", "a b", "7\n8"):
        with pytest.raises(UserInputError, match="job_id"):
            agent.job_end(capctl_pb2.JobEndRequest(job_id=bad))
    for good in ("1234_7", "1234+1", " 99 "):
        assert agent.job_end(capctl_pb2.JobEndRequest(job_id=good)).ok


def test_a_stalled_or_lost_state_ends_at_the_next_good_reading_without_a_desired_cap(tmp_path):
    """A GPU whose job ended while it stalled has no desired cap: the reconcile that ends a STALLED
    state never saw it, and it stayed STALLED for good (the coordinator held it; found by a review).
    Its next good reading ends it, and its error of then goes too."""
    dev = PureDevice(2)
    agent = make_agent(tmp_path, dev)
    agent.tick()
    agent.caps._rt[1].state, agent.caps._rt[1].message = capstates.STALLED, "has not returned after 2.0 s"
    agent.gpu_error[1] = "GPU 1: has not returned after 2.0 s"
    assert 1 not in agent.desired_w
    agent.tick()
    assert cap_states(agent.link.sent[-1].telemetry)[1] == capstates.OK
    assert agent.caps.message(1) == "" and 1 not in agent.gpu_error


def test_one_agent_per_state_directory(tmp_path):
    """Two agents on one state directory called each other FOREIGN_WRITER and undid each other's
    restores (found by a review): the second is refused, its message naming the holder's pid; the
    lock goes with the holder."""
    import os

    from capctl.errors import UserInputError
    from nodeagent.daemon import lock_state_dir

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    fd = lock_state_dir(state)
    try:
        with pytest.raises(UserInputError, match=rf"another capctl-agent holds it \(pid {os.getpid()}\)"):
            lock_state_dir(state)
    finally:
        os.close(fd)
    os.close(lock_state_dir(state))  # free again


def test_gpus_lowered_at_boot_stay_lowered_after_a_driver_reload(tmp_path):
    """Boot lowered idle GPUs at their default to the saved safe cap; a driver reload (limits back
    to the default) then left them at 700 W while no coordinator had been reached (found by a
    review): the reconcile keeps them at the safe cap."""
    dev = PureDevice(3)
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    (state_dir / "agent-state.json").write_text(json.dumps({"safe_caps_w": {"0": 350.0, "1": 350.0}}))
    agent = make_agent(tmp_path, dev, connected=False)
    agent.load_state()
    agent.boot_safe_caps()
    agent.tick()
    assert dev.limits_w() == [350.0, 350.0, 700.0]
    for i in range(3):
        dev.set_limit_w(i, 700.0)  # the reload
    agent.tick()
    assert dev.limits_w() == [350.0, 350.0, 700.0]  # GPU 2: no safe cap known, never lowered


def test_a_binding_change_that_could_not_be_saved_says_so_and_is_written_later(tmp_path, monkeypatch):
    """A read-only state directory: JobStart and JobEnd answered only "ok", and after a restart the
    ended job came back bound (found by a review). The replies now say the change is not saved,
    and the state file is written again at the next interval once it can be."""
    import json

    from nodeagent import caps as caps_mod

    dev = PureDevice(2)
    agent = make_agent(tmp_path, dev)
    real = caps_mod.store_state
    broken = [True]

    def store(path, state):
        if broken[0]:
            raise OSError(30, "Read-only file system")
        real(path, state)

    monkeypatch.setattr(caps_mod, "store_state", store)
    broken[0] = False
    assert job_start(agent, "11", 0).ok
    broken[0] = True  # the state directory turns read-only (a remount)
    reply = agent.job_end(capctl_pb2.JobEndRequest(job_id="11"))
    assert reply.ok and "NOT SAVED" in reply.message and "Read-only file system" in reply.message
    saved = json.loads((tmp_path / "state" / "caps-state.json").read_text())
    assert saved["bindings"] == {"11": [0]}  # (what a restart now would read)
    broken[0] = False
    agent.tick()
    saved = json.loads((tmp_path / "state" / "caps-state.json").read_text())
    assert saved["bindings"] == {} and agent.caps.store_problem == ""
    assert "NOT SAVED" not in job_start(agent, "12", 1).message


def test_a_gpu_error_repeated_each_interval_is_logged_once_a_minute(tmp_path, caplog, monkeypatch):
    """A write that fails each interval logged an ERROR line each time (2 a second per GPU at a
    0.5 s interval; found by a review): the same text of one GPU is logged once per REPEAT_LOG_S,
    with the count of those not logged."""
    import logging

    from nodeagent import caps as caps_mod

    agent = make_agent(tmp_path, PureDevice(2))
    clock = [1000.0]
    monkeypatch.setattr(caps_mod.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.ERROR, logger="capctl.nodeagent.caps"):
        for _ in range(10):
            agent.caps._log_error(1, "GPU 1: set to 300.000 W failed: NO_PERMISSION")
            agent.caps._log_error(1, "GPU 1: limit constraints unusable")
            clock[0] += 0.5
        clock[0] += caps_mod.REPEAT_LOG_S
        agent.caps._log_error(1, "GPU 1: set to 300.000 W failed: NO_PERMISSION")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["GPU 1: set to 300.000 W failed: NO_PERMISSION", "GPU 1: limit constraints unusable",
                     "GPU 1: set to 300.000 W failed: NO_PERMISSION (and 9 times more in 65 s)"], lines


def test_a_restore_to_the_limit_the_gpu_already_has_completes_without_a_write(tmp_path):
    """Writes that always fail (NO_PERMISSION) on a GPU already at its pre-job limit: the restore
    was RESTORE_FAILED and retried forever (found by a review). Nothing is to be written: restored.
    A GPU not at it stays RESTORE_FAILED (retried)."""
    dev = PureDevice(2, limit_w=250.0)
    agent = make_agent(tmp_path, dev)
    assert job_start(agent, "11", 0, 1).ok
    agent.on_plan(plan(1, {0: 250.0, 1: 280.0}))  # GPU 0 at its pre-job limit, GPU 1 away from it
    for i in (0, 1):
        dev.fail("set", i, NvmlPermissionError(f"GPU {i}: setting the power limit failed: NO_PERMISSION", gpu_index=i))
    agent.job_end(capctl_pb2.JobEndRequest(job_id="11"))
    states = agent.caps.states()
    assert states[0] == capstates.OK and 0 not in agent.caps.saved_limits_w()
    assert states[1] == capstates.RESTORE_FAILED and 1 in agent.caps.saved_limits_w()


def test_the_start_cap_never_raises_a_gpu_without_a_known_allowance(tmp_path):
    """An agent restarted keeps no allowance: JobStart raised idle GPUs the coordinator held at
    200 W to the 300 W start cap, and the cluster went 170-200 W over its budget for 30-70 ms
    (found by a review with the journal). Without an allowance the start cap only lowers; with
    one, as before, at most the allowance."""
    dev = PureDevice(3, limit_w=200.0)
    agent = make_agent(tmp_path, dev, start_cap_w=300.0)
    agent.on_plan(plan(1, {2: 250.0}))  # an allowance for GPU 2 only
    assert job_start(agent, "7", 0, 2).ok
    assert dev.limit_w(0) == 200.0 and dev.limit_w(2) == 250.0
    assert all(w <= 250.0 for _, w in dev.writes)


def test_a_job_starts_reply_lists_each_gpu_where_it_belongs():
    # the reply named every GPU "start cap applied" even when its write failed (a try-out)
    from types import SimpleNamespace

    from nodeagent.jobs import _start_outcome

    ok = SimpleNamespace(ok=True, error="", state=capstates.OK)
    failed = SimpleNamespace(ok=False, error="GPU 1: NVML: no permission", state=capstates.SET_FAILED)
    held = SimpleNamespace(ok=False, error="GPU 2: bad constraints", state=capstates.UNSUPPORTED_CONSTRAINTS)
    text = _start_outcome({0: 300.0, 1: 300.0, 2: 300.0, 3: 300.0}, {0: ok, 1: failed, 2: held})
    assert text == ("start cap applied to [0]; held at their limit (bad device data): [2]; start cap failed on "
                    "[1, 3] (see gpus)")
    assert _start_outcome({0: 300.0}, {0: ok}) == "start cap applied to [0]"
