"""Memory-bound share of a GPU's synchronous step, estimated from NVML's utilization rates.

Pure functions, arrays in, arrays out (NumPy, elementwise; scalars work too). No I/O, no state:
the caller (:class:`coordinator.models.Models`) keeps each GPU's smoothed estimate.

Model: the step-time model of DVFS performance with one frequency-insensitive part (the "beta"
model: C.-H. Hsu and W. Feng, "A Power-Aware Run-Time System for High-Performance Computing",
SC'05; the simulated driver's step-time model, csrc/simnvml/physics.c, is the same). At SM clock
ratio ``r = f / f_max`` a step takes ``T(r) = T(1) * (m + (1 - m) / r)``: a share ``m`` (memory-bound
at max clock) does not scale with the SM clock, the rest does. The step rate relative to max clock
is therefore ``rho(r) = 1 / (m + (1 - m) / r)`` (:func:`rate_of_clock`; ``rho = r`` when ``m = 0``,
the compute-bound case capctl assumed before).

Estimate (:func:`sample_share`): NVML's ``nvmlDeviceGetUtilizationRates`` (NVML API reference,
``nvmlUtilization_t``) gives ``memory`` = percent of the driver's sample period during which
device memory was read or written and ``gpu`` = percent during which a kernel ran. Their ratio
``s = memory / gpu`` is the share of busy time during which memory is active. Under the model the
memory-bound part is that time, ``s = m / (m + (1 - m) / r)`` at the sample's clock ratio, so
``m = s / (s + r * (1 - s))`` (``m = s`` at max clock). Estimates are exponentially smoothed per GPU
(:func:`smooth`, half-life :data:`HALF_LIFE_SAMPLES`) and bounded to ``[0, MAX_SHARE]``.

Rate curve (:func:`curve_slope_factor`): capctl learns each GPU's clock curve ``c(P)`` (clock
ratio at cap ``P``, family ``1 - a (exp((sat_w - P) / k_w) - 1)``, capctl/allocator/curves.py). Its
step-rate curve is ``rho(P) = rho(c(P))`` above, ``1 - rho = (1 - m) x / (1 - m x)`` with
``x = 1 - c``. To first order in ``x`` that is the same family with ``a`` times ``1 - m`` (same
``k_w``, ``sat_w``): exact in value and slope at saturation, concave, and above the true rate by
``(1 - m) m x^2 / (1 - m x)`` (0.011 at ``m = 0.5``, clock ratio 0.8).

Limits (docs/allocation.md, "Memory-bound share"): NVML's memory utilization counts any memory
activity, also traffic that overlaps compute, so ``m`` is an upper estimate for kernels that
overlap both (the curve then promises less gain per watt than there is); the memory clock is taken
as fixed (power capping lowers the SM clock on data-center GPUs); one number per GPU stands for a
whole step (phases within a step average out over NVML's sample period).
"""

from __future__ import annotations

import numpy as np

MIN_GPU_UTILIZATION_PCT = 20.0
"""Samples below this GPU utilization (%) give no estimate: an idle GPU says nothing of its
workload (the threshold :data:`coordinator.models.BUSY_UTILIZATION_PCT` uses for rate samples)."""
MAX_SHARE = 0.9
"""Upper bound of the estimate: a step at least 10 % compute-bound (the what-if simulator fits
its workloads' ``memory_bound_fraction`` within [0, 0.9], capctl/sim/workload.py)."""
HALF_LIFE_SAMPLES = 10.0
"""Half-life (samples) of a GPU's smoothed estimate: NVML's utilization is quantized to 1 % and
sampled over 1/6-1 s, so single samples are noisy; ten samples follow a job's phase changes."""


def sample_share(memory_pct, gpu_pct, clock_ratio) -> np.ndarray:
    """The memory-bound share ``m`` of one sample per element (see the module docstring).

    ``memory_pct``, ``gpu_pct``: NVML's memory / GPU utilization (%, 0-100; NaN = not reported);
    ``clock_ratio``: SM clock / max SM clock of the same sample (0-1]. Shapes broadcast, [N].
    Returns [N] floats in ``[0, MAX_SHARE]``, NaN where a sample gives no estimate (a value absent
    or outside its range, GPU utilization below :data:`MIN_GPU_UTILIZATION_PCT`, clock ratio not in
    (0, 1]). Never raises for values; shapes that do not broadcast raise ``ValueError``.
    """
    mem = np.asarray(memory_pct, float)
    gpu = np.asarray(gpu_pct, float)
    r = np.asarray(clock_ratio, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = ((mem >= 0.0) & (mem <= 100.0) & (gpu >= MIN_GPU_UTILIZATION_PCT) & (gpu <= 100.0)
              & (r > 0.0) & (r <= 1.0))
        s = np.clip(mem / np.where(ok, gpu, 1.0), 0.0, 1.0)  # memory busy outside kernels: at most all
        m = s / np.where(ok, s + r * (1.0 - s), 1.0)
    return np.where(ok, np.clip(m, 0.0, MAX_SHARE), np.nan)


def smooth(mean, weight, share, half_life: float = HALF_LIFE_SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """One step of the exponentially weighted mean of each GPU's estimates.

    ``mean`` [N] (the smoothed share so far; any value where ``weight`` is 0), ``weight`` [N] (the
    decayed count of samples behind it, >= 0), ``share`` [N] (this step's :func:`sample_share`; NaN:
    no new estimate, that GPU unchanged), ``half_life`` (samples, > 0). Returns ``(mean, weight)``
    [N]: ``mean`` in ``[0, MAX_SHARE]`` wherever ``weight > 0``.
    """
    mean = np.asarray(mean, float)
    weight = np.asarray(weight, float)
    share = np.asarray(share, float)
    decay = 0.5 ** (1.0 / float(half_life))
    new = np.isfinite(share)
    w_old = np.where(weight > 0.0, weight, 0.0) * decay
    w_new = np.where(new, w_old + 1.0, weight)
    with np.errstate(invalid="ignore"):
        m_new = (np.where(w_old > 0.0, mean, 0.0) * w_old + np.where(new, share, 0.0)) / np.where(new, w_new, 1.0)
    return np.where(new, m_new, mean), w_new


def curve_slope_factor(share):
    """Factor on a clock curve's slope parameter ``a`` that makes it the step-rate curve of a step
    whose memory-bound share is ``share`` (module docstring, "Rate curve"): ``1 - share``, in
    ``[1 - MAX_SHARE, 1]`` for shares in ``[0, MAX_SHARE]``. Arrays or floats, elementwise."""
    return 1.0 - share


def rate_of_clock(clock_ratio, share):
    """Relative step rate ``1 / (m + (1 - m) / r)`` at clock ratio ``r`` (0, 1] of a step whose
    memory-bound share is ``m`` in [0, 1) (the module's model). Elementwise on arrays or plain
    floats (pure arithmetic: cheap on a scalar); ``m = 0`` returns ``r`` (up to rounding: a caller
    that must stay bit-identical without an estimate skips the call), ``r = 1`` returns 1. ``r <= 0`` raises ``ZeroDivisionError`` on floats (callers pass measured ratios)."""
    return 1.0 / (share + (1.0 - share) / clock_ratio)
