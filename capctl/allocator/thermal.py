"""First-order RC thermal model of a GPU: thermal ceiling and online identification.

Model (lumped thermal resistance/capacitance, e.g. Skadron et al., "Temperature-aware
microarchitecture", ISCA 2003; the standard first-order model for a die on a heat sink)::

    tau * dT/dt = T_ss(P) - T,     T_ss(P) = inlet_c + r_c_per_w * P

With power held at P over an interval of length dt the temperature at its end is
``T(t+dt) = T_ss + (T - T_ss) * exp(-dt / tau)``, affine in P. The thermal ceiling is the largest
P keeping that prediction ``margin_c`` below the device's slowdown temperature (NVML
``NVML_TEMPERATURE_THRESHOLD_SLOWDOWN``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["thermal_ceiling_w", "predict_temp_c", "OnlineThermalFit", "THERMAL_PRIOR"]

#: Prior / bounds for identification. R: air-cooled data-center GPUs run 0.05-0.2 °C/W above
#: inlet at full power (e.g. 400 W, 25 °C inlet, ~65 °C die); tau: heat-sink time constants of
#: tens of seconds; inlet: ASHRAE A1 allowable 15-32 °C. Sources: NVIDIA A100/H100 thermal
#: design guides (inlet), ASHRAE TC 9.9 (2021) thermal guidelines.
THERMAL_PRIOR = {
    "r_c_per_w": (0.10, 0.005, 1.0),  # (prior, lower bound, upper bound)
    "tau_s": (30.0, 1.0, 3600.0),
    "inlet_c": (25.0, 0.0, 60.0),
}


def predict_temp_c(temp_c, power_w, inlet_c, r_c_per_w, tau_s, interval_s):
    """Temperature [°C] after ``interval_s`` [s] at constant ``power_w`` [W]; arrays broadcast."""
    e = np.exp(-np.asarray(interval_s, float) / np.asarray(tau_s, float))
    t_ss = np.asarray(inlet_c, float) + np.asarray(r_c_per_w, float) * np.asarray(power_w, float)
    return t_ss + (np.asarray(temp_c, float) - t_ss) * e


def thermal_ceiling_w(temp_c, inlet_c, r_c_per_w, tau_s, interval_s, slowdown_temp_c, margin_c):
    """Largest cap [W] whose predicted end-of-interval temperature is <= slowdown_temp_c - margin_c.

    All arguments broadcast (numpy arrays or scalars): temp_c, inlet_c, slowdown_temp_c,
    margin_c in °C; r_c_per_w in °C/W (> 0); tau_s, interval_s in s (> 0). Returns a float array
    [W] of the broadcast shape; may be below the device minimum or negative when the GPU is
    already too hot (the allocator then holds the minimum and alerts). Solving
    ``inlet + R*P + (T - inlet - R*P) e <= target`` with ``e = exp(-interval/tau)`` gives
    ``P <= ((target - T e) / (1 - e) - inlet) / R``.
    Raises ValueError if r_c_per_w, tau_s or interval_s is not positive.
    """
    r = np.asarray(r_c_per_w, float)
    tau = np.asarray(tau_s, float)
    dt = np.asarray(interval_s, float)
    if np.any(~(r > 0)) or np.any(~(tau > 0)) or np.any(~(dt > 0)):
        raise ValueError("r_c_per_w, tau_s and interval_s must be > 0 "
                         f"(got min {np.min(r)}, {np.min(tau)}, {np.min(dt)})")
    e = np.exp(-dt / tau)
    target = np.asarray(slowdown_temp_c, float) - np.asarray(margin_c, float)
    return ((target - np.asarray(temp_c, float) * e) / (1.0 - e) - np.asarray(inlet_c, float)) / r


class OnlineThermalFit:
    """Recursive least squares estimate of (R, tau, inlet) for G GPUs from their history.

    Discretized model: with ``e = exp(-dt/tau)``, ``T_k = e T_{k-1} + (1-e) R P_k + (1-e) inlet``
    — linear in the regressors (T_{k-1}, P_k, 1) with coefficients (alpha, beta, gamma), from which
    ``tau = -dt/ln(alpha)``, ``R = beta/(1-alpha)``, ``inlet = gamma/(1-alpha)``. ``P_k`` is the
    average power over the interval ending at sample k (what the NVML energy counter gives).
    Sampling should be near-periodic: samples whose dt differs from the running mean by > 50 %
    only reset the reference point. RLS with forgetting factor ``forget`` (Ljung, System
    Identification, 2nd ed., §11.2); the prior (:data:`THERMAL_PRIOR`) initializes the estimate
    and estimates are clipped to its bounds, so unexciting data (constant power) keeps the prior.

    add(timestamp_s[G] or scalar, power_w[G], temp_c[G]); params() -> (r_c_per_w[G], tau_s[G],
    inlet_c[G]). Raises ValueError on shape mismatch or time going backwards.
    """

    def __init__(self, n_gpus: int, *, nominal_interval_s: float = 5.0, forget: float = 0.995,
                 prior_strength: float = 1e-2):
        self.n = int(n_gpus)
        self.forget = float(forget)
        self.dt_s = float(nominal_interval_s)
        r0, tau0, in0 = (THERMAL_PRIOR[k][0] for k in ("r_c_per_w", "tau_s", "inlet_c"))
        e = np.exp(-self.dt_s / tau0)
        theta0 = np.array([e, (1 - e) * r0, (1 - e) * in0])
        self._theta = np.tile(theta0, (self.n, 1))
        # covariance scaled to regressor magnitudes (T ~ 50 °C, P ~ 300 W, 1)
        scale = np.array([1 / 50.0, 1 / 300.0, 1.0]) ** 2
        self._cov = np.tile(np.diag(scale / prior_strength), (self.n, 1, 1))
        self._prev_t = None
        self._prev_temp = None
        self._dt_sum = 0.0
        self._dt_n = 0

    def add(self, timestamp_s, power_w, temp_c) -> None:
        """Add one sample per GPU (timestamp [s], average power over the last interval [W], temp [°C])."""
        ts = np.broadcast_to(np.asarray(timestamp_s, float), (self.n,))
        p = np.asarray(power_w, float).reshape(-1)
        t = np.asarray(temp_c, float).reshape(-1)
        if p.shape != (self.n,) or t.shape != (self.n,):
            raise ValueError(f"power_w and temp_c must have shape ({self.n},), got {p.shape}, {t.shape}")
        if self._prev_t is not None:
            dt = ts - self._prev_t
            if np.any(dt <= 0):
                raise ValueError("timestamps must increase")
            mean_dt = self._dt_sum / self._dt_n if self._dt_n else float(np.median(dt))
            ok = np.abs(dt - mean_dt) <= 0.5 * mean_dt
            if np.any(ok):
                self._dt_sum += float(np.sum(dt[ok]))
                self._dt_n += int(ok.sum())
                self.dt_s = self._dt_sum / self._dt_n
                x = np.stack([self._prev_temp, p, np.ones(self.n)], axis=1)  # [G, 3]
                px = np.einsum("gij,gj->gi", self._cov, x)
                denom = self.forget + np.einsum("gi,gi->g", x, px)
                gain = px / denom[:, None]
                err = t - np.einsum("gi,gi->g", x, self._theta)
                upd = ok & np.isfinite(err)
                self._theta[upd] += gain[upd] * err[upd, None]
                newcov = (self._cov - gain[:, :, None] * px[:, None, :]) / self.forget
                self._cov[upd] = newcov[upd]
        self._prev_t = ts.copy()
        self._prev_temp = t.copy()

    def params(self):
        """(r_c_per_w[G] °C/W, tau_s[G] s, inlet_c[G] °C), each clipped to THERMAL_PRIOR bounds."""
        lo = {k: v[1] for k, v in THERMAL_PRIOR.items()}
        hi = {k: v[2] for k, v in THERMAL_PRIOR.items()}
        alpha = np.clip(self._theta[:, 0], np.exp(-self.dt_s / lo["tau_s"]), np.exp(-self.dt_s / hi["tau_s"]))
        tau = -self.dt_s / np.log(alpha)
        r = np.clip(self._theta[:, 1] / (1 - alpha), lo["r_c_per_w"], hi["r_c_per_w"])
        inlet = np.clip(self._theta[:, 2] / (1 - alpha), lo["inlet_c"], hi["inlet_c"])
        return r, np.clip(tau, lo["tau_s"], hi["tau_s"]), inlet
