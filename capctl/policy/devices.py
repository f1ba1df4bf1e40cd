"""Known device power-limit constraints per GPU model, used to check policy caps statically.

At run time the node agent reads the real constraints from NVML
(``nvmlDeviceGetPowerManagementLimitConstraints``) and every cap is clamped to them; this table only
lets ``capctl policy validate`` catch a policy minimum below what a device accepts before deployment.

Source of the figures: the "Min Power Limit" / "Max Power Limit" that ``nvidia-smi -q -d POWER``
(NVML limit constraints) reports for these boards at their default configuration, which match the
board TDPs in NVIDIA's datasheets (H100 SXM5 700 W, H200 SXM 700 W, A100 SXM4 400 W, V100 SXM2 300 W,
A40 300 W). The same figures are in the simulated driver's device table (``csrc/simnvml/physics.c``,
read through :mod:`capctl.simgpu.profiles`); this module keeps its own copy so that ``capctl.policy``
does not load the simulator, and ``tests/policy``/``tests/sim`` check that the two agree.
Site-specific values can be passed as ``device_min_cap_w`` / ``device_max_cap_w`` mappings.
"""

from __future__ import annotations

from collections.abc import Mapping

KNOWN_DEVICE_LIMITS_W: Mapping[str, tuple[float, float]] = {
    "H100-SXM": (200.0, 700.0),
    "H200": (200.0, 700.0),
    "A100-SXM4": (100.0, 400.0),
    "V100-SXM2": (150.0, 300.0),
    "A40": (100.0, 300.0),
}
"""GPU model -> (minimum cap, maximum cap) in watts, from NVML limit constraints (see module doc)."""


def _norm(model: str) -> str:
    return "".join(ch for ch in model.upper() if ch.isalnum())


def device_limits_w(
    model: str,
    device_min_cap_w: Mapping[str, float] | None = None,
    device_max_cap_w: Mapping[str, float] | None = None,
) -> tuple[float | None, float | None]:
    """Return ``(min_cap_w, max_cap_w)`` of ``model`` (either may be None when unknown).

    Caller-supplied maps win over :data:`KNOWN_DEVICE_LIMITS_W`. Model names match ignoring case
    and punctuation (``h100_sxm`` == ``H100-SXM``).
    """
    key = _norm(model)
    low = high = None
    for name, (lo, hi) in KNOWN_DEVICE_LIMITS_W.items():
        if _norm(name) == key:
            low, high = lo, hi
    for name, value in (device_min_cap_w or {}).items():
        if _norm(name) == key:
            low = float(value)
    for name, value in (device_max_cap_w or {}).items():
        if _norm(name) == key:
            high = float(value)
    return low, high
