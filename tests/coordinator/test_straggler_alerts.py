"""The solve's alerts about a job whose GPU gets no positive rate at its upper bound: not for a
straggler held at its minimum cap (its STRAGGLER flag says why), still for any other GPU
(allocation.solve on plain inputs; the allocator's alert, capctl.allocator._core._rate_ranges)."""

from __future__ import annotations

import math

from capctl.allocator.curves import DEFAULT_CURVES, rate_unclamped
from coordinator.allocation import GpuInput, SolveInputs, solve

#: a learned-looking curve fitted at 500-700 W that extrapolates below zero at 200 W
STEEP = {"a": 0.02, "k_w": 80.0, "sat_w": 650.0}
STUCK = "HW slowdown: SM clock held at 990 of 1980 MHz at any cap (HW_SLOWDOWN)"


def _inputs(straggler: str, ceiling_w: float = math.inf) -> SolveInputs:
    """Job J on n2's GPUs 0-3 (H100 limits 200-700 W): GPU 3 on :data:`STEEP`, held at its minimum
    (upper bound 200 W: a straggler's, drawing 153 W) or with a thermal ceiling; the cluster 2,400 W."""
    gpus = []
    for i in range(4):
        hi = 200.0 if i == 3 else 700.0
        g = GpuInput(("n2", i), "cluster", 200.0, hi, False, 500.0, 500.0, "J",
                     STEEP if i == 3 else DEFAULT_CURVES["H100"], ceiling_w if i == 3 else math.inf, 200.0)
        if i == 3:
            g.straggler = straggler
        gpus.append(g)
    return SolveInputs(gpus=gpus, jobs={"J": 1.0}, domains=[{"name": "cluster", "parent": None, "limit_w": 2400.0,
                                                              "kind": "cluster"}],
                       objective="proportional", slew_w=None, node_domain={"n2": "cluster"},
                       domain_members={"cluster": {("n2", i) for i in range(4)}})


def test_no_rate_alert_for_a_straggler_held_at_its_minimum():
    assert rate_unclamped(200.0, STEEP["a"], STEEP["k_w"], STEEP["sat_w"]) < 0  # the premise: -4.4
    out = solve(_inputs(STUCK))
    assert not [a for a in out.alerts if "no positive predicted rate" in a], out.alerts
    assert out.desired_w[("n2", 3)] == 200.0


def test_the_alert_stays_for_a_gpu_that_is_no_straggler():
    out = solve(_inputs("", ceiling_w=100.0))  # a thermal ceiling below its minimum: no straggler
    assert [a for a in out.alerts if "no positive predicted rate" in a] == [
        "job J: a GPU's ceiling allows no positive predicted rate; the job is held at its minimum caps"]
