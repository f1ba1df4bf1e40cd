"""Cap lease and failsafe of the node agent (pure logic, no I/O).

Semantics (docs/protocol.md, "Leases and failsafe"): every ``CapPlan`` renews the lease for
``lease_s`` seconds and carries ``safe_caps``. When the lease runs out, each GPU moves to
``min(current cap, safe cap)``: never above its last assignment, never back to the default limit.

The agent measures the lease on its own monotonic clock from the moment it receives the plan
(``lease_s`` after receipt), bounded by the plan's absolute ``lease_expiry_s`` when that is sooner
on the agent's wall clock, so a wall-clock jump on either side cannot stretch a lease.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


def failsafe_caps(current_w: dict[int, float], safe_w: dict[int, float]) -> dict[int, float]:
    """Return the caps to apply on lease expiry: ``{index: min(current, safe)}``, W.

    Only GPUs with both a current cap and a safe cap are named; a GPU already at or below its safe
    cap is left out (nothing to write). Never raises a cap.
    """
    out: dict[int, float] = {}
    for index, safe in safe_w.items():
        cur = current_w.get(index)
        if cur is None or safe <= 0:
            continue
        if safe < cur:
            out[index] = float(safe)
    return out


MAX_LEASE_S = 86400.0
"""Longest lease a plan may grant (s): the policy schema's maximum of ``failsafe.lease_s``."""


def renewal_problem(lease_s: float, lease_expiry_unix_s: float) -> str:
    """Why a plan's lease fields cannot renew a lease ("" when they can): ``lease_s`` must be a
    finite number in [0, :data:`MAX_LEASE_S`] s and ``lease_expiry_unix_s`` a finite Unix time
    (0: none). An infinite or absurd ``lease_s`` would keep the lease forever: the failsafe would
    never fire (found by a review)."""
    if not (math.isfinite(lease_s) and 0.0 <= lease_s <= MAX_LEASE_S):
        return f"CapPlan.lease_s {lease_s!r}: need 0 to {MAX_LEASE_S:g} s (finite)"
    if not math.isfinite(lease_expiry_unix_s):
        return f"CapPlan.lease_expiry_s {lease_expiry_unix_s!r}: need a finite Unix time (0: none)"
    return ""


@dataclass
class Lease:
    """Lease state of one agent. Times: ``time.monotonic()`` seconds unless named ``_unix_s``."""

    expiry_mono_s: float | None = None
    safe_caps_w: dict[int, float] = field(default_factory=dict)
    expired_applied: bool = False  # failsafe caps applied for the current expiry

    def renew(self, lease_s: float, lease_expiry_unix_s: float = 0.0, *, now_mono_s: float | None = None,
              now_unix_s: float | None = None) -> None:
        """Renew from a plan: expiry = now + lease_s (or sooner per ``lease_expiry_unix_s``)."""
        now_mono = time.monotonic() if now_mono_s is None else now_mono_s
        now_unix = time.time() if now_unix_s is None else now_unix_s
        candidates = []
        if lease_s > 0:
            candidates.append(now_mono + lease_s)
        if lease_expiry_unix_s > 0:
            remaining = lease_expiry_unix_s - now_unix
            # a coordinator clock far ahead must not stretch the lease beyond lease_s
            candidates.append(now_mono + max(0.0, remaining))
        if candidates:
            self.expiry_mono_s = min(candidates)
            self.expired_applied = False

    def set_safe_caps(self, caps_w: dict[int, float]) -> dict[int, float]:
        """Update the failsafe caps (W per NVML index) with those a plan or Welcome carries; GPUs it
        does not name keep their last safe cap (a plan may cover a subset of the node's GPUs).
        A value that is no finite number of watts above 0 (NaN, infinite, <= 0, not a number) is
        never taken: the GPU keeps its last safe cap (a NaN would win the failsafe's ``min`` and be
        written; found by a review). Returns the refused ones (index -> value as given)."""
        refused = {}
        for k, v in caps_w.items():
            try:
                w = float(v)
            except (TypeError, ValueError):
                w = math.nan
            if math.isfinite(w) and w > 0:
                self.safe_caps_w[int(k)] = w
            else:
                refused[k] = v
        return refused

    def active(self, now_mono_s: float | None = None) -> bool:
        """True while a lease is held and not yet expired."""
        now = time.monotonic() if now_mono_s is None else now_mono_s
        return self.expiry_mono_s is not None and now < self.expiry_mono_s

    def expired(self, now_mono_s: float | None = None) -> bool:
        """True when a lease was held and has run out."""
        now = time.monotonic() if now_mono_s is None else now_mono_s
        return self.expiry_mono_s is not None and now >= self.expiry_mono_s

    def remaining_s(self, now_mono_s: float | None = None) -> float | None:
        now = time.monotonic() if now_mono_s is None else now_mono_s
        return None if self.expiry_mono_s is None else self.expiry_mono_s - now
