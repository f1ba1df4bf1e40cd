"""Cap management on one node: save/restore pre-job limits, job bindings, drift handling.

:class:`CapManager` sits on a :class:`~nodeagent.backend.GpuBackend` (in production
:class:`~nodeagent.nvml.NvmlBackend`) and is the only code that writes power limits. Its rules (issue 2, DEVELOPERS.md "Hardware safety"):

* Before the FIRST write to a GPU its pre-job (site) limit, i.e. the requested power limit read
  from the device, is saved in the root-only state file (:mod:`nodeagent.savedstate`);
  restore returns to that value, never to the default limit. The saved value is kept until the
  restore succeeded.
* GPUs are counted per job (MIG or shared GPUs): a GPU is restored only when its last job leaves.
* Decreases are applied before increases; every GPU is handled on its own: one failing GPU never
  stops the others. A failed restore stays pending and is retried (:meth:`CapManager.retry_pending`,
  also run by every :meth:`CapManager.reconcile`).
* Restart never resets caps: a new manager re-reads the state file and the devices and writes
  nothing until asked. A corrupt state file is moved aside (``*.corrupt.<time>``), reported
  (:attr:`CapManager.state_file_error`) and the manager keeps running; pre-job limits captured
  after that are the limits then in force (``saved_source="recovered"``), so a later restore
  never raises a cap.

Drift (:meth:`CapManager.reconcile`, run each interval) compares the requested limit on the device
with the one capctl last wrote:

* requested limit changed once (driver reload puts it back to the default) -> re-applied at once,
  state ``OK``;
* requested limit changed again within ``foreign_window_s`` -> ``FOREIGN_WRITER``: an alarm is
  logged (ERROR, at most once per ``rewrite_interval_s``) and the cap is re-written at most once
  per ``rewrite_interval_s`` (no write war);
* requested limit as written but enforced limit lower (another limit binds, e.g. an out-of-band
  BMC/chassis limit) -> ``OOB_LIMITED``, no write; the enforced value is what counts
  (:meth:`CapManager.status`).

Cap states: ``OK``, ``OOB_LIMITED``, ``FOREIGN_WRITER``, ``RESTORE_FAILED``, ``LOST`` (GPU lost),
``SET_FAILED`` (a write was refused, e.g. NO_PERMISSION / NOT_SUPPORTED), ``ERROR`` (a read failed),
``UNSUPPORTED_CONSTRAINTS`` (the device reports limit constraints no cap satisfies, see
:mod:`capctl.devicedata`: the GPU is never written; checked at open and before every write),
``STALLED`` (an NVML call on the GPU did not return within the agent's timeout,
:mod:`nodeagent.callguard`: nothing is written until it returns; the next read recovers it).
A GPU back from one of :data:`HELD_STATES` is written no higher than its limit read then until a
plan of the coordinator names it (:meth:`CapManager.lift_raise_hold`): decreases only.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from capctl.capstates import (  # the one vocabulary (the protocol's CapState enum)
    ERROR,
    FOREIGN_WRITER,
    LOST,
    OK,
    OOB_LIMITED,
    RESTORE_FAILED,
    SET_FAILED,
    STALLED,
    UNSUPPORTED_CONSTRAINTS,
)
from capctl.devicedata import unsupported_message
from capctl.errors import CapctlError, UserInputError
from nodeagent.backend import GpuBackend, GpuLostError, NvmlError, NvmlStalledError, UnsupportedConstraintsError
from nodeagent.errorlog import REPEAT_LOG_S, GpuErrorLog  # noqa: F401 (REPEAT_LOG_S: the module's, re-exported)
from nodeagent.savedstate import (
    STATE_FILE_NAME,
    GpuRecord,
    NodeCapState,
    SavedStateError,
    load_state,
    quarantine,
    store_state,
)

LOG = logging.getLogger("capctl.nodeagent.caps")

CAP_STATES = (OK, OOB_LIMITED, FOREIGN_WRITER, RESTORE_FAILED, LOST, SET_FAILED, ERROR, UNSUPPORTED_CONSTRAINTS,
              STALLED)
"""Every value :meth:`CapManager.states` / :meth:`CapManager.reconcile` can report."""

ENFORCED_TOLERANCE_W = 1.0
"""Enforced limit this far or more below the requested one counts as ``OOB_LIMITED`` (W).

NVML reports both limits in mW; 1 W absorbs rounding of limits that other agents set in W
(nvidia-smi -pl takes whole watts) without hiding a real out-of-band limit (tens of W and more).
"""


def _mw(value_w: float) -> int:
    """Whole milliwatts of a value in W (for exact comparisons of limits NVML reports in mW)."""
    return int(round(value_w * 1000.0))


@dataclass(frozen=True, slots=True)
class CapResult:
    """Outcome of one per-GPU write (W).

    ``action``: ``"set"``, ``"restore"`` or ``"none"`` (nothing to do). ``requested_w``: the
    cap asked for (for a restore: the saved pre-job limit); ``cap_w``/``enforced_w``: read back
    after the write (NaN when unknown). ``ok`` False means ``error`` holds the message (with a
    remedy) and ``error_type`` the exception class name; ``state`` is the GPU's cap state after it.
    """

    index: int
    ok: bool
    action: str
    requested_w: float
    cap_w: float = math.nan
    enforced_w: float = math.nan
    state: str = OK
    error: str | None = None
    error_type: str | None = None


@dataclass(frozen=True, slots=True)
class GpuCapStatus:
    """What the manager knows about one GPU after the last operation (W).

    ``effective_cap_w`` is what really limits the GPU: the enforced limit (issue 2: with an
    out-of-band limit "the enforced value is what counts").
    """

    index: int
    state: str
    desired_w: float | None
    cap_w: float | None
    enforced_w: float | None
    saved_limit_w: float | None
    jobs: int
    message: str | None

    @property
    def effective_cap_w(self) -> float | None:
        """The enforced limit (W), or None before the first observation."""
        return self.enforced_w


@dataclass
class _Runtime:
    state: str = OK
    desired_w: float | None = None
    cap_w: float | None = None
    enforced_w: float | None = None
    message: str | None = None
    drift_s: deque = field(default_factory=lambda: deque(maxlen=16))
    last_rewrite_s: float | None = None
    last_alarm_s: float | None = None
    restore_ceiling_w: float | None = None  # coordinator's allowance while a restore is held below it
    held_w: float | None = None  # value written by a restore held below the saved limit
    raise_hold: bool = False  # was in a HELD_STATES state: no raise until the coordinator's next plan
    raise_ceiling_w: float | None = None  # its limit when first read again after that (W)
    foreign_w: float | None = None  # the requested limit at its last drift (W): another writer's


HELD_STATES = frozenset({UNSUPPORTED_CONSTRAINTS, STALLED, LOST, ERROR})
"""States in which the agent does not write a GPU (it cannot read or may not write it) and the
coordinator counts it at its current limit (``capctl.capstates.UNCONTROLLABLE``). A cap the
coordinator sent meanwhile failed and is forgotten by it; the agent still held it as the GPU's
target and wrote it when the GPU came back: 609.8 -> 648.1 W, 4831.4 W on a 4800 W budget (a
try-out). Back from one, the GPU is written no higher than its limit read then until
:meth:`CapManager.lift_raise_hold` (a plan newer than the state change)."""


class CapManager:
    """Applies, tracks and restores power limits on the GPUs of one node.

    Args:
        backend: an open :class:`~nodeagent.backend.GpuBackend` (production:
            :class:`~nodeagent.nvml.NvmlBackend`).
        state_dir: directory of the state file ``caps-state.json`` (created 0700 if missing;
            production: ``/var/lib/capctl``).
        clock: monotonic time source in seconds (tests pass a manual clock).
        rewrite_interval_s: minimum time between two re-writes of a GPU claimed by a foreign
            writer, and between two foreign-writer alarms.
        foreign_window_s: two drifts of the requested limit within this window mark a foreign
            writer (default ``4 * rewrite_interval_s``).

    All public methods are thread-safe (one re-entrant lock). Bad arguments raise
    :class:`~capctl.errors.UserInputError`; hardware errors are captured per GPU in the results.
    """

    def __init__(
        self,
        backend: GpuBackend,
        state_dir: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        rewrite_interval_s: float = 30.0,
        foreign_window_s: float | None = None,
    ):
        if not (isinstance(rewrite_interval_s, (int, float)) and rewrite_interval_s > 0):
            raise UserInputError(f"rewrite_interval_s: {rewrite_interval_s!r}, expected > 0 s")
        self.backend = backend
        self.failed_writes: dict[str, int] = {}  # action -> failed cap writes (capctl_agent_cap_write_failures_total)
        self.state_path = Path(state_dir) / STATE_FILE_NAME
        self.store_problem = ""
        """Why the last write of the state file failed ("" when it worked): retried each interval."""
        self.errors = GpuErrorLog(LOG)  # per-GPU error lines, rate-limited (nodeagent.errorlog)
        self.clock = clock
        self.rewrite_interval_s = float(rewrite_interval_s)
        self.foreign_window_s = float(
            foreign_window_s if foreign_window_s is not None else 4.0 * rewrite_interval_s
        )
        self.state_file_error: SavedStateError | None = None
        # called with a GPU index: the ceiling (W) of its restore while its allowance
        # (:meth:`set_restore_ceiling`) is unknown, e.g. after a restart (allowances are kept in
        # memory only); None from it: no bound. The agent sets it (AgentCore.restore_fallback_w)
        self.fallback_ceiling: Callable[[int], float | None] | None = None
        # called with a GPU index: whether a coordinator manages its caps (the agent sets it,
        # AgentCore.coordinator_managed); only then does a GPU back from a held state wait for a
        # plan before it is raised (HELD_STATES); None: never
        self.raise_guard: Callable[[int], bool] | None = None
        self._lock = threading.RLock()
        self._devices = backend.devices()
        self._count = len(self._devices)
        self._rt = {i: _Runtime() for i in range(self._count)}
        for d in self._devices:
            problem = (unsupported_message(d.min_cap_w, d.max_cap_w) or d.limit_problem) if d.error is None else ""
            if problem and d.index in self._rt:
                self._rt[d.index].state, self._rt[d.index].message = UNSUPPORTED_CONSTRAINTS, problem
                self._rt[d.index].raise_hold = True
                LOG.error("GPU %d: %s", d.index, problem)
        self._recovered = False
        self._state = self._load()

    # -- state file ----------------------------------------------------------------------------

    def _load(self) -> NodeCapState:
        try:
            state = load_state(self.state_path)
        except SavedStateError as err:
            moved = quarantine(self.state_path)
            err.moved_to = moved
            kept = f"; kept aside as {moved}" if moved else ""
            message = (
                f"{err}{kept}. Continuing without the saved pre-job limits: caps in force are "
                "kept, and a later restore returns to the limit in force now (never higher); "
                "check the site power limits (nvidia-smi -q -d POWER)"
            )
            err.args = (message,)
            self.state_file_error = err
            LOG.error("%s", message)
            self._recovered = True
            state = NodeCapState()
            self._try_store(state)
            return state
        uuids = {d.uuid: d.index for d in self._devices if d.uuid}
        remapped: dict[int, GpuRecord] = {}
        for index, rec in state.gpus.items():
            now_index = uuids.get(rec.uuid)
            if now_index is None:
                if index < self._count and not self._devices[index].uuid:
                    now_index = index  # cannot be read now (lost): keep it where it was
                else:
                    LOG.error(
                        "cap state file %s: GPU %s (saved limit %.3f W, was index %d) is not on "
                        "this node any more; its record is dropped",
                        self.state_path, rec.uuid, rec.saved_limit_w, index,
                    )
                    continue
            remapped[now_index] = rec
            if rec.restore_pending:
                self._rt[now_index].state = RESTORE_FAILED
        state.gpus = remapped
        for job, indices in list(state.bindings.items()):
            state.bindings[job] = [i for i in indices if i < self._count]
        LOG.info(
            "cap state %s: %d saved pre-job limit(s), %d job binding(s)",
            self.state_path, len(state.gpus), len(state.bindings),
        )
        return state

    def _try_store(self, state: NodeCapState | None = None) -> str | None:
        """Write the state file; on failure log it and keep the problem in :attr:`store_problem`
        (written again by :meth:`retry_store`, each interval, until it works)."""
        try:
            store_state(self.state_path, state if state is not None else self._state)
        except OSError as err:
            message = (
                f"cannot write the cap state file {self.state_path}: {err}; the agent needs a "
                "writable root-only state directory"
            )
            if message != self.store_problem:
                LOG.error("%s", message)
            self.store_problem = message
            return message
        if self.store_problem:
            LOG.info("cap state file %s written again", self.state_path)
        self.store_problem = ""
        return None

    def retry_store(self) -> None:
        """Write the state file again if the last write failed: a binding change made while the
        state directory was read-only came back wrong after a restart (an ended job rebound, a
        running one forgotten; found by a review)."""
        with self._lock:
            if self.store_problem:
                self._try_store()

    # -- queries -------------------------------------------------------------------------------

    def bindings(self) -> dict[str, list[int]]:
        """Job id -> GPU indices bound to it (copies)."""
        with self._lock:
            return {job: list(ix) for job, ix in self._state.bindings.items()}

    def saved_limits_w(self) -> dict[int, float]:
        """GPU index -> saved pre-job limit (W), for every GPU capctl wrote and not yet restored."""
        with self._lock:
            return {i: r.saved_limit_w for i, r in sorted(self._state.gpus.items())}

    def states(self) -> dict[int, str]:
        """GPU index -> cap state (see :data:`CAP_STATES`) for every GPU of the node."""
        with self._lock:
            return {i: rt.state for i, rt in self._rt.items()}

    def note_readable(self, indices) -> list[int]:
        """GPUs just read without an error (``indices``): a ``STALLED`` or ``LOST`` state ends with
        them, as :meth:`reconcile` ends it for GPUs with a desired cap. A GPU without one (its job
        ended while it stalled) stayed ``STALLED`` for good, and the coordinator never planned it
        again (found by a review). Returns the GPUs whose state ended."""
        ended = []
        with self._lock:
            for i in indices:
                rt = self._rt.get(i)
                if rt is not None and rt.state in (STALLED, LOST):
                    rt.state, rt.message = OK, None
                    ended.append(i)
                    self.errors.cleared(i, "readable")
        return ended

    def message(self, index: int) -> str:
        """Why GPU ``index`` is in its cap state ("" when there is nothing to say)."""
        with self._lock:
            rt = self._rt.get(index)
            return (rt.message or "") if rt is not None else ""

    def job_count(self, index: int) -> int:
        """Number of jobs bound to GPU ``index``."""
        with self._lock:
            return sum(1 for ix in self._state.bindings.values() if index in ix)

    def status(self) -> dict[int, GpuCapStatus]:
        """GPU index -> :class:`GpuCapStatus` (last observation; no NVML call)."""
        with self._lock:
            return {
                i: GpuCapStatus(
                    index=i, state=rt.state, desired_w=rt.desired_w, cap_w=rt.cap_w,
                    enforced_w=rt.enforced_w,
                    saved_limit_w=(self._state.gpus[i].saved_limit_w if i in self._state.gpus else None),
                    jobs=self.job_count(i), message=rt.message,
                )
                for i, rt in self._rt.items()
            }

    # -- binding -------------------------------------------------------------------------------

    def _check_indices(self, indices, field_name: str) -> list[int]:
        out = []
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self._count:
                raise UserInputError(
                    f"{field_name}: GPU index {i!r} does not exist on this node; allowed "
                    f"0..{self._count - 1}"
                )
            out.append(i)
        return out

    def bind(self, job_id: str, indices: list[int]) -> None:
        """Bind ``job_id`` to GPUs ``indices`` (added to an existing binding; idempotent).

        A GPU may be bound to several jobs (MIG, shared GPUs); it is restored when the last one
        is released. Binding a GPU whose restore is pending hands it to the new job: the saved
        pre-job limit is kept and restored when that job leaves.

        Raises:
            UserInputError: empty job id or an index that does not exist.
        """
        if not isinstance(job_id, str) or not job_id.strip():
            raise UserInputError(f"job_id: {job_id!r}, expected a non-empty string")
        with self._lock:
            new = self._check_indices(indices, f"bind {job_id}")
            self._state.bindings[job_id] = sorted(set(self._state.bindings.get(job_id, [])) | set(new))
            for i in new:
                rec = self._state.gpus.get(i)
                if rec is not None and rec.restore_pending:
                    rec.restore_pending = False
                    if self._rt[i].state == RESTORE_FAILED:
                        self._rt[i].state = OK
                self._rt[i].restore_ceiling_w = self._rt[i].held_w = None
            self._try_store()

    # -- writing -------------------------------------------------------------------------------

    def _fail(self, index: int, action: str, requested_w: float, err: Exception, state: str) -> CapResult:
        rt = self._rt.get(index)
        if rt is not None:
            rt.state = state
            rt.message = str(err)
            if state in HELD_STATES or state == SET_FAILED:
                # a refused write too: the coordinator counts the GPU at its read-back after the
                # failed ack; a raise retried here once writes work again went above that count
                # (decreases still go through: the bound is the limit read then)
                rt.raise_hold, rt.raise_ceiling_w = True, None
        self._log_error(index, f"GPU {index}: {_attempt(action, requested_w)} failed: {err}")
        self.failed_writes[action] = self.failed_writes.get(action, 0) + 1
        return CapResult(index=index, ok=False, action=action, requested_w=requested_w,
                         state=state, error=str(err), error_type=type(err).__name__)

    def _log_error(self, index: int, text: str) -> None:
        """Log ``text`` for GPU ``index`` at ERROR, at most once per :data:`REPEAT_LOG_S` for the same
        error (:class:`~nodeagent.errorlog.GpuErrorLog`: a failing write retried each interval, a GPU
        whose state flips between RESTORE_FAILED and UNSUPPORTED_CONSTRAINTS, an NVML stall whose
        text carries its age: 136 lines in minutes); the suppressed count goes with the next line."""
        self.errors.error(index, text)

    def _unsupported(self, index: int, action: str, requested_w: float, err: Exception) -> CapResult:
        """GPU ``index`` reports unusable limit constraints: nothing written; logged on the change."""
        rt = self._rt[index]
        self._log_error(index, str(err))
        rt.state, rt.message = UNSUPPORTED_CONSTRAINTS, str(err)
        rt.raise_hold, rt.raise_ceiling_w = True, None
        try:  # the limit it is held at: what the result reports (never the 0 W of bad constraints)
            rt.cap_w, rt.enforced_w = self.backend.get_cap_w(index), self.backend.get_enforced_w(index)
        except CapctlError:
            pass
        return CapResult(index=index, ok=False, action=action, requested_w=requested_w,
                         cap_w=rt.cap_w if rt.cap_w is not None else math.nan,
                         enforced_w=rt.enforced_w if rt.enforced_w is not None else math.nan,
                         state=UNSUPPORTED_CONSTRAINTS, error=str(err), error_type=type(err).__name__)

    def _plan(self, targets: dict[int, float], action: str, results: dict[int, CapResult]):
        """Read current limits; return [(delta_w, index, requested_w, current_w)] decreases first.
        A GPU with unusable limit constraints is left out (never written, never clamped to 0 W)."""
        plan = []
        for index, cap_w in targets.items():
            try:
                self._check_indices([index], action)
                target_w = self.backend.clamp_cap_mw(index, cap_w) / 1000.0
                current_w = self.backend.get_cap_w(index)
                ceiling_w = self._raise_ceiling_w(index, current_w)
            except UnsupportedConstraintsError as err:
                results[index] = self._unsupported(index, action, cap_w, err)
                continue
            except GpuLostError as err:
                results[index] = self._fail(index, action, cap_w, err, LOST)
                continue
            except NvmlStalledError as err:  # nothing is written while its NVML call is outstanding
                results[index] = self._fail(index, action, cap_w, err, STALLED)
                continue
            except CapctlError as err:
                results[index] = self._fail(index, action, cap_w, err, ERROR)
                continue
            if ceiling_w is not None and target_w > ceiling_w:
                target_w = cap_w = ceiling_w  # back from a held state: no raise before a plan
            plan.append((target_w - current_w, index, cap_w, current_w))
        plan.sort(key=lambda p: (p[0], p[1]))
        return plan

    def _save_pre_job(self, plan) -> set[int]:
        """Record pre-job limits of GPUs written for the first time; return indices NOT safe to write."""
        fresh = [(i, cur) for _, i, _, cur in plan if i not in self._state.gpus]
        if not fresh:
            return set()
        for i, current_w in fresh:
            self._state.gpus[i] = GpuRecord(
                uuid=self._devices[i].uuid, saved_limit_w=current_w,
                saved_source="recovered" if self._recovered else "read",
            )
            LOG.info("GPU %d: saved pre-job limit %.3f W", i, current_w)
        problem = self._try_store()
        if problem is None:
            return set()
        for i, _ in fresh:
            del self._state.gpus[i]
        return {i for i, _ in fresh}

    def _write(self, index: int, cap_w: float, action: str) -> CapResult:
        rt = self._rt[index]
        try:
            res = self.backend.set_cap_w(index, cap_w)
        except GpuLostError as err:
            return self._fail(index, action, cap_w, err, LOST)
        except NvmlStalledError as err:  # the write may still land: the next read shows (a drift)
            return self._fail(index, action, cap_w, err, STALLED)
        except CapctlError as err:
            rec = self._state.gpus.get(index)
            if action == "restore" and rec is not None and _mw(cap_w) >= _mw(rec.saved_limit_w):
                # (a full restore only: one held at the allowance must still show that the GPU
                # cannot be written, before the allowance asks for the raise)
                done = self._already_at(index, cap_w)
                if done is not None:  # nothing to write: restored (a write that can never succeed
                    # was retried forever for a GPU already at its pre-job limit; found by a review)
                    rt.cap_w, rt.enforced_w, rt.message, rt.state, rt.desired_w = done[0], done[1], None, OK, None
                    self.errors.cleared(index, "readable")
                    return CapResult(index, True, action, cap_w, done[0], done[1], OK)
            return self._fail(index, action, cap_w, err, RESTORE_FAILED if action == "restore" else SET_FAILED)
        rt.cap_w, rt.enforced_w, rt.message = res.cap_w, res.enforced_w, None
        if action == "restore":
            # against the value written (whole mW, rounded down inside the constraints), not the
            # float asked for: a held restore at an allowance of 348.2347 W writes 348.234 W
            if _mw(res.cap_w) != _mw(res.written_w):
                err = NvmlError(
                    f"GPU {index}: restore to {res.written_w:.3f} W read back {res.cap_w:.3f} W (another "
                    "writer?); will retry",
                    gpu_index=index,
                )
                return self._fail(index, action, cap_w, err, RESTORE_FAILED)
            rt.state = OK
            rt.desired_w = None
            self.errors.cleared(index, "written")
            return CapResult(index, True, action, cap_w, res.cap_w, res.enforced_w, OK)
        rec = self._state.gpus[index]
        rec.written_w = res.written_w
        rt.desired_w = res.written_w
        rt.state = self._observed_state(index, res.cap_w, res.enforced_w)
        if rt.state == FOREIGN_WRITER:  # (a re-write: the reason stays with the state)
            rt.message = self._foreign_text(index, self.clock())
        self.errors.cleared(index, "written")
        return CapResult(index, True, action, cap_w, res.cap_w, res.enforced_w, rt.state)

    def _already_at(self, index: int, cap_w: float) -> tuple[float, float] | None:
        """``(limit, enforced limit)`` (W) of GPU ``index`` when its limit already is what writing
        ``cap_w`` would set (whole mW, clamped as a write is), else None (also when unreadable)."""
        try:
            target_mw = self.backend.clamp_cap_mw(index, cap_w)
            now_w = self.backend.get_cap_w(index)
            enforced_w = self.backend.get_enforced_w(index)
        except CapctlError:
            return None
        return (now_w, enforced_w) if _mw(now_w) == target_mw else None

    def _observed_state(self, index: int, cap_w: float, enforced_w: float) -> str:
        if self._is_foreign(index, self.clock()):
            return FOREIGN_WRITER
        if enforced_w < cap_w - ENFORCED_TOLERANCE_W:
            return OOB_LIMITED
        return OK

    def set_caps(self, caps_w: dict[int, float]) -> dict[int, CapResult]:
        """Apply caps (W) per GPU index: decreases first, each GPU independently.

        Each cap is clamped into the device's limit constraints (see
        :meth:`~nodeagent.backend.GpuBackend.clamp_cap_mw`). Before the first write to a GPU its
        current limit is saved to the state file; if that save fails the GPU is not written. A
        NaN/inf cap or a bad index yields an error result for that GPU only.

        Returns:
            GPU index -> :class:`CapResult`.
        """
        with self._lock:
            results: dict[int, CapResult] = {}
            caps_w = dict(caps_w)
            # an idle GPU whose pre-job limit is still to be restored: the cap is the restore's
            # ceiling (the coordinator's allowance), so the restore state machine stays in charge
            held = [i for i in caps_w if i in self._rt and self._restore_pending_idle(i)]
            for i in held:
                cap = caps_w.pop(i)
                if isinstance(cap, (int, float)) and math.isfinite(cap):
                    self._rt[i].restore_ceiling_w = float(cap)
            pending = [i for i in held if self._rt[i].held_w is None
                       or not _same_w(self._restore_target_w(i), self._rt[i].held_w)
                       or self._rt[i].state == RESTORE_FAILED]
            if pending:
                results.update(self._restore(pending))
            plan = self._plan(caps_w, "set", results)
            unsafe = self._save_pre_job(plan)
            for _, index, cap_w, _ in plan:
                if index in unsafe:
                    results[index] = self._fail(
                        index, "set", cap_w,
                        NvmlError(f"GPU {index}: not written: cannot save its pre-job limit to "
                                  f"{self.state_path}; fix the state directory", gpu_index=index),
                        SET_FAILED)
                    continue
                results[index] = self._write(index, cap_w, "set")
            self._try_store()
            return dict(sorted(results.items()))

    # -- restoring -----------------------------------------------------------------------------

    def _restore_target_w(self, index: int) -> float:
        """The value a restore writes now (W): the saved pre-job limit, never above the ceiling:
        the coordinator's allowance, else :attr:`fallback_ceiling`'s (a restart forgets the
        allowances; it finished held restores at full pre-job limits before it connected: 1.4 kW
        over a 10 kW budget for 0.8 s)."""
        saved_w = self._state.gpus[index].saved_limit_w
        ceiling_w = self._rt[index].restore_ceiling_w
        if ceiling_w is None and self.fallback_ceiling is not None:
            ceiling_w = self.fallback_ceiling(index)
        target_w = saved_w if ceiling_w is None else min(saved_w, ceiling_w)
        raise_w = self._rt[index].raise_ceiling_w if self._rt[index].raise_hold else None
        return target_w if raise_w is None else min(target_w, raise_w)

    def _restore(self, indices: list[int]) -> dict[int, CapResult]:
        results: dict[int, CapResult] = {}
        targets = {i: self._restore_target_w(i) for i in indices if i in self._state.gpus}
        for i in targets:
            self._state.gpus[i].restore_pending = True
        if targets:
            self._try_store()  # a crash from here on still retries the restore at the next start
        for _, index, target_w, _ in self._plan(targets, "restore", results):
            results[index] = self._write(index, target_w, "restore")
        for index, res in results.items():
            rt = self._rt[index]
            if res.ok:
                saved_w = self._state.gpus[index].saved_limit_w
                if res.requested_w < saved_w - 1e-3:  # (the target, or its raise ceiling: _plan)
                    # held below the pre-job limit by the coordinator's allowance: the restore stays
                    # pending and completes once the allowance reaches the saved value
                    rt.held_w = res.requested_w
                    # a foreign writer's alert stays until its window passes (the JobEnd of a GPU
                    # another process kept at 700 W reported it OK at capctl's figure; a try-out)
                    foreign = self._is_foreign(index, self.clock())
                    rt.state = FOREIGN_WRITER if foreign else OK
                    rt.message = self._foreign_text(index, self.clock()) if foreign else None
                    LOG.info("GPU %d: pre-job limit %.3f W held at %.3f W (coordinator allowance)",
                             index, saved_w, res.requested_w)
                    continue
                del self._state.gpus[index]
                rt.drift_s.clear()
                rt.restore_ceiling_w = rt.held_w = None
                LOG.info("GPU %d: restored pre-job limit %.3f W", index, res.requested_w)
            else:
                rt.state = LOST if res.state == LOST else RESTORE_FAILED
        self._try_store()
        return dict(sorted(results.items()))

    def _restore_pending_idle(self, index: int) -> bool:
        rec = self._state.gpus.get(index)
        return rec is not None and rec.restore_pending and self.job_count(index) == 0

    def held_restores(self, indices) -> dict[int, tuple[float, float]]:
        """GPU index -> (held W, pre-job limit W) for those of ``indices`` whose restore is held below
        the saved pre-job limit by the coordinator's allowance (the restore stays pending)."""
        with self._lock:
            return {i: (float(self._rt[i].held_w), float(self._state.gpus[i].saved_limit_w))
                    for i in sorted(indices) if i in self._rt and self._rt[i].held_w is not None
                    and i in self._state.gpus}

    def set_restore_ceiling(self, index: int, ceiling_w: float | None) -> None:
        """Set the highest limit (W) a pending restore of GPU ``index`` may write (None: no bound).

        The agent passes the coordinator's current allowance for an idle GPU, so that restoring a
        pre-job limit never raises a GPU above what the coordinator budgeted for it; the restore
        completes when the allowance reaches the saved value.
        """
        with self._lock:
            if index in self._rt:
                self._rt[index].restore_ceiling_w = None if ceiling_w is None else float(ceiling_w)

    def release(self, job_id: str, ceiling_w: dict[int, float] | None = None) -> dict[int, CapResult]:
        """Unbind ``job_id``; restore the pre-job limit of each GPU it was the last job on.

        ``ceiling_w`` (GPU index -> W) bounds the restore from above for GPUs under coordinator
        management (see :meth:`set_restore_ceiling`); GPUs not named are restored fully.

        Best effort per GPU: a GPU that fails keeps its saved value, is marked
        ``RESTORE_FAILED`` and is retried by :meth:`retry_pending` / :meth:`reconcile`. Releasing
        an unknown job is a no-op (the epilog may run twice).

        Returns:
            GPU index -> :class:`CapResult` for the GPUs restored or attempted.
        """
        with self._lock:
            indices = self._state.bindings.pop(str(job_id), None)
            if indices is None:
                LOG.info("release %s: no such job bound on this node (already released?)", job_id)
                return {}
            last = [i for i in indices if self.job_count(i) == 0]
            for i in last:
                self._rt[i].desired_w = None
                ceiling = (ceiling_w or {}).get(i)
                self._rt[i].restore_ceiling_w = None if ceiling is None else float(ceiling)
            return self._restore([i for i in last if i in self._state.gpus])

    def retry_pending(self) -> dict[int, CapResult]:
        """Retry every pending restore (GPUs with no job left and a saved value not yet restored)."""
        with self._lock:
            pending = [
                i for i, rec in self._state.gpus.items()
                if rec.restore_pending and self.job_count(i) == 0
                and not (self._rt[i].held_w is not None and _same_w(self._restore_target_w(i), self._rt[i].held_w))
            ]
            return self._restore(sorted(pending)) if pending else {}

    def restore(self, indices: list[int]) -> dict[int, CapResult]:
        """Restore the saved pre-job limits of ``indices`` now, regardless of bindings (admin use)."""
        with self._lock:
            return self._restore(self._check_indices(indices, "restore"))

    # -- drift ---------------------------------------------------------------------------------

    def reconcile(self, desired_caps_w: dict[int, float]) -> dict[int, str]:
        """One control interval: retry pending restores, compare devices with the desired caps.

        For each GPU in ``desired_caps_w`` (W) the requested and enforced limits are read and
        (see the module doc): a first write or a changed desired cap is applied; a drift of the
        requested limit is re-applied at once the first time (driver reload) and rate-limited
        when it repeats (``FOREIGN_WRITER``); an enforced limit below the requested one is
        reported ``OOB_LIMITED`` without writing. Writes are ordered decreases first. GPUs whose
        restore is pending and that no job holds are restored instead of capped.

        Returns:
            GPU index -> cap state, for the GPUs in ``desired_caps_w`` and every GPU with a
            saved pre-job limit.
        """
        with self._lock:
            self.retry_pending()
            now_s = self.clock()
            self._verify_held(now_s)
            writes = {index: cap_w for index, cap_w in desired_caps_w.items()
                      if self._needs_write(index, cap_w, now_s)}
            if writes:
                self.set_caps(writes)  # decreases first; states set from the read-back
            report = set(desired_caps_w) | set(self._state.gpus)
            return {i: self._rt[i].state for i in sorted(report) if i in self._rt}

    def _needs_write(self, index: int, cap_w: float, now_s: float) -> bool:
        """Compare GPU ``index`` with its desired cap ``cap_w`` (W) at ``now_s`` (s, the manager's
        clock) and update its observed state; True when the cap must be (re-)written.

        A bad index or a failed read is logged and recorded in the GPU's state (``LOST`` /
        ``ERROR``); nothing is raised.
        """
        try:
            self._check_indices([index], "reconcile")
        except UserInputError as err:
            LOG.error("%s", err)
            return False
        rec = self._state.gpus.get(index)
        if rec is not None and rec.restore_pending and self.job_count(index) == 0:
            return False
        rt = self._rt[index]
        try:
            target_w = self.backend.clamp_cap_mw(index, cap_w) / 1000.0
            cap_now_w = self.backend.get_cap_w(index)
            enforced_now_w = self.backend.get_enforced_w(index)
        except UnsupportedConstraintsError as err:
            self._unsupported(index, "read", cap_w, err)
            return False
        except GpuLostError as err:
            self._fail(index, "read", cap_w, err, LOST)
            return False
        except NvmlStalledError as err:
            self._fail(index, "read", cap_w, err, STALLED)
            return False
        except CapctlError as err:
            self._fail(index, "read", cap_w, err, ERROR)
            return False
        rt.cap_w, rt.enforced_w = cap_now_w, enforced_now_w
        if rt.state in HELD_STATES:
            rt.state, rt.message = OK, None
            self.errors.cleared(index, "readable")
        ceiling_w = self._raise_ceiling_w(index, cap_now_w, enforced_now_w)
        if ceiling_w is not None:
            target_w = min(target_w, ceiling_w)
        written_w = rec.written_w if rec is not None else None
        if written_w is None or rt.state == SET_FAILED:
            return True
        if _mw(cap_now_w) != _mw(written_w):
            return self._drifted(index, now_s, cap_now_w, written_w)
        if _mw(written_w) != _mw(target_w):
            return True
        rt.state = self._observed_state(index, cap_now_w, enforced_now_w)
        rt.message = (
            f"enforced limit {enforced_now_w:.3f} W below the requested "
            f"{cap_now_w:.3f} W (out-of-band limit)" if rt.state == OOB_LIMITED else
            self._foreign_text(index, now_s) if rt.state == FOREIGN_WRITER else None
        )
        return False

    def _raise_ceiling_w(self, index: int, cap_now_w: float, enforced_now_w: float | None = None) -> float | None:
        """The most GPU ``index`` may be written now (W) because it was in a :data:`HELD_STATES`
        state since the coordinator's last plan for it, else None (no bound; also when no
        coordinator manages it, :attr:`raise_guard`). Fixed at the first read after the state
        (``cap_now_w``, ``enforced_now_w``: its requested and enforced limits then, W; the enforced
        one is read when not given): the lower of the two, what the coordinator counts.

        Raises:
            CapctlError: reading the enforced limit failed (the caller handles it as any read).
        """
        rt = self._rt[index]
        if not rt.raise_hold or self.raise_guard is None or not self.raise_guard(index):
            return None
        if rt.raise_ceiling_w is None:
            if enforced_now_w is None:
                enforced_now_w = self.backend.get_enforced_w(index)
            rt.raise_ceiling_w = min(cap_now_w, enforced_now_w)
            LOG.info("GPU %d: readable again after a held state: kept at or below its limit %.3f W until "
                     "the coordinator's next plan for it (a target it set before may not be counted any more)",
                     index, rt.raise_ceiling_w)
        return rt.raise_ceiling_w

    def lift_raise_hold(self, indices) -> None:
        """A plan from the coordinator newer than the GPUs' held state names ``indices``: its caps
        may raise them (the coordinator counts what it sends). A GPU still held fails that write and
        is bounded again (:meth:`_fail`, :meth:`_unsupported`)."""
        with self._lock:
            for i in indices:
                rt = self._rt.get(i)
                if rt is not None and rt.raise_hold:
                    rt.raise_hold, rt.raise_ceiling_w = False, None
                    LOG.info("GPU %d: a new plan names it: its caps may rise again", i)

    def _verify_held(self, now_s: float) -> None:
        """Idle GPUs whose restore is held below the pre-job limit (at the coordinator's allowance):
        compare the device's requested limit with the value written; a drift is handled as any other
        (:meth:`_drifted`: re-written at once the first time, ``FOREIGN_WRITER`` and rate-limited when
        it repeats). Before, such a GPU was never read back: a foreign write of 700 W over a 284 W
        hold stayed, state OK, 7,416 W on a 7,000 W budget for 25 s (found by a try-out)."""
        for i, rec in sorted(self._state.gpus.items()):
            rt = self._rt.get(i)
            if rt is None or rt.held_w is None or not rec.restore_pending or self.job_count(i):
                continue
            try:
                cap_now_w = self.backend.get_cap_w(i)
            except CapctlError as err:  # the next restore or reconcile reports the GPU's state
                LOG.warning("GPU %d: reading the held restore back failed: %s", i, err)
                continue
            rt.cap_w = cap_now_w
            # held_w is the restore's target; the device keeps whole milliwatts of it, rounded down
            # (487.4999 W reads 487.499 W: not a drift, a test on the Slurm cluster)
            if abs(cap_now_w - rt.held_w) <= HELD_TOLERANCE_W:
                if rt.state == FOREIGN_WRITER:  # clears with its window; else its reason, now
                    foreign = self._is_foreign(i, now_s)
                    rt.state, rt.message = (FOREIGN_WRITER, self._foreign_text(i, now_s)) if foreign else (OK, None)
                continue
            if self._drifted(i, now_s, cap_now_w, rt.held_w):
                held_w, foreign = rt.held_w, (rt.state, rt.message)
                rt.held_w = None  # written again by the restore (held at the allowance again)
                res = self._restore([i]).get(i)
                if res is not None and not res.ok:
                    LOG.error("GPU %d: re-writing the held restore (%.3f W) failed: %s", i, held_w, res.error)
                elif foreign[0] == FOREIGN_WRITER:  # still reported: the coordinator holds it as spent
                    rt.state, rt.message = foreign

    def _is_foreign(self, index: int, now_s: float) -> bool:
        recent = [t for t in self._rt[index].drift_s if now_s - t < self.foreign_window_s]
        return len(recent) >= 2

    def _foreign_text(self, index: int, now_s: float) -> str:
        """Why GPU ``index`` is ``FOREIGN_WRITER`` at ``now_s`` (s, the manager's clock) when no foreign
        write shows right now (capctl re-wrote it, or the writer stopped): the last foreign value,
        how long ago, when the state clears (the second newest drift leaving ``foreign_window_s``:
        :meth:`_is_foreign`). The alert had no text then: after each re-write and for the ~120 s
        the state lingers once the writer stopped (a try-out)."""
        rt = self._rt[index]
        drifts = list(rt.drift_s)
        age_s = now_s - drifts[-1] if drifts else 0.0
        clear_s = max(0.0, drifts[-2] + self.foreign_window_s - now_s) if len(drifts) >= 2 else 0.0
        seen = f" to {rt.foreign_w:.3f} W" if rt.foreign_w is not None else ""
        return (f"another process set the power limit{seen} {age_s:.0f} s ago (no foreign write seen since); capctl "
                f"re-writes it at most every {self.rewrite_interval_s:g} s; the state clears after {clear_s:.0f} s "
                "more without one. Find it (e.g. a DCGM/nvidia-smi cron job or another power manager) and stop it")

    def _drifted(self, index: int, now_s: float, cap_now_w: float, written_w: float) -> bool:
        """Record a drift of GPU ``index``'s requested limit; return True if it may be re-written."""
        rt = self._rt[index]
        rt.drift_s.append(now_s)
        rt.foreign_w = cap_now_w
        if not self._is_foreign(index, now_s):
            LOG.warning(
                "GPU %d: requested limit is %.3f W, capctl wrote %.3f W (driver reload or a "
                "one-off change); re-applying", index, cap_now_w, written_w,
            )
            rt.last_rewrite_s = now_s
            return True
        rt.state = FOREIGN_WRITER
        rt.message = (
            f"another process keeps setting the power limit (now {cap_now_w:.3f} W, capctl "
            f"wrote {written_w:.3f} W); re-writing at most every {self.rewrite_interval_s:g} s. "
            "Find it (e.g. a DCGM/nvidia-smi cron job or another power manager) and stop it"
        )
        if rt.last_alarm_s is None or now_s - rt.last_alarm_s >= self.rewrite_interval_s:
            rt.last_alarm_s = now_s
            LOG.error("ALARM GPU %d: foreign writer: %s", index, rt.message)
        if rt.last_rewrite_s is None or now_s - rt.last_rewrite_s >= self.rewrite_interval_s:
            rt.last_rewrite_s = now_s
            return True
        return False


_ATTEMPTS = {
    "set": "setting the power limit to {w:.3f} W",
    "restore": "restoring the pre-job limit (writing {w:.3f} W)",
    "read": "reading its power limits (to keep the cap at {w:.3f} W)",
}


def _attempt(action: str, requested_w: float) -> str:
    """What a failed ``action`` of :class:`CapManager` tried, for its log line ("GPU 2: read to
    200.000 W failed" said nothing of what failed; a try-out)."""
    return _ATTEMPTS.get(action, action + " {w:.3f} W").format(w=requested_w)


HELD_TOLERANCE_W = 0.0015
"""A held restore reads back within this (W) of its target: milliwatt rounding, not a drift."""


def _same_w(target_w: float, held_w: float) -> bool:
    """True when a restore's target is the value already held (W, to 1 mW)."""
    return abs(target_w - held_w) < 1e-3
