"""Per-GPU online models: the power->rate curve and the thermal (R, tau, inlet) model.

The curve estimator is the allocator's (:class:`capctl.allocator.curves.OnlineCurveFit`); the
thermal one is the arithmetic of :class:`capctl.allocator.thermal.OnlineThermalFit` batched over
nodes (:class:`ThermalBank`: one RLS update of every node's GPUs per interval, as arrays); this
module turns telemetry samples into their observations.

Rate observations (one per telemetry sample of a busy GPU; source: NVML clocks event reasons,
``nvmlDeviceGetCurrentClocksEventReasons``):

* thermal slowdown reasons present: skipped (the clock is low for another reason than the cap);
* a power-cap reason present (``SW_POWER_CAP``): the cap binds; relative rate estimated as
  ``sm_clock_mhz / max_sm_clock_mhz`` at the enforced cap (synchronous steps scale with the SM
  clock when compute-bound: the estimate the issue asks for);
* no throttling reason and the GPU draws below its cap: the cap does not bind; rate 1.0 at the
  enforced cap (the workload's demand is below it);
* idle GPUs (utilization below :data:`BUSY_UTILIZATION_PCT`) give no observation.

Thermal observations: ``(timestamp, power_w, temp_c)`` of every sample (power is NVML's ~1 s
average, close enough to the average over the interval for intervals of seconds), only at times
when every GPU of the node has a valid sample with a temperature (the registry keeps samples
without a valid reading out altogether: zeros are never learned from).

Memory-bound share (issue 12, item 8; :mod:`coordinator.membound`): the observations above are
clock ratios, so the curves learned are clock curves, and a step that is partly memory-bound gains
less rate per watt than its clock. Each GPU keeps a smoothed estimate ``m`` of its job's
memory-bound share from NVML's memory utilization (one batched update per interval);
:meth:`Models.curve` hands the allocator the curve with ``a`` times
:func:`~coordinator.membound.curve_slope_factor` ``(m) = 1 - m`` (the one hook). Without an
estimate (the agent reports no memory utilization) the curve is exactly the clock curve.

The curve prior is the allocator's default for the device's model (:data:`DEFAULT_CURVES`,
matched in the NVML product name); unknown products get the A40 curve mapped affinely onto the
device's limit constraints (as the allocator does for H100/A100).

Prior-anchored curve (per GPU, every sample, closed form): same-model GPUs need different power
for the same clock (Sinha et al., "Not All GPUs Are Created Equal", SC'22: power management makes
same-SKU GPUs run 8 % apart on average, up to 22 %, under the same limit). Until a GPU's
observations span enough distinct caps for the 3-parameter fit (:data:`FULL_FIT_MIN_CAPS` caps
over :data:`FULL_FIT_MIN_SPAN_W`; settled caps rarely do), its curve is the prior with its power
axis scaled by ``s``: ``rho_g(P) = rho_prior(P / s)`` (``CurveParams`` ``k_w`` and ``sat_w`` times
``s``). Each observation gives one ``s``: at a binding cap, ``P / P_prior(rho)`` (the prior's
inverse, as :func:`~capctl.allocator.curves.cap_for_rate`); below the cap (rate 1), the GPU's own
uncapped draw over the prior's saturation, ``power_w / sat_w``. ``s`` is their exponentially
weighted mean (:data:`SCALE_HALF_LIFE` samples). A GPU bound to a new job (registry bindings)
gets a fresh model: a new workload, a new curve.

Arrays: the per-sample state of every GPU's curve (anchored scale, caps seen, refit bookkeeping,
the learned fit) is a row of one :class:`CurveBank`; :meth:`Models.update` feeds one interval's
samples of all GPUs on arrays (the curve fit's 1 W bins stay per GPU, a dict each; a sample is
the tuple of ``coordinator.registry.Sample``'s fields, read by position: :data:`S_TIME`...) and
:meth:`Models.curve_arrays` reads every GPU's curve as arrays (tested equal to the per-GPU
:meth:`GpuModel.add` / :meth:`Models.curve` to 1e-9). Refits are fitted in batches
(:func:`capctl.allocator.batchfit.fit_curves`) within the interval's budget.

Clocks: :class:`Models` takes the clocks it reads (``clock``: refit throttle, default
``time.monotonic``; ``budget_clock``: the per-interval refit budget, default
``time.perf_counter``) and the random source of the refit jitter, so an in-process user (the
what-if simulator) can run it on simulated time, deterministically. The daemon keeps the defaults.
"""

from __future__ import annotations

import collections
import logging
import math
import operator
import random
import time

import numpy as np

from capctl.allocator.batchfit import fit_curves
from capctl.allocator.curves import DEFAULT_CURVES, CurveParams, OnlineCurveFit
from capctl.allocator.thermal import THERMAL_PRIOR
from coordinator import membound
from coordinator.idlegrants import IdleGrants
from coordinator.paceslope import PaceSlopes
from coordinator.refitcost import RefitCost
from coordinator.registry import gpu_jobs

log = logging.getLogger("capctl.coordinator.models")

BUSY_UTILIZATION_PCT = 20.0
"""A GPU below this utilization (%) is idle: it says nothing about its rate curve."""

MODEL_KEYS = ("H200", "H100", "A100", "A40", "V100")
"""Order in which :data:`DEFAULT_CURVES` keys are searched in NVML product names."""

_A40_RANGE_W = (100.0, 300.0)


def known_product(product_name: str) -> bool:
    """True when ``product_name`` matches a built-in curve (:data:`MODEL_KEYS`)."""
    upper = product_name.upper()
    return any(key in upper and key in DEFAULT_CURVES for key in MODEL_KEYS)


def prior_curve(product_name: str, min_cap_w: float, max_cap_w: float) -> CurveParams:
    """The allocator's default curve for ``product_name`` (e.g. "NVIDIA H100 80GB HBM3").

    Unknown products: the A40 curve (Zeus fit) mapped from [100, 300] W onto
    ``[min_cap_w, max_cap_w]``.
    """
    upper = product_name.upper()
    for key in MODEL_KEYS:
        if key in upper and key in DEFAULT_CURVES:
            return DEFAULT_CURVES[key]
    lo, hi = (min_cap_w, max_cap_w) if max_cap_w > min_cap_w > 0 else (200.0, 700.0)
    return DEFAULT_CURVES["A40"].scaled(*_A40_RANGE_W, lo, hi, f"A40 Zeus fit mapped onto [{lo:g}, {hi:g}] W")


S_TIME, S_POWER, S_ENFORCED, S_TEMP, S_CLOCK, S_REASONS, S_UTIL, S_MEM = range(8)
"""Positions in a sample (``coordinator.registry.Sample``'s field order: time s, power W, enforced
limit W, temperature °C, SM clock MHz, reason names, utilization %, memory utilization % (NaN: not
reported)); ``GpuObs.new_samples`` holds ``Sample`` objects or plain tuples of the same fields."""

_SLOWED, _POWER, _FREE = 0, 1, 2
_RATE_CLASS: dict[tuple, int] = {}


def _rate_class(reasons: tuple) -> int:
    """What a reason set says of the rate (memoized per tuple; a fleet reports a few distinct
    sets): a slowdown sets the clock (thermal, HW), the power cap does, or nothing throttles."""
    hit = _RATE_CLASS.get(reasons)
    if hit is None:
        up = [r.upper() for r in reasons]
        hit = (_SLOWED if any("THERMAL" in r or "SLOWDOWN" in r for r in up)
               else _POWER if any("POWER" in r for r in up) else _FREE)
        if len(_RATE_CLASS) >= 4096:
            _RATE_CLASS.clear()
        _RATE_CLASS[reasons] = hit
    return hit


def rate_observation(sample, max_sm_clock_mhz: float) -> float | None:
    """Relative rate observed in one telemetry sample (see module docstring; read by position,
    :data:`S_TIME`...), or None."""
    if sample[S_UTIL] < BUSY_UTILIZATION_PCT:
        return None
    reasons = sample[S_REASONS]
    cls = _rate_class(reasons if isinstance(reasons, tuple) else tuple(reasons))
    if cls == _SLOWED:
        return None  # the clock is set by a slowdown (thermal, HW): it says nothing of the cap
    clock, enforced_w = sample[S_CLOCK], sample[S_ENFORCED]
    if cls == _POWER:
        if max_sm_clock_mhz <= 0 or clock <= 0:
            return None
        return min(1.0, clock / max_sm_clock_mhz)
    if enforced_w > 0 and sample[S_POWER] < enforced_w:
        return 1.0
    return None


CURVE_REFIT_S = 10.0
"""A GPU's rate curve is refitted (scipy least squares, a few ms) at most this often, seconds."""
FULL_FIT_MIN_CAPS = 3
"""Distinct caps (1 W bins) a GPU must have been observed at before its 3-parameter fit is used."""
FULL_FIT_MIN_SPAN_W = 50.0
"""... and the span (W) those caps must cover: closer caps cannot tell the curve's shape."""
SCALE_HALF_LIFE = 20.0
"""Half-life (samples) of the prior-anchored power scale's exponential mean."""
REFIT_NEW_CAPS = 5
"""A fitted GPU is refitted when this many caps it was never seen at have been observed since ..."""
REFIT_SCALE_MOVE = 0.05
"""... or when its anchored scale moved by this fraction (one 15 MHz clock step is ~2 % of power)
since the last refit: its workload changed (phases within a job)."""
SCALE_RANGE = (0.5, 2.5)
"""Bounds of the power scale ``s`` (Sinha et al. SC'22 variation stays well inside)."""


class CurveBank:
    """The per-GPU state of many :class:`GpuModel` as columns (one row per model), so that one
    interval's samples of all GPUs update them on arrays (:meth:`Models.update`) and their curves
    are read as arrays (:meth:`Models.curve_arrays`). Columns: the anchored scale's weighted sum
    and weight, the scale at the last refit, new caps since it, the refit time (s), whether the
    full fit is usable (``ready``) and the learned curve (``learned``; ``fit`` [rows, 6]: a, k_w W,
    sat_w W, valid_min_w W, fit_rmse, fit_max_err); each row's prior (``prior`` [rows, 4] as
    ``fit``'s first four, ``prior_obj`` the CurveParams); the memory-bound share's smoothed
    estimate ``mem_share`` [rows] (0-0.9) and its sample weight ``mem_weight`` [rows] (0: none;
    :mod:`coordinator.membound`); the lowest / highest cap bin seen ``cap_lo`` / ``cap_hi`` (W)
    and how many distinct bins ``n_caps`` (the curve fit's bins: :attr:`GpuModel._caps`)."""

    FLOAT = ("scale_sum", "scale_wt", "scale_at_fit", "refit_mono")

    def __init__(self, capacity: int = 16) -> None:
        self.rows = 0
        self.free: list[int] = []
        self._alloc(capacity)

    def _alloc(self, cap: int) -> None:
        old = self.rows and (self.scale_sum, self.scale_wt, self.scale_at_fit, self.refit_mono, self.new_caps,
                             self.ready, self.learned, self.fit, self.prior, self.prior_obj, self.mem_share,
                             self.mem_weight, self.cap_lo, self.cap_hi, self.n_caps)
        self.scale_sum = np.zeros(cap)
        self.scale_wt = np.zeros(cap)
        self.scale_at_fit = np.ones(cap)
        self.refit_mono = np.full(cap, -math.inf)
        self.new_caps = np.zeros(cap, np.int64)
        self.ready = np.zeros(cap, bool)
        self.learned = np.zeros(cap, bool)
        self.fit = np.zeros((cap, 6))
        self.prior = np.zeros((cap, 4))
        self.prior_obj = np.full(cap, None, dtype=object)
        self.mem_share = np.zeros(cap)
        self.mem_weight = np.zeros(cap)
        self.cap_lo = np.full(cap, math.inf)  # lowest / highest cap bin seen (W)
        self.cap_hi = np.full(cap, -math.inf)
        self.n_caps = np.zeros(cap, np.int64)
        if old:
            for new, prev in zip((self.scale_sum, self.scale_wt, self.scale_at_fit, self.refit_mono, self.new_caps,
                                  self.ready, self.learned, self.fit, self.prior, self.prior_obj, self.mem_share,
                                  self.mem_weight, self.cap_lo, self.cap_hi, self.n_caps), old):
                new[:len(prev)] = prev

    def new_row(self, prior: CurveParams) -> int:
        """A row at the initial state (no observation) for a GPU of curve prior ``prior``;
        returns its index."""
        if self.free:
            row = self.free.pop()
        else:
            if self.rows == len(self.scale_sum):
                self._alloc(2 * self.rows)
            row = self.rows
            self.rows += 1
        self.scale_sum[row] = self.scale_wt[row] = 0.0
        self.scale_at_fit[row] = 1.0
        self.refit_mono[row] = -math.inf
        self.new_caps[row] = 0
        self.ready[row] = self.learned[row] = False
        self.mem_share[row] = self.mem_weight[row] = 0.0
        self.cap_lo[row] = math.inf
        self.cap_hi[row] = -math.inf
        self.n_caps[row] = 0
        self.prior[row] = (prior.a, prior.k_w, prior.sat_w, prior.valid_min_w)
        self.prior_obj[row] = prior
        return row

    def release(self, row: int) -> None:
        """Give a row back (its model was dropped)."""
        self.free.append(row)


def _bank_field(name: str, cast):
    def get(self):
        return cast(getattr(self.bank, name)[self.row])

    def set_(self, value):
        getattr(self.bank, name)[self.row] = value

    return property(get, set_)


class GpuModel:
    """Online curve of one GPU (W -> relative rate): prior-anchored scale, then the full fit.
    Its per-sample state lives in a row of a :class:`CurveBank` (its own unless ``bank`` is given:
    :class:`Models` keeps all its GPUs in one)."""

    def __init__(self, product_name: str, min_cap_w: float, max_cap_w: float, bank: CurveBank | None = None) -> None:
        self.prior = prior_curve(product_name, min_cap_w, max_cap_w)
        self.known = known_product(product_name)
        self.curve_fit = OnlineCurveFit(self.prior)
        self._failed = False
        self._cached = self.prior
        self.bank = bank if bank is not None else CurveBank(1)
        self.row = self.bank.new_row(self.prior)
        self._scaled: CurveParams | None = None
        self._scaled_at: tuple | None = None
        self._decay = 0.5 ** (1.0 / SCALE_HALF_LIFE)
        self.refits = 0
        self.job_id = ""  # the job whose samples this model holds ("" = none yet)
        # memory-bound share of this job's step (coordinator.membound; Models.update keeps it):
        # smoothed estimate and its sample weight (bank columns, 0 / 0 = none: the curve as before)
        self.mem_curve: tuple | None = None  # (clock curve, share, rate curve) of the last call

    _scale_sum = _bank_field("scale_sum", float)
    _scale_wt = _bank_field("scale_wt", float)
    _scale_at_fit = _bank_field("scale_at_fit", float)
    _refit_mono = _bank_field("refit_mono", float)
    _new_caps = _bank_field("new_caps", int)  # distinct caps first seen since the last refit
    _ready = _bank_field("ready", bool)  # _full_fit_ready() once true stays true (caps are only added)
    _cap_lo = _bank_field("cap_lo", float)  # lowest and highest cap bin seen (W)
    _cap_hi = _bank_field("cap_hi", float)
    mem_share = _bank_field("mem_share", float)  # memory-bound share (coordinator.membound) and its weight
    mem_weight = _bank_field("mem_weight", float)

    def add(self, sample, max_sm_clock_mhz: float) -> None:
        """Feed one telemetry sample (a ``Sample`` or the tuple of its fields, :data:`S_TIME`...)."""
        rho = rate_observation(sample, max_sm_clock_mhz)
        enforced_w, power_w = sample[S_ENFORCED], sample[S_POWER]
        if rho is None or not (math.isfinite(enforced_w) and enforced_w > 0):
            return  # no reading (zeros) is no observation
        self.observe_cap(enforced_w, rho)
        p = self.prior
        if rho < 1.0:
            ref = p.sat_w - p.k_w * math.log1p((1.0 - rho) / p.a)  # cap_for_rate, scalar
            s = enforced_w / ref if ref > 0 else math.nan
        else:
            s = power_w / p.sat_w if power_w > 0 and p.sat_w > 0 else math.nan
        if math.isfinite(s):
            s = min(max(s, SCALE_RANGE[0]), SCALE_RANGE[1])
            self._scale_sum = self._scale_sum * self._decay + s
            self._scale_wt = self._scale_wt * self._decay + 1.0
            self._scaled = None

    def observe_cap(self, enforced_w: float, rho: float) -> None:
        """The part of :meth:`add` kept per GPU: the observation into the curve fit's 1 W bins
        and the set of caps seen (W; ``rho`` the observed relative rate)."""
        b = int(round(enforced_w))
        new = b not in self.curve_fit._sum and enforced_w >= self.prior.valid_min_w
        self.curve_fit.add(enforced_w, rho)
        if new:
            self._new_cap(b)

    @property
    def _caps(self):
        """The cap bins (W) seen at or above the prior's ``valid_min_w``: the curve fit's 1 W bins
        (the same rule and bin: ``int(round(cap))``, the fit's prior keeps the model's
        ``valid_min_w``), a set-like view."""
        return self.curve_fit._sum.keys()

    def _new_cap(self, b: int) -> None:
        """A cap bin (W) this GPU was never seen at, at or above its prior's ``valid_min_w`` (now
        in the curve fit's bins)."""
        bank, row = self.bank, self.row
        lo = bank.cap_lo[row] = min(float(bank.cap_lo[row]), b)
        hi = bank.cap_hi[row] = max(float(bank.cap_hi[row]), b)
        bank.new_caps[row] += 1
        n = bank.n_caps[row] = len(self._caps)
        # the full fit's condition, kept on each new cap (caps are only added: once true, stays)
        bank.ready[row] = n >= FULL_FIT_MIN_CAPS and hi - lo >= FULL_FIT_MIN_SPAN_W

    @property
    def kind(self) -> str:
        """The curve in use: ``learned`` (this GPU's own 3-parameter fit), ``prior`` (a built-in
        model's curve scaled to this GPU) or ``generic`` (no built-in model matches: a curve mapped
        from the device's limit constraints, until learned)."""
        if self._cached is not self.prior:
            return "learned"
        return "prior" if self.known else "generic"

    @property
    def scale(self) -> float:
        """Current power scale ``s`` of the prior-anchored curve (1.0 before any observation)."""
        wt = self._scale_wt
        return self._scale_sum / wt if wt > 0 else 1.0

    def _full_fit_ready(self) -> bool:
        """Observations at :data:`FULL_FIT_MIN_CAPS` caps over :data:`FULL_FIT_MIN_SPAN_W` (kept by
        :meth:`observe_cap`)."""
        return bool(self.bank.ready[self.row])

    def _anchored(self) -> CurveParams:
        if self._scaled is None or self._scaled_at != (self._scale_sum, self._scale_wt):
            s = self.scale
            p = self.prior
            self._scaled_at = (self._scale_sum, self._scale_wt)
            self._scaled = p if s == 1.0 else CurveParams(
                p.a, p.k_w * s, p.sat_w * s, p.valid_min_w, p.fit_rmse, p.fit_max_err,
                f"prior scaled x{s:.3f} in power")
        return self._scaled

    def curve(self, now_mono: float | None = None, allow_refit: bool = True, rng=random) -> CurveParams:
        """The current curve: the prior-anchored scaled prior until the full fit is usable, then the
        full fit, refitted at most every :data:`CURVE_REFIT_S` (``now_mono``, default
        ``time.monotonic()``), only when ``allow_refit`` and when new caps were observed; the last
        good fit if a refit fails. ``rng``: source of the refit jitter (``random.uniform``).
        A refit is :meth:`begin_refit`, one fit, :meth:`finish_refit` (:meth:`Models.curve_arrays`
        does the fits of many GPUs in one batch)."""
        if not self._full_fit_ready():
            return self._anchored()
        now = time.monotonic() if now_mono is None else now_mono
        if self.refit_wanted(now, allow_refit):
            problem = self.begin_refit(now, rng)
            self.finish_refit(problem, fit_curves([problem])[0] if problem is not None else None)
        return self._cached if self._cached is not self.prior else self._anchored()

    def refit_wanted(self, now: float, allow_refit: bool = True) -> bool:
        """True when :meth:`curve` would refit at ``now`` (mono s): the full fit is usable, new caps
        or a moved scale since the last one, the throttle passed and ``allow_refit``."""
        if not self._full_fit_ready():
            return False
        moved = abs(self.scale / self._scale_at_fit - 1.0) > REFIT_SCALE_MOVE
        if self._cached is not self.prior and not (self._new_caps >= REFIT_NEW_CAPS or moved):
            return False  # nothing new to fit: skip the refit
        return allow_refit and now - self._refit_mono >= CURVE_REFIT_S

    def begin_refit(self, now: float, rng=random):
        """Start a refit at ``now`` (mono s): the throttle and its jitter, the new-cap count, the
        scale at fit, the regularizing prior; returns the fit to do
        (:meth:`OnlineCurveFit.fit_problem`; None: no new samples, the last fit stays)."""
        # the next refit comes 0.8-1.2 periods later: refits of many GPUs spread over intervals
        self._refit_mono = now + rng.uniform(-0.2, 0.2) * CURVE_REFIT_S
        self._new_caps = 0
        self._scale_at_fit = self.scale
        # regularize toward this GPU's anchored prior, not the model's (a part needing 1.4x the
        # power would otherwise be pulled back to the nominal curve)
        self.curve_fit.prior = self._anchored()
        return self.curve_fit.fit_problem()

    def finish_refit(self, problem, fit) -> None:
        """End the refit :meth:`begin_refit` started: ``fit`` is the ``fit_curves`` result of its
        ``problem`` (a :class:`CurveParams` or the exception it raised; None with no problem). A
        failed fit keeps the last one (logged once per GPU)."""
        if fit is not None and not isinstance(fit, Exception) and not all(
                map(math.isfinite, (fit.a, fit.k_w, fit.sat_w))):
            fit = ValueError(f"a fit ended at non-finite parameters (a={fit.a}, k_w={fit.k_w}, sat_w={fit.sat_w})")
        if isinstance(fit, Exception):
            if not self._failed:
                log.warning("rate curve refit failed (%s); keeping the last fit", fit)
                self._failed = True
            return
        self._cached = c = self.curve_fit.accept(fit) if problem is not None else self.curve_fit.params()
        self.refits += 1
        if c is not self.prior:
            self.bank.learned[self.row] = True
            self.bank.fit[self.row] = (c.a, c.k_w, c.sat_w, c.valid_min_w, c.fit_rmse, c.fit_max_err)


class ThermalBank:
    """The RLS thermal estimates of many nodes with ``n_gpus`` GPUs each, as arrays (one row per
    node): the arithmetic of :class:`capctl.allocator.thermal.OnlineThermalFit` (same model,
    prior, forgetting factor 0.995, prior strength 1e-2, dt screening, bounds), batched over nodes
    so that one interval's samples of all nodes are one update. Row ``r`` after the same samples
    equals an ``OnlineThermalFit(n_gpus, nominal_interval_s=...)`` fed them (tested to 1e-9).

    Shapes: ``theta`` [rows, G, 3] (alpha, beta, gamma), ``cov`` [rows, G, 3, 3]; per row the
    previous sample time (s, NaN: none), temperatures (°C), the dt statistics (s); ``last_t`` [rows]
    the time (s) of the last sample :meth:`NodeThermal.accepts` took (-inf: none)."""

    FORGET = 0.995
    PRIOR_STRENGTH = 1e-2

    def __init__(self, n_gpus: int) -> None:
        self.n = int(n_gpus)
        self.rows = 0
        self.free: list[int] = []
        self._alloc(16)

    def _alloc(self, cap: int) -> None:
        old = self.rows and (self.theta, self.cov, self.prev_t, self.prev_temp, self.dt_sum, self.dt_n, self.dt_s,
                             self.last_t)
        G = self.n
        self.theta = np.zeros((cap, G, 3))
        self.cov = np.zeros((cap, G, 3, 3))
        self.prev_t = np.full(cap, np.nan)
        self.prev_temp = np.zeros((cap, G))
        self.dt_sum = np.zeros(cap)
        self.dt_n = np.zeros(cap, np.int64)
        self.dt_s = np.zeros(cap)
        self.last_t = np.full(cap, -math.inf)
        if old:
            for new, prev in zip((self.theta, self.cov, self.prev_t, self.prev_temp, self.dt_sum, self.dt_n,
                                  self.dt_s, self.last_t), old):
                new[:len(prev)] = prev

    def new_row(self, interval_s: float) -> int:
        """A row at the prior (nominal sampling period ``interval_s``, s); returns its index."""
        if self.free:
            row = self.free.pop()
        else:
            if self.rows == len(self.prev_t):
                self._alloc(2 * self.rows)
            row = self.rows
            self.rows += 1
        r0, tau0, in0 = (THERMAL_PRIOR[k][0] for k in ("r_c_per_w", "tau_s", "inlet_c"))
        e = np.exp(-float(interval_s) / tau0)
        self.theta[row] = np.array([e, (1 - e) * r0, (1 - e) * in0])
        scale = np.array([1 / 50.0, 1 / 300.0, 1.0]) ** 2
        self.cov[row] = np.diag(scale / self.PRIOR_STRENGTH)
        self.prev_t[row] = np.nan
        self.dt_sum[row] = 0.0
        self.dt_n[row] = 0
        self.dt_s[row] = float(interval_s)
        self.last_t[row] = -math.inf
        return row

    def release(self, row: int) -> None:
        """Give a row back (its node left)."""
        self.free.append(row)

    def add(self, rows: np.ndarray, time_s: np.ndarray, power_w: np.ndarray, temp_c: np.ndarray) -> None:
        """One sample of every GPU of the nodes ``rows`` (distinct, [K]): time [K] (s, later than
        the row's previous one), power [K, G] (W), temperature [K, G] (°C)."""
        G = self.n
        has = np.isfinite(self.prev_t[rows])
        k = rows[has]
        if k.size:
            dt = time_s[has] - self.prev_t[k]
            n_prev = self.dt_n[k]
            mean_dt = np.where(n_prev > 0, self.dt_sum[k] / np.maximum(n_prev, 1), dt)
            ok = np.abs(dt - mean_dt) <= 0.5 * mean_dt
            k, dt = k[ok], dt[ok]
            if k.size:
                self.dt_sum[k] += G * dt
                self.dt_n[k] += G
                self.dt_s[k] = self.dt_sum[k] / self.dt_n[k]
                sel = np.nonzero(has)[0][ok]
                x = np.stack([self.prev_temp[k], power_w[sel], np.ones((k.size, G))], axis=2)  # [K, G, 3]
                cov = self.cov[k]
                theta = self.theta[k]
                px = np.einsum("kgij,kgj->kgi", cov, x)
                denom = self.FORGET + np.einsum("kgi,kgi->kg", x, px)
                gain = px / denom[..., None]
                err = temp_c[sel] - np.einsum("kgi,kgi->kg", x, theta)
                upd = np.isfinite(err)
                newcov = np.multiply(gain[..., :, None], px[..., None, :])  # (cov - gain px') / FORGET, in place
                np.subtract(cov, newcov, out=newcov)
                newcov /= self.FORGET
                if upd.all():  # (the usual case: the same values without the masked copies)
                    theta += gain * err[..., None]
                    cov = newcov
                else:
                    theta[upd] += gain[upd] * err[upd][:, None]
                    cov[upd] = newcov[upd]
                self.theta[k] = theta
                self.cov[k] = cov
        self.prev_t[rows] = time_s
        self.prev_temp[rows] = temp_c

    def params(self, rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(r_c_per_w, tau_s, inlet_c)`` [K, G] (°C/W, s, °C) of ``rows``, clipped to the
        bounds of :data:`capctl.allocator.thermal.THERMAL_PRIOR` (as ``OnlineThermalFit.params``)."""
        lo = {k: v[1] for k, v in THERMAL_PRIOR.items()}
        hi = {k: v[2] for k, v in THERMAL_PRIOR.items()}
        dt = self.dt_s[rows][:, None]
        th = self.theta[rows]
        alpha = np.clip(th[..., 0], np.exp(-dt / lo["tau_s"]), np.exp(-dt / hi["tau_s"]))
        tau = -dt / np.log(alpha)
        r = np.clip(th[..., 1] / (1 - alpha), lo["r_c_per_w"], hi["r_c_per_w"])
        inlet = np.clip(th[..., 2] / (1 - alpha), lo["inlet_c"], hi["inlet_c"])
        return r, np.clip(tau, lo["tau_s"], hi["tau_s"]), inlet


class NodeThermal:
    """Thermal model of one node's GPUs: one row of a :class:`ThermalBank` over its GPU indices."""

    def __init__(self, indices: tuple[int, ...], interval_s: float, bank: ThermalBank | None = None) -> None:
        self.indices = indices
        self.bank = bank if bank is not None else ThermalBank(len(indices))
        self.row = self.bank.new_row(interval_s)

    @property
    def last_t(self) -> float:
        """Time (s) of the last sample taken (-inf: none; its bank's ``last_t`` column, so that
        :meth:`Models.update` reads and sets those of many nodes on arrays)."""
        return float(self.bank.last_t[self.row])

    @last_t.setter
    def last_t(self, time_s: float) -> None:
        self.bank.last_t[self.row] = time_s

    def accepts(self, time_s: float, power_w, temp_c) -> bool:
        """True when a sample at ``time_s`` (s) is new and well formed (one finite-typed value per
        GPU); out-of-order samples are ignored."""
        return time_s > self.last_t and len(power_w) == len(temp_c) == len(self.indices)

    def add(self, time_s: float, power_w: list[float], temp_c: list[float]) -> None:
        """One sample per GPU (in ``indices`` order); out-of-order samples are ignored."""
        if not self.accepts(time_s, power_w, temp_c):
            return
        self.last_t = time_s
        self.bank.add(np.array([self.row]), np.array([float(time_s)]), np.asarray([power_w], float),
                      np.asarray([temp_c], float))

    def params(self) -> dict[int, tuple[float, float, float]]:
        """GPU index -> (r_c_per_w °C/W, tau_s s, inlet_c °C)."""
        r, tau, inlet = (a[0].tolist() for a in self.bank.params(np.array([self.row])))
        return {idx: (r[i], tau[i], inlet[i]) for i, idx in enumerate(self.indices)}


REFIT_BUDGET_FRACTION = 0.1
"""Curve refits of one interval stop after this fraction of the interval, at most
:data:`REFIT_BUDGET_MAX_S` and at most :data:`REFIT_BUDGET_PER_GPU_S` per GPU (never below
:data:`REFIT_BUDGET_MIN_S`); the GPUs left over keep their last fit until a later interval."""
REFIT_BUDGET_MAX_S = 0.1
REFIT_BUDGET_PER_GPU_S = 1.5e-6
"""The refit budget per GPU of the cluster (s per interval; issue 12 item 7: at most 20 us of
coordinator CPU per GPU per interval beyond the solver in all): at 8,000 GPUs 12 ms, some 12
batched fits (bench/interval_cost.py: 1.7 us per GPU); at 100,000 the :data:`REFIT_BUDGET_MAX_S`
cap, ~320 fits."""
REFIT_BUDGET_MIN_S = 0.01
"""The refit budget of a small cluster (s per interval): some ten batched fits."""
REFIT_BATCH = 64
"""Curve refits fitted together at most (:func:`capctl.allocator.batchfit.fit_curves`); a batch
holds as many as the budget left pays for at the measured cost (:mod:`coordinator.refitcost`: a
fixed part per batch and a part per fit; the interval's first batch at least one)."""


def _with_memory_bound(m: GpuModel, c: CurveParams) -> CurveParams:
    """The hook: GPU ``m``'s clock curve ``c`` as a step-rate curve for its memory-bound share
    (:func:`coordinator.membound.curve_slope_factor`); ``c`` itself without an estimate."""
    share = m.mem_share
    if share <= 0.0:
        return c
    hit = m.mem_curve
    if hit is not None and hit[0] is c and hit[1] == share:
        return hit[2]
    out = CurveParams(c.a * membound.curve_slope_factor(share), c.k_w, c.sat_w, c.valid_min_w, c.fit_rmse,
                      c.fit_max_err, f"{c.source}, memory-bound {share:.2f}")
    m.mem_curve = (c, share, out)
    return out


def _update_memory_bound(work: list) -> None:
    """One :func:`coordinator.membound.smooth` step of every GPU in ``work`` (``(GpuModel, sample,
    max SM clock MHz)``: its latest sample of the interval) as arrays."""
    n = len(work)
    mem = np.fromiter((w[1][S_MEM] for w in work), float, n)
    util = np.fromiter((w[1][S_UTIL] for w in work), float, n)
    ratio = np.fromiter((w[1][S_CLOCK] / w[2] if w[2] > 0 else np.nan for w in work), float, n)
    mean, weight = membound.smooth(np.fromiter((w[0].mem_share for w in work), float, n),
                                   np.fromiter((w[0].mem_weight for w in work), float, n),
                                   membound.sample_share(mem, util, ratio))
    for (model, _, _), m_i, w_i in zip(work, mean.tolist(), weight.tolist()):
        model.mem_share = m_i
        model.mem_weight = w_i


def _new_caps_batch(bank: CurveBank, rows: np.ndarray, bins: np.ndarray, new: list) -> None:
    """:meth:`GpuModel._new_cap` of the GPUs at positions ``new`` of ``rows`` (distinct rows of
    ``bank``; ``bins`` [n] cap bins, W) whose bin was new to them (``OnlineCurveFit.add_binned``
    returns them): the bank's lowest / highest cap, new-cap and bin counts and full-fit condition
    on arrays (the same state)."""
    if not new:
        return
    r = rows[new]
    b = bins[new].astype(float)
    lo = bank.cap_lo[r] = np.minimum(bank.cap_lo[r], b)
    hi = bank.cap_hi[r] = np.maximum(bank.cap_hi[r], b)
    bank.new_caps[r] += 1
    n_caps = bank.n_caps[r] = bank.n_caps[r] + 1
    bank.ready[r] = (n_caps >= FULL_FIT_MIN_CAPS) & (hi - lo >= FULL_FIT_MIN_SPAN_W)


def _update_memory_bound_cols(bank: CurveBank, rows: np.ndarray, cols: dict) -> None:
    """:func:`_update_memory_bound` of the GPUs of bank rows ``rows`` [n] (distinct), one sample
    each, from the columns ``cols`` (:func:`_sample_columns`: [n] arrays, memory utilization % NaN
    = not reported, SM clock MHz, max SM clock MHz): the same smoothing step on the bank's
    ``mem_share`` / ``mem_weight`` rows of the GPUs that report a memory utilization (tested equal
    to the per-GPU path to 1e-9)."""
    if not rows.size:
        return
    mem = cols["memory_utilization_pct"]
    sel = np.nonzero(~np.isnan(mem))[0]
    if not sel.size:
        return
    rows = rows[sel]
    maxc = cols["max_sm_clock_mhz"][sel]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(maxc > 0, cols["sm_clock_mhz"][sel] / np.where(maxc > 0, maxc, 1.0), np.nan)
    mean, weight = membound.smooth(bank.mem_share[rows], bank.mem_weight[rows],
                                   membound.sample_share(mem[sel], cols["utilization_pct"][sel], ratio))
    bank.mem_share[rows] = mean
    bank.mem_weight[rows] = weight


def _common_times(per_gpu: list) -> list[tuple[float, list[float], list[float]]]:
    """The thermal samples of one node: ``(time s, powers W, temps °C)`` for each telemetry time
    at which every GPU has a valid sample with a temperature (sorted). The samples of one
    telemetry message share its arrival time; a GPU without a reading, or without a temperature,
    gives none at that time, so the fit never learns from zeros. (Samples read by position,
    :data:`S_TIME`...)"""
    if all(len(x) == 1 for x in per_gpu):  # the usual case: one report per interval
        t = per_gpu[0][0][S_TIME]
        if all(x[0][S_TIME] == t and x[0][S_TEMP] > 0 and math.isfinite(x[0][S_TEMP]) for x in per_gpu):
            return [(t, [x[0][S_POWER] for x in per_gpu], [x[0][S_TEMP] for x in per_gpu])]
    by_time = [{smp[S_TIME]: smp for smp in samples_i if smp[S_TEMP] > 0 and math.isfinite(smp[S_TEMP])}
               for samples_i in per_gpu]
    common = sorted(set(by_time[0]).intersection(*by_time[1:]))
    return [(t, [m[t][S_POWER] for m in by_time], [m[t][S_TEMP] for m in by_time]) for t in common]


_COLUMNS = (("time_s", S_TIME), ("power_w", S_POWER), ("enforced_w", S_ENFORCED), ("temp_c", S_TEMP),
            ("sm_clock_mhz", S_CLOCK), ("utilization_pct", S_UTIL), ("memory_utilization_pct", S_MEM))
"""The numeric sample fields :meth:`Models.update` reads as columns, and their positions."""


def _sample_columns(samples: list, max_clock_mhz: np.ndarray) -> dict:
    """The fields of ``samples`` (tuples in ``Sample`` order, one per GPU) as arrays [n] by field
    name, ``reasons`` a list, ``max_sm_clock_mhz`` the GPUs' ``max_clock_mhz`` [n]. One
    ``np.fromiter`` over an ``itemgetter`` per field (measured 7 Dec 2026, 8,000 GPUs: 0.17 ms
    each; one ``zip(*samples)`` cost 1.1 ms and made 8,000 iterators for the collector)."""
    n = len(samples)
    cols = {name: np.fromiter(map(operator.itemgetter(pos), samples), float, n) for name, pos in _COLUMNS}
    cols["reasons"] = list(map(operator.itemgetter(S_REASONS), samples))
    cols["max_sm_clock_mhz"] = max_clock_mhz
    return cols


def _rate_classes(reasons) -> np.ndarray:
    """:func:`_rate_class` of every reason set of ``reasons`` as an array [n] (the memo read with
    one ``map``; a set not memoized yet, or given as a list, through :func:`_rate_class`)."""
    try:
        cls = list(map(_RATE_CLASS.get, reasons))
    except TypeError:  # an unhashable set (a list): one by one
        cls = [None] * len(reasons)
    if None in cls:
        cls = [c if c is not None else _rate_class(r if isinstance(r, tuple) else tuple(r))
               for c, r in zip(cls, reasons)]
    return np.array(cls, np.int64) if cls else np.zeros(0, np.int64)


class CurveColumns:
    """Rate curves of G GPUs as arrays [G] (``a``, ``k_w`` W, ``sat_w`` W, ``valid_min_w`` W, the
    anchored ``scale``) and what rebuilds each one's ``CurveParams`` (:meth:`curve`): ``priors``
    (None: an unknown GPU), ``learned`` [G] bool and ``fit`` [G, 6] (the bank's learned fits)."""

    __slots__ = ("a", "k_w", "sat_w", "valid_min_w", "scale", "priors", "learned", "fit", "mem_share")

    def __init__(self, *, a, k_w, sat_w, valid_min_w, scale, priors, learned, fit, mem_share=None) -> None:
        self.a, self.k_w, self.sat_w, self.valid_min_w = a, k_w, sat_w, valid_min_w
        self.scale, self.priors, self.learned, self.fit = scale, priors, learned, fit
        self.mem_share = mem_share  # [G] memory-bound share (coordinator.membound; 0: none) or None

    def curve(self, i: int) -> CurveParams | None:
        """GPU ``i``'s curve, equal to what ``GpuModel.curve()`` returned (a scaled prior as
        ``_anchored``, a learned fit as ``OnlineCurveFit.params``; None for an unknown GPU)."""
        return self.curves_at([i])[0]

    def curves_at(self, positions) -> list:
        """:meth:`curve` of every GPU at ``positions`` (one conversion per array)."""
        pos = np.asarray(positions, np.int64)
        priors = self.priors[pos].tolist() if isinstance(self.priors, np.ndarray) else [self.priors[i] for i in pos]
        learned = self.learned[pos].tolist()
        fits = self.fit[pos].tolist() if self.fit is not None else [None] * len(pos)
        shares = self.mem_share[pos].tolist() if self.mem_share is not None else [0.0] * len(pos)
        out = []
        for p, s, lf, f, share in zip(priors, self.scale[pos].tolist(), learned, fits, shares):
            if p is None:
                c = None
            elif lf:
                c = CurveParams(f[0], f[1], f[2], f[3], f[4], f[5], "online fit")
            else:
                c = p if s == 1.0 else CurveParams(p.a, p.k_w * s, p.sat_w * s, p.valid_min_w, p.fit_rmse,
                                                   p.fit_max_err, f"prior scaled x{s:.3f} in power")
            if c is not None and share > 0.0:  # as _with_memory_bound
                c = CurveParams(c.a * membound.curve_slope_factor(share), c.k_w, c.sat_w, c.valid_min_w, c.fit_rmse,
                                c.fit_max_err, f"{c.source}, memory-bound {share:.2f}")
            out.append(c)
        return out


_ROW = operator.attrgetter("row")
"""A model's row in its bank (:class:`CurveBank`)."""
_NEW_SAMPLES = operator.attrgetter("new_samples")
_MAX_CLOCK = operator.attrgetter("max_sm_clock_mhz")
_FIRST = operator.itemgetter(0)


class _NodeEntry:
    """:meth:`Models.update`'s record of one node as last seen: the ``NodeObs``, its GPU dict's
    keys and records (insertion order), its bindings as ``(job_id, gpu_indices)``; the GPU records
    in index order (``glist``), their models and the node's :class:`NodeThermal`. Valid while the
    node, its records and bindings are those (:meth:`Models._node_entries`)."""

    __slots__ = ("node", "keys", "vals", "bind", "glist", "models", "nt")

    def __init__(self, node, bind: list, glist: list, models: list, nt: NodeThermal) -> None:
        self.node, self.keys, self.vals, self.bind = node, list(node.gpus), list(node.gpus.values()), bind
        self.glist, self.models, self.nt = glist, models, nt


class _Flat:
    """Every node's GPUs in one sequence (nodes in the registry's order, each node's GPUs by index;
    ``entries`` the :class:`_NodeEntry` list it was built from): ``glist`` the GPU records,
    ``models`` / ``fits`` their :class:`GpuModel` and curve fits, ``rows`` [G] their
    :class:`CurveBank` rows; per node with GPUs: ``starts`` / ``sizes`` [K] (positions), ``nts``
    its :class:`NodeThermal`, ``bank_of`` [K] its thermal bank (index in ``banks``), ``nt_rows``
    [K] its row there."""

    def __init__(self, entries: list) -> None:
        self.entries = entries
        self.glist = [g for e in entries for g in e.glist]
        self.models = [m for e in entries for m in e.models]
        self.fits = [m.curve_fit for m in self.models]
        self.rows = np.fromiter(map(_ROW, self.models), np.int64, len(self.models))
        full = [e for e in entries if e.glist]
        self.sizes = np.fromiter((len(e.glist) for e in full), np.int64, len(full))
        self.starts = np.cumsum(self.sizes) - self.sizes
        self.nts = [e.nt for e in full]
        self.banks = list({id(nt.bank): nt.bank for nt in self.nts}.values())
        index = {id(b): i for i, b in enumerate(self.banks)}
        self.bank_of = np.fromiter((index[id(nt.bank)] for nt in self.nts), np.int64, len(full))
        self.nt_rows = np.fromiter((nt.row for nt in self.nts), np.int64, len(full))


class Models:
    """All online models of the cluster, keyed by ``(node, index)`` / node name."""

    def __init__(self, clock=time.monotonic, budget_clock=time.perf_counter, rng=None) -> None:
        """``clock``: seconds for the refit throttle; ``budget_clock``: seconds for the
        per-interval refit budget; ``rng``: a ``random.Random`` for the refit jitter (default: the
        ``random`` module). The daemon uses the defaults; the what-if simulator passes simulated
        clocks and a seeded ``random.Random`` (deterministic runs)."""
        self.gpus: dict[tuple[str, int], GpuModel] = {}
        self.curve_bank = CurveBank()  # the per-sample state of every GpuModel of ``gpus``
        self._node_models: dict[str, _NodeEntry] = {}  # node -> its record as last seen (update)
        self._flat: _Flat | None = None  # every node's GPUs in one sequence (update)
        self._held: dict[str, set[int]] = {}  # node -> the GPU indices of ``gpus`` keys (forget_missing)
        self.nodes: dict[str, NodeThermal] = {}
        self._banks: dict[int, ThermalBank] = {}  # GPUs per node -> the thermal rows of such nodes
        self._thermal_cache = None  # per interval: bank id -> (r, tau, inlet) of all its rows
        self._thermal_arrays = None  # the same as arrays [3, rows, G] (thermal_arrays)
        self._refit_deadline: float | None = 0.0
        self._refit_budget_s = 0.0
        self._fit_cost = RefitCost()  # a batch of refits' measured cost (s, budget clock)
        self._clock = clock
        self._budget_clock = budget_clock
        self._rng = rng if rng is not None else random
        self.refits = 0
        """Full (3-parameter) curve refits done so far."""
        self.memory_bound_share = "estimate"
        """Policy ``models.memory_bound_share`` (the caller sets it): ``estimate`` keeps each GPU's
        share (:func:`_update_memory_bound`), ``zero`` keeps none: the next :meth:`update` drops
        every estimate, so both curve paths give the clock curves."""
        self.pace_slopes = PaceSlopes()
        """Each GPU's measured slope of power over pace (the pace loop's; fed by the solver inputs)."""
        self.idle_grants = IdleGrants()
        """The idle GPUs' recent raw grants (coordinator.idlegrants; recorded from each solve's output)."""

    def update(self, registry, interval_s: float) -> None:
        """Consume the samples the registry gathered since the last call; opens this interval's
        refit budget (see :data:`REFIT_BUDGET_FRACTION`). The GPUs with one new sample (the usual
        case) are fed on arrays (:meth:`_add_batch`, :meth:`_add_one_thermal`, the memory-bound
        share); those with several one sample at a time (:meth:`GpuModel.add`, their node's
        thermal samples by time: :meth:`_add_thermal`). Every node's GPUs are one flat sequence
        (:class:`_Flat`, kept while no node changed), read by C-level passes (samples, counts,
        max clocks) instead of a Python loop per node and GPU: ``bench/interval_cost.py``'s
        ``models`` stage (this and :meth:`forget_missing`) at 8,000 GPUs 6.5 -> 2.7 us a GPU, at
        100,000 8.4 -> 3.5 (medians of 3 runs interleaved with the previous code, 2-core host
        shared with other work, 7 Dec 2026; tested equal to the record-by-record models,
        tests/coordinator/test_model_feed.py)."""
        budget_s = max(REFIT_BUDGET_MIN_S, REFIT_BUDGET_PER_GPU_S * len(self.gpus))
        self._refit_budget_s = min(REFIT_BUDGET_FRACTION * interval_s, REFIT_BUDGET_MAX_S, budget_s)
        self._refit_deadline = None  # the budget runs from this interval's first refit
        self._thermal_cache = None
        self._thermal_arrays = None
        entries = self._node_entries(registry, interval_s)
        flat = self._flat
        if flat is None or flat.entries != entries:
            flat = self._flat = _Flat(entries)
        glist = flat.glist
        lists = list(map(_NEW_SAMPLES, glist))  # Registry.take_samples, on the flat sequence (emptied below)
        counts = np.fromiter(map(len, lists), np.int64, len(lists))
        one = counts == 1
        if one.all():
            sel, samples, rows = None, list(map(_FIRST, lists)), flat.rows
        else:
            sel = np.flatnonzero(one)
            samples, rows = list(map(_FIRST, map(lists.__getitem__, sel.tolist()))), flat.rows[sel]
        maxc = np.fromiter(map(_MAX_CLOCK, glist), float, len(glist))
        mem_work = self._add_several(flat, lists, np.flatnonzero(counts > 1), maxc)
        cols = _sample_columns(samples, maxc if sel is None else maxc[sel])
        self._add_batch(flat.fits if sel is None else list(map(flat.fits.__getitem__, sel.tolist())), rows, cols)
        self._add_node_thermal(flat, lists, counts, sel, cols)
        if self.memory_bound_share == "zero":
            self.curve_bank.mem_share[:] = 0.0  # every model's estimate dropped (free rows reset on reuse)
            self.curve_bank.mem_weight[:] = 0.0
        else:
            _update_memory_bound_cols(self.curve_bank, rows, cols)
            if mem_work:
                _update_memory_bound(mem_work)
        # the samples taken: each GPU's list emptied in place (a new list per GPU per interval
        # cost 0.05 us a GPU and 8,000 objects for the collector each interval)
        try:
            collections.deque(map(list.clear, lists), maxlen=0)
        except TypeError:  # samples set as another sequence than a list: replaced
            for g in glist:
                g.new_samples = []

    def _node_entries(self, registry, interval_s: float) -> list:
        """The :class:`_NodeEntry` of every node of ``registry`` (its order): the one kept while the
        node, its GPU records (keys and objects) and its bindings' ``(job_id, gpu_indices)`` are
        unchanged, else a new one (:meth:`_new_entry`). Why: the per-interval signature tuple of
        each node and the lookup of its models cost ~0.6 us a GPU (8,000 GPUs; measured 7 Dec
        2026); two list compares per node stand in for them."""
        cache = self._node_models
        out = []
        for name, node in registry.nodes.items():
            gpus = node.gpus
            bind = [(b.job_id, b.gpu_indices) for b in node.bindings.values()]
            e = cache.get(name)
            if (e is None or e.node is not node or e.bind != bind or e.keys != list(gpus)
                    or e.vals != list(gpus.values())):
                e = cache[name] = self._new_entry(name, node, bind, interval_s)
            out.append(e)
        return out

    def _new_entry(self, node_name: str, node, bind: list, interval_s: float) -> _NodeEntry:
        """``node``'s :class:`_NodeEntry`: its thermal model (a new one when its GPU indices
        changed) and its GPUs' models (:meth:`_node_gpu_models`)."""
        gpus = node.gpus
        indices = tuple(sorted(gpus))
        nt = self.nodes.get(node_name)
        if nt is None or nt.indices != indices:
            if nt is not None:
                nt.bank.release(nt.row)
            nt = NodeThermal(indices, interval_s, self._bank(len(indices)))
            self.nodes[node_name] = nt
        glist = list(map(gpus.__getitem__, indices))
        models = [m for _, m in self._node_gpu_models(node_name, node, indices, glist)]
        return _NodeEntry(node, bind, glist, models, nt)

    def _add_several(self, flat: _Flat, lists: list, several: np.ndarray, maxc: np.ndarray) -> list:
        """:meth:`GpuModel.add` of every sample of the GPUs at positions ``several`` of ``flat``
        (more than one sample each, in ``lists``); returns their memory-bound work
        (``(model, latest sample, max SM clock MHz)`` of those whose latest sample reports a memory
        utilization: :func:`_update_memory_bound`)."""
        work = []
        for i in several.tolist():
            m, mine, mc = flat.models[i], lists[i], flat.glist[i].max_sm_clock_mhz
            for smp in mine:
                m.add(smp, mc)
            if mine[-1][S_MEM] == mine[-1][S_MEM]:  # not NaN
                work.append((m, mine[-1], mc))
        return work

    def _add_node_thermal(self, flat: _Flat, lists: list, counts: np.ndarray, sel, cols: dict) -> None:
        """The nodes' thermal samples: nodes with one sample of every GPU on arrays
        (:meth:`_add_one_thermal`), nodes with a sample of every GPU and several of some by time
        (:func:`_common_times`, :meth:`_add_thermal`); nodes with a GPU without one give none."""
        if not flat.sizes.size:
            return
        low = np.minimum.reduceat(counts, flat.starts)
        high = np.maximum.reduceat(counts, flat.starts)
        single = np.flatnonzero((low == 1) & (high == 1))
        if single.size:  # their samples' positions in cols (contiguous per node)
            pos = flat.starts[single] if sel is None else np.searchsorted(sel, flat.starts[single])
            self._add_one_thermal(flat, single, pos, cols)
        work = []
        for k in np.flatnonzero((low >= 1) & (high > 1)).tolist():
            start = int(flat.starts[k])
            times = _common_times(lists[start:start + int(flat.sizes[k])])
            if times:
                work.append((flat.nts[k], times))
        self._add_thermal(work)

    def _add_one_thermal(self, flat: _Flat, nodes: np.ndarray, pos: np.ndarray, cols: dict) -> None:
        """The thermal samples of the nodes ``nodes`` (positions in ``flat``, one sample of every
        GPU, at positions ``pos`` [k] .. + its size of ``cols``), on arrays: what
        :func:`_common_times` and :meth:`_add_thermal` do with them (a node's samples count when
        they share one time and every temperature is positive and finite; only a time later than
        the node's last), one :meth:`ThermalBank.add` per bank."""
        time_s, temp, power = cols["time_s"], cols["temp_c"], cols["power_w"]
        bank_of = flat.bank_of[nodes]
        for b in np.unique(bank_of).tolist():
            bank = flat.banks[b]
            here = bank_of == b
            nt_rows = flat.nt_rows[nodes[here]]
            slots = pos[here][:, None] + np.arange(bank.n)
            t, tc, pw = time_s[slots], temp[slots], power[slots]
            with np.errstate(invalid="ignore"):
                ok = (t == t[:, :1]).all(axis=1) & (tc > 0).all(axis=1) & np.isfinite(tc).all(axis=1)
            ok &= t[:, 0] > bank.last_t[nt_rows]
            ok = np.flatnonzero(ok)
            if ok.size:
                bank.last_t[nt_rows[ok]] = t[ok, 0]
                bank.add(nt_rows[ok], t[ok, 0], pw[ok], tc[ok])

    def _node_gpu_models(self, node_name: str, node, indices: tuple, glist: list) -> list:
        """``[(key, model)]`` of the GPUs ``indices`` of ``node`` (records ``glist``): a GPU's
        model, a new one for a GPU without one or bound to a new job (a new workload: its curve
        starts again from the prior; a GPU bound to several jobs is the first binding's, gpu_jobs)."""
        job_of = gpu_jobs(node.bindings.values())
        out = []
        held = self._held.setdefault(node_name, set())
        for i, g in zip(indices, glist):
            key = (node_name, i)
            m = self.gpus.get(key)
            job = job_of.get(i, "")
            if m is None or (job and job != m.job_id):
                if m is not None:
                    m.bank.release(m.row)
                m = GpuModel(g.name, g.min_cap_w, g.max_cap_w, bank=self.curve_bank)
                m.job_id = job
                self.gpus[key] = m
                held.add(i)
            out.append((key, m))
        return out

    def _add_batch(self, fits: list, rows_all: np.ndarray, cols: dict) -> None:
        """:meth:`GpuModel.add` of one sample for each GPU of bank rows ``rows_all`` [n] (distinct;
        ``fits`` their curve fits; ``cols`` the samples' columns, :func:`_sample_columns`): the
        rate observations and the anchored scale on arrays, the curve fit's bins per GPU
        (:meth:`OnlineCurveFit.add_binned`). Same state as ``add`` per GPU."""
        n = rows_all.size
        if not n:
            return
        util, enforced, power, clock = (cols[f] for f in ("utilization_pct", "enforced_w", "power_w", "sm_clock_mhz"))
        maxc = cols["max_sm_clock_mhz"]
        cls = _rate_classes(cols["reasons"])
        with np.errstate(divide="ignore", invalid="ignore"):
            capped = (cls == _POWER) & (maxc > 0) & (clock > 0)
            free = (cls == _FREE) & (enforced > 0) & (power < enforced)
            rho = np.where(capped, np.minimum(1.0, clock / np.where(maxc > 0, maxc, 1.0)), 1.0)
        ok = (util >= BUSY_UTILIZATION_PCT) & (capped | free) & np.isfinite(enforced) & (enforced > 0)
        sel = np.nonzero(ok)[0]
        if not sel.size:
            return
        fits = fits if sel.size == n else list(map(fits.__getitem__, sel.tolist()))
        bank = self.curve_bank
        rows_ = rows_all[sel]
        a, k, sat = bank.prior[rows_, 0], bank.prior[rows_, 1], bank.prior[rows_, 2]
        e, p, r = enforced[sel], power[sel], rho[sel]
        # GpuModel.observe_cap of each, its checks on arrays: the 1 W bin int(round(e)) (both round
        # half to even), at or above the prior's valid_min_w (the curve fit's prior is the model's)
        bins = np.rint(e).astype(np.int64)
        in_range = (e >= bank.prior[rows_, 3]).tolist()
        new = OnlineCurveFit.add_binned(fits, bins.tolist(), r.tolist(), in_range)
        _new_caps_batch(bank, rows_, bins, new)
        with np.errstate(divide="ignore", invalid="ignore"):
            ref = sat - k * np.log1p((1.0 - r) / a)  # cap_for_rate
            s = np.where(r < 1.0, np.where(ref > 0, e / ref, np.nan),
                         np.where((p > 0) & (sat > 0), p / sat, np.nan))
        good = np.isfinite(s)
        if not good.any():
            return
        idx = rows_[good]
        decay = 0.5 ** (1.0 / SCALE_HALF_LIFE)
        bank.scale_sum[idx] = bank.scale_sum[idx] * decay + np.clip(s[good], SCALE_RANGE[0], SCALE_RANGE[1])
        bank.scale_wt[idx] = bank.scale_wt[idx] * decay + 1.0

    def _bank(self, n_gpus: int) -> ThermalBank:
        bank = self._banks.get(n_gpus)
        if bank is None:
            bank = self._banks[n_gpus] = ThermalBank(n_gpus)
        return bank

    def _add_thermal(self, work: list) -> None:
        """Feed ``(NodeThermal, [(time s, powers W, temps °C), ...])`` pairs to their banks: round
        r takes every node's r-th new time, one batched :meth:`ThermalBank.add` per bank."""
        r = 0
        while work:
            by_bank: dict = {}
            for nt, times in work:
                t, power, temp = times[r]
                if nt.accepts(t, power, temp):
                    nt.last_t = t
                    by_bank.setdefault(id(nt.bank), (nt.bank, []))[1].append((nt.row, t, power, temp))
            for bank, rows in by_bank.values():
                bank.add(np.fromiter((x[0] for x in rows), np.int64, len(rows)),
                         np.fromiter((x[1] for x in rows), float, len(rows)),
                         np.array([x[2] for x in rows], float), np.array([x[3] for x in rows], float))
            r += 1
            work = [w for w in work if len(w[1]) > r]

    def curve(self, key: tuple[str, int]) -> CurveParams | None:
        """Current rate curve of a GPU (None if unknown)."""
        m = self.gpus.get(key)
        if m is None:
            return None
        if not m._full_fit_ready():
            return _with_memory_bound(m, m._anchored())  # what m.curve() returns then, without reading the clocks
        n = m.refits
        deadline = self._deadline()  # (before the budget clock is read: a first refit opens it)
        c = m.curve(self._clock(), allow_refit=self._budget_clock() < deadline, rng=self._rng)
        self.refits += m.refits - n
        return _with_memory_bound(m, c)

    def _deadline(self) -> float:
        """The end of this interval's refit budget on the budget clock (s): it runs from the
        interval's first refit (the samples' update and the solver inputs before it not counted)."""
        if self._refit_deadline is None:
            self._refit_deadline = self._budget_clock() + self._refit_budget_s
        return self._refit_deadline

    def _refit_due(self, due: list) -> None:
        """Refit the models ``due`` (in order; each one :meth:`GpuModel.refit_wanted` would refit:
        :meth:`curve_arrays`' due mask, the same rule on arrays)
        in batches (:func:`capctl.allocator.batchfit.fit_curves`, at most :data:`REFIT_BATCH`, as
        many as the budget left pays for at the measured cost per fit) while this interval's
        refit budget lasts; the models left over keep their last fit until a later interval."""
        now = self._clock()
        todo = list(due)
        first = self._refit_deadline is None  # (no batch yet this interval: at least one fit)
        while todo:
            deadline = self._deadline()
            t0 = self._budget_clock()
            size = self._fit_cost.size(deadline - t0, REFIT_BATCH, first) if t0 < deadline else 0
            if not size:
                break  # this interval's refit budget is spent (or cannot pay for another batch)
            first = False
            batch = todo[:size]
            del todo[:size]
            problems = [m.begin_refit(now, self._rng) for m in batch]
            fitted = [p for p in problems if p is not None]
            fits = iter(fit_curves(fitted) if fitted else ())
            for m, p in zip(batch, problems):
                n = m.refits
                m.finish_refit(p, next(fits) if p is not None else None)
                self.refits += m.refits - n
            if fitted:  # (the simulator's budget clock: its charge)
                self._fit_cost.observe(len(fitted), self._budget_clock() - t0)

    def memory_bound(self, key: tuple[str, int]) -> float | None:
        """The GPU's smoothed memory-bound share of a step (0-0.9, :mod:`coordinator.membound`), or
        None when it has none (no memory utilization reported since its job started)."""
        m = self.gpus.get(key)
        return m.mem_share if m is not None and m.mem_weight > 0 else None

    def memory_bounds(self) -> dict[tuple[str, int], float]:
        """GPU key -> :meth:`memory_bound` of every GPU that has an estimate."""
        bank = self.curve_bank
        keys = list(self.gpus)
        rows = np.fromiter(map(_ROW, self.gpus.values()), np.int64, len(keys))
        has = np.flatnonzero(bank.mem_weight[rows] > 0)  # (on arrays: two numpy reads per GPU cost 0.37 us)
        return dict(zip(map(keys.__getitem__, has.tolist()), bank.mem_share[rows[has]].tolist()))

    def curve_arrays(self, keys) -> "CurveColumns":
        """The current rate curve of every GPU of ``keys`` as arrays (:class:`CurveColumns`),
        element-wise what :meth:`curve` returns: the prior-anchored curves and the learned fits
        read from the :class:`CurveBank`; only GPUs due for a refit are refitted (refit budget,
        throttle and jitter as :meth:`curve`; batched, :meth:`_refit_due`), the least recently
        refitted first (in ``keys`` order among equals): with more GPUs due than the budget pays
        for, every GPU still gets its turn; an unknown key: the allocator's default H100 curve
        (what a None curve means to it)."""
        gpus = self.gpus
        n = len(keys)
        bank = self.curve_bank
        models = list(map(gpus.get, keys))
        rows = np.fromiter(((m.row if m is not None else -1) for m in models), np.int64, n)
        known = rows >= 0
        rows = np.where(known, rows, 0)
        share = np.where(known & (bank.mem_weight[rows] > 0), bank.mem_share[rows], 0.0)
        ready = bank.ready[rows] & known
        wt = bank.scale_wt[rows]
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(wt > 0, bank.scale_sum[rows] / np.where(wt > 0, wt, 1.0), 1.0)
            moved = np.abs(scale / bank.scale_at_fit[rows] - 1.0) > REFIT_SCALE_MOVE
        learned = bank.learned[rows]
        due = ready & (~learned | (bank.new_caps[rows] >= REFIT_NEW_CAPS) | moved)
        due &= (self._clock() - bank.refit_mono[rows]) >= CURVE_REFIT_S if due.any() else due
        if due.any():  # the least recently refitted first (never refitted: -inf), so none starves
            idx = np.nonzero(due)[0]
            idx = idx[np.argsort(bank.refit_mono[rows[idx]], kind="stable")]
            self._refit_due([models[i] for i in idx.tolist()])
        learned = bank.learned[rows] & ready
        priors = np.where(known, bank.prior_obj[rows], None)
        d = DEFAULT_CURVES["H100"]  # an unknown GPU's curve in the allocator (None)
        params = np.where(known[:, None], bank.prior[rows], (d.a, d.k_w, d.sat_w, d.valid_min_w)).T.copy()
        anchored = known & ~learned
        params[1] = np.where(anchored, params[1] * scale, params[1])
        params[2] = np.where(anchored, params[2] * scale, params[2])
        if learned.any():
            fit = bank.fit[rows[learned]]
            for j in range(4):
                params[j][learned] = fit[:, j]
        mem = share > 0.0  # the memory-bound hook (_with_memory_bound), on arrays
        if mem.any():
            params[0] = np.where(mem & known, params[0] * membound.curve_slope_factor(share), params[0])
        return CurveColumns(a=params[0], k_w=params[1], sat_w=params[2], valid_min_w=params[3], scale=scale,
                            priors=priors, learned=learned, fit=bank.fit[rows] if learned.any() else None,
                            mem_share=np.where(known, share, 0.0) if mem.any() else None)

    def thermal_arrays(self, topology, skip=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(r_c_per_w, tau_s, inlet_c)`` [G] (°C/W, s, °C) of the GPU slots of ``topology``
        (``(node, (indices...))`` in slot order; :meth:`thermal` per node, as arrays); NaN where a
        node has no thermal model or ``skip[node position]`` is true."""
        G = sum(len(ix) for _, ix in topology)
        out = np.full((3, G), np.nan)
        if self._thermal_arrays is None:
            self._thermal_arrays = {id(b): np.stack(b.params(np.arange(b.rows))) for b in self._banks.values()}
        per_bank: dict = {}
        start = 0
        for j, (name, indices) in enumerate(topology):
            nt = self.nodes.get(name)
            if nt is not None and not (skip is not None and skip[j]):
                if nt.indices == indices and id(nt.bank) in self._thermal_arrays:
                    per_bank.setdefault(id(nt.bank), ([], []))
                    per_bank[id(nt.bank)][0].append(nt.row)
                    per_bank[id(nt.bank)][1].append(start)
                else:  # GPUs changed since the last update: by index, as thermal() does
                    th = self.thermal(name)
                    for p, idx in enumerate(indices):
                        if idx in th:
                            out[:, start + p] = th[idx]
            start += len(indices)
        for bid, (rows, starts) in per_bank.items():
            arr = self._thermal_arrays[bid]  # [3, rows, n]
            n = arr.shape[2]
            slots = np.asarray(starts, np.int64)[:, None] + np.arange(n)
            out[:, slots] = arr[:, np.asarray(rows, np.int64)]
        return out[0], out[1], out[2]

    def curve_kind(self, key: tuple[str, int]) -> str:
        """:attr:`GpuModel.kind` of a GPU ("" if unknown)."""
        m = self.gpus.get(key)
        return m.kind if m is not None else ""

    def curve_kinds(self, keys) -> dict[tuple[str, int], str]:
        """GPU key -> :meth:`curve_kind` for every key of ``keys``."""
        gpus = self.gpus
        out = {}
        for k in keys:
            m = gpus.get(k)
            # GpuModel.kind, inlined (one call per GPU per interval saved)
            out[k] = "" if m is None else "learned" if m._cached is not m.prior else "prior" if m.known else "generic"
        return out

    def thermal(self, node: str) -> dict[int, tuple[float, float, float]]:
        """GPU index -> (R °C/W, tau s, inlet °C) for ``node`` (empty if unknown). The parameters
        of every node are computed at once, on the first call after :meth:`update`."""
        nt = self.nodes.get(node)
        if nt is None:
            return {}
        if self._thermal_cache is None:
            self._thermal_cache = {id(b): tuple(a.tolist() for a in b.params(np.arange(b.rows)))
                                   for b in self._banks.values()}
        hit = self._thermal_cache.get(id(nt.bank))
        if hit is None or nt.row >= len(hit[0]):
            return nt.params()
        r, tau, inlet = hit[0][nt.row], hit[1][nt.row], hit[2][nt.row]
        return {idx: (r[i], tau[i], inlet[i]) for i, idx in enumerate(nt.indices)}

    def forget_missing(self, registry) -> None:
        """Drop models of GPUs no longer known to the registry (per node: the GPU indices with a
        model against the node's, one set compare; a per-GPU key test cost 0.25 us a GPU, 8,000
        GPUs, 7 Dec 2026)."""
        nodes = registry.nodes
        for name, held in list(self._held.items()):
            node = nodes.get(name)
            if node is not None and held == node.gpus.keys():
                continue
            gone = held.difference(node.gpus) if node is not None else held
            if node is None:
                del self._held[name]
            if gone:
                for i in list(gone):
                    m = self.gpus.pop((name, i))
                    m.bank.release(m.row)
                    held.discard(i)
                self._node_models.pop(name, None)
        for name in [n for n in self._node_models if n not in nodes]:
            del self._node_models[name]
        for name in [n for n in self.nodes if n not in nodes]:
            nt = self.nodes.pop(name)
            nt.bank.release(nt.row)
        self._thermal_cache = None
        self._thermal_arrays = None
