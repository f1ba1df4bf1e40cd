"""The GPU backend contract of the node agent: :class:`GpuBackend`, its records and its errors.

:class:`~nodeagent.caps.CapManager` and the agent (:mod:`nodeagent.daemon`) are typed against
:class:`GpuBackend`, a structural :class:`typing.Protocol` holding exactly what they call. The
production implementation is :class:`nodeagent.nvml.NvmlBackend` (the only importer of
``pynvml``); logic tests use a pure-Python device (``tests/nodeagent/puredevice.py``).

Units: W, °C, MHz, J; the one exception is :meth:`GpuBackend.clamp_cap_mw`, which returns whole
milliwatts (the value the device will accept). The error family keeps the names of the production
backend (``NvmlError`` ...): every backend raises these, so callers handle one set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from capctl.errors import HardwareError

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class NvmlError(HardwareError):
    """A GPU backend call failed (NVML in production). ``nvml_code`` is the NVML return code (or
    None), ``gpu_index`` the GPU.

    The message names the GPU, the operation, the NVML error and a remedy.
    """

    def __init__(self, message: str, *, nvml_code: int | None = None, gpu_index: int | None = None):
        super().__init__(message)
        self.nvml_code = nvml_code
        self.gpu_index = gpu_index


class NvmlPermissionError(NvmlError):
    """NVML_ERROR_NO_PERMISSION: changing power limits needs root or CAP_SYS_ADMIN."""


class NvmlNotSupportedError(NvmlError):
    """NVML_ERROR_NOT_SUPPORTED: the device does not allow power limits (or the query)."""


class GpuLostError(NvmlError):
    """NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus or stopped responding."""


class NvmlLibraryError(NvmlError):
    """The NVML library is missing, unusable, or not the one the agent is configured for."""


class SimulatedNodeUnsetError(NvmlLibraryError):
    """The simulated driver has no node to simulate (``CAPCTL_SIMGPU_NODE`` unset, missing or not a
    simulated node's state file): a configuration error, exit 1 (was 5, "hardware")."""

    exit_code = 1


class UnsupportedConstraintsError(NvmlError):
    """The device reports limit constraints no cap can satisfy ((0, 0), min > max, outside sane
    bounds: :func:`capctl.devicedata.constraints_problem`): bad device data, nothing is written."""


class NvmlStalledError(NvmlError):
    """An NVML call on this GPU has not returned within the agent's per-GPU timeout (a hung driver
    call), or an earlier one is still outstanding: no fresh reading, nothing written until it returns
    (:mod:`nodeagent.callguard`)."""


class NvmlUninitializedError(NvmlError):
    """The backend (or NVML) is not initialised: call :meth:`nodeagent.nvml.NvmlBackend.open` first."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Static facts of one GPU, read from the device when the backend opens.

    Units: W, °C, MHz. Constraints/default from nvmlDeviceGetPowerManagementLimitConstraints /
    DefaultLimit; thresholds from nvmlDeviceGetTemperatureThreshold; ``error`` is set (and the
    numbers are NaN/empty) when the GPU could not be read (e.g. lost at start).
    """

    index: int
    uuid: str
    name: str
    minor_number: int
    pci_bus_id: str
    min_cap_w: float
    max_cap_w: float
    default_cap_w: float
    slowdown_temp_c: float
    shutdown_temp_c: float
    max_sm_clock_mhz: int
    error: str | None = None
    limit_problem: str = ""
    """Why the limit constraints contradict the device's own power limit read at the same time
    ("" when they agree): such a GPU is held at its limit, nothing written (bad device data)."""


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One telemetry sample of one GPU.

    Fields: ``power_w`` (board power, NVML's ~1 s average on Ampere and later), ``cap_w`` (requested
    power limit), ``enforced_w`` (enforced limit: the lowest of all limits in force),
    ``min_cap_w``/``max_cap_w`` (limit constraints), ``temp_c``, ``slowdown_temp_c``/
    ``shutdown_temp_c`` (device thresholds), ``sm_clock_mhz``/``max_sm_clock_mhz``,
    ``clocks_event_reasons`` (decoded names, see :func:`capctl.reasons.decode`),
    ``utilization_pct`` (0-100, share of time a kernel ran), ``memory_utilization_pct`` (0-100,
    share of time device memory was read or written; both ``nvmlDeviceGetUtilizationRates``, NaN
    when the device does not report them or reported a value outside 0-100), ``energy_j`` (since
    driver load), ``timestamp_s`` (host
    ``time.time()`` when the read started). When ``error`` is set the GPU could not be read
    (``error_type`` names the exception class, e.g. ``"GpuLostError"``) and numbers are NaN.
    """

    index: int
    power_w: float
    cap_w: float
    enforced_w: float
    temp_c: float
    sm_clock_mhz: int
    max_sm_clock_mhz: int
    clocks_event_reasons: tuple[str, ...]
    utilization_pct: float
    energy_j: float
    min_cap_w: float
    max_cap_w: float
    timestamp_s: float
    slowdown_temp_c: float = math.nan
    shutdown_temp_c: float = math.nan
    error: str | None = None
    error_type: str | None = None
    memory_utilization_pct: float = math.nan

    @property
    def ok(self) -> bool:
        """True when the sample holds real readings (no error)."""
        return self.error is None

    @classmethod
    def failed(cls, index: int, err: Exception, timestamp_s: float) -> "GpuSample":
        """An error marker for GPU ``index`` (all numbers NaN)."""
        nan = math.nan
        return cls(
            index=index, power_w=nan, cap_w=nan, enforced_w=nan, temp_c=nan, sm_clock_mhz=0,
            max_sm_clock_mhz=0, clocks_event_reasons=(), utilization_pct=nan, energy_j=nan,
            min_cap_w=nan, max_cap_w=nan, timestamp_s=timestamp_s, error=str(err),
            error_type=type(err).__name__,
        )


@dataclass(frozen=True, slots=True)
class SetResult:
    """Outcome of :meth:`GpuBackend.set_cap_w` (all W).

    ``requested_w``: what the caller asked; ``written_w``: the clamped value written to NVML;
    ``cap_w``: the requested limit read back after the write; ``enforced_w``: the enforced limit
    read back (below ``cap_w`` when another limit binds); ``clamped``: the request was outside
    the limit constraints and was moved inside.
    """

    index: int
    requested_w: float
    written_w: float
    cap_w: float
    enforced_w: float
    clamped: bool


# --------------------------------------------------------------------------------------------
# The protocol
# --------------------------------------------------------------------------------------------


@runtime_checkable
class GpuBackend(Protocol):
    """What the agent and :class:`~nodeagent.caps.CapManager` need from the GPUs of one node.

    GPUs are addressed by index ``0..len(devices()) - 1``. Every per-GPU method raises
    :class:`~capctl.errors.UserInputError` for an index that does not exist, :class:`GpuLostError`
    when the GPU is lost, and another :class:`NvmlError` subclass for other device failures.

    Attributes:
        driver_version: driver version string reported in the agent's hello (None if unknown).
        simulated: True when the GPUs are not real (the hello tells the coordinator).
    """

    driver_version: str | None
    simulated: bool

    def devices(self) -> list[DeviceInfo]:
        """Static facts of every GPU in index order; a GPU that cannot be read carries ``error``."""
        ...

    def telemetry_all(self) -> list[GpuSample]:
        """One sample per GPU in index order; a GPU that fails yields :meth:`GpuSample.failed`
        (never raises for one GPU)."""
        ...

    def telemetry(self, index: int) -> GpuSample:
        """One sample of GPU ``index`` (what :mod:`nodeagent.callguard` runs per GPU). Raises as
        the class doc says."""
        ...

    def clamp_cap_mw(self, index: int, cap_w: float) -> int:
        """The cap ``cap_w`` (W) as whole milliwatts inside the GPU's limit constraints.

        Raises:
            UserInputError: ``cap_w`` not a finite number; no such GPU.
            UnsupportedConstraintsError: the constraints read are unusable (never clamped to 0 W).
            NvmlError: reading the constraints failed (:class:`GpuLostError` for a lost GPU).
        """
        ...

    def get_cap_w(self, index: int) -> float:
        """Requested power limit of GPU ``index`` (W). Raises as the class doc says."""
        ...

    def get_enforced_w(self, index: int) -> float:
        """Enforced power limit of GPU ``index`` (W): the lowest limit in force. Raises as the
        class doc says."""
        ...

    def set_cap_w(self, index: int, cap_w: float) -> SetResult:
        """Write ``cap_w`` (W, clamped inside the limit constraints) and read both limits back.

        Raises:
            UserInputError: ``cap_w`` not finite; no such GPU.
            NvmlPermissionError: writing limits is not permitted.
            NvmlNotSupportedError: the GPU does not allow power limits.
            GpuLostError: the GPU is lost.
            NvmlError: any other device failure.
        """
        ...
