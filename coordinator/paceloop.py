"""Closed loop on each job's measured pace (issue 12, "Closed loop on the pace"; pure).

The model-based solve (:func:`coordinator.allocation.solve`) proposes the caps; it decides how
many watts each job gets. Open-loop, its split of a job's watts over the job's GPUs follows the
per-GPU rate curves, which are estimates: a curve refit moves caps by hundreds of watts while the
GPUs' measured pace says nothing changed (the oscillation of issue 12). This module corrects the
split inside each synchronous job from what the GPUs report: the pace of GPU g is
``f_g = sm_clock / max_sm_clock`` measured at its enforced limit ``e_g`` (one telemetry sample, so
the pair is consistent), for GPUs whose clock the power cap sets (``SW_POWER_CAP`` reason).

The correction is one damped Newton step toward equal pace at the job's total ``T`` (the solve's
sum over the job's GPUs)::

    c_g = e_g + GAIN * s_g * (f* - f_g),     s_g = dP/df of g's plant at f_g  (W per unit pace)
    f*  chosen so that sum_g c_g = T         (closed form; clipped GPUs fixed, a few passes)

so GPUs measurably faster than the pace-setter come down, the slower go up within their ceilings,
and a job's GPUs converge to equal pace even where the curves are wrong.

Slope. ``s_g`` is the model's, :func:`slope_w` (the cube law's, ``3 P / f``), replaced by the
GPU's measured slope (:mod:`coordinator.paceslope`: the power law through two of its operating
points at least four clock steps apart, at its latest point) where that is below ``GAIN`` times
the model's, i.e. where the model's step would overshoot (:func:`loop_slope_w`). A GPU without a
measurement takes its model slope times the median ratio of its job-mates that have one.

Stability: for the pace error ``x_g = f_g - f*`` the step gives ``x' = (1 - GAIN * rho) x`` with
``rho = s_g / s_true`` (``s_true`` the device's local slope): overdamped (no sign change, so a
cap changes direction at most once after a step) for ``rho < 1 / GAIN = 1.43``, stable for
``rho < 2 / GAIN = 2.86``. With ``GAIN = 0.7``:

- a cube-law plant (the simulated driver, DVFS parts): :func:`slope_w` bounds ``s_true`` by the
  factor ``P / (P - P_static)`` (1.1-1.4, static power 10-30 % of the draw): measured at 0.7-0.9
  of the model's, the model's is kept (main's loop): ``rho`` 1.1-1.4, factor 0.02-0.23 (replacing
  it by the measured one, factor ~0.3, cost 0.1 % of throughput in ``capctl sim``'s A100 hard
  budget, seeds 11 and 12);
- a plant flatter than the cube law (clock ~ P^k, k < 1/3): the model's slope is the lower one and
  is kept: ``rho < 1``, overdamped, factor ``1 - 0.7 s_model / s_true`` (k = 1/4: ~0.4);
- a plant steeper (k up to 1, the clock at a voltage floor; the fake agent's curve below ~430 W,
  5x at 300 W): the true slope is 1/3-1/20 of the model's; the measured one replaces it (below
  0.7x the model's, where the model's step would overshoot) down to ``s_model / MAX_MISMATCH``: ``rho`` is the measurement's error, 0.8-1.33 from reading the clock
  (n >= 4 steps known to one step) times the plant's deviation from the two-point power law, so
  overdamped while that deviation stays under 7 %, stable under 2.1x; a plant steeper than 20x
  the model keeps ``s_model / 20``: overdamped to 28x, stable to 57x.
- before its first measurement on a new plant (a new job, a load change) a GPU steps by the
  model's slope: where the plant is more than 1.43x steeper than that, this first step overshoots
  once (the one direction change the criterion allows), and the measurement taken across it sets
  the slope of every later step.

Damping: no move up to :data:`PACE_DEADBAND` (two 15 MHz clock steps: the clock is quantized),
and no Newton step from a sample older than the current cap (:data:`AT_CAP_TOLERANCE_W`: the loop
delay would apply one correction twice); the split is then held, scaled to the job's total.
"""

from __future__ import annotations

import math
import operator
import statistics
from typing import NamedTuple

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
"""A pace at or above this is the GPU's maximum clock (:func:`_op_w`: below its cap, the cap is not
its operating point)."""
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


class _Job(NamedTuple):
    """One job's per-GPU quantities, computed once per interval (GPU key -> value):

    * ``s`` the step gains: ``GAIN`` times the loop's slope (W per unit pace): :func:`_slope` for a
      GPU with a measured slope; one without takes its model slope times the median ratio
      (:func:`_slope` / model) of its job-mates that have one (a job runs on one product: the
      plant's shape is shared, its scale is the GPU's own; mixing model and measured slopes in one
      job made the unmeasured GPUs overshoot and pull the pace target), else its model slope;
    * ``op`` the operating points (:func:`_op_w`, W);
    * ``hi`` the ceilings (W): the GPU's maximum cap, lowered to its thermal ceiling where it has a
      finite one, never below its minimum cap.
    """

    s: dict
    op: dict
    hi: dict


_FIELDS = ("pace", "pace_at_w", "draw_w", "pace_slope_w", "min_cap_w", "max_cap_w", "thermal_ceiling_w")
"""The row fields :func:`job_arrays` reads, in its argument order."""


def _prepare(members) -> _Job:
    """:class:`_Job` of one job's GPUs (rows): :func:`job_arrays` on their fields."""
    cols = [np.fromiter((getattr(g, f, math.nan) for g in members), float, len(members)) for f in _FIELDS]
    return job_arrays([g.key for g in members], *cols)


def job_arrays(keys, pace, at_w, draw_w, meas_w, lo_w, max_w, thermal_w) -> _Job:
    """:class:`_Job` of one job's GPUs from arrays [n] (``keys`` theirs; the fields of
    :data:`_FIELDS`: pace 0..1, W). The same operations, in the same order, as :func:`_op_w`,
    :func:`slope_w`, :func:`loop_slope_w` and :class:`_Job`'s rules per GPU: identical floats
    (``np.fmax`` where Python's ``max`` keeps its first argument against a NaN). Assumes finite
    ``lo_w`` / ``max_w`` (validated limits); a NaN or infinite thermal ceiling is none."""
    op = np.where((pace >= MAX_CLOCK_PACE) & (0.0 < draw_w) & (draw_w < at_w), draw_w, at_w)
    with np.errstate(invalid="ignore", divide="ignore"):
        model = 3.0 * op / np.maximum(pace, 0.05)
        measured = (meas_w > 0.0) & np.isfinite(meas_w)
        own = np.where(measured & ~(meas_w >= GAIN * model), np.fmax(meas_w, model / MAX_MISMATCH), model)
        ratio = 1.0
        if measured.sum() < len(keys):
            r = (own / model)[measured & (model > 0)]
            ratio = statistics.median(r.tolist()) if r.size else 1.0
        gains = GAIN * np.where(measured, own, model * ratio)
    hi = np.fmax(lo_w, np.minimum(max_w, np.where(np.isfinite(thermal_w), thermal_w, math.inf)))
    return _Job(dict(zip(keys, gains.tolist())), dict(zip(keys, op.tolist())), dict(zip(keys, hi.tolist())))


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


def correct(gpus, desired: dict, jobs, extra_w=None, aligned=None, prepared=None) -> dict:
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
    ``prepared``: job -> :class:`_Job` of its GPUs (:func:`job_arrays` on the caller's columns, the
    same values as from the rows), or None: computed here from the rows.
    """
    by_job: dict = {}
    for g in gpus:
        if g.job is not None and g.job in jobs:
            by_job.setdefault(g.job, []).append(g)
    out = {}
    for job, members in by_job.items():
        if (len(members) < 2 or not all((g.paced or g.straggler) and not g.fixed for g in members)
                or not any(g.paced for g in members)):
            continue
        paces = list(map(_PACE, members))
        slowest = min(members, key=_PACE)
        solve_w = sum(map(desired.__getitem__, map(_KEY, members)))
        avail = extra_w(members) if extra_w else 0.0  # headroom the solve left (granted; unused returned)
        current = all(abs(g.pace_at_w - g.observed_w) <= AT_CAP_TOLERANCE_W for g in members if not g.straggler)
        caps = None
        j = prepared[job] if prepared is not None and job in prepared else _prepare(members)  # once per job
        # more watts help only if the pace-setter can take them: not held at its ceiling, and its
        # clock below its maximum (at it, below its cap, the job is saturated: watts buy nothing;
        # granted anyway, they raised it to its ceiling, where none was granted, so it fell back
        # to the solve's caps: a cap turning every interval, 674 <-> 700 W; found by a try-out)
        total = solve_w + (avail if (j.hi[slowest.key] - slowest.observed_w > AT_CAP_TOLERANCE_W
                                     and slowest.pace < MAX_CLOCK_PACE) else 0.0)
        if current and max(paces) - min(paces) > PACE_DEADBAND:
            caps = _split(members, total, j)
        elif current and _on_grid(members):  # within the deadband on a clock-step grid: every GPU
            caps = _align(members, solve_w + avail, j)  # on one step, with the watts it needs at most
            total = solve_w + avail if caps is not None else total
            if caps is not None and aligned is not None:
                aligned.append(job)
        if caps is None:  # equal pace, or a sample from before the last change: the split holds (scaled to T)
            caps = _hold(members, total, current, j)
        if len(caps) == len(members) and sum(caps.values()) <= total + 1e-6:
            out.update(caps)  # never more than the solve gave the job (clipping at minimums can)
        else:
            caps = {}
        if extra_w:  # what the job did not use (headroom and the solve's) goes to the jobs after it
            extra_w(members, caps)
    return out


_PACE = operator.attrgetter("pace")
_KEY = operator.attrgetter("key")
_STEP = operator.attrgetter("pace_step")
_DRAW = operator.attrgetter("draw_w")
_AT = operator.attrgetter("pace_at_w")
_LO = operator.attrgetter("min_cap_w")
_MAX = operator.attrgetter("max_cap_w")
"""Row fields read in C over a job's rows (``map``; the same values, in the same order, as the
comprehensions they replace; a small part of the pace stage, within its noise at 8,000 GPUs,
7 Dec 2026)."""


def _on_grid(members) -> bool:
    """Whether the job's GPUs report clocks on one step grid (:func:`coordinator.pacealign.on_grid`
    on the non-stragglers' paces and clock steps)."""
    from coordinator import pacealign

    rest = [g for g in members if not g.straggler]
    return pacealign.on_grid(list(map(_PACE, rest)), list(map(_STEP, rest)))


def _align(members, total_w: float, j: _Job):
    """:func:`coordinator.pacealign.align_caps` on the job's GPUs (stragglers held at their
    ceiling, bounding the target to their pace); None when a GPU lacks a draw or a clock step (its
    sample cannot tell its step) or no step fits."""
    from coordinator import pacealign

    strag = [g for g in members if g.straggler]
    rest = [g for g in members if not g.straggler]
    if not rest or any(g.draw_w <= 0 or g.pace_step <= 0 for g in rest):
        return None
    held = {g.key: j.hi[g.key] for g in strag}
    static = [pacealign.STATIC_FRACTION * g.max_cap_w for g in rest]
    gains = j.s
    keys = list(map(_KEY, rest))
    pace, draw = list(map(_PACE, rest)), list(map(_DRAW, rest))
    n = pacealign.exponent_from_slope([gains[k] / GAIN for k in keys], pace, draw, static)
    caps = pacealign.align_caps(
        pace, list(map(_STEP, rest)), draw, list(map(_AT, rest)), list(map(_LO, rest)),
        list(map(j.hi.__getitem__, keys)), static, total_w - sum(held.values()), min([1.0] + [g.pace for g in strag]), n)
    if caps is None:
        return None
    held.update(zip(keys, np.asarray(caps, float).tolist()))
    return held


def _op_w(g) -> float:
    """The power (W) at which ``g``'s pace was measured: its enforced limit when the cap sets its
    clock, its draw when it runs at its maximum clock below the cap (the cap is not its operating
    point then: stepping from it would hand the GPU watts it does not use)."""
    if g.pace >= MAX_CLOCK_PACE and 0.0 < g.draw_w < g.pace_at_w:
        return g.draw_w
    return g.pace_at_w


def _hold(members, total_w: float, grow: bool, j: _Job) -> dict:
    """The job's current split (enforced limits) scaled to ``total_w`` (W), within each GPU's
    range; a GPU held at its ceiling bounds the others' pace (:func:`_bound_by_ceiling`).
    ``grow`` False (a sample from before the last change): scaled down only, never up; the watts
    wait one interval for a sample of the current caps (scaling up from a stale sample undid the
    clock-step alignment of the interval before: a two-interval limit cycle)."""
    strag = [g for g in members if g.straggler]
    rest = [g for g in members if not g.straggler]
    hi = j.hi
    caps = {g.key: hi[g.key] for g in strag}  # held (where extra watts buy nothing)
    now = sum(g.observed_w for g in rest)
    if now <= 0:
        return {}
    k = (total_w - sum(caps.values())) / now
    if not grow:
        k = min(k, 1.0)
    caps.update({g.key: min(max(g.observed_w * k, g.min_cap_w), hi[g.key]) for g in rest})
    at_hi = [g for g in rest if caps[g.key] >= hi[g.key] - AT_CAP_TOLERANCE_W]
    return _bound_by_ceiling(members, caps, at_hi, j)


def _bound_by_ceiling(members, caps: dict, at_hi, j: _Job) -> dict:
    """Nobody planned faster than the pace the GPUs ``at_hi`` (held at their ceiling) reach there:
    ``c_g <= e_g + s_g (reach - f_g)`` with ``reach = min(f_h + (hi_h - e_h) / s_h)`` (W)."""
    s, op = j.s, j.op
    reaches = {g.key: g.pace + (j.hi[g.key] - op[g.key]) / s[g.key] for g in at_hi if s[g.key] > 0}
    reach = min(reaches.values(), default=math.inf)
    reach = min([reach] + [g.pace for g in members if g.straggler])  # a straggler's pace is fixed
    if not math.isfinite(reach):
        return caps
    # held: the GPUs that set the reach (and the stragglers); a GPU at its ceiling that would be
    # faster there is bounded like the others (it would wait at the barrier)
    held = {k for k, r in reaches.items() if r <= reach + 1e-9} | {g.key for g in members if g.straggler}
    for g in members:
        if g.key not in held:
            caps[g.key] = min(caps[g.key], max(g.min_cap_w, op[g.key] + s[g.key] * (reach - g.pace)))
    return caps


def _split(members, total_w: float, j: _Job) -> dict:
    """One damped Newton step of ``members`` toward equal pace with ``sum(caps) <= total_w`` (W).

    GPUs whose step leaves their range are clipped and the pace target recomputed for the rest
    (a few passes). A GPU held at its ceiling sets the pace: nobody is planned faster than it gets
    there (watts to a GPU that would wait at the barrier buy nothing), so the sum can stay below
    ``total_w``; the rest is left to the other jobs."""
    s, op, hi = j.s, j.op, j.hi
    lo = {g.key: g.min_cap_w for g in members}
    caps: dict = {g.key: hi[g.key] for g in members if g.straggler}  # held; they bound the pace below
    at_hi: list = []
    free = [g for g in members if not g.straggler]
    budget = total_w - sum(caps.values())
    target = 1.0
    for _ in range(_PASSES):
        den = sum(s[g.key] for g in free)
        if den <= 0 or not free:
            break
        target = (budget - sum(op[g.key] - s[g.key] * g.pace for g in free)) / den
        clipped = []
        for g in free:
            c = op[g.key] + s[g.key] * (target - g.pace)
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
    return _bound_by_ceiling(members, caps, at_hi, j)  # the pace the ceiling-held GPUs reach bounds all
