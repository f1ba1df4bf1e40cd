"""Thermal ceiling vs a direct simulation of the RC equation; online identification."""

from __future__ import annotations

import numpy as np
import pytest

from capctl.allocator.thermal import OnlineThermalFit, predict_temp_c, thermal_ceiling_w


def _simulate(temp_c, power_w, inlet_c, r, tau, dt, steps=20000):
    """Explicit Euler integration of tau dT/dt = inlet + R P - T."""
    h = dt / steps
    t = np.array(temp_c, float)
    for _ in range(steps):
        t = t + h * (inlet_c + r * power_w - t) / tau
    return t


def test_ceiling_reaches_target_exactly_in_simulation():
    temp = np.array([50.0, 70.0, 80.0])
    inlet = np.array([25.0, 30.0, 22.0])
    r = np.array([0.08, 0.1, 0.06])
    tau = np.array([30.0, 45.0, 20.0])
    cap = thermal_ceiling_w(temp, inlet, r, tau, 5.0, 87.0, 3.0)
    end = _simulate(temp, cap, inlet, r, tau, 5.0)
    assert np.allclose(end, 84.0, atol=1e-3)
    hotter = _simulate(temp, cap + 10.0, inlet, r, tau, 5.0)
    assert np.all(hotter > 84.0)


def test_ceiling_below_zero_when_already_too_hot_and_bad_args():
    assert thermal_ceiling_w(95.0, 25.0, 0.1, 30.0, 5.0, 87.0, 3.0) < 0
    with pytest.raises(ValueError):
        thermal_ceiling_w(50.0, 25.0, 0.0, 30.0, 5.0, 87.0, 3.0)


def test_online_fit_recovers_r_tau_inlet():
    rng = np.random.default_rng(7)
    G = 5
    r = rng.uniform(0.05, 0.2, G)
    tau = rng.uniform(15, 90, G)
    inlet = rng.uniform(18, 32, G)
    fit = OnlineThermalFit(G, nominal_interval_s=5.0)
    t = inlet.copy()
    for k in range(800):
        p = rng.uniform(100, 450, G)
        t = predict_temp_c(t, p, inlet, r, tau, 5.0)
        fit.add(k * 5.0, p, t + rng.normal(0, 0.1, G))
    r_hat, tau_hat, inlet_hat = fit.params()
    assert np.allclose(r_hat, r, rtol=0.1)
    assert np.allclose(tau_hat, tau, rtol=0.15)
    assert np.allclose(inlet_hat, inlet, atol=2.0)


def test_online_fit_keeps_prior_without_excitation():
    fit = OnlineThermalFit(1)
    for k in range(50):
        fit.add(k * 5.0, [300.0], [55.0])
    r_hat, tau_hat, inlet_hat = fit.params()
    assert 0.005 <= r_hat[0] <= 1.0 and 1.0 <= tau_hat[0] <= 3600.0 and 0 <= inlet_hat[0] <= 60
