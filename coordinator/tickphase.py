"""The coordinator's tick grid and the report timing it advises each agent (docs/protocol.md,
"Report timing"). Pure functions of monotonic times in seconds; no I/O.

Why: an agent that reports every interval from its own start has a phase uniform in
[0, interval) against the coordinator's reconcile, so its report waits that long before any
decision uses it: the p99 of report -> enforced is then at least ~0.99 interval before any work
(bench/control_loop.py). The coordinator therefore keeps its regular ticks on a fixed grid
(:func:`next_grid_tick`: an early tick for a job event does not move it) and tells each agent, in
every ``CapPlan.report_in_s``, when to send its next report so that it lands a *lead* before the
next grid tick (:func:`report_in_s`). The leads of the nodes are spread over
[:data:`LEAD_MIN_FRACTION`, :data:`LEAD_MAX_FRACTION`] of the interval by a hash of the node name
(:func:`lead_s`): the reports of 1,000 agents arrive over a window instead of in one burst, and
each is read before the tick's snapshot.

The advice is relative ("in X s after you receive this"), computed when the plan is written to
the stream, so neither the clock offset between hosts nor the time the plan waited in the
coordinator's queue enters it; it is renewed with every plan (at least one per interval), so
clock-rate drift and a changed grid (restart, HA leader change: the new leader's plans carry its
own grid, an older term's plans are refused before their advice is read) are corrected within one
interval.
"""

from __future__ import annotations

import math
import zlib

LEAD_MIN_FRACTION = 0.08
"""Earliest report lead before a grid tick, as a fraction of the interval (s/s): covers the plan's
delivery and the agent's own wake-up and NVML reads (measured on loopback: a few ms; 80 ms at a
1 s interval leaves room for a loaded host)."""
LEAD_MAX_FRACTION = 0.30
"""Latest report lead, as a fraction of the interval (s/s): the window [min, max] over which the
nodes' reports are spread so that the coordinator reads them (~0.1-0.2 ms each) before its tick.
A report is then at most this old (plus the tick's work) when its decision is taken."""
MIN_ADVICE_FRACTION = 0.1
"""An advice is at least this fraction of an interval ahead (s/s). A plan written later than the
lead before the next grid tick (a reconcile that took most of the interval, or overran it) asks
for the report this soon rather than one interval later: it still reaches the next snapshot,
which waits a little for reports not yet read (coordinator.loop.REPORT_GRACE). Measured at 1,000
agents on a loaded 2-core host, plans arriving 0.7-1.4 s after their snapshot: aiming at the grid
point after sent ~90 % of the reports one reconcile late."""


def lead_s(node: str, interval_s: float) -> float:
    """The report lead (s) of ``node`` before a grid tick: a stable point of
    [LEAD_MIN_FRACTION, LEAD_MAX_FRACTION] x ``interval_s`` from the CRC-32 of its name (the same
    on every coordinator, so a restart or a failover keeps each node's place in the window)."""
    frac = zlib.crc32(node.encode("utf-8", "replace")) / 2**32
    return interval_s * (LEAD_MIN_FRACTION + (LEAD_MAX_FRACTION - LEAD_MIN_FRACTION) * frac)


def report_in_s(next_tick_mono: float, now_mono: float, node: str, interval_s: float) -> float:
    """Seconds from ``now_mono`` until ``node`` should send its next report: ``lead_s`` before the
    grid tick at ``next_tick_mono`` (monotonic s), but at least :data:`MIN_ADVICE_FRACTION` of an
    interval (a late plan: report soon). Always in (0, 2 x interval]; 0.0 (no advice) when the
    interval or the times are not finite and positive."""
    if not (interval_s > 0 and math.isfinite(interval_s) and math.isfinite(next_tick_mono) and math.isfinite(now_mono)):
        return 0.0
    due = next_tick_mono - lead_s(node, interval_s) - now_mono
    return min(max(due, MIN_ADVICE_FRACTION * interval_s), 2.0 * interval_s)


BUSY_MARGIN = 0.05
"""When reconciles take longer than the interval, the grid stretches to the last one's duration
plus this fraction (s/s), so that the next grid point comes when the coordinator can start it."""


def next_grid_tick(grid_mono: float, now_mono: float, interval_s: float, busy_s: float = 0.0) -> float:
    """The next regular tick (monotonic s) after the one of the grid at ``grid_mono`` that starts at
    ``now_mono``: one interval later. ``busy_s``: how long the last regular reconcile took (s); when
    it exceeds the interval (an overloaded coordinator) the grid stretches to ``busy_s`` x (1 +
    :data:`BUSY_MARGIN`) from now, so that the next tick, and the reports advised for it, come when
    it can run rather than one interval late. After a pause (the tick began more than an interval
    late) the grid skips the missed ticks, keeping its phase, rather than firing them back to back;
    after an interval change that put ``grid_mono`` more than an interval ahead, it restarts at
    ``now_mono + interval_s``."""
    nxt = grid_mono + interval_s
    if nxt <= now_mono:
        nxt += math.ceil((now_mono - nxt) / interval_s + 1e-9) * interval_s
    if nxt - now_mono > interval_s + 1e-9:
        nxt = now_mono + interval_s
    if busy_s > interval_s and math.isfinite(busy_s):
        nxt = max(nxt, now_mono + min(busy_s * (1.0 + BUSY_MARGIN), 10.0 * interval_s))
    return nxt
