"""The pace loop on per-job arrays (coordinator.paceloop: gains, operating points and ceilings
computed once per job by ``_prepare``) gives the same caps, aligned jobs and headroom calls as the
per-GPU reference (tests/coordinator/pace_reference.py, the loop before the change) to 1e-9, on
random jobs covering every branch: Newton step, clock-step alignment, hold (current and stale
samples), stragglers, GPUs held at their accounted cap with or without a measured pace,
measured / unmeasured slopes, thermal ceilings, GPUs at max clock below
their cap, and the solve's headroom (``extra_w``)."""

from __future__ import annotations

import math
import random

import numpy as np
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
    head_w = rng.choice([0.0, 50.0, 400.0])
    _hold_some(random.Random(seed + 7919), gpus, desired, jobs)  # (its own stream: the draws above as before)
    return gpus, desired, jobs, head_w


def _hold_some(rng: random.Random, gpus, desired, jobs) -> None:
    """One GPU of about a quarter of the jobs held by the coordinator at its accounted cap (fixed,
    min = max = its cap, the solve's cap that too), most with a measured pace (a live reading: it
    bounds its job-mates' like a straggler), some without (NaN: LOST, STALLED; the job is skipped)."""
    for name in jobs:
        if rng.random() < 0.25:
            g = rng.choice([g for g in gpus if g.job == name])
            g.fixed, g.paced, g.straggler = True, False, ""
            g.min_cap_w = g.max_cap_w = g.accounted_w
            if rng.random() < 0.3:
                g.pace = math.nan
            desired[g.key] = g.accounted_w


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
    """The cases above are not vacuous: some jobs move, some are aligned, some hold, some with a
    GPU held at its accounted cap move (it bounding their pace), none of those held GPUs does."""
    moved = aligned = jobs_total = held_jobs = 0
    for seed in range(60):
        gpus, desired, jobs, head_w = _cluster(seed)
        out, al, _ = _run(pace_reference, gpus, desired, jobs, head_w)
        moved += len(out)
        aligned += len(al)
        jobs_total += len(jobs)
        held = {g.job for g in gpus if g.fixed and math.isfinite(g.pace)}
        held_jobs += len({g.job for g in gpus if g.key in out and g.job in held})
        assert not any(g.fixed for g in gpus if g.key in out)
    assert moved > 500 and aligned >= 3 and held_jobs > 30, (moved, aligned, jobs_total, held_jobs)


def test_job_gains_equal_the_per_gpu_ones():
    for seed in range(20):
        gpus, _, _, _ = _cluster(seed)
        for job in {g.job for g in gpus}:
            members = [g for g in gpus if g.job == job]
            j = paceloop._prepare(members)
            new, ref = dict(zip([g.key for g in members], j.s.tolist())), pace_reference._gains(members)
            assert new.keys() == ref.keys()
            assert all(new[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-9, nan_ok=True) for k in ref)
            assert j.op.tolist() == [pace_reference._op_w(g) for g in members]
            assert j.hi.tolist() == [pace_reference._hi(g) for g in members]


def _inputs(seed: int):
    """_cluster's GPUs (shuffled: jobs interleaved) as solver inputs under two racks and a cluster
    with limits (tight enough that some corrections are refused), and the solve's caps."""
    from coordinator.allocation import SolveInputs

    gpus, desired, jobs, _ = _cluster(seed)
    rng = random.Random(seed)
    rng.shuffle(gpus)
    racks = {g.key: f"r{hash(g.key[0]) % 2}" for g in gpus}
    members = {"c": frozenset(racks)} | {r: frozenset(k for k in racks if racks[k] == r) for r in ("r0", "r1")}
    total = sum(desired.values())
    domains = [{"name": "c", "parent": None, "limit_w": total * rng.uniform(0.98, 1.1), "kind": "cluster"}] + [
        {"name": r, "parent": "c", "limit_w": rng.choice([None, 0.5 * total * rng.uniform(0.95, 1.1)]),
         "kind": "rack"} for r in ("r0", "r1")]
    inputs = SolveInputs(gpus=gpus, jobs=jobs, domains=domains, objective="proportional", slew_w=None,
                         node_domain={}, domain_members=members)
    return inputs, desired


@pytest.mark.parametrize("seed", range(40))
def test_paced_split_on_columns_equals_the_row_reference(seed):
    """allocation.paced_split (per job on column slices, paceloop.job_caps) gives exactly the row
    reference's caps, ``at`` and aligned jobs (the same floats, not only within 1e-9)."""
    from coordinator import allocation

    inputs, desired = _inputs(seed)
    keys = [g.key for g in inputs.gpus]
    for with_at in (True, False):
        mine, ref = dict(desired), dict(desired)
        at_mine = np.array([desired[k] for k in keys]) if with_at else None
        at_ref = np.array([desired[k] for k in keys]) if with_at else None
        got = allocation.paced_split(inputs, mine, at_mine)
        want = pace_reference.paced_split(inputs, ref, at_ref)
        assert got == want
        assert mine == ref
        if with_at:
            assert at_mine.tobytes() == at_ref.tobytes()


def test_the_column_cases_move_refuse_and_align(monkeypatch):
    """The cases above are not vacuous: caps move, some jobs' corrections are refused by a limit
    (the loop moved them, the split kept the solve's caps), some jobs are aligned."""
    proposed: list = []

    def recording(*args, **kwargs):
        proposed.append(correct(*args, **kwargs))
        return proposed[-1]

    correct = pace_reference.correct
    monkeypatch.setattr(pace_reference, "correct", recording)
    moved = aligned = refused = 0
    for seed in range(40):
        inputs, desired = _inputs(seed)
        out = dict(desired)
        proposed.clear()
        aligned += len(pace_reference.paced_split(inputs, out))
        moved += sum(out[k] != desired[k] for k in desired)
        refused += sum(out[k] != c for k, c in (proposed[0] if proposed else {}).items())
    assert moved > 300 and aligned >= 3 and refused > 50, (moved, aligned, refused)


def _align_case(rng):
    """Random align_caps inputs: jobs on or off the grid, some GPUs at their max clock, two clock
    grids, stale draws, cube-law or measured exponents (arrays or the scalar default), bounds."""
    n = int(rng.choice([1, 2, 3, 8, 16, 64, 300]))
    base = int(rng.integers(40, 131))
    f = (base + rng.integers(0, 3, n)) * STEP if rng.random() < 0.8 else rng.uniform(0.3, 1.0, n)
    if rng.random() < 0.2:
        f[rng.random(n) < 0.3] = 1.0
    step = np.full(n, STEP) if rng.random() < 0.8 else rng.choice([STEP, 15 / 1410], n)
    cap = rng.uniform(200, 700, n)
    draw = cap * rng.uniform(0.7, 1.05, n)
    exponent = 3.0 if rng.random() < 0.3 else rng.uniform(0.3, 3.0, n)
    return (f, step, draw, cap, np.full(n, 200.0), rng.choice([700.0, 600.0, 450.0], n), np.full(n, 70.0),
            float(cap.sum() * rng.uniform(0.9, 1.1)), 1.0 if rng.random() < 0.8 else float(rng.uniform(0.3, 1.0)),
            exponent)


def test_align_caps_on_all_targets_equals_the_per_target_loop():
    """pacealign.align_caps (every target step in one array operation) gives exactly the caps of
    the loop over targets it replaced (bit for bit), or None where that did."""
    from coordinator import pacealign

    rng = np.random.default_rng(7)
    found = nothing = 0
    for _ in range(1500):
        case = _align_case(rng)
        with np.errstate(all="ignore"):
            ref = pace_reference.align_caps(*case)
        new = pacealign.align_caps(*case)
        if ref is None:
            assert new is None
            nothing += 1
        else:
            assert new is not None and new.tobytes() == np.asarray(ref).tobytes()
            found += 1
    assert found > 500 and nothing > 50, (found, nothing)


def test_a_job_whose_free_gpus_have_no_step_gain_keeps_the_solves_caps():
    # no GPU but the straggler has a positive step gain (a zero operating point) and the
    # straggler's finite pace bounds the job: the row loop raised KeyError here, failing the whole
    # interval (no plan to any node); now the job keeps the solve's caps
    from coordinator import paceloop

    n = 3
    arr = lambda *v: np.array(v, dtype=float)  # noqa: E731
    j = paceloop._Job(s=arr(0.0, 0.0, 900.0), op=arr(0.0, 0.0, 500.0), hi=arr(700.0, 700.0, 700.0))
    a = paceloop.JobGpus(pace=arr(0.9, 0.8, 0.5), pace_at_w=arr(400.0, 400.0, 700.0), observed_w=arr(400.0, 400.0, 700.0),
                         draw_w=arr(390.0, 395.0, 650.0), pace_step=np.full(n, np.nan), min_cap_w=np.full(n, 200.0),
                         max_cap_w=np.full(n, 700.0), straggler=np.array([False, False, True]), j=j)
    assert paceloop._split(a, 1500.0) is None
