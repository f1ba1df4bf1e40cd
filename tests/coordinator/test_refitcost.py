"""The refit batches' cost line (coordinator/refitcost.py) and the refit budget it keeps
(coordinator/models.py ``Models._refit_due``)."""

from __future__ import annotations

import random

import pytest

from capctl.allocator.curves import rate_unclamped
from coordinator import models as M
from coordinator import refitcost
from coordinator.refitcost import RefitCost
from tests.coordinator.test_models import H100, _registry, _sample


def test_the_line_is_found_from_batches_of_several_sizes():
    cost = RefitCost()
    for n in [1, 5, 12, 3, 30, 8, 2, 20] * 3:  # a batch costs 4 ms + 0.5 ms a fit
        cost.observe(n, 4e-3 + 0.5e-3 * n)
    assert cost.fixed_s == pytest.approx(4e-3, rel=1e-6)
    assert cost.each_s == pytest.approx(0.5e-3, rel=1e-6)
    assert cost.size(12e-3, 64, first=False) == 16  # (12 - 4) / 0.5
    assert cost.size(4.2e-3, 64, first=False) == 0  # not even one fit: no batch
    assert cost.size(4.2e-3, 64, first=True) == 1  # the interval's first batch: one at least
    assert cost.size(1.0, 64, first=False) == 64  # at most a whole batch


def test_batches_of_one_size_keep_the_fixed_part_and_follow_the_mean():
    cost = RefitCost()
    for _ in range(10):
        cost.observe(10, 10e-3)  # 1 ms a fit, no fixed cost: one size cannot tell them apart
    assert cost.fixed_s == pytest.approx(refitcost.FIXED_PRIOR_S)
    assert cost.fixed_s + 10 * cost.each_s == pytest.approx(10e-3)  # the mean predicted exactly
    assert cost.size(10e-3 + 1e-9, 64, first=False) == 10  # the budget that paid for ten: ten


def test_noise_never_gives_a_negative_part_and_nan_is_not_learned():
    cost = RefitCost()
    for n, t in [(1, 9e-3), (10, 2e-3), (1, 8e-3), (10, 3e-3)]:  # cost falling with size: noise
        cost.observe(n, t)
        assert cost.each_s >= refitcost.MIN_EACH_S and cost.fixed_s >= 0.0
    before = (cost.fixed_s, cost.each_s)
    cost.observe(5, float("nan"))
    cost.observe(0, 1.0)
    assert (cost.fixed_s, cost.each_s) == before


def _run(models, reg, intervals: int, now: list, charged: list) -> list:
    """Feed moving caps to every GPU of ``reg`` for ``intervals`` 1 s intervals and ask for every
    curve; returns the refit budget spent per interval (the budget clock's charge)."""
    prior = M.prior_curve(H100, 200.0, 700.0)
    keys = [("n1", i) for i in sorted(reg.nodes["n1"].gpus)]
    spent = []
    for t in range(intervals):
        now[0] = float(t)
        for g in reg.nodes["n1"].gpus.values():
            cap = 260.0 + (13.7 * t + g.index) % 400.0  # a new cap bin every interval: refits due
            g.new_samples.append(_sample(float(t), cap, float(rate_unclamped(cap, prior.a, prior.k_w, prior.sat_w))))
        models.update(reg, 1.0)
        c0 = charged[0]
        models.curve_arrays(keys)
        spent.append(charged[0] - c0)
    return spent


def test_a_fixed_cost_per_batch_keeps_the_refits_within_the_budget():
    # a budget clock charging 6 ms per batch and 0.3 ms per fit (a batch's cost mostly fixed, as
    # measured on the test host): with a cost per fit alone (the model before 7 Dec 2026) the
    # interval's later batches took one fit each, at least, whatever was left: 10 ms budgets ran
    # 12-16 ms. Now the first batch is sized to the line and no batch starts that does not fit.
    now, charged = [0.0], [0.0]
    real = M.fit_curves

    def charging(problems):
        charged[0] += 6e-3 + 0.3e-3 * len(problems)
        return real(problems)

    models = M.Models(clock=lambda: now[0], budget_clock=lambda: now[0] + charged[0], rng=random.Random(7))
    M.fit_curves, saved = charging, M.fit_curves
    try:
        spent = _run(models, _registry(n_gpus=300), 40, now, charged)
    finally:
        M.fit_curves = saved
    budget = M.REFIT_BUDGET_MIN_S  # 300 GPUs: the small cluster's budget
    assert max(spent[10:]) <= budget + 1e-12  # once the line is learned: never over the budget
    assert min(spent[10:]) >= budget - (6e-3 + 0.3e-3)  # and never less than one batch under it
    assert models.refits >= 30 * 12  # ~13 fits an interval: (10 - 6) / 0.3
