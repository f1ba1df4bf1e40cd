"""A small real cluster for fault injection, with invariants sampled throughout.

Two simulated nodes (n1, n2) of 4 H100-class GPUs, each with its real ``capctl-agent``; one real
``capctl-coordinator``; three jobs (one spanning both nodes) under full load. Power domains:
``cluster`` (2,800 W) with racks ``rack-a`` = n1 and ``rack-b`` = n2 (1,500 W each).

The coordinator runs through a tiny launcher that lets the test move its wall clock
(``time.time``) by writing an offset to a file — a clock jump as the daemon's Python code sees it;
its monotonic clock is left alone, as the kernel would.

:class:`Sampler` checks, from the moment it starts:

* the sum of enforced limits within every domain limit, exactly: from the simulated driver's
  journal of enforced-limit changes (:mod:`capctl.simgpu.journal`), at every instant;

and, sampling every GPU of the simulated devices (the ground truth, not what capctl reports) every
~30 ms and the coordinator's status every ~20 ms (agents every 200 ms), records violations of:

* no GPU of a running job above its allowed cap: the most the coordinator ever allocated it (or
  pushed as its safe cap), or the policy's start cap before that;
* no job binding lost: every agent keeps every binding it was given (checked each sample); the
  coordinator's view is checked by the tests after recovery.

A test may excuse a bounded window (``excuse_s``) for a fault that by itself breaks an invariant
(a driver reload puts limits back to the default): it then asserts the recovery time separately.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path

import grpc

from capctl.capstates import of as cap_state_of
from capctl.demo.processes import CoordinatorProc, ProcessGroup, start_agent, wait_until
from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc
from tests.support.processes import require_coordinator, sim_node, stop_group

NODES = {"n1": 4, "n2": 4}
DOMAINS = {"cluster": (2800.0, ("n1", "n2")), "rack-a": (1500.0, ("n1",)), "rack-b": (1500.0, ("n2",))}
INTERVAL_S = 0.3
LEASE_S = 1.5
START_CAP_W = 300.0
RECONNECT_MAX_S = 0.5
JOBS = {"100": {"n1": [0, 1], "n2": [0, 1]}, "200": {"n1": [2, 3]}, "300": {"n2": [2, 3]}}
TOL_W = 0.5
CATCH_UP_S = 1.0
STATUS_PERIOD_S = 0.02

POLICY = f"""\
version: 1
budget_w: 2800
interval_s: {INTERVAL_S}
objective: proportional
thermal: {{margin_c: 5}}
start_cap_w: {START_CAP_W:g}
failsafe: {{lease_s: {LEASE_S}, safe_cap_w: null}}
prolog: {{on_unreachable: fail-open, timeout_s: 5}}
domains:
  name: cluster
  kind: cluster
  limit_w: 3000
  gpu_model: H100-SXM
  gpus_per_node: 4
  children:
    - {{name: rack-a, kind: rack, limit_w: 1500, nodes: "n1"}}
    - {{name: rack-b, kind: rack, limit_w: 1500, nodes: "n2"}}
"""

CLOCK_MAIN = r"""
import os, sys, time
_real_time, _mono = time.time, time.monotonic
_path = os.environ["CAPCTL_TEST_CLOCK_OFFSET_FILE"]
_cache = [0.0, -1.0]
def _offset():
    now = _mono()
    if now - _cache[1] > 0.05:
        try:
            with open(_path) as f:
                _cache[0] = float(f.read().strip() or 0)
        except (OSError, ValueError):
            pass
        _cache[1] = now
    return _cache[0]
time.time = lambda: _real_time() + _offset()
from coordinator.daemon import main
sys.exit(main())
"""


class Sampler:
    """Samples the devices and the coordinator in a background thread (see module docstring)."""

    def __init__(self, rig: FaultRig) -> None:
        self.rig = rig
        self.violations: list[str] = []
        self.max_domain_w: dict[str, float] = collections.defaultdict(float)
        self.allowed_w: dict[tuple[str, int], float] = {}
        self.samples = 0
        self.status_samples = 0
        self._excused_until = 0.0
        self._excused_ns: list[tuple[int, int]] = []  # [start, end) windows for the journal check
        self.start_ns = 0
        self._candidates: list[tuple[float, tuple[str, int], float]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> Sampler:
        self.start_ns = time.monotonic_ns()
        self.sample_status()  # the allowed caps are known before the first device sample
        for fn in (self._devices_loop, self._status_loop, self._agents_loop):
            t = threading.Thread(target=fn, daemon=True, name=f"sampler-{fn.__name__}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5.0)

    def excuse(self, seconds: float) -> None:
        """Do not count device-level violations for the next ``seconds`` (a fault that breaks them);
        ``excuse(0)`` ends every excuse now (the fault's recovery was seen)."""
        with self._lock:
            now, now_ns = time.monotonic(), time.monotonic_ns()
            if seconds <= 0:
                self._excused_until = min(self._excused_until, now)
                self._excused_ns = [(a, min(b, now_ns)) for a, b in self._excused_ns]
                return
            self._excused_until = max(self._excused_until, now + seconds)
            self._excused_ns.append((now_ns, now_ns + int(seconds * 1e9)))

    def check_domains(self) -> None:
        """The exact journal check of every domain since :meth:`start`; an interval over a limit is
        excused only when it lies wholly inside an excused window."""
        from capctl.simgpu.journal import check_nodes

        paths = {n: sim.path for n, sim in self.rig.sims.items()}
        for name, (limit, nodes) in DOMAINS.items():
            res = check_nodes(paths, limit, gpus={n: range(NODES[n]) for n in nodes}, since_ns=self.start_ns)
            self.max_domain_w[name] = res.max_sum_w
            assert res.complete, res.describe()
            for o in res.over:
                if not any(a <= o.start_ns and o.end_ns <= b for a, b in self._excused_ns):
                    self.violations.append(
                        f"t={(o.start_ns - self.start_ns) / 1e9:.3f}s domain {name}: sum of enforced limits "
                        f"{o.peak_w:.3f} W > {limit:.0f} W for {o.duration_s * 1e3:.2f} ms (journal)")

    def _violation(self, text: str) -> None:
        with self._lock:
            if time.monotonic() < self._excused_until:
                return
            if len(self.violations) < 50:
                self.violations.append(f"t={time.monotonic() - self.rig.t0:.2f}s {text}")

    def _devices_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_devices()
            except Exception as exc:  # noqa: BLE001 — a read racing a fault injection: retried
                if "lost" not in str(exc).lower():
                    self._violation(f"device read failed: {exc}")
            self._stop.wait(0.03)

    def sample_devices(self) -> None:
        rig = self.rig
        enforced: dict[tuple[str, int], float] = {}
        for node, sim in rig.sims.items():
            arr = sim.state()
            for i in range(sim.gpu_count):
                enforced[(node, i)] = float(arr[i]["enforced_w"])
        bound = rig.bound_gpus()
        now = time.monotonic()
        for key, value in enforced.items():
            if key in bound and value > max(self.allowed_w.get(key, 0.0), START_CAP_W) + TOL_W:
                with self._lock:  # judged by the status loop once the coordinator's view caught up
                    if len(self._candidates) < 10000 and now >= self._excused_until:
                        self._candidates.append((now, key, value))
        self.samples += 1

    def judge_candidates(self, older_than: float) -> None:
        """Confirm device readings above every cap the coordinator had allocated so far, unless the
        coordinator's status showed such a cap within :data:`CATCH_UP_S` (its view is published a
        moment after the plans go out)."""
        with self._lock:
            ripe = [c for c in self._candidates if c[0] <= older_than]
            self._candidates = [c for c in self._candidates if c[0] > older_than]
        for t, key, value in ripe:
            allowed = max(self.allowed_w.get(key, 0.0), START_CAP_W)
            if value > allowed + TOL_W and len(self.violations) < 50:
                self.violations.append(f"t={t - self.rig.t0:.2f}s GPU {key[0]}/{key[1]}: enforced {value:.1f} W "
                                       f"above every cap allocated to it ({allowed:.1f} W)")

    def _status_loop(self) -> None:
        # fast enough to see every allocation (each lasts at least a fifth of an interval)
        while not self._stop.is_set():
            self.sample_status()
            self._stop.wait(STATUS_PERIOD_S)

    def sample_status(self) -> None:
        rig = self.rig
        try:
            st = rig.status(timeout_s=0.5)
        except grpc.RpcError:
            st = None
        if st is not None:
            for n in st.nodes:
                for g in n.gpus:
                    key = (n.name, g.index)
                    self.allowed_w[key] = max(self.allowed_w.get(key, 0.0), g.cap_w)
            self.status_samples += 1
        self.judge_candidates(time.monotonic() - CATCH_UP_S)

    def _agents_loop(self) -> None:
        while not self._stop.is_set():
            self.sample_agents()
            self._stop.wait(0.2)

    def sample_agents(self) -> None:
        """Every agent still holds every binding it was given; note agents in their failsafe."""
        rig = self.rig
        for node, agent in list(rig.agents.items()):
            if agent.poll() is not None or rig.paused.get(node):
                continue
            try:
                local = agent.status(timeout_s=0.5)
            except Exception:  # noqa: BLE001 — agent restarting
                continue
            have = {j.job_id for j in local.jobs}
            want = {j for j, where in rig.jobs.items() if node in where}
            if local.ready and not want <= have:
                self._violation(f"agent {node} lost binding(s) {sorted(want - have)}")
            for g in local.gpus:
                if cap_state_of(g) == "SAFE_CAP":
                    rig.safe_cap_seen.add(node)


class FaultRig:
    """The cluster, its processes and the sampler. ``stop()`` ends everything it started."""

    policy_text = POLICY

    def __init__(self, workdir: Path) -> None:
        require_coordinator()
        self.workdir = Path(workdir)
        self.group = ProcessGroup()
        self.sims: dict = {}
        self.agents: dict = {}
        self.coordinator: CoordinatorProc | None = None
        self.jobs: dict[str, dict[str, list[int]]] = {}
        self.paused: dict[str, bool] = {}
        self.safe_cap_seen: set[str] = set()
        self.clock_file = self.workdir / "clock-offset"
        self.policy_path = self.workdir / "policy.yaml"
        self.sampler: Sampler | None = None
        self.t0 = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> FaultRig:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.policy_path.write_text(self.policy_text)
        self.clock_file.write_text("0")
        for k, (name, count) in enumerate(NODES.items()):
            self.sims[name] = sim_node(self.workdir / f"sim-{name}", count, seed=300 + k)
        self.start_coordinator()
        for name in NODES:
            self.start_agent(name)
        for name in NODES:
            self.agents[name].wait_ready(30.0, connected=True)
        self.wait_idle_within_limits()
        self.sampler = Sampler(self).start()  # from here on, everything is sampled (job starts too)
        for job, where in JOBS.items():
            self.job_start(job, where)
        for sim in self.sims.values():
            for i in range(sim.gpu_count):
                sim.set_load(i, 700.0, 100.0)
        self.wait_settled()
        return self

    def wait_idle_within_limits(self, timeout_s: float = 20.0) -> None:
        """Before any job: the coordinator has brought the idle devices (created at their default
        limit) within every domain limit."""
        def ok():
            for name, (limit, nodes) in DOMAINS.items():
                if sum(sum(self.enforced(n)) for n in nodes) > limit + TOL_W:
                    return False
            return True
        wait_until(ok, timeout_s, 0.1, "idle devices within the domain limits", proc=self.coordinator)

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        for name, paused in self.paused.items():
            if paused and self.agents.get(name) is not None:
                self.agents[name].signal(__import__("signal").SIGCONT)
        stop_group(self.group)
        for sim in self.sims.values():
            sim.close()

    def start_coordinator(self) -> CoordinatorProc:
        argv = [sys.executable, "-c", CLOCK_MAIN, "--policy", str(self.policy_path),
                "--listen", f"unix:{self.workdir / 'coordinator.sock'}", "--state-dir", str(self.workdir / "coord-state"),
                "--admin-socket", str(self.workdir / "admin.sock"), "--metrics-port", "-1"]
        env = dict(os.environ)
        env.pop("CAPCTL_SIMGPU_NODE", None)
        env.update(PYTHONUNBUFFERED="1", CAPCTL_TEST_CLOCK_OFFSET_FILE=str(self.clock_file))
        proc = CoordinatorProc("coordinator", argv, self.workdir / "coordinator.log", env=env)
        proc.address = f"unix:{self.workdir / 'coordinator.sock'}"
        proc.admin_address = f"unix:{self.workdir / 'admin.sock'}"
        proc.state_dir = self.workdir / "coord-state"
        self.group.add(proc)
        self.coordinator = proc
        proc.wait_serving(30.0)
        return proc

    def start_agent(self, name: str):
        agent = self.group.add(start_agent(self.workdir, name, self.coordinator.address, sim_env=self.sims[name].env(),
                                           policy=self.policy_path, reconnect_max_s=RECONNECT_MAX_S))
        self.agents[name] = agent
        return agent

    # -- helpers -----------------------------------------------------------------------------
    def job_start(self, job: str, where: dict[str, list[int]]) -> None:
        for node, gpus in where.items():
            with self.agents[node].client() as c:
                reply = c.job_start(job, [str(g) for g in gpus], user="faults")
            assert reply.ok, reply.message
        self.jobs[job] = {n: list(g) for n, g in where.items()}

    def job_end(self, job: str) -> None:
        for node in self.jobs.pop(job):
            with self.agents[node].client() as c:
                c.job_end(job)

    def bound_gpus(self) -> set[tuple[str, int]]:
        return {(n, g) for where in list(self.jobs.values()) for n, gs in where.items() for g in gs}

    def status(self, timeout_s: float = 2.0):
        with grpc.insecure_channel(self.coordinator.address) as ch:
            return pb_grpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=timeout_s)

    def admin(self, method: str, request, timeout_s: float = 5.0):
        with grpc.insecure_channel(self.coordinator.admin_address) as ch:
            return getattr(pb_grpc.AdminStub(ch), method)(request, timeout=timeout_s)

    def enforced(self, node: str) -> list[float]:
        sim = self.sims[node]
        return [sim.read(i)["enforced_w"] for i in range(sim.gpu_count)]

    def coordinator_jobs(self) -> dict[str, list[str]]:
        return {j.job_id: sorted(j.nodes) for j in self.status().jobs}

    def bindings_complete(self) -> bool:
        try:
            seen = self.coordinator_jobs()
        except grpc.RpcError:
            return False
        return all(seen.get(j) == sorted(where) for j, where in self.jobs.items())

    def wait_settled(self, timeout_s: float = 20.0) -> None:
        """Wait until every node is live at the coordinator, every job is seen there, and the
        devices use at least 90 % of the cluster budget.

        Raises:
            TimeoutError: not settled within ``timeout_s``; names the conditions still unmet.
        """
        unmet: list[str] = []

        def ok():
            st = self.status()
            unmet.clear()
            stale = [n.name for n in st.nodes if n.stale]
            if stale or len(st.nodes) != len(NODES):
                unmet.append(f"nodes {sorted(n.name for n in st.nodes)} stale {stale}")
            used = sum(sum(self.enforced(n)) for n in NODES)
            if used < 0.9 * DOMAINS["cluster"][0]:
                unmet.append(f"devices use {used:.1f} W < 90 % of {DOMAINS['cluster'][0]:g} W")
            # the coordinator's view of each enforced limit (from the agents' reports) matches the device;
            # its desired cap may differ by up to the planner's deadband, which is not re-sent
            off = [(n.name, g.index, g.enforced_w, self.sims[n.name].read(g.index)["enforced_w"])
                   for n in st.nodes for g in n.gpus
                   if abs(g.enforced_w - self.sims[n.name].read(g.index)["enforced_w"]) > 1.0]
            if off:
                unmet.append(f"coordinator view != devices (node, gpu, view W, device W): {off}")
            if not self.bindings_complete():
                unmet.append(f"bindings {self.coordinator_jobs()} != {self.jobs}")
            return not unmet
        try:
            wait_until(ok, timeout_s, 0.1, "cluster settled (live, bound, budget used, view = devices)",
                       proc=self.coordinator)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\nunmet at the deadline: {unmet}") from None

    def healthy(self) -> bool:
        try:
            if self.coordinator.poll() is not None or any(a.poll() is not None for a in self.agents.values()):
                return False
            if any(self.paused.values()):
                return False
            st = self.status()
            return len(st.nodes) == len(NODES) and all(not n.stale for n in st.nodes) and self.bindings_complete()
        except Exception:  # noqa: BLE001
            return False

    def wait_no_safe_caps(self, timeout_s: float = 10.0) -> None:
        """Wait until no agent reports a GPU in ``SAFE_CAP`` (leases renewed everywhere)."""
        def ok():
            return not any(cap_state_of(g) == "SAFE_CAP" for a in self.agents.values() for g in a.status().gpus)
        wait_until(ok, timeout_s, 0.05, "no agent in its failsafe")

    def assert_invariants(self) -> None:
        """Fail with the recorded violations, if any; the samplers must have been running."""
        s = self.sampler
        s.sample_status()
        s.judge_candidates(float("inf"))
        s.check_domains()
        assert s.samples > 0 and s.status_samples > 0, "the sampler did not run"
        assert not s.violations, "invariants violated:\n" + "\n".join(s.violations)
