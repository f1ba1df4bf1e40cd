#!/usr/bin/env python3
"""CPU cost of one reconcile interval per GPU, by stage (issue 12, item 7: "low cost per GPU").

    .venv/bin/python bench/interval_cost.py [--gpus 8000,100000] [--intervals 6] [--warmup 3]

For each N: N GPUs, 8 per node (H100-class, 200-700 W), racks of 32 nodes with a rack limit of
0.85 x their maximum draw, the cluster budget 0.7 x TDP; a job mix of node-aligned synchronous jobs
of 8-1,024 GPUs (log-uniform sizes, as :func:`capctl.allocator.synthetic.synthetic_cluster`) on
90 % of the GPUs, the rest idle; the policy's default idle rule (``idle_cap_w: null``).

The coordinator is the daemon's own :class:`coordinator.loop.Coordinator` (registry, models,
decision, plans, ledger, view) on a simulated clock that advances one interval per interval (the
refit throttle and leases see the policy's 1 s interval; the reports land :data:`REPORT_LEAD_S`
before the snapshot; the refit budget keeps its real ``perf_counter`` clock). Each node's agent is a small in-process stand-in (no gRPC: the transport
is bench/control_loop.py's): it says hello with the real ``AgentHello``, and each interval sends
one real ``NodeTelemetry`` serialized to bytes, its GPUs packed (``GpuReadings``, what the real
agent sends this coordinator; ``--readings plain``: one ``GpuTelemetry`` per GPU and plans with
per-GPU caps, as agents before packed readings and plans); the coordinator side decodes it (``AgentMessage.FromString``, what the gRPC
deserializer calls) and runs the server's telemetry branch (``limits.telemetry_rows``,
``Coordinator.on_energy``, ``Registry.on_telemetry``).
Plans are real ``CapPlan`` messages; the stand-in agent applies their caps and answers a plan with
caps with a real ``CapAck`` (the read-back of the GPUs the plan named, as nodeagent does; a hold is
not acknowledged), decoded and recorded by ``Coordinator.on_ack`` during the phase-1 wait.
Loads: every job alternates a heavy phase (650 W demand) and a light one (320 W) every few
intervals at its own offset; each GPU has a power factor (Sinha et al. SC'22: +-10 %), so caps
move; its SM clock follows the DVFS cube law at the power it draws; 1 % of the GPUs run hot. Each
job has a memory-bound share (uniform in [0, :data:`MAX_MEMORY_SHARE`]) and its GPUs report NVML's
utilization rates as the simulated driver does (memory = util x m / (m + (1 - m) / r)), so
``models`` includes the memory-bound share update (``memory_bound_gpus``: GPUs with an estimate).

Measured: CPU seconds (``time.process_time``, the whole process) of each stage of the timed
intervals, per GPU per interval (us):

* ``ingest``: decode + telemetry branch, one report per node;
* ``models``: ``Models.update`` (samples -> per-GPU rate curves, node thermal fits);
* ``refit``: the lazy curve refits of GPUs due for one (``Models._refit_due`` from
  ``Models.curve_arrays``: batched fits, at most the interval's refit budget,
  ``models.REFIT_BUDGET_PER_GPU_S`` per GPU within the bounds named there);
* ``inputs``: the snapshot -> solver inputs (``observe.problem``: ``allocation.build_inputs``),
  the refits not counted;
* ``solve``: the allocator's fast path only (``capctl.allocator.fast.solve``);
* ``build``: ``allocation.build_problem`` (inputs -> the allocator's arrays);
* ``pace``: the pace split (``allocation.paced_split``); ``idle``: the idle rule
  (``allocation.idle_from_headroom``); ``solve_rest``: the rest of ``allocation.solve`` /
  ``decide.solve``;
* ``plan``: the fleet state and ``decide.plan`` (safe caps, phase-1 decreases, candidates);
* ``send``: sending the plans (serialized as gRPC would), the acknowledgements (decoded and
  recorded), phase 2 (``Coordinator._send``); the stand-in agents' own work is subtracted;
* ``after``: ``Coordinator._after_plans`` (targets, node ledger when due) and ``_publish``;
* ``view``: building the published view once (``capctl status``) and one Prometheus collection:
  the daemon does these only when read (:class:`coordinator.view.LazyView`), so they are reported
  apart (``view_read_us``), as if read every interval.

``beyond_solver_us`` = all per-interval stages but ``solve`` (``view`` apart). ``--profile FILE``
writes a cProfile of the first timed interval, ingest to publish (the view read not included). The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from capctl import plancaps, readings  # noqa: E402

GPUS_PER_NODE = 8
NODES_PER_RACK = 32
TDP_W, MIN_W = 700.0, 200.0
MAX_CLOCK_MHZ = 1980
INTERVAL_S = 1.0
HEAVY_W, LIGHT_W = 650.0, 320.0
PHASE_INTERVALS = 4
"""A job's load changes every this many intervals."""
REPORT_LEAD_S = 0.2
"""The simulated clock moves this much (s) between the reports and the interval's snapshot, as
for agents following the coordinator's report advice (0.08-0.30 of an interval ahead,
docs/protocol.md). With the clock standing still there, and fewer intervals than the 60 s
throttle window (``--warmup 62`` or more fills it: the daemon's steady state), a cost of the live
daemon was not measured: the view's throttle counts went over each GPU's whole history every
interval (coordinator/registry.py, ``throttle_counts``, fixed 4 Dec 2026). Measured at 8,000 GPUs
with ``--warmup 62 --intervals 4``: stage ``after`` 16.1 -> 3.6 us per GPU, beyond the solver
53.0 -> 39.6 us (the same code with ``--warmup 4``: 31-36 us, the cost of a young daemon)."""
MAX_MEMORY_SHARE = 0.6
"""Jobs' memory-bound shares are drawn uniformly in [0, this] (the what-if workloads' range of
``memory_bound_fraction`` reaches 0.9, capctl/sim/workload.py; most training steps are below 0.6)."""
STAGES = ("ingest", "models", "refit", "inputs", "build", "solve", "pace", "idle", "solve_rest", "plan", "send", "after",
          "view")


def node_name(i: int) -> str:
    return f"n{i + 1:05d}"


def write_policy(path: Path, n_nodes: int) -> None:
    """The policy: cluster budget 0.7 x TDP, racks of 32 nodes limited to 0.85 x their maximum draw."""
    racks = []
    for r in range(0, n_nodes, NODES_PER_RACK):
        hi = min(n_nodes, r + NODES_PER_RACK)
        limit = 0.85 * (hi - r) * GPUS_PER_NODE * TDP_W
        racks.append(f"    - {{name: rack{r // NODES_PER_RACK + 1:04d}, kind: rack, limit_w: {limit:.0f}, "
                     f"nodes: \"n[{r + 1:05d}-{hi:05d}]\"}}")
    path.write_text("\n".join([
        "version: 1",
        f"budget_w: {0.7 * n_nodes * GPUS_PER_NODE * TDP_W:.0f}",
        f"interval_s: {INTERVAL_S:g}",
        "objective: proportional",
        "thermal: {margin_c: 5}",
        "failsafe: {lease_s: 10, safe_cap_w: null}",
        "domains:",
        "  name: bench",
        "  kind: cluster",
        "  gpu_model: H100-SXM",
        f"  gpus_per_node: {GPUS_PER_NODE}",
        "  children:",
        *racks,
        "",
    ]))


def job_mix(n_nodes: int, rng) -> list[tuple[int, int]]:
    """Node-aligned jobs ``(first node, nodes)``, sizes 8-1,024 GPUs log-uniform, on 90 % of the nodes."""
    jobs, start, target = [], 0, int(0.9 * n_nodes)
    while start < target:
        nodes = max(1, int(2 ** rng.uniform(3, 10)) // GPUS_PER_NODE)
        nodes = min(nodes, target - start)
        jobs.append((start, nodes))
        start += nodes
    return jobs


class Fleet:
    """The stand-in agents: per-GPU state as arrays [nodes, 8] (W, degC, MHz, J)."""

    def __init__(self, n_nodes: int, seed: int, phase_intervals: int = PHASE_INTERVALS) -> None:
        from capctl.v1 import capctl_pb2 as pb

        self.pb = pb
        self.phase_intervals = phase_intervals  # intervals between a job's load changes
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.n = n_nodes
        shape = (n_nodes, GPUS_PER_NODE)
        self.enforced = np.full(shape, TDP_W)
        self.factor = rng.uniform(0.9, 1.1, shape)  # power factor: W a part needs for the same clock
        self.temp = rng.uniform(40, 70, shape)
        self.hot = rng.random(shape) < 0.01
        self.energy = np.zeros(shape)
        self.job_of_node = np.full(n_nodes, -1)
        self.jobs = job_mix(n_nodes, rng)
        for j, (first, count) in enumerate(self.jobs):
            self.job_of_node[first:first + count] = j
        self.offset = rng.integers(0, 2 * phase_intervals, len(self.jobs))
        # each job's memory-bound share of a step (coordinator/membound.py's model), so the
        # telemetry carries NVML's utilization rates and the models' share update is in the cost
        self.mem_share = rng.uniform(0.0, MAX_MEMORY_SHARE, len(self.jobs))
        self.seq = 0
        self.plain = False
        """Send one ``GpuTelemetry`` per GPU (agents before packed readings) instead of ``GpuReadings``,
        and say no ``packed_plans`` in the hello (plans come as ``repeated CapAssignment``)."""
        self.agent_cpu_s = 0.0  # CPU of the stand-in agents inside the coordinator's stages (subtracted)

    def hello(self, k: int):
        pb = self.pb
        name = node_name(k)
        j = self.job_of_node[k]
        jobs = [pb.JobBinding(job_id=f"job{j}", node=name, gpu_indices=list(range(GPUS_PER_NODE)),
                              partition="batch")] if j >= 0 else []
        return pb.AgentHello(
            protocol_version="capctl.v1", node=name, agent_version="bench", driver_version="bench", simulated=True,
            gpus=[pb.GpuInfo(index=i, uuid=f"GPU-{k:05d}-{i}", name="NVIDIA H100 80GB HBM3", minor_number=i,
                             min_cap_w=MIN_W, max_cap_w=TDP_W, default_cap_w=TDP_W, slowdown_temp_c=89.0,
                             shutdown_temp_c=92.0, max_sm_clock_mhz=MAX_CLOCK_MHZ, pre_job_cap_w=TDP_W)
                  for i in range(GPUS_PER_NODE)],
            jobs=jobs, packed_plans=not self.plain)

    def step(self, t: int) -> None:
        """Advance the devices by one interval (loads, power, temperatures, energy)."""
        heavy = ((t + self.offset) // self.phase_intervals) % 2 == 0
        demand_job = np.where(heavy, HEAVY_W, LIGHT_W)
        j = self.job_of_node
        demand = np.where(j[:, None] >= 0, demand_job[np.maximum(j, 0)][:, None], 60.0)
        demand = demand * self.factor + self.rng.uniform(-10, 10, self.enforced.shape)
        self.power = np.minimum(self.enforced, np.maximum(demand, 50.0))
        # DVFS cube law: clock fraction at the power drawn (static 75 W), scaled by the power factor
        frac = np.clip((np.maximum(self.power - 75.0, 1.0) / (625.0 * self.factor)) ** (1 / 3), 0.3, 1.0)
        self.clock = (MAX_CLOCK_MHZ * frac / 15.0).astype(int) * 15
        target = np.where(self.hot, 45.0, 28.0) + 0.07 * self.power
        self.temp += 0.3 * (target - self.temp) + self.rng.uniform(-0.5, 0.5, self.temp.shape)
        self.energy += self.power * INTERVAL_S

    def gpu_rows(self, k: int):
        pb = self.pb
        busy = self.job_of_node[k] >= 0
        job = f"job{self.job_of_node[k]}" if busy else ""
        util = 100.0 if busy else 0.0
        # NVML's memory utilization as the simulated driver reports it: util x m / (m + (1 - m) / r)
        m = float(self.mem_share[self.job_of_node[k]]) if busy else 0.0
        r = self.clock[k] / MAX_CLOCK_MHZ
        mem_pct = np.floor(util * m / (m + (1.0 - m) / r) + 0.5).tolist()
        rows = []
        for i in range(GPUS_PER_NODE):
            p, e = float(self.power[k, i]), float(self.enforced[k, i])
            reasons = []
            if busy and p >= e - 1.0:
                reasons.append("SW_POWER_CAP")
            if self.temp[k, i] > 84.0:
                reasons.append("SW_THERMAL_SLOWDOWN")
            rows.append(pb.GpuTelemetry(index=i, power_w=p, cap_w=e, enforced_w=e, temp_c=float(self.temp[k, i]),
                                        sm_clock_mhz=int(self.clock[k, i]), clocks_event_reasons=reasons,
                                        utilization_pct=util, energy_j=float(self.energy[k, i]),
                                        utilization_rates=pb.UtilizationRates(gpu_pct=util, memory_pct=mem_pct[i]),
                                        job_id=job, cap_state="OK", pre_job_cap_w=TDP_W))
        return rows

    def telemetry_bytes(self, k: int) -> bytes:
        """Node ``k``'s report, serialized: its GPUs packed (``GpuReadings``, as the real agent sends
        them to a coordinator that asks) unless :attr:`plain`."""
        pb = self.pb
        self.seq += 1
        tele = pb.NodeTelemetry(node=node_name(k), timestamp_s=time.time(), seq=self.seq)
        readings.fill(tele, self.gpu_rows(k), not self.plain)
        return pb.AgentMessage(telemetry=tele).SerializeToString()


class Stopwatch:
    """Accumulated process CPU seconds per stage (only while ``on``)."""

    def __init__(self) -> None:
        self.cpu = dict.fromkeys(STAGES, 0.0)
        self.on = False

    def wrap(self, stage: str, fn):
        def timed(*args, **kwargs):
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.cpu[stage] += time.process_time() - t0
        return timed


class BenchSession:
    """What the coordinator holds of an agent stream (the AgentSession interface), with the agent
    answering each plan at once through the real messages: CapPlan -> caps applied -> CapAck bytes."""

    def __init__(self, k: int, fleet: Fleet, coord) -> None:
        self.node = node_name(k)
        self.peer = "bench"
        self.k = k
        self.fleet = fleet
        self.coord = coord
        self.waiters: dict = {}
        self.sent: dict = {}
        self.close_reason = ""

    def send(self, msg) -> bool:
        data = msg.SerializeToString()  # what gRPC would put on the wire
        t1 = time.process_time()  # the agent's side from here: not the coordinator's
        plan = type(msg).FromString(data).plan
        fleet = self.fleet
        caps = plancaps.of_plan(plan)[0]  # per-GPU or packed (capctl.plancaps), as nodeagent reads them
        for index, cap_w in caps.items():
            fleet.enforced[self.k, index] = cap_w
        pb = fleet.pb
        # the read-back of the GPUs the plan named; a hold (no caps) is not acknowledged: what
        # nodeagent's on_plan answers (nodeagent/loop.py)
        touched = caps.keys()
        if touched:
            msg = pb.AgentMessage(ack=pb.CapAck(seq=plan.seq, ok=True))
            readings.fill(msg.ack, [r for r in fleet.gpu_rows(self.k) if r.index in touched], not fleet.plain)
            ack = msg.SerializeToString()
            asyncio.get_running_loop().call_soon(self._ack, ack)
        self.fleet.agent_cpu_s += time.process_time() - t1
        return True

    def _ack(self, data: bytes) -> None:
        from capctl.security import limits

        msg = self.fleet.pb.AgentMessage.FromString(data)
        rows, problem = limits.ack_rows(msg.ack)  # the server's ack branch (coordinator/server.py)
        if not problem:
            self.coord.on_ack(self, msg.ack, rows)

    def close(self, reason: str) -> None:
        self.close_reason = reason


class IntervalBench:
    """The daemon's coordinator for ``n_gpus`` GPUs on a simulated clock, its stand-in agents and
    the stage timers (see module docstring)."""

    def __init__(self, n_gpus: int, seed: int, fleet_cls=None, phase_intervals: int = PHASE_INTERVALS,
                 plain: bool = False) -> None:
        """``fleet_cls``: the stand-in agents' class (default :class:`Fleet`), built with
        ``phase_intervals`` (see :data:`PHASE_INTERVALS`); ``plain``: the stand-ins send and read
        the per-GPU messages (``Fleet.plain``), not packed readings and plans."""
        from capctl.policy import load_policy
        from coordinator import loop
        from coordinator.metrics import ViewCollector
        from coordinator.models import Models

        self.n_gpus = n_gpus
        self.n_nodes = n_gpus // GPUS_PER_NODE
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "policy.yaml"
            write_policy(path, self.n_nodes)
            self.policy = load_policy(str(path))
        self.now_s = 1000.0
        clock = lambda: self.now_s  # noqa: E731
        coord = self.coord = loop.Coordinator(self.policy, str(path))
        coord.registry.clock = clock
        coord._start_clock = clock() - 1e6  # no startup hold
        coord.models = Models(clock=clock)
        self.fleet = (fleet_cls or Fleet)(self.n_nodes, seed, phase_intervals)
        self.fleet.plain = plain
        self.sw = Stopwatch()
        self.sessions = [BenchSession(k, self.fleet, coord) for k in range(self.n_nodes)]
        for k, s in enumerate(self.sessions):
            coord.attach(self.fleet.hello(k), s)
        self.collector = ViewCollector(coord)

    def ingest(self, blobs: list[bytes]) -> None:
        """The server's telemetry branch (coordinator/server.py, AgentLinkServicer._read) per report."""
        from capctl.security import limits
        from capctl.v1 import capctl_pb2 as pb

        coord = self.coord
        for k, data in enumerate(blobs):
            tele = pb.AgentMessage.FromString(data).telemetry  # the gRPC deserializer's call
            node = self.sessions[k].node
            if tele.node and tele.node != node:
                continue
            rows, problem = limits.telemetry_rows(tele, node)
            if problem:
                continue
            coord.on_energy(node, tele)
            coord.registry.on_telemetry(node, tele, rows)

    async def one_interval(self):
        """Coordinator.tick, stage by stage (same calls, same order); returns the decision."""
        from coordinator import decide, observe

        coord, sw, c = self.coord, self.sw, time.process_time
        on = sw.on
        t = c()
        coord.models.update(coord.registry, self.policy.interval_s)
        coord.models.forget_missing(coord.registry)
        sw.cpu["models"] += (c() - t) * on
        t = c()
        refit0 = sw.cpu["refit"]
        problem = observe.problem(coord.registry, coord.models, coord.policy, coord.registry.clock(), coord.lease_s,
                                  coord.ack_memory_s())
        sw.cpu["inputs"] += (c() - t) * on - (sw.cpu["refit"] - refit0)
        t = c()
        inner0 = sum(sw.cpu[s] for s in ("solve", "build", "pace", "idle"))
        solution = decide.solve(problem)  # the daemon runs it in a worker thread: same CPU
        coord._record_solution(solution)
        sw.cpu["solve_rest"] += (c() - t) * on - (sum(sw.cpu[s] for s in ("solve", "build", "pace", "idle")) - inner0)
        t = c()
        decision = decide.plan(solution, coord._observations(problem))
        coord._over_ticks = coord._over_ticks + 1 if decision.counted_over else 0  # (Coordinator.tick's too)
        sw.cpu["plan"] += (c() - t) * on
        t = c()
        a0 = self.fleet.agent_cpu_s
        sent = await coord._send(decision, problem.inputs)
        sw.cpu["send"] += (c() - t - (self.fleet.agent_cpu_s - a0)) * on
        t = c()
        coord._ticks_since_policy += 1  # (Coordinator.tick's bookkeeping: the exact decreases after a start end)
        coord._after_plans(decision)
        coord.tick_count += 1
        coord._publish(problem.inputs, solution.out, solution.desired_w, list(decision.alerts), 0.0, sent)
        sw.cpu["after"] += (c() - t) * on
        return decision

    def read_view(self) -> None:
        """What a ``capctl status`` and a Prometheus scrape cost when they read this interval's view."""
        sw, c = self.sw, time.process_time
        t = c()
        self.coord.view.resolve()
        for _ in self.collector.collect():
            pass
        sw.cpu["view"] += (c() - t) * sw.on

    async def run(self, intervals: int, warmup: int, profile: str) -> list[str]:
        """``warmup`` untimed then ``intervals`` timed intervals; returns the decision modes."""
        modes = []
        for it in range(warmup + intervals):
            self.sw.on = it >= warmup
            self.fleet.step(it)
            blobs = [self.fleet.telemetry_bytes(k) for k in range(self.n_nodes)]  # the agents' side: not timed
            prof = None
            if profile and it == warmup:  # the profile covers ingest and the interval (not the view)
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t = time.process_time()
            self.ingest(blobs)
            self.sw.cpu["ingest"] += (time.process_time() - t) * self.sw.on
            self.now_s += REPORT_LEAD_S  # the reports land a little before the interval's snapshot
            decision = await self.one_interval()
            if prof is not None:
                prof.disable()
                prof.dump_stats(profile)
            self.read_view()
            modes.append(decision.mode)
            self.now_s += INTERVAL_S - REPORT_LEAD_S
        return modes


def measure(n_gpus: int, intervals: int, warmup: int, seed: int = 0, profile: str = "", plain: bool = False) -> dict:
    """Run :class:`IntervalBench` and return its figures (us per GPU per interval by stage);
    ``plain``: the stand-in agents send one ``GpuTelemetry`` per GPU, not packed readings, and
    say no ``packed_plans`` (their plans come as one ``CapAssignment`` per GPU)."""
    from capctl.allocator import fast
    from coordinator import allocation, loop
    from coordinator.models import Models

    bench = IntervalBench(n_gpus, seed, plain=plain)
    sw = bench.sw
    # stage timers around the daemon's own functions (looked up at call time)
    patches = [(fast, "solve", "solve"), (allocation, "build_problem", "build"), (allocation, "paced_split", "pace"),
               (allocation, "idle_from_headroom", "idle"), (Models, "_refit_due", "refit")]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, stage in patches:
        setattr(mod, name, sw.wrap(stage, getattr(mod, name)))
    old_gc = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(loop.GC_THRESHOLDS, old_gc)))  # as Coordinator.run
    try:
        modes = asyncio.run(bench.run(intervals, warmup, profile))
    finally:
        gc.set_threshold(*old_gc)
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    per = {s: 1e6 * v / (n_gpus * intervals) for s, v in sw.cpu.items()}
    beyond = sum(v for s, v in per.items() if s not in ("solve", "view"))
    return {"gpus": n_gpus, "nodes": bench.n_nodes, "jobs": len(bench.fleet.jobs), "intervals": intervals,
            "readings": "plain" if plain else "packed",
            "us_per_gpu": {s: round(v, 2) for s, v in per.items()},
            "solve_us_per_gpu": round(per["solve"], 2), "beyond_solver_us": round(beyond, 2),
            "view_read_us": round(per["view"], 2),
            "interval_cpu_s": round(sum(sw.cpu.values()) / intervals, 3),
            "refits": bench.coord.models.refits, "modes": sorted(set(modes)),
            "memory_bound_gpus": len(bench.coord.models.memory_bounds()),
            "enforced_over_budget": round(float(bench.fleet.enforced.sum()) / bench.policy.budget_w, 4)}


def measure_sim(cluster: str, policy_file: str, duration_s: float | None) -> dict:
    """The ``capctl sim`` figure of issue 12: the capctl policy's CPU (``time.process_time`` inside
    its ``decide``: registry mirror, models, inputs, solve, planning) and the fast solver's CPU, on
    the scenario ``cluster`` under ``policy_file`` (the engine and the devices not counted)."""
    from dataclasses import replace

    from capctl.policy import load_policy
    from capctl.sim import policies
    from capctl.sim.cluster import load_cluster
    from capctl.sim.engine import build_scenario, run_policy

    spec = load_cluster(cluster)
    if duration_s is not None:
        spec = replace(spec, duration_s=float(duration_s))
    scn = build_scenario(spec, load_policy(policy_file))
    cpu = [0.0, 0]
    inner = policies.Capctl.decide

    def decide(self, obs):
        t0 = time.process_time()
        try:
            return inner(self, obs)
        finally:
            cpu[0] += time.process_time() - t0
            cpu[1] += 1

    from capctl.allocator import fast

    solver = fast.solve
    solve_cpu = [0.0]

    def timed_solve(problem):
        t0 = time.process_time()
        try:
            return solver(problem)
        finally:
            solve_cpu[0] += time.process_time() - t0

    policies.Capctl.decide = decide
    fast.solve = timed_solve
    try:
        run = run_policy(scn, "capctl")
    finally:
        policies.Capctl.decide = inner
        fast.solve = solver
    g = scn.topo.n_gpus
    n = max(1, cpu[1] * g)
    return {"scenario": spec.name, "gpus": g, "decisions": cpu[1], "capctl_cpu_s": round(cpu[0], 2),
            "solve_cpu_s": round(solve_cpu[0], 2), "solve_wall_s": run.extra.get("solve_s"),
            "us_per_gpu_per_decision": round(1e6 * cpu[0] / n, 1),
            "beyond_solver_us_per_gpu": round(1e6 * (cpu[0] - solve_cpu[0]) / n, 1), "throughput": run.throughput}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="8000,100000", help="comma-separated cluster sizes (GPUs, multiples of 8)")
    ap.add_argument("--intervals", type=int, default=6, help="timed intervals per size")
    ap.add_argument("--warmup", type=int, default=3, help="untimed intervals first (hellos, first fits)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="", help="write a cProfile of the first timed interval (ingest to "
                    "publish, not the view read) to this file")
    ap.add_argument("--readings", default="packed", choices=("packed", "plain"),
                    help="the stand-in agents' GPU readings and plans: packed (GpuReadings and packed plan caps, "
                         "as the real agent and this coordinator) or plain (one GpuTelemetry / CapAssignment per "
                         "GPU, agents before them); "
                         "compare the two in separate runs (a second size in one process runs ~10 %% slower)")
    ap.add_argument("--sim", nargs=2, metavar=("CLUSTER", "POLICY"),
                    help="measure the capctl policy of `capctl sim` on this cluster and policy file instead")
    ap.add_argument("--duration", type=float, default=None, help="with --sim: simulated seconds")
    args = ap.parse_args(argv)
    if args.sim:
        r = measure_sim(args.sim[0], args.sim[1], args.duration)
        print(f"capctl sim {r['scenario']}: capctl policy {r['capctl_cpu_s']:.1f} s CPU over {r['decisions']} "
              f"decisions x {r['gpus']} GPUs = {r['us_per_gpu_per_decision']:.1f} us/GPU/decision, "
              f"{r['beyond_solver_us_per_gpu']:.1f} beyond the solver; solve {r['solve_cpu_s']} s CPU")
        print(json.dumps({"bench": "interval_cost_sim", **r}))
        return 0
    results = []
    for n in [int(x) for x in args.gpus.split(",") if x.strip()]:
        r = measure(n, args.intervals, args.warmup, args.seed, args.profile, args.readings == "plain")
        stages = "  ".join(f"{s} {v:.1f}" for s, v in r["us_per_gpu"].items())
        print(f"{n:>7} GPUs, {r['jobs']} jobs, {r['readings']} readings: beyond the solver {r['beyond_solver_us']:.1f} us/GPU/interval "
              f"(target <= 20), solver {r['solve_us_per_gpu']:.1f}, a view read {r['view_read_us']:.1f}; interval CPU {r['interval_cpu_s']:.2f} s; "
              f"{stages}", flush=True)
        results.append(r)
    print(json.dumps({"bench": "interval_cost", "target_us": 20.0, "results": results}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head: the reader left; no second error at exit's flush
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
