"""The interior-point start of the fast path (capctl.allocator.interior): instances where many jobs
sit on kinks and the throughput objective, against the cvxpy reference; its prices; its fallback."""

from __future__ import annotations

import numpy as np
import pytest

from capctl.allocator import fast
from capctl.allocator._core import prepare
from capctl.allocator.fast import solve
from capctl.allocator.interior import interior_prices
from capctl.allocator.reference import solve_reference
from capctl.allocator.synthetic import synthetic_cluster

from .helpers import assert_exactly_feasible


def _dual(pb):
    prep = prepare(pb)
    var = np.nonzero(prep.has_gpu & (prep.s_max > prep.s_lo))[0]
    return prep, fast._Dual(pb, prep, var, prep.s_max.copy())


def _gpus_on_a_kink(pb, res):
    """GPUs held at their lower bound in a job whose rate is strictly inside its range."""
    prep = prepare(pb)
    jg = np.nonzero(prep.in_job)[0]
    j = pb.job_of_gpu[jg]
    inside = (res.job_rate[j] > prep.s_lo[j] * (1 + 1e-6)) & (res.job_rate[j] < prep.s_max[j] * (1 - 1e-6))
    return int(np.sum(inside & (np.abs(res.cap_w[jg] - prep.lo[jg]) < 2e-3)))


@pytest.mark.parametrize("kind", [dict(cluster_frac=0.42, rack_frac=0.45, seed=2),
                                  dict(cluster_frac=0.35, rack_frac=0.45, objective="throughput", seed=1)],
                         ids=["cluster-42pct", "throughput"])
def test_kinked_instances_match_the_reference(kind):
    kw = dict(kind)
    pb = synthetic_cluster(1000, **kw)
    res = solve(pb)
    assert_exactly_feasible(pb, res)
    assert not [a for a in res.alerts if "stopped" in a or "repair" in a], res.alerts
    ref = solve_reference(pb)
    gap = (res.objective_value - ref.objective_value) / max(1.0, abs(ref.objective_value))
    assert gap >= -1e-6, (res.objective_value, ref.objective_value)
    assert abs(gap) <= 1e-6, (res.objective_value, ref.objective_value)
    # the instance is the hard kind: jobs inside their range hold GPUs at their minimum (kinks)
    assert _gpus_on_a_kink(pb, res) >= 10
    # the interior-point start leaves the exact method a few Newton steps (before it: 18-19)
    assert res.iterations <= 6


def test_interior_prices_are_near_the_optimum():
    pb = synthetic_cluster(1000, seed=3, cluster_frac=0.42, rack_frac=0.45)
    prep, dual = _dual(pb)
    start = interior_prices(dual.jobs, dual.pc, dual.pg, dual.budget, dual.depth_c, dual.parent_c)
    assert start is not None
    lam, s, iterations = start
    res = solve(pb)
    exact = res.domain_price[prep.candidates]
    binding = exact > 0
    assert binding.any()
    assert np.allclose(lam[binding], exact[binding], rtol=1e-3)
    assert np.all(lam[~binding] <= 1e-3 * exact.max())
    var = np.nonzero(prep.has_gpu & (prep.s_max > prep.s_lo))[0]
    assert np.allclose(s, res.job_rate[var], rtol=1e-4)
    assert 5 <= iterations <= 60


def test_interior_declines_a_domain_without_interior():
    pb = synthetic_cluster(64, seed=1, cluster_frac=0.42, rack_frac=0.45)
    prep, dual = _dual(pb)
    tight = dual.budget.copy()
    # the cluster row (candidate 0 here: the root) exactly at the sum of its GPUs' lower bounds
    root = int(np.nonzero(dual.parent_c < 0)[0][0])
    tight[root] = float(np.sum(dual.jobs.lo))
    assert interior_prices(dual.jobs, dual.pc, dual.pg, tight, dual.depth_c, dual.parent_c) is None
    # and solve() still works without it (its own starting prices), exactly feasible
    res = solve(pb)
    assert_exactly_feasible(pb, res)
