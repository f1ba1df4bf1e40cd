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


KNOWN_NVML_NAMES: Mapping[str, str] = {
    "NVIDIA H100 80GB HBM3": "H100-SXM",
    "NVIDIA H200": "H200",
    "NVIDIA A100-SXM4-80GB": "A100-SXM4",
    "Tesla V100-SXM2-32GB": "V100-SXM2",
    "NVIDIA A40": "A40",
}
"""What ``nvmlDeviceGetName`` (``nvidia-smi --query-gpu=name``) reports for these boards -> the
model of :data:`KNOWN_DEVICE_LIMITS_W` (the simulated driver reports the same names)."""
OTHER_NVML_NAMES: Mapping[str, str] = {
    "NVIDIA A100-SXM4-40GB": "A100-SXM4",
    "Tesla V100-SXM2-16GB": "V100-SXM2",
}
"""Other memory sizes of the same boards (same limit constraints: the A100 SXM4 40 GB and V100 SXM2
16 GB datasheets give the same 400 W / 300 W TDP): their NVML names name the model too."""


def _norm(model: str) -> str:
    return "".join(ch for ch in str(model).upper() if ch.isalnum())


def canonical_model(model: str) -> str | None:
    """The :data:`KNOWN_DEVICE_LIMITS_W` model ``model`` names, or None: a model's name or its NVML
    name (:data:`KNOWN_NVML_NAMES`), ignoring case and punctuation (``h100_sxm``, ``H100 SXM`` and
    ``NVIDIA H100 80GB HBM3`` are ``H100-SXM``; ``H100`` is none: the PCIe and NVL boards have
    other limits)."""
    key = _norm(model)
    for name in KNOWN_DEVICE_LIMITS_W:
        if _norm(name) == key:
            return name
    for nvml_name, name in {**KNOWN_NVML_NAMES, **OTHER_NVML_NAMES}.items():
        if _norm(nvml_name) == key:
            return name
    return None


def model_suggestion(model: str) -> str | None:
    """The known model the unknown ``model`` may mean, or None: one whose name begins with it
    (``H100``: ``H100-SXM``), or whose name it begins with followed by digits only (``H100-SXM5``:
    ``H100-SXM``), vendor prefix aside; never another board's name that is merely similar (``B200``
    is not ``H200``, and ``H200 NVL``, a PCIe board, is not ``H200``: a try-out)."""
    key = _norm(model)
    for vendor in ("NVIDIA", "TESLA"):
        key = key.removeprefix(vendor)
    if len(key) < 3:
        return None
    hits = {name for name in KNOWN_DEVICE_LIMITS_W
            if _norm(name).startswith(key) or (key.startswith(_norm(name)) and key[len(_norm(name)):].isdigit())}
    return hits.pop() if len(hits) == 1 else None


def device_limits_w(
    model: str,
    device_min_cap_w: Mapping[str, float] | None = None,
    device_max_cap_w: Mapping[str, float] | None = None,
) -> tuple[float | None, float | None]:
    """Return ``(min_cap_w, max_cap_w)`` of ``model`` (either may be None when unknown).

    Caller-supplied maps win over :data:`KNOWN_DEVICE_LIMITS_W`. Model names match ignoring case
    and punctuation (``h100_sxm`` == ``H100-SXM``); a known model's NVML name names it too
    (:func:`canonical_model`).
    """
    key = _norm(model)
    low = high = None
    known = canonical_model(model)
    if known is not None:
        low, high = KNOWN_DEVICE_LIMITS_W[known]
    for name, value in (device_min_cap_w or {}).items():
        if _norm(name) == key:
            low = float(value)
    for name, value in (device_max_cap_w or {}).items():
        if _norm(name) == key:
            high = float(value)
    return low, high
