"""Job binding of the node agent: AgentLocal's JobStart and JobEnd (called by the Slurm hooks).

JobStart binds a job to GPUs named as Slurm names them (minor number, UUID or PCI bus id), applies
the start cap (W) to the GPUs no other job holds, and tells the coordinator. While connected, the
start cap also lowers the coordinator's allowance of those GPUs: the coordinator budgets the watts
it gave back as soon as it reads the next report, so a job's end may restore only up to there.
JobEnd restores the pre-job limits of the GPUs whose last job this was, never above that allowance
(see :meth:`nodeagent.caps.CapManager.release`). Both are idempotent.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable

from capctl import capstates
from capctl.errors import CapctlError, UserInputError
from nodeagent import messages
from nodeagent.backend import DeviceInfo
from nodeagent.core import AgentCore

log = logging.getLogger("capctl.agent")

MAX_GPU_IDS = 1024


def norm_pci(bus_id: str) -> str:
    """Normalise a PCI bus id: lower case, 8-hex-digit domain ("0000:18:00.0" == "00000000:18:00.0")."""
    s = bus_id.strip().lower()
    parts = s.split(":")
    if len(parts) == 3:
        try:
            parts[0] = f"{int(parts[0], 16):08x}"
        except ValueError:
            pass
    elif len(parts) == 2:
        parts = ["00000000"] + parts
    return ":".join(parts)


def _match(devs: list[DeviceInfo], gid: str, kind: int) -> tuple[DeviceInfo | None, list]:
    """The device ``gid`` names under ``kind`` (or None) and the known ids of that kind.

    Raises:
        UserInputError: ``kind`` is not MINOR, UUID or PCI_BUS_ID.
    """
    from capctl.v1 import capctl_pb2

    if kind == capctl_pb2.GPU_ID_MINOR:
        match = next((d for d in devs if int(d.minor_number) == int(gid)), None) if gid.isdigit() else None
        return match, sorted(int(d.minor_number) for d in devs)
    if kind == capctl_pb2.GPU_ID_UUID:
        return next((d for d in devs if d.uuid and d.uuid.lower() == gid.lower()), None), [d.uuid for d in devs]
    if kind == capctl_pb2.GPU_ID_PCI_BUS_ID:
        norm = norm_pci(gid)
        match = next((d for d in devs if d.pci_bus_id and norm_pci(d.pci_bus_id) == norm), None)
        return match, [d.pci_bus_id for d in devs]
    raise UserInputError(f"gpu_id_kind {kind} is not one of MINOR, UUID, PCI_BUS_ID")


def map_gpu_ids(devices: Iterable[DeviceInfo], gpu_ids, kind: int, node: str) -> list[int]:
    """Map SLURM_JOB_GPUS-style ids to NVML indices (sorted, unique) by minor number / UUID / PCI bus id.

    Raises:
        UserInputError: an id matches no GPU (the message lists the known ones), or a bad ``kind``.
    """
    from capctl.v1 import capctl_pb2

    out: list[int] = []
    devs = list(devices)
    for raw in gpu_ids:
        gid = str(raw).strip()
        match, known = _match(devs, gid, kind)
        if match is None:
            raise UserInputError(f"GPU id {gid!r} ({capctl_pb2.GpuIdKind.Name(kind)}) matches no GPU on "
                                 f"{node}; known: {', '.join(map(str, known))}")
        if match.index not in out:
            out.append(match.index)
    return sorted(out)


def check_job_id(raw: str) -> str:
    """The stripped job id: a Slurm job id as JobStart takes it
    (:func:`capctl.security.limits.check_job_id`), for JobEnd too (it took any text up to 128
    characters, ``1; rm -rf /`` included, into its log lines and ``JobEnded``; found by a review).

    Raises:
        UserInputError: empty, longer than ``capctl.security.limits.MAX_JOB_ID_LEN``, or other characters than
            ``[A-Za-z0-9_.+:-]``.
    """
    from capctl.security.limits import check_job_id as job_id_problem

    job_id = raw.strip()
    problem = job_id_problem(job_id)
    if problem:
        raise UserInputError(problem)
    return job_id


class JobBinding(AgentCore):
    """JobStart / JobEnd of the agent (the AgentLocal calls the Slurm hooks make)."""

    def map_gpu_ids(self, gpu_ids, kind: int) -> list[int]:
        """Map SLURM_JOB_GPUS-style ids to NVML indices by minor number / UUID / PCI bus id.

        Raises:
            UserInputError: an id matches no GPU (the message lists the known ones).
        """
        if any(getattr(d, "error", None) for d in self.devices.values()):
            # a GPU whose facts could not be read (lost at start): read again, so that one back
            # is found by its minor number / UUID (it stayed "-1" until the next hello; a review)
            self.devices = {d.index: d for d in self.backend.devices()}
        return map_gpu_ids(self.devices.values(), gpu_ids, kind, self.node)

    def job_start(self, req):
        """AgentLocal.JobStart: bind ``req.job_id`` to the GPUs named by ``req.gpu_ids`` and apply the
        start cap (W) to those not yet bound; idempotent. Returns ``JobStartReply``.

        Raises:
            UserInputError: empty/oversized job id, too many ids, or an id matching no GPU.
        """
        from capctl.security.limits import validate_job_start
        from capctl.v1 import capctl_pb2

        job_id = check_job_id(req.job_id)
        problem = validate_job_start(req)
        if problem:
            raise UserInputError(problem)
        if len(req.gpu_ids) > MAX_GPU_IDS:
            raise UserInputError(f"gpu_ids: {len(req.gpu_ids)} ids; at most 1024 allowed")
        with self.lock:
            indices = self.map_gpu_ids(req.gpu_ids, req.gpu_id_kind)
            connected = bool(self.link and self.link.connected)
            unchanged = self._nothing_to_start(job_id, indices, connected)
            if unchanged is not None:
                return unchanged
            if job_id in self.jobs:
                indices = sorted(set(self.jobs[job_id]["gpu_indices"]) | set(indices))
            self._meter()  # energy counters at the start: the intervals before belong to the jobs before
            start, results = self._bind_and_cap(job_id, indices, req, connected)
            self.energy.start(job_id, self.jobs[job_id]["start_time_s"], len(indices), self.jobs[job_id])
            # a GPU with unusable limit constraints is held at its limit (bad device data, flagged
            # UNSUPPORTED_CONSTRAINTS in its result): not a start-cap failure of the healthy ones
            ok = all(not messages.result_error(r) or getattr(r, "state", "") == capstates.UNSUPPORTED_CONSTRAINTS
                     for r in results.values()) and len(results) == len(start)
            binding = self._binding(job_id)
            reply = capctl_pb2.JobStartReply(
                ok=ok, message=f"job {job_id} bound to GPUs {indices} on {self.node}; " + _start_outcome(start, results)
                + self._not_saved(),
                gpus=self._cap_results(indices, results), coordinator_connected=connected)
        log.info("JobStart %s: GPUs %s (user %s)", job_id, indices, req.user or "?")
        if self.link is not None:
            self.link.send(messages.job_started(binding))
        return reply

    def _not_saved(self) -> str:
        """The reply's note when the state file could not be written (the change is applied but
        not saved: written again each interval; a restart before that forgets it). The replies
        said only "ok" (found by a review: an ended job came back bound after a restart)."""
        problem = getattr(self.caps, "store_problem", "")
        return (f"; NOT SAVED ({problem}): retried each interval, a restart before then forgets this change"
                if problem else "")

    def _nothing_to_start(self, job_id: str, indices: list[int], connected: bool):
        """The ``JobStartReply`` when the request binds no new GPU (none named, or all already
        bound to this job); None when there is work to do."""
        from capctl.v1 import capctl_pb2

        if not indices and job_id not in self.jobs:
            return capctl_pb2.JobStartReply(ok=True, coordinator_connected=connected,
                                            message=f"job {job_id} holds no GPU on {self.node}: nothing to bind")
        if job_id in self.jobs:
            known = self.jobs[job_id]["gpu_indices"]
            if not set(indices) - set(known):
                return capctl_pb2.JobStartReply(
                    ok=True, message=f"job {job_id} already bound to GPUs {known} on {self.node}",
                    gpus=self._cap_results(known), coordinator_connected=connected)
        return None

    def _bind_and_cap(self, job_id: str, indices: list[int], req, connected: bool):
        """Bind ``job_id`` to ``indices``, record it, apply the start cap to the GPUs no job held
        before; return ``(start caps W by index, write results by index)``. Saves the state file.

        Raises:
            UserInputError: from :meth:`CapManager.bind` (bad index).
        """
        bound_before = self.bound_indices()
        fresh = [i for i in indices if i not in bound_before]
        self.caps.bind(job_id, indices)
        meta = self.jobs.get(job_id) or {"user": req.user, "partition": req.partition, "account": req.account,
                                         "qos": req.qos, "start_time_s": time.time()}
        meta["gpu_indices"] = indices
        self.jobs[job_id] = meta
        start = {i: self._start_cap_w(i, connected) for i in fresh}
        results = self._apply(start)
        self.desired_w.update(start)
        if connected:
            # the coordinator budgets the watts this start cap gave back as soon as it reads our
            # next report, so the allowance comes down with it: the job's end may restore only
            # up to here until the coordinator hands more out (never above its accounting)
            for i, c in start.items():
                self.allowed_w[i] = min(self.allowed_w.get(i, math.inf), c)
                self.caps.set_restore_ceiling(i, self.allowed_w[i])
        self.save_state()
        return start, results

    def _start_cap_w(self, index: int, connected: bool) -> float:
        """The start cap of GPU ``index`` (W): the policy's, never above the safe cap without a live
        lease, never above the coordinator's allowance, clamped to the limit constraints."""
        cap = self.start_cap_w
        safe = self._safe_cap_for(index)
        if safe is not None and not (connected and self.lease.active()):
            cap = min(cap, safe)
        if index in self.allowed_w:  # never above what the coordinator budgeted for this GPU
            cap = min(cap, self.allowed_w[index])
        else:  # no allowance known (an agent restarted: it keeps none): never above the GPU's limit
            # now, which the coordinator counts; a restarted agent raised idle GPUs held at 200 W to
            # the 300 W start cap and the cluster went 200 W over its budget for 30-70 ms (found by
            # a review with the enforced-limit journal)
            try:
                cap = min(cap, self.backend.get_cap_w(index))
            except CapctlError:
                cap = min(cap, safe) if safe is not None else cap
        return self._clamp(index, cap)

    def _end_message(self, job_id: str, known: bool, ok: bool, results: dict, held: dict,
                     unsupported: dict, others: dict[int, str]) -> str:
        """The JobEnd reply's text: the GPUs restored, held below the pre-job limit by the allowance
        (``held``: index -> (held W, pre-job W)), held for unusable constraints (``unsupported``:
        index -> result) and failed (retried), from ``results`` (index -> cap result); ``others``
        (index -> text, :meth:`_end_gpus`) told as they are."""
        restored = sorted(i for i, r in results.items() if getattr(r, "ok", False) and i not in held and i not in others)
        failed = sorted(i for i, r in results.items() if not getattr(r, "ok", False) and i not in unsupported)
        msg = (f"job {job_id} ended on {self.node}"
               + (f"; restored GPUs {restored}" if restored or not (held or unsupported or others) else "")
               if known else f"job {job_id} was not bound on {self.node}; nothing to restore")
        if held:  # the documented, safe bound: the rest of each pre-job limit comes with the allowance
            msg += "; held below the pre-job limit by the coordinator's allowance (restored when it allows): " + \
                ", ".join(f"GPU {i} at {h:g} W of {s:g} W" for i, (h, s) in held.items())
        if unsupported:
            msg += "; " + _held_unsupported(unsupported, self.caps.saved_limits_w())
        msg += "".join("; " + text for _, text in sorted(others.items()))
        if known and failed:
            msg += f"; GPUs {failed} could not be restored and will be retried"
        elif not ok:
            msg += "; some GPUs could not be restored and will be retried"
        return msg

    def _end_states(self, indices) -> dict[int, tuple[str, str]]:
        """GPU index -> (cap state, its reason) of ``indices`` before a JobEnd's restore (which
        writes the GPU: a foreign writer's value is gone from the read-back then)."""
        states = self.caps.states()
        return {i: (states.get(i, capstates.OK), self.caps.message(i) or self.gpu_error.get(i, ""))
                for i in sorted(indices)}

    def _end_gpus(self, job_gpus, results: dict, before: dict) -> tuple[list, dict[int, str]]:
        """The JobEnd reply's ``GpuCapResult`` for every GPU of the job (``job_gpus``; ``results``:
        index -> restore result; ``before``: :meth:`_end_states`), and the text of those not told by
        :meth:`_end_message` (index -> text): a GPU another process sets the limit of
        (``FOREIGN_WRITER`` before the restore: the limit read then, not capctl's write; the epilog
        logged "GPU 1 at 537.478 W of 700 W" while the driver had 700 W: a try-out) and a GPU with no
        restore (nothing of capctl's on it) in a held state (a stalled GPU was left out: a try-out).
        Limits in W; an unread one is 0 (the hook logs null). Call after the release (unbound)."""
        from capctl.v1 import capctl_pb2
        from nodeagent.caps import HELD_STATES

        samples = {s.index: s for s in self.last_samples}  # read by the JobEnd's _meter, before the restore
        states = self.caps.states()
        gpus, others = [], {}
        # (a GPU another job still holds is not this end's: its cap stays, it is not listed)
        for i in sorted((set(job_gpus) - set(self.bound_indices())) | set(results)):
            state, why = before.get(i, (capstates.OK, ""))
            s = samples.get(i)
            read_w = (messages.finite(getattr(s, "cap_w", 0.0)), messages.finite(getattr(s, "enforced_w", 0.0)))
            if state == capstates.FOREIGN_WRITER and getattr(results.get(i), "ok", True):
                why = why or "another process sets its power limit"
                at = f" at {read_w[0]:g} W (read before the restore)" if read_w[0] > 0 else ""
                done = results.get(i)
                wrote = (f"; capctl wrote {messages.finite(done.cap_w):g} W, which it may not keep"
                         if done is not None and getattr(done, "ok", False) else "")
                others[i] = f"GPU {i} held by another writer{at}{wrote}: {why}"
                gpus.append(capctl_pb2.GpuCapResult(index=i, cap_w=read_w[0], enforced_w=read_w[1], ok=False,
                                                    error=f"GPU {i}: {why.removeprefix(f'GPU {i}: ')}"))
            elif i in results:
                gpus.append(messages.cap_result(i, results[i]))
            elif states.get(i) in HELD_STATES:
                why = self.caps.message(i) or why or f"GPU {i}: cap state {states[i]}"
                others[i] = (f"GPU {i} in state {states[i]}, never written for this job (nothing to restore): "
                             f"{why.removeprefix(f'GPU {i}: ')}")
                gpus.append(capctl_pb2.GpuCapResult(index=i, cap_w=read_w[0], enforced_w=read_w[1], ok=False,
                                                    error=why))
            else:
                gpus.extend(messages.cap_results([i], None, self.last_samples))
        return gpus, others

    def end_left_jobs(self) -> list[str]:
        """End the jobs whose epilog could not reach this agent and left their end in its drop box
        (:mod:`capctl.endedjobs`), as :meth:`job_end` would have; returns their ids. A bad id is
        logged and dropped; an end that fails (no state file write) stays for the next interval."""
        from capctl import endedjobs
        from capctl.v1 import capctl_pb2

        ended = []
        for job_id in endedjobs.waiting(self.socket_path):
            try:
                # the job ended when its epilog ran, not now (a try-out: 41 s recorded for a 26 s job)
                reply = self.job_end(capctl_pb2.JobEndRequest(job_id=job_id),
                                     ended_at_s=endedjobs.left_at(self.socket_path, job_id))
            except UserInputError as err:
                log.error("drop box %s: %s: dropped", endedjobs.drop_box(self.socket_path), err)
            except CapctlError as err:
                log.error("ending job %s left by its epilog failed: %s; retried", job_id, err)
                continue
            else:
                log.warning("job %s ended from the drop box (its epilog could not reach the agent): %s",
                            job_id, reply.message)
                ended.append(job_id)
            endedjobs.done(self.socket_path, job_id)
        return ended

    def job_end(self, req, ended_at_s: float | None = None):
        """AgentLocal.JobEnd: restore the pre-job limits of the GPUs whose last job this was (per GPU,
        best effort, failures retried), unbind, forward JobEnded; idempotent, valid without JobStart.
        Restores never go above the coordinator's allowance (W). Returns ``JobEndReply`` (``ok``
        false when some GPU could not be restored yet). ``ended_at_s``: when the job ended (Unix s;
        its drop-box entry's time), if earlier than now: the record's end time (its energy still
        holds the counters up to now: there is no reading of that moment).

        Raises:
            UserInputError: empty or oversized job id.
        """
        from capctl.v1 import capctl_pb2

        job_id = check_job_id(req.job_id)
        with self.lock:
            job_gpus = set(self.jobs.get(job_id, {}).get("gpu_indices", [])) | set(self._cap_bindings().get(job_id, []))
            known = bool(job_gpus) or job_id in self.jobs
            self._meter()  # energy counters at the end, before the GPUs are released
            now_s = time.time()
            rec = self.energy.jobs.get(job_id)
            start_s = rec.start_time_s if rec is not None else 0.0
            ok_end = ended_at_s is not None and 0 < ended_at_s < now_s and ended_at_s >= start_s
            energy = self.energy.finish(job_id, ended_at_s if ok_end else now_s)
            ceiling = {i: self.allowed_w[i] for i in job_gpus if i in self.allowed_w}
            before = self._end_states(job_gpus)
            try:
                res = self.caps.release(job_id, ceiling_w=ceiling)
            except CapctlError as err:
                log.error("release of job %s failed: %s", job_id, err)
                res = {}
            results = dict(messages.results_iter(res, {}))
            self.jobs.pop(job_id, None)
            still_bound = self.bound_indices()
            for i in job_gpus:
                if i not in still_bound:  # MIG/shared GPUs keep their cap until the last job leaves
                    self.desired_w.pop(i, None)
                    self.safe_mode.discard(i)
            self._note_errors(results)
            unsupported = {i: r for i, r in results.items()
                           if not getattr(r, "ok", False) and getattr(r, "state", "") == capstates.UNSUPPORTED_CONSTRAINTS}
            # a GPU held for bad device data is not a failed restore: nothing is written to it
            ok = not any(messages.result_error(r) for i, r in results.items() if i not in unsupported)
            self.save_state()
            gpus, others = self._end_gpus(job_gpus, results, before)
            held = self.caps.held_restores([i for i, r in results.items() if getattr(r, "ok", False) and i not in others])
            msg = self._end_message(job_id, known, ok, results, held, unsupported, others) + self._not_saved()
        log.info("JobEnd %s: %s", job_id, msg)
        if self.link is not None:
            self.link.send(messages.job_ended(job_id, self.node, energy))
        return capctl_pb2.JobEndReply(ok=ok, message=msg, gpus=gpus)


def _held_unsupported(results: dict, saved_w: dict[int, float]) -> str:
    """The JobEnd text of the GPUs of ``results`` (index -> cap result) held for unusable limit
    constraints: never written, so not restored by capctl (the epilog said "could not be restored
    and will be retried"; a try-out). ``saved_w``: index -> pre-job limit (W)."""
    parts = []
    for i, r in sorted(results.items()):
        text = str(getattr(r, "error", "") or "").removeprefix(f"GPU {i}: ")
        reason = text.split(": the GPU is never written")[0].split("; no limit is written")[0]
        cap_w = messages.finite(getattr(r, "cap_w", None), math.nan)
        at = f" at {cap_w:g} W" if cap_w > 0 else ""
        pre = f" {saved_w[i]:g} W" if i in saved_w else ""
        parts.append(f"GPU {i} held{at}: unsupported limit constraints ({reason}): never written, its pre-job "
                     f"limit{pre} not restored by capctl while the device reports them")
    return "; ".join(parts)


def _start_outcome(start, results: dict) -> str:
    """What a JobStart did to each GPU of ``start`` (indices; ``results``: index -> its cap result):
    the GPUs whose start cap was applied, those held for bad device data (UNSUPPORTED_CONSTRAINTS)
    and those whose cap failed, each listed only where it belongs (the reply named every GPU as
    "start cap applied" even when its write failed; found by a try-out)."""
    applied, held, failed = [], [], []
    for i in sorted(start):
        r = results.get(i)
        if r is not None and getattr(r, "state", "") == capstates.UNSUPPORTED_CONSTRAINTS:
            held.append(i)
        elif r is None or messages.result_error(r):
            failed.append(i)
        else:
            applied.append(i)
    out = f"start cap applied to {applied}"
    if held:
        out += f"; held at their limit (bad device data): {held}"
    if failed:
        out += f"; start cap failed on {failed} (see gpus)"
    return out
