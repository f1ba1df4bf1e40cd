"""Batched model code (coordinator/models.py) against the per-node/per-GPU code it replaces."""

from __future__ import annotations

import numpy as np
import pytest

from capctl.allocator.thermal import OnlineThermalFit
from coordinator import models as M


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thermal_bank_equals_one_online_fit_per_node(seed):
    # random nodes, powers, temperatures and jittered sample times (some off the mean dt: screened)
    rng = np.random.default_rng(seed)
    n_nodes, G, steps = 7, 4, 40
    bank = M.ThermalBank(G)
    rows = np.array([bank.new_row(2.0) for _ in range(n_nodes)])
    fits = [OnlineThermalFit(G, nominal_interval_s=2.0) for _ in range(n_nodes)]
    t = rng.uniform(0, 5, n_nodes)
    for _ in range(steps):
        t = t + np.where(rng.random(n_nodes) < 0.1, rng.uniform(3.5, 6.0, n_nodes), rng.uniform(1.8, 2.2, n_nodes))
        p = rng.uniform(100, 700, (n_nodes, G))
        temp = rng.uniform(30, 85, (n_nodes, G))
        some = rng.random(n_nodes) < 0.8  # not every node reports every round
        bank.add(rows[some], t[some], p[some], temp[some])
        for k in np.nonzero(some)[0]:
            fits[k].add(t[k], p[k], temp[k])
    r, tau, inlet = bank.params(rows)
    for k, fit in enumerate(fits):
        r1, tau1, inlet1 = fit.params()
        np.testing.assert_allclose(r[k], r1, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(tau[k], tau1, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(inlet[k], inlet1, rtol=1e-9, atol=1e-12)
    # the estimates moved from the prior (the comparison above is not of two untouched priors)
    assert np.ptp(r) > 1e-3


def test_thermal_bank_rows_are_reused_at_the_prior_and_grow():
    bank = M.ThermalBank(2)
    rows = [bank.new_row(1.0) for _ in range(40)]  # past the first allocation
    assert rows == list(range(40))
    bank.add(np.array([3]), np.array([1.0]), np.array([[300.0, 300.0]]), np.array([[50.0, 50.0]]))
    bank.add(np.array([3]), np.array([2.0]), np.array([[600.0, 600.0]]), np.array([[70.0, 70.0]]))
    moved = bank.params(np.array([3]))[0].copy()
    bank.release(3)
    assert bank.new_row(1.0) == 3
    fresh = OnlineThermalFit(2, nominal_interval_s=1.0).params()
    np.testing.assert_allclose(bank.params(np.array([3]))[0][0], fresh[0], rtol=1e-12)
    assert not np.allclose(moved[0], fresh[0])
