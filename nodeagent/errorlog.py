"""Rate-limited ERROR lines of one node's GPUs (:class:`GpuErrorLog`, used by :mod:`nodeagent.caps`).

A GPU that cannot be read or written fails again at every interval (1 s): an NVML stall logged
136 ERROR lines in a few minutes, each a new text because it carries the stall's age (found by a
try-out). Per GPU, an error is logged at ERROR the first time; the same error (the same text once
its numbers are left out: ages, watts) is logged again at most once per :data:`REPEAT_LOG_S`,
with the count of those not logged; a different error is logged at once. When the GPU works again
one INFO line says so, with the count of repeats not logged since the last line.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

REPEAT_LOG_S = 60.0
"""The same error of one GPU is logged at most once per this many seconds (s)."""
MAX_KINDS = 64
"""Errors of one GPU remembered at once (bounded: a GPU whose errors keep changing)."""
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def error_kind(text: str) -> str:
    """``text`` with its numbers left out (``GPU #: ... after #s``): two lines of the same error."""
    return _NUMBER.sub("#", text)


@dataclass
class _Seen:
    first_s: float  # when this error was first logged (the log's clock, s)
    logged_s: float  # when a line of it was last logged (s)
    repeats: int = 0  # times it recurred since, not logged


class GpuErrorLog:
    """Per-GPU error lines at ERROR, rate-limited, and one INFO line when the GPU recovers.

    Args:
        log: the logger to write to.
        clock: monotonic time source (s; default :func:`time.monotonic`, looked up at each call).
    """

    def __init__(self, log: logging.Logger, clock: Callable[[], float] | None = None) -> None:
        self.log = log
        self.clock = clock or (lambda: time.monotonic())
        self._seen: dict[int, dict[str, _Seen]] = {}  # GPU index -> error kind -> when logged

    def error(self, index: int, text: str) -> bool:
        """Log ``text`` (an error of GPU ``index``) at ERROR unless the same error was logged for it
        within :data:`REPEAT_LOG_S`; the repeats not logged are counted in the next line. Returns
        whether a line was written."""
        now_s = self.clock()
        kinds = self._seen.setdefault(index, {})
        kind = error_kind(text)
        seen = kinds.get(kind)
        if seen is not None and now_s - seen.logged_s < REPEAT_LOG_S:
            seen.repeats += 1
            return False
        more = (f" (and {seen.repeats} times more in {now_s - seen.logged_s:.0f} s)"
                if seen is not None and seen.repeats else "")
        self.log.error("%s%s", text, more)
        if seen is None and len(kinds) >= MAX_KINDS:
            kinds.clear()
        kinds[kind] = _Seen(seen.first_s if seen is not None else now_s, now_s)
        return True

    def cleared(self, index: int, what: str) -> bool:
        """GPU ``index`` works again (``what``: "readable" or "written"): one
        INFO line if an error of it was logged, with the repeats not logged since; forgets its
        errors (the next one is logged at once). Returns whether a line was written."""
        kinds = self._seen.pop(index, None)
        if not kinds:
            return False
        repeats = sum(s.repeats for s in kinds.values())
        since_s = self.clock() - min(s.first_s for s in kinds.values())
        extra = f", {repeats} repeat(s) since the last line not logged" if repeats else ""
        self.log.info("GPU %d: %s again; its error cleared (first logged %.0f s ago%s)", index, what, since_s, extra)
        return True

    def failing(self, index: int) -> bool:
        """Whether an error of GPU ``index`` was logged and has not cleared."""
        return bool(self._seen.get(index))
