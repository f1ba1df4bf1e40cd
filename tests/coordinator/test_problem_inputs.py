"""The coordinator's observed state -> problem: GPUs without a valid reading, thermal learning,
configuration alerts (node outside the policy, a node's stream replaced again and again).

In-process: the real Coordinator, Registry and Models with protobuf messages; the agent sessions
are stand-ins that drop every plan (no gRPC needed for these rules)."""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np

from capctl.allocator.thermal import THERMAL_PRIOR
from coordinator import allocation
from coordinator.loop import REPLACED_MAX, Coordinator
from coordinator.models import Models
from coordinator.registry import Registry
from capctl.policy.validate import parse_policy

from capctl.v1 import capctl_pb2 as pb

POLICY = """
version: 1
budget_w: 20000
interval_s: 2
objective: proportional
thermal: {margin_c: 5}
slew_w: null
idle_cap_w: 200
min_cap_w: null
failsafe: {lease_s: 10, safe_cap_w: null}
weights: {default: 1.0}
domains:
  name: cluster
  kind: cluster
  gpu_model: H100-SXM
  gpus_per_node: 2
  children:
    - {name: pdu-a, kind: pdu, limit_w: 4500, nodes: "node1"}
    - {name: pdu-b, kind: pdu, limit_w: 4500, nodes: "node2"}
"""


class Session:
    """Stand-in for server.AgentSession: plans are dropped (send -> False)."""

    def __init__(self, peer="127.0.0.1:1"):
        self.peer = peer
        self.waiters: dict = {}
        self.sent: dict = {}
        self.closed = ""

    def send(self, msg) -> bool:
        return False

    def close(self, why: str = "") -> None:
        self.closed = why


class Recording(Session):
    """A session whose plans are kept (send -> True)."""

    def __init__(self):
        super().__init__()
        self.msgs = []

    def send(self, msg) -> bool:
        self.msgs.append(msg)
        return True


def hello(node, n_gpus=2, jobs=()):
    return pb.AgentHello(
        protocol_version="capctl.v1", node=node, simulated=True,
        gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H100 80GB HBM3", min_cap_w=200.0,
                         max_cap_w=700.0, default_cap_w=700.0, slowdown_temp_c=87.0, shutdown_temp_c=92.0,
                         max_sm_clock_mhz=1980) for i in range(n_gpus)],
        jobs=[pb.JobBinding(job_id=j, node=node, gpu_indices=list(range(n_gpus))) for j in jobs])


def telemetry(node, seq, rows):
    """rows: (enforced_w, power_w, temp_c) per GPU; (0, 0, 0) = the zeroed sample of an agent
    that could not read its GPU yet."""
    return pb.NodeTelemetry(node=node, seq=seq, gpus=[
        pb.GpuTelemetry(index=i, power_w=p, cap_w=e, enforced_w=e, temp_c=t, sm_clock_mhz=1800 if e else 0,
                        clocks_event_reasons=["SW_POWER_CAP"] if e else [], utilization_pct=100.0 if e else 0.0)
        for i, (e, p, t) in enumerate(rows)])


def test_zeroed_telemetry_is_no_reading_gpu_fixed_and_no_model_learns_from_it():
    now = [0.0]
    reg = Registry(clock=lambda: now[0])
    models = Models(clock=lambda: now[0], budget_clock=lambda: now[0])
    policy = parse_policy(POLICY)
    for n in ("node1", "node2"):
        reg.on_hello(hello(n, jobs=("j1",)), Session())
    temps = 40.0
    for k in range(40):
        now[0] = 2.0 * k
        temps += 0.5
        # node1 GPU 0 keeps sending zeros (e.g. NVML not answering yet); the others real readings
        reg.on_telemetry("node1", telemetry("node1", k, [(0.0, 0.0, 0.0), (450.0, 440.0, temps)]))
        reg.on_telemetry("node2", telemetry("node2", k, [(450.0, 440.0 + k, temps), (450.0, 430.0 + k, temps)]))
        models.update(reg, 2.0)
    g0 = reg.nodes["node1"].gpus[0]
    assert not g0.have_reading and g0.accounted_w(now[0], 2.0) == 700.0
    assert g0.temp_c == 0.0 and g0.enforced_w == 0.0  # nothing recorded from the zeroed samples
    assert reg.nodes["node1"].gpus[1].have_reading
    inputs = allocation.build_inputs(reg, models, policy, now[0], 10.0, 2.0)
    by_key = {g.key: g for g in inputs.gpus}
    fixed = by_key[("node1", 0)]
    assert fixed.fixed and fixed.min_cap_w == fixed.max_cap_w == 700.0  # held at its accounted cap
    assert not by_key[("node1", 1)].fixed and not by_key[("node2", 0)].fixed
    # no model learned from the zeros: node1's thermal fit never got a sample (one GPU has none),
    # node2's did; GPU 0's curve model saw no observation
    r1, tau1, inlet1 = models.thermal("node1")[1]
    prior = (THERMAL_PRIOR["r_c_per_w"][0], THERMAL_PRIOR["tau_s"][0], THERMAL_PRIOR["inlet_c"][0])
    assert np.allclose((r1, tau1, inlet1), prior, rtol=1e-9)
    assert models.nodes["node1"].last_t == -math.inf and models.nodes["node2"].last_t > 0
    assert models.thermal("node2")[0] != models.thermal("node1")[1]
    assert models.gpus[("node1", 0)].curve_fit.n_samples == 0
    assert models.gpus[("node1", 1)].curve_fit.n_samples > 0
    # a zeroed ack read-back is no reading either: the cap sent keeps counting
    g1 = reg.nodes["node1"].gpus[1]
    g1.pending[7] = 600.0
    reg.on_ack("node1", pb.CapAck(seq=7, ok=True, gpus=[pb.GpuTelemetry(index=1)]), {1: 600.0})
    assert g1.enforced_w == 450.0 and g1.accounted_w(now[0], 2.0) == 600.0


def _coordinator():
    return Coordinator(parse_policy(POLICY), "<test>")


def test_node_outside_the_policy_and_replaced_streams_alert_once(caplog):
    coord = _coordinator()
    reg = coord.registry
    for n in ("node1", "node2", "node9"):
        reg.on_hello(hello(n, jobs=(f"job-{n}",)), Session())
        reg.on_telemetry(n, telemetry(n, 1, [(400.0, 390.0, 50.0), (400.0, 390.0, 50.0)]))
    unlisted = ("node node9 is not in the policy: counted only against the cluster budget, outside every "
                "PDU/rack limit — fix the policy or the agent's --node")
    with caplog.at_level(logging.WARNING, logger="capctl.coordinator.loop"):
        for _ in range(3):
            asyncio.run(coord.tick())
            alerts = list(coord.view.resolve().status.alerts)
            assert unlisted in alerts
            assert not any("replaced" in a for a in alerts)
        # node1's stream replaced REPLACED_MAX + 1 times within a minute: two agents claim it
        for k in range(REPLACED_MAX + 1):
            reg.on_hello(hello("node1", jobs=("job-node1",)), Session(peer=f"127.0.0.{2 + k % 2}:1"))
        for _ in range(2):
            asyncio.run(coord.tick())
            alerts = list(coord.view.resolve().status.alerts)
            assert f"two agents claim node node1? its stream was replaced {REPLACED_MAX + 1} times in 60 s" in alerts
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings.count(unlisted) == 1
    assert sum("two agents claim node node1" in w for w in warnings) == 1


def test_one_restart_is_not_a_replaced_stream_alert():
    coord = _coordinator()
    reg = coord.registry
    reg.on_hello(hello("node1"), Session())
    for k in range(REPLACED_MAX):
        reg.on_hello(hello("node1"), Session())
    assert reg.replacements(60.0) == {"node1": REPLACED_MAX}
    assert not any("claim" in a for a in coord._watch_alerts(reg.clock()))


def test_status_shows_ceilings_only_where_they_constrain():
    from coordinator.loop import _shown_ceiling_w

    assert _shown_ceiling_w(8554.0, 200.0, 700.0) == 700.0    # cool GPU: the device maximum, not "8554 W"
    assert math.isnan(_shown_ceiling_w(math.inf, 200.0, 700.0))  # no estimate: null, not "0 W"
    assert _shown_ceiling_w(-590.1, 200.0, 700.0) == 200.0    # too hot: held at its minimum
    assert _shown_ceiling_w(650.0, 200.0, 700.0) == 650.0


def test_a_gpu_bound_to_two_jobs_is_the_first_bindings_everywhere():
    """GPU 1 of node1 is bound to jA and jB (a shared GPU): the registry's job of it, the energy
    charged for it, the solver inputs and the models all name the first binding (jA, in the order
    the registry holds node1's bindings); jB keeps GPU 2, GPU 3 is idle."""
    now = [0.0]
    reg = Registry(clock=lambda: now[0])
    models = Models(clock=lambda: now[0], budget_clock=lambda: now[0])
    msg = hello("node1", n_gpus=4)
    msg.jobs.extend([pb.JobBinding(job_id="jA", node="node1", gpu_indices=[0, 1]),
                     pb.JobBinding(job_id="jB", node="node1", gpu_indices=[2, 1])])
    reg.on_hello(msg, Session())
    node = reg.nodes["node1"]
    assert list(node.bindings) == ["jA", "jB"]
    energy_j = [1000.0, 2000.0, 3000.0, 4000.0]
    for k, step_j in enumerate([0.0, 100.0]):  # the first sample only sets each counter's base
        now[0] = 2.0 * k
        energy_j = [e + step_j * (i + 1) for i, e in enumerate(energy_j)]  # GPU i: (i + 1) * 100 J
        reg.on_telemetry("node1", pb.NodeTelemetry(node="node1", seq=k, gpus=[
            pb.GpuTelemetry(index=i, power_w=400.0, cap_w=450.0, enforced_w=450.0, temp_c=60.0, sm_clock_mhz=1800,
                            utilization_pct=100.0, energy_j=e) for i, e in enumerate(energy_j)]))
        models.update(reg, 2.0)
    assert [reg.job_of(node, i) for i in range(4)] == ["jA", "jA", "jB", ""]
    assert dict(reg.job_energy_j) == {"jA": 100.0 + 200.0, "jB": 300.0}  # GPU 1's 200 J to jA only
    inputs = allocation.build_inputs(reg, models, parse_policy(POLICY), now[0], 10.0, 2.0)
    assert [(g.key, g.job) for g in inputs.gpus] == [
        (("node1", 0), "jA"), (("node1", 1), "jA"), (("node1", 2), "jB"), (("node1", 3), None)]
    assert inputs.jobs == {"jA": 1.0, "jB": 1.0}
    assert [models.gpus[("node1", i)].job_id for i in range(4)] == ["jA", "jA", "jB", ""]
    # JobStarted of jB again (an agent's resend) keeps the registry's order: GPU 1 stays jA's
    reg.on_job_started("node1", pb.JobBinding(job_id="jB", node="node1", gpu_indices=[1, 2]))
    inputs = allocation.build_inputs(reg, models, parse_policy(POLICY), now[0], 10.0, 2.0)
    assert [g.job for g in inputs.gpus] == ["jA", "jA", "jB", None] and reg.job_of(node, 1) == "jA"


def test_a_plan_with_a_cap_that_is_no_number_is_not_sent_and_the_next_node_still_gets_its_plan(caplog):
    coord = _coordinator()
    sessions = {n: Recording() for n in ("node1", "node2")}
    for n, s in sessions.items():
        coord.registry.on_hello(hello(n), s)
        coord.registry.nodes[n].session = s

    async def send_both():
        with caplog.at_level(logging.ERROR, logger="capctl.coordinator.loop"):
            bad = coord.send_plan("node1", "increase", {0: None}, {0: 300.0})
            good = coord.send_plan("node2", "increase", {0: 350.0}, {0: 300.0})
        return bad, good

    bad, good = asyncio.run(send_both())
    assert bad is None and sessions["node1"].msgs == [] and not coord.registry.nodes["node1"].gpus[0].pending
    assert good is True and [c.cap_w for c in sessions["node2"].msgs[0].plan.caps] == [350.0]
    assert any("node1" in r.getMessage() and "None" in r.getMessage() for r in caplog.records)


def test_a_hold_expects_no_ack_and_an_older_agents_ack_of_one_still_counts():
    coord = _coordinator()
    s = Recording()
    s.node = "node1"
    coord.registry.on_hello(hello("node1"), s)
    coord.registry.nodes["node1"].session = s
    coord.registry.on_telemetry("node1", telemetry("node1", 1, [(400.0, 380.0, 60.0), (400.0, 380.0, 60.0)]))

    async def send():
        return coord.send_plan("node1", "hold", {}, {0: 300.0, 1: 300.0}), \
            coord.send_plan("node1", "increase", {1: 450.0}, {0: 300.0, 1: 300.0})

    hold, inc = asyncio.run(send())
    assert hold is True and inc is True
    seqs = [m.plan.seq for m in s.msgs]
    assert list(s.sent) == [seqs[1]]  # only the plan with caps waits for its acknowledgement
    # an agent of an earlier release acknowledges the hold too: its read-back is recorded
    coord.on_ack(s, pb.CapAck(seq=seqs[0], ok=True, gpus=[
        pb.GpuTelemetry(index=0, cap_w=390.0, enforced_w=390.0, power_w=370.0)]))
    g0, g1 = coord.registry.nodes["node1"].gpus[0], coord.registry.nodes["node1"].gpus[1]
    assert g0.enforced_w == 390.0 and g1.pending == {seqs[1]: 450.0}
    coord.on_ack(s, pb.CapAck(seq=seqs[1], ok=True, gpus=[pb.GpuTelemetry(index=1, cap_w=450.0, enforced_w=450.0)]))
    assert g1.pending == {} and g1.enforced_w == 450.0 and s.sent == {}


def test_a_ledger_node_not_reported_yet_shows_no_age_and_an_alert_that_says_so():
    # node2 known only from the node ledger (its agent has not reported to this coordinator): its
    # report age is unknown, not -1.0 s (found by a try-out), and nothing exports an age for it
    import time as _time

    from coordinator.metrics import ViewCollector

    coord = _coordinator()
    reg = coord.registry
    reg.on_hello(hello("node1", jobs=("job-node1",)), Session())
    reg.on_telemetry("node1", telemetry("node1", 1, [(400.0, 390.0, 50.0), (400.0, 390.0, 50.0)]))
    reg.restore_ledger({"node2": {"gpus": {0: (400.0, 200.0, 700.0, 300.0)}, "seen_s": _time.time() - 5.0}},
                       86400.0)
    reg.nodes["node2"].last_report_mono = -1e18  # (a ledger node: no report to this coordinator)
    asyncio.run(coord.tick())
    st = coord.view.resolve().status
    n2 = next(n for n in st.nodes if n.name == "node2")
    assert n2.stale and math.isnan(n2.last_report_age_s)
    assert "node node2 stale (no report to this coordinator yet): held at its caps" in list(st.alerts)
    ages = [s for fam in ViewCollector(coord).collect() if fam.name == "capctl_agent_staleness_seconds"
            for s in fam.samples]
    assert [s.labels["node"] for s in ages] == ["node1"]


def test_failed_acks_are_logged_once_a_minute_per_node_with_the_count_left_out(caplog):
    """A node whose every plan fails (plans reaching a skewed agent after their lease expiry: one
    ``ok`` false ack per interval) wrote one warning per interval for ever; now at most one per node
    per ACK_WARN_EVERY_S, the next one saying how many were not logged. The alert names the node."""
    from coordinator.loop import ACK_WARN_EVERY_S

    coord = _coordinator()
    now = [100.0]
    coord.registry.clock = lambda: now[0]
    sessions = {}
    for node in ("node1", "node2"):
        s = sessions[node] = Recording()
        s.node = node
        coord.registry.on_hello(hello(node), s)
    caplog.set_level(logging.WARNING, logger="capctl.coordinator")
    for k in range(30):  # one failed ack of each node per 2 s interval
        for node, s in sessions.items():
            coord.on_ack(s, pb.CapAck(seq=k + 1, ok=False, error=f"plan {k + 1} arrived 3.0 s after its lease expiry"))
        now[0] += 2.0
    lines = [r.getMessage() for r in caplog.records if "not fully applied" in r.getMessage()]
    per_node = {n: [ln for ln in lines if f"agent {n}:" in ln] for n in sessions}
    assert ACK_WARN_EVERY_S == 60.0 and all(len(v) == 1 for v in per_node.values()), per_node
    now[0] += ACK_WARN_EVERY_S
    coord.on_ack(sessions["node1"], pb.CapAck(seq=99, ok=False, error="GPU 0: set failed"))
    last = [r.getMessage() for r in caplog.records if "not fully applied" in r.getMessage()][-1]
    assert "agent node1: plan 99 not fully applied: GPU 0: set failed (29 more" in last, last


def test_clock_alert_thresholds():
    """The clock alert (decide.watch_alerts): none below half the lease, a warning about delayed
    plans from half, every plan late from 0.9 of the lease (a report's transit shortens the lead:
    at one lease it said "delayed by more than 0.0 s", a try-out); the key names the form, so a
    change of form is logged again. The coordinator's own lease clock behind its host's (its host
    clock set after it started): its own alert, and the nodes' say to restart it."""
    from coordinator import decide, observe

    coord = _coordinator()
    reg = coord.registry
    reg.on_hello(hello("node1"), Session())
    node = reg.nodes["node1"]

    def alerts(ahead_s, own=None):
        node.clock_ahead_s = ahead_s
        return decide.watch_alerts(coord.policy, {"node1": 2}, {}, observe.clocks_ahead(reg, reg.clock(), 10.0), own)

    assert alerts(4.9) == {} and alerts(-30.0) == {} and alerts(math.nan) == {}  # (behind: no plan is late)
    node.clock_ahead_s = 12.0
    assert observe.clocks_ahead(reg, reg.clock(), 10.0) == {"node1": (12.0, 10.0)}
    assert observe.clocks_ahead(reg, reg.clock() + 11.0, 10.0) == {}  # (a stale node: its last skew not shown)
    half = alerts(5.0)
    assert list(half) == [("clock", "node1", "delayed")]
    text = half[("clock", "node1", "delayed")]
    assert "5.0 s ahead of the coordinator's (lease 10 s)" in text and "delayed by more than 5.0 s" in text
    assert text.endswith("synchronize the clocks of the coordinator's host and the node (NTP)")
    for ahead in (9.0, 9.95, 12.0):
        late = alerts(ahead)
        assert list(late) == [("clock", "node1", "late")], ahead
        assert "every plan reaches its agent after its lease expiry" in late[("clock", "node1", "late")]
    own = alerts(9.95, (10.0, 10.0))
    assert "the coordinator's lease clock is 10.0 s behind its host's clock" in own[("clock", "coordinator")]
    assert own[("clock", "coordinator")].endswith("restart the coordinator")
    assert "restart the coordinator (its lease clock is behind" in own[("clock", "node1", "late")]
    assert ("clock", "coordinator") not in alerts(9.95, (4.0, 10.0))  # (within half the lease: no alert)
    assert -1.0 < coord.own_clock()[0] < 1.0 and coord.own_clock()[1] == coord.lease_s


def test_reconciles_longer_than_the_interval_raise_the_overload_alert_then_clear(caplog):
    """The run loop stretches its grid when a reconcile takes longer than the interval (caps then
    follow loads later than the policy says); three in a row raise a persistent alert naming the
    time taken and an interval to use, logged once; one reconcile within the interval clears it."""
    from coordinator.loop import OVERLOAD_TICKS

    coord = Coordinator(parse_policy(POLICY.replace("interval_s: 2", "interval_s: 0.1")), "<test>")
    assert coord.interval_s == 0.1
    slow = [True]
    ticks = []

    async def tick():
        ticks.append(slow[0])
        await asyncio.sleep(0.15 if slow[0] else 0.0)

    coord.tick = tick
    seen = []

    async def run():
        stop = asyncio.Event()
        task = asyncio.ensure_future(coord.run(stop))
        for _ in range(400):  # bounded: ~4 s
            await asyncio.sleep(0.01)
            seen.append(coord.persistent_alerts.get("overload"))
            if len(ticks) >= OVERLOAD_TICKS + 2 and slow[0]:
                slow[0] = False
            if not slow[0] and ticks.count(False) >= 2:
                break
        stop.set()
        coord.wake()
        await asyncio.wait_for(task, 5)

    caplog.set_level(logging.WARNING, logger="capctl.coordinator")
    asyncio.run(run())
    raised = [a for a in seen if a]
    assert raised and "coordinator overloaded: the last 3 reconciles took longer than the 0.1 s interval" in raised[0]
    assert "(the last 0.1" in raised[0] and "raise interval_s to 1 s or more" in raised[0], raised[0]
    assert seen[-1] is None  # cleared by the fast reconciles
    assert sum("coordinator overloaded" in r.getMessage() for r in caplog.records) == 1
