"""``capctl-agent``: the node agent daemon (one per compute node).

::

    capctl-agent --node NAME --coordinator ADDR --socket PATH --state-dir DIR
                 [--nvml-library system|simulated|PATH] [--allow-simulated] [--policy FILE]
                 [--interval-s S] [--socket-group GROUP] [--log-level LEVEL]
                 [--tls-ca FILE --tls-cert FILE --tls-key FILE [--tls-server-name NAME]]

What it does (docs/protocol.md):

- Opens NVML through :class:`nodeagent.nvml.NvmlBackend` (refusing the simulated driver unless
  ``--nvml-library simulated``, or a path with ``--allow-simulated``) and manages caps through
  :class:`nodeagent.caps.CapManager` (pre-job limits and job bindings persist in the state
  directory across agent restarts).
- Boot: GPUs found at their default limit (reboot, driver reload) while a safe cap is known (the
  last one the coordinator pushed, saved in the state directory, or the policy's
  ``failsafe.safe_cap_w``) are moved to the safe cap before the agent reports ready
  (``LocalStatus.ready``).
- Keeps one AgentLink stream to the coordinator (:mod:`nodeagent.link`): hello with GPUs,
  bindings and last plan seq; telemetry every interval; job events; plans applied (decreases first,
  clamped to the limit constraints) and acknowledged with the enforced read-back.
- Lease (:mod:`nodeagent.lease`): when it runs out, the GPUs with caps move to
  min(current, safe cap), reported as cap_state ``SAFE_CAP``.
- Drift: :meth:`CapManager.reconcile` every interval; its per-GPU cap_state goes into telemetry.
- Serves AgentLocal (JobStart/JobEnd/LocalStatus) for the Slurm hooks on a root-only unix socket
  with an SO_PEERCRED check (:mod:`nodeagent.local`).

SIGTERM/SIGINT stop it cleanly (caps stay where they are: the lease/safe caps protect the budget).
Exit codes as :mod:`capctl.errors` (1 bad input, 5 NVML/hardware).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import grpc

from capctl import capstates, lifeline
from capctl.errors import CapctlError, UserInputError, run_for_person
from nodeagent.lease import Lease, failsafe_caps
from nodeagent.link import PROTOCOL_VERSION, AgentLinkClient
from nodeagent.savedstate import atomic_write

log = logging.getLogger("capctl.agent")

AGENT_VERSION = "0.1.0"
STATE_FILE = "agent-state.json"
"""Agent's own state file in the state directory (job metadata, safe caps, last plan seq)."""
DEFAULT_INTERVAL_S = 5.0
BOOT_DEFAULT_TOLERANCE_W = 1.0
"""A GPU whose limit is within this many W of its default limit counts as "at its default"."""



def _finite(value, default: float = 0.0) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


class Agent:
    """The node agent: owns the CapManager, the AgentLink client, the local server and the loop.

    Args:
        node: Slurm node name.
        coordinator: gRPC target of the coordinator.
        socket_path: AgentLocal unix socket path.
        state_dir: state directory (0700; created).
        backend: an opened :class:`~nodeagent.nvml.NvmlBackend`.
        caps: a :class:`~nodeagent.caps.CapManager` on ``backend`` and ``state_dir``.
        start_cap_w: cap applied to a job's GPUs at JobStart until the coordinator assigns one, W.
        policy_safe_cap_w: failsafe cap from the policy (None: only coordinator-pushed ones), W.
        interval_s: telemetry / reconcile period in seconds (replaced by the Welcome's).
        socket_gid: gid allowed on the local socket besides root (None: root only).
    """

    def __init__(self, node: str, coordinator: str, socket_path: str, state_dir: Path, backend, caps,
                 *, start_cap_w: float, policy_safe_cap_w: float | None, interval_s: float,
                 socket_gid: int | None = None, backoff_max_s: float = 5.0, tls=None) -> None:
        self.node = node
        self.coordinator = coordinator
        self.socket_path = socket_path
        self.state_dir = Path(state_dir)
        self.backend = backend
        self.caps = caps
        self.start_cap_w = float(start_cap_w)
        self.policy_safe_cap_w = policy_safe_cap_w
        self.interval_s = float(interval_s)
        self.socket_gid = socket_gid
        self.backoff_max_s = backoff_max_s
        self.tls = tls  # capctl.security.tls.TlsConfig for mTLS to the coordinator, or None

        self.lock = threading.RLock()  # guards every CapManager/backend write and the fields below
        self.stop_event = threading.Event()
        self.wake = threading.Event()  # run the next tick now (after a Welcome)
        self.ready = False
        self.devices = {d.index: d for d in backend.devices()}
        self.jobs: dict[str, dict] = {}  # job_id -> {gpu_indices, user, partition, account, qos, start_time_s}
        self.desired_w: dict[int, float] = {}  # what the agent keeps on each GPU it manages
        self.safe_mode: set[int] = set()  # GPUs held at their safe cap after a lease expiry
        # the coordinator's latest allowance per GPU (W; min with the safe cap after a lease expiry):
        # no start cap and no restore ever raises a managed GPU above it
        self.allowed_w: dict[int, float] = {}
        self.gpu_error: dict[int, str] = {}
        self.lease = Lease()
        self.last_plan_seq = 0
        self.coordinator_id = ""
        self.telemetry_seq = 0
        self.last_samples: list = []
        self.link: AgentLinkClient | None = None
        self.local = None
        self._loop_thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------
    # state
    def _state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def load_state(self) -> None:
        """Read the agent state file and merge it with the CapManager's bindings (authoritative)."""
        data: dict = {}
        path = self._state_path()
        if path.exists():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as err:
                log.error("state file %s unreadable (%s); starting from the CapManager's bindings", path, err)
                data = {}
        meta = data.get("jobs") if isinstance(data.get("jobs"), dict) else {}
        safe = data.get("safe_caps_w") if isinstance(data.get("safe_caps_w"), dict) else {}
        try:
            self.lease.set_safe_caps({int(k): float(v) for k, v in safe.items()})
        except (TypeError, ValueError):
            pass
        try:
            self.last_plan_seq = int(data.get("last_plan_seq", 0))
        except (TypeError, ValueError):
            self.last_plan_seq = 0
        bindings = self._cap_bindings()
        if getattr(self.caps, "state_file_error", None) is not None:
            # the CapManager's file was corrupt: rebind from our own state file (two copies, one lost)
            for job_id, m in meta.items():
                if job_id in bindings or not isinstance(m, dict):
                    continue
                try:
                    indices = sorted({int(i) for i in m.get("gpu_indices", [])} & set(self.devices))
                except (TypeError, ValueError):
                    continue
                if indices:
                    try:
                        self.caps.bind(job_id, indices)
                    except CapctlError as err:
                        log.error("rebinding job %s from %s failed: %s", job_id, path, err)
                        continue
                    log.warning("job %s rebound to GPUs %s from %s (the cap state file was corrupt)",
                                job_id, indices, path)
            bindings = self._cap_bindings()
        for job_id, indices in bindings.items():
            m = meta.get(job_id) if isinstance(meta.get(job_id), dict) else {}
            self.jobs[job_id] = {
                "gpu_indices": sorted(indices),
                "user": str(m.get("user", "")), "partition": str(m.get("partition", "")),
                "account": str(m.get("account", "")), "qos": str(m.get("qos", "")),
                "start_time_s": _finite(m.get("start_time_s"), time.time()),
            }
        if self.jobs:
            log.info("restored %d job binding(s) from %s: %s", len(self.jobs), self.state_dir,
                     ", ".join(sorted(self.jobs)))

    def save_state(self) -> None:
        """Write ``agent-state.json`` atomically (0600); errors are logged, the agent keeps running."""
        data = {
            "node": self.node,
            "jobs": self.jobs,
            "safe_caps_w": {str(k): v for k, v in self.lease.safe_caps_w.items()},
            "last_plan_seq": self.last_plan_seq,
            "coordinator_id": self.coordinator_id,
        }
        try:
            atomic_write(self._state_path(), json.dumps(data, indent=1, sort_keys=True).encode("utf-8"))
        except OSError as err:
            log.error("cannot write state file %s: %s", self._state_path(), err)

    def _cap_bindings(self) -> dict[str, list[int]]:
        """The CapManager's bindings (the authoritative, persisted ones): ``{job_id: [index, ...]}``."""
        return {str(job): sorted(int(i) for i in indices) for job, indices in self.caps.bindings().items()}

    def bound_indices(self) -> dict[int, list[str]]:
        """``{index: [job_ids]}`` of every bound GPU."""
        out: dict[int, list[str]] = {}
        for job_id, meta in self.jobs.items():
            for i in meta["gpu_indices"]:
                out.setdefault(i, []).append(job_id)
        return out

    # ------------------------------------------------------------------------------------------
    # caps
    def _clamp(self, index: int, cap_w: float) -> float:
        dev = self.devices.get(index)
        if dev is None or not math.isfinite(dev.min_cap_w) or not math.isfinite(dev.max_cap_w):
            return float(cap_w)
        return min(max(float(cap_w), dev.min_cap_w), dev.max_cap_w)

    def _safe_cap_for(self, index: int) -> float | None:
        values = [v for v in (self.lease.safe_caps_w.get(index), self.policy_safe_cap_w) if v]
        return min(values) if values else None

    def _apply(self, caps_w: dict[int, float]) -> dict[int, object]:
        """Apply caps through the CapManager (which writes decreases first); results by index."""
        if not caps_w:
            return {}
        try:
            results = dict(_results_iter(self.caps.set_caps(caps_w), caps_w))
        except CapctlError as err:
            log.error("set_caps %s failed: %s", caps_w, err)
            for i in caps_w:
                self.gpu_error[i] = str(err)
            return {}
        self._note_errors(results)
        return results

    def _note_errors(self, results: dict) -> bool:
        """Record each GPU's set-cap error from ``results`` ({index: result}); clear it on success.

        Returns True when no GPU of ``results`` failed."""
        ok = True
        for i, r in results.items():
            err = _result_error(r)
            if err:
                self.gpu_error[i] = err
                ok = False
            else:
                self.gpu_error.pop(i, None)
        return ok

    def boot_safe_caps(self) -> None:
        """Move GPUs found at their default limit to the known safe cap (before ready)."""
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
                    # unbound GPU: the safe cap becomes its limit; no pre-job limit is saved for it
                    try:
                        self.backend.set_cap_w(s.index, cap)
                        log.warning("boot: GPU %d was at its default limit %.0f W; safe cap %.0f W applied",
                                    s.index, dev.default_cap_w, cap)
                    except CapctlError as err:
                        self.gpu_error[s.index] = str(err)
                        log.error("boot: GPU %d: cannot apply the safe cap: %s", s.index, err)
        if todo_bound:
            log.warning("boot: bound GPUs %s at their default limit; applying safe caps", sorted(todo_bound))
            self._apply(todo_bound)
            self.desired_w.update(todo_bound)
        # keep bound GPUs where they are now (restart never resets caps)
        self.last_samples = self.backend.telemetry_all()
        for s in self.last_samples:
            if s.index in bound and s.index not in self.desired_w and getattr(s, "error", None) is None:
                self.desired_w[s.index] = s.cap_w

    # ------------------------------------------------------------------------------------------
    # protobuf builders
    def _gpu_info(self, dev):
        from capctl.v1 import capctl_pb2

        saved = {}
        try:
            saved = dict(self.caps.saved_limits_w() or {})
        except Exception:  # noqa: BLE001
            saved = {}
        return capctl_pb2.GpuInfo(
            index=dev.index, uuid=dev.uuid or "", name=dev.name or "",
            minor_number=max(0, int(dev.minor_number)), pci_bus_id=dev.pci_bus_id or "",
            min_cap_w=_finite(dev.min_cap_w), max_cap_w=_finite(dev.max_cap_w),
            default_cap_w=_finite(dev.default_cap_w), slowdown_temp_c=_finite(dev.slowdown_temp_c),
            shutdown_temp_c=_finite(dev.shutdown_temp_c), max_sm_clock_mhz=int(dev.max_sm_clock_mhz or 0),
            pre_job_cap_w=_finite(saved.get(dev.index, 0.0)),
        )

    def _binding(self, job_id: str):
        from capctl.v1 import capctl_pb2

        m = self.jobs[job_id]
        return capctl_pb2.JobBinding(job_id=job_id, node=self.node, gpu_indices=m["gpu_indices"], user=m["user"],
                                     partition=m["partition"], account=m["account"], qos=m["qos"],
                                     start_time_s=m["start_time_s"])

    def _gpu_telemetry(self, s, bound: dict[int, list[str]], states: dict[int, str] | None = None):
        from capctl.v1 import capctl_pb2

        err = getattr(s, "error", None)
        state = states.get(s.index, capstates.OK) if states is not None else capstates.OK
        if s.index in self.safe_mode and state == capstates.OK:
            state = capstates.SAFE_CAP
        if err:
            state = capstates.LOST if getattr(s, "error_type", "") == "GpuLostError" else capstates.ERROR
        return capctl_pb2.GpuTelemetry(
            index=s.index, power_w=_finite(s.power_w), cap_w=_finite(s.cap_w), enforced_w=_finite(s.enforced_w),
            temp_c=_finite(s.temp_c), sm_clock_mhz=int(s.sm_clock_mhz or 0),
            clocks_event_reasons=list(s.clocks_event_reasons or ()), utilization_pct=_finite(s.utilization_pct),
            energy_j=_finite(s.energy_j), job_id=",".join(bound.get(s.index, [])), cap_state=capstates.to_wire(state),
            error=err or self.gpu_error.get(s.index, ""),
            pre_job_cap_w=_finite(self.caps.saved_limits_w().get(s.index, 0.0)),
        )

    def hello(self):
        """The ``AgentHello`` for a (re)connect: GPUs re-read from NVML, bindings, last plan seq."""
        from capctl.v1 import capctl_pb2

        with self.lock:
            self.devices = {d.index: d for d in self.backend.devices()}
            return capctl_pb2.AgentHello(
                protocol_version=PROTOCOL_VERSION, node=self.node, agent_version=AGENT_VERSION,
                driver_version=self.backend.driver_version or "", simulated=bool(self.backend.simulated),
                gpus=[self._gpu_info(d) for d in sorted(self.devices.values(), key=lambda d: d.index)],
                jobs=[self._binding(j) for j in sorted(self.jobs)], last_plan_seq=self.last_plan_seq,
            )

    # ------------------------------------------------------------------------------------------
    # link callbacks
    def on_welcome(self, welcome) -> None:
        """Take the coordinator's interval and initial safe caps; send telemetry right away."""
        with self.lock:
            if welcome.interval_s > 0:
                self.interval_s = float(welcome.interval_s)
            if welcome.coordinator_id != self.coordinator_id:
                self.coordinator_id = welcome.coordinator_id
            self.lease.set_safe_caps({c.index: c.cap_w for c in welcome.safe_caps})
            self.save_state()
        self.wake.set()  # telemetry right away: the coordinator needs our enforced caps before planning

    def on_plan(self, plan):
        """Apply a ``CapPlan`` (renew the lease, update safe caps, set caps clamped to the limit
        constraints unless ``dry_run``) and return its ``CapAck`` with the read-back of the GPUs it
        named (all GPUs for a plan without caps). Unknown GPUs or non-finite caps make ``ok`` false."""
        from capctl.v1 import capctl_pb2

        with self.lock:
            self.lease.renew(plan.lease_s, plan.lease_expiry_s)
            before = dict(self.lease.safe_caps_w)
            self.lease.set_safe_caps({c.index: c.cap_w for c in plan.safe_caps})
            safe_changed = any(abs(before.get(i, -1e9) - v) > 1.0 for i, v in self.lease.safe_caps_w.items())
            if self.safe_mode:
                log.info("lease renewed by plan %d: leaving the failsafe on GPUs %s", plan.seq, sorted(self.safe_mode))
                self.safe_mode.clear()
            errors: list[str] = []
            ok = True
            if not plan.dry_run and plan.caps:
                wanted: dict[int, float] = {}
                for c in plan.caps:
                    if c.index not in self.devices:
                        errors.append(f"GPU {c.index} does not exist on {self.node}")
                        ok = False
                        continue
                    if not math.isfinite(c.cap_w) or c.cap_w <= 0:
                        errors.append(f"GPU {c.index}: cap {c.cap_w!r} W refused")
                        ok = False
                        continue
                    wanted[c.index] = self._clamp(c.index, c.cap_w)
                for i, cap in wanted.items():
                    self.allowed_w[i] = cap
                    self.caps.set_restore_ceiling(i, cap)  # a held restore may rise to the new allowance
                results = self._apply(wanted)
                for i, cap in wanted.items():
                    r = results.get(i)
                    if r is None or _result_error(r):
                        ok = False
                        errors.append(f"GPU {i}: {_result_error(r) if r is not None else 'not applied'}")
                    self.desired_w[i] = cap
            self.last_plan_seq = max(self.last_plan_seq, plan.seq) if plan.seq else self.last_plan_seq
            samples = self.backend.telemetry_all()
            self.last_samples = samples
            bound = self.bound_indices()
            touched = {c.index for c in plan.caps}
            states = self.caps.states()
            gpus = [self._gpu_telemetry(s, bound, states) for s in samples if not touched or s.index in touched]
            if safe_changed or plan.seq % 20 == 0:  # the boot failsafe needs the latest safe caps
                self.save_state()
        return capctl_pb2.CapAck(seq=plan.seq, ok=ok, gpus=gpus, error="; ".join(errors))

    def on_disconnect(self) -> None:
        log.warning("coordinator link down; lease %s", "held" if self.lease.active() else "not held")

    # ------------------------------------------------------------------------------------------
    # periodic work
    def tick(self) -> None:
        """One interval: retries, failsafe, drift reconcile, telemetry."""
        from capctl.v1 import capctl_pb2

        with self.lock:
            try:
                self.caps.retry_pending()
            except CapctlError as err:
                log.error("retrying pending restores failed: %s", err)
            if self.lease.expired() and not self.lease.expired_applied:
                self._apply_failsafe()
            try:
                self.caps.reconcile(dict(self.desired_w))
            except CapctlError as err:
                log.error("reconcile failed: %s", err)
            states = self.caps.states()
            samples = self.backend.telemetry_all()
            self.last_samples = samples
            self.telemetry_seq += 1
            bound = self.bound_indices()
            msg = capctl_pb2.NodeTelemetry(node=self.node, timestamp_s=time.time(), seq=self.telemetry_seq,
                                           gpus=[self._gpu_telemetry(s, bound, states) for s in samples])
        if self.link is not None:
            self.link.send(capctl_pb2.AgentMessage(telemetry=msg), droppable=True)

    def _apply_failsafe(self) -> None:
        managed = set(self.bound_indices()) | set(self.desired_w)
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
        while not self.stop_event.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # noqa: BLE001 — the daemon keeps running on its last good state
                log.exception("agent tick failed")
            # wake up at least every 0.5 s so a lease expiry is acted on promptly
            deadline = started + self.interval_s
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now >= deadline:
                    break
                rem = self.lease.remaining_s(now)
                if rem is not None and rem <= 0 and not self.lease.expired_applied:
                    break
                if self.wake.wait(min(0.5, deadline - now)):
                    self.wake.clear()
                    time.sleep(0.05)  # let the link finish its handshake before the telemetry goes out
                    break

    # ------------------------------------------------------------------------------------------
    # AgentLocal
    def map_gpu_ids(self, gpu_ids, kind: int) -> list[int]:
        """Map SLURM_JOB_GPUS-style ids to NVML indices by minor number / UUID / PCI bus id.

        Raises:
            UserInputError: an id matches no GPU (the message lists the known ones).
        """
        from capctl.v1 import capctl_pb2

        out: list[int] = []
        devs = list(self.devices.values())
        for raw in gpu_ids:
            gid = str(raw).strip()
            match = None
            if kind == capctl_pb2.GPU_ID_MINOR:
                if gid.isdigit():
                    match = next((d for d in devs if int(d.minor_number) == int(gid)), None)
                known = sorted(int(d.minor_number) for d in devs)
            elif kind == capctl_pb2.GPU_ID_UUID:
                match = next((d for d in devs if d.uuid and d.uuid.lower() == gid.lower()), None)
                known = [d.uuid for d in devs]
            elif kind == capctl_pb2.GPU_ID_PCI_BUS_ID:
                norm = _norm_pci(gid)
                match = next((d for d in devs if d.pci_bus_id and _norm_pci(d.pci_bus_id) == norm), None)
                known = [d.pci_bus_id for d in devs]
            else:
                raise UserInputError(f"gpu_id_kind {kind} is not one of MINOR, UUID, PCI_BUS_ID")
            if match is None:
                raise UserInputError(f"GPU id {gid!r} ({capctl_pb2.GpuIdKind.Name(kind)}) matches no GPU on "
                                     f"{self.node}; known: {', '.join(map(str, known))}")
            if match.index not in out:
                out.append(match.index)
        return sorted(out)

    def job_start(self, req):
        """AgentLocal.JobStart: bind ``req.job_id`` to the GPUs named by ``req.gpu_ids`` and apply the
        start cap (W) to those not yet bound; idempotent. Returns ``JobStartReply``.

        Raises:
            UserInputError: empty/oversized job id, too many ids, or an id matching no GPU.
        """
        from capctl.v1 import capctl_pb2

        job_id = req.job_id.strip()
        if not job_id or len(job_id) > 128:
            raise UserInputError(f"job_id {req.job_id!r}: give the Slurm job id (1-128 characters)")
        from capctl.security.limits import validate_job_start

        problem = validate_job_start(req)
        if problem:
            raise UserInputError(problem)
        if len(req.gpu_ids) > 1024:
            raise UserInputError(f"gpu_ids: {len(req.gpu_ids)} ids; at most 1024 allowed")
        with self.lock:
            indices = self.map_gpu_ids(req.gpu_ids, req.gpu_id_kind)
            connected = bool(self.link and self.link.connected)
            if not indices and job_id not in self.jobs:
                return capctl_pb2.JobStartReply(ok=True, coordinator_connected=connected,
                                                message=f"job {job_id} holds no GPU on {self.node}: nothing to bind")
            if job_id in self.jobs:
                known = self.jobs[job_id]["gpu_indices"]
                new = sorted(set(indices) - set(known))
                if not new:
                    return capctl_pb2.JobStartReply(
                        ok=True, message=f"job {job_id} already bound to GPUs {known} on {self.node}",
                        gpus=self._cap_results(known), coordinator_connected=connected)
                indices = sorted(set(known) | set(indices))
            bound_before = self.bound_indices()
            fresh = [i for i in indices if i not in bound_before]
            self.caps.bind(job_id, indices)
            meta = self.jobs.get(job_id) or {"user": req.user, "partition": req.partition, "account": req.account,
                                             "qos": req.qos, "start_time_s": time.time()}
            meta["gpu_indices"] = indices
            self.jobs[job_id] = meta
            # start cap until the coordinator's first assignment; never above the safe cap when no lease
            start: dict[int, float] = {}
            for i in fresh:
                cap = self.start_cap_w
                safe = self._safe_cap_for(i)
                if safe is not None and not (connected and self.lease.active()):
                    cap = min(cap, safe)
                if i in self.allowed_w:  # never above what the coordinator budgeted for this GPU
                    cap = min(cap, self.allowed_w[i])
                start[i] = self._clamp(i, cap)
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
            ok = all(not _result_error(r) for r in results.values()) and len(results) == len(start)
            binding = self._binding(job_id)
            reply = capctl_pb2.JobStartReply(
                ok=ok, message=(f"job {job_id} bound to GPUs {indices} on {self.node}; start cap applied to "
                                f"{sorted(start)}" + ("" if ok else "; some caps failed (see gpus)")),
                gpus=self._cap_results(indices, results), coordinator_connected=connected)
        log.info("JobStart %s: GPUs %s (user %s)", job_id, indices, req.user or "?")
        if self.link is not None:
            self.link.send(capctl_pb2.AgentMessage(job_started=capctl_pb2.JobStarted(binding=binding)))
        return reply

    def job_end(self, req):
        """AgentLocal.JobEnd: restore the pre-job limits of the GPUs whose last job this was (per GPU,
        best effort, failures retried), unbind, forward JobEnded; idempotent, valid without JobStart.
        Returns ``JobEndReply`` (``ok`` false when some GPU could not be restored yet).

        Raises:
            UserInputError: empty or oversized job id.
        """
        from capctl.v1 import capctl_pb2

        job_id = req.job_id.strip()
        if not job_id or len(job_id) > 128:
            raise UserInputError(f"job_id {req.job_id!r}: give the Slurm job id (1-128 characters)")
        with self.lock:
            job_gpus = set(self.jobs.get(job_id, {}).get("gpu_indices", [])) | set(self._cap_bindings().get(job_id, []))
            known = bool(job_gpus) or job_id in self.jobs
            ceiling = {i: self.allowed_w[i] for i in job_gpus if i in self.allowed_w}
            try:
                res = self.caps.release(job_id, ceiling_w=ceiling)
            except CapctlError as err:
                log.error("release of job %s failed: %s", job_id, err)
                res = {}
            results = dict(_results_iter(res, {}))
            self.jobs.pop(job_id, None)
            still_bound = self.bound_indices()
            for i in job_gpus:
                if i not in still_bound:  # MIG/shared GPUs keep their cap until the last job leaves
                    self.desired_w.pop(i, None)
                    self.safe_mode.discard(i)
            ok = self._note_errors(results)
            self.save_state()
            gpus = [_cap_result_pb(i, r) for i, r in sorted(results.items())]
        msg = (f"job {job_id} ended on {self.node}; restored GPUs {sorted(results)}" if known
               else f"job {job_id} was not bound on {self.node}; nothing to restore")
        if not ok:
            msg += "; some GPUs could not be restored and will be retried"
        log.info("JobEnd %s: %s", job_id, msg)
        if self.link is not None:
            self.link.send(capctl_pb2.AgentMessage(job_ended=capctl_pb2.JobEnded(job_id=job_id, node=self.node)))
        return capctl_pb2.JobEndReply(ok=ok, message=msg, gpus=gpus)

    def local_status(self):
        """AgentLocal.LocalStatus: node, link state, bindings, last telemetry and ``ready``."""
        from capctl.v1 import capctl_pb2

        with self.lock:
            bound = self.bound_indices()
            states = self.caps.states()
            return capctl_pb2.LocalStatusReply(
                node=self.node, coordinator_connected=bool(self.link and self.link.connected),
                jobs=[self._binding(j) for j in sorted(self.jobs)],
                gpus=[self._gpu_telemetry(s, bound, states) for s in self.last_samples], ready=self.ready)

    def _cap_results(self, indices, results: dict | None = None):
        results = results or {}
        by_index = {s.index: s for s in self.last_samples}
        out = []
        for i in indices:
            if i in results:
                out.append(_cap_result_pb(i, results[i]))
            else:
                from capctl.v1 import capctl_pb2

                s = by_index.get(i)
                out.append(capctl_pb2.GpuCapResult(index=i, cap_w=_finite(getattr(s, "cap_w", 0)),
                                                   enforced_w=_finite(getattr(s, "enforced_w", 0)), ok=True))
        return out

    # ------------------------------------------------------------------------------------------
    # lifecycle
    def start(self) -> None:
        """Load state, apply boot safe caps, report ready, then start the local server, link and loop."""
        from nodeagent.local import LocalServer

        self.load_state()
        with self.lock:
            self.boot_safe_caps()
            self.ready = True
        log.info("agent %s ready: %d GPU(s), %d job(s)", self.node, len(self.devices), len(self.jobs))
        self.local = LocalServer(self.socket_path, _LocalServicer(self), allowed_gid=self.socket_gid)
        self.local.start()
        creds, options = None, []
        if self.tls is not None:
            from capctl.security import tls as tls_mod

            creds, options = tls_mod.channel_credentials(self.tls), tls_mod.channel_options(self.tls)
        self.link = AgentLinkClient(self.coordinator, self.hello, self.on_welcome, self.on_plan, self.on_disconnect,
                                    credentials=creds, channel_options=options, backoff_max_s=self.backoff_max_s)
        self.link.start()
        self._loop_thread = threading.Thread(target=self._loop, name="agent-loop", daemon=True)
        self._loop_thread.start()

    def stop(self) -> None:
        """Stop the loop, the link and the local server; save the state file. Caps are left as they are."""
        self.stop_event.set()
        self.wake.set()
        if self.link is not None:
            self.link.stop()
        if self.local is not None:
            self.local.stop()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=5.0)
        with self.lock:
            self.save_state()


class _LocalServicer:
    """AgentLocal gRPC servicer: maps user errors to INVALID_ARGUMENT, hardware errors to INTERNAL."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def _guard(self, fn, request, context):
        try:
            return fn(request)
        except UserInputError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except CapctlError as err:
            context.abort(grpc.StatusCode.INTERNAL, str(err))
        except Exception as err:  # noqa: BLE001
            log.exception("local call failed")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    def JobStart(self, request, context):  # noqa: N802 (gRPC naming)
        return self._guard(self.agent.job_start, request, context)

    def JobEnd(self, request, context):  # noqa: N802
        return self._guard(self.agent.job_end, request, context)

    def LocalStatus(self, request, context):  # noqa: N802
        return self._guard(lambda _r: self.agent.local_status(), request, context)


# ----------------------------------------------------------------------------------------------
# helpers for CapManager results (SetResult / restore results / error markers)

def _result_error(r) -> str:
    if r is None:
        return "no result"
    if isinstance(r, BaseException):
        return str(r)
    err = getattr(r, "error", None)
    if err:
        return str(err)
    if getattr(r, "ok", True) is False:
        return str(getattr(r, "message", "") or "failed")
    return ""


def _results_iter(res, batch):
    """Yield ``(index, result)`` from a CapManager result (dict by index or list of records)."""
    if res is None:
        return
    if isinstance(res, dict):
        for i, r in res.items():
            yield int(i), r
        return
    for r in res:
        idx = getattr(r, "index", None)
        if idx is not None:
            yield int(idx), r


def _cap_result_pb(index: int, r):
    from capctl.v1 import capctl_pb2

    err = _result_error(r)
    cap = getattr(r, "cap_w", None)
    if cap is None:
        cap = getattr(r, "restored_w", getattr(r, "written_w", 0.0))
    return capctl_pb2.GpuCapResult(index=index, cap_w=_finite(cap), enforced_w=_finite(getattr(r, "enforced_w", 0.0)),
                                   ok=not err, error=err)


def _norm_pci(bus_id: str) -> str:
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


# ----------------------------------------------------------------------------------------------
# command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capctl-agent", description="capctl node agent (one per compute node).")
    p.add_argument("--node", required=True, help="Slurm node name of this host")
    p.add_argument("--coordinator", required=True, help="coordinator gRPC address (host:port or unix:/path)")
    p.add_argument("--socket", default=None,
                   help="AgentLocal unix socket path (%%n = node name; default: the policy's agent.socket_path)")
    p.add_argument("--state-dir", required=True, help="state directory (pre-job limits, bindings); created 0700")
    p.add_argument("--nvml-library", default="system",
                   help="'system' (default), 'simulated' (our simulated driver) or an absolute path")
    p.add_argument("--allow-simulated", action="store_true",
                   help="accept the simulated driver at an absolute --nvml-library path")
    p.add_argument("--policy", default=None, help="policy YAML (start cap, safe cap, socket group, interval)")
    p.add_argument("--interval-s", type=float, default=None,
                   help="telemetry/reconcile period in seconds until the coordinator's Welcome (default: policy's)")
    p.add_argument("--socket-group", default=None, help="group allowed on the local socket besides root")
    p.add_argument("--reconnect-max-s", type=float, default=5.0, help="ceiling of the reconnect backoff, seconds")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    try:
        from capctl.security.tls import add_tls_arguments
    except ImportError:  # pragma: no cover - security module absent
        return p
    add_tls_arguments(p, what="the link to the coordinator")
    return p


def _load_policy(path: str | None):
    from capctl import policy as policy_mod

    if path:
        return policy_mod.load_policy(path)
    return getattr(policy_mod, "DEFAULT_POLICY", None)


def run(args: argparse.Namespace) -> int:
    from nodeagent.caps import CapManager
    from nodeagent.nvml import NvmlBackend

    if args.interval_s is not None and not (0.05 <= args.interval_s <= 3600):
        raise UserInputError(f"--interval-s {args.interval_s}: allowed 0.05..3600 seconds")
    if not (0.2 <= args.reconnect_max_s <= 300):
        raise UserInputError(f"--reconnect-max-s {args.reconnect_max_s}: allowed 0.2..300 seconds")
    if not args.node.strip() or "/" in args.node:
        raise UserInputError(f"--node {args.node!r}: give the Slurm node name")
    from capctl.addresses import check_address, check_socket_path

    check_address(args.coordinator, "--coordinator")
    tls_config = None
    if getattr(args, "tls_ca", None) or getattr(args, "tls_cert", None) or getattr(args, "tls_key", None):
        from capctl.security.tls import tls_from_args

        tls_config = tls_from_args(args)
        tls_config.read()  # fail now, with the flag named, rather than on every reconnect
    policy = _load_policy(args.policy)
    interval_s = args.interval_s or (policy.interval_s if policy is not None else DEFAULT_INTERVAL_S)
    start_cap_w = policy.start_cap_w if policy is not None else 300.0
    safe_cap_w = policy.failsafe.safe_cap_w if policy is not None else None
    from nodeagent.local import resolve_group

    group = args.socket_group or (policy.agent.socket_group if policy is not None else None)
    socket_gid = resolve_group(group)
    if args.socket is not None:
        socket_path = args.socket.replace("%n", args.node)
    elif policy is not None:
        socket_path = policy.socket_path(args.node)
    else:
        raise UserInputError("--socket: give the AgentLocal socket path (or a --policy with agent.socket_path)")
    socket_path = check_socket_path(socket_path, "--socket")
    from nodeagent.local import socket_in_use

    if os.path.exists(socket_path):
        live, detail = socket_in_use(socket_path)
        if live:  # checked before touching any GPU; LocalServer.start checks again when binding
            raise UserInputError(f"--socket: another agent is serving on {socket_path} ({detail}); stop it first")

    state_dir = Path(args.state_dir)
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise UserInputError(f"--state-dir {state_dir}: cannot create it ({err.strerror})") from None
    if not os.access(state_dir, os.W_OK):
        raise UserInputError(f"--state-dir {state_dir}: not writable")

    lib = args.nvml_library
    backend = NvmlBackend(lib, allow_simulated=bool(args.allow_simulated))
    backend.open()
    agent = None
    stop = threading.Event()

    def _signal(signum, _frame):
        log.info("signal %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _signal)
    signal.signal(signal.SIGINT, _signal)
    try:
        caps = CapManager(backend, state_dir)
        agent = Agent(args.node, args.coordinator, socket_path, state_dir, backend, caps, start_cap_w=start_cap_w,
                      policy_safe_cap_w=safe_cap_w, interval_s=interval_s, socket_gid=socket_gid,
                      backoff_max_s=args.reconnect_max_s, tls=tls_config)
        agent.start()
        while not stop.wait(1.0):
            pass
    finally:
        if agent is not None:
            agent.stop()
        backend.close()
    log.info("agent %s stopped", args.node)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``capctl-agent``; returns the exit status."""
    lifeline.watch_parent()  # started by a test or the demo: stop when that parent dies
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s capctl-agent[%(process)d] %(levelname)s %(name)s: %(message)s")
    from capctl.security import redact

    redact.install()  # no secrets in logs
    return run_for_person("capctl-agent", run, args)


if __name__ == "__main__":
    sys.exit(main())
