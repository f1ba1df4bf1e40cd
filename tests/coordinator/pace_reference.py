"""Reference (per-GPU, dict-based) implementation of coordinator.paceloop.correct as of c72c806
(its clock-step alignment, :func:`align_caps`, and the row-based allocation.paced_split as of
93c374b: loops over the targets and over rows, 7 Dec 2026)
(and the headroom rule of 6 Dec 2026: none for a job whose pace-setter is at its maximum clock),
kept for the equivalence test (tests/coordinator/test_pace_equivalence.py): the module
under test must give the same caps to 1e-9. Not used by the coordinator. Extended once since, in
:func:`correct` only: a fixed GPU with a measured pace (held at its accounted cap, its reading
live) is taken as a straggler there and gets no cap (jobs with one were skipped before; the
try-out that found it: coordinator.paceloop.pace_bound)."""
from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

GAIN = 0.7
"""Loop gain of the Newton step (see module docstring for the stability bound)."""
PACE_DEADBAND = 0.016
"""Pace differences (fraction of max clock) up to this are noise: two 15 MHz steps of a ~2 GHz
part (the clock is quantized to 15 MHz; a one-step difference is what equal caps give)."""
_PASSES = 4
MAX_MISMATCH = 20.0
"""Most the measured slope lowers the model's (factor; module docstring, "Stability"): the fake
agent's curve (the allocator's H100 prior) is 11x steeper than the cube law's bound at 250 W (44x
at 210 W, pace 0.12); below it a bad reading cannot make the step vanish."""
MAX_CLOCK_PACE = 0.99
"""A pace at or above this is the GPU's maximum clock."""
AT_CAP_TOLERANCE_W = 1.0
"""A pace sample is of the current operating point when taken at the GPU's current enforced limit
(within this, W): a step from an older sample would apply the same correction twice (loop delay)."""


def slope_w(at_w: float, pace: float) -> float:
    """dP/df (W per unit pace) of a GPU drawing ``at_w`` (W, its enforced limit when capped) at pace
    ``pace`` (0..1): ``3 P / f``, the slope of the DVFS power law ``P = P_static + P_dyn f^3``
    (dynamic power ~ C V^2 f with V ~ f; Hsu & Feng, SC'05; NVIDIA DVFS) with the static power
    taken as 0, so it bounds the true slope ``3 (P - P_static) / f`` from above (by
    ``P / (P - P_static)``, 1.1-1.4 for a busy datacenter GPU). Independent of the fitted curves on
    purpose: the loop must work where the models are wrong."""
    return 3.0 * float(at_w) / max(float(pace), 0.05)


def _slope(g) -> float:
    """The loop's slope (W per unit pace) for ``g``: :func:`slope_w` at its operating point
    (:func:`_op_w`), bounded by ``g``'s measured slope (:func:`loop_slope_w`)."""
    return loop_slope_w(slope_w(_op_w(g), g.pace), getattr(g, "pace_slope_w", math.nan))


def _measured(g) -> bool:
    m = getattr(g, "pace_slope_w", math.nan)
    return m > 0.0 and math.isfinite(m)


def _gains(members) -> dict:
    """GPU key -> ``GAIN`` times the loop's slope (W per unit pace) of each of one job's GPUs:
    :func:`_slope` for a GPU with a measured slope; one without takes its model slope times the
    median ratio (:func:`_slope` / model) of its job-mates that have one (a job runs on one product:
    the plant's shape is shared, its scale is the GPU's own; mixing model and measured slopes in
    one job made the unmeasured GPUs overshoot and pull the pace target), else its model slope."""
    model = {g.key: slope_w(_op_w(g), g.pace) for g in members}
    own = {g.key: _slope(g) for g in members if _measured(g)}
    ratios = [own[k] / model[k] for k in own if model[k] > 0] if len(own) < len(members) else []
    ratio = statistics.median(ratios) if ratios else 1.0
    return {g.key: GAIN * own.get(g.key, model[g.key] * ratio) for g in members}


def loop_slope_w(model_w: float, measured_w: float) -> float:
    """The slope the loop steps by (W per unit pace): the model's (``model_w``, :func:`slope_w`),
    or the GPU's measured one (``measured_w``, :mod:`coordinator.paceslope`; NaN or not positive:
    none) where that is below ``GAIN * model_w`` (the model's step would overshoot: ``GAIN *
    model / true > 1``), never below ``model_w / MAX_MISMATCH``. Only lowers: at or above that the
    model's step is overdamped already and faster (a cube-law plant, a flatter one; see the module
    docstring)."""
    if not (measured_w > 0.0 and math.isfinite(measured_w)) or measured_w >= GAIN * model_w:
        return model_w
    return max(measured_w, model_w / MAX_MISMATCH)


def correct(gpus, desired: dict, jobs, extra_w=None, aligned=None) -> dict:
    """The pace-corrected split of each job's watts; returns GPU key -> cap (W) for the GPUs it
    moved (a subset of ``desired``'s keys; the rest keep the solve's caps).

    ``gpus``: :class:`coordinator.allocation.GpuInput` rows (``pace``, ``pace_at_w``,
    ``observed_w``, ``paced``, ``min_cap_w``, ``max_cap_w``, ``thermal_ceiling_w``, ``curve``,
    ``job``, ``fixed``, ``straggler``). A straggler is held at its ceiling and its measured pace
    bounds its job-mates' (its pace does not respond to power). The loop owns the split of a job whose GPUs are all ``paced`` (a fresh
    sample with the cap setting the clock) and not fixed: a Newton step when every sample is of the
    current operating point and the paces differ by more than :data:`PACE_DEADBAND`; else the
    current split scaled to the job's total (the curves alone never move it). Other jobs keep the
    solve's split. ``extra_w(members)``: watts a job whose every GPU's clock is set by its cap may
    add to the solve's total (headroom the solve left, which the measured clocks say it can use).
    ``aligned``: a list the jobs put on one clock step (:func:`_align`) are appended to, or None.
    """
    by_job: dict = {}
    for g in gpus:
        if g.job is not None and g.job in jobs:
            by_job.setdefault(g.job, []).append(g)
    out = {}
    for job, members in by_job.items():
        # extended for one case (held-pace): a fixed GPU with a measured pace (finite ``pace``: a
        # live reading; coordinator.paceloop.pace_bound) bounds its job-mates' as a straggler does.
        # Taken as a straggler here (its ceiling is its accounted cap: min = max), and given no cap;
        # a job with one was skipped before, every other job is as it was
        held = {g.key for g in members if g.fixed and math.isfinite(g.pace)}
        members = [dataclasses.replace(g, straggler=g.straggler or "held", fixed=False) if g.key in held else g
                   for g in members]
        if (len(members) < 2 or not all((g.paced or g.straggler) and not g.fixed for g in members)
                or not any(g.paced for g in members)):
            continue
        paces = [g.pace for g in members]
        slowest = min(members, key=lambda g: g.pace)
        solve_w = sum(desired[g.key] for g in members)
        avail = extra_w(members) if extra_w else 0.0  # headroom the solve left (granted; unused returned)
        current = all(abs(g.pace_at_w - g.observed_w) <= AT_CAP_TOLERANCE_W for g in members if not g.straggler)
        caps = None
        # more watts help only if the pace-setter can take them (not held at its ceiling, below
        # its maximum clock)
        total = solve_w + (avail if (_hi(slowest) - slowest.observed_w > AT_CAP_TOLERANCE_W
                                     and slowest.pace < MAX_CLOCK_PACE) else 0.0)
        if current and max(paces) - min(paces) > PACE_DEADBAND:
            caps = _split(members, total)
        elif current and _on_grid(members):  # within the deadband on a clock-step grid: every GPU
            caps = _align(members, solve_w + avail)  # on one step, with the watts it needs at most
            total = solve_w + avail if caps is not None else total
            if caps is not None and aligned is not None:
                aligned.append(job)
        if caps is None:  # equal pace, or a sample from before the last change: the split holds (scaled to T)
            caps = _hold(members, total, grow=current)
        if len(caps) == len(members) and sum(caps.values()) <= total + 1e-6:
            caps = {k: c for k, c in caps.items() if k not in held}  # (held: no cap)
            out.update(caps)  # never more than the solve gave the job (clipping at minimums can)
        else:
            caps = {}
        if extra_w:  # what the job did not use (headroom and the solve's) goes to the jobs after it
            extra_w(members, caps)
    return out


def _on_grid(members) -> bool:
    """Whether the job's GPUs report clocks on one step grid (:func:`coordinator.pacealign.on_grid`
    on the non-stragglers' paces and clock steps)."""
    from coordinator import pacealign

    rest = [g for g in members if not g.straggler]
    return pacealign.on_grid([g.pace for g in rest], [g.pace_step for g in rest])


def _align(members, total_w: float):
    """:func:`coordinator.pacealign.align_caps` on the job's GPUs (stragglers held at their
    ceiling, bounding the target to their pace); None when a GPU lacks a draw or a clock step (its
    sample cannot tell its step) or no step fits."""
    from coordinator import pacealign

    strag = [g for g in members if g.straggler]
    rest = [g for g in members if not g.straggler]
    if not rest or any(g.draw_w <= 0 or g.pace_step <= 0 for g in rest):
        return None
    held = {g.key: _hi(g) for g in strag}
    static = [pacealign.STATIC_FRACTION * g.max_cap_w for g in rest]
    gains = _gains(members)
    n = pacealign.exponent_from_slope([gains[g.key] / GAIN for g in rest], [g.pace for g in rest],
                                      [g.draw_w for g in rest], static)
    caps = align_caps(
        [g.pace for g in rest], [g.pace_step for g in rest], [g.draw_w for g in rest],
        [g.pace_at_w for g in rest], [g.min_cap_w for g in rest], [_hi(g) for g in rest],
        static, total_w - sum(held.values()), min([1.0] + [g.pace for g in strag]), n)
    if caps is None:
        return None
    held.update({g.key: float(c) for g, c in zip(rest, caps)})
    return held


def _op_w(g) -> float:
    """The power (W) at which ``g``'s pace was measured: its enforced limit when the cap sets its
    clock, its draw when it runs at its maximum clock below the cap (the cap is not its operating
    point then: stepping from it would hand the GPU watts it does not use)."""
    if g.pace >= 0.99 and 0.0 < g.draw_w < g.pace_at_w:
        return g.draw_w
    return g.pace_at_w


def _hold(members, total_w: float, grow: bool = True) -> dict:
    """The job's current split (enforced limits) scaled to ``total_w`` (W), within each GPU's
    range; a GPU held at its ceiling bounds the others' pace (:func:`_bound_by_ceiling`).
    ``grow`` False (a sample from before the last change): scaled down only, never up; the watts
    wait one interval for a sample of the current caps (scaling up from a stale sample undid the
    clock-step alignment of the interval before: a two-interval limit cycle)."""
    strag = [g for g in members if g.straggler]
    rest = [g for g in members if not g.straggler]
    caps = {g.key: _hi(g) for g in strag}  # held (where extra watts buy nothing)
    now = sum(g.observed_w for g in rest)
    if now <= 0:
        return {}
    k = (total_w - sum(caps.values())) / now
    if not grow:
        k = min(k, 1.0)
    caps.update({g.key: min(max(g.observed_w * k, g.min_cap_w), _hi(g)) for g in rest})
    at_hi = [g for g in rest if caps[g.key] >= _hi(g) - AT_CAP_TOLERANCE_W]
    return _bound_by_ceiling(members, caps, at_hi)


def _bound_by_ceiling(members, caps: dict, at_hi) -> dict:
    """Nobody planned faster than the pace the GPUs ``at_hi`` (held at their ceiling) reach there:
    ``c_g <= e_g + s_g (reach - f_g)`` with ``reach = min(f_h + (hi_h - e_h) / s_h)`` (W)."""
    s = _gains(members)
    reaches = {g.key: g.pace + (_hi(g) - _op_w(g)) / s[g.key] for g in at_hi if s[g.key] > 0}
    reach = min(reaches.values(), default=math.inf)
    reach = min([reach] + [g.pace for g in members if g.straggler])  # a straggler's pace is fixed
    if not math.isfinite(reach):
        return caps
    # held: the GPUs that set the reach (and the stragglers); a GPU at its ceiling that would be
    # faster there is bounded like the others (it would wait at the barrier)
    held = {k for k, r in reaches.items() if r <= reach + 1e-9} | {g.key for g in members if g.straggler}
    for g in members:
        if g.key not in held:
            caps[g.key] = min(caps[g.key], max(g.min_cap_w, _op_w(g) + s[g.key] * (reach - g.pace)))
    return caps


def _hi(g) -> float:
    return max(g.min_cap_w, min(g.max_cap_w, g.thermal_ceiling_w if math.isfinite(g.thermal_ceiling_w) else math.inf))


def _split(members, total_w: float) -> dict:
    """One damped Newton step of ``members`` toward equal pace with ``sum(caps) <= total_w`` (W).

    GPUs whose step leaves their range are clipped and the pace target recomputed for the rest
    (a few passes). A GPU held at its ceiling sets the pace: nobody is planned faster than it gets
    there (watts to a GPU that would wait at the barrier buy nothing), so the sum can stay below
    ``total_w``; the rest is left to the other jobs."""
    s = _gains(members)
    lo = {g.key: g.min_cap_w for g in members}
    hi = {g.key: _hi(g) for g in members}
    caps: dict = {g.key: hi[g.key] for g in members if g.straggler}  # held; they bound the pace below
    at_hi: list = []
    free = [g for g in members if not g.straggler]
    budget = total_w - sum(caps.values())
    target = 1.0
    for _ in range(_PASSES):
        den = sum(s[g.key] for g in free)
        if den <= 0 or not free:
            break
        target = (budget - sum(_op_w(g) - s[g.key] * g.pace for g in free)) / den
        clipped = []
        for g in free:
            c = _op_w(g) + s[g.key] * (target - g.pace)
            if c > hi[g.key] or c < lo[g.key]:
                caps[g.key] = min(max(c, lo[g.key]), hi[g.key])
                clipped.append(g)
                if c > hi[g.key]:
                    at_hi.append(g)
            else:
                caps[g.key] = c
        if not clipped:
            break
        budget -= sum(caps[g.key] for g in clipped)
        out = {g.key for g in clipped}  # by key: ``g not in clipped`` compared whole rows, O(n^2) per job
        free = [g for g in free if g.key not in out]
    return _bound_by_ceiling(members, caps, at_hi)  # the pace the ceiling-held GPUs reach bounds all


def align_caps(pace, pace_step, draw_w, cap_w, lo_w, hi_w, static_w, total_w: float,
               max_pace: float = 1.0, exponent=3.0):
    """coordinator.pacealign.align_caps as of 93c374b: one target step after the other."""
    from coordinator.pacealign import KEEP_BAND, MAX_STEPS, settled_draw_w

    f = np.asarray(pace, float)
    if f.size == 0:
        return None
    step = np.asarray(pace_step, float)
    draw = np.asarray(draw_w, float)
    cap = np.asarray(cap_w, float)
    lo = np.asarray(lo_w, float)
    hi = np.maximum(np.asarray(hi_w, float), lo)
    if not (np.all(f > 0) and np.all(step > 0) and np.all(draw > 0) and np.all(np.isfinite(cap))):
        return None
    n = np.broadcast_to(np.asarray(exponent, float), f.shape)
    if not np.all(np.isfinite(n) & (n > 0)):
        return None
    draw = settled_draw_w(f, step, draw, cap, np.asarray(static_w, float), n)
    ps = np.minimum(np.asarray(static_w, float), 0.9 * draw)
    top = float(f.max())
    grid = float(step[int(np.argmax(f))])
    k_low = int(np.ceil((top - float(f.min())) / grid - 1e-9)) + MAX_STEPS
    uncapped = f >= 0.99
    for k in range(MAX_STEPS, -k_low - 1, -1):
        if k == MAX_STEPS:  # the job's watts reach further than a few steps: not an alignment
            x = top + k * grid  # (the caller scales its split to them; this aligns next interval)
            need = ps + (draw - ps) * ((x + 0.5 * step) / f) ** n
            if x <= min(max_pace, 1.0) + 1e-9 and np.all(need <= hi + 1e-9) and float(
                    np.minimum(np.maximum(need, lo), hi).sum()) <= total_w + 1e-6:
                return None
            continue
        x = top + k * grid
        if x > max_pace + 1e-9 or x > 1.0 + 1e-9 or x <= 0:
            continue
        mid = ps + (draw - ps) * ((x + 0.5 * step) / f) ** n
        caps = np.maximum(mid, lo)
        at_or_above = f >= x - 1e-9
        caps = np.where(at_or_above, np.minimum(caps, cap), caps)
        # hysteresis: a GPU on step x keeps its cap up to five eighths of the step
        # (:data:`KEEP_BAND`): it runs on x now, so it is never raised there; above the band it
        # holds watts it does not use and goes to mid-step. A drift of the draw estimate inside
        # the band moves nothing, so a GPU does not flip between steps.
        on_x = np.abs(f - x) <= 1e-9
        lower = ps + (draw - ps) * ((x + KEEP_BAND[0] * step) / f) ** n
        upper = ps + (draw - ps) * ((x + KEEP_BAND[1] * step) / f) ** n
        caps = np.where(on_x & (cap >= lower) & (cap <= upper), np.maximum(cap, lo), caps)
        caps = np.where(on_x & (cap < lower), np.maximum(mid, lo), caps)
        caps = np.where(uncapped & (np.abs(f - x) <= 1e-9), cap, caps)
        reach = ps + (draw - ps) * ((x + 0.25 * step) / f) ** n  # a quarter step into x's step
        if np.any(~at_or_above & (reach > hi + 1e-9)):
            continue  # some GPU cannot get there within its range
        caps = np.minimum(caps, hi)
        if float(caps.sum()) <= total_w + 1e-6:
            # every GPU at its max clock: nothing to align (the caller's split keeps their headroom
            # for a rising demand)
            return None if x >= 1.0 - 1e-9 and np.all(uncapped) else caps
    return None


def paced_split(inputs, desired: dict, at=None) -> set:
    """coordinator.allocation.paced_split as of 93c374b (rows, a headroom closure, :func:`correct`)."""
    from coordinator.allocation import LIMIT_SLACK_W, _domain_sums, _pace_candidates, columns_of, domain_levels, \
        values_at

    limited, levels = domain_levels(inputs)
    c = columns_of(inputs)
    n = len(limited)
    lims = np.array([lim for _, lim in limited], float)
    d = values_at(desired, c.keys) if at is None else at
    load = _domain_sums(levels, d, n)
    head = lims - load - LIMIT_SLACK_W
    cand = _pace_candidates(c, inputs.jobs).tolist()
    gpus = c.rows_at(cand, with_curves=False)
    pos_of = {g.key: p for g, p in zip(gpus, cand)}
    granted_w: dict = {}

    def extra_w(members, caps=None) -> float:
        if not n:
            return 0.0
        p = np.array([pos_of[g.key] for g in members], np.int64)
        if caps is not None:
            back = granted_w.pop(members[0].job, None)
            if back is not None:
                head[back[0]] += back[1]
            if caps:
                diff = np.array([caps.get(g.key, desired[g.key]) - desired[g.key] for g in members], float)
                head[:] -= _domain_sums(levels[p], diff, n)
            return 0.0
        mine = np.unique(levels[p])
        mine = mine[mine >= 0]
        if not mine.size:
            return 0.0
        grant = max(0.0, float(head[mine].min()))
        head[mine] -= grant
        granted_w[members[0].job] = (mine, grant)
        return grant

    aligned: list = []
    moved = correct(gpus, desired, inputs.jobs, extra_w, aligned)
    if not moved:
        return set()
    job_of = {g.key: g.job for g in gpus}
    by_job: dict = {}
    for k, cap in moved.items():
        by_job.setdefault(job_of[k], {})[k] = cap
    for caps in by_job.values():
        p = np.array([pos_of[k] for k in caps], np.int64)
        diff = np.array([cap - desired[k] for k, cap in caps.items()], float)
        delta = _domain_sums(levels[p], diff, n) if n else np.zeros(0)
        if bool(np.all(load + delta <= lims + 1e-6)):
            desired.update(caps)
            if at is not None:
                at[p] = list(caps.values())
            load += delta
        else:
            aligned = [j for j in aligned if j != job_of[next(iter(caps))]]
    return set(aligned)
