"""Per-GPU online models (coordinator/models.py): prior-anchored power scale, full refits,
and the injectable clocks that let the what-if simulator run them on simulated time."""

from __future__ import annotations

import random

import numpy as np
import pytest

from capctl.allocator.curves import rate_unclamped  # the family itself: synthetic truth below RATE_MIN too
from coordinator import models as M
from coordinator.registry import GpuObs, NodeObs, Registry, Sample

H100 = "NVIDIA H100 80GB HBM3"
MAX_CLK = 1980.0


def _sample(t_s, cap_w, rho, power_w=None):
    """A telemetry sample of a busy GPU at enforced cap ``cap_w``: power-capped (clock = rho x max)
    when rho < 1, else drawing ``power_w`` below its cap at max clock."""
    capped = rho < 1.0
    return Sample(time_s=t_s, power_w=cap_w if capped else power_w, enforced_w=cap_w, temp_c=60.0,
                  sm_clock_mhz=rho * MAX_CLK, reasons=("SW_POWER_CAP",) if capped else (),
                  utilization_pct=100.0)


@pytest.mark.parametrize("scale", [0.9, 1.0, 1.35, 1.8])
def test_anchored_scale_recovers_a_part_needing_more_power(scale):
    # Sinha et al. SC'22: the part needs `scale` x the power for the same clock; one cap is enough
    m = M.GpuModel(H100, 200.0, 700.0)
    prior = m.prior
    for t in range(10):
        cap = 500.0
        m.add(_sample(float(t), cap, float(prior.rate(cap / scale))), MAX_CLK)
    assert m.scale == pytest.approx(scale, rel=1e-6)
    c = m.curve(now_mono=0.0)
    caps = np.linspace(300.0, 700.0, 9)
    np.testing.assert_allclose(c.rate(caps), prior.rate(caps / scale), atol=1e-9)


def test_uncapped_samples_anchor_the_saturation_at_the_measured_draw():
    m = M.GpuModel(H100, 200.0, 700.0)
    for t in range(5):
        m.add(_sample(float(t), 700.0, 1.0, power_w=520.0), MAX_CLK)
    assert m.curve(now_mono=0.0).sat_w == pytest.approx(520.0)


def test_full_fit_only_with_spread_caps_and_refit_throttle_uses_the_given_clock():
    m = M.GpuModel(H100, 200.0, 700.0)
    truth = m.prior
    for t, cap in enumerate([400.0, 401.0, 402.0] * 3):  # 3 caps within 2 W: shape unknown
        m.add(_sample(float(t), cap, float(truth.rate(cap / 1.2))), MAX_CLK)
    assert m.curve(now_mono=0.0).source.startswith("prior scaled")
    assert m.refits == 0
    for t, cap in enumerate([300.0, 500.0, 600.0] * 3):
        m.add(_sample(10.0 + t, cap, float(truth.rate(cap / 1.2))), MAX_CLK)
    c = m.curve(now_mono=100.0, rng=random.Random(1))
    assert m.refits == 1 and c.source == "online fit"
    caps = np.array([300.0, 450.0, 600.0])
    np.testing.assert_allclose(c.rate(caps), truth.rate(caps / 1.2), atol=0.02)
    # more new caps, but the throttle's clock (the argument, not the wall clock) says "too soon"
    for t, cap in enumerate([310.0, 320.0, 330.0, 340.0, 350.0, 360.0]):
        m.add(_sample(20.0 + t, cap, float(truth.rate(cap / 1.2))), MAX_CLK)
    assert m.curve(now_mono=101.0) is c and m.refits == 1
    assert m.curve(now_mono=100.0 + 2 * M.CURVE_REFIT_S).source == "online fit" and m.refits == 2


def _registry(n_gpus=2):
    reg = Registry(clock=lambda: 0.0)
    node = NodeObs(name="n1", simulated=True)
    node.session = object()
    for i in range(n_gpus):
        node.gpus[i] = GpuObs(node="n1", index=i, name=H100, min_cap_w=200.0, max_cap_w=700.0,
                              default_cap_w=700.0, slowdown_temp_c=89.0, shutdown_temp_c=92.0,
                              max_sm_clock_mhz=int(MAX_CLK), enforced_w=700.0)
    reg.nodes["n1"] = node
    return reg


def _feed(reg, models, scales, steps):
    prior = M.prior_curve(H100, 200.0, 700.0)
    out = []
    for t in range(steps):
        for i, g in reg.nodes["n1"].gpus.items():
            cap = 300.0 + 40.0 * (t % 8)
            g.new_samples.append(_sample(float(t), cap, float(rate_unclamped(cap / scales[i], prior.a, prior.k_w, prior.sat_w))))
        models.update(reg, 5.0)
        out.append([models.curve(("n1", i)) for i in reg.nodes["n1"].gpus])
    return out


def test_models_on_injected_clocks_are_deterministic_and_per_gpu():
    runs = []
    for _ in range(2):
        now = [0.0]
        models = M.Models(clock=lambda: now[0], budget_clock=lambda: now[0], rng=random.Random(3))
        reg = _registry()
        runs.append(_feed(reg, models, scales=[1.0, 1.5], steps=12))
        assert models.refits >= 2  # both GPUs refitted (their caps span 280 W)
    assert runs[0] == runs[1]
    c0, c1 = runs[0][-1]
    assert c1.rate(600.0) < c0.rate(600.0)  # the less efficient part is slower at the same cap


def test_models_refit_budget_reads_the_budget_clock():
    # a budget clock that jumps past the interval's budget at once: no full refit is allowed
    ticks = iter(range(0, 10_000_000, 1))
    models = M.Models(clock=lambda: 1e6, budget_clock=lambda: float(next(ticks)), rng=random.Random(3))
    _feed(_registry(), models, scales=[1.0, 1.5], steps=12)
    assert models.refits == 0


def test_a_new_job_on_a_gpu_starts_its_curve_from_the_prior():
    from coordinator.registry import Binding

    now = [0.0]
    models = M.Models(clock=lambda: now[0], budget_clock=lambda: now[0], rng=random.Random(3))
    reg = _registry(n_gpus=2)
    node = reg.nodes["n1"]
    node.bindings["jobA"] = Binding("jobA", "n1", (0, 1))
    _feed(reg, models, scales=[1.5, 1.5], steps=3)
    first = models.gpus[("n1", 0)]
    assert first.job_id == "jobA" and first.scale == pytest.approx(1.5, rel=1e-6)
    node.bindings.clear()  # idle: the model is kept
    models.update(reg, 5.0)
    assert models.gpus[("n1", 0)] is first
    node.bindings["jobB"] = Binding("jobB", "n1", (0,))
    _feed(reg, models, scales=[1.1, 1.5], steps=2)
    second = models.gpus[("n1", 0)]
    assert second is not first and second.job_id == "jobB"
    assert second.scale == pytest.approx(1.1, rel=1e-6)  # no memory of jobA's workload
    assert models.gpus[("n1", 1)].scale == pytest.approx(1.5, rel=1e-6)


def test_refits_of_an_interval_are_batched_within_its_budget():
    # 40 GPUs due for their first full fit; the budget clock charges 1 ms per refit (as the
    # simulator): a small cluster's budget (REFIT_BUDGET_MIN_S) pays for that many, in batches
    now = [0.0]
    models = M.Models(clock=lambda: now[0], budget_clock=lambda: now[0] + models.refits * 1e-3,
                      rng=random.Random(3))
    reg = _registry(n_gpus=40)
    prior = M.prior_curve(H100, 200.0, 700.0)
    for t in range(8):
        for g in reg.nodes["n1"].gpus.values():
            cap = 300.0 + 40.0 * t
            g.new_samples.append(_sample(float(t), cap, float(rate_unclamped(cap, prior.a, prior.k_w, prior.sat_w))))
        models.update(reg, 5.0)
    keys = [("n1", i) for i in range(40)]
    cols = models.curve_arrays(keys)
    want = round(M.REFIT_BUDGET_MIN_S / 1e-3)
    assert models.refits == want == int(cols.learned.sum())
    assert list(np.flatnonzero(cols.learned)) == list(range(want))  # in the GPUs' order
    models.update(reg, 5.0)  # the next interval: a new budget, the next GPUs
    assert int(models.curve_arrays(keys).learned.sum()) == 2 * want
    # a learned curve is its own fit, the same one the GPU's model returns
    c = models.curve(("n1", 0))
    assert c.source.startswith("online fit") and cols.curve(0).a == pytest.approx(c.a)


def test_with_more_gpus_due_than_the_budget_pays_for_none_starves():
    # 200 GPUs whose caps keep moving (due again CURVE_REFIT_S after each refit), a budget of 10
    # fits per interval (1 ms charged per refit), 1 s intervals: demand 20 per interval, twice the
    # budget. The least recently refitted go first: every GPU gets its first fit within 20
    # intervals and then one every ~20 (in GPU order, the first ~100 would take every turn)
    now = [0.0]
    models = M.Models(clock=lambda: now[0], budget_clock=lambda: now[0] + models.refits * 1e-3,
                      rng=random.Random(5))
    n = 200
    reg = _registry(n_gpus=n)
    prior = M.prior_curve(H100, 200.0, 700.0)
    keys = [("n1", i) for i in range(n)]
    seen_at: dict = {}
    for t in range(50):
        now[0] = float(t)
        for g in reg.nodes["n1"].gpus.values():
            cap = 260.0 + (13.7 * t) % 400.0  # a new cap bin every interval: always something to refit
            g.new_samples.append(_sample(float(t), cap, float(rate_unclamped(cap, prior.a, prior.k_w, prior.sat_w))))
        models.update(reg, 1.0)
        before = {k: models.gpus[k].refits for k in keys}
        models.curve_arrays(keys)
        for k in keys:
            if models.gpus[k].refits > before[k]:
                seen_at.setdefault(k, []).append(t)
    assert len(seen_at) == n  # every GPU refitted
    firsts = sorted(v[0] for v in seen_at.values())
    assert firsts[-1] - firsts[0] <= n // 10 + 1  # the first fits of all within 20 intervals of 10
    assert all(len(v) >= 2 for v in seen_at.values())  # and each again in turn
    gaps = [b - a for v in seen_at.values() for a, b in zip(v, v[1:])]
    assert max(gaps) <= n // 10 + 3
