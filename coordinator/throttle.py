"""Throttling history of one node's GPUs: how many of the last minute's samples were throttled.

The view shows, per GPU, the fractions of its samples of the last :data:`WINDOW_S` seconds taken
in thermal and in power throttling (``capctl status``, Prometheus). A node's telemetry report
samples its GPUs at one time, so the history is kept per node, one entry per report, and counted
without a per-GPU step: each GPU index ``i`` (``0 <= i < capctl.security.limits.MAX_GPUS_PER_NODE``,
64) owns the bit lane ``[LANE_BITS * i, LANE_BITS * (i + 1))`` of three Python ints (sampled,
thermal, power). A report adds its three masks (bit ``LANE_BITS * i`` set for each GPU sampled,
thermal, power); a report leaving the window subtracts them. A lane counts at most
:data:`MAX_REPORTS` (4,096 < 2 ** 16) samples, so lanes never carry into one another.

Why: the per-GPU deque this replaces (``GpuObs.add_throttle``, one append, three sums and a window
check per GPU per report) cost 0.9 us per GPU per report at 8,000 GPUs (bench/interval_cost.py's
record loop with and without it, 5 Dec 2026, the 2-core test host), about a third of recording a
report; the masks cost three ``|=`` per GPU.
"""

from __future__ import annotations

import collections

WINDOW_S = 60.0
"""Window of the throttling fractions (s, the registry's monotonic clock)."""
LANE_BITS = 16
"""Bits per GPU lane (module docstring)."""
LANE_MASK = (1 << LANE_BITS) - 1
MAX_REPORTS = 4096
"""Most reports kept per node: the oldest is dropped first (a node reporting more often than
every ~15 ms keeps less than the window). Below ``2 ** LANE_BITS``: no lane carries."""


def lane(index: int) -> int:
    """The bit of GPU ``index`` (0-63) in a mask: ``1 << (LANE_BITS * index)``."""
    return 1 << (LANE_BITS * index)


def count(packed: int, index: int) -> int:
    """GPU ``index``'s count in the lane-packed int ``packed`` (:meth:`NodeThrottle.counts`)."""
    return (packed >> (LANE_BITS * index)) & LANE_MASK


class NodeThrottle:
    """The reports of the last :data:`WINDOW_S` seconds of one node, as lane masks (module
    docstring), with their running sums."""

    __slots__ = ("hist", "sums")

    def __init__(self) -> None:
        self.hist: collections.deque = collections.deque()  # (mono s, sampled, thermal, power)
        self.sums = [0, 0, 0]  # lane-packed counts: sampled, thermal, power

    def add(self, now_mono: float, sampled: int, thermal: int, power: int) -> None:
        """One report at ``now_mono`` (s): the lane masks of the GPUs it sampled, of those in
        thermal and of those in power throttling (:func:`lane`). Drops what left the window."""
        hist = self.hist
        if len(hist) >= MAX_REPORTS:
            self._drop_oldest()
        hist.append((now_mono, sampled, thermal, power))
        sums = self.sums
        sums[0] += sampled
        sums[1] += thermal
        sums[2] += power
        self._expire(now_mono)

    def counts(self, now_mono: float) -> tuple[int, int, int]:
        """``(sampled, thermal, power)`` lane-packed counts of the reports of the last
        :data:`WINDOW_S` seconds before ``now_mono`` (never earlier than a report's time or an
        earlier query); :func:`count` reads one GPU's. O(1) amortized."""
        self._expire(now_mono)
        sums = self.sums
        return sums[0], sums[1], sums[2]

    def gpu_counts(self, now_mono: float, index: int) -> tuple[int, int, int]:
        """``(samples, thermal, power)`` of GPU ``index`` over the window before ``now_mono``."""
        s, t, p = self.counts(now_mono)
        return count(s, index), count(t, index), count(p, index)

    def fractions(self, now_mono: float, index: int) -> tuple[float, float]:
        """Fractions (0-1) of GPU ``index``'s samples of the window in thermal / power throttling."""
        n, th, pw = self.gpu_counts(now_mono, index)
        return (th / n, pw / n) if n else (0.0, 0.0)

    def _expire(self, now_mono: float) -> None:
        hist = self.hist
        while hist and now_mono - hist[0][0] > WINDOW_S:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _t, sampled, thermal, power = self.hist.popleft()
        sums = self.sums
        sums[0] -= sampled
        sums[1] -= thermal
        sums[2] -= power
