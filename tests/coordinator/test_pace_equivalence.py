"""The pace loop on per-job arrays (coordinator.paceloop: gains, operating points and ceilings
computed once per job by ``_prepare``) gives the same caps, aligned jobs and headroom calls as the
per-GPU reference (tests/coordinator/pace_reference.py, the loop before the change) to 1e-9, on
random jobs covering every branch: Newton step, clock-step alignment, hold (current and stale
samples), stragglers, measured / unmeasured slopes, thermal ceilings, GPUs at max clock below
their cap, and the solve's headroom (``extra_w``)."""

from __future__ import annotations

import math
import random

import pytest

from capctl.allocator.curves import DEFAULT_CURVES
from coordinator import paceloop
from coordinator.allocation import GpuInput
from tests.coordinator import pace_reference

STEP = 15.0 / 1980.0  # one 15 MHz clock step of a 1,980 MHz part (pace units)


def _gpu(rng: random.Random, job: str, node: int, i: int, kind: str) -> GpuInput:
    lo, hi = 200.0, rng.choice([700.0, 600.0])
    cap = rng.uniform(lo, hi)
    thermal = rng.choice([math.inf, math.nan, rng.uniform(250.0, 700.0), rng.uniform(150.0, 260.0)])
    g = GpuInput((f"{job}-n{node}", i), "cluster", lo, hi, False, cap, cap, job, DEFAULT_CURVES["H100"],
                 thermal, lo)
    if kind == "grid":  # within the deadband, on the clock-step grid
        g.pace = (120 + rng.randint(0, 1)) * STEP
    else:
        g.pace = rng.choice([rng.uniform(0.3, 1.0), 1.0, rng.uniform(0.99, 1.0)])
    g.pace_at_w = cap if rng.random() < 0.85 else cap + rng.uniform(-40.0, 40.0)  # else a stale sample
    g.paced = True
    g.draw_w = rng.choice([0.0, cap * rng.uniform(0.8, 1.0), cap * rng.uniform(0.95, 1.0)])
    g.pace_step = STEP if rng.random() < 0.9 else 0.0
    if rng.random() < 0.5:  # a measured slope: below, around or above the model's
        g.pace_slope_w = 3.0 * cap / max(g.pace, 0.05) * rng.choice([0.01, 0.2, 0.6, 0.9, 1.5])
    if rng.random() < 0.06:
        g.straggler, g.paced = "HW slowdown", rng.random() < 0.5
    return g


def _cluster(seed: int):
    rng = random.Random(seed)
    gpus, jobs = [], {}
    for j in range(rng.randint(1, 12)):
        name = f"J{j}"
        jobs[name] = 1.0
        kind = rng.choice(["grid", "free", "free"])
        n = rng.choice([2, 3, 8, 16, 64])
        gpus += [_gpu(rng, name, k // 8, k % 8, kind) for k in range(n)]
    desired = {g.key: g.observed_w * rng.uniform(0.9, 1.1) for g in gpus}
    return gpus, desired, jobs, rng.choice([0.0, 50.0, 400.0])


def _run(module, gpus, desired, jobs, head_w):
    """``module.correct`` with a recording headroom function: (caps, aligned, calls)."""
    calls = []
    left = [head_w]

    def extra_w(members, caps=None):
        if caps is not None:
            calls.append((members[0].job, tuple(sorted(caps.items()))))
            return 0.0
        grant, left[0] = left[0] / 2, left[0] / 2
        calls.append((members[0].job, grant))
        return grant

    aligned: list = []
    out = module.correct(gpus, dict(desired), jobs, extra_w if head_w else None, aligned)
    return out, aligned, calls


@pytest.mark.parametrize("seed", range(60))
def test_array_pace_loop_equals_the_per_gpu_reference(seed):
    gpus, desired, jobs, head_w = _cluster(seed)
    new, new_aligned, new_calls = _run(paceloop, gpus, desired, jobs, head_w)
    ref, ref_aligned, ref_calls = _run(pace_reference, gpus, desired, jobs, head_w)
    assert set(new) == set(ref)
    assert all(abs(new[k] - ref[k]) <= 1e-9 for k in ref), max(abs(new[k] - ref[k]) for k in ref)
    assert new_aligned == ref_aligned
    assert len(new_calls) == len(ref_calls)
    for (jn, a), (jr, b) in zip(new_calls, ref_calls):
        assert jn == jr
        if isinstance(b, float):
            assert a == pytest.approx(b, abs=1e-9)
        else:
            assert [k for k, _ in a] == [k for k, _ in b]
            assert all(abs(x - y) <= 1e-9 for (_, x), (_, y) in zip(a, b))


def test_the_random_jobs_reach_every_branch():
    """The cases above are not vacuous: some jobs move, some are aligned, some hold."""
    moved = aligned = jobs_total = 0
    for seed in range(60):
        gpus, desired, jobs, head_w = _cluster(seed)
        out, al, _ = _run(pace_reference, gpus, desired, jobs, head_w)
        moved += len(out)
        aligned += len(al)
        jobs_total += len(jobs)
    assert moved > 500 and aligned >= 3, (moved, aligned, jobs_total)


def test_job_gains_equal_the_per_gpu_ones():
    for seed in range(20):
        gpus, _, _, _ = _cluster(seed)
        for job in {g.job for g in gpus}:
            members = [g for g in gpus if g.job == job]
            new, ref = paceloop._prepare(members).s, pace_reference._gains(members)
            assert new.keys() == ref.keys()
            assert all(new[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-9) for k in ref)
            j = paceloop._prepare(members)
            assert all(j.op[g.key] == pace_reference._op_w(g) for g in members)
            assert all(j.hi[g.key] == pace_reference._hi(g) for g in members)


@pytest.mark.parametrize("seed", range(20))
def test_jobs_prepared_from_columns_equal_the_rows_and_the_reference(seed):
    """allocation._pace_jobs (the columns' slices, GPUs of different jobs interleaved) gives the
    rows' :class:`paceloop._Job` exactly, and ``correct`` with it the reference's caps."""
    from coordinator.allocation import _columns_from_rows, _pace_candidates, _pace_jobs

    gpus, desired, jobs, head_w = _cluster(seed)
    random.Random(seed).shuffle(gpus)
    c = _columns_from_rows(gpus)
    cand = _pace_candidates(c, jobs).tolist()
    rows = c.rows_at(cand, with_curves=False)
    prepared = _pace_jobs(c, cand)
    assert set(prepared) == {g.job for g in rows}
    for job, j in prepared.items():
        assert j == paceloop._prepare([g for g in rows if g.job == job])
    new = paceloop.correct(rows, dict(desired), jobs, None, [], prepared)
    ref = pace_reference.correct(rows, dict(desired), jobs, None, [])
    assert set(new) == set(ref) and all(abs(new[k] - ref[k]) <= 1e-9 for k in ref)
