"""The coordinator's decision step (:mod:`coordinator.decide`), called directly.

Hand-built observations (registry objects made from plain values, snapshotted with
:mod:`coordinator.observe` at a ``now`` passed in): no process, no stream, no sleep and no clock;
the models have fixed clocks (no sample: the prior rate curve of every GPU).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from capctl.policy.validate import parse_policy
from coordinator import decide, observe
from coordinator.models import Models
from coordinator.planner import DEADBAND_W
from coordinator.registry import Binding, GpuObs, NodeObs, Registry

NOW = 1000.0
LEASE_S = 10.0
INTERVAL_S = 2.0
ACK_MEMORY_S = 2.0


def policy_text(budget_w: float, nodes: str = "node1,node2", pdu_w: float | None = None) -> str:
    """Two GPUs per node, all under one PDU (limit ``pdu_w``, default the budget), W and s."""
    pdu_w = budget_w if pdu_w is None else pdu_w
    return f"""
version: 1
budget_w: {budget_w:g}
interval_s: {INTERVAL_S:g}
objective: proportional
thermal: {{margin_c: 5}}
slew_w: null
idle_cap_w: 200
min_cap_w: null
failsafe: {{lease_s: {LEASE_S:g}, safe_cap_w: null}}
weights: {{default: 1.0}}
domains:
  name: cluster
  kind: cluster
  gpu_model: H100-SXM
  gpus_per_node: 2
  children:
    - {{name: pdu-a, kind: pdu, limit_w: {pdu_w:g}, nodes: "{nodes}"}}
"""


def add_node(reg: Registry, name: str, enforced_w: list[float], *, reading: bool = True, connected: bool = True,
             report_age_s: float = 0.5, connected_age_s: float = 100.0) -> NodeObs:
    """A node with one job over its GPUs (200..700 W devices), each enforcing ``enforced_w[i]``."""
    node = NodeObs(name=name, session=object() if connected else None, last_report_mono=NOW - report_age_s,
                   last_telemetry_mono=NOW - report_age_s, connected_mono=NOW - connected_age_s)
    for i, e in enumerate(enforced_w):
        node.gpus[i] = GpuObs(node=name, index=i, min_cap_w=200.0, max_cap_w=700.0, default_cap_w=700.0,
                              slowdown_temp_c=87.0, have_reading=reading, power_w=e - 10.0 if reading else 0.0,
                              cap_w=e if reading else 0.0, enforced_w=e if reading else 0.0, temp_c=60.0)
    job = f"job-{name}"
    node.bindings[job] = Binding(job, name, tuple(range(len(enforced_w))))
    reg.nodes[name] = node
    return node


def registry(**nodes: list[float]) -> Registry:
    reg = Registry(clock=lambda: NOW)
    for name, enforced in nodes.items():
        add_node(reg, name, enforced)
    return reg


def snapshot(reg: Registry, policy, *, now: float = NOW, dry_run: bool = False, start_s: float = 0.0):
    models = Models(clock=lambda: 0.0, budget_clock=lambda: 0.0)
    return observe.snapshot(reg, models, policy, now, dry_run=dry_run, lease_s=LEASE_S, interval_s=INTERVAL_S,
                            ack_memory_s=ACK_MEMORY_S, start_s=start_s)


def state(reg: Registry, obs: decide.Observations, now: float) -> decide.FleetState:
    return observe.fleet_state(reg, obs.problem.inputs, now, LEASE_S, ACK_MEMORY_S)


def test_budget_is_respected_by_the_desired_caps_and_every_excess_is_decreased():
    reg = registry(node1=[700.0, 700.0], node2=[700.0, 700.0])
    obs = snapshot(reg, parse_policy(policy_text(2000.0)))
    d = decide.decide(obs)
    assert d.mode == decide.APPLY and d.hold_reasons == ()
    assert set(d.desired_w) == {("node1", 0), ("node1", 1), ("node2", 0), ("node2", 1)}
    assert sum(d.desired_w.values()) <= 2000.0 + 1e-6
    assert all(200.0 <= w <= 700.0 for w in d.desired_w.values())
    assert sum(d.desired_w.values()) == pytest.approx(2000.0, abs=1.0)  # four busy GPUs use the whole budget
    # every GPU is above its desired cap: all are lowered in phase 1, nothing is raised
    assert d.decreases == {"node1": {0: d.desired_w[("node1", 0)], 1: d.desired_w[("node1", 1)]},
                           "node2": {0: d.desired_w[("node2", 0)], 1: d.desired_w[("node2", 1)]}}
    assert d.increase_candidates == frozenset() and d.early_holds == ()
    assert decide.plan_increases(d, state(reg, obs, NOW + 0.1)) == {}
    # the failsafe caps hold the budget too, were every agent to fall back at once
    assert sum(c for caps in d.safe_caps.values() for c in caps.values()) <= 2000.0 + 1e-6
    assert d.live_nodes == ("node1", "node2")


def read_back(gpu, cap_w: float) -> None:
    """A read-back of ``gpu`` at ``cap_w`` (W): its requested and enforced limits (both count)."""
    gpu.cap_w = gpu.enforced_w = cap_w


def test_decreases_come_first_and_increases_only_within_the_headroom_as_accounted():
    policy = parse_policy(policy_text(1800.0))
    reg = registry(node1=[700.0, 700.0], node2=[200.0, 200.0])
    obs = snapshot(reg, policy)
    d = decide.decide(obs)
    want = d.desired_w
    assert sum(want.values()) <= 1800.0 + 1e-6
    assert set(d.decreases) == {"node1"}  # phase 1: only the GPUs above their desired cap
    assert d.decreases["node1"] == {0: want[("node1", 0)], 1: want[("node1", 1)]}
    assert d.increase_candidates == frozenset({"node2"})
    assert d.early_holds == ()  # node1 is lowered, node2 waits for phase 2
    # phase 2 before any acknowledgement: the decreases still count at 700 W, the budget is spent
    assert decide.plan_increases(d, state(reg, obs, NOW + 0.1)) == {}
    # node1 acknowledged only GPU 0 (GPU 1 still enforces 700 W): the headroom is what GPU 0 freed
    read_back(reg.nodes["node1"].gpus[0], want[("node1", 0)])
    inc = decide.plan_increases(d, state(reg, obs, NOW + 0.2))
    freed = 700.0 - want[("node1", 0)]
    assert set(inc) == {("node2", 0), ("node2", 1)}
    assert sum(inc.values()) - 400.0 <= freed + 1e-6
    assert sum(inc.values()) == pytest.approx(400.0 + freed, abs=1e-2)  # all of it granted, in proportion
    assert inc[("node2", 0)] == pytest.approx(inc[("node2", 1)], abs=1e-3)
    # both acknowledged: node2 gets its desired caps, and the sum of caps respects the budget
    read_back(reg.nodes["node1"].gpus[1], want[("node1", 1)])
    inc = decide.plan_increases(d, state(reg, obs, NOW + 0.3))
    assert inc == pytest.approx({("node2", 0): want[("node2", 0)], ("node2", 1): want[("node2", 1)]}, abs=1e-3)
    assert want[("node1", 0)] + want[("node1", 1)] + sum(inc.values()) <= 1800.0 + 1e-6
    assert decide.increases_by_node(inc).keys() == {"node2"}


def test_same_observations_same_decision_and_nothing_to_send_at_the_desired_caps():
    policy = parse_policy(policy_text(1800.0))
    reg = registry(node1=[700.0, 700.0], node2=[200.0, 200.0])
    obs = snapshot(reg, policy)
    first = decide.decide(obs)
    assert decide.decide(obs) == first  # same snapshot
    assert decide.decide(snapshot(reg, policy)) == first  # a new snapshot of the same registry
    # the fleet applied the decision (read back within the deadband): only holds are left
    for (n, i), w in first.desired_w.items():
        read_back(reg.nodes[n].gpus[i], w + (0.9 if i == 0 else -0.9) * DEADBAND_W)
    obs2 = snapshot(reg, policy)
    again = decide.plan(first.solution, obs2)
    assert again.decreases == {} and again.increase_candidates == frozenset()
    assert again.early_holds == again.live_nodes == ("node1", "node2")
    assert decide.plan_increases(again, obs2.state) == {}
    # and a new solve of the converged fleet decides the same caps: still nothing to send
    settled = decide.decide(obs2)
    assert settled.desired_w == pytest.approx(first.desired_w, abs=1e-6)
    assert settled.decreases == {} and settled.increase_candidates == frozenset()
    assert decide.plan_increases(settled, obs2.state) == {}
    assert decide.decide(obs2) == settled


def test_startup_hold_blocks_increases_until_every_policy_node_reported_or_a_lease_passed():
    # node3 never said hello: counted at the most it may draw (2 declared H100s at 700 W), so
    # the others share 3,200 - 1,400 = 1,800 W
    policy = parse_policy(policy_text(3200.0, nodes="node1,node2,node3"))
    reg = registry(node1=[700.0, 700.0], node2=[200.0, 200.0])
    obs = snapshot(reg, policy, start_s=NOW - 1.0)
    d = decide.decide(obs)
    assert d.mode == decide.APPLY and d.hold_increases
    assert any(r.startswith("startup hold: 1 policy node(s)") for r in d.hold_reasons)
    counted = ("each counted at 1400 W (the most it may draw: the policy's gpus_per_node at the maximum limit of its "
               "gpu_model, or of the known GPUs when it names none capctl knows; at least the largest known node's "
               "draw) until it reports or is removed from the policy")
    assert ("1 policy node(s) have not reported (node3): no cap is raised until they report or one lease has "
            f"passed; {counted}") in d.alerts
    assert d.solution.out is not None and sum(d.desired_w.values()) <= 1800.0 + 1e-6
    assert set(d.decreases) == {"node1"}  # decreases are never held
    assert d.increase_candidates == frozenset() and d.early_holds == ("node2",)
    for gpu in reg.nodes["node1"].gpus.values():  # even with the headroom freed, nothing is raised
        gpu.enforced_w = 200.0
    assert decide.plan_increases(d, state(reg, obs, NOW + 0.2)) == {}
    # one lease after the start the missing node is presumed down: increases resume
    late = decide.decide(snapshot(reg, policy, start_s=NOW - LEASE_S - 1.0))
    assert not late.hold_increases and late.increase_candidates
    assert f"1 policy node(s) have not reported (node3): {counted}" in late.alerts
    assert sum(late.desired_w.values()) <= 1800.0 + 1e-6  # still counted: never handed out


def test_an_unreported_policy_node_lowers_every_limit_above_it():
    # node3 is counted at the most it may draw (2 declared H100s x 700 W): that comes off the
    # PDU above it (2,500 W) and the cluster budget (3,000 W); nothing once every node reported
    from coordinator import allocation

    policy = parse_policy(policy_text(3000.0, nodes="node1,node2,node3", pdu_w=2500.0))
    reg = registry(node1=[300.0, 300.0], node2=[300.0, 300.0])
    obs = snapshot(reg, policy, start_s=NOW - LEASE_S - 1.0)
    inputs = obs.problem.inputs
    assert inputs.reserved_w == {"node3": 1400.0}
    limits = {d["name"]: d["limit_w"] for d in inputs.domains}
    assert limits[policy.domains.name] == 1600.0 and limits["pdu-a"] == 1100.0
    d = decide.decide(obs)
    assert sum(d.desired_w.values()) <= 1100.0 + 1e-6
    add_node(reg, "node3", [200.0, 200.0])
    again = snapshot(reg, policy, start_s=NOW - LEASE_S - 1.0).problem.inputs
    assert again.reserved_w == {} and {d["name"]: d["limit_w"] for d in again.domains}["pdu-a"] == 2500.0
    # the reserve never takes a limit below 0 W; no known node: nothing to count it by
    assert allocation.with_reserve([{"name": "pdu-a", "limit_w": 1000.0}], policy, {"node3": 1400.0}) == [
        {"name": "pdu-a", "limit_w": 0.0, "reserved_w": 1000.0}]
    # no known node: the policy's declaration alone; a bigger node than any known one counts at its
    # own declared size (an 8-GPU node beside 2-GPU ones: 7,000 W on a 6,200 W budget, a try-out)
    assert allocation.unreported_reserve(policy, (), np.zeros(0, np.int64), np.zeros(0)) == {
        "node1": 1400.0, "node2": 1400.0, "node3": 1400.0}
    big = parse_policy(policy_text(6200.0, nodes="node1,node2").replace("gpus_per_node: 2", "gpus_per_node: 8"))
    assert allocation.unreported_reserve(big, (("node1", (0, 1)),), np.array([0, 0]), np.full(2, 700.0)) == {
        "node2": 5600.0}
    assert allocation.declared_draw_w(big, "node2") == 5600.0
    # 8 GPUs a node declared without a model capctl knows: 8 x the known GPUs' highest maximum
    # limit (it was counted at the known 2-GPU node's draw, found by a try-out)
    for model in ("", "gpu_model: B200"):
        odd = parse_policy(policy_text(6200.0, nodes="node1,node2").replace("gpus_per_node: 2", "gpus_per_node: 8")
                           .replace("gpu_model: H100-SXM", model))
        assert allocation.unreported_reserve(odd, (("node1", (0, 1)),), np.array([0, 0]),
                                             np.array([700.0, 650.0])) == {"node2": 5600.0}, model
        assert allocation.declared_draw_w(odd, "node2") == 0.0  # (no GPU known: nothing to count it by)


def test_a_stale_node_is_held_at_its_accounted_caps_and_gets_no_plan():
    policy = parse_policy(policy_text(2000.0))
    reg = registry(node1=[700.0, 700.0])
    stale = add_node(reg, "node2", [600.0, 500.0], report_age_s=LEASE_S + 5.0)
    stale.gpus[0].pending[9] = 650.0  # a cap sent, never acknowledged: counts at 650 W
    d = decide.decide(snapshot(reg, policy))
    assert d.desired_w[("node2", 0)] == 650.0 and d.desired_w[("node2", 1)] == 500.0
    assert d.live_nodes == ("node1",)
    assert "node2" not in d.decreases and "node2" not in d.safe_caps and "node2" not in d.increase_candidates
    # the live node shares what the stale one leaves: the held caps are spent, never free
    assert d.desired_w[("node1", 0)] + d.desired_w[("node1", 1)] <= 2000.0 - 1150.0 + 1e-6
    assert sum(d.desired_w.values()) <= 2000.0 + 1e-6


def test_a_node_without_its_first_telemetry_holds_every_cap_and_dry_run_applies_nothing():
    policy = parse_policy(policy_text(1800.0))
    reg = registry(node1=[700.0, 700.0])
    add_node(reg, "node2", [0.0, 0.0], reading=False, connected_age_s=0.5)  # said hello just now
    d = decide.decide(snapshot(reg, policy))
    assert d.mode == decide.HOLD and d.waiting == ("node2",)
    assert "waiting for the first telemetry of node2" in d.hold_reasons
    assert d.decreases == {} and d.increase_candidates == frozenset()
    assert d.desired_w[("node2", 0)] == d.desired_w[("node2", 1)] == 700.0  # counted at the maximum limit
    assert d.safe_caps.keys() == {"node1"}  # holds still renew the lease with safe caps
    dry = decide.decide(snapshot(registry(node1=[700.0, 700.0]), policy, dry_run=True))
    assert dry.mode == decide.DRY_RUN and dry.decreases == {} and dry.hold_reasons[0].startswith("dry run")
    assert decide.plan_increases(dry, snapshot(registry(node1=[200.0, 200.0]), policy).state) == {}


def test_a_failed_solve_holds_every_cap_at_its_accounted_value():
    policy = parse_policy(policy_text(1800.0))
    reg = registry(node1=[700.0, 600.0])
    obs = snapshot(reg, policy)
    gpus = list(obs.problem.inputs.gpus)
    gpus[0] = dataclasses.replace(gpus[0], domain="no-such-domain")  # a malformed problem
    bad = dataclasses.replace(obs.problem, inputs=dataclasses.replace(obs.problem.inputs, gpus=gpus))
    d = decide.plan(decide.solve(bad), obs)
    assert d.mode == decide.HOLD and d.solution.out is None
    assert d.desired_w == {("node1", 0): 700.0, ("node1", 1): 600.0}
    assert any(a.startswith("solve failed: ") and a.endswith("; caps held") for a in d.alerts)
    assert d.decreases == {}


def test_deciding_reads_no_clock(monkeypatch):
    policy = parse_policy(policy_text(1800.0))
    obs = snapshot(registry(node1=[700.0, 700.0], node2=[200.0, 200.0]), policy)

    def no_clock():
        raise AssertionError("the decision step read a clock")

    monkeypatch.setattr(time, "time", no_clock)
    monkeypatch.setattr(time, "monotonic", no_clock)
    d = decide.decide(obs)
    assert decide.plan_increases(d, obs.state) == {}
    assert d.now == NOW


def test_a_deficit_under_a_reserve_names_the_policys_limit_and_what_is_held():
    """A PDU whose limit the reserve of an unreported node takes below its GPUs' minimums: the
    alert names the policy's limit, the watts held and what is left (it said "limit 0.0 W below
    the sum of minimum caps" of a 2,400 W PDU; found by a try-out)."""
    policy = parse_policy(policy_text(3000.0, nodes="node1,node2,node3", pdu_w=1500.0))
    reg = registry(node1=[300.0, 300.0], node2=[300.0, 300.0])
    d = decide.decide(snapshot(reg, policy, start_s=NOW - LEASE_S - 1.0))
    alerts = [a for a in d.alerts if a.startswith("domain pdu-a:")]
    assert alerts and "limit 1500.0 W less 1400.0 W held for policy nodes that have not reported = 100.0 W " \
        "below the sum of minimum caps" in alerts[0], d.alerts


def test_the_most_the_nodes_may_draw_counts_unreported_nodes_at_their_reserve():
    from coordinator import allocation

    policy = parse_policy(policy_text(3000.0, nodes="node1,node2,node3", pdu_w=2500.0))
    reg = registry(node1=[300.0, 300.0], node2=[300.0, 300.0])
    inputs = snapshot(reg, policy, start_s=NOW - LEASE_S - 1.0).problem.inputs
    most = sum(g.max_cap_w for g in inputs.gpus)
    assert most == 4 * 700.0 and allocation.maximum_draw_w(inputs) == most + 1400.0  # node3: 2 x 700 W declared


def test_a_refused_second_claim_counts_that_node_once_more_until_it_stops():
    """A second agent refused for node2 (another agent serves it): its GPUs are real and at caps no
    plan sets, whichever agent said hello first. They are counted once more at the most node2 may
    draw, with an alert, until ``CLAIM_HOLD_S`` after its last try (4,730 W on a 4,000 W budget
    when the wrong agent held the name; found by a try-out)."""
    from coordinator import allocation

    policy = parse_policy(policy_text(3000.0, nodes="node1,node2", pdu_w=2900.0))
    reg = registry(node1=[300.0, 300.0], node2=[300.0, 300.0])
    reg.refuse_claim("node2", "node node2 is already served by an agent at peer reporting other GPUs")
    obs = snapshot(reg, policy, start_s=NOW - LEASE_S - 1.0)
    assert obs.problem.inputs.reserved_w == {"node2": 1400.0}
    d = decide.decide(obs)
    assert [a for a in d.alerts if a.startswith("two agents claim node node2:") and "1400 W more" in a]
    assert sum(d.desired_w.values()) <= 3000.0 - 1400.0 + 1e-6
    reg.clock = lambda: NOW + allocation.CLAIM_HOLD_S + 1.0  # it stopped trying
    assert reg.claims_refused(NOW + allocation.CLAIM_HOLD_S + 1.0, allocation.CLAIM_HOLD_S) == {}


def test_gpus_a_node_no_longer_lists_stay_counted_until_listed_again():
    """node2's agent dead (its GPUs at 600 W), another agent says hello as node2 with other GPUs (a
    copied --node on another host): node2's GPUs left the books (the hello's records replaced them
    by index) and the cluster went to 4,756 W on a 4,000 W budget (found by a try-out). They stay
    counted at their last caps, with an alert, until a hello lists them again."""
    from capctl.v1 import capctl_pb2 as pb

    policy = parse_policy(policy_text(3000.0))
    reg = registry(node1=[300.0, 300.0])

    def hello(node, uuids):
        return pb.AgentHello(node=node, gpus=[pb.GpuInfo(index=i, uuid=u, min_cap_w=200.0, max_cap_w=700.0)
                                              for i, u in enumerate(uuids)])
    reg.on_hello(hello("node2", ["GPU-a", "GPU-b"]), object())
    for g in reg.nodes["node2"].gpus.values():
        g.have_reading, g.cap_w, g.enforced_w = True, 600.0, 600.0
    reg.on_hello(hello("node2", ["GPU-a", "GPU-b"]), object())  # its own agent again: nothing lost
    assert reg.nodes["node2"].ghosts == {}
    reg.on_hello(hello("node2", ["GPU-x", "GPU-y"]), object())  # another host's GPUs
    assert all(not g.have_reading for g in reg.nodes["node2"].gpus.values())  # new records, not node2's
    inputs = snapshot(reg, policy, start_s=NOW - LEASE_S - 1.0).problem.inputs
    assert inputs.ghosts == {"node2": (1200.0, ["GPU-a", "GPU-b"])} and inputs.reserved_w == {"node2": 1200.0}
    d = decide.decide(snapshot(reg, policy, start_s=NOW - LEASE_S - 1.0))
    assert [a for a in d.alerts if a.startswith("node node2: 2 GPU(s) its agent no longer lists") and "1200 W" in a]
    reg.on_hello(hello("node2", ["GPU-a", "GPU-b"]), object())  # node2's own agent is back
    assert reg.nodes["node2"].ghosts == {"GPU-x": (700.0, NOW, 0), "GPU-y": (700.0, NOW, 1)}  # (the other's, now)
    reg.on_hello(hello("node3", ["GPU-x", "GPU-y"]), object())  # ... listed by their own node
    assert reg.ghost_reserve(NOW, 86400.0) == {}


def test_a_deficit_says_how_much_of_the_minimums_are_held_gpus():
    """A stale node counted at its caps makes a domain's "minimum caps" exceed its limit: the alert
    says which watts are GPUs held at their accounted caps (after a restart a stopped agent's node
    at its saved caps read as minimum caps it could not have; found by a try-out)."""
    policy = parse_policy(policy_text(1600.0))  # node1's minimums 400 W + node2 held at 1,350 W: 150 W short
    reg = registry(node1=[300.0, 300.0])
    add_node(reg, "node2", [700.0, 650.0], report_age_s=LEASE_S + 5.0)  # stale: held at 1,350 W
    d = decide.decide(snapshot(reg, policy))
    deficit = [a for a in d.alerts if "below the sum of minimum caps" in a]
    assert deficit and deficit[0].endswith("; 1350.0 W of them are 2 GPU(s) held at their accounted caps (a stale "
                                           "node's, no reading, a state the coordinator cannot move)"), d.alerts
