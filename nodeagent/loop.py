"""The node agent's control loop: boot failsafe, AgentLink callbacks and the periodic tick.

- Boot (:meth:`AgentLoop.boot_safe_caps`): GPUs found at their default limit while a safe cap is
  known are moved to it before the agent reports ready.
- Link callbacks: ``hello`` for each (re)connect, ``on_welcome`` (interval, safe caps),
  ``on_plan`` (renew the lease, apply the caps decreases first, answer ``CapAck``; a plan that
  arrived after its lease expiry renews nothing and only lowers caps).
- Tick (every ``interval_s`` seconds, :meth:`AgentLoop.tick`): retry pending restores, apply the
  failsafe once when the lease has run out (caps only ever go down: min(current, safe cap)),
  reconcile drift, send telemetry. The coordinator's ``CapPlan.report_in_s`` moves the next tick so
  that the report lands just before its reconcile (:mod:`nodeagent.reportclock`, docs/protocol.md
  "Report timing"); without advice the agent keeps its own period.
"""

from __future__ import annotations

import functools
import logging
import math
import time

from capctl import __version__, capstates, plancaps
from capctl.errors import CapctlError
from nodeagent import messages
from nodeagent.core import AgentCore
from nodeagent.lease import failsafe_caps, late_s, renewal_problem
from nodeagent.link import LeaveCoordinator
from nodeagent.reportclock import ReportClock

log = logging.getLogger("capctl.agent")

AGENT_VERSION = __version__  # the one version (capctl/__init__.py)
BOOT_DEFAULT_TOLERANCE_W = 1.0
"""A GPU whose limit is within this many W of its default limit counts as "at its default"."""
PHASE_DECREASE = "decrease"
"""``CapPlan.phase`` of the first phase of a reallocation: caps only come down (docs/protocol.md)."""
PHASES = (PHASE_DECREASE, "increase", "hold", "")
"""The ``CapPlan.phase`` values an agent takes (docs/protocol.md; "" from a peer that sets none: a
plan without the phase-1 rule); a plan of another phase is refused."""
WAKE_CHECK_S = 0.5
"""The loop wakes at least this often (s) so that a lease expiry is acted on promptly."""
WELCOME_REPORT_DELAY_S = 0.05
"""After a Welcome the next report goes out this many seconds later (s): the link finishes its
handshake first; the coordinator needs the enforced caps before it plans."""


class AgentLoop(AgentCore):
    """Boot, link callbacks and the periodic work of the agent (see the module doc)."""

    @functools.cached_property
    def report_clock(self) -> ReportClock:
        """When the next report is due (:mod:`nodeagent.reportclock`)."""
        return ReportClock()

    # ------------------------------------------------------------------------------------------
    # boot
    def boot_safe_caps(self) -> None:
        """Move GPUs found at their default limit to the known safe cap (W) before ready; keep bound
        GPUs where they are now (a restart never resets caps). Errors are logged per GPU, not raised."""
        samples = self.backend.telemetry_all()
        self.last_samples = samples
        bound = self.bound_indices()
        todo_bound: dict[int, float] = {}
        for s in samples:
            if getattr(s, "error", None):
                continue
            dev = self.devices.get(s.index)
            safe = self._safe_cap_for(s.index)
            if dev is None or safe is None:
                continue
            if abs(s.cap_w - dev.default_cap_w) <= BOOT_DEFAULT_TOLERANCE_W and safe < s.cap_w:
                cap = self._clamp(s.index, safe)
                if s.index in bound:
                    todo_bound[s.index] = cap
                else:
                    self._boot_cap_unbound(s.index, cap, dev.default_cap_w)
        if todo_bound:
            log.warning("boot: bound GPUs %s at their default limit; applying safe caps", sorted(todo_bound))
            self._apply(todo_bound)
            self.desired_w.update(todo_bound)
        # keep bound GPUs where they are now (restart never resets caps)
        self.last_samples = self.backend.telemetry_all()
        for s in self.last_samples:
            if s.index in bound and s.index not in self.desired_w and getattr(s, "error", None) is None:
                self.desired_w[s.index] = s.cap_w

    def arm_boot_lease(self, now_mono_s: float | None = None) -> None:
        """Give the agent, at start, the last lease a plan gave it (``lease_s``, saved; the policy's
        default 30 s before any): when no plan renews it by then, the failsafe applies
        min(current, safe cap) as after any lease expiry. An agent restarted while its coordinator
        was down held no lease at all, so its GPUs stayed at the last caps for good, above what the
        policy allows without a coordinator (found by a review: 550 W kept, 350 W the safe cap)."""
        self.lease.renew(self.lease_s, now_mono_s=now_mono_s)
        if self.lease.safe_caps_w or self.policy_safe_cap_w:
            log.info("no lease yet: the failsafe applies the safe caps in %.0f s unless a coordinator plans first",
                     self.lease_s)

    def _boot_cap_unbound(self, index: int, cap_w: float, default_w: float) -> None:
        """Unbound GPU at its default limit: the safe cap ``cap_w`` (W) becomes its limit; no pre-job
        limit is saved for it. A failure is logged and kept in ``gpu_error``."""
        try:
            self.backend.set_cap_w(index, cap_w)
            log.warning("boot: GPU %d was at its default limit %.0f W; safe cap %.0f W applied",
                        index, default_w, cap_w)
            # kept by the reconcile (a driver reload resets limits to the default: it left idle
            # GPUs at 700 W while no coordinator had been reached; found by a review)
            self.desired_w[index] = cap_w
        except CapctlError as err:
            self.gpu_error[index] = str(err)
            log.error("boot: GPU %d: cannot apply the safe cap: %s", index, err)

    # ------------------------------------------------------------------------------------------
    # link callbacks
    def hello(self):
        """The ``AgentHello`` for a (re)connect: GPUs re-read from the backend, bindings, last plan seq,
        the newest coordinator term seen."""
        with self.lock:
            self.devices = {d.index: d for d in self.backend.devices()}
            self.resend_ended = True  # the next report repeats the ended jobs' energy (nodeagent.energy)
            return messages.hello(
                node=self.node, agent_version=AGENT_VERSION, driver_version=self.backend.driver_version,
                simulated=bool(self.backend.simulated),
                gpus=[self._gpu_info(d) for d in sorted(self.devices.values(), key=lambda d: d.index)],
                jobs=[self._binding(j) for j in sorted(self.jobs)], last_plan_seq=self.last_plan_seq,
                coordinator_term=self.fence.newest,  # a leader below it raises its term (docs/ha.md)
            )

    def on_welcome(self, welcome) -> None:
        """Take the coordinator's interval (s) and initial safe caps (W); send telemetry right away."""
        with self.lock:
            if welcome.interval_s > 0:
                self.interval_s = float(welcome.interval_s)
            if welcome.coordinator_id != self.coordinator_id:
                self.coordinator_id = welcome.coordinator_id
            self.packed_readings = bool(welcome.packed_readings)  # per stream: an older coordinator reads GpuTelemetry
            self.fence.see(welcome.term)
            self.stream_seq = 0  # plan seqs rise strictly within one stream (docs/protocol.md)
            safe = {c.index: c.cap_w for c in welcome.safe_caps[:plancaps.MAX_CAPS]}
            refused = self.lease.set_safe_caps({i: v for i, v in safe.items() if i in self.devices})
            refused.update({i: v for i, v in safe.items() if i not in self.devices})
            if refused:
                log.warning("welcome: safe caps %s refused (need finite watts > 0 for a GPU of this node): the last ones "
                            "kept", dict(list(refused.items())[:8]))
            self.save_state()
        # telemetry right away: the coordinator needs our enforced caps before planning
        self.report_clock.report_now(time.monotonic(), WELCOME_REPORT_DELAY_S)
        self.wake.set()

    def on_plan(self, plan):
        """Apply a ``CapPlan`` (renew the lease, update safe caps, set caps clamped to the limit
        constraints unless ``dry_run``) and return its ``CapAck`` with the read-back of the GPUs it
        named; a plan without caps (a hold) is not acknowledged (None: docs/protocol.md, "hold"):
        its read-back would only repeat the telemetry. Unknown GPUs, caps or safe caps that are no
        finite watts above 0 make ``ok`` false (a refused safe cap keeps the last one). A plan
        whose packed rows cannot be read (capctl.plancaps) is not taken at all (no lease renewal,
        no cap, no safe cap, its seq not recorded) and is answered ``ok`` false with the reason,
        a hold too. A plan that arrived after its lease expiry (nodeagent.lease.late_s) is taken
        only as far as it lowers GPUs (:meth:`_on_late_plan`), a hold too answered ``ok`` false.
        Never raises for a bad cap or a failed write: they are reported in the ack."""
        received_mono = time.monotonic()
        with self.lock:
            refused = self.fence.admit(plan.term)
            if refused:  # an older leader's plan: no cap changed, no lease renewed (nodeagent/fencing.py)
                log.warning("%s; leaving that coordinator", refused)
                raise LeaveCoordinator(refused)
            caps, safe, problem = plancaps.of_plan(plan)  # per-GPU or packed rows (capctl.plancaps)
            problem = problem or renewal_problem(plan.lease_s, plan.lease_expiry_s) or self._order_problem(plan)
            if problem:  # a plan that cannot be read: not taken (no lease renewed, no cap, no safe
                # cap, seq not advanced, its report advice not followed), only answered, so that
                # the coordinator logs why
                log.warning("plan %d refused: %s", plan.seq, problem)
                return messages.cap_ack(plan.seq, False, [], [problem], packed=self.packed_readings)
            now_mono, now_unix = time.monotonic(), time.time()  # (after any wait for the lock)
            late = late_s(plan.lease_expiry_s, now_unix)
            if late is not None:
                return self._on_late_plan(plan, caps, safe, late, now_mono, now_unix)
            if self.report_clock.advise(plan.report_in_s, received_mono, self.interval_s):
                self.wake.set()  # the loop re-reads when its next report is due
            self.lease.renew(plan.lease_s, plan.lease_expiry_s, now_mono_s=now_mono, now_unix_s=now_unix)
            if plan.lease_s > 0:
                self.lease_s = float(plan.lease_s)
            errors: list[str] = []
            safe_changed, safe_ok = self._take_safe_caps(plan.seq, safe, errors)
            if self.safe_mode:
                log.info("lease renewed by plan %d: leaving the failsafe on GPUs %s", plan.seq, sorted(self.safe_mode))
                self.safe_mode.clear()
            self.dry_run_plans = bool(plan.dry_run)
            ok = self._apply_plan_caps(caps, plan.phase, errors) if not plan.dry_run and caps else True
            self._took_plan(plan, safe_changed)
            if not caps:  # a hold: lease and safe caps only, no read-back (no NVML call)
                return None
            return self._ack_with_read_back(plan.seq, ok and safe_ok, caps, errors)

    def _on_late_plan(self, plan, caps: dict[int, float], safe: dict[int, float], late: float,
                      now_mono_s: float, now_unix_s: float):
        """A plan that arrived ``late`` s after its lease expiry (queued while the agent was stopped,
        a stream held up; ``now_*_s``: its receipt, monotonic and Unix s): it renews no lease (one
        still held ends now: the failsafe applies at the next tick) and does not take the GPUs out of
        the failsafe; of its caps only those below the GPU's limit, desired cap and allowance are
        applied (none in a dry run), of its safe caps only those below the last ones; its report
        advice is not followed. A raise written now would stay until the failsafe's
        min(current, safe cap) and could leave the GPU above what it had (405 W over 397 W after a
        SIGSTOP past the lease). Returns its ``CapAck``, ``ok`` false with why (a hold too, without
        read-back); its seq is recorded (a replay of it is refused)."""
        self.lease.renew(plan.lease_s, plan.lease_expiry_s, now_mono_s=now_mono_s, now_unix_s=now_unix_s)
        errors: list[str] = []
        safe_changed, _ = self._take_safe_caps(plan.seq, safe, errors, only_lower=True)
        lowered, kept = self._late_decreases(caps) if not plan.dry_run else ({}, sorted(caps))
        parts = [f"GPUs {sorted(lowered)} lowered"] if lowered else []
        parts += [f"GPUs {kept} kept at their limits"] if kept else []
        why = (f"plan {plan.seq} arrived {late:.1f} s after its lease expiry: only its decreases applied"
               + (f" ({'; '.join(parts)})" if parts else "") + ", the lease not renewed")
        log.warning("%s%s", why, "" if self.lease.expired_applied else "; the failsafe applies at the next tick")
        errors.insert(0, why)
        invalid = {i: c for i, c in caps.items() if i not in lowered and i not in kept and not plan.dry_run}
        self._apply_plan_caps({**lowered, **invalid}, PHASE_DECREASE, errors)  # (invalid: refused with why)
        self._took_plan(plan, safe_changed)
        if not caps:
            return messages.cap_ack(plan.seq, False, [], errors, packed=self.packed_readings)
        return self._ack_with_read_back(plan.seq, False, caps, errors)

    def _late_decreases(self, caps: dict[int, float]) -> tuple[dict[int, float], list[int]]:
        """Split a late plan's ``caps`` (index -> W): those it may apply, below the GPU's limit, its
        desired cap and its allowance (compared clamped, as they would be written), and the indices
        of the others (a raise, no change, or a limit that cannot be read), kept where they are.
        Unknown GPUs and caps that are no watts above 0 are in neither (refused with their reason
        by :meth:`_apply_plan_caps`)."""
        lowered: dict[int, float] = {}
        kept: list[int] = []
        for index, cap_w in sorted(caps.items()):
            if index not in self.devices or not math.isfinite(cap_w) or cap_w <= 0:
                continue
            try:
                ceiling = self.backend.get_cap_w(index)
            except CapctlError:
                kept.append(index)
                continue
            known = [v for v in (self.desired_w.get(index), self.allowed_w.get(index)) if v is not None]
            if self._clamp(index, cap_w) < min([ceiling, *known]):
                lowered[index] = cap_w
            else:
                kept.append(index)
        return lowered, kept

    def _take_safe_caps(self, seq: int, safe: dict[int, float], errors: list[str],
                        only_lower: bool = False) -> tuple[bool, bool]:
        """Take plan ``seq``'s safe caps (index -> W; ``only_lower``: only those below the last
        ones, :meth:`nodeagent.lease.Lease.set_safe_caps`); append a line per refused one (no finite
        watts above 0, a GPU this node does not have) to ``errors``. Returns (a safe cap changed by
        more than 1 W, none refused)."""
        before = dict(self.lease.safe_caps_w)
        unknown = {i: v for i, v in safe.items() if i not in self.devices}
        refused = self.lease.set_safe_caps({i: v for i, v in safe.items() if i not in unknown},
                                           only_lower=only_lower)
        changed = any(abs(before.get(i, -1e9) - v) > 1.0 for i, v in self.lease.safe_caps_w.items())
        lines = [f"GPU {i}: safe cap {v!r} W refused" for i, v in refused.items()]
        lines += [f"GPU {i} does not exist on {self.node}: its safe cap not kept" for i in sorted(unknown)[:8]]
        if lines:
            log.warning("plan %d: %s (the last safe caps kept)", seq, "; ".join(lines))
        errors += lines
        return changed, not lines

    def _took_plan(self, plan, safe_changed: bool) -> None:
        """Record that ``plan`` was taken (its term and seq), and save the state when its safe caps
        changed (the boot failsafe needs the latest) or every 20th plan."""
        self.plan_term = plan.term
        self.last_plan_seq = max(self.last_plan_seq, plan.seq) if plan.seq else self.last_plan_seq
        self.stream_seq = max(self.stream_seq, plan.seq)
        if safe_changed or plan.seq % 20 == 0:
            self.save_state()

    def _ack_with_read_back(self, seq: int, ok: bool, caps: dict[int, float], errors: list[str]):
        """The ``CapAck`` of plan ``seq`` with the read-back of the GPUs its ``caps`` named (one
        NVML read of every GPU), ``ok`` and ``errors`` as given."""
        samples = self.backend.telemetry_all()
        self.last_samples = samples
        bound = self.bound_indices()
        states = self.caps.states()
        gpus = [self._gpu_telemetry(s, bound, states) for s in samples if s.index in caps]
        return messages.cap_ack(seq, ok, gpus, errors, packed=self.packed_readings)

    def _order_problem(self, plan) -> str:
        """Why ``plan`` may not be taken on this stream ("" when it may): a phase the protocol
        does not define, or a seq not above the last plan taken since the Welcome (a replayed or
        reordered plan: an older cap would overwrite a newer one; found by a try-out with a fake
        coordinator: seq 1 after seq 11 applied)."""
        if plan.phase not in PHASES:
            return f"CapPlan.phase {plan.phase[:40]!r}: need decrease, increase or hold"
        if plan.seq <= self.stream_seq:
            return (f"CapPlan.seq {plan.seq} not above {self.stream_seq}, the last plan taken on this stream "
                    "(a replayed or reordered plan)")
        return ""

    def _apply_plan_caps(self, caps: dict[int, float], phase: str, errors: list[str]) -> bool:
        """Apply a plan's ``caps`` (GPU index -> W; ``phase`` its phase), each the GPU's new
        allowance; append a line per refused or failed GPU to ``errors``; True when every cap was
        applied."""
        ok = True
        wanted: dict[int, float] = {}
        for index, cap_w in caps.items():
            if index not in self.devices:
                errors.append(f"GPU {index} does not exist on {self.node}")
                ok = False
                continue
            if not math.isfinite(cap_w) or cap_w <= 0:
                errors.append(f"GPU {index}: cap {cap_w!r} W refused")
                ok = False
                continue
            wanted[index] = self._clamp(index, cap_w)
        if phase == PHASE_DECREASE:
            self._hold_raises(wanted)
        before = {i: (self.allowed_w.get(i), self.desired_w.get(i)) for i in wanted}
        self.caps.lift_raise_hold(wanted)  # newer than any held state: the coordinator counts these caps
        for i, cap in wanted.items():
            self.allowed_w[i] = cap
            self.caps.set_restore_ceiling(i, cap)  # a held restore may rise to the new allowance
        results = self._apply(wanted)
        for i, cap in wanted.items():
            r = results.get(i)
            if r is None or messages.result_error(r):
                ok = False
                errors.append(f"GPU {i}: {messages.result_error(r) if r is not None else 'not applied'}")
            if getattr(r, "state", None) == capstates.STALLED:
                self._keep_stalled_low(i, cap, *before[i])
                continue
            self.desired_w[i] = cap
        return ok

    def _keep_stalled_low(self, index: int, cap_w: float, allowed_w: float | None, desired_w: float | None) -> None:
        """A plan's cap (W) for a GPU whose NVML call is outstanding (not written): kept only as far
        as it lowers the GPU. The coordinator holds a STALLED GPU at its last enforced limit and
        stops counting a raise it sent once the ack says it failed, so a raise written when the GPU
        recovers could overrun a domain limit; a decrease is always safe and is written then."""
        if allowed_w is not None:  # else the new allowance (cap_w, set already) is the first ceiling
            self.allowed_w[index] = min(allowed_w, cap_w)
        if desired_w is None:
            self.desired_w.pop(index, None)  # nothing kept on it before: it stays where it is
        else:
            self.desired_w[index] = min(desired_w, cap_w)
        self.caps.set_restore_ceiling(index, self.allowed_w[index])

    def _hold_raises(self, wanted: dict[int, float]) -> None:
        """Phase 1 of a plan only lowers caps: a cap above a GPU's current limit (W) is held at
        that limit. The coordinator computed it from an accounting that is higher than the device
        (the agent lowered the GPU itself since, e.g. a start cap), and raising it now, before the
        other nodes' decreases, is how a cluster sum reached 3,300 W over a 3,200 W budget. The
        ack reports the limit kept; the coordinator raises it in a phase 2, after its decreases."""
        for i, cap in list(wanted.items()):
            try:
                current_w = self.backend.get_cap_w(i)
            except CapctlError:
                continue  # unreadable: the write below reports the GPU's error
            if cap > current_w:
                wanted[i] = current_w

    def on_disconnect(self) -> None:
        """The link went down: log whether the lease still holds (caps stay as they are)."""
        log.warning("coordinator link down; lease %s", "held" if self.lease.active() else "not held")

    # ------------------------------------------------------------------------------------------
    # periodic work
    def tick(self) -> None:
        """One interval: jobs ended in the drop box, retries, failsafe, drift reconcile, telemetry.
        CapManager errors are logged."""
        self.end_left_jobs()
        with self.lock:
            try:
                self.caps.retry_pending()
            except CapctlError as err:
                log.error("retrying pending restores failed: %s", err)
            self.caps.retry_store()
            if self.lease.expired() and not self.lease.expired_applied:
                self._apply_failsafe()
            try:
                self.caps.reconcile(dict(self.desired_w))
            except CapctlError as err:
                log.error("reconcile failed: %s", err)
            samples = self._meter()
            for i in self.caps.note_readable([s.index for s in samples if getattr(s, "error", None) is None]):
                self.gpu_error.pop(i, None)  # (its error of then: it read fine now)
            states = self.caps.states()
            self.telemetry_seq += 1
            bound = self.bound_indices()
            records = self.energy.running()
            resent = self.resend_ended
            if resent:
                records = self.energy.kept_ended(time.time()) + records
                self.resend_ended = False
            msg = messages.node_telemetry(self.node, time.time(), self.telemetry_seq,
                                          [self._gpu_telemetry(s, bound, states) for s in samples],
                                          job_energy=[messages.job_energy(self.node, r) for r in records],
                                          packed=self.packed_readings)
        if self.link is not None and not self.link.send(msg, droppable=True) and resent:
            # dropped (the stream not up yet: a report between the hello and the welcome, or the
            # outbox full): the ended jobs' records go with the next report that is sent (found by a
            # test: a job ended from the drop box at the start was never recorded as finished)
            with self.lock:
                self.resend_ended = True

    def _apply_failsafe(self) -> None:
        """Lease expired: move every managed GPU to min(current, safe cap) (W), never higher; hold
        them in ``safe_mode`` and lower their allowance to the safe cap. Managed: bound GPUs, GPUs
        with a desired cap, and idle GPUs whose pre-job limit is still to be restored (a job that
        ended while the coordinator was away: its restore held at the last allowance; found by a
        try-out: 616.8 W kept, state OK, while the other GPUs went to the 350 W safe cap)."""
        managed = set(self.bound_indices()) | set(self.desired_w) | set(self.caps.saved_limits_w())
        current = {s.index: s.cap_w for s in self.last_samples
                   if getattr(s, "error", None) is None and s.index in managed}
        for i, d in self.desired_w.items():
            current[i] = min(current.get(i, d), d)
        safe = {i: c for i in managed if (c := self._safe_cap_for(i)) is not None}
        todo = {i: self._clamp(i, c) for i, c in failsafe_caps(current, safe).items()}
        log.warning("lease expired: applying safe caps %s", {i: round(c) for i, c in sorted(todo.items())})
        self._apply(todo)
        for i in managed:
            if i in safe:
                self.desired_w[i] = min(self.desired_w.get(i, current.get(i, safe[i])), safe[i])
                self.safe_mode.add(i)
        for i, c in safe.items():
            if i in self.allowed_w:
                self.allowed_w[i] = min(self.allowed_w[i], c)
                self.caps.set_restore_ceiling(i, self.allowed_w[i])
        self.lease.expired_applied = True

    def _loop(self) -> None:
        """The loop thread: :meth:`tick` every ``interval_s`` s until ``stop_event``; a failed tick
        is logged and the next one runs on the last good state."""
        while not self.stop_event.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # noqa: BLE001 — the daemon keeps running on its last good state
                log.exception("agent tick failed")
            self.report_clock.reported(started, self.interval_s)
            self._wait_next()

    def _wait_next(self) -> None:
        """Sleep until the next report is due (:attr:`report_clock`, re-read whenever a plan or a
        Welcome moves it), a lease expiry to act on, or stop."""
        while not self.stop_event.is_set():
            now = time.monotonic()
            deadline = self.report_clock.due_mono(now)
            if now >= deadline:
                break
            rem = self.lease.remaining_s(now)
            if rem is not None and rem <= 0 and not self.lease.expired_applied:
                break
            if self.wake.wait(min(WAKE_CHECK_S, deadline - now)):
                self.wake.clear()
