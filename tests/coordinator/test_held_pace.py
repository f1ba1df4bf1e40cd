"""A GPU the coordinator holds at its accounted cap (UNSUPPORTED_CONSTRAINTS and the like) whose
reading is live bounds its job-mates' pace as a straggler does (coordinator.paceloop.pace_bound):
they come down to its measured pace, it gets no cap, the watts go to other jobs. Found by a
try-out: n1/3 held at 200 W, 1,155 MHz (bad limit constraints), its job-mate n1/2 stayed at
262 W, 1,320 MHz for minutes while a watt had a positive price. Without a live reading (STALLED,
LOST, a stale node) its pace is unknown and the job keeps the solve's caps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from capctl.allocator.curves import DEFAULT_CURVES
from coordinator import allocation, paceloop
from coordinator.allocation import GpuInput, SolveInputs

MAX_MHZ = 1980.0
STEP = 15.0 / MAX_MHZ


def _gpu(key, job, cap_w, mhz, *, held=False, lo_w=100.0, paced=True) -> GpuInput:
    """A busy H100 of ``job`` at enforced limit ``cap_w`` (W) running at ``mhz``: held (fixed,
    min = max = its cap; never ``paced``) or planned in ``lo_w``-700 W."""
    lo, hi = (cap_w, cap_w) if held else (lo_w, 700.0)
    g = GpuInput(key, "cluster", lo, hi, held, cap_w, cap_w, job, DEFAULT_CURVES["H100"], math.inf, lo)
    g.pace, g.pace_at_w, g.draw_w, g.pace_step = mhz / MAX_MHZ, cap_w, cap_w - 3.0, STEP
    g.paced = paced and not held
    return g


def _job_600(held_pace=True, mate_lo_w=100.0):
    held = _gpu(("n1", 3), "600", 200.0, 1155.0, held=True)
    if not held_pace:  # no live reading (STALLED, LOST, a stale node): no measured pace
        held.pace, held.pace_at_w, held.draw_w, held.pace_step = math.nan, 0.0, 0.0, 0.0
    mate = _gpu(("n1", 2), "600", 262.0, 1320.0, lo_w=mate_lo_w)
    return held, mate


def test_the_job_mate_of_a_held_gpu_comes_down_to_its_pace_and_the_held_gpu_gets_no_cap():
    held, mate = _job_600()
    assert held.pace == pytest.approx(0.583, abs=1e-3) and mate.pace == pytest.approx(0.667, abs=1e-3)
    desired = {held.key: 200.0, mate.key: 262.0}  # the solve's: the held GPU at its accounted cap
    out = paceloop.correct([mate, held], desired, {"600": 1.0})
    assert held.key not in out  # never a cap from the pace loop
    # one damped Newton step down to its pace: 262 + 0.7 * 3 * 262 / f_m * (f_h - f_m)
    s_w = paceloop.GAIN * 3.0 * 262.0 / mate.pace
    assert out[mate.key] == pytest.approx(262.0 + s_w * (held.pace - mate.pace), abs=1e-6)
    assert 190.0 < out[mate.key] < 195.0  # ~69 W freed
    # never below its minimum cap
    held, mate = _job_600(mate_lo_w=200.0)
    assert paceloop.correct([mate, held], desired, {"600": 1.0}) == {mate.key: 200.0}


def test_a_held_gpu_without_a_live_reading_leaves_its_job_as_it_was():
    held, mate = _job_600(held_pace=False)
    desired = {held.key: 200.0, mate.key: 262.0}
    assert paceloop.correct([mate, held], desired, {"600": 1.0}) == {}
    inputs = SolveInputs(gpus=[mate, held], jobs={"600": 1.0}, domains=[
        {"name": "cluster", "parent": None, "limit_w": 462.0, "kind": "cluster"}], objective="proportional",
        slew_w=None, node_domain={}, domain_members={"cluster": frozenset([mate.key, held.key])})
    d = dict(desired)
    allocation.paced_split(inputs, d)
    assert d == desired


def test_paced_split_frees_the_mates_watts_for_the_job_after_it_and_never_moves_the_held_gpu():
    """On the columns (the coordinator's path): job 600's mate comes down; job 700 after it (two
    paced GPUs at equal pace, below their ceilings) takes the watts it freed, within the limit."""
    held, mate = _job_600()
    k = [_gpu(("n2", i), "700", 400.0, 1500.0) for i in range(2)]
    gpus = [mate, held, *k]
    desired = {mate.key: 262.0, held.key: 200.0, k[0].key: 400.0, k[1].key: 400.0}
    limit_w = sum(desired.values())
    inputs = SolveInputs(gpus=gpus, jobs={"600": 1.0, "700": 1.0}, domains=[
        {"name": "cluster", "parent": None, "limit_w": limit_w, "kind": "cluster"}], objective="proportional",
        slew_w=None, node_domain={}, domain_members={"cluster": frozenset(desired)})
    d = dict(desired)
    at = np.array([d[g.key] for g in gpus])
    allocation.paced_split(inputs, d, at)
    assert d[held.key] == 200.0 and at[1] == 200.0
    freed = 262.0 - d[mate.key]
    assert 67.0 < freed < 72.0
    # (job 700 is on the clock-step grid: aligned, it takes the watts of its next steps, not all)
    assert 0.9 * freed < d[k[0].key] + d[k[1].key] - 800.0 <= freed
    assert sum(d.values()) <= limit_w + 1e-6
    assert at.tolist() == [d[g.key] for g in gpus]


def test_a_held_gpus_pace_is_measured_only_from_a_live_fresh_reading():
    """allocation._pace_columns: a fixed GPU busy with a live reading has a pace (never ``paced``);
    one without a live reading (STALLED / LOST), on a stale node, idle, or not fixed at all keeps
    today's columns."""
    n = 5
    c = {"max_sm_clock_mhz": np.full(n, MAX_MHZ), "sm_clock_mhz": np.array([1155.0, 1155.0, 1155.0, 1155.0, 1320.0]),
         "sample_enforced_w": np.array([200.0, 200.0, 200.0, 200.0, 262.0]), "power_w": np.full(n, 198.0),
         "reasons": tuple([("SW_POWER_CAP",)] * n), "utilization_pct": np.array([100.0, 100.0, 100.0, 0.0, 100.0]),
         "have_reading": np.ones(n, bool), "reading_live": np.array([True, False, True, True, True])}
    fixed = np.array([True, True, True, True, False])
    stale = np.array([False, False, True, False, False])
    pace, at, paced, draw, step = allocation._pace_columns(c, fixed, np.ones(n, bool), {}, None, stale)
    assert pace[0] == pytest.approx(1155.0 / MAX_MHZ) and at[0] == 200.0 and step[0] == pytest.approx(STEP)
    assert np.isnan(pace[1:4]).all() and not paced[:4].any()
    assert pace[4] == pytest.approx(1320.0 / MAX_MHZ) and paced[4]
    assert paceloop.pace_bound(np.zeros(n, bool), fixed, pace).tolist() == [True, False, False, False, False]
