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

from coordinator import pacealign

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
    """One job's per-GPU quantities, computed once per interval (arrays [n], in the job's GPU order):

    * ``s`` the step gains: ``GAIN`` times the loop's slope (W per unit pace): :func:`_slope` for a
      GPU with a measured slope; one without takes its model slope times the median ratio
      (:func:`_slope` / model) of its job-mates that have one (a job runs on one product: the
      plant's shape is shared, its scale is the GPU's own; mixing model and measured slopes in one
      job made the unmeasured GPUs overshoot and pull the pace target), else its model slope;
    * ``op`` the operating points (:func:`_op_w`, W);
    * ``hi`` the ceilings (W): the GPU's maximum cap, lowered to its thermal ceiling where it has a
      finite one, never below its minimum cap.
    """

    s: np.ndarray
    op: np.ndarray
    hi: np.ndarray


_FIELDS = ("pace", "pace_at_w", "draw_w", "pace_slope_w", "min_cap_w", "max_cap_w", "thermal_ceiling_w")
"""The row fields :func:`job_arrays` reads, in its argument order."""


def _prepare(members) -> _Job:
    """:class:`_Job` of one job's GPUs (rows): :func:`job_arrays` on their fields."""
    cols = [np.fromiter((getattr(g, f, math.nan) for g in members), float, len(members)) for f in _FIELDS]
    return job_arrays(*cols)


def job_arrays(pace, at_w, draw_w, meas_w, lo_w, max_w, thermal_w) -> _Job:
    """:class:`_Job` of one job's GPUs from arrays [n] (the fields of :data:`_FIELDS`: pace 0..1,
    W). The same operations, in the same order, as :func:`_op_w`, :func:`slope_w`,
    :func:`loop_slope_w` and :class:`_Job`'s rules per GPU: identical floats (``np.fmax`` where
    Python's ``max`` keeps its first argument against a NaN). Assumes finite ``lo_w`` / ``max_w``
    (validated limits); a NaN or infinite thermal ceiling is none."""
    op = np.where((pace >= MAX_CLOCK_PACE) & (0.0 < draw_w) & (draw_w < at_w), draw_w, at_w)
    with np.errstate(invalid="ignore", divide="ignore"):
        model = 3.0 * op / np.maximum(pace, 0.05)
        measured = (meas_w > 0.0) & np.isfinite(meas_w)
        own = np.where(measured & ~(meas_w >= GAIN * model), np.fmax(meas_w, model / MAX_MISMATCH), model)
        ratio = 1.0
        if measured.sum() < len(pace):
            r = (own / model)[measured & (model > 0)]
            ratio = statistics.median(r.tolist()) if r.size else 1.0
        gains = GAIN * np.where(measured, own, model * ratio)
    hi = np.fmax(lo_w, np.minimum(max_w, np.where(np.isfinite(thermal_w), thermal_w, math.inf)))
    return _Job(gains, op, hi)


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
    bounds its job-mates' (its pace does not respond to power); so does a fixed GPU with a measured
    pace (:func:`pace_bound`: held at its accounted cap, it gets no cap here). The loop owns the
    split of a job whose GPUs are all ``paced`` (a fresh sample with the cap setting the clock) and
    not fixed, or bound its pace: a Newton step when every sample is of the
    current operating point and the paces differ by more than :data:`PACE_DEADBAND`; else the
    current split scaled to the job's total (the curves alone never move it). Other jobs keep the
    solve's split. ``extra_w(members)``: watts a job whose every GPU's clock is set by its cap may
    add to the solve's total (headroom the solve left, which the measured clocks say it can use);
    ``extra_w(members, caps)`` after the job (its caps, {} for none) takes back what it left.
    ``aligned``: a list the jobs put on one clock step (:func:`_align`) are appended to, or None.
    ``prepared``: job -> :class:`_Job` of its GPUs (:func:`job_arrays` on the caller's columns, the
    same values as from the rows), or None: computed here from the rows. Rows to arrays per job,
    then :func:`job_caps` (the array form the coordinator calls on its columns).
    """
    by_job: dict = {}
    for g in gpus:
        if g.job is not None and g.job in jobs:
            by_job.setdefault(g.job, []).append(g)
    out = {}
    for job, members in by_job.items():
        held = [bool(g.fixed and math.isfinite(g.pace)) for g in members]
        if (len(members) < 2 or not all(((g.paced or g.straggler) and not g.fixed) or h for g, h in zip(members, held))
                or not any(g.paced for g in members)):
            continue
        a = job_rows(members, prepared[job] if prepared is not None and job in prepared else None)
        avail = extra_w(members) if extra_w else 0.0  # headroom the solve left (granted; unused returned)
        caps, on_step = job_caps(a, sum(desired[g.key] for g in members), avail)
        if on_step and aligned is not None:
            aligned.append(job)
        got = {}
        if caps is not None:  # stragglers first (the order the caps were summed in); none to a held GPU
            order = np.r_[np.flatnonzero(a.straggler), np.flatnonzero(~a.straggler)].tolist()
            got = {members[i].key: c for i, c in zip(order, caps[order].tolist()) if not held[i]}
            out.update(got)
        if extra_w:  # what the job did not use (headroom and the solve's) goes to the jobs after it
            extra_w(members, got)
    return out


class JobGpus(NamedTuple):
    """One job's GPUs as arrays [n] (the :class:`coordinator.allocation.GpuInput` fields of the
    same names: pace 0..1, W; ``straggler`` bool: :func:`pace_bound`, the stragglers and the fixed
    GPUs with a measured pace) and its :class:`_Job` (``j``)."""

    pace: np.ndarray
    pace_at_w: np.ndarray
    observed_w: np.ndarray
    draw_w: np.ndarray
    pace_step: np.ndarray
    min_cap_w: np.ndarray
    max_cap_w: np.ndarray
    straggler: np.ndarray
    j: _Job


def job_rows(members, j: _Job | None = None) -> JobGpus:
    """:class:`JobGpus` of one job's rows (``j`` None: :func:`_prepare` on them); ``straggler``:
    :func:`pace_bound` of them."""
    cols = [np.fromiter(map(operator.attrgetter(f), members), float, len(members)) for f in JobGpus._fields[:7]]
    n = len(members)
    strag = pace_bound(np.fromiter((bool(g.straggler) for g in members), bool, n),
                       np.fromiter((bool(g.fixed) for g in members), bool, n), cols[0])
    return JobGpus(*cols, strag, _prepare(members) if j is None else j)


def pace_bound(straggler, fixed, pace) -> np.ndarray:
    """Which GPUs' measured pace bounds their job-mates' (bool [n]; arrays [n]: ``straggler`` bool,
    ``fixed`` bool, ``pace`` 0..1, NaN: none): the stragglers, and the fixed GPUs with a measured
    pace (the coordinator holds them at their accounted cap, UNSUPPORTED_CONSTRAINTS and the
    like, and their reading is live: :func:`coordinator.allocation._pace_columns`). Both are
    ``JobGpus.straggler``: held at their ceiling (a fixed GPU's is its accounted cap), the others
    planned no faster than them, the watts that frees left to other jobs. Such a GPU's extra watts
    buy nothing (a synchronous step runs at its slowest GPU): its job-mates held at 262 W and
    1,320 MHz beside a GPU held at 200 W and 1,155 MHz, while the price of a watt was positive
    (found by a try-out). A fixed GPU without a measured pace (LOST, STALLED, a stale node) bounds
    nothing: its job is left to the solve."""
    return np.asarray(straggler, bool) | (np.asarray(fixed, bool) & np.isfinite(np.asarray(pace, float)))


def job_caps(a: JobGpus, solve_w: float, avail_w: float) -> tuple:
    """One job's pace-corrected caps: ``(caps [n] W or None, aligned)``.

    ``a``: the job's GPUs (all paced or stragglers, none fixed unless its pace is measured, taken
    as a straggler: :func:`pace_bound`; one at least paced: the jobs :func:`correct` moves); ``solve_w``: the solve's watts for them (W, summed in GPU order);
    ``avail_w``: the headroom granted to the job (W). ``caps`` None: the job keeps the solve's caps
    (no positive current draw to scale, or the caps would exceed the job's watts); ``aligned``:
    they came from :func:`_align` (true even where then refused). Per GPU the operations of the
    per-row loop it replaced, on arrays (sums in its order; Python's ``min``/``max`` kept where a
    NaN could differ): identical floats (tests/coordinator/test_pace_equivalence.py). Why arrays:
    the per-GPU Python of the row loop was most of the pace stage (measured figures:
    :func:`coordinator.allocation._pace_jobs`). Where no GPU but the stragglers has a positive step
    gain, the job keeps the solve's caps (the row loop raised KeyError there when a straggler
    bounded the pace: the whole interval failed, no plan sent)."""
    strag, rest = a.straggler, ~a.straggler
    j, paces = a.j, a.pace.tolist()
    low = min(range(len(paces)), key=paces.__getitem__)  # the pace-setter (the first slowest)
    current = bool(np.all(np.abs(a.pace_at_w[rest] - a.observed_w[rest]) <= AT_CAP_TOLERANCE_W))
    # more watts help only if the pace-setter can take them: not held at its ceiling, and its
    # clock below its maximum (at it, below its cap, the job is saturated: watts buy nothing;
    # granted anyway, they raised it to its ceiling, where none was granted, so it fell back
    # to the solve's caps: a cap turning every interval, 674 <-> 700 W; found by a try-out)
    total = solve_w + (avail_w if (float(j.hi[low]) - float(a.observed_w[low]) > AT_CAP_TOLERANCE_W
                                   and paces[low] < MAX_CLOCK_PACE) else 0.0)
    caps, on_step = None, False
    if current and max(paces) - min(paces) > PACE_DEADBAND:
        caps = _split(a, total)
    elif current and pacealign.on_grid(a.pace[rest], a.pace_step[rest]):  # within the deadband on a
        caps = _align(a, solve_w + avail_w)  # clock-step grid: every GPU on one step, with the watts it needs at most
        on_step = caps is not None
        total = solve_w + avail_w if on_step else total
    if caps is None:  # equal pace, or a sample from before the last change: the split holds (scaled to T)
        caps = _hold(a, total, current)
    # never more than the solve gave the job (clipping at minimums can); summed stragglers first
    if caps is None or not sum(np.r_[caps[strag], caps[rest]].tolist()) <= total + 1e-6:
        return None, on_step
    return caps, on_step


def _py_max(a, b):
    """Python's ``max(a, b)`` elementwise ([n]): ``a`` unless ``b > a`` (keeps ``a`` against a NaN ``b``)."""
    return np.where(b > a, b, a)


def _py_min(a, b):
    """Python's ``min(a, b)`` elementwise ([n]): ``a`` unless ``b < a``."""
    return np.where(b < a, b, a)


def _align(a: JobGpus, total_w: float):
    """:func:`coordinator.pacealign.align_caps` on the job's GPUs (stragglers held at their
    ceiling, bounding the target to their pace): caps [n] (W) or None when a GPU lacks a draw or a
    clock step (its sample cannot tell its step) or no step fits."""
    strag, rest = a.straggler, ~a.straggler
    draw, step = a.draw_w[rest], a.pace_step[rest]
    if not rest.any() or bool(np.any((draw <= 0) | (step <= 0))):
        return None
    hi, pace = a.j.hi, a.pace[rest]
    static = pacealign.STATIC_FRACTION * a.max_cap_w[rest]
    n = pacealign.exponent_from_slope(a.j.s[rest] / GAIN, pace, draw, static)
    caps = pacealign.align_caps(
        pace, step, draw, a.pace_at_w[rest], a.min_cap_w[rest], hi[rest], static,
        total_w - sum(hi[strag].tolist()), min([1.0] + a.pace[strag].tolist()), n)
    if caps is None:
        return None
    out = hi.copy()
    out[rest] = caps
    return out


def _op_w(g) -> float:
    """The power (W) at which ``g``'s pace was measured: its enforced limit when the cap sets its
    clock, its draw when it runs at its maximum clock below the cap (the cap is not its operating
    point then: stepping from it would hand the GPU watts it does not use)."""
    if g.pace >= MAX_CLOCK_PACE and 0.0 < g.draw_w < g.pace_at_w:
        return g.draw_w
    return g.pace_at_w


def _hold(a: JobGpus, total_w: float, grow: bool):
    """The job's current split (enforced limits) scaled to ``total_w`` (W), within each GPU's
    range ([n] W; None where the GPUs draw nothing); a GPU held at its ceiling bounds the others'
    pace (:func:`_bound_by_ceiling`). ``grow`` False (a sample from before the last change): scaled
    down only, never up; the watts wait one interval for a sample of the current caps (scaling up
    from a stale sample undid the clock-step alignment of the interval before: a two-interval
    limit cycle)."""
    strag, rest, hi = a.straggler, ~a.straggler, a.j.hi
    caps = hi.copy()  # stragglers held (where extra watts buy nothing)
    now = sum(a.observed_w[rest].tolist())
    if now <= 0:
        return None
    k = (total_w - sum(hi[strag].tolist())) / now
    if not grow:
        k = min(k, 1.0)
    caps[rest] = _py_min(_py_max(a.observed_w[rest] * k, a.min_cap_w[rest]), hi[rest])
    return _bound_by_ceiling(a, caps, np.flatnonzero(rest & (caps >= hi - AT_CAP_TOLERANCE_W)))


def _bound_by_ceiling(a: JobGpus, caps, at_hi):
    """Nobody planned faster than the pace the GPUs ``at_hi`` (positions, held at their ceiling)
    reach there: ``c_g <= e_g + s_g (reach - f_g)`` with ``reach = min(f_h + (hi_h - e_h) / s_h)``
    (W); ``caps`` [n] in place, returned."""
    s, op, f = a.j.s, a.j.op, a.pace
    at_hi = at_hi[s[at_hi] > 0]
    r = f[at_hi] + (a.j.hi[at_hi] - op[at_hi]) / s[at_hi]
    reach = min(r.tolist(), default=math.inf)
    reach = min([reach] + f[a.straggler].tolist())  # a straggler's pace is fixed
    if not math.isfinite(reach):
        return caps
    # held: the GPUs that set the reach (and the stragglers); a GPU at its ceiling that would be
    # faster there is bounded like the others (it would wait at the barrier)
    free = ~a.straggler
    free[at_hi[r <= reach + 1e-9]] = False
    caps[free] = _py_min(caps[free], _py_max(a.min_cap_w[free], op[free] + s[free] * (reach - f[free])))
    return caps


def _split(a: JobGpus, total_w: float):
    """One damped Newton step of the job's GPUs toward equal pace with ``sum(caps) <= total_w`` (W):
    caps [n] (W) or None (the step gave some GPU no cap).

    GPUs whose step leaves their range are clipped and the pace target recomputed for the rest
    (a few passes). A GPU held at its ceiling sets the pace: nobody is planned faster than it gets
    there (watts to a GPU that would wait at the barrier buy nothing), so the sum can stay below
    ``total_w``; the rest is left to the other jobs."""
    s, op, hi, lo, f = a.j.s, a.j.op, a.j.hi, a.min_cap_w, a.pace
    caps = np.where(a.straggler, hi, math.nan)  # held; they bound the pace below
    at_hi: list = []
    free = np.flatnonzero(~a.straggler)
    budget = total_w - sum(hi[a.straggler].tolist())
    for i in range(_PASSES):
        den = sum(s[free].tolist())
        if den <= 0 and free.size and not i:  # no GPU got a cap: the job keeps the solve's (the per-row
            return None  # loop raised KeyError here where a straggler bounds the pace: the interval failed)
        if den <= 0 or not free.size:
            break
        target = (budget - sum((op[free] - s[free] * f[free]).tolist())) / den
        c = op[free] + s[free] * (target - f[free])
        over, under = c > hi[free], c < lo[free]
        clip = over | under
        caps[free] = np.where(clip, _py_min(_py_max(c, lo[free]), hi[free]), c)
        at_hi.append(free[over])
        if not clip.any():
            break
        budget -= sum(caps[free[clip]].tolist())
        free = free[~clip]
    return _bound_by_ceiling(a, caps, np.concatenate(at_hi) if at_hi else np.zeros(0, np.int64))
