"""Binding reasons, prices and convergence on small, fully explained instances (issue: wrong or
stale BINDING, prices on slack domains, the fast path stopping on a trivial 2-PDU problem)."""

from __future__ import annotations

import numpy as np
import pytest

from capctl.allocator.curves import DEFAULT_CURVES, RATE_MIN
from capctl.allocator.fast import solve
from capctl.allocator.problem import AllocationProblem

from .helpers import assert_exactly_feasible

H100 = DEFAULT_CURVES["H100"]


def two_pdus(budget_w, *, scale=1.2, held=(), held_w=700.0, ceilings=None, jobs=("j",) * 16):
    """2 nodes x 8 H100 (200-700 W), each node on its own PDU (4500 W), under a cluster budget.
    ``scale``: the online model's per-GPU power scale (1.2: saturation 740 W, above the device
    maximum, so the rate at 700 W is below 1). ``held``: GPU indices fixed at ``held_w``
    (min = max = accounted, as the coordinator builds GPUs without a reading)."""
    doms = [{"name": "cluster", "parent": None, "limit_w": budget_w, "kind": "cluster"},
            {"name": "pdu-a", "parent": "cluster", "limit_w": 4500.0, "kind": "pdu"},
            {"name": "pdu-b", "parent": "cluster", "limit_w": 4500.0, "kind": "pdu"},
            {"name": "node:n1", "parent": "pdu-a", "limit_w": None, "kind": "node"},
            {"name": "node:n2", "parent": "pdu-b", "limit_w": None, "kind": "node"}]
    curve = {"a": H100.a, "k_w": H100.k_w * scale, "sat_w": H100.sat_w * scale, "valid_min_w": 200.0}
    gpus = []
    for g in range(16):
        fixed = g in held
        gpus.append({"name": f"n{1 + g // 8}/{g % 8}", "domain": f"node:n{1 + g // 8}",
                     "min_cap_w": held_w if fixed else 200.0, "max_cap_w": held_w if fixed else 700.0,
                     "curve": curve, "job": jobs[g],
                     "thermal_ceiling_w": None if ceilings is None else ceilings[g]})
    names = sorted({j for j in jobs if j})
    return AllocationProblem.build(gpus=gpus, jobs={n: 1.0 for n in names}, domains=doms)


@pytest.mark.parametrize("scale", [1.0, 1.2, 1.5])
def test_pdus_at_their_limit_bind_and_the_fast_path_converges(scale):
    pb = two_pdus(20000.0, scale=scale)
    r = solve(pb)
    assert_exactly_feasible(pb, r)
    assert not any("stopped after" in a for a in r.alerts), r.alerts
    assert not any("rounding repair" in a for a in r.alerts), r.alerts
    assert r.iterations < 40
    assert np.allclose(r.cap_w, 562.5, atol=0.01)
    assert r.job_binding == ["domain:pdu-a"] or r.job_binding == ["domain:pdu-b"]
    d = list(pb.domain_names)
    assert r.domain_price[d.index("pdu-a")] > 0 and r.domain_price[d.index("pdu-b")] > 0
    assert r.domain_price[d.index("cluster")] == 0.0  # 11 kW of slack


@pytest.mark.parametrize("held", [(), (0,)])
def test_cluster_bound_gives_slack_pdus_zero_price(held):
    """Budget 7000 W: the cluster binds, each PDU keeps ~1000 W of slack -> price 0 there
    (complementary slackness), binding "domain:cluster", also with a GPU held at its accounted
    cap (an agent that reconnected and has not reported yet)."""
    pb = two_pdus(7000.0, held=held)
    r = solve(pb)
    assert_exactly_feasible(pb, r)
    assert not any("stopped after" in a or "rounding repair" in a for a in r.alerts), r.alerts
    d = list(pb.domain_names)
    assert r.domain_load_w[d.index("cluster")] > 7000.0 - 0.1
    for pdu in ("pdu-a", "pdu-b"):
        assert r.domain_load_w[d.index(pdu)] < 4500.0 - 500.0
        assert r.domain_price[d.index(pdu)] == 0.0
    assert r.domain_price[d.index("cluster")] > 0
    assert r.job_binding == ["domain:cluster"]


def test_two_jobs_each_bound_by_its_own_pdu():
    pb = two_pdus(20000.0, jobs=("a",) * 8 + ("b",) * 8)
    r = solve(pb)
    assert r.job_binding == ["domain:pdu-a", "domain:pdu-b"]
    assert not r.alerts


def test_device_max_only_where_the_device_maximum_binds():
    def unlimited(scale):
        pb = two_pdus(1e6, scale=scale)
        return AllocationProblem(**{**pb.__dict__, "domain_limit_w": np.array([1e6] + [np.inf] * 4)})

    # plenty of power; the curve saturates above 700 W (scale 1.2): the device maximum binds
    r = solve(unlimited(1.2))
    assert np.allclose(r.cap_w, 700.0) and r.job_binding == ["device_max"]
    # saturation below the maximum: the curve, not the device, limits the job
    r = solve(unlimited(1.0))
    assert r.job_binding == ["saturated"] and np.all(r.cap_w < 700.0)


def test_negative_ceiling_is_worded_as_too_hot_and_huge_ceiling_is_no_constraint():
    ceil = [None] * 16
    ceil[3] = -590.1   # far too hot: the RC model's ceiling is negative
    ceil[5] = 8554.0   # cold: far above the device maximum, not a constraint
    pb = two_pdus(20000.0, ceilings=ceil, jobs=("a",) * 8 + ("b",) * 8)
    r = solve(pb)
    assert r.cap_w[3] == 200.0
    alert = [a for a in r.alerts if "n1/3" in a]
    assert alert == ["gpu n1/3 is too hot to keep below slowdown−margin even at its minimum cap (200 W): "
                     "held at its minimum"]
    assert not any("-590" in a or "8554" in a for a in r.alerts)
    assert r.job_binding[0] == "thermal"
    assert r.job_binding[1] == "domain:pdu-b"


def test_rates_never_negative_and_objective_finite_at_minimum_caps():
    """A power-hungry GPU (scale 2) whose curve extrapolates far below zero at 200 W, held at its
    minimum by a deficit-free but tight PDU: the reported rate is clamped at RATE_MIN, never < 0,
    and the log objective is finite."""
    pb = two_pdus(20000.0, scale=2.0, ceilings=[150.0] + [None] * 15, jobs=("a",) * 8 + ("b",) * 8)
    r = solve(pb)
    assert np.all(r.job_rate >= RATE_MIN) and np.isfinite(r.objective_value)
    assert r.job_rate[0] == RATE_MIN


@pytest.mark.parametrize("solver", ["fast", "reference"])
def test_a_job_paced_by_a_held_gpu_names_that_gpu_as_its_slowest(solver):
    """A GPU held at a fixed cap (a LOST GPU at its last known cap) below what its job-mates could
    reach sets the job's pace: the job-mates are capped to keep pace with it, and the held GPU, not
    a job-mate milliwatt rounding left a hair slower, is the job's slowest (the coordinator labels
    the job ``held`` from it; before, a job-mate was named and the job showed ``device_min``)."""
    pb = two_pdus(20000.0, held=(5,), held_w=500.0, jobs=("j",) * 8 + (None,) * 8)
    if solver == "fast":
        r = solve(pb)
    else:
        pytest.importorskip("cvxpy")
        from capctl.allocator.reference import solve_reference

        r = solve_reference(pb)
    assert r.job_binding == ["device_min"]  # the held GPU's upper bound (= its fixed cap) binds
    assert int(r.slowest_gpu[0]) == 5
    mates = [g for g in range(8) if g != 5]
    assert np.allclose(r.cap_w[mates], 500.0, atol=0.5)  # paced to the held GPU, no watts wasted above it


def _rack_at_minimums(slack_w: float) -> AllocationProblem:
    """Two racks of 8 H100 (200-700 W), one job each; rack-b's limit is its GPUs' minimum caps
    (8 x 200 W) plus ``slack_w``; rack-a (2000 W) and the cluster (4000 W) leave room."""
    doms = [{"name": "cluster", "parent": None, "limit_w": 4000.0, "kind": "cluster"},
            {"name": "rack-a", "parent": "cluster", "limit_w": 2000.0, "kind": "rack"},
            {"name": "rack-b", "parent": "cluster", "limit_w": 1600.0 + slack_w, "kind": "rack"},
            {"name": "node:n1", "parent": "rack-a", "limit_w": None, "kind": "node"},
            {"name": "node:n2", "parent": "rack-b", "limit_w": None, "kind": "node"}]
    curve = {"a": H100.a, "k_w": H100.k_w, "sat_w": H100.sat_w, "valid_min_w": 200.0}
    gpus = [{"name": f"n{1 + g // 8}/{g % 8}", "domain": f"node:n{1 + g // 8}", "min_cap_w": 200.0,
             "max_cap_w": 700.0, "curve": curve, "job": "a" if g < 8 else "b"} for g in range(16)]
    return AllocationProblem.build(gpus=gpus, jobs={"a": 1.0, "b": 1.0}, domains=doms)


@pytest.mark.parametrize("slack_w", [0.0, 0.001, 0.005])
@pytest.mark.parametrize("solver", ["fast", "reference"])
def test_a_domain_limit_at_its_gpus_minimum_caps_holds_them_there(solver, slack_w):
    """A rack limit equal to its GPUs' minimum caps (to within a milliwatt each) holds them at their
    minimums: the rack binds its job, its price is unknown (NaN; status shows 0 for it, as for a
    domain in deficit), the other rack is solved
    as usual, and there is no solver alert. Before (found by a try-out): prices of ~1e28, the fast
    path at its 200-iteration limit, "rounding left 1 mW over" and "rounding repair" alerts."""
    pb = _rack_at_minimums(slack_w)
    if solver == "fast":
        r = solve(pb)
    else:
        pytest.importorskip("cvxpy")
        from capctl.allocator.reference import solve_reference

        r = solve_reference(pb)
    assert_exactly_feasible(pb, r)
    assert r.alerts == [], r.alerts
    assert np.allclose(r.cap_w[8:], 200.0) and np.allclose(r.cap_w[:8], 250.0, atol=0.01)
    assert r.job_binding == ["domain:rack-a", "domain:rack-b"]
    d = list(pb.domain_names)
    assert np.isnan(r.domain_price[d.index("rack-b")]) and 0 < r.domain_price[d.index("rack-a")] < 1.0
    assert r.domain_deficit_w[d.index("rack-b")] == 0.0 and r.feasible


def test_a_domain_limit_just_above_the_pin_slack_is_solved():
    """10 mW per GPU above the minimums is solved (priced, caps above the minimums), not pinned."""
    pb = _rack_at_minimums(1.0)
    r = solve(pb)
    assert_exactly_feasible(pb, r)
    d = list(pb.domain_names)
    assert r.alerts == [] and 0 < r.domain_price[d.index("rack-b")] < 1.0
    assert r.cap_w[8:].sum() > 1600.9 and r.job_binding[1] == "domain:rack-b"


def test_a_deficit_under_a_pinned_domain_keeps_its_deficit_label():
    """The cluster's limit equals all 16 minimum caps (pinned) and rack-b is in deficit below it: the
    job under rack-b is labelled with the deficit (the more serious reason), the other with the
    pinned cluster (found by a review: both showed domain:cluster)."""
    doms = [{"name": "cluster", "parent": None, "limit_w": 3200.0, "kind": "cluster"},
            {"name": "rack-a", "parent": "cluster", "limit_w": 2000.0, "kind": "rack"},
            {"name": "rack-b", "parent": "cluster", "limit_w": 1500.0, "kind": "rack"},
            {"name": "node:n1", "parent": "rack-a", "limit_w": None, "kind": "node"},
            {"name": "node:n2", "parent": "rack-b", "limit_w": None, "kind": "node"}]
    curve = {"a": H100.a, "k_w": H100.k_w, "sat_w": H100.sat_w, "valid_min_w": 200.0}
    gpus = [{"name": f"n{1 + g // 8}/{g % 8}", "domain": f"node:n{1 + g // 8}", "min_cap_w": 200.0,
             "max_cap_w": 700.0, "curve": curve, "job": "a" if g < 8 else "b"} for g in range(16)]
    pb = AllocationProblem.build(gpus=gpus, jobs={"a": 1.0, "b": 1.0}, domains=doms)
    r = solve(pb)
    assert r.job_binding == ["domain:cluster", "deficit:rack-b"] and not r.feasible
    assert np.allclose(r.cap_w, 200.0)
