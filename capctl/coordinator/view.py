"""The published, immutable picture of one reconcile interval (what Admin and metrics read).

The reconcile loop builds a :class:`View` at the end of every interval and swaps it in atomically;
the Admin service (event-loop thread) and the Prometheus collector (its HTTP thread) only read it.
Units: W, degC, MHz, s, J.
"""

from __future__ import annotations

import dataclasses
import math

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


def empty_view(coordinator_id: str, policy, policy_path: str, dry_run: bool) -> View:
    """The view before the first interval."""
    return View(status=pb.StatusReply(
        budget_w=policy.budget_w, interval_s=policy.interval_s, dry_run=dry_run, policy_path=policy_path,
        coordinator_id=coordinator_id,
    ))


def finite(x: float, default: float = 0.0) -> float:
    """``x`` if finite else ``default`` (protobuf doubles may carry inf/NaN, JSON cannot)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else default
