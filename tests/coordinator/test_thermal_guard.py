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
