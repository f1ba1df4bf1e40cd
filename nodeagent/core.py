"""The node agent's shared state and cap helpers: :class:`AgentCore`, the base of the agent.

The agent is split by what each part does, all working on this one state under one lock:
:mod:`nodeagent.loop` (boot failsafe, link callbacks, the periodic tick), :mod:`nodeagent.jobs`
(JobStart/JobEnd binding) and :mod:`nodeagent.daemon` (servers, lifecycle, command line);
:mod:`nodeagent.agentstate` reads and writes the state file, :mod:`nodeagent.messages` builds the
protobufs. Constructing an agent starts nothing (no thread, no server, no device write), so logic
tests drive it in-process on a pure-Python :class:`~nodeagent.backend.GpuBackend`.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

from capctl import capstates, devicedata
from capctl.errors import CapctlError
from nodeagent import agentstate, messages
from nodeagent.backend import DeviceInfo, GpuBackend, GpuSample
from nodeagent.caps import CapManager
from nodeagent.energy import EnergyMeter
from nodeagent.fencing import TermFence
from nodeagent.lease import Lease
from nodeagent.link import AgentLinkClient

log = logging.getLogger("capctl.agent")


class AgentCore:
    """State of the node agent and the cap operations every part of it uses.

    Args:
        node: Slurm node name.
        coordinator: gRPC target of the coordinator (used by :meth:`nodeagent.daemon.Agent.start`).
        socket_path: AgentLocal unix socket path (used by ``start``).
        state_dir: state directory (0700; created).
        backend: an opened :class:`~nodeagent.backend.GpuBackend` (production:
            :class:`~nodeagent.nvml.NvmlBackend`).
        caps: a :class:`~nodeagent.caps.CapManager` on ``backend`` and ``state_dir``.
        start_cap_w: cap applied to a job's GPUs at JobStart until the coordinator assigns one, W.
        policy_safe_cap_w: failsafe cap from the policy (None: only coordinator-pushed ones), W.
        interval_s: telemetry / reconcile period in seconds (replaced by the Welcome's).
        socket_gid: gid allowed on the local socket besides root (None: root only).
        backoff_max_s: ceiling of the link's reconnect backoff, seconds.
        tls: a ``capctl.security.tls.TlsConfig`` for mTLS to the coordinator, or None.

    ``link`` and ``local`` stay None until ``start`` (messages for the coordinator are then not
    sent). ``lock`` guards every CapManager/backend write and the fields below.
    """

    def __init__(self, node: str, coordinator: str, socket_path: str, state_dir: Path, backend: GpuBackend,
                 caps: CapManager, *, start_cap_w: float, policy_safe_cap_w: float | None, interval_s: float,
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
        self.devices: dict[int, DeviceInfo] = {d.index: d for d in backend.devices()}
        self.jobs: dict[str, dict] = {}  # job_id -> {gpu_indices, user, partition, account, qos, start_time_s}
        self.desired_w: dict[int, float] = {}  # what the agent keeps on each GPU it manages
        self.safe_mode: set[int] = set()  # GPUs held at their safe cap after a lease expiry
        # the coordinator's latest allowance per GPU (W; min with the safe cap after a lease expiry):
        # no start cap and no restore ever raises a managed GPU above it
        self.allowed_w: dict[int, float] = {}
        self.gpu_error: dict[int, str] = {}
        self.lease = Lease()
        self.lease_s = agentstate.DEFAULT_LEASE_S
        """The last lease a plan gave (s; saved): the one the agent gives itself at start."""
        self.fence = TermFence()  # newest coordinator term seen (HA fencing)
        self.plan_term = 0  # term of the last plan applied
        self.last_plan_seq = 0
        self.stream_seq = 0  # the last plan seq taken on the current stream (reset at each Welcome)
        self.coordinator_id = ""
        self.packed_readings = False  # the coordinator's Welcome asked for GpuReadings (capctl.readings)
        self.telemetry_seq = 0
        self.last_samples: list[GpuSample] = []
        self.energy = EnergyMeter()  # per-job energy from the GPUs' energy counters (nodeagent.energy)
        self.resend_ended = False  # set by each (re)connect: the next report repeats the ended jobs' energy
        self.link: AgentLinkClient | None = None
        self.local = None  # nodeagent.local.LocalServer once started
        self._loop_thread: threading.Thread | None = None
        self.dry_run_plans = False  # the last plan was a dry run (the coordinator manages no cap)
        caps.fallback_ceiling = self.restore_fallback_w
        caps.raise_guard = self.coordinator_managed

    # ------------------------------------------------------------------------------------------
    # state
    def _state_path(self) -> Path:
        return agentstate.state_path(self.state_dir)

    def load_state(self) -> None:
        """Read the agent state file and merge it with the CapManager's bindings (authoritative).

        Never raises: an unreadable file is logged and the CapManager's bindings are used alone.
        """
        path = self._state_path()
        data = agentstate.read(path)
        meta = agentstate.job_meta(data)
        self.lease.set_safe_caps(agentstate.safe_caps_w(data))
        self.lease_s = agentstate.lease_s(data)
        self.last_plan_seq = agentstate.last_plan_seq(data)
        self.fence.see(agentstate.coordinator_term(data))  # a restart does not forget the newest term
        if getattr(self.caps, "state_file_error", None) is not None:
            # the CapManager's file was corrupt: rebind from our own state file (two copies, one lost)
            agentstate.rebind(self.caps, meta, self._cap_bindings(), self.devices, path)
        self.jobs.update(agentstate.job_records(self._cap_bindings(), meta))
        for job_id, rec in self.jobs.items():
            self.energy.start(job_id, float(rec.get("start_time_s") or 0.0), len(rec.get("gpu_indices", ())), rec)
        # their energy so far and the GPUs' last counter readings: the next reading charges the gap
        for problem in self.energy.restore(agentstate.energy(data), self._uuids()):
            log.warning("state file %s: %s", path, problem)
        if self.jobs:
            log.info("restored %d job binding(s) from %s: %s", len(self.jobs), self.state_dir,
                     ", ".join(sorted(self.jobs)))

    def save_state(self) -> None:
        """Write ``agent-state.json`` atomically (0600); errors are logged, the agent keeps running."""
        agentstate.write(self._state_path(), node=self.node, jobs=self.jobs, safe_caps=self.lease.safe_caps_w,
                         plan_seq=self.last_plan_seq, coordinator_id=self.coordinator_id,
                         coordinator_term=self.fence.newest, energy=self.energy.snapshot(self._uuids()),
                         lease_s=self.lease_s)

    def _uuids(self) -> dict[int, str]:
        """Index -> UUID of every GPU the backend listed."""
        return {i: str(getattr(d, "uuid", "") or "") for i, d in self.devices.items()}

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
        """``cap_w`` (W) clamped into GPU ``index``'s limit constraints as read at open."""
        dev = self.devices.get(index)
        if (dev is None or not math.isfinite(dev.min_cap_w) or not math.isfinite(dev.max_cap_w)
                or devicedata.unsupported_message(dev.min_cap_w, dev.max_cap_w) or dev.limit_problem):
            return float(cap_w)  # unusable constraints (0, 0 ...): never a 0 W request; the backend holds it
        return min(max(float(cap_w), dev.min_cap_w), dev.max_cap_w)

    def restore_fallback_w(self, index: int) -> float | None:
        """The ceiling (W) of a restore of GPU ``index`` while the coordinator's allowance for it is
        unknown (after a restart, or never planned): ``max(its current limit, its safe cap)``, the
        most it may hold without a lease (an unreadable limit: the safe cap). None, a full restore,
        when no safe cap is known (no coordinator ever) or the coordinator runs a dry run."""
        safe_w = self._safe_cap_for(index)
        if safe_w is None or self.dry_run_plans:
            return None
        try:
            return max(self.backend.get_cap_w(index), safe_w)
        except CapctlError:
            return safe_w

    def coordinator_managed(self, index: int) -> bool:
        """Whether a coordinator manages GPU ``index``'s caps: one sent this agent a plan or safe caps
        (also before a restart: saved) and does not run a dry run. Then a GPU back from a held state
        is raised only by a plan (:data:`nodeagent.caps.HELD_STATES`)."""
        return (self.last_plan_seq > 0 or bool(self.lease.safe_caps_w)) and not self.dry_run_plans

    def _safe_cap_for(self, index: int) -> float | None:
        """The failsafe cap of GPU ``index`` (W): the lower of the coordinator's and the policy's."""
        values = [v for v in (self.lease.safe_caps_w.get(index), self.policy_safe_cap_w) if v]
        return min(values) if values else None

    def _apply(self, caps_w: dict[int, float]) -> dict[int, object]:
        """Apply caps (W) through the CapManager (which writes decreases first); results by index.

        Never raises: a failure is logged and recorded per GPU in ``gpu_error``.
        """
        if not caps_w:
            return {}
        try:
            results = dict(messages.results_iter(self.caps.set_caps(caps_w), caps_w))
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
            err = messages.result_error(r)
            if err:
                self.gpu_error[i] = err
                ok = False
            else:
                self.gpu_error.pop(i, None)
        return ok

    # ------------------------------------------------------------------------------------------
    # messages from the agent's state
    def _gpu_info(self, dev: DeviceInfo):
        saved = {}
        try:
            saved = dict(self.caps.saved_limits_w() or {})
        except Exception:  # noqa: BLE001
            saved = {}
        return messages.gpu_info(dev, saved.get(dev.index, 0.0))

    def _binding(self, job_id: str):
        return messages.job_binding(self.node, job_id, self.jobs[job_id])

    def _gpu_telemetry(self, s: GpuSample, bound: dict[int, list[str]], states: dict[int, str] | None = None):
        cap_state = states.get(s.index, capstates.OK) if states is not None else capstates.OK
        # why it is in that state: the CapManager's message, kept with the state it explains (the
        # last set-cap error is kept until a write succeeds, which a held GPU never has: it may
        # tell of a state the GPU left long ago)
        error = self.caps.message(s.index) or self.gpu_error.get(s.index, "")
        if not error and cap_state == capstates.UNSUPPORTED_CONSTRAINTS:  # also before any write: the values read
            problem = devicedata.unsupported_message(s.min_cap_w, s.max_cap_w)
            error = f"GPU {s.index}: {problem}" if problem else ""
        return messages.gpu_telemetry(
            s, state=messages.telemetry_state(s, cap_state, s.index in self.safe_mode),
            job_ids=bound.get(s.index, []), error=error,
            pre_job_cap_w=self.caps.saved_limits_w().get(s.index, 0.0))

    def _meter(self) -> list[GpuSample]:
        """Read every GPU and charge the energy since the last reading to the jobs bound now
        (:meth:`EnergyMeter.observe`); returns the samples (also kept in ``last_samples``)."""
        samples = self.backend.telemetry_all()
        self.last_samples = samples
        self.energy.observe(samples, self.bound_indices())
        return samples

    def _cap_results(self, indices, results: dict | None = None) -> list:
        return messages.cap_results(indices, results, self.last_samples)
