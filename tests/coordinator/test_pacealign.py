"""One clock step per job (coordinator.pacealign) against a quantized DVFS plant: the simulated
driver's law (P = P_s + P_d f^3, the clock the largest 15 MHz step whose power fits under the cap)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from capctl.allocator.curves import DEFAULT_CURVES
from coordinator import pacealign, paceloop
from coordinator.allocation import GpuInput

STATIC_W = 75.0  # the plant's static power (the H100 profile's); the loop assumes 0.1 x 700 W
MAX_MHZ = 1980.0
STEP_MHZ = 15.0


def _clock(cap_w: float, dyn_w: float) -> float:
    """The plant's SM clock (MHz) under ``cap_w`` for a part drawing ``dyn_w`` dynamic at max clock."""
    if cap_w >= STATIC_W + dyn_w:
        return MAX_MHZ
    f = MAX_MHZ * ((cap_w - STATIC_W) / dyn_w) ** (1.0 / 3.0)
    return math.floor(f / STEP_MHZ + 1e-9) * STEP_MHZ


def _draw(clock_mhz: float, dyn_w: float) -> float:
    return STATIC_W + dyn_w * (clock_mhz / MAX_MHZ) ** 3


def _gpus(caps, dyn, hi=None):
    out = []
    for i, (c, d) in enumerate(zip(caps, dyn)):
        clk = _clock(c, d)
        g = GpuInput((f"n{i // 4}", i % 4), "cluster", 200.0, (hi or {}).get(i, 700.0), False, c, c, "J",
                     DEFAULT_CURVES["H100"], math.inf, 200.0)
        g.pace, g.pace_at_w, g.paced = clk / MAX_MHZ, c, True
        g.draw_w, g.pace_step = _draw(clk, d), STEP_MHZ / MAX_MHZ
        out.append(g)
    return out


def _run(caps, dyn, total_w, steps=6, hi=None):
    hist = []
    for _ in range(steps):
        gpus = _gpus(caps, dyn, hi)
        moved = paceloop.correct(gpus, {g.key: total_w / len(gpus) for g in gpus}, {"J": 1.0})
        caps = [moved.get(g.key, c) for g, c in zip(gpus, caps)]
        hist.append(caps)
    return hist


def test_gpus_a_step_apart_land_on_one_step_the_highest_the_total_allows():
    dyn = [520.0, 600.0, 455.0, 780.0, 560.0, 610.0]  # power factors ~0.85-1.3 of a 600 W part
    start = [75.0 + d * (1605.0 / MAX_MHZ) ** 3 + 3.0 for d in dyn]
    start[2] -= 6.0  # one GPU a step below: within the pace loop's deadband, so nothing moved it
    clocks = [_clock(c, d) for c, d in zip(start, dyn)]
    assert len(set(clocks)) == 2 and max(clocks) - min(clocks) <= paceloop.PACE_DEADBAND * MAX_MHZ
    total = sum(start) + 20.0  # the job's watts: a little more than it uses now
    hist = _run(start, dyn, total)
    final = [_clock(c, d) for c, d in zip(hist[-1], dyn)]
    assert len(set(final)) == 1, final  # every GPU on one step
    # the highest step whose mid-step caps fit the total: no higher one does
    x = final[0]
    assert x >= max(clocks)
    need_next = sum(_draw(x + STEP_MHZ, d) for d in dyn)
    assert need_next > total
    assert sum(hist[-1]) <= total + 1e-6
    assert hist[-1] == pytest.approx(hist[-2], abs=1e-9)  # a reconcile: settled caps stay put


def test_a_gpu_at_its_ceiling_sets_the_step_and_the_rest_come_down():
    dyn = [600.0, 600.0, 600.0, 600.0]
    caps = [480.0, 520.0, 520.0, 520.0]
    hist = _run(caps, dyn, 2400.0, hi={0: 480.0})
    final = [_clock(c, d) for c, d in zip(hist[-1], dyn)]
    assert len(set(final)) == 1 and final[0] == _clock(480.0, 600.0)
    assert all(c <= 480.0 + 1e-9 for c in hist[-1])


def test_align_caps_refuses_what_it_cannot_tell():
    one = np.ones(2)
    assert pacealign.align_caps([], [], [], [], [], [], [], 100.0) is None
    # no draw measured: no operating point
    assert pacealign.align_caps(0.8 * one, 0.0076 * one, 0 * one, 400 * one, 200 * one, 700 * one, 70 * one,
                                800.0) is None
    # the job's watts do not reach even its slowest GPU's step minus MAX_STEPS
    assert pacealign.align_caps(0.8 * one, 0.0076 * one, 400 * one, 400 * one, 200 * one, 700 * one, 70 * one,
                                300.0) is None


def test_a_stale_averaged_draw_is_bounded_by_what_the_cap_says():
    step = STEP_MHZ / MAX_MHZ
    f = np.array([1605.0, 1605.0, 1605.0, 1.0 * MAX_MHZ]) / MAX_MHZ
    cap = np.array([450.0, 450.0, 450.0, 600.0])
    # fresh (within one step below the cap), above the cap (before a decrease), far below (before
    # an increase), and a GPU at its max clock drawing what its work needs
    draw = np.array([446.0, 470.0, 380.0, 400.0])
    out = pacealign.settled_draw_w(f, [step] * 4, draw, cap, [70.0] * 4)
    one_step = 3 * (450.0 - 70.0) * step / f[0]
    assert out[0] == 446.0 and out[1] == 450.0
    assert out[2] == pytest.approx(450.0 - one_step) and 380.0 + 50 < out[2] < 446.0  # ~10.7 W: one step
    assert out[3] == 400.0


def test_a_gpu_on_the_target_step_keeps_its_cap_below_the_band_top_and_goes_mid_step_above():
    dyn = np.array([600.0, 520.0, 560.0])
    f = np.full(3, 1605.0 / MAX_MHZ)
    step = STEP_MHZ / MAX_MHZ
    draw = STATIC_W + dyn * f ** 3

    def power(at):  # the plant's (and the alignment's) power law at pace ``at``
        return STATIC_W + dyn * at ** 3
    caps = np.array([power(f + 0.4 * step)[0], power(f + 0.9 * step)[1], power(f + 0.1 * step)[2]])
    mid = power(f + 0.5 * step)
    total = float(mid.sum()) + 1.0  # not enough for the next step
    out = pacealign.align_caps(f, [step] * 3, draw, caps, [200.0] * 3, [700.0] * 3, [STATIC_W] * 3, total)
    assert out is not None
    assert out[0] == pytest.approx(caps[0])  # inside the band: kept (no move for a drift)
    assert out[1] == pytest.approx(mid[1])  # above it: watts it does not use, down to mid-step
    assert out[2] == pytest.approx(caps[2])  # near the step's bottom: kept (it runs on the step now)
    assert all(_clock(c, d) == 1605.0 for c, d in zip(out, dyn))
