"""``capctl demo``: capctl at work on a small simulated cluster, in real time.

What it runs (all real processes talking gRPC over unix sockets in a temporary directory):

- ``nodes`` simulated nodes (default 4) of 8 H100-SXM GPUs each (the simulated NVML driver,
  :mod:`capctl.simgpu`); the first half of the nodes (a hot aisle: node1, node2) has hot inlets
  (35-38 °C vs 20-22 °C) and every GPU
  its own thermal resistance (seeded spread 0.055-0.085 °C/W, and 0.105-0.115 °C/W for a few poorly
  cooled GPUs), so some GPUs would cross their slowdown temperature at full power, and those on hot
  inlets even at the uniform cap;
- one ``capctl-agent`` per node (``--nvml-library simulated``);
- 3 synchronous jobs bound through the agents' local JobStart, as the Slurm prolog would: job 1001
  on GPUs 0-3 of every node, 1002 on GPUs 4-7 of the hot half of the nodes, 1003 on GPUs 4-7 of the
  cool half; every GPU runs at full demand (700 W uncapped). 1001 and 1002 hold GPUs that throttle
  at the uniform cap; 1003 does not, and can use watts the others cannot turn into speed;
- phase 1, **uniform static caps**: no coordinator; every GPU holds the policy's start cap, set to
  budget / number of GPUs (clamped to the limit constraints) — the usual static alternative;
- phase 2, **capctl**: ``capctl-coordinator`` with the embedded default policy (budget 0.8 x TDP)
  takes over the same GPUs, same jobs, same thermal state.

Measurements (sampled every :data:`SAMPLE_S` from the simulated devices themselves, not from capctl):

- a synchronous job advances at the pace of its slowest GPU: its throughput over a window is the
  sum over samples of min over its GPUs of the progress-counter increments, divided by the time;
  ``throughput_ratio_vs_uniform`` = GPU-weighted mean of (capctl phase / uniform phase) job
  throughput, each measured after its phase's settling time;
- ``max_enforced_w``: the exact largest sum of the enforced limits of all GPUs at any instant of
  either phase, from the simulated driver's journal of enforced-limit changes (not sampled; the
  budget must hold at every instant, including during reallocation); ``over_budget`` lists every
  interval above the budget;
- ``thermal_slowdown_fraction``: the fraction of GPU-samples in the capctl phase (from the
  coordinator's start, settling included) with a thermal slowdown clocks event reason
  (``..._uniform``: same in the uniform phase, warm-up included).

Demo-only physics change: thermal time constants are shortened to 6-9 s (the profile has 20 s)
and the GPUs start warm (near their temperature at the uniform cap, at most 86 °C, as if the jobs
had been running), so both phases reach a thermal steady state within a one-minute show. Everything started is stopped on exit, Ctrl-C or error.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from capctl.demo import processes as P
from capctl import reasons
from capctl.errors import CapctlError, UserInputError

SAMPLE_S = 0.25
"""Period of the demo's own device sampling (seconds)."""
GPUS_PER_NODE = 8
GPU_MODEL = "H100-SXM"
TDP_W = 700.0
"""H100 SXM5 TDP / default limit (NVIDIA H100 datasheet); the budget is 0.8 x TDP x GPUs."""
DEMAND_W = 700.0
"""Uncapped demand of every GPU's workload (W): full TDP, so the cap always binds."""
DEFAULT_DURATION_S = 75.0
POORLY_COOLED_HOT = (1, 6)
"""GPU indices with a high thermal resistance on hot-inlet nodes (one in job 1001, one in 1002)."""
POORLY_COOLED_COLD = (2,)
"""GPU index with a high thermal resistance on cool-inlet nodes (in job 1001)."""
THERMAL_SLOWDOWN_REASONS = reasons.THERMAL_SLOWDOWN  # capctl.reasons: the one definition


@dataclass
class Job:
    job_id: str
    gpus: list[tuple[str, int]]  # (node, index)

    @property
    def nodes(self) -> list[str]:
        return sorted({n for n, _ in self.gpus}, key=_node_key)


def _node_key(name: str):
    m = re.search(r"(\d+)$", name)
    return (name[: m.start()] if m else name, int(m.group(1)) if m else 0)


@dataclass
class PhaseStats:
    """Accumulated measurements of one phase (uniform or capctl)."""

    name: str
    measure_from_s: float = math.inf  # monotonic time from which throughput counts
    work: dict[str, float] = field(default_factory=dict)
    time_s: float = 0.0
    gpu_samples: int = 0
    thermal_samples: int = 0
    max_enforced_w: float = 0.0  # exact, from the journal (_check_budget)
    samples: int = 0
    start_ns: int = 0            # CLOCK_MONOTONIC span of the phase
    end_ns: int = 0
    over_budget: list[dict] = field(default_factory=list)
    budget_problems: list[str] = field(default_factory=list)


def plan_durations(duration_s: float) -> dict[str, float]:
    """Split the show: warm-up under uniform caps, uniform measurement, capctl settling, capctl
    measurement (seconds)."""
    warm = min(12.0, 0.15 * duration_s)
    uniform = 0.35 * duration_s
    capctl = duration_s - warm - uniform
    settle = min(15.0, capctl / 3.0)
    return {"warmup_s": warm, "uniform_s": uniform, "capctl_settle_s": settle, "capctl_measure_s": capctl - settle}


def demo_policy_yaml(node_names: list[str], uniform_cap_w: float, interval_s: float) -> str:
    """The embedded default policy with the demo's node names, start cap = uniform cap, interval."""
    from capctl.policy import DEFAULT_POLICY_YAML

    text = DEFAULT_POLICY_YAML
    text = re.sub(r"(?m)^start_cap_w:.*$", f"start_cap_w: {uniform_cap_w:.3f}", text)
    text = re.sub(r"(?m)^interval_s:.*$", f"interval_s: {interval_s:g}", text)
    n = len(node_names)
    budget = 0.8 * TDP_W * GPUS_PER_NODE * n
    if n != 4:
        import hostlist

        half = max(1, n // 2)
        groups = [g for g in (node_names[:half], node_names[half:]) if g]
        children = "\n".join(
            f'    - {{name: pdu-{chr(97 + k)}, kind: pdu, limit_w: {min(budget, 600.0 * GPUS_PER_NODE * len(g)):.0f}, '
            f'nodes: "{hostlist.collect_hostlist(g)}"}}' for k, g in enumerate(groups))
        text = re.sub(r"(?m)^budget_w:.*$", f"budget_w: {budget:.0f}", text)
        text = re.sub(r"(?ms)^  children:\n.*?(?=^agent:)", "  children:\n" + children + "\n", text)
    return text

WORKDIR_PREFIX = "capctl-demo-"
OWNER_FILE = "demo.pid"
"""pid of the demo that owns a temporary directory (absent with ``--keep``)."""


def remove_stale_workdirs() -> list[str]:
    """Remove temporary directories of demos that were killed (SIGKILL: no cleanup of their own).

    Only ``capctl-demo-*`` directories of this user holding a ``demo.pid`` whose process is gone
    (:func:`capctl.privdirs.remove_stale`); its daemons died with it (their lifeline,
    :mod:`capctl.lifeline`). Returns the paths removed.
    """
    from capctl import privdirs

    return privdirs.remove_stale(WORKDIR_PREFIX, OWNER_FILE)


class Demo:
    """One demo run. Use :meth:`run` (returns the summary dict); always stops what it started."""

    def __init__(self, duration_s: float = DEFAULT_DURATION_S, nodes: int = 4, *, live: bool = True,
                 out=None, err=None, keep: bool = False, interval_s: float = 1.0, seed: int = 7) -> None:
        if not (10.0 <= duration_s <= 3600.0):
            raise UserInputError(f"--duration {duration_s:g}: allowed 10..3600 seconds")
        if not (1 <= nodes <= 16):
            raise UserInputError(f"--nodes {nodes}: allowed 1..16")
        self.duration_s = float(duration_s)
        self.n_nodes = nodes
        self.live = live
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.keep = keep
        self.interval_s = interval_s
        self.seed = seed
        self.node_names = [f"node{i + 1}" for i in range(nodes)]
        self.n_gpus = nodes * GPUS_PER_NODE
        self.budget_w = 0.8 * TDP_W * self.n_gpus
        self.group = P.ProcessGroup()
        self.sims: dict = {}
        self.agents: dict[str, P.AgentProc] = {}
        self.coordinator: P.CoordinatorProc | None = None
        self.jobs: list[Job] = []
        self.workdir: Path | None = None
        self.phase: PhaseStats | None = None
        self.phases: dict[str, PhaseStats] = {}
        self.stats_lock = threading.Lock()
        self.stop_sampling = threading.Event()
        self.last_rates: dict[str, float] = {}
        self.last_enforced_w = 0.0
        self.sample_error: str | None = None
        self.uniform_cap_w = 0.0
        self.solve_s: float | None = None
        self.hot_nodes: list[str] = []
        self.t0 = time.monotonic()

    # ------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if not self.live:
            print(text, file=self.err, flush=True)

    def run(self) -> dict:
        """Run the whole demo; returns the summary. Raises CapctlError on failure (after cleanup)."""
        old_term = signal.getsignal(signal.SIGTERM)

        def _term(signum, frame):
            raise KeyboardInterrupt

        try:
            signal.signal(signal.SIGTERM, _term)
        except ValueError:
            old_term = None  # not the main thread
        try:
            self._setup()
            return self._show()
        finally:
            self._cleanup()
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)

    # ------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        """Start the show's cluster: prerequisites checked, workdir, policy, simulated nodes, agents,
        jobs bound, every GPU at full demand. Raises CapctlError on failure (:meth:`run` cleans up)."""
        SimNode = self._sim_node_class()
        remove_stale_workdirs()
        self.workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        if not self.keep:  # --keep: never removed by a later run
            (self.workdir / OWNER_FILE).write_text(f"{os.getpid()}\n")
        self._write_policy()
        self._create_sims(SimNode)
        self._start_agents()
        self._start_jobs()
        for name, node in self.sims.items():
            for i in range(GPUS_PER_NODE):
                node.set_load(i, DEMAND_W, 100.0)

    def _sim_node_class(self):
        """:class:`capctl.simgpu.node.SimNode`, once the demo's prerequisites are checked: the built
        simulated NVML driver and every module of the agent and coordinator extras. Raises
        CapctlError naming what is missing."""
        from capctl.simgpu.build import library_path

        lib = Path(library_path())
        if not lib.is_file():
            raise CapctlError(f"simulated NVML driver {lib} is not built; the demo runs from a source checkout "
                              "('make demo' builds it), or set CAPCTL_SIMNVML_LIB to a built libnvidia-ml.so.1 "
                              "(the wheel never ships the simulated driver)")
        import importlib.util

        from capctl.extras import EXTRAS_OF_MODULE, missing_extra_message

        # the demo runs a coordinator and agents: every module of those extras (capctl[sim] brings both)
        missing = [m for m, extras in EXTRAS_OF_MODULE.items()
                   if {"agent", "coordinator"} & set(extras) and importlib.util.find_spec(m) is None]
        try:
            from capctl.simgpu.node import SimNode
        except ImportError as exc:
            missing.append(getattr(exc, "name", None) or str(exc))
        if missing:
            raise CapctlError(missing_extra_message("demo", ModuleNotFoundError(name=missing[0]), "sim")
                              or f"demo: simulated GPUs unavailable ({missing[0]})")
        return SimNode

    def _write_policy(self) -> None:
        """Write the demo's policy into the workdir (start cap = the uniform cap, W: budget / GPUs,
        clamped to 200-700 W) and check it; sets ``uniform_cap_w`` and ``policy_path``."""
        limits = (200.0, 700.0)
        cap = math.floor(self.budget_w / self.n_gpus * 1000.0) / 1000.0
        self.uniform_cap_w = min(max(cap, limits[0]), limits[1])
        policy = self.workdir / "policy.yaml"
        policy.write_text(demo_policy_yaml(self.node_names, self.uniform_cap_w, self.interval_s))
        from capctl.policy import load_policy

        load_policy(str(policy))  # fail early with a clear error
        self.policy_path = policy

    def _create_sims(self, SimNode) -> None:
        """Create the simulated nodes in the workdir (``sims``; ``hot_nodes``: the first half), with
        seeded inlets (°C), thermal resistances (°C/W), time constants (s) and warm start temperatures."""
        rng = random.Random(self.seed)
        half = max(1, self.n_nodes // 2)
        # a hot aisle: the first half of the nodes (node1, node2) has hot inlets, the rest cool ones
        self.hot_nodes = self.node_names[:half]
        for k, name in enumerate(self.node_names):
            hot = name in self.hot_nodes
            inlets = [round(rng.uniform(35.0, 38.0) if hot else rng.uniform(20.0, 22.0), 1)
                      for _ in range(GPUS_PER_NODE)]
            d = self.workdir / name
            d.mkdir()
            resist = [round(rng.uniform(0.055, 0.085), 4) for _ in range(GPUS_PER_NODE)]
            # poorly cooled GPUs (a clogged heat sink, a failing fan): 0.105-0.115 C/W. At full power
            # they cross the slowdown temperature on any inlet; at the uniform cap on a hot inlet too.
            for i in (POORLY_COOLED_HOT if hot else POORLY_COOLED_COLD):
                if i < GPUS_PER_NODE:
                    resist[i] = round(rng.uniform(0.105, 0.115), 4)
            # the jobs were already running: start near the temperature of a GPU at ~the uniform cap
            temps = [round(min(t + r * 0.95 * self.uniform_cap_w, 86.0), 1) for t, r in zip(inlets, resist)]
            node = SimNode.create(
                d / "gpus.state", GPUS_PER_NODE, model=GPU_MODEL, inlet_c=inlets, seed=self.seed * 100 + k,
                thermal_resistance_c_per_w=resist, temp_c=temps,
                tau_s=[round(rng.uniform(6.0, 9.0), 2) for _ in range(GPUS_PER_NODE)])
            self.sims[name] = node

    def _start_agents(self) -> None:
        """Start one agent per simulated node (``agents``) and wait until each is ready (30 s at most)."""
        coord_addr = f"unix:{self.workdir / 'coordinator.sock'}"
        self.coord_addr = coord_addr
        for name in self.node_names:
            self.agents[name] = self.group.add(P.start_agent(
                self.workdir, name, coord_addr, sim_env=self.sims[name].env(), policy=self.policy_path,
                interval_s=self.interval_s, reconnect_max_s=1.0))
        for a in self.agents.values():
            a.wait_ready(30.0)
        self.say(f"capctl demo: {self.n_nodes} simulated node{'s' if self.n_nodes != 1 else ''} x {GPUS_PER_NODE} {GPU_MODEL}, budget "
                 f"{self.budget_w:.0f} W (0.8 x TDP), hot inlets on {', '.join(self.hot_nodes)}; workdir {self.workdir}")

    def _start_jobs(self) -> None:
        """Bind the demo's jobs (``jobs``) through the agents' JobStart, as the Slurm prolog would:
        1001 on GPUs 0-3 of every node; 1002 / 1003 on GPUs 4-7 of each half. Raises CapctlError
        when an agent refuses."""
        half = max(1, self.n_nodes // 2)
        first, second = self.node_names[:half], self.node_names[half:]
        self.jobs = [Job("1001", [(n, i) for n in self.node_names for i in range(4)])]
        self.jobs.append(Job("1002", [(n, i) for n in first for i in range(4, 8)]))
        if second:
            self.jobs.append(Job("1003", [(n, i) for n in second for i in range(4, 8)]))
        for job in self.jobs:
            for node in job.nodes:
                idx = [i for n, i in job.gpus if n == node]
                with self.agents[node].client() as c:
                    # SLURM_JOB_GPUS-style minor numbers (/dev/nvidiaN; the simulated driver's minor = index)
                    reply = c.job_start(job.job_id, [str(i) for i in idx], 0,
                                        user="demo", partition="gpu", account="demo")
                if not reply.ok:
                    raise CapctlError(f"JobStart {job.job_id} on {node} failed: {reply.message}")

    # ------------------------------------------------------------------------------------------
    def _read_all(self) -> dict[tuple[str, int], dict]:
        out = {}
        for name, node in self.sims.items():
            for i in range(GPUS_PER_NODE):
                out[(name, i)] = node.read(i)
        return out

    def _sampler(self) -> None:
        prev = self._read_all()
        prev_t = time.monotonic()
        while not self.stop_sampling.wait(SAMPLE_S):
            try:
                cur = self._read_all()
            except Exception as exc:  # noqa: BLE001
                self.sample_error = str(exc)
                continue
            now = time.monotonic()
            dt = now - prev_t
            enforced = sum(float(r["enforced_w"]) for r in cur.values())  # live display only
            rates = {}
            for job in self.jobs:
                incs = [float(cur[g]["progress"]) - float(prev[g]["progress"]) for g in job.gpus]
                rates[job.job_id] = min(incs) / dt if dt > 0 else 0.0
            with self.stats_lock:
                self.last_enforced_w = enforced
                self.last_rates = rates
                ph = self.phase
                if ph is not None:
                    ph.samples += 1
                    if now >= ph.measure_from_s:
                        ph.time_s += dt
                        for job in self.jobs:
                            ph.work[job.job_id] = ph.work.get(job.job_id, 0.0) + rates[job.job_id] * dt
                    for r in cur.values():  # thermal slowdown: the whole phase, settling included
                        ph.gpu_samples += 1
                        if any(x in THERMAL_SLOWDOWN_REASONS for x in _reasons(r)):
                            ph.thermal_samples += 1
            prev, prev_t = cur, now

    # ------------------------------------------------------------------------------------------
    def _show(self) -> dict:
        d = plan_durations(self.duration_s)
        sampler = threading.Thread(target=self._sampler, name="demo-sampler", daemon=True)
        uniform = PhaseStats("uniform")
        capctl = PhaseStats("capctl")
        self.phases = {"uniform": uniform, "capctl": capctl}
        t0 = self.t0 = time.monotonic()
        with self.stats_lock:
            uniform.measure_from_s = t0 + d["warmup_s"]
            uniform.start_ns = time.monotonic_ns()
            self.phase = uniform
        sampler.start()
        self.say(f"phase 1/2: uniform static caps of {self.uniform_cap_w:.0f} W per GPU "
                 f"({d['warmup_s']:.0f} s warm-up + {d['uniform_s']:.0f} s measured)")
        self._wait_phase(t0 + d["warmup_s"] + d["uniform_s"], "uniform static caps", t0)

        # phase 2: the coordinator takes over
        self.coordinator = self.group.add(P.start_coordinator(self.workdir, self.policy_path,
                                                              listen=self.coord_addr))
        t1 = time.monotonic()
        with self.stats_lock:
            capctl.measure_from_s = math.inf
            uniform.end_ns = capctl.start_ns = time.monotonic_ns()
            self.phase = capctl
        self.coordinator.wait_serving(30.0)
        for a in self.agents.values():
            a.wait_ready(30.0, connected=True)
        t1b = time.monotonic()
        with self.stats_lock:
            capctl.measure_from_s = t1b + d["capctl_settle_s"]
        self.say(f"phase 2/2: capctl coordinator in charge (agents connected after {t1b - t1:.1f} s; "
                 f"{d['capctl_settle_s']:.1f} s settling + {d['capctl_measure_s']:.1f} s measured)")
        self._wait_phase(t1b + d["capctl_settle_s"] + d["capctl_measure_s"], "capctl", t1b)
        try:
            st = self.coordinator.status()
            self.solve_s = st.last_solve_s
            final_status = st
        except Exception:  # noqa: BLE001
            final_status = None
        self.stop_sampling.set()
        sampler.join(timeout=5.0)
        capctl.end_ns = time.monotonic_ns()
        for ph in (uniform, capctl):
            self._check_budget(ph)
        summary = self._summary(final_status)
        return summary

    def _check_budget(self, ph: PhaseStats) -> None:
        """The phase's exact largest sum of enforced limits and its intervals over the budget, from
        the simulated driver's journal (:mod:`capctl.simgpu.journal`), not from samples."""
        from capctl.simgpu.journal import check_nodes

        res = check_nodes({name: node.path for name, node in self.sims.items()}, self.budget_w,
                          since_ns=ph.start_ns, until_ns=ph.end_ns)
        ph.max_enforced_w = res.max_sum_w
        ph.budget_problems = list(res.problems)
        ph.over_budget = [{"phase": ph.name, "t_s": round((o.start_ns - ph.start_ns) / 1e9, 4),
                           "duration_s": round(o.duration_s, 6), "peak_w": round(o.peak_w, 3)} for o in res.over]

    def _wait_phase(self, until: float, label: str, started: float) -> None:
        last_draw = 0.0
        while True:
            now = time.monotonic()
            if now >= until:
                return
            P.check_alive(list(self.agents.values()) + ([self.coordinator] if self.coordinator else []))
            if self.live and now - last_draw >= 1.0:
                last_draw = now
                self._draw(label, now - started, until - now)
            time.sleep(min(0.2, max(0.0, until - now)))

    def _draw(self, label: str, elapsed_s: float, left_s: float) -> None:
        from capctl.statusview import render_gpus, render_nodes_summary, render_status, status_dict

        with self.stats_lock:
            rates = dict(self.last_rates)
            enforced = self.last_enforced_w
            ph = self.phase
            thermal = (ph.thermal_samples / ph.gpu_samples) if ph and ph.gpu_samples else 0.0
            avg = {j: (ph.work.get(j, 0.0) / ph.time_s) for j in ph.work} if ph and ph.time_s else {}
        lines = [f"capctl demo — phase: {label}   elapsed {elapsed_s:4.0f} s, {left_s:3.0f} s left   "
                 f"(Ctrl-C stops and cleans up)",
                 f"sum of enforced caps {enforced:7.0f} W / budget {self.budget_w:.0f} W   thermal slowdown "
                 f"{100 * thermal:4.1f}% of GPU-time this phase",
                 "job step rate (its slowest GPU), now / measured average this phase: " + "   ".join(
                     f"{j.job_id}: {rates.get(j.job_id, 0.0):.3f} / "
                     + (f"{avg[j.job_id]:.3f}" if j.job_id in avg else "settling") for j in self.jobs), ""]
        body = None
        if self.coordinator is not None:
            try:
                body = "$ capctl status\n" + render_status(status_dict(self.coordinator.status(1.0)), hottest=5)
            except Exception as exc:  # noqa: BLE001
                body = f"(coordinator starting: {type(exc).__name__})"
        if body is None:
            view = {"nodes": self._sim_nodes_view()}
            body = ("no coordinator yet: every GPU at the uniform static cap (read from the simulated devices)\n\n"
                    + render_nodes_summary(view) + "\n\nhottest GPUs (margin to slowdown temperature):\n"
                    + render_gpus(view, limit=5))
        text = "\n".join(lines) + "\n" + body
        if self.out.isatty():
            self.out.write("\x1b[H\x1b[2J" + text + "\n")
        else:
            self.out.write(text + "\n\n")
        self.out.flush()

    def _sim_nodes_view(self) -> list[dict]:
        """The simulated devices in the shape of ``capctl status --json`` nodes (for the live view)."""
        owner = {g: j.job_id for j in self.jobs for g in j.gpus}
        nodes = []
        for name, node in self.sims.items():
            gpus = []
            for i in range(GPUS_PER_NODE):
                r = node.read(i)
                gpus.append({"index": i, "cap_w": float(r["limit_w"]), "enforced_w": float(r["enforced_w"]),
                             "power_w": float(r.get("power_avg_w", r["power_w"])), "temp_c": float(r["temp_c"]),
                             "slowdown_temp_c": float(r["slowdown_temp_c"]), "sm_clock_mhz": int(r["sm_clock_mhz"]),
                             "clocks_event_reasons": list(_reasons(r)), "job_id": owner.get((name, i), ""),
                             "cap_state": ""})
            nodes.append({"name": name, "stale": False, "last_report_age_s": 0.0, "gpus": gpus})
        return nodes

    # ------------------------------------------------------------------------------------------
    def _summary(self, final_status) -> dict:
        uni, cap = self.phases["uniform"], self.phases["capctl"]
        jobs = []
        num = den = 0.0
        for job in self.jobs:
            tu = uni.work.get(job.job_id, 0.0) / uni.time_s if uni.time_s else 0.0
            tc = cap.work.get(job.job_id, 0.0) / cap.time_s if cap.time_s else 0.0
            ratio = tc / tu if tu > 0 else None
            jobs.append({"job_id": job.job_id, "nodes": job.nodes, "gpus": len(job.gpus),
                         "throughput_uniform": round(tu, 5), "throughput_capctl": round(tc, 5),
                         "ratio": None if ratio is None else round(ratio, 4)})
            num += len(job.gpus) * tc
            den += len(job.gpus) * tu
        ratio = num / den if den > 0 else None
        max_enf = max(uni.max_enforced_w, cap.max_enforced_w)
        summary = {
            "budget_w": round(self.budget_w, 3),
            "max_enforced_w": round(max_enf, 3),
            "max_enforced_w_uniform": round(uni.max_enforced_w, 3),
            "max_enforced_w_capctl": round(cap.max_enforced_w, 3),
            "throughput_ratio_vs_uniform": None if ratio is None else round(ratio, 4),
            "thermal_slowdown_fraction": round(cap.thermal_samples / cap.gpu_samples, 4) if cap.gpu_samples else None,
            "thermal_slowdown_fraction_uniform": (round(uni.thermal_samples / uni.gpu_samples, 4)
                                                  if uni.gpu_samples else None),
            "uniform_cap_w": self.uniform_cap_w,
            "nodes": self.n_nodes,
            "gpus": self.n_gpus,
            "hot_nodes": self.hot_nodes,
            "duration_s": self.duration_s,
            "measured_s": {"uniform": round(uni.time_s, 2), "capctl": round(cap.time_s, 2)},
            "samples": {"uniform": uni.samples, "capctl": cap.samples},
            "jobs": jobs,
            "last_solve_s": None if self.solve_s is None else round(self.solve_s, 6),
        }
        if final_status is not None:
            summary["final_caps_w"] = {n.name: [round(g.enforced_w, 1) for g in n.gpus] for n in final_status.nodes}
        summary["over_budget"] = uni.over_budget + cap.over_budget
        if uni.budget_problems or cap.budget_problems:
            summary["journal_problems"] = uni.budget_problems + cap.budget_problems
        if self.sample_error:
            summary["sample_error"] = self.sample_error
        return summary

    # ------------------------------------------------------------------------------------------
    def _cleanup(self) -> None:
        self.stop_sampling.set()
        for job in self.jobs:
            for node in job.nodes:
                agent = self.agents.get(node)
                if agent is None or agent.poll() is not None:
                    continue
                try:
                    with agent.client(2.0) as c:
                        c.job_end(job.job_id)
                except CapctlError:
                    pass
        try:
            self.group.stop_all()
        finally:
            for node in self.sims.values():
                close = getattr(node, "close", None)
                if close:
                    try:
                        close()
                    except Exception:  # noqa: BLE001
                        pass
            if self.workdir is not None and not self.keep:
                shutil.rmtree(self.workdir, ignore_errors=True)


def _reasons(r: dict) -> tuple[str, ...]:
    names = r.get("reasons", r.get("clocks_event_reasons", ()))
    if isinstance(names, int):
        return reasons.decode(names)
    return tuple(names or ())


def render_summary(s: dict) -> str:
    """The people's summary of a demo run."""
    from capctl.statusview import table

    lines = ["", "capctl demo — summary", "=" * 21,
             f"{s['nodes']} node{'s' if s['nodes'] != 1 else ''} x {s['gpus'] // max(1, s['nodes'])} GPUs, budget {s['budget_w']:.0f} W; "
             f"uniform static cap {s['uniform_cap_w']:.0f} W per GPU; hot inlets on {', '.join(s['hot_nodes'])}", ""]
    rows = [[j["job_id"], str(j["gpus"]), ",".join(j["nodes"]), f"{j['throughput_uniform']:.4f}",
             f"{j['throughput_capctl']:.4f}", "-" if j["ratio"] is None else f"{j['ratio']:.3f}x"] for j in s["jobs"]]
    lines.append(table(["JOB", "GPUS", "NODES", "UNIFORM RATE", "CAPCTL RATE", "CAPCTL/UNIFORM"], rows,
                       right={1, 3, 4, 5}))
    ratio = s["throughput_ratio_vs_uniform"]
    lines += ["",
              f"job throughput vs uniform static caps: {'-' if ratio is None else f'{ratio:.3f}x'} (GPU-weighted; "
              f"measured {s['measured_s']['uniform']:.1f} s uniform, {s['measured_s']['capctl']:.1f} s capctl)",
              f"largest sum of enforced caps: {s['max_enforced_w']:.0f} W vs budget {s['budget_w']:.0f} W "
              + ("(UNPROVEN: a journal of enforced-limit changes was incomplete)" if s.get("journal_problems") else
                 f"({'within' if not s['over_budget'] else 'OVER'} budget at every instant; "
                 "exact, from the simulated driver's journal of enforced-limit changes)"),
              f"GPU-time in thermal slowdown: capctl {_pct(s['thermal_slowdown_fraction'])}, uniform "
              f"{_pct(s['thermal_slowdown_fraction_uniform'])}"]
    if s.get("last_solve_s") is not None:
        lines.append(f"coordinator's last solve: {1000 * s['last_solve_s']:.1f} ms")
    return "\n".join(lines)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"
