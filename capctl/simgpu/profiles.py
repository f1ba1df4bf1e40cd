"""Device profiles of the simulated GPUs, read from the C table in ``csrc/simnvml/physics.c``.

The values and their sources (datasheets, ``nvidia-smi -q`` captures, NVIDIA product briefs,
labelled estimates) are documented next to the table in physics.c and in docs/simulated-gpus.md;
this module only exposes them to Python, it never duplicates them.

Usage::

    from capctl.simgpu import profiles
    profiles.get("H100-SXM").max_limit_w   # 700.0
    [p.name for p in profiles.all_profiles()]
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

from capctl.errors import UserInputError
from capctl.simgpu import _lib


@dataclass(frozen=True)
class DeviceProfile:
    """Constants of one GPU model (watts, MHz, degrees C, C/W, seconds).

    ``averaged_power`` is True where NVML reports power as a 1 s average (Ampere and later except
    GA100, per the nvmlDeviceGetPowerUsage reference); ``pci_device_id`` is NVML's combined
    device/vendor id.
    """

    index: int
    name: str
    nvml_name: str
    min_limit_w: float
    max_limit_w: float
    default_limit_w: float
    idle_w: float
    max_sm_clock_mhz: float
    min_sm_clock_mhz: float
    idle_sm_clock_mhz: float
    mem_clock_mhz: float
    max_video_clock_mhz: float
    slowdown_temp_c: float
    shutdown_temp_c: float
    max_operating_temp_c: float
    mem_max_temp_c: float
    thermal_resistance_c_per_w: float
    tau_s: float
    memory_bound_fraction: float
    pci_device_id: int
    architecture: int
    averaged_power: bool


@functools.lru_cache(maxsize=1)
def all_profiles() -> tuple[DeviceProfile, ...]:
    """All device profiles, in the C table's order (index = ``capsim_gpu.profile``).

    Raises:
        capctl.simgpu._lib.LibraryMissingError: the simulated library is not built.
    """
    lib = _lib.load()
    count = ctypes.c_uint()
    ptr = lib.capsim_profiles(ctypes.byref(count))
    dt = _lib.dtype(lib, 1)
    buf = (ctypes.c_char * (dt.itemsize * count.value)).from_address(ptr)
    arr = np.frombuffer(bytes(buf), dtype=dt)
    out = []
    for i, rec in enumerate(arr):
        kw = {}
        for name in dt.names:
            v = rec[name]
            if isinstance(v, bytes):
                v = v.decode()
            elif name == "averaged_power":
                v = bool(v)
            elif np.issubdtype(type(v), np.integer):
                v = int(v)
            else:
                v = float(v)
            kw[name] = v
        out.append(DeviceProfile(index=i, **kw))
    return tuple(out)


def names() -> list[str]:
    """Model keys accepted by ``SimNode.create(model=...)``."""
    return [p.name for p in all_profiles()]


def get(name: str) -> DeviceProfile:
    """Return the profile called ``name`` (case-insensitive).

    Raises:
        UserInputError: unknown model; the message lists the allowed names.
    """
    for p in all_profiles():
        if p.name.lower() == str(name).lower():
            return p
    raise UserInputError(f"model {name!r} is unknown; allowed: {', '.join(names())}")


def __getattr__(attr: str):
    if attr == "PROFILES":
        return all_profiles()
    raise AttributeError(attr)
