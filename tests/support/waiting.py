"""Polling helper shared by the integration tests."""

from __future__ import annotations

import time


def wait_for(cond, timeout_s: float = 20.0, what: str = "condition", period_s: float = 0.05):
    """Poll ``cond()`` until truthy (returns its value) or fail after ``timeout_s`` naming ``what``.

    Raises:
        AssertionError: the deadline passed; the message carries the last value seen.
    """
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")
