"""One synchronous job's GPUs on one clock step (pure, arrays; issue 12 item 8, "Optimality").

A synchronous step runs at the pace of the job's slowest GPU, and SM clocks move in steps of
:data:`CLOCK_STEP_MHZ`: a power limit sets the largest supported clock whose power fits under it.
Within the pace loop's deadband (:data:`coordinator.paceloop.PACE_DEADBAND`, two clock steps) a
job's GPUs can sit one or two steps apart for good: the slowest sets the pace one step below what
the job's watts and ceilings allow, and the faster ones burn watts at the barrier. In ``capctl
sim`` this held jobs one step (~1 % of clock) below the oracle, the largest jobs most (one GPU of
1,024 is enough).

:func:`align_caps` puts every GPU of the job on the same step, the highest one that the job's
watts (``total_w``) and every GPU's ceiling allow, with each cap in the middle of its step (half a
step of margin either way against noise). The cap a GPU needs for pace ``x`` follows from its own
measured operating point (``draw_w`` at pace ``f``) by the DVFS power law
``P(x) = P_s + (P - P_s) (x / f)^3`` (dynamic power ~ C V^2 f with V ~ f; Hsu & Feng, SC'05; the
simulated driver's law, csrc/simnvml/physics.c), with the static power ``P_s`` estimated as
:data:`STATIC_FRACTION` of the GPU's maximum limit. Moves are a few steps at most (within
:data:`MAX_STEPS`), where an error in ``P_s`` costs a fraction of a step: for a move of k steps the
cap is off by ``dP_s * 3 k * step / f`` (e.g. 15 W error, k = 2, 15 MHz of 1,100 MHz: 1.2 W), well
inside the half-step margin (3-4 W on A100/H100 at 0.55-0.8 x TDP).

It is a reconcile, not an integrator: the caps follow from the latest operating points each
interval, so a GPU landing a step off is put right in the next one, and an unchanged state gives
unchanged caps (the planner's 2 W deadband then sends nothing).
"""

from __future__ import annotations

import numpy as np

CLOCK_STEP_MHZ = 15.0
"""SM clock step (MHz): A100 and H100 support graphics clocks 15 MHz apart
(``nvmlDeviceGetSupportedGraphicsClocks``); the simulated driver quantizes the same way."""
STATIC_FRACTION = 0.1
"""Static (clock-independent) power of a busy GPU as a fraction of its maximum limit: ~75 W of
700 W on H100 SXM, ~55 W of 400 W on A100 SXM4 (idle readings of DGX H100 / DGX A100 nodes, the
simulated driver's profiles). An underestimate makes lowered caps slightly low and raised caps
slightly high; see the module docstring for the bound."""
GRID_TOLERANCE = 0.02
"""A clock is on the step grid when it is within this fraction of a step of it (0.3 MHz of 15 MHz:
NVML reports whole MHz, so this only absorbs float rounding of ``clock / max clock``)."""
KEEP_BAND = (0.0, 0.625)
"""Where in its step (fractions of one step above the step's clock) a GPU already on the target
step keeps its cap: anywhere on it below, at most an eighth of a step over mid-step above (a drift
of the draw estimate under an eighth of a step, ~1 W on A100/H100, moves nothing). Measured on the
A100 hard budget, seed 12 (capctl/oracle): (0, 5/8) 0.9914, the same as no band; (0, 3/4) 0.9899
(~1/8 step of watts per GPU held for nothing); (1/4, 5/8) 0.9898 (raising GPUs near the bottom of
their step to mid-step costs the same watts)."""
MAX_STEPS = 8
"""Largest move (clock steps) above the job's fastest GPU or below its slowest: beyond it the
Newton step of :mod:`coordinator.paceloop` moves the caps (the power law is extrapolated further)."""


MIN_EXPONENT = 0.3
"""Smallest power-law exponent used (clock ~ P^3.3): the pace loop's slope is at least a tenth
of the cube law's (:data:`coordinator.paceloop.MAX_MISMATCH`)."""


def exponent_from_slope(slope_w, pace, draw_w, static_w) -> np.ndarray:
    """The power law's exponent (shape [N]) that has the slope ``slope_w`` (W per unit pace, the
    pace loop's, :func:`coordinator.paceloop.loop_slope_w`) at the operating point (``pace``,
    ``draw_w`` W, static power ``static_w`` W): ``n = s f / (P - P_s)``, at most 3 (the cube law's:
    the loop's slope only lowers the model's), at least :data:`MIN_EXPONENT`. Where the draw does not
    exceed the static power, 3. Raises nothing."""
    f = np.asarray(pace, float)
    dyn = np.asarray(draw_w, float) - np.asarray(static_w, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.asarray(slope_w, float) * f / dyn
    n = np.where((dyn > 0) & np.isfinite(n), n, 3.0)
    return np.clip(n, MIN_EXPONENT, 3.0)


def on_grid(pace, pace_step, tolerance: float = GRID_TOLERANCE) -> bool:
    """Whether a job's GPUs report SM clocks on one step grid anchored at the max clock.

    ``pace`` (SM clock / max SM clock, measured) and ``pace_step`` (one clock step as a fraction of
    the max clock), shape [N]. True when at least one GPU runs below its max clock and every such
    GPU's distance to its max clock is a whole number of steps (within ``tolerance`` of a step):
    what NVML's supported graphics clocks give on A100/H100 (every clock is the max clock less a
    multiple of 15 MHz) and the simulated driver's quantized clocks. A plant whose clock moves
    continuously with its cap reports integer MHz clocks off that grid (a GPU lands on it by
    chance with probability 1/15 per operating point, every GPU of a job with 1/15^k for k
    distinct clocks), and then the pace loop converges as a continuous loop (no alignment).
    False for empty input or a step that is not positive. Raises nothing."""
    f = np.asarray(pace, float)
    step = np.asarray(pace_step, float)
    if f.size == 0 or step.shape != f.shape or not np.all(step > 0):
        return False
    below = f < 1.0 - 1e-9
    if not below.any():
        return False
    k = (1.0 - f[below]) / step[below]
    return bool(np.all(np.abs(k - np.round(k)) <= tolerance))


def settled_draw_w(pace, pace_step, draw_w, cap_w, static_w, exponent=3.0) -> np.ndarray:
    """The draw (W, shape [N]) of each GPU at its measured clock, bounded by what its cap says.

    A GPU whose clock its cap sets (``pace`` < 0.99) runs at the highest step whose power fits
    under the cap, so its true draw lies within one step's power below the cap:
    ``cap - 3 (cap - P_s) step / f <= P(f) <= cap`` (the cube law's slope times one step). The
    1 s-averaged power reading of Ampere/Hopper (nvml.h, ``nvmlDeviceGetPowerUsage``) still mixes
    in the draw before a cap change for up to a second, above the cap after a decrease or far
    below it after an increase; clipped to that band, a stale reading costs at most one step's
    power instead of a move of several steps (measured: ``bench/load_step.py`` on parts of unequal
    power factors turned caps 3 times in 5 intervals without it). A GPU at its max clock draws what
    its work needs: only ``<= cap`` applies. Inputs as :func:`align_caps` (``exponent``: the
    power law's, 3 the cube law); raises nothing."""
    f = np.asarray(pace, float)
    cap = np.asarray(cap_w, float)
    d = np.minimum(np.asarray(draw_w, float), cap)
    one_step = np.asarray(exponent, float) * np.maximum(cap - np.asarray(static_w, float), 0.0) * np.asarray(
        pace_step, float) / f
    return np.where(f < 0.99, np.maximum(d, cap - one_step), d)


def align_caps(pace, pace_step, draw_w, cap_w, lo_w, hi_w, static_w, total_w: float,
               max_pace: float = 1.0, exponent=3.0) -> np.ndarray | None:
    """Caps (W, shape [N]) that put the N GPUs of one job on one clock step, or None.

    Inputs, all shape [N]: ``pace`` (SM clock / max SM clock, measured), ``pace_step`` (one clock
    step as a fraction of the max clock), ``draw_w`` (measured power at that pace, W; the cap sets
    the pace or the GPU runs at its max clock below it), ``cap_w`` (its enforced limit now, W),
    ``lo_w`` / ``hi_w`` (the range it may be planned in, ceilings included, W), ``static_w``
    (static power estimate, W). ``total_w``: the job's watts; ``max_pace``: a bound on the target
    (a straggler's pace, 1.0 otherwise). ``exponent`` (scalar or [N]): the power law's exponent
    ``n`` in ``P(x) = P_s + (P - P_s) (x / f)^n``, 3 (the cube law) unless the GPU's measured slope
    says its clock rises faster with power (:func:`exponent_from_slope`).

    The target is the highest pace ``x`` on the fastest GPU's step grid, less than
    :data:`MAX_STEPS` above the fastest and at most :data:`MAX_STEPS` below the slowest, such that
    every GPU reaches it within ``hi_w`` and the caps sum to at most ``total_w``; None when the
    job's watts reach :data:`MAX_STEPS` above (a large move: the caller's split scales to them) or
    when every GPU runs at its max clock. A GPU already at or above ``x`` keeps at most its current cap (it runs there now);
    one at its max clock keeps its cap when ``x`` is its pace (its draw is not what it needs at its
    peaks). Returns None when no target fits (the caller keeps its own split), or for empty or
    malformed input (non-positive draws or steps). Raises nothing.
    """
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
    x = top + np.arange(MAX_STEPS, -k_low - 1, -1) * grid  # the targets, highest first (``top + k * grid``)
    if x[0] <= min(max_pace, 1.0) + 1e-9:  # the job's watts reach further than a few steps: not an
        need = _law_w(ps, draw - ps, x[:1], 0.5, step, f, n)[0]  # alignment (the caller scales its
        if np.all(need <= hi + 1e-9) and float(np.minimum(np.maximum(need, lo), hi).sum()) <= total_w + 1e-6:
            return None  # split to them; this aligns next interval)
    x = x[1:][~((x[1:] > max_pace + 1e-9) | (x[1:] > 1.0 + 1e-9) | (x[1:] <= 0))]
    rows = max(1, ROWS_ELEMENTS // f.size)
    for b in range(0, x.size, rows):
        caps, ok = _step_caps(x[b:b + rows], f, step, cap, lo, hi, ps, draw - ps, n)
        for i in np.flatnonzero(ok).tolist():
            if float(caps[i].sum()) <= total_w + 1e-6:
                # every GPU at its max clock: nothing to align (the caller's split keeps their
                # headroom for a rising demand)
                return None if x[b + i] >= 1.0 - 1e-9 and np.all(f >= 0.99) else caps[i].copy()
    return None


ROWS_ELEMENTS = 1 << 16
"""Most elements (targets x GPUs) :func:`align_caps` evaluates in one block of targets (memory
bound: ~10 temporaries of that many floats)."""


def _law_w(ps, dyn, x, frac: float, step, f, n) -> np.ndarray:
    """``P(x + frac step)`` (W, shape [len(x), N]) of the power law ``P_s + D (y / f)^n`` for each
    target ``x`` (the module docstring; ``dyn`` = ``D``, [N]). Elementwise the operations (and the
    power function's code path: contiguous rows) of the per-target loop it replaced: the same floats."""
    return ps + dyn * ((x[:, None] + frac * step) / f) ** n


def _step_caps(x, f, step, cap, lo, hi, ps, dyn, n) -> tuple:
    """The caps (W, [len(x), N]) that put every GPU on each target step ``x`` ([T], pace; see
    :func:`align_caps`), and which targets every GPU reaches within its ceiling ([T] bool). One
    array operation per rule over all targets (measured on the aligned jobs of bench/interval_cost.py's
    fleet, 8,000 GPUs, 17-20 targets, timeit best of 5, 7 Dec 2026: a loop over the targets
    0.22-0.75 ms a job of 16-320 GPUs, this 0.12-0.41 ms; ~10 such jobs an interval)."""
    with np.errstate(all="ignore"):  # targets the loop never reached (below the first fit) included
        mid = _law_w(ps, dyn, x, 0.5, step, f, n)
        caps = np.maximum(mid, lo)
        xc = x[:, None]
        at_or_above = f >= xc - 1e-9
        caps = np.where(at_or_above, np.minimum(caps, cap), caps)
        # hysteresis: a GPU on step x keeps its cap up to five eighths of the step
        # (:data:`KEEP_BAND`): it runs on x now, so it is never raised there; above the band it
        # holds watts it does not use and goes to mid-step. A drift of the draw estimate inside
        # the band moves nothing, so a GPU does not flip between steps.
        on_x = np.abs(f - xc) <= 1e-9
        lower = _law_w(ps, dyn, x, KEEP_BAND[0], step, f, n)
        upper = _law_w(ps, dyn, x, KEEP_BAND[1], step, f, n)
        caps = np.where(on_x & (cap >= lower) & (cap <= upper), np.maximum(cap, lo), caps)
        caps = np.where(on_x & (cap < lower), np.maximum(mid, lo), caps)
        caps = np.where((f >= 0.99) & on_x, cap, caps)
        reach = _law_w(ps, dyn, x, 0.25, step, f, n)  # a quarter step into x's step
        ok = ~np.any(~at_or_above & (reach > hi + 1e-9), axis=1)  # else some GPU cannot get there
    return np.minimum(caps, hi), ok


MARGIN_BAND = 0.875
"""Highest point of its clock step (fraction of one step above the step's clock) that
:func:`step_top_w` lets a GPU's cap reach: an eighth of a step (~1 W on A100/H100) below the next
step's power, so an error of the draw estimate under that does not lift one GPU a step above its
job-mates (where it would burn watts at the barrier)."""


def step_top_w(pace, pace_step, draw_w, cap_w, static_w, new_cap_w, band: float = MARGIN_BAND) -> np.ndarray:
    """The highest cap (W, shape [N]) that keeps each GPU on the clock step ``new_cap_w`` gives it.

    Inputs as :func:`align_caps` (``pace``, ``pace_step``, ``draw_w``, ``cap_w``: the operating
    point measured at enforced limit ``cap_w``; ``static_w``), all [N], plus ``new_cap_w`` [N] (its
    planned cap, W). The step under ``new_cap_w`` is the highest clock of the grid anchored at the
    max clock whose power by the cube law (module docstring) fits under it; the result is the power
    at ``band`` of that step, never below ``new_cap_w``. A GPU at its max clock (``pace`` >= 0.99),
    or one with a non-positive pace, step or dynamic draw, gets ``new_cap_w`` (no room). Raises
    nothing for values."""
    f = np.asarray(pace, float)
    step = np.asarray(pace_step, float)
    new = np.asarray(new_cap_w, float)
    ok = (f > 0) & (f < 0.99) & (step > 0) & np.isfinite(new)
    f1 = np.where(ok, f, 1.0)
    s1 = np.where(ok, step, 1.0)
    d = settled_draw_w(f1, s1, np.asarray(draw_w, float), np.asarray(cap_w, float), np.asarray(static_w, float))
    ps = np.minimum(np.asarray(static_w, float), 0.9 * d)
    ok &= d > ps
    dyn = np.where(ok, d - ps, 1.0)
    y = f1 * np.cbrt(np.maximum(new - ps, 0.0) / dyn)  # the pace new_cap_w reaches (continuous)
    x = 1.0 - np.ceil((1.0 - y) / s1 - 1e-9) * s1  # the grid clock it runs at
    top = ps + dyn * ((x + band * s1) / f1) ** 3
    return np.where(ok, np.maximum(top, new), new)
