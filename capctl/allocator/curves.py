"""Concave rate curves r(P): relative synchronous-step rate of a GPU at power cap P.

Family (per GPU, three parameters, all in watts except ``a``)::

    rho(P) = 1 - a * (exp((sat_w - P) / k_w) - 1)    for P <  sat_w
    rho(P) = 1                                        for P >= sat_w

* ``sat_w`` [W]: the workload's uncapped demand; above it the cap does not slow the GPU.
* ``k_w`` [W] > 0: scale of the exponential fall-off below saturation.
* ``a`` [-] > 0: slope factor; ``d rho / dP`` just below ``sat_w`` is ``a / k_w``.

``rho`` is continuous, increasing and concave (``-exp`` of an affine function, then ``min`` with
the constant 1). Its inverse, the smallest cap reaching relative rate ``r <= 1``, is closed form
(:func:`cap_for_rate`): ``P(r) = sat_w - k_w * log1p((1 - r) / a)``, convex and increasing in r.

Real curves flatten again at the very bottom of the cap range (measured: A40 below ~150 W), which
is not concave; the model is fitted and used only on ``[valid_min_w, max_cap_w]`` (``valid_min_w``
per model below, found from the data as the start of the concave range).

Default parameters (:data:`DEFAULT_CURVES`) were fitted with :func:`fit_curve` to the Zeus power
traces (``zeus-power-traces/summary_power_{a40,v100}.csv``, Zeus project, Apache-2.0,
https://github.com/ml-energy/zeus) — see :func:`fit_zeus_model` and docs/allocation.md for the
fit range and error. H100/H200/A100 defaults are the A40 curve mapped affinely from the A40 cap
range [100, 300] W onto the target device's [min, max] limit constraints (NVIDIA datasheets:
A100 SXM4 100-400 W, H100 SXM5 200-700 W, H200 SXM 200-700 W); no measured data backs them.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

__all__ = [
    "CurveParams",
    "DEFAULT_CURVES",
    "rate",
    "rate_unclamped",
    "RATE_MIN",
    "cap_for_rate",
    "fit_curve",
    "fit_points",
    "fit_errors",
    "FitProblem",
    "OnlineCurveFit",
    "load_zeus_traces",
    "fit_zeus_model",
    "zeus_data_dir",
]


@dataclass(frozen=True)
class CurveParams:
    """Parameters of one rate curve (see module docstring for the formula).

    a: slope factor [-] (> 0); k_w: fall-off scale [W] (> 0); sat_w: uncapped demand [W];
    valid_min_w: lowest cap where the concave model holds [W] (below it real curves flatten);
    fit_rmse / fit_max_err: fit error in relative rate on the fit range (NaN if not fitted);
    source: where the numbers come from.
    """

    a: float
    k_w: float
    sat_w: float
    valid_min_w: float
    fit_rmse: float = math.nan
    fit_max_err: float = math.nan
    source: str = ""

    def rate(self, cap_w):
        """Relative rate at ``cap_w`` [W] (scalar or array) -> same shape, <= 1."""
        return rate(cap_w, self.a, self.k_w, self.sat_w)

    def scaled(self, src_min_w: float, src_max_w: float, dst_min_w: float, dst_max_w: float,
               source: str) -> "CurveParams":
        """Map the curve affinely from cap range [src_min_w, src_max_w] onto [dst_min_w, dst_max_w]."""
        f = (dst_max_w - dst_min_w) / (src_max_w - src_min_w)
        m = lambda p: dst_min_w + (p - src_min_w) * f  # noqa: E731
        return CurveParams(self.a, self.k_w * f, m(self.sat_w), m(self.valid_min_w),
                           self.fit_rmse, self.fit_max_err, source)


RATE_MIN = 0.05
"""Floor of the predicted relative rate [-]. The exponential family extrapolates below zero at
low caps (``rho -> -inf`` as ``P -> -inf``; with a power scale > 1 already at the device minimum),
which no GPU does: a capped GPU still runs at its minimum clocks. :func:`rate` is clamped to
``[RATE_MIN, 1]``; the model is valid (fitted, concave) from ``cap_for_rate(RATE_MIN)`` up, and
the allocator never plans below that cap unless a domain limit or a thermal ceiling forces it
(then it reports ``RATE_MIN``: "at most this slow", not a prediction)."""


def rate_unclamped(cap_w, a, k_w, sat_w):
    """The family itself, without the :data:`RATE_MIN` floor (may be <= 0 at low caps): for
    fitting and for the allocator's internal, continuous cost functions. Broadcasts."""
    cap_w = np.asarray(cap_w, dtype=float)
    x = (np.asarray(sat_w, float) - cap_w) / np.asarray(k_w, float)
    return np.where(x > 0, 1.0 - np.asarray(a, float) * np.expm1(np.maximum(x, 0.0)), 1.0)


def rate(cap_w, a, k_w, sat_w):
    """Relative step rate rho(P) of the curve family, clamped to [:data:`RATE_MIN`, 1]; arrays
    broadcast. Returns float array [-], always > 0 (safe under a log)."""
    return np.maximum(rate_unclamped(cap_w, a, k_w, sat_w), RATE_MIN)


def cap_for_rate(rate_rel, a, k_w, sat_w):
    """Smallest cap [W] with rho(P) >= rate_rel (rate_rel <= 1, > 1 - a*... any real). Broadcasts."""
    r = np.minimum(np.asarray(rate_rel, float), 1.0)
    return np.asarray(sat_w, float) - np.asarray(k_w, float) * np.log1p((1.0 - r) / np.asarray(a, float))


# ----------------------------------------------------------------------------------------- fitting

_A_BOUNDS = (1e-4, 1e3)
_K_BOUNDS_REL = (0.02, 5.0)  # k_w relative to the span of the fit range


def fit_curve(cap_w, rate_rel, *, valid_min_w: float | None = None, x0: CurveParams | None = None,
              prior: CurveParams | None = None, prior_weight: float = 0.0, loss: str = "soft_l1",
              f_scale: float = 0.03, counts=None) -> CurveParams:
    """Least-squares fit of (a, k_w, sat_w) to samples (cap_w[N] W, rate_rel[N] relative rate).

    Only samples with cap >= valid_min_w are used (the concave range). ``loss``/``f_scale`` are
    scipy's robust losses (soft_l1 default: outliers from noisy step timing count less).
    ``prior`` with ``prior_weight`` > 0 adds pseudo-observations of the prior curve on a grid
    (regularization for few samples). ``counts`` [N] (default 1): how many times each sample
    counts, the same objective as the data with each sample repeated that often (fewer residuals:
    :class:`OnlineCurveFit` passes its bins' weights). Raises ValueError if fewer than 3 distinct
    usable caps and no prior, or for counts that are not positive. Source:
    scipy.optimize.least_squares (trust region reflective, bounded) with the family's analytic
    Jacobian (:func:`_resid_jac`; scipy's default finite differences gave the same fits, median
    curve difference 2e-9 over 450 synthetic refits, 27 % more CPU).
    """
    p, r, cnt, wts, n = fit_points(cap_w, rate_rel, counts, valid_min_w, prior, prior_weight)
    pmin, pmax = float(p.min()), float(p.max())
    span = max(pmax - pmin, 1.0)
    if x0 is None:
        x0 = prior or CurveParams(0.05, 0.25 * span, pmax, pmin)
    k_lo, k_hi = _K_BOUNDS_REL[0] * span, _K_BOUNDS_REL[1] * span
    start = np.array([math.log(np.clip(x0.a, *_A_BOUNDS)), math.log(np.clip(x0.k_w, k_lo, k_hi)),
                      float(np.clip(x0.sat_w, pmin, pmax + span))])

    def resid(th):
        return wts * (rate(p, math.exp(th[0]), math.exp(th[1]), th[2]) - r)

    best = None
    for s0 in (start, np.array([math.log(0.05), math.log(0.25 * span), pmax])):
        sol = least_squares(resid, s0, jac=lambda th: _resid_jac(th, p, wts), loss=_loss(loss, cnt),
                            f_scale=f_scale,
                            bounds=([math.log(_A_BOUNDS[0]), math.log(k_lo), pmin],
                                    [math.log(_A_BOUNDS[1]), math.log(k_hi), pmax + span]))
        if best is None or sol.cost < best.cost:
            best = sol
    a, k, sat = math.exp(best.x[0]), math.exp(best.x[1]), float(best.x[2])
    return CurveParams(a, k, sat, float(valid_min_w if valid_min_w is not None else pmin),
                       *fit_errors(p, r, cnt, n, a, k, sat), "fit")


PRIOR_GRID_POINTS = 12
"""Pseudo-observations of the prior curve a fit adds (a grid over its valid range)."""


def fit_points(cap_w, rate_rel, counts, valid_min_w: float | None, prior: CurveParams | None,
               prior_weight: float):
    """The residuals' data of a fit (:func:`fit_curve`, :mod:`capctl.allocator.batchfit`): the
    finite samples at caps >= ``valid_min_w`` (W), then ``prior``'s pseudo-observations when
    ``prior_weight`` > 0. Returns ``(caps [N] W, rates [N], counts [N], weights [N], N_data)``,
    the data first. Raises ValueError for shapes that differ, counts that are not positive finite
    numbers (``counts`` None: 1 each), or fewer than 3 distinct caps."""
    p = np.asarray(cap_w, float).ravel()
    r = np.asarray(rate_rel, float).ravel()
    if p.shape != r.shape:
        raise ValueError(f"cap_w and rate_rel differ in shape: {p.shape} vs {r.shape}")
    ok = np.isfinite(p) & np.isfinite(r)
    if valid_min_w is not None:
        ok &= p >= valid_min_w
    cnt = np.ones_like(p) if counts is None else np.asarray(counts, float).ravel()
    if cnt.shape != ok.shape or not np.all(np.isfinite(cnt) & (cnt > 0)):
        raise ValueError(f"counts must be {ok.shape} positive finite numbers")
    p, r, cnt = p[ok], r[ok], cnt[ok]
    n = p.size
    wts = np.ones_like(p)
    if prior is not None and prior_weight > 0:
        lo = valid_min_w if valid_min_w is not None else prior.valid_min_w
        grid = np.linspace(lo, max(prior.sat_w, lo + 1.0) * 1.05, PRIOR_GRID_POINTS)
        p = np.concatenate([p, grid])
        r = np.concatenate([r, prior.rate(grid)])
        cnt = np.concatenate([cnt, np.ones(grid.size)])
        wts = np.concatenate([wts, np.full(grid.size, math.sqrt(prior_weight / grid.size))])
    if np.unique(p).size < 3:
        raise ValueError(f"need samples at >= 3 distinct caps >= valid_min_w, got {np.unique(p).size}")
    return p, r, cnt, wts, n


def fit_errors(p, r, cnt, n: int, a: float, k_w: float, sat_w: float) -> tuple[float, float]:
    """``(fit_rmse, fit_max_err)`` of the curve ``(a, k_w, sat_w)`` on the first ``n`` (data)
    points of :func:`fit_points` (relative rate; count-weighted RMS; NaN without data)."""
    err = rate(p[:n], a, k_w, sat_w) - r[:n] if n else np.array([np.nan])
    rmse = float(np.sqrt(np.sum(cnt[:n] * err ** 2) / np.sum(cnt[:n]))) if n else math.nan
    return rmse, float(np.max(np.abs(err)))


def _resid_jac(th, p, wts):
    """Jacobian [N, 3] of :func:`fit_curve`'s residuals ``wts * (rate(p) - r)`` in
    ``(log a, log k_w, sat_w)`` (analytic; 0 where the rate is flat: above ``sat_w`` or at the
    :data:`RATE_MIN` floor)."""
    a, k = math.exp(th[0]), math.exp(th[1])
    x = np.maximum((th[2] - p) / k, 0.0)
    em1 = np.expm1(x)
    ex = a * (em1 + 1.0)
    live = wts * ((x > 0) & (1.0 - a * em1 > RATE_MIN))
    return np.stack([-a * em1 * live, ex * x * live, -ex / k * live], axis=1)


def _loss(name: str, counts: np.ndarray):
    """scipy's ``loss`` for ``least_squares``: ``name`` ("linear" or "soft_l1") with each residual
    counted ``counts`` times (the objective of the data with each point repeated that often);
    the name itself when every count is 1 (scipy's own loss)."""
    if np.all(counts == 1.0):
        return name
    if name == "linear":
        return lambda z: np.stack([counts * z, counts, np.zeros_like(z)])
    if name == "soft_l1":
        def soft_l1(z):
            t = 1.0 + z
            return np.stack([counts * 2.0 * (t ** 0.5 - 1.0), counts * t ** -0.5, counts * -0.5 * t ** -1.5])
        return soft_l1
    raise ValueError(f"loss {name!r} with counts: only 'linear' and 'soft_l1'")


@dataclass(frozen=True)
class FitProblem:
    """One curve fit's data (:func:`fit_curve`'s arguments): ``cap_w`` [N] W, ``rate_rel`` [N]
    relative rates, ``counts`` [N] (> 0, how often each sample counts), ``valid_min_w`` W (samples
    below it are left out), ``x0`` the starting curve (the last fit), ``prior`` the regularizing
    curve and its weight (>= 0)."""

    cap_w: np.ndarray
    rate_rel: np.ndarray
    counts: np.ndarray
    valid_min_w: float
    x0: CurveParams
    prior: CurveParams
    prior_weight: float


class OnlineCurveFit:
    """Incremental, robust fit of one GPU's (or one job's) rate curve.

    ``add(cap_w, rate_rel)`` stores one observation (cap in W, observed step rate relative to the
    uncapped rate); samples below ``prior.valid_min_w`` are kept out of the fit (non-concave range).
    Observations are pooled into 1 W bins with exponential forgetting (``half_life`` samples per
    bin), so memory is bounded by the cap range. ``params()`` refits (warm start from the last
    fit) with a robust loss and the prior as regularization of weight ``prior_weight``; the family
    keeps the curve concave and increasing whatever the data. Errors: ValueError on non-finite input.
    """

    __slots__ = ("prior", "prior_weight", "_decay", "_sum", "_wt", "_last", "_dirty", "n_samples")
    # (fixed attributes: add_binned reads and sets five of each of thousands of fits per interval)

    def __init__(self, prior: CurveParams, *, prior_weight: float = 2.0, half_life: float = 50.0):
        self.prior = prior
        self.prior_weight = float(prior_weight)
        self._decay = 0.5 ** (1.0 / half_life)
        self._sum: dict[int, float] = {}
        self._wt: dict[int, float] = {}
        self._last: CurveParams = prior
        self._dirty = False
        self.n_samples = 0

    def add(self, cap_w: float, rate_rel: float) -> None:
        """Add one sample: cap_w [W], rate_rel [-] (observed / uncapped). Raises ValueError if not finite."""
        if not (math.isfinite(cap_w) and math.isfinite(rate_rel)):
            raise ValueError(f"sample must be finite, got cap_w={cap_w!r} rate_rel={rate_rel!r}")
        self.n_samples += 1
        if cap_w < self.prior.valid_min_w:
            return
        b = int(round(cap_w))
        self._sum[b] = self._sum.get(b, 0.0) * self._decay + rate_rel
        self._wt[b] = self._wt.get(b, 0.0) * self._decay + 1.0
        self._dirty = True

    @staticmethod
    def add_binned(fits: list, bins: list, rates: list, in_range: list) -> list[int]:
        """:meth:`add` of one observation to each fit of ``fits``, its checks done by the caller
        on arrays: ``bins`` the caps' 1 W bins (``int(round(cap_w))``), ``rates`` the finite
        relative rates, ``in_range`` whether the cap is at least the fit's ``prior.valid_min_w``
        (lists aligned with ``fits``; each fit at most once). The same state as ``add`` per fit.
        Returns the positions (ascending) whose bin was new to their fit (its first sample)."""
        new = []
        for i, (fit, b, r, ok) in enumerate(zip(fits, bins, rates, in_range)):
            fit.n_samples += 1
            if ok:
                sums = fit._sum
                s = sums.get(b)
                if s is None:  # (0.0 * decay + r is r, 0.0 * decay + 1.0 is 1.0: as add)
                    sums[b] = r
                    fit._wt[b] = 1.0
                    new.append(i)
                else:
                    decay = fit._decay
                    sums[b] = s * decay + r
                    wts = fit._wt
                    wts[b] = wts[b] * decay + 1.0
                fit._dirty = True
        return new

    def params(self) -> CurveParams:
        """Current curve (the prior until samples at >= 3 distinct caps exist): :meth:`fit_problem`
        fitted by :func:`fit_curve` (scipy), then :meth:`accept`. The coordinator's models fit many
        GPUs' problems at once instead (:func:`capctl.allocator.batchfit.fit_curves`, the same
        objective). Raises ValueError (or numpy's LinAlgError / FloatingPointError) when the fit fails."""
        pr = self.fit_problem()
        if pr is None:
            return self._last
        return self.accept(fit_curve(pr.cap_w, pr.rate_rel, counts=pr.counts, valid_min_w=pr.valid_min_w, x0=pr.x0,
                                     prior=pr.prior, prior_weight=pr.prior_weight))

    def fit_problem(self):
        """The refit to do now as a :class:`FitProblem` (warm start from
        the last fit, the prior as regularization), or None when nothing changed since the last
        one or fewer than 3 cap bins hold samples (:meth:`params` then returns the last curve)."""
        if not self._dirty or len(self._sum) < 3:
            return None
        caps = np.array(sorted(self._sum), float)
        means = np.array([self._sum[int(c)] / self._wt[int(c)] for c in caps])
        # each bin counts in proportion to its weight (rounded, 1..20): the objective of the bins
        # repeated that often, on one point per bin
        reps = np.maximum(1, np.round([self._wt[int(c)] for c in caps]).astype(int))
        reps = np.minimum(reps, 20)
        return FitProblem(caps, means, reps.astype(float), self.prior.valid_min_w, self._last, self.prior,
                          self.prior_weight * float(reps.sum()) / 10.0)

    def accept(self, fit: CurveParams) -> CurveParams:
        """Take ``fit`` (the result of :meth:`fit_problem`) as the current curve; returns it."""
        self._last = CurveParams(fit.a, fit.k_w, fit.sat_w, self.prior.valid_min_w, fit.fit_rmse,
                                 fit.fit_max_err, "online fit")
        self._dirty = False
        return self._last


# ------------------------------------------------------------------------------ Zeus trace fitting

DATA_DIR_ENV = "CAPCTL_DATA_DIR"
"""Directory holding ``zeus-power-traces/`` and ``zeus-profile-data/`` (the shared data, not shipped)."""


def zeus_data_dir(repo_root: str | Path | None = None) -> Path:
    """``zeus-power-traces`` under ``$CAPCTL_DATA_DIR``, else ``<repo_root>/../shared/data`` (repo_root
    defaults to the working directory: tests, benches and the demo run from the repository root).
    Never located from where the package is installed."""
    import os

    if not repo_root and os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]) / "zeus-power-traces"
    root = Path(repo_root) if repo_root else Path.cwd()
    return root.parent / "shared" / "data" / "zeus-power-traces"


def load_zeus_traces(path: str | Path) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """Read a Zeus ``summary_power_*.csv``; per workload (dataset, network, batch, optimizer) return
    (cap_w[N], rate_rel[N]) with rate_rel = min(time_per_epoch) / time_per_epoch (1 = fastest).
    Raises FileNotFoundError / KeyError on a missing file or column."""
    groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            key = (row["dataset"], row["network"], row["batch_size"], row["optimizer"])
            groups[key].append((float(row["power_limit"]), float(row["time_per_epoch"])))
    out = {}
    for key, rows in groups.items():
        rows.sort()
        caps = np.array([c for c, _ in rows])
        t = np.array([x for _, x in rows])
        out[key] = (caps, t.min() / t)
    return out


def power_sensitive(traces, min_drop: float = 0.15):
    """Workloads whose rate at the lowest cap is at least ``min_drop`` below 1 (GPU-bound ones;
    the others are input/CPU bound and carry no information about the power curve)."""
    return {k: v for k, v in traces.items() if v[1][0] <= 1.0 - min_drop}


def concave_start_w(traces, tol: float = 0.02) -> float:
    """Lowest cap from which the pooled mean curve of ``traces`` has no second difference above
    ``tol`` (i.e. is concave within noise) up to the top cap [W]."""
    caps = np.unique(np.concatenate([c for c, _ in traces.values()]))
    mean = np.array([np.mean([r[c_ == c][0] for c_, r in traces.values() if np.any(c_ == c)]) for c in caps])
    d2 = mean[2:] - 2 * mean[1:-1] + mean[:-2]
    bad = np.nonzero(d2 > tol)[0]
    return float(caps[bad.max() + 1] if bad.size else caps[0])


def fit_zeus_model(path: str | Path) -> CurveParams:
    """Pooled fit of the curve family to all power-sensitive workloads of one Zeus trace file, on
    the concave range found by :func:`concave_start_w`. Returns params with fit_rmse/fit_max_err
    over all pooled samples in the range."""
    tr = power_sensitive(load_zeus_traces(path))
    lo = concave_start_w(tr)
    caps = np.concatenate([c for c, _ in tr.values()])
    rates = np.concatenate([r for _, r in tr.values()])
    fit = fit_curve(caps, rates, valid_min_w=lo, loss="linear")
    return CurveParams(fit.a, fit.k_w, fit.sat_w, lo, fit.fit_rmse, fit.fit_max_err,
                       f"Zeus {Path(path).name}, {len(tr)} power-sensitive workloads")


# Fitted by fit_zeus_model() on the Zeus traces (Apache-2.0); tests/allocator/test_curves.py re-fits
# them from ../shared/data and checks these literals match.
DEFAULT_CURVES: dict[str, CurveParams] = {
    "A40": CurveParams(a=0.0200237, k_w=42.7547, sat_w=266.734, valid_min_w=125,
                       fit_rmse=0.06356, fit_max_err=0.4525,
                       source="Zeus summary_power_a40.csv, 36 power-sensitive workloads"),
    "V100": CurveParams(a=0.0180152, k_w=54.1941, sat_w=264.825, valid_min_w=100,
                       fit_rmse=0.05531, fit_max_err=0.2054,
                       source="Zeus summary_power_v100.csv, 42 power-sensitive workloads"),
}
_A40_RANGE_W = (100.0, 300.0)  # A40 limit constraints (NVIDIA A40 datasheet: 300 W max board power)
for _name, _lo, _hi in (("A100", 100.0, 400.0), ("H100", 200.0, 700.0), ("H200", 200.0, 700.0)):
    DEFAULT_CURVES[_name] = DEFAULT_CURVES["A40"].scaled(
        *_A40_RANGE_W, _lo, _hi, f"A40 Zeus fit mapped affinely from [100, 300] W to [{_lo:.0f}, {_hi:.0f}] W")
