"""What the devices report, as status and ``explain`` show it (pure helpers of the view).

Observed state first (issue 12): a GPU's limit is its enforced limit wherever that is lower than
the request (an out-of-band limit binds), and a job's measured pace is read from the SM clocks.

Normalization of the step rates (one for both): a step rate is a fraction of the rate at the
GPU's maximum SM clock, the rate-curve model of :mod:`capctl.allocator.curves` (rate ~ SM clock /
max SM clock for a compute-bound step; Zeus, Chung et al. NSDI'23). ``predicted_step_rate`` is the
allocator's, from the curves at the caps it decided; ``measured_step_rate`` is the job's slowest
busy GPU's ``sm_clock_mhz / max_sm_clock_mhz`` in its latest telemetry (a synchronous step runs at
the pace of its slowest GPU). Memory-bound steps slow less than the clock: where a GPU has a
memory-bound share ``m`` estimated from NVML's memory utilization (:mod:`coordinator.membound`), its
clock fraction ``r`` is taken through the same model as its rate curve, ``1 / (m + (1 - m) / r)``;
without one the measured figure is the clock fraction (a lower bound of the pace).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from capctl import capstates
from capctl.allocator.curves import RATE_MIN


def clock_fraction(sm_clock_mhz: float, max_sm_clock_mhz: float) -> float:
    """``sm_clock_mhz / max_sm_clock_mhz`` clipped to [0, 1]; NaN when the maximum is unknown (<= 0)."""
    if not max_sm_clock_mhz > 0:
        return math.nan
    return min(1.0, max(0.0, float(sm_clock_mhz) / float(max_sm_clock_mhz)))


def measured_step_rate(fraction_of: Mapping, keys: Iterable, no_reading: Mapping | None = None) -> float:
    """The measured step rate of a job: the lowest clock fraction (see module doc) over its GPUs
    ``keys`` that have one in ``fraction_of`` (GPU key -> fraction); 0.0 (no reading) when none
    has, or when one of its GPUs is in ``no_reading`` (GPU key -> state: no live reading, e.g.
    LOST): a synchronous step runs at its slowest GPU's pace, unknown for that GPU (its last clock
    is no measurement of now, and its job-mates' clocks would overstate the pace)."""
    keys = list(keys)
    if no_reading and any(k in no_reading for k in keys):
        return 0.0
    vals = [fraction_of[k] for k in keys if k in fraction_of and math.isfinite(fraction_of[k])]
    return min(vals) if vals else 0.0


def predicted_rate(rate: float) -> float:
    """The predicted step rate status shows for the allocator's job rate ``rate`` [-]: ``rate``,
    or NaN (no prediction: "-" in ``capctl jobs``, null in JSON) when it is the curve's floor
    (:data:`capctl.allocator.curves.RATE_MIN`, 0.05): the job's slowest GPU is at a cap below its
    curve's range (a GPU held at its last cap, e.g. STALLED at 200 W on the generic H100 curve,
    valid from 262.5 W), where the curve says "at most this slow", not how slow. Shown as 0.050
    it was a made-up figure: a GPU held at 200 W ran at 0.62-0.67 (found by a try-out)."""
    if not math.isfinite(rate) or rate <= RATE_MIN * (1.0 + 1e-9):
        return math.nan
    return float(rate)


def rate_text(rate: float) -> str:
    """A predicted step rate for a sentence: ``"0.812"``; ``"none"`` for NaN (:func:`predicted_rate`)."""
    return f"{rate:.3f}" if math.isfinite(rate) else "none"


def straggler_bound(rate: float, binding: str, keys, straggler: Mapping, fraction_of: Mapping) -> tuple[float, str]:
    """``(predicted step rate, binding)`` of a job: a job with a straggler among its GPUs ``keys``
    (``straggler``: GPU key -> reason) runs at the straggler's measured pace whatever the caps (its
    pace does not respond to power), so that pace is the prediction and ``"straggler"`` the
    binding; other jobs keep the allocator's ``(rate, binding)``."""
    paces = [fraction_of[k] for k in keys if k in straggler and k in fraction_of]
    if not paces:
        return rate, binding
    return min(paces), "straggler"


PACE_TOLERANCE = 0.005
"""Clock-fraction gap below which two GPUs run at one pace (10 MHz of 1,980: under one 15 MHz step)."""


def measured_slowest(slowest, keys, fraction_of: Mapping, no_reading: Mapping, domains_of: Mapping,
                     price: Mapping) -> tuple:
    """``(slowest GPU key, domain binding)`` of a job the solve says is bound by its slowest GPU
    ``slowest`` held at a fixed cap (held, or an out-of-band limit), when a job-mate among ``keys``
    runs measurably slower (clock fraction ``fraction_of``, by more than :data:`PACE_TOLERANCE`;
    neither in ``no_reading``) under a domain with a positive price (``domains_of``: key -> domain
    names; ``price``: name -> objective per W): that job-mate sets the pace and that domain (the
    highest price) binds. ``(slowest, "")`` otherwise. The held GPU was blamed while its job-mate
    ran 45 MHz slower under a priced cluster limit (610 W at 1,875 MHz, 575 W at 1,830; a try-out)."""
    f_held = fraction_of.get(slowest, math.nan) if slowest is not None else math.nan
    if not math.isfinite(f_held) or slowest in no_reading:
        return slowest, ""
    mates = [(fraction_of[k], k) for k in keys
             if k != slowest and k not in no_reading and math.isfinite(fraction_of.get(k, math.nan))]
    if not mates:
        return slowest, ""
    f, k = min(mates)
    p, d = max(((price.get(d, 0.0), d) for d in domains_of.get(k, ())), default=(0.0, ""))
    if f >= f_held - PACE_TOLERANCE or not p > 0:
        return slowest, ""
    return k, f"domain:{d}"


FLAG_ALERT_NAMES = 4
"""GPUs named in one flag alert line (:func:`flag_alerts`); the rest counted ("and N more")."""


def flag_alerts(flagged: Mapping) -> list[str]:
    """One alert line per view flag (``STRAGGLER``, ``OOB_LIMITED`` while its cap state does not
    show it) naming its GPUs with each one's reason, at most :data:`FLAG_ALERT_NAMES` then "and N
    more" (``flagged``: flag -> ``["node/index (reason)", ...]``). Such GPUs had only the flag in
    ``capctl nodes`` and the binding in ``capctl jobs``: a straggler at 43 °C, not among the
    hottest, showed no ``!`` line in ``capctl status`` (found by a try-out)."""
    why = {"STRAGGLER": "they run slow at any cap: held near their draw, their job-mates paced to them",
           capstates.OOB_LIMITED: "another limiter (out-of-band) holds them below their caps: planned within it"}
    out = []
    for flag, names in flagged.items():
        if names:
            more = f" and {len(names) - FLAG_ALERT_NAMES} more" if len(names) > FLAG_ALERT_NAMES else ""
            out.append(f"{flag}: {', '.join(names[:FLAG_ALERT_NAMES])}{more} — {why.get(flag, '')}")
    return out


def limit_w(gpu) -> float:
    """The limit that binds a ``GpuStatus`` (W): its enforced limit where that is lower than the
    allocated cap, else the cap."""
    if gpu.enforced_w > 0 and gpu.enforced_w < gpu.cap_w:
        return float(gpu.enforced_w)
    return float(gpu.cap_w)


PENDING_TOLERANCE_W = 2.0
"""An enforced limit this far or less below the GPU's cap is at its cap (the planner's deadband:
``coordinator.planner.DEADBAND_W``, a change it does not send)."""


def limit_text(gpu) -> str:
    """``"cap 500 W"``; ``"enforced 500 W (below its cap 592 W: another limit binds)"`` only for a GPU
    its agent reports ``OOB_LIMITED`` or the view flags so (the allocation's memory of an
    out-of-band limit); ``"... (below its cap ...: its increase not applied yet)"`` otherwise. The
    claim was made of any 1 W gap: a GPU within the planner's 2 W deadband, or waiting for its
    increase, was said to be held by another limit (found by a review)."""
    if gpu.enforced_w > 0 and gpu.enforced_w < gpu.cap_w - PENDING_TOLERANCE_W:
        oob = capstates.of(gpu) == capstates.OOB_LIMITED or capstates.OOB_LIMITED in gpu.flags
        why = "another limit binds" if oob else "its increase not applied yet"
        return f"enforced {gpu.enforced_w:.0f} W (below its cap {gpu.cap_w:.0f} W: {why})"
    return f"cap {gpu.cap_w:.0f} W"


def reading_state(gpu) -> str:
    """Why a ``GpuStatus`` with ``no_live_reading`` has none, for the text: its cap state (LOST,
    STALLED, ...) or "no reading" (a GPU not read yet, or on a stale node)."""
    state = capstates.of(gpu)
    return state if state and state not in capstates.NORMAL else "no reading"


def explain_lines(job, reply, gpus) -> list[str]:
    """The observed-state lines of ``explain``: measured against predicted step rate, and the job's
    GPUs whose cap state or curve needs the admin's eye (``gpus``: ``(node, GpuStatus)`` pairs)."""
    lines = []
    dark = [(node, g) for node, g in gpus if g.no_live_reading and (g.job_id == job.job_id or job.job_id in g.job_ids)]
    if dark:
        names = ", ".join(f"{node} GPU {g.index} ({reading_state(g)})" for node, g in dark[:4])
        more = f" and {len(dark) - 4} more" if len(dark) > 4 else ""
        lines.append(f"Measured step rate: no reading — {names}{more} without a live reading (its last clock is "
                     f"no measurement of the job's pace); predicted {rate_text(job.predicted_step_rate)}.")
    elif job.measured_step_rate > 0:
        how = ("the slowest busy GPU by its clock: SM clock / max SM clock, through its memory-bound share" if any(
            g.job_id == job.job_id and g.HasField("memory_bound_fraction") for _, g in gpus)
            else "the slowest busy GPU by its clock: SM clock / max SM clock")
        lines.append(f"Measured step rate {job.measured_step_rate:.3f} ({how}), "
                     f"predicted {rate_text(job.predicted_step_rate)}.")
    shares = [g.memory_bound_fraction for _, g in gpus
              if g.job_id == job.job_id and g.HasField("memory_bound_fraction")]
    if shares:
        lo, hi = min(shares), max(shares)
        lines.append(f"Memory-bound share of a step (NVML memory utilization at the measured clock): "
                     + (f"{lo:.2f}" if hi - lo < 0.005 else f"{lo:.2f}-{hi:.2f}")
                     + f" over {len(shares)} GPU(s); the rate curves count it (a memory-bound step gains "
                     "less per watt than its clock).")
    for node, g in gpus:
        if g.job_id != job.job_id:
            continue
        state = capstates.of(g)
        if state and state not in capstates.NORMAL:
            lines.append(f"{node} GPU {g.index}: {state}" + (f" — {g.detail}" if g.detail else "") + ".")
        if "STRAGGLER" in g.flags:
            lines.append(f"{node} GPU {g.index}: STRAGGLER — {g.detail}; held where more watts buy nothing, its "
                         "job-mates are capped toward its pace and the watts freed go to other jobs.")
        if g.curve == "generic":
            lines.append(f"{node} GPU {g.index}: curve generic (no built-in model for this device; "
                         "mapped from its limit constraints until learned).")
    return lines
