"""The simulation loop of ``capctl sim``: one scenario, one policy, the simulated driver's physics.

All GPUs of the cluster live in ONE anonymous in-memory simulated node
(:meth:`capctl.simgpu.node.SimNode.create` with ``path=None``, manual clock): the physics — DVFS,
thermal RC, thermal slowdown, 1 s averaged power — is the simulated driver's C code, stepped for
every GPU at once by :meth:`SimNode.advance`. The cluster's node/rack structure is a mapping of
GPU indices (:mod:`capctl.sim.topology`).

Each step of ``step_s`` seconds: job starts/ends change GPU loads; inlet temperatures are
updated every ``inlet_update_s``; a policy whose period is due (or that reacts to job events)
decides caps, which are applied (clamped into the device's limit constraints) before the clock
advances; then the step is measured:

* job step rate = min over the job's GPUs of their average rate over the step (progress delta /
  step; synchronous step: the slowest GPU sets the pace; rate 1.0 = max clock at speed 1);
* throughput = sum over running jobs of (GPUs x job step rate) (GPU-steps per second);
* thermal slowdown = busy GPUs whose NVML reasons show thermal slowdown at the step's end;
* overshoot = the most the sum of enforced limits of a domain (the budget's: all GPUs; a rack's, a
  PDU's ...) is above its limit, right after the caps are applied;
* energy = the simulated energy counters of GPUs in jobs.

A GPU waiting at the barrier is modelled as still drawing its busy power (NCCL collectives
busy-wait), so energy per step is an upper bound for GPUs that are faster than their job.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from capctl.sim.policies import THERMAL_BITS, Context, Observation, make_policy
from capctl.simgpu.node import FLAG_LOST, SimDeviceError
from capctl.sim.topology import Topology, build_topology
from capctl.sim.workload import make_jobs, profiles_for

_TELE_FIELDS = ("power_avg_w", "enforced_w", "limit_w", "temp_c", "sm_clock_mhz", "reasons", "utilization_pct",
                "progress", "energy_j", "inlet_c", "thermal_resistance_c_per_w", "tau_s", "speed", "power_factor",
                "slowdown_temp_c", "demand_w", "flags", "memory_bound_fraction")


@dataclass
class Scenario:
    """Everything shared by the policies of one run: spec, policy, topology, jobs, physics setup."""

    spec: object
    policy: object
    topo: Topology
    jobs: list
    profile: object
    base_inlet_c: np.ndarray
    hot_gpus: np.ndarray
    speed: np.ndarray | None
    power_factor: np.ndarray | None = None


@dataclass
class PolicyRun:
    """Measurements of one policy (units in names; series sampled every ``series_step_s``)."""

    name: str
    throughput: float                 # mean GPU-steps per second over the run
    job_rate: dict                    # job id -> mean step rate while running (relative)
    job_gpus: dict                    # job id -> GPUs
    thermal_slowdown_fraction: float  # busy GPU-time in thermal slowdown
    max_overshoot_w: float            # max over time and limited domains of sum(enforced) - limit
    energy_per_step_j: float          # energy of busy GPUs / GPU-steps
    energy_j: float
    gpu_steps: float
    wall_s: float
    series_t_s: np.ndarray
    series_throughput: np.ndarray
    series_throttled_fraction: np.ndarray
    snap_t_s: np.ndarray
    snap_cap_w: np.ndarray            # [T, G]
    snap_temp_c: np.ndarray           # [T, G]
    snap_throttled: np.ndarray        # [T, G] bool
    extra: dict = field(default_factory=dict)


def inlet_at(scn: Scenario, t_s: float) -> np.ndarray:
    """Per-GPU inlet temperature (°C) at time ``t_s``: rack gradient + the daily swing."""
    s = scn.spec
    swing = s.swing_amplitude_c * math.sin(2 * math.pi * (t_s + s.swing_phase_s) / s.swing_period_s)
    return scn.base_inlet_c + swing


GPU_STREAM = 7
"""Second word of the seed of the GPUs' random stream (hot set, speed; :func:`build_scenario`),
apart from the job timeline's (the seed alone)."""
HOT_STREAM = 8
"""Second word of the seed of the hot GPUs' thermal resistances (:func:`_make_node`)."""
EFFICIENCY_STREAM = 9
"""Second word of the seed of the GPUs' power factors (``efficiency``, :func:`build_scenario`).
Each stream is ``default_rng([seed, STREAM])``: they were ``seed + 1`` and ``seed + 2``, so seed
s's hot resistances were drawn from seed s + 1's job-timeline stream and "three seeds" shared
draws (found by a review)."""


def build_scenario(spec, policy) -> Scenario:
    """Topology, job timeline and per-GPU physical setup (deterministic for ``spec.seed``)."""
    from capctl.simgpu.profiles import get as get_profile

    prof = get_profile(spec.gpu_model)
    topo = build_topology(spec, policy, prof.min_limit_w, prof.max_limit_w)
    rng = np.random.default_rng(spec.seed)
    profiles = profiles_for(spec)
    jobs = make_jobs(spec, profiles, rng)
    base = np.empty(topo.n_gpus)
    gpn = spec.gpus_per_node
    g = 0
    for r in spec.racks:
        n = len(r.nodes)
        for i in range(n):
            frac = i / (n - 1) if n > 1 else 0.0
            base[g:g + gpn] = r.inlet_bottom_c + (r.inlet_top_c - r.inlet_bottom_c) * frac
            g += gpn
    # the GPUs' own draws (hot set, speed) from a stream of their own: drawn after the job timeline
    # from ``rng``, they depended on how many jobs the duration made, so ``--duration`` simulated
    # another cluster (found by a review)
    rng = np.random.default_rng([int(spec.seed), GPU_STREAM])
    n_hot = int(round(spec.hot_gpu_fraction * topo.n_gpus))
    hot = np.sort(rng.choice(topo.n_gpus, size=n_hot, replace=False)) if n_hot else np.zeros(0, np.int64)
    speed = None
    if spec.speed is not None:
        mean_loss, max_loss = spec.speed
        # exponential losses with the requested mean, truncated at max_loss (Sinha et al. SC'22
        # report a long tail: ~8 % mean, up to 22 %)
        srng = np.random.default_rng([int(spec.seed), GPU_STREAM, 1])  # (apart from the hot set's draws too)
        loss = np.minimum(srng.exponential(mean_loss, topo.n_gpus) if mean_loss > 0 else np.zeros(topo.n_gpus), max_loss)
        speed = 1.0 - loss
    elif not spec.driver_speed:
        speed = np.ones(topo.n_gpus)
    power_factor = None
    if spec.efficiency is not None:
        power_factor = efficiency_factors(spec.efficiency, topo.n_gpus, np.random.default_rng([int(spec.seed), EFFICIENCY_STREAM]))
    return Scenario(spec, policy, topo, jobs, prof, base, hot, speed, power_factor)


def efficiency_factors(losses: tuple[float, float], n: int, rng: np.random.Generator) -> np.ndarray:
    """Per-GPU ``power_factor`` of the simulated driver from clock losses at a binding cap.

    ``losses = (mean_loss, max_loss)``: a GPU's clock loss L at a binding power limit relative to
    the best part is exponential with mean ``mean_loss``, truncated at ``max_loss`` (Sinha et al.,
    "Not All GPUs Are Created Equal", SC'22: 8 % average, up to 22 % performance variation, from
    power management). Cube law (physics.c): the same clock costs a part ``(1 - L)^-3`` times the
    best part's dynamic power; normalized to the median part (factor 1), so a workload's demand
    is that of a median part. Returns ``n`` factors (dimensionless).
    """
    mean_loss, max_loss = losses
    loss = np.minimum(rng.exponential(mean_loss, n) if mean_loss > 0 else np.zeros(n), max_loss)
    return ((1.0 - float(np.median(loss))) / (1.0 - loss)) ** 3


def _make_node(scn: Scenario):
    from capctl.simgpu.node import SimNode

    spec = scn.spec
    over = {}
    if scn.speed is not None:
        over["speed"] = scn.speed
    if scn.power_factor is not None:
        over["power_factor"] = scn.power_factor
    node = SimNode.create(None, gpus=scn.topo.n_gpus, model=scn.profile.name, inlet_c=inlet_at(scn, 0.0),
                          seed=int(spec.seed), manual_clock=True, **over)
    if scn.hot_gpus.size:
        rng = np.random.default_rng([int(spec.seed), HOT_STREAM])
        lo, hi = spec.hot_resistance_c_per_w
        for g in scn.hot_gpus:
            r = float(rng.uniform(lo, hi))
            node.set_param(int(g), "thermal_resistance_c_per_w", r)
            row = node.read(int(g))
            node.set_param(int(g), "temp_c", row["inlet_c"] + r * scn.profile.idle_w)
    return node


def _overshoot_w(enforced_w: np.ndarray, limited: list) -> float:
    """The largest ``sum(enforced_w[idx]) - limit_w`` (W) over ``limited`` ``(limit_w, GPU
    indices)`` pairs (every domain with a limit; -inf when none)."""
    return max((float(enforced_w[idx].sum()) - lim for lim, idx in limited), default=-math.inf)


class _Timeline:
    """The jobs of a run as simulated time passes: those not yet started (by start time), those
    running, and which running job holds each GPU (``job_of[g]``: index into ``running``, -1 idle)."""

    def __init__(self, jobs: list, n_gpus: int) -> None:
        self.starts = sorted(jobs, key=lambda j: j.start_s)
        self.si = 0
        self.running: list = []
        self.job_of = np.full(n_gpus, -1, np.int64)

    def advance(self, node, t: float) -> bool:
        """Bring the jobs to time ``t`` (s): job ends, then starts (same instant: the freed GPUs can
        be reused), setting their GPUs' loads on ``node``. Returns whether any job ended or started."""
        ended = self._end(node, t)
        started = self._start(node, t)
        event = ended or started
        if event:
            self.job_of[:] = -1
            for k, j in enumerate(self.running):
                self.job_of[j.gpus] = k
        return event

    def _end(self, node, t: float) -> bool:
        """Idle the GPUs of the running jobs that end by ``t`` (s); whether any did."""
        ended = [j for j in self.running if j.end_s <= t]
        if not ended:
            return False
        for j in ended:
            self.running.remove(j)
        idx = np.concatenate([j.gpus for j in ended])
        node.set_loads(np.zeros(idx.size), utilization_pct=0.0, indices=idx)
        return True

    def _start(self, node, t: float) -> bool:
        """Load the GPUs of the jobs that start by ``t`` (s) and have not ended (their demand, W);
        whether any did."""
        event = False
        while self.si < len(self.starts) and self.starts[self.si].start_s <= t:
            j = self.starts[self.si]
            self.si += 1
            if j.end_s <= t:
                continue
            self.running.append(j)
            event = True
            node.set_loads(np.full(j.n_gpus, j.profile.demand_w), utilization_pct=100.0,
                           memory_bound_fraction=j.profile.memory_bound_fraction, indices=j.gpus)
        return event


class _Meter:
    """The measurements of a run, accumulated step by step (units in names; see :class:`PolicyRun`):
    job work and time (s), GPU-steps, energy (J), busy and throttled GPU-time (s), the largest
    overshoot (W), the series (one point per ``every`` steps) and the snapshots (one per
    ``snap_every`` steps, ``[G]`` each)."""

    def __init__(self, node, step: float, series_s: float, snapshot_s: float) -> None:
        state = node.state(sync=True)
        self.step = step
        self.prev_progress = state["progress"].copy()
        self.prev_energy = state["energy_j"].copy()
        self.job_work: dict = {}
        self.job_time: dict = {}
        self.gpu_steps = 0.0
        self.energy = 0.0
        self.busy_time = 0.0
        self.throttled_time = 0.0
        self.max_over = -math.inf
        self.every = max(1, int(round(series_s / step)))
        self.snap_every = max(1, int(round(snapshot_s / step)))
        self.ser_t, self.ser_tp, self.ser_th = [], [], []
        self.acc_tp = self.acc_th = 0.0
        self.acc_n = 0
        self.snap_t, self.snap_cap, self.snap_temp, self.snap_thr = [], [], [], []

    def overshoot(self, st, limited: list) -> None:
        """Keep the largest overshoot (W) of the enforced limits in state ``st`` over ``limited``."""
        over = _overshoot_w(st["enforced_w"], limited)
        if over > self.max_over:
            self.max_over = over

    def measure(self, st, running: list, i: int, t: float) -> None:
        """Measure step ``i`` (from ``t`` s to ``t + step``) from the state ``st`` at its end:
        per-GPU rate (progress per s) and energy (J) since the last step, for the ``running`` jobs."""
        step = self.step
        prog = st["progress"].copy()
        en = st["energy_j"].copy()
        rate = (prog - self.prev_progress) / step
        de = en - self.prev_energy
        self.prev_progress, self.prev_energy = prog, en
        thermal = (st["reasons"] & THERMAL_BITS) != 0
        tp, n_busy, n_thr = self._jobs(running, rate, de, thermal)
        self.gpu_steps += tp * step
        self.busy_time += n_busy * step
        self.throttled_time += n_thr * step
        self._series(t, tp, n_busy, n_thr)
        if i % self.snap_every == 0:
            self.snap_t.append(t + step)
            self.snap_cap.append(st["enforced_w"].astype(np.float32))
            self.snap_temp.append(st["temp_c"].astype(np.float32))
            self.snap_thr.append(thermal.copy())

    def _jobs(self, running: list, rate: np.ndarray, de: np.ndarray, thermal: np.ndarray) -> tuple[float, int, int]:
        """Account one step of the ``running`` jobs (a job at the pace of its slowest GPU's
        ``rate``; ``de``: J per GPU; ``thermal``: bool per GPU). Returns (throughput in GPU-steps
        per s, busy GPUs, busy GPUs in thermal slowdown)."""
        step = self.step
        tp = 0.0
        n_busy = 0
        n_thr = 0
        for j in running:
            s = float(rate[j.gpus].min())
            self.job_work[j.job_id] = self.job_work.get(j.job_id, 0.0) + s * step
            self.job_time[j.job_id] = self.job_time.get(j.job_id, 0.0) + step
            tp += s * j.n_gpus
            self.energy += float(de[j.gpus].sum())
            n_busy += j.n_gpus
            n_thr += int(np.count_nonzero(thermal[j.gpus]))
        return tp, n_busy, n_thr

    def _series(self, t: float, tp: float, n_busy: int, n_thr: int) -> None:
        """Add one step to the series' running means; a point (at ``t + step`` s) every ``every`` steps."""
        self.acc_tp += tp
        self.acc_th += n_thr / n_busy if n_busy else 0.0
        self.acc_n += 1
        if self.acc_n == self.every:
            self.ser_t.append(t + self.step)
            self.ser_tp.append(self.acc_tp / self.acc_n)
            self.ser_th.append(self.acc_th / self.acc_n)
            self.acc_tp = self.acc_th = 0.0
            self.acc_n = 0

    def result(self, name: str, jobs: list, duration: float, wall0: float, extra: dict) -> PolicyRun:
        """The :class:`PolicyRun` of policy ``name`` over ``duration`` s (``wall0``: its start,
        ``time.perf_counter``)."""
        gpu_steps = self.gpu_steps
        return PolicyRun(
            name=name, throughput=gpu_steps / duration if duration else 0.0,
            job_rate={k: self.job_work[k] / self.job_time[k] for k in self.job_work if self.job_time[k] > 0},
            job_gpus={j.job_id: j.n_gpus for j in jobs if j.job_id in self.job_work},
            thermal_slowdown_fraction=self.throttled_time / self.busy_time if self.busy_time else 0.0,
            max_overshoot_w=self.max_over, energy_per_step_j=self.energy / gpu_steps if gpu_steps else math.nan,
            energy_j=self.energy, gpu_steps=gpu_steps, wall_s=time.perf_counter() - wall0,
            series_t_s=np.array(self.ser_t), series_throughput=np.array(self.ser_tp),
            series_throttled_fraction=np.array(self.ser_th), snap_t_s=np.array(self.snap_t),
            snap_cap_w=np.array(self.snap_cap), snap_temp_c=np.array(self.snap_temp),
            snap_throttled=np.array(self.snap_thr), extra=extra,
        )


def _set_inlets(scn: Scenario, node, t_s: float) -> None:
    """Set every GPU's inlet temperature (°C) on ``node`` to its value at ``t_s`` (:func:`inlet_at`)."""
    inl = inlet_at(scn, t_s)
    for g in range(scn.topo.n_gpus):
        node.set_inlet(g, float(inl[g]))


def _apply_caps(node, caps, lo, hi) -> int:
    """Set ``caps`` (W per GPU, or None: no change) on ``node``, clipped into ``[lo, hi]``.
    Returns 1 when a lost GPU (thermal shutdown) made the node refuse, else 0."""
    if caps is None:
        return 0
    caps = np.clip(np.asarray(caps, float), lo, hi)  # never outside the device's constraints
    try:
        node.set_limits_w(caps)
    except SimDeviceError:
        return 1  # a GPU lost (thermal shutdown): the others were still set
    return 0


def _extra(pol, lost: int, set_refused: int) -> dict:
    """The extra results of a run: GPUs lost and cap sets refused (when any), and what the policy
    ``pol`` reports of itself (solves and their time in s, curve refits and what it learned)."""
    extra = {}
    if lost or set_refused:
        extra["gpus_lost"] = lost
        extra["cap_sets_refused"] = set_refused
    if hasattr(pol, "solves"):
        extra["solves"] = pol.solves
        extra["solve_s"] = round(pol.solve_s, 3)
    if hasattr(pol, "refits"):
        extra["curve_refits"] = pol.refits
        extra.update(pol.learned_summary())
    return extra


def run_policy(scn: Scenario, name: str, *, snapshot_s: float = 30.0, series_s: float = 10.0) -> PolicyRun:
    """Simulate ``scn`` under policy ``name``; returns its :class:`PolicyRun`."""
    wall0 = time.perf_counter()
    spec = scn.spec
    topo = scn.topo
    node = _make_node(scn)
    pol = make_policy(name)
    pol.reset(Context(topo, float(scn.policy.budget_w), scn.policy, scn.profile, node))
    limited = [(limit_w, idx) for _name, limit_w, idx in topo.limited_domains()]  # the budget first
    step = float(spec.step_s)
    n_steps = int(round(spec.duration_s / step))
    timeline = _Timeline(scn.jobs, topo.n_gpus)
    next_inlet = spec.inlet_update_s
    next_decide = 0.0
    meter = _Meter(node, step, series_s, snapshot_s)
    set_refused = 0
    for i in range(n_steps):
        t = i * step
        event = timeline.advance(node, t)
        if t >= next_inlet:
            next_inlet += spec.inlet_update_s
            _set_inlets(scn, node, t)
        if t >= next_decide or (event and pol.on_events):
            tele = np.array(node.state(sync=False)[list(_TELE_FIELDS)])
            caps = pol.decide(Observation(t, list(timeline.running), timeline.job_of.copy(), tele, event))
            if t >= next_decide:
                next_decide = t + pol.period_s if math.isfinite(pol.period_s) else math.inf
            set_refused += _apply_caps(node, caps, topo.min_cap_w, topo.max_cap_w)
        meter.overshoot(node.state(sync=False), limited)
        node.advance(step)
        meter.measure(node.state(sync=False), timeline.running, i, t)
    lost = int(np.count_nonzero(node.state(sync=False)["flags"] & FLAG_LOST))
    node.close()
    return meter.result(name, scn.jobs, n_steps * step, wall0, _extra(pol, lost, set_refused))


def run_all(spec, policy, names=None, duration_s: float | None = None) -> tuple[Scenario, dict]:
    """Run every policy (default: all five) on the same scenario; returns (scenario, name -> run)."""
    from dataclasses import replace

    from capctl.sim.policies import POLICY_NAMES

    if duration_s is not None:
        spec = replace(spec, duration_s=float(duration_s))
    scn = build_scenario(spec, policy)
    runs = {}
    for name in names or POLICY_NAMES:
        runs[name] = run_policy(scn, name)
    return scn, runs
