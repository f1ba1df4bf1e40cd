"""The published, immutable picture of one reconcile interval (what Admin and metrics read).

The reconcile loop builds a :class:`View` at the end of every interval and swaps it in atomically;
the Admin service (event-loop thread) and the Prometheus collector (its HTTP thread) only read it.
Units: W, degC, MHz, s, J.
"""

from __future__ import annotations

import dataclasses
import math
import threading

from capctl.v1 import capctl_pb2 as pb

GpuKey = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class GpuExtra:
    """Per-GPU figures that are only exported as metrics."""

    node: str
    index: int
    uuid: str
    job_id: str
    thermal_fraction: float  # of samples in the window with a thermal slowdown reason
    power_fraction: float  # of samples in the window with a power-cap reason
    throttle_intensity: float  # 1 - sm_clock / max_sm_clock (0 when idle or unknown)
    hotspot_margin_c: float  # slowdown temperature - temperature (NaN if unknown)
    energy_j: float


@dataclasses.dataclass(frozen=True)
class JobExtra:
    """Per-job figures for Explain and metrics."""

    slowest: GpuKey | None
    domains: tuple[str, ...]  # every domain holding one of its GPUs, root first
    energy_j: float
    weight: float
    planned_slowest: GpuKey | None = None  # the solve's slowest, where a measurably slower one replaced it


@dataclasses.dataclass(frozen=True)
class View:
    """One interval's status: the proto reply plus metric-only extras."""

    status: pb.StatusReply
    gpus: tuple[GpuExtra, ...] = ()
    jobs: dict = dataclasses.field(default_factory=dict)  # job id -> JobExtra
    temp_spread_c: float = 0.0  # max - min over nodes of the mean GPU temperature
    throughput_lost: float = 0.0  # GPU-weighted mean of (1 - predicted rate) over jobs
    stale_age_s: dict = dataclasses.field(default_factory=dict)  # node -> seconds since last report
    tick_s: float = 0.0
    plans_sent: int = 0


class LazyView:
    """A :class:`View` computed on first use, from an immutable snapshot taken at the end of the
    interval (so it shows exactly what a view built then would show).

    Building the status of thousands of GPUs costs tens of milliseconds; most intervals nobody
    reads it (admins ask now and then, Prometheus scrapes every few seconds), so the reconcile
    loop only takes the snapshot and whoever reads first (event loop or exporter thread) builds
    it, once (thread-safe). ``build`` must only read the snapshot it closes over.
    """

    def __init__(self, build, tick_s: float, plans_sent: int) -> None:
        self._build = build
        self._view: View | None = None
        self._lock = threading.Lock()
        self.tick_s = tick_s
        self.plans_sent = plans_sent

    def resolve(self) -> View:
        """The built :class:`View` (built now on first call)."""
        view = self._view
        if view is None:
            with self._lock:
                if self._view is None:
                    self._view = self._build()
                    self._build = None
                view = self._view
        return view

    @property
    def status(self) -> pb.StatusReply:
        return self.resolve().status

    @property
    def gpus(self) -> tuple:
        return self.resolve().gpus

    @property
    def jobs(self) -> dict:
        return self.resolve().jobs

    @property
    def temp_spread_c(self) -> float:
        return self.resolve().temp_spread_c

    @property
    def throughput_lost(self) -> float:
        return self.resolve().throughput_lost

    @property
    def stale_age_s(self) -> dict:
        return self.resolve().stale_age_s


def empty_view(coordinator_id: str, policy, policy_path: str, dry_run: bool) -> View:
    """The view before the first interval."""
    return View(status=pb.StatusReply(
        budget_w=policy.budget_w, interval_s=policy.interval_s, dry_run=dry_run, policy_path=policy_path,
        coordinator_id=coordinator_id,
    ))


def finite(x: float, default: float = 0.0) -> float:
    """``x`` if finite else ``default`` (protobuf doubles may carry inf/NaN, JSON cannot)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else default
