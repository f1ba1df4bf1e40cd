"""coordinator.allocation.thermal_guard: a GPU's thermal ceiling bounded by what it reports."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator import allocation


def _cols(temp_c, reasons, power_w):
    n = len(temp_c)
    return {"temp_c": np.asarray(temp_c, float), "slowdown_temp_c": np.full(n, 87.0), "reasons": tuple(reasons),
            "power_w": np.asarray(power_w, float)}


def test_hot_gpus_are_never_raised_and_those_in_slowdown_come_down():
    # GPUs (slowdown 87 °C, margin 5 °C: held from 84.5 °C): cool; at the 82 °C target; at 85 °C;
    # in SW thermal slowdown at 83 °C; at 88 °C without a reason; in HW thermal slowdown at 86 °C;
    # in HW thermal slowdown without a temperature reading; unknown temperature, no reason
    c = _cols([60.0, 82.0, 85.0, 83.0, 88.0, 86.0, math.nan, math.nan],
              [(), ("SW_POWER_CAP",), (), ("SW_THERMAL_SLOWDOWN",), (), ("HW_THERMAL_SLOWDOWN",),
               ("HW_THERMAL_SLOWDOWN",), ()],
              [250.0, 250.0, 250.0, 240.0, 250.0, 160.0, 200.0, 250.0])
    model = np.full(8, 1000.0)  # a model far too optimistic (a fit learned in slowdown)
    acc = np.full(8, 250.0)
    lo, hi = np.full(8, 150.0), np.full(8, 300.0)
    out = allocation.thermal_guard(model, c, acc, lo, hi, 5.0)
    # the target itself: the model's (its own raises at a whole-degree reading of the target stay);
    # a thermal reason or 84.5 °C and up: held; at the slowdown temperature (or a HW reason without
    # a reading): a tenth of the range below the lower of its cap and draw
    assert out.tolist() == [1000.0, 1000.0, 250.0, 250.0, 250.0 - 15.0, 250.0, 200.0 - 15.0, 1000.0]
    # a model that already says less is kept
    low = np.array([100.0, 200.0, 100.0, 120.0, 100.0, 90.0, 90.0, 90.0])
    assert allocation.thermal_guard(low, c, acc, lo, hi, 5.0).tolist() == low.tolist()


@pytest.mark.parametrize("temp", [40.0, 81.9])
def test_below_the_target_nothing_changes(temp):
    c = _cols([temp], [("SW_POWER_CAP",)], [300.0])
    model = np.array([640.0])
    out = allocation.thermal_guard(model, c, np.array([300.0]), np.array([200.0]), np.array([700.0]), 5.0)
    assert out is model or out.tolist() == [640.0]


def test_near_the_target_a_ceiling_moves_by_small_steps_from_the_cap():
    # slowdown 87 °C, margin 5 °C: target 82 °C, the band from 77 °C up to the guard's hold at
    # 84.5 °C; range 150-300 W: steps of 3 W, down by 3 W + 6 W per °C above the target; below the
    # band a raise is bounded by (82 - T) / R (R 0.1 °C/W: 10 W per °C)
    temps = [60.0, 76.0, 77.0, 81.0, 82.0, 83.0, 84.0, 84.5, 86.0, math.nan]
    n = len(temps)
    c = _cols(temps, [()] * n, [250.0] * n)
    acc, lo, hi, r = np.full(n, 250.0), np.full(n, 150.0), np.full(n, 300.0), np.full(n, 0.1)
    up = np.full(n, 600.0)  # the model says raise by 350 W
    out = allocation.thermal_damping(up, c, acc, lo, hi, 5.0, r)
    assert out.tolist() == pytest.approx([250.0 + 220.0, 250.0 + 60.0, 253.0, 253.0, 253.0, 253.0, 253.0,
                                          600.0, 600.0, 600.0])
    down = np.full(n, 100.0)  # ... or lower by 150 W
    out = allocation.thermal_damping(down, c, acc, lo, hi, 5.0, r)
    assert out.tolist() == pytest.approx([100.0, 100.0, 247.0, 247.0, 247.0, 241.0, 235.0, 100.0, 100.0, 100.0])
    within = np.full(n, 251.0)  # a model within the steps is kept
    assert allocation.thermal_damping(within, c, acc, lo, hi, 5.0, r).tolist() == [251.0] * n
    # a resistance above the prior's 0.1 °C/W (an early fit) bounds the raise as the prior's would
    assert allocation.thermal_damping(up, c, acc, lo, hi, 5.0, np.full(n, 0.5))[:2].tolist() == pytest.approx(
        [250.0 + 220.0, 250.0 + 60.0])
    # no thermal model below the band: no bound there; no ceiling, no slowdown temperature: as it is
    assert allocation.thermal_damping(up, c, acc, lo, hi, 5.0, np.full(n, np.nan))[:2].tolist() == [600.0, 600.0]
    inf = np.full(n, math.inf)
    assert allocation.thermal_damping(inf, c, acc, lo, hi, 5.0, r).tolist() == [math.inf] * n
    c["slowdown_temp_c"] = np.zeros(n)
    assert allocation.thermal_damping(up, c, acc, lo, hi, 5.0, r).tolist() == up.tolist()
