"""Sanity of what a device reports about itself (shared by the node agent and the coordinator).

A GPU's limit constraints come from ``nvmlDeviceGetPowerManagementLimitConstraints``. capctl caps
only inside them, so constraints that cannot be true make every cap wrong: ``(0, 0)`` (a write
would be 0 W), ``min > max`` (no cap satisfies both), or values outside what any GPU board takes.
Such a GPU is never written: it is held and counted at its current limit and flagged
``UNSUPPORTED_CONSTRAINTS`` (:mod:`capctl.capstates`) with the values read. This is bad device
data, never a capctl bug.
"""

from __future__ import annotations

import math

MIN_SANE_LIMIT_W = 1.0
"""The lowest minimum limit accepted (W): NVML never enforces 0 W; every datacenter GPU's minimum
limit is tens to hundreds of watts (NVML reference, nvidia-smi -q -d POWER)."""
MAX_SANE_LIMIT_W = 5000.0
"""The highest maximum limit accepted (W): the largest GPU boards take about 1.2 kW (B200/GB200
datasheets); 5 kW leaves room for any module while rejecting overflowed or unit-confused values
(the simulated driver's own bound, csrc/simnvml/state.c)."""


def constraints_problem(min_w: float, max_w: float) -> str:
    """What is wrong with limit constraints ``(min_w, max_w)`` (W), "" when they can be used.

    Usable: finite, ``MIN_SANE_LIMIT_W <= min_w <= max_w <= MAX_SANE_LIMIT_W``. The text names the
    values read and what is allowed, for status and logs; it never raises.
    """
    try:
        lo, hi = float(min_w), float(max_w)
    except (TypeError, ValueError):
        return f"limit constraints ({min_w!r}, {max_w!r}) are not numbers"
    read = f"limit constraints read from the device: min {lo:g} W, max {hi:g} W"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{read}; not finite"
    if lo > hi:
        return f"{read}; min > max"
    if lo < MIN_SANE_LIMIT_W:
        return f"{read}; the minimum is below {MIN_SANE_LIMIT_W:g} W (a device never enforces 0 W)"
    if hi > MAX_SANE_LIMIT_W:
        return f"{read}; the maximum is above {MAX_SANE_LIMIT_W:g} W, more than any GPU board takes"
    return ""


def unsupported_message(min_w: float, max_w: float) -> str:
    """The status/log text of a GPU held for bad constraints ("" when they are usable)."""
    problem = constraints_problem(min_w, max_w)
    if not problem:
        return ""
    return (f"{problem}: the GPU is never written, held and counted at its current limit (bad device "
            "data: check the driver and 'nvidia-smi -q -d POWER'; a driver update or GPU reset may fix it)")
