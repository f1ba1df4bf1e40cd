"""A pure-Python GPU device for logic tests: :class:`PureDevice` implements
:class:`nodeagent.backend.GpuBackend` in memory (no processes, no C library, no pynvml).

Each GPU has limit constraints, a default limit and a requested limit (kept in whole mW, as NVML
does), an optional out-of-band limit (the enforced limit is the lower of the two) and a power draw.
Every write is recorded in :attr:`PureDevice.writes`; errors are injected per operation and GPU
with :meth:`PureDevice.fail` or by losing a GPU (:meth:`PureDevice.lose`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from capctl.errors import UserInputError
from nodeagent.backend import DeviceInfo, GpuLostError, GpuSample, NvmlError, SetResult

OPERATIONS = ("clamp", "get_cap", "get_enforced", "set", "telemetry", "device")
"""Operations :meth:`PureDevice.fail` can make fail."""


@dataclass
class PureGpu:
    """State of one simulated GPU (limits in mW, power in W)."""

    min_mw: int
    max_mw: int
    default_mw: int
    limit_mw: int
    power_w: float = 100.0
    oob_mw: int | None = None  # an out-of-band limit (BMC/chassis) below the requested one, or None
    lost: bool = False
    energy_j: float = 0.0  # the total-energy counter (J); tests move it


class PureDevice:
    """In-memory :class:`~nodeagent.backend.GpuBackend` with ``gpus`` identical GPUs.

    Args:
        gpus: number of GPUs.
        min_cap_w, max_cap_w: limit constraints (W).
        default_cap_w: default limit (W).
        limit_w: requested limit at start (W; default: ``default_cap_w``).
    """

    driver_version: str | None = "pure-1.0"
    simulated: bool = True

    def __init__(self, gpus: int = 4, *, min_cap_w: float = 200.0, max_cap_w: float = 700.0,
                 default_cap_w: float = 700.0, limit_w: float | None = None) -> None:
        start_mw = _mw(default_cap_w if limit_w is None else limit_w)
        self.gpus = [PureGpu(_mw(min_cap_w), _mw(max_cap_w), _mw(default_cap_w), start_mw) for _ in range(gpus)]
        self.writes: list[tuple[int, float]] = []  # (index, W written) in write order
        self._failures: dict[tuple[str, int], Exception] = {}

    # -- test controls -----------------------------------------------------------------------
    def fail(self, operation: str, index: int, error: Exception | None) -> None:
        """Make ``operation`` (one of :data:`OPERATIONS`) on GPU ``index`` raise ``error`` until
        cleared with ``error=None``."""
        if operation not in OPERATIONS:
            raise ValueError(f"operation {operation!r}: one of {OPERATIONS}")
        if error is None:
            self._failures.pop((operation, index), None)
        else:
            self._failures[(operation, index)] = error

    def lose(self, index: int, lost: bool = True) -> None:
        """GPU ``index`` falls off the bus: every call on it raises :class:`GpuLostError`."""
        self.gpus[index].lost = lost

    def set_limit_w(self, index: int, limit_w: float) -> None:
        """Another writer (nvidia-smi, a driver reload) sets the requested limit; not in :attr:`writes`."""
        self.gpus[index].limit_mw = _mw(limit_w)

    def limit_w(self, index: int) -> float:
        """Requested limit of GPU ``index`` now (W)."""
        return self.gpus[index].limit_mw / 1000.0

    def limits_w(self) -> list[float]:
        """Requested limits of every GPU now (W)."""
        return [self.limit_w(i) for i in range(len(self.gpus))]

    # -- GpuBackend --------------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        """Static facts; a lost GPU carries ``error`` (numbers NaN), as NvmlBackend reports it."""
        out = []
        for i, g in enumerate(self.gpus):
            if g.lost:
                nan = math.nan
                out.append(DeviceInfo(i, "", "", -1, "", nan, nan, nan, nan, nan, 0, error=f"GPU {i}: lost"))
                continue
            out.append(DeviceInfo(
                index=i, uuid=f"GPU-pure-{i:04d}", name="Pure GPU", minor_number=i,
                pci_bus_id=f"00000000:{0x18 + i:02x}:00.0", min_cap_w=g.min_mw / 1000.0,
                max_cap_w=g.max_mw / 1000.0, default_cap_w=g.default_mw / 1000.0,
                slowdown_temp_c=87.0, shutdown_temp_c=92.0, max_sm_clock_mhz=1980))
        return out

    def device(self, index: int) -> DeviceInfo:
        """Static facts of GPU ``index`` (a call on the GPU, as NvmlBackend.device re-reads a failed one)."""
        try:
            self._gpu(index, "device")
        except NvmlError:
            pass  # a lost GPU: its facts carry the error
        return self.devices()[index]

    def telemetry_all(self) -> list[GpuSample]:
        samples = []
        for i in range(len(self.gpus)):
            try:
                samples.append(self._sample(i))
            except NvmlError as err:
                samples.append(GpuSample.failed(i, err, time.time()))
        return samples

    def telemetry(self, index: int) -> GpuSample:
        return self._sample(index)

    def clamp_cap_mw(self, index: int, cap_w: float) -> int:
        g = self._gpu(index, "clamp")
        if isinstance(cap_w, bool) or not isinstance(cap_w, (int, float)) or not math.isfinite(cap_w):
            raise UserInputError(f"cap_w: {cap_w!r} is not a finite number of watts")
        return min(max(math.floor(round(float(cap_w) * 1000.0, 3)), g.min_mw), g.max_mw)

    def get_cap_w(self, index: int) -> float:
        return self._gpu(index, "get_cap").limit_mw / 1000.0

    def get_enforced_w(self, index: int) -> float:
        return self._enforced_mw(self._gpu(index, "get_enforced")) / 1000.0

    def set_cap_w(self, index: int, cap_w: float) -> SetResult:
        value_mw = self.clamp_cap_mw(index, cap_w)
        g = self._gpu(index, "set")
        g.limit_mw = value_mw
        self.writes.append((index, value_mw / 1000.0))
        return SetResult(index=index, requested_w=float(cap_w), written_w=value_mw / 1000.0,
                         cap_w=g.limit_mw / 1000.0, enforced_w=self._enforced_mw(g) / 1000.0,
                         clamped=math.floor(round(float(cap_w) * 1000.0, 3)) != value_mw)

    # -- internals ---------------------------------------------------------------------------
    def _gpu(self, index: int, operation: str) -> PureGpu:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.gpus):
            raise UserInputError(f"gpu index: {index!r} does not exist on this node; allowed "
                                 f"0..{len(self.gpus) - 1}")
        g = self.gpus[index]
        if g.lost:
            raise GpuLostError(f"GPU {index}: {operation} failed: GPU is lost", gpu_index=index)
        err = self._failures.get((operation, index))
        if err is not None:
            raise err
        return g

    @staticmethod
    def _enforced_mw(g: PureGpu) -> int:
        return g.limit_mw if g.oob_mw is None else min(g.limit_mw, g.oob_mw)

    def _sample(self, index: int) -> GpuSample:
        g = self._gpu(index, "telemetry")
        enforced_w = self._enforced_mw(g) / 1000.0
        return GpuSample(
            index=index, power_w=min(g.power_w, enforced_w), cap_w=g.limit_mw / 1000.0, enforced_w=enforced_w,
            temp_c=60.0, sm_clock_mhz=1800, max_sm_clock_mhz=1980, clocks_event_reasons=(),
            utilization_pct=90.0, energy_j=g.energy_j, min_cap_w=g.min_mw / 1000.0, max_cap_w=g.max_mw / 1000.0,
            timestamp_s=time.time(), slowdown_temp_c=87.0, shutdown_temp_c=92.0)


def _mw(value_w: float) -> int:
    return int(round(value_w * 1000.0))
