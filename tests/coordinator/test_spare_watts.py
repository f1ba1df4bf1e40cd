"""Spare watts (docs/policy.md "Spare watts", coordinator.allocation.spread_spare): what the
domains still have after the allocation goes to running GPUs below their ceiling, within every
domain limit; never to held GPUs, stragglers' jobs or idle GPUs; nothing with the option off.

The last test runs ``capctl sim``'s engine on examples/clusters/small-4x8.yaml (per-GPU speed
variation NVML does not show), where the watts were left unused and capctl ran below uniform."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from capctl.allocator.curves import DEFAULT_CURVES
from coordinator import allocation
from coordinator.allocation import GpuInput

ROOT = Path(__file__).resolve().parents[2]

# two PDUs under a cluster limit: pdu-a (n0) holds job J, pdu-b (n1) holds job K and one idle GPU
LIMITS_W = {"cluster": 2300.0, "pdu-a": 1000.0, "pdu-b": 1300.0}


def _gpu(node, index, cap_w, job, ceiling_w=math.inf, fixed=False):
    return GpuInput((node, index), "pdu-a" if node == "n0" else "pdu-b", 200.0, 700.0, fixed, cap_w, cap_w, job,
                    DEFAULT_CURVES["H100"], ceiling_w, 200.0)


def _inputs(gpus, spread=True, slew_w=None):
    members = {"pdu-a": frozenset(g.key for g in gpus if g.key[0] == "n0"),
               "pdu-b": frozenset(g.key for g in gpus if g.key[0] == "n1")}
    members["cluster"] = members["pdu-a"] | members["pdu-b"]
    domains = [{"name": "cluster", "parent": None, "limit_w": LIMITS_W["cluster"], "kind": "cluster"},
               {"name": "pdu-a", "parent": "cluster", "limit_w": LIMITS_W["pdu-a"], "kind": "pdu"},
               {"name": "pdu-b", "parent": "cluster", "limit_w": LIMITS_W["pdu-b"], "kind": "pdu"}]
    jobs = {j: 1.0 for j in {g.job for g in gpus} if j}
    return allocation.SolveInputs(gpus=gpus, jobs=jobs, domains=domains, objective="proportional", slew_w=slew_w,
                                  node_domain={}, domain_members=members, spread_spare=spread)


def _fleet():
    return [_gpu("n0", 0, 300.0, "J", ceiling_w=300.0),  # hot: held at its thermal ceiling, sets J's pace
            _gpu("n0", 1, 300.0, "J"),
            _gpu("n1", 0, 300.0, "K"), _gpu("n1", 1, 300.0, "K"),
            _gpu("n1", 2, 200.0, None)]  # idle


def _sums(desired):
    a = sum(w for k, w in desired.items() if k[0] == "n0")
    b = sum(w for k, w in desired.items() if k[0] == "n1")
    return {"cluster": a + b, "pdu-a": a, "pdu-b": b}


def test_spare_watts_go_to_running_gpus_below_their_ceiling_within_every_limit():
    gpus = _fleet()
    inputs = _inputs(gpus)
    desired = {g.key: g.observed_w for g in gpus}
    before = dict(desired)
    allocation.spread_spare(inputs, desired)
    sums = _sums(desired)
    for name, limit in LIMITS_W.items():
        assert sums[name] <= limit  # never above a domain's limit
    assert desired[("n0", 0)] == 300.0  # at its thermal ceiling: not one watt above it
    assert desired[("n1", 2)] == 200.0  # idle: the idle rule's business, not this one's
    for k in (("n0", 1), ("n1", 0), ("n1", 1)):
        assert before[k] < desired[k] <= 700.0
    # pass 1 (the cluster's 900 W over 1,200 W wanted: 0.75; pdu-b's 500 W over 800 W: 0.625):
    # J's second GPU +300 W, K's two +250 W each; then pdu-a has 100 W for the 100 W J still wants
    # and the cluster 100 W: pdu-a fills up, the cluster ends at its limit
    assert desired[("n0", 1)] == pytest.approx(700.0, abs=0.1)
    assert desired[("n1", 0)] == desired[("n1", 1)] == pytest.approx(550.0, abs=0.1)
    assert sums["cluster"] == pytest.approx(LIMITS_W["cluster"], abs=0.1)


def test_held_gpus_and_stragglers_jobs_get_nothing():
    gpus = _fleet()
    gpus[3].fixed = True  # held at its accounted cap (e.g. a stale node)
    gpus[1].straggler = "HW_SLOWDOWN"  # J has a straggler: its pace is measured and fixed
    inputs = _inputs(gpus)
    desired = {g.key: g.observed_w for g in gpus}
    allocation.spread_spare(inputs, desired)
    assert desired[("n0", 0)] == desired[("n0", 1)] == 300.0  # the straggler's job: none
    assert desired[("n1", 1)] == 300.0  # held
    assert desired[("n1", 0)] == pytest.approx(700.0)  # the only one eligible: up to its maximum


def test_the_policy_slew_and_a_ceiling_of_minus_infinity_bound_the_spread():
    """Found by a review: with ``slew_w: 20`` the spread moved caps by up to 400 W in one interval
    (the policy's largest change per interval); a -inf thermal ceiling (too hot: the solver holds
    the GPU at its minimum) was read as none, so the GPU went to its maximum."""
    gpus = _fleet()
    gpus[2].thermal_ceiling_w = -math.inf
    inputs = _inputs(gpus, slew_w=20.0)
    desired = {g.key: g.observed_w for g in gpus}
    allocation.spread_spare(inputs, desired)
    assert desired[("n0", 1)] == desired[("n1", 1)] == pytest.approx(320.0)  # +20 W at most
    assert desired[("n1", 0)] == 300.0  # -inf: no room
    out = allocation.solve(_inputs(_fleet(), slew_w=20.0))
    assert max(abs(out.desired_w[g.key] - g.observed_w) for g in _fleet()) <= 20.0 + 1e-6


def test_solve_spreads_the_spare_only_with_the_policy_option():
    on = allocation.solve(_inputs(_fleet()))
    off = allocation.solve(_inputs(_fleet(), spread=False))
    for out in (on, off):
        for name, limit in LIMITS_W.items():
            assert _sums(out.desired_w)[name] <= limit + 1e-6
        assert out.desired_w[("n0", 0)] <= 300.0 + 1e-6  # the ceiling holds either way
    # J is paced by its hot GPU: off, its job-mate gets what that pace needs and pdu-a keeps the
    # rest; on, the job-mate gets pdu-a's rest
    assert on.desired_w[("n0", 1)] > off.desired_w[("n0", 1)] + 50.0
    assert _sums(on.desired_w)["pdu-a"] == pytest.approx(LIMITS_W["pdu-a"], abs=0.1)


def test_small_4x8_seed_9_capctl_no_longer_runs_below_uniform():
    """Spreading off (the default): capctl/uniform 0.992 (seed 9), watts of pdu-a unused while a job's
    GPUs were paced to a hot GPU at its ceiling and a slower GPU (speed NVML does not show) set the
    real pace; on: 1.010, above uniform (0.985 and 1.042 before the simulator's hot resistances and
    power factors got streams of their own, capctl.sim.engine.HOT_STREAM: another draw of the same
    case)."""
    from capctl.policy import load_policy
    from capctl.sim import cluster, engine

    spec = replace(cluster.load_cluster(ROOT / "examples/clusters/small-4x8.yaml"), seed=9)
    policy = load_policy(str(ROOT / "examples/policies/small-4x8.yaml"))
    rate = {}
    for spread in (True, False):
        scn = engine.build_scenario(spec, replace(policy, spread_spare_watts=spread))
        rate[spread] = engine.run_policy(scn, "capctl").throughput
    uniform = engine.run_policy(engine.build_scenario(spec, policy), "uniform").throughput
    assert rate[False] < uniform  # the case: the watts left unused
    assert rate[True] > uniform  # no longer below uniform
    assert rate[True] > 1.01 * rate[False]
