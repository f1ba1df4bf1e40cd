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
        power_factor = efficiency_factors(spec.efficiency, topo.n_gpus, np.random.default_rng(spec.seed + 2))
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
        rng = np.random.default_rng(spec.seed + 1)
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


def run_policy(scn: Scenario, name: str, *, snapshot_s: float = 30.0, series_s: float = 10.0) -> PolicyRun:
    """Simulate ``scn`` under policy ``name``; returns its :class:`PolicyRun`."""
    wall0 = time.perf_counter()
    spec = scn.spec
    topo = scn.topo
    G = topo.n_gpus
    node = _make_node(scn)
    pol = make_policy(name)
    pol.reset(Context(topo, float(scn.policy.budget_w), scn.policy, scn.profile, node))
    limited = [(limit_w, idx) for _name, limit_w, idx in topo.limited_domains()]  # the budget first
    step = float(spec.step_s)
    n_steps = int(round(spec.duration_s / step))
    jobs = scn.jobs
    starts = sorted(jobs, key=lambda j: j.start_s)
    si = 0
    running: list = []
    job_of = np.full(G, -1, np.int64)
    next_inlet = spec.inlet_update_s
    next_decide = 0.0
    lo, hi = topo.min_cap_w, topo.max_cap_w
    state = node.state(sync=True)
    prev_progress = state["progress"].copy()
    prev_energy = state["energy_j"].copy()
    job_work = {}
    job_time = {}
    gpu_steps = 0.0
    energy = 0.0
    busy_time = 0.0
    throttled_time = 0.0
    max_over = -math.inf
    every = max(1, int(round(series_s / step)))
    snap_every = max(1, int(round(snapshot_s / step)))
    ser_t, ser_tp, ser_th = [], [], []
    acc_tp = acc_th = 0.0
    acc_n = 0
    snap_t, snap_cap, snap_temp, snap_thr = [], [], [], []
    set_refused = 0
    for i in range(n_steps):
        t = i * step
        event = False
        # job ends, then starts (same instant: the freed GPUs can be reused)
        ended = [j for j in running if j.end_s <= t]
        if ended:
            event = True
            for j in ended:
                running.remove(j)
            idx = np.concatenate([j.gpus for j in ended])
            node.set_loads(np.zeros(idx.size), utilization_pct=0.0, indices=idx)
        while si < len(starts) and starts[si].start_s <= t:
            j = starts[si]
            si += 1
            if j.end_s <= t:
                continue
            running.append(j)
            event = True
            node.set_loads(np.full(j.n_gpus, j.profile.demand_w), utilization_pct=100.0,
                           memory_bound_fraction=j.profile.memory_bound_fraction, indices=j.gpus)
        if event:
            job_of[:] = -1
            for k, j in enumerate(running):
                job_of[j.gpus] = k
        if t >= next_inlet:
            next_inlet += spec.inlet_update_s
            inl = inlet_at(scn, t)
            for g in range(G):
                node.set_inlet(g, float(inl[g]))
        if t >= next_decide or (event and pol.on_events):
            tele = np.array(node.state(sync=False)[list(_TELE_FIELDS)])
            caps = pol.decide(Observation(t, list(running), job_of.copy(), tele, event))
            if t >= next_decide:
                next_decide = t + pol.period_s if math.isfinite(pol.period_s) else math.inf
            if caps is not None:
                caps = np.clip(np.asarray(caps, float), lo, hi)  # never outside the device's constraints
                try:
                    node.set_limits_w(caps)
                except SimDeviceError:
                    set_refused += 1  # a GPU lost (thermal shutdown): the others were still set
        st = node.state(sync=False)
        over = _overshoot_w(st["enforced_w"], limited)
        if over > max_over:
            max_over = over
        node.advance(step)
        st = node.state(sync=False)
        prog = st["progress"].copy()
        en = st["energy_j"].copy()
        rate = (prog - prev_progress) / step
        de = en - prev_energy
        prev_progress, prev_energy = prog, en
        thermal = (st["reasons"] & THERMAL_BITS) != 0
        tp = 0.0
        n_busy = 0
        n_thr = 0
        for j in running:
            s = float(rate[j.gpus].min())
            job_work[j.job_id] = job_work.get(j.job_id, 0.0) + s * step
            job_time[j.job_id] = job_time.get(j.job_id, 0.0) + step
            tp += s * j.n_gpus
            energy += float(de[j.gpus].sum())
            n_busy += j.n_gpus
            n_thr += int(np.count_nonzero(thermal[j.gpus]))
        gpu_steps += tp * step
        busy_time += n_busy * step
        throttled_time += n_thr * step
        acc_tp += tp
        acc_th += n_thr / n_busy if n_busy else 0.0
        acc_n += 1
        if acc_n == every:
            ser_t.append(t + step)
            ser_tp.append(acc_tp / acc_n)
            ser_th.append(acc_th / acc_n)
            acc_tp = acc_th = 0.0
            acc_n = 0
        if i % snap_every == 0:
            snap_t.append(t + step)
            snap_cap.append(st["enforced_w"].astype(np.float32))
            snap_temp.append(st["temp_c"].astype(np.float32))
            snap_thr.append(thermal.copy())
    lost = int(np.count_nonzero(node.state(sync=False)["flags"] & FLAG_LOST))
    node.close()
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
    duration = n_steps * step
    return PolicyRun(
        name=name, throughput=gpu_steps / duration if duration else 0.0,
        job_rate={k: job_work[k] / job_time[k] for k in job_work if job_time[k] > 0},
        job_gpus={j.job_id: j.n_gpus for j in jobs if j.job_id in job_work},
        thermal_slowdown_fraction=throttled_time / busy_time if busy_time else 0.0,
        max_overshoot_w=max_over, energy_per_step_j=energy / gpu_steps if gpu_steps else math.nan,
        energy_j=energy, gpu_steps=gpu_steps, wall_s=time.perf_counter() - wall0,
        series_t_s=np.array(ser_t), series_throughput=np.array(ser_tp),
        series_throttled_fraction=np.array(ser_th), snap_t_s=np.array(snap_t),
        snap_cap_w=np.array(snap_cap), snap_temp_c=np.array(snap_temp), snap_throttled=np.array(snap_thr),
        extra=extra,
    )


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
