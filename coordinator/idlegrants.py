"""The recent idle grants of a fleet's idle GPUs: an idle GPU is raised only with headroom that held.

With ``idle_cap_w: null`` an idle GPU gets back what the running jobs leave of each domain's limit
(:func:`coordinator.allocation.idle_from_headroom`, docs/policy.md "Idle GPUs"). That leftover moves
with every solve (pace corrections and thermal ceilings move the jobs' caps by kilowatts), and the
idle GPUs' caps followed it: on bench/thermal_ceiling.py's fleet (1,024 GPUs, one-pole plant,
constant loads, intervals 30-100, seeds 1 / 2) 50.7 / 34.8 % of the idle GPUs' intervals moved their
cap by more than 50 W (mean move 44 / 33 W), a plan and an NVML write each time for watts no job
used; with this rule 29.0 / 14.5 % (24 / 16 W).

The rule: an idle GPU's cap is the lowest of its grants of the last :data:`RAISE_INTERVALS`
intervals (this one included). A lower grant applies at once (the watts go to a running job
now); a higher one only once it has held for that many intervals. Every grant fits the domains'
limits, and a lower cap only frees watts, so the rule never puts a domain over its limit. A GPU
that was not idle in the last interval (a job just ended on it) has no history: its grant,
the pre-job limit when the budget allows, applies at once (item 4 of issue 12: "fully at job end").

State between intervals (by GPU key), kept by the coordinator beside its models: the allocation
stays a pure function (it reads :meth:`IdleGrants.recent` as an input column and returns the raw
grants; the caller :meth:`IdleGrants.record` s them).
"""

from __future__ import annotations

import math

import numpy as np

RAISE_INTERVALS = 3
"""Intervals a higher idle grant must hold before an idle GPU's cap is raised to it (this one
included). Three: one interval of headroom is often a solve's transient (pace corrections move
a job's caps for an interval or two, coordinator/paceloop.py); more delays the pre-job limit's
return after another job's caps came down by ``RAISE_INTERVALS - 1`` intervals."""


class IdleGrants:
    """The raw idle grants (W) of the last ``RAISE_INTERVALS - 1`` intervals, by GPU key."""

    def __init__(self, raise_intervals: int = RAISE_INTERVALS) -> None:
        self.keep = max(0, int(raise_intervals) - 1)
        self._recent: dict = {}  # GPU key -> tuple of its last raw grants (W), newest last
        self._pos: tuple = ((), {})  # (the keys tuple of the last recent() call, key -> its position)

    def recent(self, keys) -> np.ndarray:
        """[G] (W): the lowest raw grant of each GPU of ``keys`` over the kept intervals; +inf for a
        GPU without one (not idle in the last interval, or the rule off). Visits the GPUs with a
        history only (the idle ones), their positions from a map kept per ``keys`` tuple (the
        registry's slots, the same object while the topology holds). Measured (7 Dec 2026,
        bench/interval_cost.py's fleet, 8,000 GPUs, 800 idle, best of 21 in one process): 0.075 ->
        0.021 us a GPU, a lookup per GPU before."""
        n = len(keys)
        out = np.full(n, math.inf)
        if not self._recent or not n:
            return out
        if isinstance(keys, tuple):
            if self._pos[0] is not keys:
                self._pos = (keys, {k: i for i, k in enumerate(keys)})
            pos = self._pos[1]
        else:
            pos = {k: i for i, k in enumerate(keys)}
        at, low = [], []
        for k, g in self._recent.items():
            p = pos.get(k)
            if p is not None and g:
                at.append(p)
                low.append(min(g))
        if at:
            out[at] = low
        return out

    def clear(self) -> None:
        """Forget every GPU's history (no grant this interval: a failed solve; a change of leader)."""
        self._recent = {}

    def record(self, grants: dict) -> None:
        """This interval's raw grants (GPU key -> W) of the idle GPUs the rule raised or could have
        raised; every GPU left out (busy, fixed, gone) forgets its history."""
        if not self.keep:
            self.clear()
            return
        old = self._recent
        keep = self.keep
        self._recent = {k: (old.get(k, ()) + (float(w),))[-keep:] for k, w in grants.items()}
