"""The pace loop (coordinator.paceloop) as a pure function, against a DVFS plant (P = P_s + P_d f^3,
the simulated driver's power law), and the curve kinds of the models."""

from __future__ import annotations

import math

import pytest

from capctl.allocator.curves import DEFAULT_CURVES
from coordinator import paceloop
from coordinator.allocation import GpuInput
from coordinator.models import GpuModel

STATIC_W = 70.0


def _pace_at(cap_w: float, dyn_w: float) -> float:
    """The plant: the pace a GPU with dynamic power ``dyn_w`` at max clock reaches under ``cap_w``."""
    return min(1.0, ((cap_w - STATIC_W) / dyn_w) ** (1.0 / 3.0))


def _gpu(i: int, cap_w: float, dyn_w: float, *, hi=700.0, straggler_pace=None) -> GpuInput:
    pace = straggler_pace if straggler_pace is not None else _pace_at(cap_w, dyn_w)
    g = GpuInput((f"n{i // 4}", i % 4), "cluster", 200.0, hi, False, cap_w, cap_w, "J", DEFAULT_CURVES["H100"],
                 math.inf, 200.0)
    g.pace, g.pace_at_w, g.paced = pace, cap_w, straggler_pace is None
    g.straggler = "HW slowdown" if straggler_pace is not None else ""
    return g


def _iterate(dyn, caps, total_w, steps=8, hi=None):
    """Run the loop against the plant; returns the caps after each step."""
    out = []
    for _ in range(steps):
        gpus = [_gpu(i, c, d, hi=(hi or {}).get(i, 700.0)) for i, (c, d) in enumerate(zip(caps, dyn))]
        moved = paceloop.correct(gpus, {g.key: total_w / len(gpus) for g in gpus}, {"J": 1.0})
        caps = [moved.get(g.key, c) for g, c in zip(gpus, caps)]
        out.append(caps)
    return out


def test_unequal_parts_converge_to_equal_pace_monotonically_at_the_job_total():
    dyn = [580.0, 667.0, 522.0, 754.0]  # power factors 1, 1.15, 0.9, 1.3 of a 650 W part
    hist = _iterate(dyn, [490.0] * 4, 1960.0)
    paces = [_pace_at(c, d) for c, d in zip(hist[-1], dyn)]
    assert max(paces) - min(paces) <= paceloop.PACE_DEADBAND
    assert sum(hist[-1]) == pytest.approx(1960.0, abs=0.05)
    for i in range(4):  # each cap moves one way only (overdamped), and is settled within 5 steps
        seq = [490.0] + [h[i] for h in hist]
        moves = [b - a for a, b in zip(seq, seq[1:]) if abs(b - a) > 1.0]
        assert all(m > 0 for m in moves) or all(m < 0 for m in moves)
        assert abs(hist[4][i] - hist[-1][i]) <= 5.0


def test_equal_pace_holds_the_split_and_a_ceiling_bounds_the_pace():
    same = [_gpu(i, 490.0, 580.0) for i in range(4)]
    assert paceloop.correct(same, {g.key: 500.0 for g in same}, {"J": 1.0}) == pytest.approx(
        {g.key: 500.0 for g in same})  # scaled to the job's total, split unchanged
    hist = _iterate([580.0] * 4, [500.0, 560.0, 560.0, 560.0], 2180.0, hi={0: 500.0})
    assert all(c <= 505.0 for c in hist[-1][1:])  # nobody faster than GPU 0 at its ceiling
    assert sum(hist[-1]) < 2180.0


def test_a_straggler_is_held_and_bounds_its_job_mates():
    gpus = [_gpu(0, 300.0, 580.0, straggler_pace=0.7)] + [_gpu(i, 490.0, 580.0) for i in (1, 2, 3)]
    moved = paceloop.correct(gpus, {g.key: 490.0 for g in gpus}, {"J": 1.0})
    assert moved[gpus[0].key] == pytest.approx(700.0)  # held at its (coordinator-set) ceiling
    for g in gpus[1:]:
        assert moved[g.key] < 490.0  # brought down toward its pace
        assert _pace_at(moved[g.key], 580.0) >= 0.7 - paceloop.PACE_DEADBAND


def test_curve_kind_generic_until_learned():
    unknown = GpuModel("NVIDIA B200", 200.0, 1000.0)
    known = GpuModel("NVIDIA H100 80GB HBM3", 200.0, 700.0)
    assert unknown.kind == "generic" and known.kind == "prior"


def test_a_saturated_job_takes_no_headroom():
    """A job whose GPUs run at their maximum clock below their caps (pace 1.0, drawing 650 W under
    674 W) gains nothing from watts: the headroom the solve left is not granted to it. It was
    (the pace-setter below its ceiling), which raised it to its ceiling; at the ceiling none was
    granted and it fell back to the solve's caps: a cap turning every interval, 674 <-> 700 W on
    real agents (found by two try-outs)."""
    granted = []

    def extra_w(members, caps=None):
        if caps is None:
            granted.append(100.0)
            return 100.0
        return 0.0

    for cap_w in (674.0, 700.0):  # the two states of the cycle: each keeps the solve's caps
        gpus = [_gpu(i, cap_w, 580.0) for i in range(2)]
        for g in gpus:
            g.draw_w = 650.0
        assert all(g.pace == 1.0 for g in gpus)
        moved = paceloop.correct(gpus, {g.key: 674.0 for g in gpus}, {"J": 1.0}, extra_w)
        assert all(moved.get(g.key, 674.0) == pytest.approx(674.0) for g in gpus), (cap_w, moved)
    # a job its caps hold (pace below 1) does take the headroom
    gpus = [_gpu(i, 500.0, 580.0) for i in range(2)]
    moved = paceloop.correct(gpus, {g.key: 500.0 for g in gpus}, {"J": 1.0}, extra_w)
    assert sum(moved.values()) == pytest.approx(1100.0)
