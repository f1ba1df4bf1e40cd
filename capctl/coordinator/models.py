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
average, close enough to the average over the interval for intervals of seconds).

The curve prior is the allocator's default for the device's model (:data:`DEFAULT_CURVES`,
matched in the NVML product name); unknown products get the A40 curve mapped affinely onto the
device's limit constraints (as the allocator does for H100/A100).
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
    if any("THERMAL" in r for r in reasons):
        return None
    if any("POWER" in r for r in reasons):
        if max_sm_clock_mhz <= 0 or sample.sm_clock_mhz <= 0:
            return None
        return min(1.0, sample.sm_clock_mhz / max_sm_clock_mhz)
    if sample.enforced_w > 0 and sample.power_w < sample.enforced_w:
        return 1.0
    return None


CURVE_REFIT_S = 10.0
"""A GPU's rate curve is refitted (scipy least squares, a few ms) at most this often, seconds."""


class GpuModel:
    """Online curve of one GPU (W -> relative rate)."""

    def __init__(self, product_name: str, min_cap_w: float, max_cap_w: float) -> None:
        self.prior = prior_curve(product_name, min_cap_w, max_cap_w)
        self.curve_fit = OnlineCurveFit(self.prior)
        self._failed = False
        self._cached = self.prior
        self._refit_mono = -math.inf

    def add(self, sample, max_sm_clock_mhz: float) -> None:
        """Feed one telemetry sample."""
        rho = rate_observation(sample, max_sm_clock_mhz)
        if rho is not None and math.isfinite(sample.enforced_w):
            self.curve_fit.add(sample.enforced_w, rho)

    def curve(self, now_mono: float | None = None, allow_refit: bool = True) -> CurveParams:
        """The current fit, refitted at most every :data:`CURVE_REFIT_S` (and only when
        ``allow_refit``); the last good fit (or the prior) if a refit fails."""
        now = time.monotonic() if now_mono is None else now_mono
        if not allow_refit or now - self._refit_mono < CURVE_REFIT_S:
            return self._cached
        # the next refit comes 0.8-1.2 periods later: refits of many GPUs spread over intervals
        self._refit_mono = now + random.uniform(-0.2, 0.2) * CURVE_REFIT_S
        try:
            self._cached = self.curve_fit.params()
        except (ValueError, FloatingPointError, np.linalg.LinAlgError) as exc:
            if not self._failed:
                log.warning("rate curve refit failed (%s); keeping the last fit", exc)
                self._failed = True
        return self._cached


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

    def __init__(self) -> None:
        self.gpus: dict[tuple[str, int], GpuModel] = {}
        self.nodes: dict[str, NodeThermal] = {}
        self._refit_deadline = 0.0

    def update(self, registry, interval_s: float) -> None:
        """Consume the samples the registry gathered since the last call; opens this interval's
        refit budget (see :data:`REFIT_BUDGET_FRACTION`)."""
        self._refit_deadline = time.perf_counter() + min(REFIT_BUDGET_FRACTION * interval_s, REFIT_BUDGET_MAX_S)
        samples = registry.take_samples()
        for node_name, node in registry.nodes.items():
            indices = tuple(sorted(node.gpus))
            nt = self.nodes.get(node_name)
            if nt is None or nt.indices != indices:
                nt = NodeThermal(indices, interval_s)
                self.nodes[node_name] = nt
            per_gpu = [samples.get((node_name, i), []) for i in indices]
            for i in indices:
                g = node.gpus[i]
                key = (node_name, i)
                m = self.gpus.get(key)
                if m is None:
                    m = GpuModel(g.name, g.min_cap_w, g.max_cap_w)
                    self.gpus[key] = m
                for s in samples.get(key, ()):
                    m.add(s, g.max_sm_clock_mhz)
            # thermal: samples arrive together per telemetry message; align by position
            n = min((len(s) for s in per_gpu), default=0)
            for k in range(n):
                nt.add(per_gpu[0][k].time_s, [s[k].power_w for s in per_gpu], [s[k].temp_c for s in per_gpu])

    def curve(self, key: tuple[str, int]) -> CurveParams | None:
        """Current rate curve of a GPU (None if unknown)."""
        m = self.gpus.get(key)
        return m.curve(allow_refit=time.perf_counter() < self._refit_deadline) if m else None

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
