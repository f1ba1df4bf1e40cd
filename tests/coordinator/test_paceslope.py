"""Each GPU's measured slope of power over pace (coordinator.paceslope), the loop's bound on the
model's slope (paceloop.loop_slope_w), and the solver inputs carrying it (allocation.build_inputs)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from coordinator import allocation as A
from coordinator import paceloop, paceslope
from coordinator.models import Models
from coordinator.registry import Binding, GpuObs, NodeObs, Registry

STEP = 15.0 / 1980.0
STATIC_W = 70.0


def _law(cap_w: float, k: float, dyn_w: float = 600.0) -> float:
    """Pace on the 15 MHz grid of a plant ``f = ((P - P_s) / D)^k`` (grid: the readings are exact)."""
    f = ((cap_w - STATIC_W) / dyn_w) ** k
    return math.floor(f / STEP + 1e-9) * STEP


def _feed(points, static_w=STATIC_W, step=STEP):
    """Observe one GPU at ``points`` [(op_w, pace, valid)]; the slope after each."""
    s = paceslope.PaceSlopes()
    out = []
    for w, f, ok in points:
        out.append(float(s.observe((("n", 0),), [w], [f], [ok], [step], [static_w])[0]))
    return out


@pytest.mark.parametrize("k", [0.25, 1.0 / 3.0, 0.5, 1.0])
def test_two_points_give_the_power_laws_slope_at_the_latest(k):
    a, b = 300.0, 420.0
    fa, fb = _law(a, k), _law(b, k)
    got = _feed([(a, fa, True), (b, fb, True)])
    assert math.isnan(got[0])  # one point: nothing measured
    n = math.log((b - STATIC_W) / (a - STATIC_W)) / math.log(fb / fa)
    assert got[1] == pytest.approx(n * (b - STATIC_W) / fb)
    true = (b - STATIC_W) / (k * fb)  # dP/df of the plant at b (the clock read to within a step)
    assert got[1] == pytest.approx(true, rel=0.12)


def test_small_moves_accumulate_and_an_unchanged_sample_changes_nothing():
    f0 = _law(300.0, 1.0)
    pts = [(300.0, f0, True), (302.0, f0, True)]  # no clock step: nothing to read yet
    got = _feed(pts + [(302.0, f0, True)] * 3)
    assert all(math.isnan(x) for x in got)
    far = _law(360.0, 1.0)
    got = _feed(pts + [(360.0, far, True), (360.0, far, True), (360.0, far, True)])
    assert math.isfinite(got[2]) and got[2] == got[3] == got[4]  # idempotent: several builds per interval


def test_a_load_change_re_anchors_keeping_the_shape_and_idle_forgets():
    a, b = 300.0, 420.0
    fa, fb = _law(a, 1.0), _law(b, 1.0)
    base = [(a, fa, True), (b, fb, True)]
    n = _feed(base)[-1] * fb / (b - STATIC_W)  # the measured exponent
    # a new load (the pace drops 10 steps at the same limit): the law's shape holds (the load
    # scales D, not n), its slope read at the new point; the next secant starts there
    f2 = fb - 10 * STEP
    got = _feed(base + [(b, f2, True), (b + 2.0, f2 - 2 * STEP, True)])
    assert got[2] == pytest.approx(n * (b - STATIC_W) / f2)
    assert got[3] == pytest.approx(n * (b + 2.0 - STATIC_W) / (f2 - 2 * STEP))  # no secant across the change
    # the pace falls while the limit rises (a monotone plant never does that): the same
    got = _feed(base + [(b + 30.0, fb - 5 * STEP, True)])
    assert got[-1] == pytest.approx(n * (b + 30.0 - STATIC_W) / (fb - 5 * STEP))
    # idle (not paced): forgotten
    assert math.isnan(_feed(base + [(b, 0.2, False), (b, fb, True)])[-1])
    # at its max clock below the cap the clock says nothing of the slope (none reported); back
    # under the cap the shape holds
    got = _feed(base + [(690.0, 1.0, True), (b, fb, True)])
    assert math.isnan(got[2]) and got[3] == pytest.approx(got[1])


def test_states_follow_their_gpus_when_the_keys_change():
    s = paceslope.PaceSlopes()
    k1, k2 = ("a", 0), ("b", 0)
    fa, fb = _law(300.0, 1.0), _law(420.0, 1.0)
    s.observe((k1, k2), [300.0, 300.0], [fa, fa], [True, True], [STEP, STEP], [STATIC_W, STATIC_W])
    got = s.observe((k2,), [420.0], [fb], [True], [STEP], [STATIC_W])  # k1 gone, k2 keeps its anchor
    assert math.isfinite(got[0])
    got = s.observe((k1, k2), [420.0, 420.0], [fb, fb], [True, True], [STEP, STEP], [STATIC_W, STATIC_W])
    assert math.isnan(got[0]) and math.isfinite(got[1])  # k1 starts over


def test_off_grid_clocks_are_read_to_one_mhz():
    # a continuous plant (whole MHz off the 15 MHz grid): 6 MHz is a readable change; 3 steps on the
    # grid are not
    f0, f1 = 1003.0 / 1980.0, 1009.0 / 1980.0
    assert math.isfinite(_feed([(300.0, f0, True), (306.0, f1, True)])[-1])
    g0, g1 = 1005.0 / 1980.0, 1050.0 / 1980.0  # both on the grid: 3 steps, below MIN_STEPS
    assert math.isnan(_feed([(300.0, g0, True), (330.0, g1, True)])[-1])


def test_the_loop_slope_only_lowers_the_model_and_within_its_range():
    model = paceloop.slope_w(400.0, 0.8)
    assert model == pytest.approx(1500.0)
    assert paceloop.loop_slope_w(model, math.nan) == model
    assert paceloop.loop_slope_w(model, 0.0) == model and paceloop.loop_slope_w(model, -5.0) == model
    assert paceloop.loop_slope_w(model, 400.0) == 400.0  # measured far lower: the measured
    # within 1 / GAIN of the model (a cube-law plant: static power): the model's step is overdamped
    assert paceloop.loop_slope_w(model, 0.8 * model) == model
    assert paceloop.loop_slope_w(model, 0.69 * model) == pytest.approx(0.69 * model)
    assert paceloop.loop_slope_w(model, 4000.0) == model  # measured higher: the model's
    assert paceloop.loop_slope_w(model, 1.0) == pytest.approx(model / paceloop.MAX_MISMATCH)


def test_the_solver_inputs_carry_the_measured_slope():
    now = 1000.0
    reg = Registry(clock=lambda: now)
    node = NodeObs(name="n1", session=object(), last_report_mono=now - 0.5)
    for i in range(2):
        node.gpus[i] = GpuObs(node="n1", index=i, name="NVIDIA H100 80GB HBM3", min_cap_w=200.0, max_cap_w=700.0,
                              default_cap_w=700.0, max_sm_clock_mhz=1980, have_reading=True, utilization_pct=100.0,
                              reasons=("SW_POWER_CAP",), sample_mono=now - 0.5)
    node.bindings["J"] = Binding("J", "n1", (0, 1))
    reg.nodes["n1"] = node
    models = Models(clock=lambda: now, rng=random.Random(0))
    policy = _policy()
    static = 0.1 * 700.0

    def sample(caps):
        for i, c in enumerate(caps):
            g = node.gpus[i]
            g.enforced_w = g.cap_w = g.sample_enforced_w = g.power_w = c
            g.sm_clock_mhz = int(1980 * _law(c, 1.0, 600.0 + 50 * i))
        return A.build_inputs(reg, models, policy, now, 10.0, 1.0)

    first = sample([300.0, 300.0])
    assert all(math.isnan(g.pace_slope_w) for g in first.gpus)
    second = sample([300.0, 420.0])  # GPU 1 moved 120 W, GPU 0 did not
    g0, g1 = second.gpus
    assert math.isnan(g0.pace_slope_w)
    f0, f1 = _law(300.0, 1.0, 650.0), _law(420.0, 1.0, 650.0)
    n = math.log((420.0 - static) / (300.0 - static)) / math.log(f1 / f0)
    assert g1.pace_slope_w == pytest.approx(n * (420.0 - static) / g1.pace, rel=1e-6)
    assert np.isfinite(A.columns_of(second).pace_slope_w).sum() == 1


def _policy():
    from capctl.policy.validate import parse_policy

    return parse_policy("""
version: 1
budget_w: 1400
interval_s: 1
objective: proportional
failsafe: {lease_s: 10, safe_cap_w: null}
domains:
  name: cluster
  kind: cluster
  gpu_model: H100-SXM
  gpus_per_node: 2
""", "<test>")
