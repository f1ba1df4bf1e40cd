"""When the agent's next telemetry report is due (docs/protocol.md, "Report timing"). Pure logic on
monotonic seconds (a lock, no I/O); imports nothing of ours.

The agent reports every ``interval_s`` from its own start unless the coordinator advises otherwise:
each ``CapPlan.report_in_s`` (> 0) moves the next report to that many seconds after the plan's
receipt, so that it lands shortly before the coordinator's next reconcile; the reports after it
follow every interval until the next advice (the coordinator renews it with every plan). An advice
outside (0, :data:`MAX_ADVICE_INTERVALS` x interval] or not finite is ignored (the period goes
on), so a faulty coordinator can neither stop the reports nor make them run back to back.
"""

from __future__ import annotations

import math
import threading

MAX_ADVICE_INTERVALS = 2.0
"""The longest advice followed, in intervals (s/s); the coordinator's are within (0, 2] intervals."""


class ReportClock:
    """The due time (monotonic s) of the next report; thread-safe (link thread advises, loop
    thread waits and reports). ``advised`` counts the advices followed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due_mono: float | None = None  # None: report at once (start, welcome)
        self.advised = 0

    def due_mono(self, now_mono: float) -> float:
        """When the next report is due (monotonic s); ``now_mono`` when it is due now."""
        with self._lock:
            return now_mono if self._due_mono is None else self._due_mono

    def report_now(self, now_mono: float, delay_s: float = 0.0) -> None:
        """Make the next report due ``delay_s`` seconds after ``now_mono`` (e.g. after a Welcome)."""
        with self._lock:
            self._due_mono = now_mono + max(0.0, delay_s)

    def advise(self, report_in_s: float, now_mono: float, interval_s: float) -> bool:
        """Follow the coordinator's advice: next report ``report_in_s`` seconds after ``now_mono``
        (the plan's receipt). Returns False (nothing changed) for 0 (no advice) or an advice
        outside (0, MAX_ADVICE_INTERVALS x ``interval_s``]."""
        if not (math.isfinite(report_in_s) and 0.0 < report_in_s <= MAX_ADVICE_INTERVALS * interval_s):
            return False
        with self._lock:
            self._due_mono = now_mono + report_in_s
            self.advised += 1
        return True

    def reported(self, started_mono: float, interval_s: float) -> None:
        """A report went out by a tick that began at ``started_mono``: the next is due one interval
        later, unless an advice received since the tick began already set a later time."""
        with self._lock:
            if self._due_mono is None or self._due_mono <= started_mono:
                self._due_mono = started_mono + interval_s
