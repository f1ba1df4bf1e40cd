"""Clocks event reasons: the one definition of their names and of the classes capctl reads from them.

NVML reports why a GPU's clocks are below their maximum as a bit mask
(``nvmlDeviceGetCurrentClocksEventReasons``). The bit values are NVIDIA's (nvml.h
``nvmlClocksEventReason*``, NVML API reference "Clocks Event Reasons"); the node agent checks them
against pynvml's at start (:mod:`nodeagent.nvml`), and names travel on the wire
(``GpuTelemetry.clocks_event_reasons``). Two classes matter to capctl:

- **thermal slowdown** (``SW_THERMAL_SLOWDOWN``, ``HW_THERMAL_SLOWDOWN``): the GPU ran hot and its
  clock dropped in steps — what capctl exists to prevent;
- **power capping** (``SW_POWER_CAP``, ``HW_POWER_BRAKE_SLOWDOWN``): the GPU is held by its power
  limit (or the board's external power brake).
"""

from __future__ import annotations

from collections.abc import Iterable

REASON_BITS: tuple[tuple[int, str], ...] = (
    (0x1, "GPU_IDLE"),
    (0x2, "APPLICATIONS_CLOCKS_SETTING"),
    (0x4, "SW_POWER_CAP"),
    (0x8, "HW_SLOWDOWN"),
    (0x10, "SYNC_BOOST"),
    (0x20, "SW_THERMAL_SLOWDOWN"),
    (0x40, "HW_THERMAL_SLOWDOWN"),
    (0x80, "HW_POWER_BRAKE_SLOWDOWN"),
    (0x100, "DISPLAY_CLOCK_SETTING"),
    (0x200, "BOARD_LIMIT"),   # nvmlClocksThrottleReasonBoardLimit (NVML 12.x)
    (0x400, "RELIABILITY"),   # nvmlClocksThrottleReasonReliability
)
"""(bit, name) of every clocks event reason NVML defines (nvml.h)."""

THERMAL_SLOWDOWN = frozenset({"SW_THERMAL_SLOWDOWN", "HW_THERMAL_SLOWDOWN"})
"""Reasons that mean thermal slowdown."""
POWER_CAPPED = frozenset({"SW_POWER_CAP", "HW_POWER_BRAKE_SLOWDOWN"})
"""Reasons that mean the power limit (or the power brake) holds the clock."""


def decode(mask: int) -> tuple[str, ...]:
    """Decode a clocks event reasons bit mask into names, in bit order.

    Args:
        mask: value of ``nvmlDeviceGetCurrentClocksEventReasons`` (unsigned 64-bit).

    Returns:
        Names such as ``("SW_POWER_CAP", "HW_THERMAL_SLOWDOWN")``; bits NVML does not define
        appear as ``"UNKNOWN_0x..."``. An empty tuple means no reason (full clocks).
    """
    names: list[str] = []
    known = 0
    for bit, name in REASON_BITS:
        known |= bit
        if mask & bit:
            names.append(name)
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"UNKNOWN_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)


def is_thermal(reasons: Iterable[str]) -> bool:
    """True when any reason is a thermal slowdown (software or hardware)."""
    return any(r in THERMAL_SLOWDOWN for r in reasons)


def is_power_capped(reasons: Iterable[str]) -> bool:
    """True when any reason is a power cap or the power brake."""
    return any(r in POWER_CAPPED for r in reasons)


_CLASS: dict[tuple[str, ...], tuple[bool, bool]] = {}
_CLASS_MAX = 4096


def classify(reasons: tuple[str, ...]) -> tuple[bool, bool]:
    """``(is_thermal(reasons), is_power_capped(reasons))``, memoized per reasons tuple (agents
    report a handful of distinct combinations; the cache is bounded)."""
    hit = _CLASS.get(reasons)
    if hit is None:
        hit = (is_thermal(reasons), is_power_capped(reasons))
        if len(_CLASS) < _CLASS_MAX:
            _CLASS[reasons] = hit
    return hit
