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

Clocks: :class:`Models` takes the clocks it reads (``clock``: refit throttle, default
``time.monotonic``; ``budget_clock``: the per-interval refit budget, default
``time.perf_counter``) and the random source of the refit jitter, so an in-process user (the
what-if simulator) can run it on simulated time, deterministically. The daemon keeps the defaults.
"""

from __future__ import annotations

import logging
import math
import random
import time

import numpy as np

from capctl.allocator.curves import DEFAULT_CURVES, CurveParams, OnlineCurveFit
from capctl.allocator.thermal import THERMAL_PRIOR
from coordinator import membound

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
    """Relative rate observed in one telemetry sample (see module docstring), or None."""
    if sample.utilization_pct < BUSY_UTILIZATION_PCT:
        return None
    cls = _rate_class(sample.reasons if isinstance(sample.reasons, tuple) else tuple(sample.reasons))
    if cls == _SLOWED:
        return None  # the clock is set by a slowdown (thermal, HW): it says nothing of the cap
    if cls == _POWER:
        if max_sm_clock_mhz <= 0 or sample.sm_clock_mhz <= 0:
            return None
        return min(1.0, sample.sm_clock_mhz / max_sm_clock_mhz)
    if sample.enforced_w > 0 and sample.power_w < sample.enforced_w:
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


class GpuModel:
    """Online curve of one GPU (W -> relative rate): prior-anchored scale, then the full fit."""

    def __init__(self, product_name: str, min_cap_w: float, max_cap_w: float) -> None:
        self.prior = prior_curve(product_name, min_cap_w, max_cap_w)
        self.known = known_product(product_name)
        self.curve_fit = OnlineCurveFit(self.prior)
        self._failed = False
        self._cached = self.prior
        self._refit_mono = -math.inf
        self._caps: set[int] = set()
        self._new_caps = 0  # distinct caps first seen since the last refit
        self._scale_sum = 0.0
        self._scale_wt = 0.0
        self._scaled: CurveParams | None = None
        self._decay = 0.5 ** (1.0 / SCALE_HALF_LIFE)
        self._scale_at_fit = 1.0
        self._ready = False  # _full_fit_ready() once true stays true (caps are only added)
        self.refits = 0
        self.job_id = ""  # the job whose samples this model holds ("" = none yet)
        # memory-bound share of this job's step (coordinator.membound; Models.update keeps it):
        # smoothed estimate and its sample weight; 0 / 0 = none (the curve as before)
        self.mem_share = 0.0
        self.mem_weight = 0.0
        self.mem_curve: tuple | None = None  # (clock curve, share, rate curve) of the last call

    def add(self, sample, max_sm_clock_mhz: float) -> None:
        """Feed one telemetry sample."""
        rho = rate_observation(sample, max_sm_clock_mhz)
        if rho is None or not (math.isfinite(sample.enforced_w) and sample.enforced_w > 0):
            return  # no reading (zeros) is no observation
        self.curve_fit.add(sample.enforced_w, rho)
        b = int(round(sample.enforced_w))
        if b not in self._caps and sample.enforced_w >= self.prior.valid_min_w:
            self._caps.add(b)
            self._new_caps += 1
            self._ready = False
        p = self.prior
        if rho < 1.0:
            ref = p.sat_w - p.k_w * math.log1p((1.0 - rho) / p.a)  # cap_for_rate, scalar
            s = sample.enforced_w / ref if ref > 0 else math.nan
        else:
            s = sample.power_w / p.sat_w if sample.power_w > 0 and p.sat_w > 0 else math.nan
        if math.isfinite(s):
            s = min(max(s, SCALE_RANGE[0]), SCALE_RANGE[1])
            self._scale_sum = self._scale_sum * self._decay + s
            self._scale_wt = self._scale_wt * self._decay + 1.0
            self._scaled = None

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
        return self._scale_sum / self._scale_wt if self._scale_wt > 0 else 1.0

    def _full_fit_ready(self) -> bool:
        if not self._ready:
            caps = self._caps
            self._ready = len(caps) >= FULL_FIT_MIN_CAPS and max(caps) - min(caps) >= FULL_FIT_MIN_SPAN_W
        return self._ready

    def _anchored(self) -> CurveParams:
        if self._scaled is None:
            s = self.scale
            p = self.prior
            self._scaled = p if s == 1.0 else CurveParams(
                p.a, p.k_w * s, p.sat_w * s, p.valid_min_w, p.fit_rmse, p.fit_max_err,
                f"prior scaled x{s:.3f} in power")
        return self._scaled

    def curve(self, now_mono: float | None = None, allow_refit: bool = True, rng=random) -> CurveParams:
        """The current curve: the prior-anchored scaled prior until the full fit is usable, then the
        full fit, refitted at most every :data:`CURVE_REFIT_S` (``now_mono``, default
        ``time.monotonic()``), only when ``allow_refit`` and when new caps were observed; the last
        good fit if a refit fails. ``rng``: source of the refit jitter (``random.uniform``)."""
        if not self._full_fit_ready():
            return self._anchored()
        now = time.monotonic() if now_mono is None else now_mono
        moved = abs(self.scale / self._scale_at_fit - 1.0) > REFIT_SCALE_MOVE
        if self._cached is not self.prior and not (self._new_caps >= REFIT_NEW_CAPS or moved):
            return self._cached  # nothing new to fit: skip the scipy refit (ms of CPU)
        if not allow_refit or now - self._refit_mono < CURVE_REFIT_S:
            return self._cached if self._cached is not self.prior else self._anchored()
        # the next refit comes 0.8-1.2 periods later: refits of many GPUs spread over intervals
        self._refit_mono = now + rng.uniform(-0.2, 0.2) * CURVE_REFIT_S
        self._new_caps = 0
        self._scale_at_fit = self.scale
        # regularize toward this GPU's anchored prior, not the model's (a part needing 1.4x the
        # power would otherwise be pulled back to the nominal curve)
        self.curve_fit.prior = self._anchored()
        try:
            self._cached = self.curve_fit.params()
            self.refits += 1
        except (ValueError, FloatingPointError, np.linalg.LinAlgError) as exc:
            if not self._failed:
                log.warning("rate curve refit failed (%s); keeping the last fit", exc)
                self._failed = True
        return self._cached if self._cached is not self.prior else self._anchored()


class ThermalBank:
    """The RLS thermal estimates of many nodes with ``n_gpus`` GPUs each, as arrays (one row per
    node): the arithmetic of :class:`capctl.allocator.thermal.OnlineThermalFit` (same model,
    prior, forgetting factor 0.995, prior strength 1e-2, dt screening, bounds), batched over nodes
    so that one interval's samples of all nodes are one update. Row ``r`` after the same samples
    equals an ``OnlineThermalFit(n_gpus, nominal_interval_s=...)`` fed them (tested to 1e-9).

    Shapes: ``theta`` [rows, G, 3] (alpha, beta, gamma), ``cov`` [rows, G, 3, 3]; per row the
    previous sample time (s, NaN: none), temperatures (°C), the dt statistics (s)."""

    FORGET = 0.995
    PRIOR_STRENGTH = 1e-2

    def __init__(self, n_gpus: int) -> None:
        self.n = int(n_gpus)
        self.rows = 0
        self.free: list[int] = []
        self._alloc(16)

    def _alloc(self, cap: int) -> None:
        old = self.rows and (self.theta, self.cov, self.prev_t, self.prev_temp, self.dt_sum, self.dt_n, self.dt_s)
        G = self.n
        self.theta = np.zeros((cap, G, 3))
        self.cov = np.zeros((cap, G, 3, 3))
        self.prev_t = np.full(cap, np.nan)
        self.prev_temp = np.zeros((cap, G))
        self.dt_sum = np.zeros(cap)
        self.dt_n = np.zeros(cap, np.int64)
        self.dt_s = np.zeros(cap)
        if old:
            for new, prev in zip((self.theta, self.cov, self.prev_t, self.prev_temp, self.dt_sum, self.dt_n,
                                  self.dt_s), old):
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
                theta[upd] += gain[upd] * err[upd][:, None]
                newcov = (cov - gain[..., :, None] * px[..., None, :]) / self.FORGET
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
        self.last_t = -math.inf

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
"""Curve refits of one interval stop after this fraction of the interval (at most
:data:`REFIT_BUDGET_MAX_S`); the GPUs left over keep their last fit until a later interval."""
REFIT_BUDGET_MAX_S = 0.1


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
    mem = np.fromiter((w[1].memory_utilization_pct for w in work), float, n)
    util = np.fromiter((w[1].utilization_pct for w in work), float, n)
    ratio = np.fromiter((w[1].sm_clock_mhz / w[2] if w[2] > 0 else np.nan for w in work), float, n)
    mean, weight = membound.smooth(np.fromiter((w[0].mem_share for w in work), float, n),
                                   np.fromiter((w[0].mem_weight for w in work), float, n),
                                   membound.sample_share(mem, util, ratio))
    for (model, _, _), m_i, w_i in zip(work, mean.tolist(), weight.tolist()):
        model.mem_share = m_i
        model.mem_weight = w_i


def _common_times(per_gpu: list) -> list[tuple[float, list[float], list[float]]]:
    """The thermal samples of one node: ``(time s, powers W, temps °C)`` for each telemetry time
    at which every GPU has a valid sample with a temperature (sorted). The samples of one
    telemetry message share its arrival time; a GPU without a reading, or without a temperature,
    gives none at that time, so the fit never learns from zeros."""
    if all(len(x) == 1 for x in per_gpu):  # the usual case: one report per interval
        t = per_gpu[0][0].time_s
        if all(x[0].time_s == t and x[0].temp_c > 0 and math.isfinite(x[0].temp_c) for x in per_gpu):
            return [(t, [x[0].power_w for x in per_gpu], [x[0].temp_c for x in per_gpu])]
    by_time = [{smp.time_s: smp for smp in samples_i if smp.temp_c > 0 and math.isfinite(smp.temp_c)}
               for samples_i in per_gpu]
    common = sorted(set(by_time[0]).intersection(*by_time[1:]))
    return [(t, [m[t].power_w for m in by_time], [m[t].temp_c for m in by_time]) for t in common]


class Models:
    """All online models of the cluster, keyed by ``(node, index)`` / node name."""

    def __init__(self, clock=time.monotonic, budget_clock=time.perf_counter, rng=None) -> None:
        """``clock``: seconds for the refit throttle; ``budget_clock``: seconds for the
        per-interval refit budget; ``rng``: a ``random.Random`` for the refit jitter (default: the
        ``random`` module). The daemon uses the defaults; the what-if simulator passes simulated
        clocks and a seeded ``random.Random`` (deterministic runs)."""
        self.gpus: dict[tuple[str, int], GpuModel] = {}
        self.nodes: dict[str, NodeThermal] = {}
        self._banks: dict[int, ThermalBank] = {}  # GPUs per node -> the thermal rows of such nodes
        self._thermal_cache = None  # per interval: bank id -> (r, tau, inlet) of all its rows
        self._refit_deadline = 0.0
        self._clock = clock
        self._budget_clock = budget_clock
        self._rng = rng if rng is not None else random
        self.refits = 0
        """Full (3-parameter) curve refits done so far."""

    def update(self, registry, interval_s: float) -> None:
        """Consume the samples the registry gathered since the last call; opens this interval's
        refit budget (see :data:`REFIT_BUDGET_FRACTION`). The thermal samples of all nodes go
        into their :class:`ThermalBank` in one batched update per bank and round."""
        self._refit_deadline = self._budget_clock() + min(REFIT_BUDGET_FRACTION * interval_s, REFIT_BUDGET_MAX_S)
        self._thermal_cache = None
        samples = registry.take_samples()
        thermal_work = []
        mem_work = []  # (GpuModel, its latest sample with a memory utilization, max SM clock MHz)
        for node_name, node in registry.nodes.items():
            indices = tuple(sorted(node.gpus))
            nt = self.nodes.get(node_name)
            if nt is None or nt.indices != indices:
                if nt is not None:
                    nt.bank.release(nt.row)
                nt = NodeThermal(indices, interval_s, self._bank(len(indices)))
                self.nodes[node_name] = nt
            per_gpu = [samples.get((node_name, i), ()) for i in indices]
            job_of = {i: b.job_id for b in node.bindings.values() for i in b.gpu_indices}
            gpus = node.gpus
            for i, mine in zip(indices, per_gpu):
                g = gpus[i]
                key = (node_name, i)
                m = self.gpus.get(key)
                job = job_of.get(i, "")
                if m is None or (job and job != m.job_id):
                    # a new job is a new workload: its curve starts again from the prior
                    m = GpuModel(g.name, g.min_cap_w, g.max_cap_w)
                    m.job_id = job
                    self.gpus[key] = m
                for smp in mine:
                    m.add(smp, g.max_sm_clock_mhz)
                if mine and mine[-1].memory_utilization_pct == mine[-1].memory_utilization_pct:  # not NaN
                    mem_work.append((m, mine[-1], g.max_sm_clock_mhz))
            if per_gpu and all(per_gpu):
                times = _common_times(per_gpu)
                if times:
                    thermal_work.append((nt, times))
        self._add_thermal(thermal_work)
        if mem_work:
            _update_memory_bound(mem_work)

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
        c = m.curve(self._clock(), allow_refit=self._budget_clock() < self._refit_deadline, rng=self._rng)
        self.refits += m.refits - n
        return _with_memory_bound(m, c)

    def memory_bound(self, key: tuple[str, int]) -> float | None:
        """The GPU's smoothed memory-bound share of a step (0-0.9, :mod:`coordinator.membound`), or
        None when it has none (no memory utilization reported since its job started)."""
        m = self.gpus.get(key)
        return m.mem_share if m is not None and m.mem_weight > 0 else None

    def memory_bounds(self) -> dict[tuple[str, int], float]:
        """GPU key -> :meth:`memory_bound` of every GPU that has an estimate."""
        return {k: m.mem_share for k, m in self.gpus.items() if m.mem_weight > 0}

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
        """Drop models of GPUs no longer known to the registry."""
        for key in [k for k in self.gpus if k[0] not in registry.nodes or k[1] not in registry.nodes[k[0]].gpus]:
            del self.gpus[key]
        for name in [n for n in self.nodes if n not in registry.nodes]:
            nt = self.nodes.pop(name)
            nt.bank.release(nt.row)
        self._thermal_cache = None
