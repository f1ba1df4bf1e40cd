"""Per-GPU online models: the power->rate curve and the thermal (R, tau, inlet) model.

Both estimators are the allocator's (:class:`capctl.allocator.curves.OnlineCurveFit`,
:class:`capctl.allocator.thermal.OnlineThermalFit`); this module only turns telemetry samples into
their observations.

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
from capctl.allocator.thermal import OnlineThermalFit

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


def rate_observation(sample, max_sm_clock_mhz: float) -> float | None:
    """Relative rate observed in one telemetry sample (see module docstring), or None."""
    if sample.utilization_pct < BUSY_UTILIZATION_PCT:
        return None
    reasons = [r.upper() for r in sample.reasons]
    if any("THERMAL" in r or "SLOWDOWN" in r for r in reasons):
        return None  # the clock is set by a slowdown (thermal, HW): it says nothing of the cap
    if any("POWER" in r for r in reasons):
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
        self.refits = 0
        self.job_id = ""  # the job whose samples this model holds ("" = none yet)

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
        return len(self._caps) >= FULL_FIT_MIN_CAPS and max(self._caps) - min(self._caps) >= FULL_FIT_MIN_SPAN_W

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


class NodeThermal:
    """Thermal model of one node's GPUs (one :class:`OnlineThermalFit` over its GPU indices)."""

    def __init__(self, indices: tuple[int, ...], interval_s: float) -> None:
        self.indices = indices
        self.fit = OnlineThermalFit(len(indices), nominal_interval_s=interval_s)
        self.last_t = -math.inf

    def add(self, time_s: float, power_w: list[float], temp_c: list[float]) -> None:
        """One sample per GPU (in ``indices`` order); out-of-order samples are ignored."""
        if time_s <= self.last_t:
            return
        self.last_t = time_s
        try:
            self.fit.add(time_s, np.asarray(power_w, float), np.asarray(temp_c, float))
        except ValueError as exc:
            log.debug("thermal sample ignored: %s", exc)

    def params(self) -> dict[int, tuple[float, float, float]]:
        """GPU index -> (r_c_per_w °C/W, tau_s s, inlet_c °C)."""
        r, tau, inlet = self.fit.params()
        return {idx: (float(r[i]), float(tau[i]), float(inlet[i])) for i, idx in enumerate(self.indices)}


REFIT_BUDGET_FRACTION = 0.1
"""Curve refits of one interval stop after this fraction of the interval (at most
:data:`REFIT_BUDGET_MAX_S`); the GPUs left over keep their last fit until a later interval."""
REFIT_BUDGET_MAX_S = 0.1


class Models:
    """All online models of the cluster, keyed by ``(node, index)`` / node name."""

    def __init__(self, clock=time.monotonic, budget_clock=time.perf_counter, rng=None) -> None:
        """``clock``: seconds for the refit throttle; ``budget_clock``: seconds for the
        per-interval refit budget; ``rng``: a ``random.Random`` for the refit jitter (default: the
        ``random`` module). The daemon uses the defaults; the what-if simulator passes simulated
        clocks and a seeded ``random.Random`` (deterministic runs)."""
        self.gpus: dict[tuple[str, int], GpuModel] = {}
        self.nodes: dict[str, NodeThermal] = {}
        self._refit_deadline = 0.0
        self._clock = clock
        self._budget_clock = budget_clock
        self._rng = rng if rng is not None else random
        self.refits = 0
        """Full (3-parameter) curve refits done so far."""

    def update(self, registry, interval_s: float) -> None:
        """Consume the samples the registry gathered since the last call; opens this interval's
        refit budget (see :data:`REFIT_BUDGET_FRACTION`)."""
        self._refit_deadline = self._budget_clock() + min(REFIT_BUDGET_FRACTION * interval_s, REFIT_BUDGET_MAX_S)
        samples = registry.take_samples()
        for node_name, node in registry.nodes.items():
            indices = tuple(sorted(node.gpus))
            nt = self.nodes.get(node_name)
            if nt is None or nt.indices != indices:
                nt = NodeThermal(indices, interval_s)
                self.nodes[node_name] = nt
            per_gpu = [samples.get((node_name, i), []) for i in indices]
            job_of = {i: b.job_id for b in node.bindings.values() for i in b.gpu_indices}
            for i in indices:
                g = node.gpus[i]
                key = (node_name, i)
                m = self.gpus.get(key)
                job = job_of.get(i, "")
                if m is None or (job and job != m.job_id):
                    # a new job is a new workload: its curve starts again from the prior
                    m = GpuModel(g.name, g.min_cap_w, g.max_cap_w)
                    m.job_id = job
                    self.gpus[key] = m
                for s in samples.get(key, ()):
                    m.add(s, g.max_sm_clock_mhz)
            # thermal: the samples of one telemetry message share its arrival time; a time is
            # used only when every GPU of the node has a valid sample then (a GPU without a
            # reading, or without a temperature, gives none: the fit never learns from zeros)
            if per_gpu and all(per_gpu):
                by_time = [{s.time_s: s for s in samples_i if s.temp_c > 0 and math.isfinite(s.temp_c)}
                           for samples_i in per_gpu]
                common = sorted(set(by_time[0]).intersection(*by_time[1:]))
                for t in common:
                    nt.add(t, [m[t].power_w for m in by_time], [m[t].temp_c for m in by_time])

    def curve(self, key: tuple[str, int]) -> CurveParams | None:
        """Current rate curve of a GPU (None if unknown)."""
        m = self.gpus.get(key)
        if m is None:
            return None
        n = m.refits
        c = m.curve(self._clock(), allow_refit=self._budget_clock() < self._refit_deadline, rng=self._rng)
        self.refits += m.refits - n
        return c

    def curve_kind(self, key: tuple[str, int]) -> str:
        """:attr:`GpuModel.kind` of a GPU ("" if unknown)."""
        m = self.gpus.get(key)
        return m.kind if m is not None else ""

    def thermal(self, node: str) -> dict[int, tuple[float, float, float]]:
        """GPU index -> (R °C/W, tau s, inlet °C) for ``node`` (empty if unknown)."""
        nt = self.nodes.get(node)
        return nt.params() if nt else {}

    def forget_missing(self, registry) -> None:
        """Drop models of GPUs no longer known to the registry."""
        for key in [k for k in self.gpus if k[0] not in registry.nodes or k[1] not in registry.nodes[k[0]].gpus]:
            del self.gpus[key]
        for name in [n for n in self.nodes if n not in registry.nodes]:
            del self.nodes[name]
