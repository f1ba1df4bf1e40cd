"""Each GPU's measured slope of power over pace, for the pace loop (issue 12 item 2; arrays).

The pace loop (:mod:`coordinator.paceloop`) steps caps by ``s * (f* - f)`` with ``s`` the slope
``dP/df`` (W per unit pace) of the GPU's plant. Its model slope, the DVFS cube law's
(:func:`coordinator.paceloop.slope_w`), bounds a cube-law plant's slope from above; a plant whose
clock rises with power much faster than the cube law (the allocator's H100 curve below ~400 W,
clock ~ P^k with k > 1/3) has a true slope several times lower, and a step by the model's slope
overshoots by that factor: the loop diverged there. This module measures the slope from the
GPU's own samples, so the loop can bound the model's slope by it.

The measurement is the power law ``P = P_s + D f^n`` (the DVFS form, with ``P_s`` the alignment's
static power estimate, :data:`coordinator.pacealign.STATIC_FRACTION` of the maximum limit) through
two of the GPU's operating points on one plant, each a consistent pair (enforced limit ``op_w``,
pace ``f`` measured at it)::

    n = ln((op_w - P_s) / (anchor_w - P_s)) / ln(f / anchor_f)    when |f - anchor_f| >= MIN_STEPS steps
    s = n (op_w - P_s) / f                                          (its slope at the latest point)

For a power-law plant this is its exact slope wherever the GPU moves (a secant would lag the
curvature between the points); for another monotone plant it is the slope of the power law
through both points, by the mean value theorem that of the plant somewhere between them. The clock
is read in steps (15 MHz on the grid, one MHz off it: :func:`_resolution`): a pace change of n
steps is known to within one step, so ``n`` is within about ``n / (n +- 1)`` of the plant's: at
least :data:`MIN_STEPS` (4) steps keeps it within -20 % / +33 %. Smaller changes do not move the
anchor (they accumulate to a readable one); one that shows a steeper slope than measured (the
least its reading allows) raises it (a plant flattening toward its max clock). Robustness:

- a load change re-anchors the measurement and keeps the exponent (a load scales ``D`` in
  ``P = P_s + D f^n``, not ``n``; a secant across it read a slope several times off): the pace
  moved by more than two steps while the limit did not, or against the limit (a monotone plant
  never does that); so does a sample at the max clock (the clock says nothing of the slope there);
- a GPU whose sample is not a busy, cap-responsive one (not ``paced``: idle, a new job, a slowdown)
  forgets its measurement: it starts from the model's slope.

State: per GPU key, :data:`STATE_FIELDS`, held as arrays in the order of the keys
handed in (the solver inputs' order); a change of the keys tuple remaps them by key (GPUs no
longer present are forgotten, so memory is bounded by the fleet). An unchanged sample changes
nothing (idempotent: several builds of the inputs per interval are one observation).
"""

from __future__ import annotations

import numpy as np

from coordinator.pacealign import CLOCK_STEP_MHZ, GRID_TOLERANCE

MIN_STEPS = 4.0
"""Pace change (clock steps) a measurement needs: its reading error is then within -20 % / +33 %."""
SAME_W = 1.0
"""Limits within this (W) are one operating point (the pace loop's ``AT_CAP_TOLERANCE_W``)."""
JUMP_STEPS = 2.0
"""A pace move (clock steps) the limit does not explain: more than this at the same limit, or
against the limit's move, is a load change: the measurement re-anchors (keeping the exponent)."""
DEFAULT_STEP = 15.0 / 1980.0
"""One clock step as a fraction of the max clock where the GPU's is unknown (15 MHz of H100's
1,980 MHz: the finer grid of A100/H100, so the conservative one for :data:`MIN_STEPS`)."""


STATE_FIELDS = ("anchor_w", "anchor_f", "last_w", "last_f", "exponent")
"""Per GPU: the anchor of the next measurement (W, pace), the last distinct operating point
(W, pace), the measured exponent ``n`` of its power law; NaN: none."""


def _resolution(pace: np.ndarray, pace_step: np.ndarray) -> np.ndarray:
    """How finely each GPU's pace is read (fraction of the max clock, [G]): one clock step where
    the clock is on the step grid (``pace_step``; :data:`DEFAULT_STEP` where unknown), one MHz
    (NVML's unit) where it is off it (a clock that moves continuously with the cap)."""
    step = np.where(pace_step > 0, pace_step, DEFAULT_STEP)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = (1.0 - pace) / step
    on = np.abs(k - np.round(k)) <= GRID_TOLERANCE
    return np.where(on | ~np.isfinite(k), step, step / CLOCK_STEP_MHZ)


def secant_update(state: tuple, op_w, pace, valid, pace_step, static_w) -> tuple:
    """One observation of every GPU (arrays [G]); returns ``(new state, slope_w)``.

    ``state``: the arrays [G] of :data:`STATE_FIELDS`; ``op_w`` (W) and ``pace`` (0..1): each
    GPU's latest operating point; ``valid`` (bool): a busy sample whose clock the cap sets or that
    runs at its max clock (see the module docstring); ``pace_step``: one clock step as a fraction
    of the max clock (0: unknown, :data:`DEFAULT_STEP`); ``static_w``: its static power estimate
    (W). A move of at least :data:`MIN_STEPS` from the anchor sets the exponent of the power law
    through both points; a smaller move from the last point raises it to the least value the
    reading allows where that is more (a plant flattening toward its max clock). ``slope_w``: the
    law's slope at the latest point, ``n (op_w - P_s) / f`` (W per unit pace; NaN where none is
    measured or the GPU runs at its max clock). Pure; raises nothing (NaN inputs are not valid)."""
    aw, af, lw, lf, n = (np.asarray(a, float) for a in state)
    w, f = np.asarray(op_w, float), np.asarray(pace, float)
    ps = np.asarray(static_w, float)
    dyn = w - ps
    q = _resolution(f, np.asarray(pace_step, float))
    v = np.asarray(valid, bool) & np.isfinite(w) & np.isfinite(f) & (w > 0) & (f > 0)
    ok = v & (f < 0.99) & (dyn > 0)  # a cap-set point; at its max clock a GPU keeps its state
    dw, df = w - aw, f - af
    have = ok & np.isfinite(aw)
    jump = have & (np.abs(df) > JUMP_STEPS * q) & ((np.abs(dw) < SAME_W) | (dw * df < 0))
    meas = have & ~jump & (np.abs(dw) >= SAME_W) & (dw * df > 0) & (np.abs(df) >= MIN_STEPS * q)
    dlw, dlf = w - lw, f - lf
    new_pt = ok & ~(np.abs(dlw) < SAME_W)  # NaN last point: new
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(meas, np.log(dyn / (aw - ps)) / np.log(f / af), n)
        lower = np.abs(dlw) / (np.abs(dlf) + q) * f / dyn  # the least exponent the reading allows
    n = np.where(meas & ~(np.isfinite(n) & (n > 0)), np.nan, n)  # an anchor below the static power
    grow = have & ~jump & ~meas & new_pt & (dlw * dlf >= 0) & np.isfinite(n) & (lower > n)
    n = np.where(grow, lower, n)
    move = (ok & ~np.isfinite(aw)) | jump | meas | grow
    aw, af = np.where(move, w, aw), np.where(move, f, af)
    lw, lf = np.where(new_pt, w, lw), np.where(new_pt, f, lf)
    n = np.where(v, n, np.nan)  # the shape outlives a load change (it scales D, not n); idle: gone
    aw, af, lw, lf = (np.where(ok, a, np.nan) for a in (aw, af, lw, lf))  # at the max clock: re-anchor
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = np.where(ok, n * dyn / f, np.nan)
    return (aw, af, lw, lf, n), slope


class PaceSlopes:
    """The measured slopes of a fleet's GPUs across intervals (struct of arrays by GPU key)."""

    def __init__(self) -> None:
        self._keys: tuple = ()
        self._state = tuple(np.zeros(0) for _ in STATE_FIELDS)

    def _aligned(self, keys: tuple) -> tuple:
        """The state in the order of ``keys`` (remapped by key when the tuple changed)."""
        if keys is self._keys or keys == self._keys:
            return self._state
        old = {k: i for i, k in enumerate(self._keys)}
        pos = np.fromiter((old.get(k, -1) for k in keys), np.int64, len(keys))
        out = []
        for a in self._state:
            b = np.full(len(keys), np.nan)
            hit = pos >= 0
            b[hit] = a[pos[hit]]
            out.append(b)
        return tuple(out)

    def observe(self, keys: tuple, op_w, pace, valid, pace_step, static_w) -> np.ndarray:
        """Feed the latest operating point of every GPU of ``keys`` (arrays [G] as
        :func:`secant_update`); returns each GPU's measured slope (W per unit pace, shape [G], NaN
        where none is measured yet)."""
        self._state, slope = secant_update(self._aligned(keys), op_w, pace, valid, pace_step, static_w)
        self._keys = keys
        return slope
