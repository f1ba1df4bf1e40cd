"""NVML backend of the node agent: the ONLY module in capctl that imports :mod:`pynvml`.

Everything above this module speaks watts (W), degrees Celsius (°C), megahertz (MHz) and joules
(J); milliwatts (mW) and millijoules (mJ) exist only here, at the NVML edge.

NVML calls used (NVML API reference, https://docs.nvidia.com/deploy/nvml-api/, through the
``pynvml`` wrappers of ``nvidia-ml-py``):

=================================================  ===========================================
NVML function                                      used for
=================================================  ===========================================
nvmlInitWithFlags(0) / nvmlShutdown                open / close (reference counted by NVML)
nvmlSystemGetDriverVersion                         logged at open, ``driver_version``
nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex_v2  device enumeration
nvmlDeviceGetName, GetUUID, GetMinorNumber,        :class:`DeviceInfo`
nvmlDeviceGetPciInfo_v3
nvmlDeviceGetPowerManagementLimitConstraints       min/max cap (mW), clamping
nvmlDeviceGetPowerManagementDefaultLimit           default cap (mW)
nvmlDeviceGetPowerManagementLimit                  requested limit (mW), read back after set
nvmlDeviceGetEnforcedPowerLimit                    enforced limit (mW), read back after set
nvmlDeviceSetPowerManagementLimit                  the plain setter (the ``_v2`` wrapper of
                                                   pynvml swallows errors, so it is not used)
nvmlDeviceGetPowerUsage                            power draw (mW)
nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)     GPU temperature (°C)
nvmlDeviceGetTemperatureThreshold(SLOWDOWN,        thresholds read from the device, never
  SHUTDOWN)                                        hard-coded
nvmlDeviceGetClockInfo / GetMaxClockInfo(SM)       SM clock and its maximum (MHz)
nvmlDeviceGetCurrentClocksEventReasons             clocks event reasons (bit mask, decoded)
nvmlDeviceGetTotalEnergyConsumption                energy counter (mJ since driver load)
nvmlDeviceGetUtilizationRates                      GPU and memory utilization (%); NOT_SUPPORTED,
                                                   an error or a value outside 0-100 leaves the
                                                   value absent (NaN), never a failed sample
=================================================  ===========================================

Library selection and verification: the agent loads exactly one NVML library per process
(``pynvml`` keeps it for the process lifetime). ``library="system"`` loads the driver's
``libnvidia-ml.so.1`` through the dynamic loader, ``"simulated"`` our build
(:func:`capctl.paths.library_path`), or an absolute path. After loading, the file actually
mapped is found with ``dladdr(3)`` on an NVML symbol and compared with the configuration; the
simulated driver (recognised by its exported ``capsim_*`` symbols) is refused unless configured.
So ``LD_LIBRARY_PATH`` or an earlier load cannot silently point the agent at another library.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
from pathlib import Path

import pynvml

from capctl import devicedata, reasons
from capctl.errors import UserInputError
from nodeagent.backend import (  # the backend contract; re-exported here for existing callers
    DeviceInfo,
    GpuLostError,
    GpuSample,
    NvmlError,
    NvmlLibraryError,
    SimulatedNodeUnsetError,
    NvmlNotSupportedError,
    NvmlPermissionError,
    NvmlUninitializedError,
    SetResult,
    UnsupportedConstraintsError,
)

LOG = logging.getLogger("capctl.nodeagent.nvml")

SONAME = "libnvidia-ml.so.1"
"""The soname of NVML on Linux (NVML API reference, "Initialization and Cleanup")."""

SIMULATED_SYMBOL_PREFIX = b"capsim_"
"""Prefix of symbols exported only by our simulated driver (csrc/simnvml), used to recognise it."""

_PROCESS_LOCK = threading.Lock()
"""Serialises library loading/verification in this process (pynvml has one library per process)."""

# Clocks event reasons: names and classes live in capctl.reasons (one vocabulary); pynvml's bit
# values (nvml.h) are compared with that table here, so a renumbering fails loudly at import.
_PYNVML_REASON_BITS = {
    "GPU_IDLE": pynvml.nvmlClocksEventReasonGpuIdle,
    "APPLICATIONS_CLOCKS_SETTING": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "SW_POWER_CAP": pynvml.nvmlClocksEventReasonSwPowerCap,
    "HW_SLOWDOWN": pynvml.nvmlClocksEventReasonHwSlowdown,
    "SYNC_BOOST": pynvml.nvmlClocksEventReasonSyncBoost,
    "SW_THERMAL_SLOWDOWN": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "HW_THERMAL_SLOWDOWN": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "HW_POWER_BRAKE_SLOWDOWN": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "DISPLAY_CLOCK_SETTING": pynvml.nvmlClocksEventReasonDisplayClockSetting,
    "BOARD_LIMIT": pynvml.nvmlClocksThrottleReasonBoardLimit,
    "RELIABILITY": pynvml.nvmlClocksThrottleReasonReliability,
}
if {n: b for b, n in reasons.REASON_BITS} != _PYNVML_REASON_BITS:  # pragma: no cover - a new NVML
    raise ImportError("capctl.reasons.REASON_BITS differ from pynvml's nvmlClocksEventReason* values")
decode_clocks_event_reasons = reasons.decode
"""Decode an NVML clocks event reasons mask (:func:`capctl.reasons.decode`)."""


_REMEDIES: dict[int, tuple[type[NvmlError], str]] = {
    pynvml.NVML_ERROR_NO_PERMISSION: (
        NvmlPermissionError,
        "changing power limits needs root or CAP_SYS_ADMIN: run capctl-agent as root "
        "(the shipped systemd unit does)",
    ),
    pynvml.NVML_ERROR_NOT_SUPPORTED: (
        NvmlNotSupportedError,
        "the device does not allow power limits (see 'nvidia-smi -q -d POWER'); exclude this "
        "GPU from capping in the policy",
    ),
    pynvml.NVML_ERROR_GPU_IS_LOST: (
        GpuLostError,
        "the GPU is lost (fell off the bus, see dmesg for Xid 79): drain the node and reset the "
        "GPU or reboot",
    ),
    pynvml.NVML_ERROR_UNINITIALIZED: (
        NvmlUninitializedError,
        "NVML is not initialised: open the backend first (or the driver was unloaded)",
    ),
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        NvmlLibraryError,
        "libnvidia-ml.so.1 was not found: install the NVIDIA driver, or start the agent with "
        "--nvml-library simulated for the simulated driver",
    ),
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: (
        NvmlLibraryError,
        "the loaded NVML library lacks this function: update the NVIDIA driver",
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        NvmlLibraryError,
        "the NVIDIA kernel driver is not loaded: load it (modprobe nvidia) or check the install",
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        NvmlLibraryError,
        "NVML and the kernel driver versions differ: reboot or reload the driver after an upgrade",
    ),
    pynvml.NVML_ERROR_INVALID_ARGUMENT: (
        NvmlError,
        "NVML rejected the argument (for a limit: outside the limit constraints the driver "
        "enforces, which may differ from those it reports); check 'nvidia-smi -q -d POWER'",
    ),
    pynvml.NVML_ERROR_RESET_REQUIRED: (
        GpuLostError,
        "the GPU requires a reset: drain the node and reset the GPU",
    ),
}


ROOT_NO_PERMISSION_REMEDY = (
    "the driver refused although capctl-agent runs as root: the power limit may be locked (by the "
    "BMC or out-of-band management, or a driver setting; see 'nvidia-smi -q -d POWER'), or the agent "
    "lacks the capability (a CapabilityBoundingSet without CAP_SYS_ADMIN)"
)
"""The remedy of NVML_ERROR_NO_PERMISSION for an agent that is root (the admin try-out: "run
capctl-agent as root" was the hint for an agent that was root)."""


def _error_name(code: int) -> str:
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == code:
            return name
    return f"NVML error {code}"


def _translate(err: pynvml.NVMLError, operation: str, gpu_index: int | None) -> NvmlError:
    """Map a pynvml exception to the typed capctl error carrying a remedy."""
    code = getattr(err, "value", None)
    cls, remedy = _REMEDIES.get(
        code, (NvmlError, "check 'nvidia-smi' and the kernel log; restart capctl-agent if it persists")
    )
    if code == pynvml.NVML_ERROR_NO_PERMISSION and os.geteuid() == 0:
        remedy = ROOT_NO_PERMISSION_REMEDY  # running as root already: that is not the cause
    where = f"GPU {gpu_index}: " if gpu_index is not None else ""
    try:
        text = str(err)
    except Exception:  # pragma: no cover - pynvml's __str__ may itself call NVML
        text = "?"
    name = _error_name(code) if code is not None else "NVML error"
    message = f"{where}{operation} failed: {name} ({text}); {remedy}"
    return cls(message, nvml_code=code, gpu_index=gpu_index)


def _mw_to_w(value_mw: int) -> float:
    return value_mw / 1000.0


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# --------------------------------------------------------------------------------------------
# Library loading and verification
# --------------------------------------------------------------------------------------------


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _dladdr_file(address: int) -> str | None:
    """Path of the shared object containing ``address`` (dladdr(3), else /proc/self/maps)."""
    for libname in (None, "libdl.so.2"):
        try:
            dladdr = ctypes.CDLL(libname).dladdr
        except (OSError, AttributeError):
            continue
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        info = _DlInfo()
        if dladdr(ctypes.c_void_p(address), ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= address < hi and len(parts) == 6:
                    return parts[5].strip()
    except OSError:  # pragma: no cover - no procfs
        pass
    return None


def _symbol_file(lib: ctypes.CDLL, symbol: str = "nvmlInitWithFlags") -> str | None:
    try:
        func = getattr(lib, symbol)
    except AttributeError:
        return None
    return _dladdr_file(ctypes.cast(func, ctypes.c_void_p).value)


def _is_simulated_file(path: str) -> bool:
    """True if ``path`` is our simulated driver: its dynamic symbol table names ``capsim_*``."""
    try:
        with open(path, "rb") as f:
            return SIMULATED_SYMBOL_PREFIX in f.read()
    except OSError:
        return False


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def simulated_library_path() -> Path:
    """Path of our simulated ``libnvidia-ml.so.1`` (``$CAPCTL_SIMNVML_LIB`` or build/)."""
    from capctl.paths import library_path

    return Path(library_path())


# --------------------------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------------------------


class NvmlBackend:
    """Typed, watt-based access to the GPUs of this node through NVML; implements
    :class:`nodeagent.backend.GpuBackend` (structurally).

    Args:
        library: ``"system"`` (the driver's ``libnvidia-ml.so.1`` as the dynamic loader finds it),
            ``"simulated"`` (our build, :func:`simulated_library_path`), or an absolute path.
        allow_simulated: accept the simulated driver even when ``library`` is not
            ``"simulated"`` (tests pointing at a copy of it by absolute path).

    Use as a context manager or call :meth:`open` / :meth:`close`. Thread-safe: one lock
    serialises the set-and-read-back sequence; reads are lock-free (NVML is thread-safe).

    Raises (from :meth:`open`): :class:`NvmlLibraryError` when the library is missing, not the
    configured one, or the simulated driver without configuration; other :class:`NvmlError`
    subclasses for NVML failures. Per-call methods raise the typed errors listed in their docs.
    """

    def __init__(self, library: str = "system", *, allow_simulated: bool = False):
        if library not in ("system", "simulated") and not os.path.isabs(str(library)):
            raise UserInputError(
                f"--nvml-library {library!r} is not allowed; use 'system', 'simulated' or an "
                "absolute path to a libnvidia-ml.so.1"
            )
        self.library = str(library)
        self.allow_simulated = bool(allow_simulated or library == "simulated")
        self.library_path: str | None = None
        self.driver_version: str | None = None
        self.simulated: bool = False
        self._handles: list = []
        self._devices: list[DeviceInfo] = []
        self._clamp_logged: dict[int, tuple[int, int]] = {}  # index -> (asked mW, used mW) last logged
        self._open = False
        # one lock per GPU (set + read-backs are atomic per GPU): a stalled write on one GPU never
        # holds back another GPU's write (nodeagent.callguard)
        self._set_locks: dict[int, threading.Lock] = {}
        self._util_logged: set[tuple[int, str]] = set()  # (GPU, problem) logged once until it clears

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "NvmlBackend":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        """True between a successful :meth:`open` and :meth:`close`."""
        return self._open

    def _expected_path(self) -> str | None:
        if self.library == "system":
            return None
        if self.library == "simulated":
            return str(simulated_library_path())
        return self.library

    def _load_library(self) -> str:
        """Load (or find the already loaded) NVML library; return the file actually mapped."""
        expected = self._expected_path()
        if expected is not None and not os.path.isfile(expected):
            hint = " (run 'make build')" if self.library == "simulated" else ""
            raise NvmlLibraryError(
                f"NVML library {expected} does not exist{hint}; fix the agent's --nvml-library"
            )
        current = pynvml.nvmlLib
        if current is None:
            try:
                lib = ctypes.CDLL(expected or SONAME, mode=os.RTLD_GLOBAL)
            except OSError as err:
                if expected is None:
                    raise NvmlLibraryError(
                        f"cannot load {SONAME} ({err}): install the NVIDIA driver, or start the agent "
                        "with --nvml-library simulated to use the simulated driver"
                    ) from None
                raise NvmlLibraryError(
                    f"cannot load NVML library {expected}: {err}; check the agent's --nvml-library"
                ) from None
        else:
            lib = current
        loaded = _symbol_file(lib)
        if loaded is None:
            raise NvmlLibraryError(
                f"the loaded NVML library ({getattr(lib, '_name', '?')}) has no nvmlInitWithFlags "
                "symbol: it is not NVML; check the agent's --nvml-library and LD_LIBRARY_PATH"
            )
        self._verify(loaded, expected, preloaded=current is not None)
        return loaded

    def _verify(self, loaded: str, expected: str | None, *, preloaded: bool) -> None:
        earlier = " (already loaded earlier in this process)" if preloaded else ""
        if expected is not None and not _same_file(loaded, expected):
            raise NvmlLibraryError(
                f"configured NVML library {expected} but {loaded} is loaded{earlier}; a process "
                "can use only one NVML library: check LD_LIBRARY_PATH / LD_PRELOAD and the "
                "agent's --nvml-library"
            )
        simulated = _is_simulated_file(loaded)
        if simulated and not self.allow_simulated:
            where = ("it is the file --nvml-library names" if os.path.isabs(str(self.library)) and not preloaded
                     else "remove it from LD_LIBRARY_PATH / LD_PRELOAD")
            raise NvmlLibraryError(
                f"refusing the simulated NVML driver {loaded}{earlier}: the agent was started with "
                f"--nvml-library {self.library}; {where}; use "
                "--nvml-library simulated (or an absolute path with --allow-simulated) when a simulated "
                "node is intended, else the system's NVML (--nvml-library system)"
            )
        self.simulated = simulated

    def open(self) -> "NvmlBackend":
        """Load and verify the library, initialise NVML, read every device's static facts.

        Returns self. Logs the library path and driver version (INFO). Idempotent.

        Raises:
            NvmlLibraryError: missing/wrong library, or the simulated one without configuration.
            NvmlError: nvmlInit failed (subclass per NVML code).
        """
        if self._open:
            return self
        with _PROCESS_LOCK:
            loaded = self._load_library()
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as err:
                raise self._init_error(err, loaded) from None
            count = self._check_initialised(loaded)
        self.library_path = loaded
        self._open = True
        self._handles = [None] * count
        self._set_locks = {i: threading.Lock() for i in range(count)}
        self._devices = [self._read_device(i) for i in range(count)]
        LOG.info(
            "NVML loaded from %s (driver %s%s), %d GPU(s)",
            loaded, self.driver_version, ", SIMULATED" if self.simulated else "", count,
        )
        return self

    def _init_error(self, err: pynvml.NVMLError, loaded: str) -> NvmlError:
        """The typed error for a failed nvmlInit of ``loaded`` (names CAPCTL_SIMGPU_NODE for the
        simulated driver)."""
        if self.simulated and getattr(err, "value", None) == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            node = os.environ.get("CAPCTL_SIMGPU_NODE")
            if not node:
                where = "CAPCTL_SIMGPU_NODE is not set"
            elif not os.path.exists(node):
                where = f"CAPCTL_SIMGPU_NODE points at a missing file, {node}"
            else:
                where = f"CAPCTL_SIMGPU_NODE points at {node}, which is not a usable simulated node"
            return SimulatedNodeUnsetError(
                f"nvmlInit of the simulated driver {loaded} failed: {where}; create a simulated "
                "node with 'capctl-simgpu init DIR' and set CAPCTL_SIMGPU_NODE to its state file"
            )
        return _translate(err, f"nvmlInit of {loaded}", None)

    def _check_initialised(self, loaded: str) -> int:
        """After nvmlInit: check NVML runs from ``loaded``, read the driver version; return the
        device count. On failure NVML is shut down again.

        Raises:
            NvmlLibraryError: NVML was initialised from another file.
            NvmlError: reading the driver version or the device count failed.
        """
        try:
            # pynvml resolves the bare soname; it must be the very file verified above.
            after = _symbol_file(pynvml.nvmlLib)
            if after is None or not _same_file(after, loaded):
                raise NvmlLibraryError(
                    f"NVML was initialised from {after} instead of the verified {loaded}; "
                    "check LD_LIBRARY_PATH / LD_PRELOAD"
                )
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
            return pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as err:
            pynvml.nvmlShutdown()
            raise _translate(err, "reading the driver version / device count", None) from None
        except NvmlError:
            pynvml.nvmlShutdown()
            raise

    def close(self) -> None:
        """Shut NVML down (reference counted; the library stays mapped). Idempotent."""
        if not self._open:
            return
        self._open = False
        self._handles = []
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:  # pragma: no cover - nothing useful to do at close
            LOG.warning("nvmlShutdown failed: %s", err)

    # -- helpers -----------------------------------------------------------------------------

    def _handle(self, index: int):
        if not self._open:
            raise NvmlUninitializedError(
                "NVML backend is not open: call NvmlBackend.open() (or use it as a context manager)",
                gpu_index=index,
            )
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self._handles):
            raise UserInputError(
                f"gpu index: {index!r} does not exist on this node; allowed 0..{len(self._handles) - 1}"
            )
        handle = self._handles[index]
        if handle is None:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as err:
                raise _translate(err, "nvmlDeviceGetHandleByIndex", index) from None
            self._handles[index] = handle
        return handle

    def _call(self, index: int, operation: str, func, *args):
        handle = self._handle(index)
        try:
            return func(handle, *args)
        except pynvml.NVMLError as err:
            raise _translate(err, operation, index) from None

    def _read_device(self, index: int) -> DeviceInfo:
        try:
            h = self._handle(index)
            min_mw, max_mw = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(h)
            limit_problem = _limit_outside(index, min_mw, max_mw, pynvml.nvmlDeviceGetPowerManagementLimit(h))
            if limit_problem:
                LOG.error("GPU %d: %s", index, limit_problem)
            return DeviceInfo(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                name=_text(pynvml.nvmlDeviceGetName(h)),
                minor_number=int(pynvml.nvmlDeviceGetMinorNumber(h)),
                pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                min_cap_w=_mw_to_w(min_mw),
                max_cap_w=_mw_to_w(max_mw),
                default_cap_w=_mw_to_w(pynvml.nvmlDeviceGetPowerManagementDefaultLimit(h)),
                slowdown_temp_c=float(pynvml.nvmlDeviceGetTemperatureThreshold(
                    h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
                shutdown_temp_c=float(pynvml.nvmlDeviceGetTemperatureThreshold(
                    h, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)),
                max_sm_clock_mhz=int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
                limit_problem=limit_problem,
            )
        except (pynvml.NVMLError, NvmlError) as err:
            error = _translate(err, "reading device facts", index) if isinstance(err, pynvml.NVMLError) else err
            LOG.error("%s", error)
            nan = math.nan
            return DeviceInfo(index, "", "", -1, "", nan, nan, nan, nan, nan, 0, error=str(error))

    # -- devices and telemetry ---------------------------------------------------------------

    def device_count(self) -> int:
        """Number of GPUs NVML reported at open."""
        self._require_open()
        return len(self._handles)

    def _require_open(self) -> None:
        if not self._open:
            raise NvmlUninitializedError(
                "NVML backend is not open: call NvmlBackend.open() (or use it as a context manager)"
            )

    def devices(self, *, refresh: bool = False) -> list[DeviceInfo]:
        """Static facts of every GPU (:class:`DeviceInfo`), read at open; ``refresh`` re-reads.

        A GPU that failed to read carries ``error``; it is re-read on every call until it works.
        """
        self._require_open()
        for i, info in enumerate(self._devices):
            if refresh or info.error is not None:
                self._devices[i] = self._read_device(i)
        return list(self._devices)

    def device(self, index: int) -> DeviceInfo:
        """Static facts of GPU ``index`` (re-read when the last read failed: a GPU that still cannot
        be read carries ``error``, as in :meth:`devices`; it raised GpuLostError from its handle
        before, and a GPU lost at start stopped the agent, found by a review).

        Raises:
            UserInputError: no such GPU index.
        """
        self._require_open()
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self._devices):
            raise UserInputError(f"gpu index: {index!r} does not exist on this node; allowed 0..{len(self._devices) - 1}")
        if self._devices[index].error is not None:
            self._devices[index] = self._read_device(index)
        return self._devices[index]

    def telemetry(self, index: int) -> GpuSample:
        """Read one :class:`GpuSample` of GPU ``index`` (10 NVML queries, no writes).

        Raises:
            GpuLostError, NvmlNotSupportedError, NvmlError: the NVML query failed.
            UserInputError: no such GPU index.
        """
        timestamp_s = time.time()
        h = self._handle(index)
        info = self._devices[index]
        try:
            min_mw, max_mw = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(h)
            util_pct, memory_pct = self._utilization_rates(h, index)
            sample = GpuSample(
                index=index,
                power_w=_mw_to_w(pynvml.nvmlDeviceGetPowerUsage(h)),
                cap_w=_mw_to_w(pynvml.nvmlDeviceGetPowerManagementLimit(h)),
                enforced_w=_mw_to_w(pynvml.nvmlDeviceGetEnforcedPowerLimit(h)),
                temp_c=float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                sm_clock_mhz=int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                max_sm_clock_mhz=int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
                clocks_event_reasons=decode_clocks_event_reasons(
                    int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))),
                utilization_pct=util_pct,
                memory_utilization_pct=memory_pct,
                energy_j=pynvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0,
                min_cap_w=_mw_to_w(min_mw),
                max_cap_w=_mw_to_w(max_mw),
                timestamp_s=timestamp_s,
                slowdown_temp_c=info.slowdown_temp_c,
                shutdown_temp_c=info.shutdown_temp_c,
            )
        except pynvml.NVMLError as err:
            raise _translate(err, "reading telemetry", index) from None
        if info.error is not None:  # lost at open, back now: fill in the thresholds
            info = self.device(index)
            sample = _replace(sample, slowdown_temp_c=info.slowdown_temp_c,
                              shutdown_temp_c=info.shutdown_temp_c)
        return sample

    def _utilization_rates(self, h, index: int) -> tuple[float, float]:
        """``(gpu_pct, memory_pct)`` of GPU ``index`` from ``nvmlDeviceGetUtilizationRates`` (NVML
        API reference, ``nvmlUtilization_t``: percent of the driver's sample period during which a
        kernel was executing / device memory was read or written). A value is NaN (absent) when
        the call fails (NOT_SUPPORTED or any NVML error) or lies outside 0-100 (bad device data);
        each such problem is logged once per GPU (naming the GPU, the value and the allowed
        range) until it clears. Never raises for the device's answer."""
        logged = self._util_logged
        try:
            rates = pynvml.nvmlDeviceGetUtilizationRates(h)
        except pynvml.NVMLError as err:
            if (index, "call") not in logged:
                logged.add((index, "call"))
                LOG.warning("%s; its utilization is left out of the reports until it answers",
                            _translate(err, "nvmlDeviceGetUtilizationRates", index))
            return math.nan, math.nan
        logged.discard((index, "call"))
        out = []
        for field, raw in (("gpu", getattr(rates, "gpu", None)), ("memory", getattr(rates, "memory", None))):
            try:
                value = float(raw)
            except (TypeError, ValueError):
                value = math.nan
            if 0.0 <= value <= 100.0:
                logged.discard((index, field))
                out.append(value)
                continue
            if (index, field) not in logged:
                logged.add((index, field))
                LOG.warning("GPU %d: nvmlDeviceGetUtilizationRates reported %s utilization %r %%, "
                            "bad device data (allowed 0-100 %%): dropped from the reports until valid",
                            index, field, raw)
            out.append(math.nan)
        return out[0], out[1]

    def telemetry_all(self) -> list[GpuSample]:
        """One sample per GPU, in index order; a GPU that fails yields :meth:`GpuSample.failed`."""
        self._require_open()
        samples: list[GpuSample] = []
        for index in range(len(self._handles)):
            try:
                samples.append(self.telemetry(index))
            except NvmlError as err:
                samples.append(GpuSample.failed(index, err, time.time()))
        return samples

    # -- limits ------------------------------------------------------------------------------

    def limit_constraints_w(self, index: int) -> tuple[float, float]:
        """(min_cap_w, max_cap_w) of GPU ``index``, read from the device now."""
        min_mw, max_mw = self._constraints_mw(index)
        return _mw_to_w(min_mw), _mw_to_w(max_mw)

    def _constraints_mw(self, index: int) -> tuple[int, int]:
        min_mw, max_mw = self._call(
            index, "nvmlDeviceGetPowerManagementLimitConstraints",
            pynvml.nvmlDeviceGetPowerManagementLimitConstraints)
        return int(min_mw), int(max_mw)

    def validate_policy_limits_w(
        self, index: int, min_cap_w: float | None = None, max_cap_w: float | None = None,
        *, field: str = "policy",
    ) -> None:
        """Check a policy's cap range against GPU ``index``'s limit constraints.

        Raises:
            UserInputError: ``min_cap_w`` below the device minimum, ``max_cap_w`` above the device
                maximum, or a non-finite value; the message names ``field``, the value and the
                allowed range.
        """
        dev_min_w, dev_max_w = self.limit_constraints_w(index)
        name = self.device(index).name
        for key, value in (("min_cap_w", min_cap_w), ("max_cap_w", max_cap_w)):
            if value is not None:
                _check_finite(value, f"{field}.{key}")
        if min_cap_w is not None and min_cap_w < dev_min_w:
            raise UserInputError(
                f"{field}.min_cap_w: {min_cap_w:g} W is below the minimum power limit of GPU "
                f"{index} ({name}); allowed {dev_min_w:g}..{dev_max_w:g} W"
            )
        if max_cap_w is not None and max_cap_w > dev_max_w:
            raise UserInputError(
                f"{field}.max_cap_w: {max_cap_w:g} W is above the maximum power limit of GPU "
                f"{index} ({name}); allowed {dev_min_w:g}..{dev_max_w:g} W"
            )

    def clamp_cap_mw(self, index: int, cap_w: float, *, policy_min_w: float | None = None) -> int:
        """Convert a cap in W to the milliwatts NVML will accept for GPU ``index``.

        The value is rounded DOWN to whole mW (after removing float noise below 1 µW, so
        250.0 W -> 250000 mW and 199.9999999999 W -> 200000 mW) and then clamped, in integer
        mW, to the device's limit constraints, so the result always lies inside them (never
        99 999 mW on a 100 000 mW minimum). A clamp is logged once per GPU and value (the caps
        manager converts a cap before writing it and the write converts it again; a start cap
        outside the constraints is asked for again at every reconcile).

        Args:
            policy_min_w: when given, validated first (:meth:`validate_policy_limits_w`).

        Raises:
            UserInputError: ``cap_w`` is NaN, infinite or not a number; ``policy_min_w`` below the
                device minimum.
            UnsupportedConstraintsError: the constraints read are unusable
                (:func:`capctl.devicedata.constraints_problem`) or differ from those read at
                start (:meth:`_constraints_changed`); nothing may be written.
            NvmlError: reading the constraints failed.
        """
        _check_finite(cap_w, "cap_w")
        if policy_min_w is not None:
            self.validate_policy_limits_w(index, policy_min_w)
        min_mw, max_mw = self._constraints_mw(index)
        problem = devicedata.unsupported_message(_mw_to_w(min_mw), _mw_to_w(max_mw))
        if problem:
            raise UnsupportedConstraintsError(f"GPU {index}: {problem}", gpu_index=index)
        changed = self._constraints_changed(index, min_mw, max_mw)
        if changed:
            raise UnsupportedConstraintsError(f"GPU {index}: {changed}", gpu_index=index)
        value_mw = math.floor(round(float(cap_w) * 1000.0, 3))
        clamped_mw = min(max(value_mw, min_mw), max_mw)
        if clamped_mw != value_mw and self._clamp_logged.get(index) != (value_mw, clamped_mw):
            self._clamp_logged[index] = (value_mw, clamped_mw)
            LOG.warning(
                "GPU %d: cap %.3f W outside the limit constraints %.3f..%.3f W, using %.3f W",
                index, cap_w, _mw_to_w(min_mw), _mw_to_w(max_mw), _mw_to_w(clamped_mw),
            )
        return clamped_mw

    def _constraints_changed(self, index: int, min_mw: int, max_mw: int) -> str:
        """Why the constraints ``min_mw``..``max_mw`` read now may not be used ("" when they may):
        they differ (by more than 1 mW) from the usable ones read when the backend opened, which
        the agent's hello reported and the coordinator plans with. Clamping into constraints the
        coordinator does not know could raise a GPU far above its share of a domain limit (a
        minimum reported as 650 W on a GPU given 471 W) or write a value no board takes (a
        maximum of 2 W), so nothing is written until the agent re-reads them (a restart)."""
        info = self._devices[index] if 0 <= index < len(self._devices) else None
        if info is None or info.error is not None:
            return ""
        if info.limit_problem:
            return info.limit_problem
        start = (info.min_cap_w, info.max_cap_w)
        if not all(math.isfinite(v) for v in start) or devicedata.unsupported_message(*start):
            # unusable at start: the hello said so and the coordinator holds the GPU at its limit;
            # whatever it reads now, nothing is written before a restart reports them again
            return (f"limit constraints read from the device at start were unusable (min {start[0]:g} W, "
                    f"max {start[1]:g} W); now min {_mw_to_w(min_mw):g} W, max {_mw_to_w(max_mw):g} W; {_HELD}")
        lo_mw, hi_mw = round(start[0] * 1000.0), round(start[1] * 1000.0)
        if abs(min_mw - lo_mw) <= 1 and abs(max_mw - hi_mw) <= 1:
            return ""
        return (f"limit constraints read from the device changed: min {_mw_to_w(min_mw):g} W, max "
                f"{_mw_to_w(max_mw):g} W, at start min {start[0]:g} W, max {start[1]:g} W (as reported to "
                f"the coordinator); {_HELD}")

    def get_cap_w(self, index: int) -> float:
        """Requested power limit of GPU ``index`` in W (nvmlDeviceGetPowerManagementLimit)."""
        return _mw_to_w(self._call(index, "nvmlDeviceGetPowerManagementLimit",
                                   pynvml.nvmlDeviceGetPowerManagementLimit))

    def get_enforced_w(self, index: int) -> float:
        """Enforced power limit of GPU ``index`` in W (nvmlDeviceGetEnforcedPowerLimit)."""
        return _mw_to_w(self._call(index, "nvmlDeviceGetEnforcedPowerLimit",
                                   pynvml.nvmlDeviceGetEnforcedPowerLimit))

    def get_default_cap_w(self, index: int) -> float:
        """Default power limit of GPU ``index`` in W (nvmlDeviceGetPowerManagementDefaultLimit)."""
        return _mw_to_w(self._call(index, "nvmlDeviceGetPowerManagementDefaultLimit",
                                   pynvml.nvmlDeviceGetPowerManagementDefaultLimit))

    def set_cap_w(self, index: int, cap_w: float) -> SetResult:
        """Set GPU ``index``'s power limit to ``cap_w`` W, clamped inside its constraints.

        Uses the plain ``nvmlDeviceSetPowerManagementLimit`` (errors surface) and reads back the
        requested and the enforced limit.

        Raises:
            UserInputError: ``cap_w`` not finite.
            NvmlPermissionError: needs root or CAP_SYS_ADMIN.
            NvmlNotSupportedError: the device does not allow power limits.
            GpuLostError: the GPU is lost.
            NvmlError: any other NVML failure.
        """
        value_mw = self.clamp_cap_mw(index, cap_w)
        handle = self._handle(index)
        with self._set_locks[index]:
            try:
                pynvml.nvmlDeviceSetPowerManagementLimit(handle, value_mw)
            except pynvml.NVMLError as err:
                raise _translate(err, f"setting the power limit to {value_mw / 1000:g} W", index) from None
            try:
                cap_mw = pynvml.nvmlDeviceGetPowerManagementLimit(handle)
                enforced_mw = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)
            except pynvml.NVMLError as err:
                raise _translate(err, "reading back the power limit", index) from None
        if cap_mw != value_mw:
            LOG.warning("GPU %d: wrote %d mW but the limit reads back as %d mW", index, value_mw, cap_mw)
        return SetResult(
            index=index, requested_w=float(cap_w), written_w=_mw_to_w(value_mw),
            cap_w=_mw_to_w(cap_mw), enforced_w=_mw_to_w(enforced_mw),
            clamped=math.floor(round(float(cap_w) * 1000.0, 3)) != value_mw,
        )


_HELD = "no limit is written to this GPU until the agent is restarted and reads them again"
"""How a GPU with constraints the agent may not use is held (:meth:`NvmlBackend._constraints_changed`)."""
LIMIT_TOLERANCE_MW = 1000
"""How far (mW) a GPU's power limit may lie outside its limit constraints before they are taken as
contradicting it (:func:`_limit_outside`): NVML keeps the limit inside them, to the milliwatt."""


def _limit_outside(index: int, min_mw, max_mw, limit_mw) -> str:
    """Why GPU ``index``'s limit constraints ``min_mw``..``max_mw`` contradict its power limit
    ``limit_mw`` (all mW, as NVML returns them), "" when they agree (or are unusable anyway:
    :func:`capctl.devicedata.unsupported_message` judges those). The text does not name the GPU:
    the callers prefix it, as for the other constraint problems.

    A limit outside the constraints is bad device data (a driver or a firmware reporting a new
    minimum, an injected fault): clamping into them would raise the GPU on the agent's own,
    outside any plan (found by a try-out: a GPU at 604 W reporting 650..700 W, restarted agent
    wrote 650 W, a PDU 614 W over its limit in the simulated driver's journal)."""
    if (devicedata.unsupported_message(_mw_to_w(min_mw), _mw_to_w(max_mw))
            or min_mw - LIMIT_TOLERANCE_MW <= limit_mw <= max_mw + LIMIT_TOLERANCE_MW):
        return ""
    return (f"power limit {_mw_to_w(limit_mw):g} W read from the device is outside its limit "
            f"constraints {_mw_to_w(min_mw):g}..{_mw_to_w(max_mw):g} W (bad device data): held at its limit, "
            f"{_HELD}")


def _check_finite(value: float, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserInputError(f"{field}: {value!r} is not a finite number of watts")


def _replace(sample: GpuSample, **changes) -> GpuSample:
    import dataclasses

    return dataclasses.replace(sample, **changes)
