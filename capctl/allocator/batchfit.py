"""Many rate-curve fits at once: :func:`capctl.allocator.curves.fit_curve`'s objective, solved for
a batch of GPUs as arrays (issue 12, item 7: "batched fits").

Each problem is one GPU's observations (caps W, mean relative rates, counts per 1 W bin) and its
prior curve's pseudo-observations, the same residuals, bounds and robust loss as ``fit_curve``,
from ``fit_curve``'s two starting points (the last fit, a generic curve) and a third one (a steep,
wide curve: ``a`` = 1, ``k_w`` = the span of the caps), the lowest objective of the three kept::

    minimize   sum_i count_i * rho(((w_i * (rate(P_i) - r_i)) / f)^2)      rho(z) = 2 (sqrt(1 + z) - 1)
    over       theta = (log a, log k_w, sat_w) in the box of ``fit_curve``

(``soft_l1``, ``f`` = ``f_scale`` = 0.03 relative rate). The solver is a projected
Levenberg-Marquardt iteration on all problems together: per problem the iteratively reweighted
Gauss-Newton system ``(J' D J + lambda diag(J' D J)) delta = -J' D res`` with ``D = count /
sqrt(1 + z)`` (the soft_l1 weights), a 3 x 3 solve per problem (``numpy.linalg.solve`` on a
stack), the step projected onto the box, accepted when the objective decreases (``lambda`` / 3)
and rejected otherwise (``lambda`` x 4). Problems are padded to the longest one with count 0.
Source of the method: Levenberg (1944), Marquardt (1963); the reweighting is the standard IRLS
majorizer of a concave robust loss (Holland & Welsch 1977).

Cost (2-core host, 4 Dec 2026): 0.5-1.3 ms per fit in batches of 16-256 (4 ms for one alone) where
scipy's ``least_squares`` takes 5-16 ms per GPU (``bench/interval_cost.py`` prints the refit
stage). Fits against ``fit_curve``'s on random instances (tests/allocator/test_batchfit.py): the
same objective (median relative difference 1e-10), within 1e-3 or lower in >= 95 % of them, lower
in 8-11 %, at worst a local minimum 9 % higher; the error against the true curves alike (median
equal; at the 95th percentile 0.15 vs 0.13 on one seed, from one fit with a 4 % *lower* objective
that follows the noise, 0.17 vs 0.16 on the other).
"""

from __future__ import annotations

import math

import numpy as np

from capctl.allocator.curves import (_A_BOUNDS, _K_BOUNDS_REL, RATE_MIN, CurveParams, FitProblem, fit_errors,
                                     fit_points)

__all__ = ["FitProblem", "fit_curves", "MAX_ITERATIONS"]

MAX_ITERATIONS = 60
"""Iterations at most (each: one objective and Jacobian evaluation of every live problem); the
iteration stops earlier when every problem's objective moved less than :data:`REL_TOL`."""
REL_TOL = 1e-8
"""Relative change of a problem's objective under which it counts as converged."""


def _prepare(pr: FitProblem, f_scale: float):
    """One problem's rows: :func:`capctl.allocator.curves.fit_points` (points [N] W, rates [N],
    counts [N], weights [N]: data then the prior's pseudo-observations), the box (lower, upper)
    and the three starts (each ``(log a, log k_w, sat_w)``), and the number of data points N_data.
    Raises ValueError as ``fit_curve`` does (fewer than 3 distinct caps, counts not positive,
    shapes that differ)."""
    p, r, cnt, wts, n = fit_points(pr.cap_w, pr.rate_rel, pr.counts, pr.valid_min_w, pr.prior, pr.prior_weight)
    pmin, pmax = float(p.min()), float(p.max())
    span = max(pmax - pmin, 1.0)
    k_lo, k_hi = _K_BOUNDS_REL[0] * span, _K_BOUNDS_REL[1] * span
    box_lo = (math.log(_A_BOUNDS[0]), math.log(k_lo), pmin)
    box_hi = (math.log(_A_BOUNDS[1]), math.log(k_hi), pmax + span)
    x0 = pr.x0
    second = (math.log(0.05), math.log(0.25 * span), pmax)
    # the last fit's parameters, clipped into the box; one that is not a finite number (a NaN
    # passes Python's min/max) takes the generic start's value
    a0, k0, s0 = (v if math.isfinite(v) else None for v in (x0.a, x0.k_w, x0.sat_w))
    first = (math.log(min(max(a0, _A_BOUNDS[0]), _A_BOUNDS[1])) if a0 is not None else second[0],
             math.log(min(max(k0, k_lo), k_hi)) if k0 is not None else second[1],
             min(max(s0, pmin), pmax + span) if s0 is not None else second[2])
    third = (math.log(1.0), math.log(min(max(span, k_lo), k_hi)), pmax)
    return p, r, cnt, wts, box_lo, box_hi, (first, second, third), n


def _evaluate(theta, P, R, C, W, f_scale: float):
    """Objective [M], residuals [M, N], the Jacobian's three columns [3, M, N] (in ``(log a,
    log k_w, sat_w)``: ``curves._resid_jac`` of rows of padded problems) and ``z`` [M, N], the
    scaled squared residuals, at ``theta`` [M, 3]."""
    a = np.exp(theta[:, 0])[:, None]
    k = np.exp(theta[:, 1])[:, None]
    x = np.maximum((theta[:, 2][:, None] - P) / k, 0.0)
    em1 = np.expm1(x)
    raw = 1.0 - a * em1
    res = W * (np.maximum(raw, RATE_MIN) - R)
    ex = a * (em1 + 1.0)
    live = W * ((x > 0) & (raw > RATE_MIN))
    jx = ex * live
    J = np.empty((3,) + P.shape)
    np.multiply(-a * em1, live, out=J[0])
    np.multiply(jx, x, out=J[1])
    np.divide(jx, -k, out=J[2])
    z = res * res * (1.0 / (f_scale * f_scale))
    obj = (C * (np.sqrt(1.0 + z) - 1.0)).sum(axis=1)
    return obj, res, J, z


WIDTH_RATIO = 2.0
MIN_GROUP = 16
"""Problems are solved in groups (sorted by width): a group of at least :data:`MIN_GROUP`
problems is closed before one more than :data:`WIDTH_RATIO` times as wide as its narrowest. A
batch is padded to its widest problem, and one GPU with 500 bins among 20-bin ones made a
64-problem batch cost 71 ms instead of 16 (found by a try-out); a group has a fixed cost per
iteration too (~2 ms a solve), so small batches stay whole."""


def fit_curves(problems, f_scale: float = 0.03) -> list:
    """Fit every problem of ``problems`` (a sequence of :class:`capctl.allocator.curves.FitProblem`,
    ``OnlineCurveFit.fit_problem``); returns, aligned, a :class:`CurveParams` (source "fit";
    ``fit_rmse`` / ``fit_max_err`` on the data points, as ``fit_curve``) or the ``ValueError`` of
    that problem (fewer than 3 distinct caps, bad counts, a fit that ended non-finite). Never
    raises for the batch: problems of similar width are solved together (:data:`WIDTH_RATIO`,
    :data:`MIN_GROUP`)."""
    out: list = [None] * len(problems)
    rows = []
    for i, pr in enumerate(problems):
        try:
            rows.append((i, _prepare(pr, f_scale)))
        except ValueError as exc:
            out[i] = exc
    rows.sort(key=lambda r: r[1][0].size)
    group: list = []
    for row in rows:
        if len(group) >= MIN_GROUP and row[1][0].size > WIDTH_RATIO * group[0][1][0].size:
            _fit_group(group, problems, out, f_scale)
            group = []
        group.append(row)
    if group:
        _fit_group(group, problems, out, f_scale)
    return out


def _fit_group(rows: list, problems, out: list, f_scale: float) -> None:
    """Solve the prepared ``rows`` ((index, :func:`_prepare` result)) together, padded to the
    widest; write each problem's curve (or its ValueError) to ``out[index]``."""
    width = max(r[1][0].size for r in rows)
    ns = len(rows[0][1][6])
    m = ns * len(rows)  # the starts of problem j: rows ns j .. ns j + ns - 1
    P = np.zeros((m, width))
    R = np.zeros((m, width))
    C = np.zeros((m, width))
    W = np.zeros((m, width))
    lo = np.zeros((m, 3))
    hi = np.zeros((m, 3))
    theta = np.zeros((m, 3))
    for j, (_, (p, r, cnt, wts, box_lo, box_hi, starts, _n)) in enumerate(rows):
        for s in range(ns):
            q = ns * j + s
            P[q, :p.size], R[q, :p.size], C[q, :p.size], W[q, :p.size] = p, r, cnt, wts
            P[q, p.size:] = p[0]
            lo[q], hi[q], theta[q] = box_lo, box_hi, starts[s]
    try:
        with np.errstate(all="ignore"):
            theta = _solve(theta, lo, hi, P, R, C, W, f_scale)
            obj = _evaluate(theta, P, R, C, W, f_scale)[0]
    except (np.linalg.LinAlgError, FloatingPointError) as exc:  # the group's fits all fail alike
        for i, _ in rows:
            out[i] = ValueError(f"curve fit failed: {exc}")
        return
    obj = np.where(np.isfinite(obj) & np.isfinite(theta).all(axis=1), obj, np.inf)
    for j, (i, (p, r, cnt, _w, _lo, _hi, _s, n)) in enumerate(rows):
        q = ns * j + int(np.argmin(obj[ns * j:ns * j + ns]))
        if not math.isfinite(float(obj[q])):
            out[i] = ValueError("curve fit failed: no start ended at finite parameters")
            continue
        a, k, sat = math.exp(theta[q, 0]), math.exp(theta[q, 1]), float(theta[q, 2])
        out[i] = CurveParams(a, k, sat, float(problems[i].valid_min_w), *fit_errors(p, r, cnt, n, a, k, sat), "fit")


def _solve(theta, lo, hi, P, R, C, W, f_scale: float) -> np.ndarray:
    """The projected, damped, reweighted Gauss-Newton iteration (module docstring) from ``theta``
    [M, 3] inside the box ``[lo, hi]``; returns the parameters [M, 3]."""
    obj, res, J, z = _evaluate(theta, P, R, C, W, f_scale)
    lam = np.full(len(theta), 1e-3)
    active = np.ones(len(theta), bool)
    eye = np.eye(3)
    for _ in range(MAX_ITERATIONS):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        wgt = C[idx] / np.sqrt(1.0 + z[idx])  # soft_l1 weights
        Ji = J[:, idx]
        wr = wgt * res[idx]
        g = np.stack([np.einsum("mn,mn->m", wr, Ji[k]) for k in range(3)], axis=1)
        wj = [wgt * Ji[k] for k in range(3)]
        H = np.empty((idx.size, 3, 3))
        for k in range(3):
            for l in range(k, 3):
                H[:, k, l] = H[:, l, k] = np.einsum("mn,mn->m", wj[k], Ji[l])
        # parameters at a bound whose descent direction leaves the box stay where they are (the
        # active set: the others then step as if that bound were an equality)
        th = theta[idx]
        span = hi[idx] - lo[idx]
        pinned = ((th <= lo[idx] + 1e-9 * span) & (g > 0)) | ((th >= hi[idx] - 1e-9 * span) & (g < 0))
        free = (~pinned).astype(float)
        g = g * free
        H = H * free[:, :, None] * free[:, None, :]
        diag = np.einsum("mkk->mk", H)
        A = H + (lam[idx, None] * np.maximum(diag, 1e-12))[:, :, None] * eye + (1.0 - free)[:, :, None] * eye \
            + 1e-15 * eye
        step = -np.linalg.solve(A, g[:, :, None])[:, :, 0]
        trial = np.clip(th + step, lo[idx], hi[idx])
        t_obj, t_res, t_J, t_z = _evaluate(trial, P[idx], R[idx], C[idx], W[idx], f_scale)
        better = t_obj < obj[idx]
        moved = np.abs(obj[idx] - t_obj) > REL_TOL * np.maximum(obj[idx], 1e-300)
        b = idx[better]
        theta[b], obj[b], res[b], z[b] = trial[better], t_obj[better], t_res[better], t_z[better]
        J[:, b] = t_J[:, better]
        lam[idx] = np.clip(np.where(better, lam[idx] / 3.0, lam[idx] * 4.0), 1e-12, 1e12)
        # converged: an accepted step that moved the objective by less than REL_TOL, or a damping
        # so large that no step is left
        done = (better & ~moved) | (lam[idx] >= 1e12) | (np.abs(step).max(axis=1) < 1e-12)
        active[idx[done]] = False
    return theta
