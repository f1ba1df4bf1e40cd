"""Cap lease and failsafe of the node agent (pure logic, no I/O).

Semantics (docs/protocol.md, "Leases and failsafe"): every ``CapPlan`` renews the lease for
``lease_s`` seconds and carries ``safe_caps``. When the lease runs out, each GPU moves to
``min(current cap, safe cap)``: never above its last assignment, never back to the default limit.

The agent measures the lease on its own monotonic clock from the moment it receives the plan
(``lease_s`` after receipt), bounded by the plan's absolute ``lease_expiry_s`` when that is sooner
on the agent's wall clock, so a wall-clock jump on either side cannot stretch a lease.

A plan whose ``lease_expiry_s`` is not after the agent's wall clock on arrival (the expiry
:meth:`Lease.renew` would compute is not after now: :func:`late_s`) arrived after its lease
expiry: it was queued while the agent was stopped, or its stream was held up past the lease. It
renews nothing (a lease still held ends at once: the failsafe applies at the next tick), and the
agent takes only what lowers a GPU from it (nodeagent/loop.py). Its lateness is measured against
the coordinator's clock, as the bound of every lease already is. The coordinator's lease clock is
its host's wall clock at its start advanced by its monotonic clock (a wall-clock jump after the
start moves nothing); when it is behind the agent's wall clock by more than the lease (the
coordinator started while its host's clock was behind, before NTP set it; its host suspended
since: the monotonic clock stops), every plan arrives late: the agents hold their failsafe caps
and say why in every ack. That is the safe direction, and what such a skew did before too (a
lease of 0 s: the failsafe at the next tick, taken back by the next plan's raises);
docs/protocol.md asks for clocks within a small part of the lease (NTP).
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


def late_s(lease_expiry_unix_s: float, now_unix_s: float | None = None) -> float | None:
    """How long (s, >= 0) after its lease expiry a plan arrives: ``now_unix_s`` (this agent's wall
    clock, Unix s; None: now) less the plan's ``lease_expiry_unix_s``. None when the plan's lease
    has not run out, or it names no expiry (0). When it is not None, :meth:`Lease.renew` computes
    an expiry that is not after now (``lease_s`` cannot make it later than the absolute bound): such
    a plan renews no lease and raises no cap (the module doc)."""
    if lease_expiry_unix_s <= 0:
        return None
    now_unix = time.time() if now_unix_s is None else now_unix_s
    late = now_unix - lease_expiry_unix_s
    return late if late >= 0 else None


@dataclass
class Lease:
    """Lease state of one agent. Times: ``time.monotonic()`` seconds unless named ``_unix_s``."""

    expiry_mono_s: float | None = None
    safe_caps_w: dict[int, float] = field(default_factory=dict)
    expired_applied: bool = False  # failsafe caps applied for the current expiry

    def renew(self, lease_s: float, lease_expiry_unix_s: float = 0.0, *, now_mono_s: float | None = None,
              now_unix_s: float | None = None) -> bool:
        """Renew from a plan: expiry = now + ``lease_s`` (s), or sooner per ``lease_expiry_unix_s``
        (a Unix time on the coordinator's lease clock, read on this agent's wall clock; 0: none).
        Returns True when the lease runs past now. A plan that arrived after its lease expiry
        (:func:`late_s`: the expiry computed is not after now) renews nothing and returns False: a
        lease still held ends now (the failsafe re-armed), one run out already is left as it is
        (its failsafe, applied or due, not re-armed). Neither field set: nothing changes (False)."""
        now_mono = time.monotonic() if now_mono_s is None else now_mono_s
        now_unix = time.time() if now_unix_s is None else now_unix_s
        candidates = []
        if lease_s > 0:
            candidates.append(now_mono + lease_s)
        if lease_expiry_unix_s > 0:
            remaining = lease_expiry_unix_s - now_unix
            # a coordinator clock far ahead must not stretch the lease beyond lease_s
            candidates.append(now_mono + max(0.0, remaining))
        if not candidates:
            return False
        expiry = min(candidates)
        if expiry <= now_mono:  # arrived after its lease expiry: never a renewal
            if not self.expired(now_mono):
                self.expiry_mono_s = now_mono
                self.expired_applied = False
            return False
        self.expiry_mono_s = expiry
        self.expired_applied = False
        return True

    def set_safe_caps(self, caps_w: dict[int, float], *, only_lower: bool = False) -> dict[int, float]:
        """Update the failsafe caps (W per NVML index) with those a plan or Welcome carries; GPUs it
        does not name keep their last safe cap (a plan may cover a subset of the node's GPUs).
        A value that is no finite number of watts above 0 (NaN, infinite, <= 0, not a number) is
        never taken: the GPU keeps its last safe cap (a NaN would win the failsafe's ``min`` and be
        written; found by a review). ``only_lower`` (a plan that arrived after its lease expiry):
        a value not below the GPU's last safe cap is left out (not refused). Returns the refused
        ones (index -> value as given)."""
        refused = {}
        for k, v in caps_w.items():
            try:
                w = float(v)
            except (TypeError, ValueError):
                w = math.nan
            if not (math.isfinite(w) and w > 0):
                refused[k] = v
            elif not only_lower or w < self.safe_caps_w.get(int(k), math.inf):
                self.safe_caps_w[int(k)] = w
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
