"""The memory-bound share estimate (coordinator/membound.py) and its one hook in the per-GPU models:
bounded, monotone, the inverse of the step-time model, and neutral when NVML reports nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import membound as MB
from coordinator import models as M
from coordinator.registry import Sample

H100 = "NVIDIA H100 80GB HBM3"
MAX_CLK = 1980.0


def _busy_share(m, r):
    """The memory-busy share of a step of memory-bound share m at clock ratio r (the model)."""
    return m / (m + (1.0 - m) / r)


@settings(max_examples=200, deadline=None)
@given(m=st.floats(0.0, MB.MAX_SHARE), r=st.floats(0.3, 1.0), util=st.floats(MB.MIN_GPU_UTILIZATION_PCT, 100.0))
def test_share_inverts_the_step_time_model_at_any_clock(m, r, util):
    est = MB.sample_share(util * _busy_share(m, r), util, r)
    assert est == pytest.approx(m, abs=1e-9)


def test_share_is_bounded_and_monotone_in_memory_utilization_and_clock():
    mem = np.linspace(0.0, 100.0, 101)
    est = MB.sample_share(mem, 100.0, 0.8)
    assert np.all(np.diff(est) >= 0) and est[0] == 0.0 and est.max() == MB.MAX_SHARE
    # the same memory utilization at a lower clock means a larger share at max clock
    by_clock = MB.sample_share(30.0, 100.0, np.linspace(0.4, 1.0, 13))
    assert np.all(np.diff(by_clock) < 0) and by_clock[-1] == pytest.approx(0.30)


@pytest.mark.parametrize("mem,gpu,r", [
    (math.nan, 100.0, 0.8), (30.0, math.nan, 0.8), (-1.0, 100.0, 0.8), (101.0, 100.0, 0.8),
    (30.0, 120.0, 0.8), (5.0, 10.0, 0.8), (30.0, 100.0, 0.0), (30.0, 100.0, 1.2), (30.0, 100.0, math.nan)])
def test_absent_idle_or_out_of_range_samples_give_no_estimate(mem, gpu, r):
    assert np.isnan(MB.sample_share(mem, gpu, r))


def test_smoothing_converges_ignores_nan_and_starts_from_the_first_sample():
    mean, wt = MB.smooth(np.zeros(2), np.zeros(2), np.array([0.4, np.nan]))
    assert mean[0] == pytest.approx(0.4) and wt[0] == 1.0 and wt[1] == 0.0
    for _ in range(200):
        mean, wt = MB.smooth(mean, wt, np.array([0.2, np.nan]))
    assert mean[0] == pytest.approx(0.2, abs=1e-6) and mean[1] == 0.0 and wt[1] == 0.0
    # half-life: from a long history at 0 (its steady weight), HALF_LIFE_SAMPLES samples of a new
    # value move the mean half way
    mean, wt = np.array([0.0]), np.array([1.0 / (1.0 - 0.5 ** (1.0 / MB.HALF_LIFE_SAMPLES))])
    for _ in range(int(MB.HALF_LIFE_SAMPLES)):
        mean, wt = MB.smooth(mean, wt, np.array([0.5]))
    assert mean[0] == pytest.approx(0.25, abs=0.01)


def test_rate_of_clock_is_monotone_and_neutral_at_zero_share():
    r = np.linspace(0.4, 1.0, 7)
    assert np.allclose(MB.rate_of_clock(r, 0.0), r)
    rates = [MB.rate_of_clock(r, m) for m in (0.0, 0.3, 0.6)]
    assert all(np.all(b[:-1] > a[:-1]) for a, b in zip(rates, rates[1:]))  # a memory-bound step loses less
    assert all(np.all(np.diff(x) > 0) and x[-1] == 1.0 for x in rates)
    assert MB.rate_of_clock(0.5, 0.5) == pytest.approx(1.0 / 1.5)


def _capped(t_s, cap_w, clock_ratio, mem_pct=math.nan):
    return Sample(time_s=t_s, power_w=cap_w, enforced_w=cap_w, temp_c=60.0, sm_clock_mhz=clock_ratio * MAX_CLK,
                  reasons=("SW_POWER_CAP",), utilization_pct=100.0, memory_utilization_pct=mem_pct)


class _Reg:
    """The two things Models.update reads of a Registry: its nodes and the new samples."""

    def __init__(self):
        from coordinator.registry import GpuObs, NodeObs

        node = NodeObs(name="n1")
        node.gpus[0] = GpuObs(node="n1", index=0, name=H100, min_cap_w=200.0, max_cap_w=700.0,
                              max_sm_clock_mhz=int(MAX_CLK))
        self.nodes = {"n1": node}

    def feed(self, samples):
        """The GPU's new samples, as Registry.on_telemetry leaves them for Models.update."""
        self.nodes["n1"].gpus[0].new_samples = list(samples)


def _models_after(batches):
    models = M.Models(clock=lambda: 0.0, budget_clock=lambda: 0.0)
    reg = _Reg()
    for batch in batches:
        reg.feed(batch)
        models.update(reg, 1.0)
    return models


def test_models_without_memory_utilization_keep_the_clock_curve_and_with_it_flatten_it():
    caps = [(400.0, 0.80), (450.0, 0.86), (500.0, 0.91)]
    plain = _models_after([[_capped(float(t), c, r)] for t, (c, r) in enumerate(caps * 4)])
    key = ("n1", 0)
    assert plain.memory_bound(key) is None and plain.memory_bounds() == {}
    # without an estimate the curve is the clock curve itself (the same object the model holds)
    c = plain.curve(key)
    assert c is plain.gpus[key].curve(now_mono=0.0, allow_refit=False)
    # a 0.4-memory-bound step, as NVML's memory utilization shows it at each clock
    mem = [[_capped(float(t), c, r, round(100 * _busy_share(0.4, r)))] for t, (c, r) in enumerate(caps * 4)]
    seen = _models_after(mem)
    est = seen.memory_bound(key)
    assert est == pytest.approx(0.4, abs=0.01) and seen.memory_bounds() == {key: est}
    rate = seen.curve(key)
    clock = seen.gpus[key].curve(now_mono=0.0, allow_refit=False)
    assert (rate.k_w, rate.sat_w) == (clock.k_w, clock.sat_w) and rate.a == pytest.approx(clock.a * (1 - est))
    p = np.linspace(300.0, 650.0, 8)
    truth = MB.rate_of_clock(clock.rate(p), est)  # the model's step rate at the clock curve's clocks
    assert np.all(rate.rate(p) >= clock.rate(p)) and np.all(rate.rate(p) >= truth - 1e-12)
    x = 1.0 - clock.rate(p)  # first order: above the model's rate by at most (1-m) m x^2 / (1 - m x)
    assert np.all(rate.rate(p) - truth <= (1 - est) * est * x ** 2 / (1 - est * x) + 1e-9)
    assert seen.curve(key) is rate  # cached while nothing changed


def test_column_path_gives_the_per_gpu_paths_memory_bound_curves():
    # the solver reads curves as arrays (Models.curve_arrays, CurveColumns.curves_at); with shares
    # estimated they must equal the per-GPU hook (Models.curve) within 1e-9, the hook applied once
    # (a = clock curve's a x (1 - share)), learned and prior curves both
    import random

    from tests.coordinator.test_columns import _close, _registry, _sample

    rng = random.Random(5)
    reg = _registry(rng, nodes=10, per_node=4)
    models = M.Models(clock=lambda: 1e6, budget_clock=lambda: 0.0, rng=random.Random(0))
    share_of = {g.key: rng.choice([None, 0.0, 0.2, 0.55, 0.85]) for n in reg.nodes.values() for g in n.gpus.values()}
    for step in range(30):
        for node in reg.nodes.values():
            for g in node.gpus.values():
                smp = _sample(rng, float(step))
                m, r = share_of[g.key], smp.sm_clock_mhz / g.max_sm_clock_mhz
                if m is not None and r > 0:
                    smp = smp._replace(memory_utilization_pct=float(round(smp.utilization_pct * _busy_share(m, r))))
                g.new_samples = [smp]
        models.update(reg, 1.0)
    keys = sorted(models.gpus) + [("unknown", 0)]
    arrays = models.curve_arrays(keys)
    rows = arrays.curves_at(list(range(len(keys))))
    with_share = learned = 0
    for i, key in enumerate(keys):
        want = models.curve(key)
        assert rows[i] == arrays.curve(i)
        if want is None:
            assert rows[i] is None
            continue
        got = rows[i]
        assert _close([got.a, got.k_w, got.sat_w, got.valid_min_w], [want.a, want.k_w, want.sat_w, want.valid_min_w])
        assert _close([arrays.a[i], arrays.k_w[i], arrays.sat_w[i], arrays.valid_min_w[i]],
                      [want.a, want.k_w, want.sat_w, want.valid_min_w]), key
        share = models.memory_bound(key) or 0.0
        clock = models.gpus[key].curve(now_mono=1e6, allow_refit=False)
        assert math.isclose(want.a, clock.a * (1.0 - share), rel_tol=1e-12, abs_tol=1e-15), key  # once
        with_share += share > 0.05
        learned += share > 0.05 and bool(arrays.learned[i])
    assert with_share >= 10 and learned >= 1  # the comparison covers shares on priors and learned fits


def test_policy_zero_keeps_no_estimate_and_drops_one_kept_before():
    caps = [(400.0, 0.80), (450.0, 0.86), (500.0, 0.91)]
    batches = [[_capped(float(t), c, r, round(100 * _busy_share(0.4, r)))] for t, (c, r) in enumerate(caps * 4)]
    key = ("n1", 0)
    models = M.Models(clock=lambda: 0.0, budget_clock=lambda: 0.0)
    reg = _Reg()
    for batch in batches[:6]:
        reg.feed(batch)
        models.update(reg, 1.0)
    assert models.memory_bound(key) == pytest.approx(0.4, abs=0.01)  # estimated (the default)
    models.memory_bound_share = "zero"  # policy models.memory_bound_share: zero (a reload)
    for batch in batches[6:]:
        reg.feed(batch)
        models.update(reg, 1.0)
        assert models.memory_bound(key) is None and models.memory_bounds() == {}
    rate = models.curve(key)
    clock = models.gpus[key].curve(now_mono=0.0, allow_refit=False)
    assert rate is clock  # the clock curve itself, on both paths
    arrays = models.curve_arrays([key])
    assert arrays.a[0] == clock.a and arrays.mem_share is None


def test_memory_bounds_lists_every_gpu_with_an_estimate_and_its_value():
    """Models.memory_bounds (read on arrays) equals memory_bound GPU by GPU: the GPUs with an
    estimate and their values, none of the others."""
    from coordinator.registry import GpuObs

    models = M.Models(clock=lambda: 0.0, budget_clock=lambda: 0.0)
    reg = _Reg()
    node = reg.nodes["n1"]
    for i in range(1, 6):
        node.gpus[i] = GpuObs(node="n1", index=i, name=H100, min_cap_w=200.0, max_cap_w=700.0,
                              max_sm_clock_mhz=int(MAX_CLK))
    caps = [(400.0, 0.80), (450.0, 0.86), (500.0, 0.91)]
    for t, (c, r) in enumerate(caps * 4):
        for i, g in node.gpus.items():
            share = 0.1 * i if i % 2 else 0.0  # odd GPUs report a memory utilization
            g.new_samples = [_capped(float(t), c, r, round(100 * _busy_share(share, r)) if share else math.nan)]
        models.update(reg, 1.0)
    want = {k: models.memory_bound(k) for k in models.gpus if models.memory_bound(k) is not None}
    assert set(want) == {("n1", 1), ("n1", 3), ("n1", 5)}
    assert want[("n1", 5)] > want[("n1", 1)] > 0
    assert models.memory_bounds() == want
