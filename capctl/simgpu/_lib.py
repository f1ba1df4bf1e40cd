"""ctypes binding of the control functions (``capsim_*``) of the simulated ``libnvidia-ml.so.1``.

The library is built by ``make build`` from ``csrc/simnvml`` (see :mod:`capctl.simgpu.build`).
Record layouts (GPU state, device profiles) are read from the library's own field tables, so the
numpy dtypes here are never a second copy of the C structs.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from capctl.errors import CapctlError, HardwareError, UserInputError
from capctl.simgpu.build import library_path

ABI_VERSION = 5
"""Layout version this module was written for (``CAPSIM_ABI_VERSION`` in csrc/simnvml/simgpu.h)."""

# nvmlReturn_t values (nvml.h) used by the control API.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_GPU_IS_LOST = 15

FAULT_CODES = {
    "set_no_permission": 1,
    "set_not_supported": 2,
    "gpu_lost": 3,
    "oob_limit": 4,
    "foreign_writer": 5,
    "bad_constraints": 6,
    "stuck_slowdown": 7,
    "nvml_stall": 8,
    "continuous_clock": 9,
}
"""Fault names accepted by :meth:`SimNode.inject` / :meth:`SimNode.clear` and their C codes."""


class SimInputError(UserInputError):
    """Bad input to the simulated driver's control API (names the argument, value and range)."""

    def __init__(self, message: str, nvml_code: int = NVML_ERROR_INVALID_ARGUMENT):
        super().__init__(message)
        self.nvml_code = nvml_code


class SimDeviceError(HardwareError):
    """A simulated device refused the operation (injected fault); ``nvml_code`` is the NVML code."""

    def __init__(self, message: str, nvml_code: int):
        super().__init__(message)
        self.nvml_code = nvml_code


class LibraryMissingError(CapctlError):
    """The simulated driver library is not built or cannot be loaded."""

    exit_code = 5


class _Field(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_size_t), ("dtype", ctypes.c_char_p)]


@functools.lru_cache(maxsize=4)
def load(path: str | None = None) -> ctypes.CDLL:
    """Load the simulated library (``$CAPCTL_SIMNVML_LIB`` or ``build/simnvml/libnvidia-ml.so.1``).

    Raises:
        LibraryMissingError: the file is missing, is not our library, or has another ABI version.
    """
    lib_path = Path(path) if path else library_path()
    if not lib_path.is_file():
        raise LibraryMissingError(
            f"simulated NVML library not found at {lib_path}; build it with 'make build' "
            "(or set CAPCTL_SIMNVML_LIB to its path)"
        )
    try:
        lib = ctypes.CDLL(str(lib_path.resolve()))
    except OSError as err:
        raise LibraryMissingError(f"cannot load simulated NVML library {lib_path}: {err}") from None
    if not hasattr(lib, "capsim_abi_version"):
        raise LibraryMissingError(
            f"{lib_path} is not capctl's simulated NVML library (no capsim_abi_version symbol)"
        )
    lib.capsim_abi_version.restype = ctypes.c_uint
    if lib.capsim_abi_version() != ABI_VERSION:
        raise LibraryMissingError(
            f"{lib_path} has ABI version {lib.capsim_abi_version()}, expected {ABI_VERSION}; "
            "rebuild with 'make build'"
        )
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    c_node = ctypes.c_void_p
    u = ctypes.c_uint
    d = ctypes.c_double
    i = ctypes.c_int
    sigs = {
        "capsim_last_error": (ctypes.c_char_p, []),
        "capsim_create": (c_node, [ctypes.c_char_p, u, ctypes.c_char_p, i, ctypes.c_uint64, d]),
        "capsim_create_profile": (c_node, [ctypes.c_char_p, u, ctypes.c_void_p, i, ctypes.c_uint64, d]),
        "capsim_node_profile": (ctypes.c_void_p, [c_node]),
        "capsim_open": (c_node, [ctypes.c_char_p]),
        "capsim_close": (None, [c_node]),
        "capsim_gpu_count": (u, [c_node]),
        "capsim_gpus": (ctypes.c_void_p, [c_node]),
        "capsim_manual_clock": (i, [c_node]),
        "capsim_driver_generation": (u, [c_node]),
        "capsim_journal_errors": (ctypes.c_uint64, [c_node]),
        "capsim_now": (i, [c_node, ctypes.POINTER(d)]),
        "capsim_sync": (i, [c_node]),
        "capsim_read": (i, [c_node, u, ctypes.c_void_p]),
        "capsim_advance": (i, [c_node, d]),
        "capsim_set_limit": (i, [c_node, u, d]),
        "capsim_set_limits": (
            i,
            [c_node, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
        ),
        "capsim_set_load": (i, [c_node, u, d, d, d]),
        "capsim_set_loads": (
            i,
            [c_node, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_size_t],
        ),
        "capsim_set_param": (i, [c_node, u, ctypes.c_char_p, d]),
        "capsim_inject": (i, [c_node, u, i, d, d]),
        "capsim_clear": (i, [c_node, u, i]),
        "capsim_driver_reload": (i, [c_node]),
        "capsim_fields": (
            ctypes.POINTER(_Field),
            [i, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
        ),
        "capsim_profiles": (ctypes.c_void_p, [ctypes.POINTER(u)]),
        "capsim_profile_index": (i, [ctypes.c_char_p]),
        "capsim_default_gpu": (i, [i, ctypes.c_void_p]),
        "capsim_steady_state": (
            i,
            [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, i, i, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_void_p],
        ),
        "capsim_step_array": (None, [ctypes.c_void_p, ctypes.c_size_t, d]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def last_error(lib: ctypes.CDLL) -> str:
    """Return the library's last error message for this thread."""
    msg = lib.capsim_last_error()
    return msg.decode() if msg else "unknown error"


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    """Raise the matching error for a non-zero control-API return code."""
    if rc == 0:
        return
    msg = f"{what}: {last_error(lib)}"
    if rc == NVML_ERROR_INVALID_ARGUMENT:
        raise SimInputError(msg, rc)
    raise SimDeviceError(msg, rc)


@functools.lru_cache(maxsize=4)
def dtype(lib: ctypes.CDLL, which: int) -> np.dtype:
    """numpy structured dtype of a C record: 0 = ``capsim_gpu``, 1 = ``capsim_profile``."""
    count = ctypes.c_size_t()
    size = ctypes.c_size_t()
    table = lib.capsim_fields(which, ctypes.byref(count), ctypes.byref(size))
    names, formats, offsets = [], [], []
    for k in range(count.value):
        f = table[k]
        names.append(f.name.decode())
        formats.append(f.dtype.decode())
        offsets.append(f.offset)
    return np.dtype(
        {"names": names, "formats": formats, "offsets": offsets, "itemsize": size.value}
    )


def default_record(lib: ctypes.CDLL, profile_index: int) -> np.ndarray:
    """A ``capsim_gpu`` record (1-element array) with the defaults of one profile."""
    rec = np.zeros(1, dtype=dtype(lib, 0))
    check(lib, lib.capsim_default_gpu(profile_index, rec.ctypes.data), "default record")
    return rec
