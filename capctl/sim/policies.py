"""The five power policies compared by ``capctl sim`` (same cluster, workload and seed).

Every policy sees the cluster through :class:`Observation` and returns per-GPU caps (W) or None
(no change). The engine applies them to the simulated GPUs inside the device's limit constraints.
What each one may observe is what it would observe on a real cluster:

1. ``uniform`` — static: every GPU gets ``budget / number of GPUs``, clamped to the device's limit
   constraints (then lowered where a power domain of the policy would be exceeded).
2. ``utilization`` — utilization-proportional shifting every :data:`UTILIZATION_PERIOD_S` (90 s),
   like NVIDIA's power steering: the budget is water-filled over GPUs in proportion to their NVML
   utilization (idle GPUs get the device minimum), clamped to the limit constraints.
3. ``balancer`` — model-free, in the style of GEOPM's ``power_balancer`` agent (GEOPM docs,
   "power_balancer": a job's budget is fixed; each node measures its epoch time without the time
   spent waiting at the barrier, lowers its limit while it is still faster than the slowest node
   of its job, and the watts freed go to the slowest nodes). Job budget = the uniform share of its
   GPUs; the node limit is split equally over the node's GPUs; one step of
   :data:`BALANCER_STEP_W` per GPU per :data:`BALANCER_PERIOD_S`, deadband :data:`BALANCER_TOL`.
   Thermally unaware (as GEOPM's balancer is).
4. ``capctl`` — the coordinator's logic run in-process: the telemetry is mirrored into the
   coordinator's own :class:`~coordinator.registry.Registry` (readings and one model sample
   per GPU per interval, as ``Registry.on_telemetry`` stores the agents' reports); the
   coordinator's own :class:`~coordinator.models.Models` learns per GPU (rate curve:
   prior-anchored power scale, then the allocator's :class:`~capctl.allocator.curves.OnlineCurveFit`;
   thermal: one :class:`~capctl.allocator.thermal.OnlineThermalFit` per node), on simulated time
   (its injectable clocks: the refit throttle reads the simulated clock; the per-interval refit
   budget is charged :data:`CAPCTL_REFIT_COST_S` per refit; the refit jitter comes from a seeded
   ``random.Random``); then the coordinator's :func:`coordinator.allocation.build_inputs`
   and :func:`~coordinator.allocation.solve` (fast allocator) and its two-phase planner with
   the deadband (:mod:`coordinator.planner`, its array versions, as the daemon's decision).
   It sees only NVML telemetry (with NVML's memory utilization, as the agents report it:
   :func:`nvml_memory_utilization_pct`) — no step rates,
   no speeds, no power factors; a GPU's power efficiency shows in its SM clock at the enforced cap.
5. ``oracle`` — the same allocator given the truth: per GPU, the rate curve of its job's workload
   fitted to the physics' steady state (:func:`capctl.simgpu.node.steady_state`) and mapped in
   closed form onto the GPU's true ``power_factor`` (a part with factor k at cap P runs as a
   nominal part at ``P_static + (P - P_static) / k``), every GPU's true ``speed``, and the thermal
   ceiling from the true R, tau, inlet and temperature.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from capctl.sim.topology import Topology, fit_to_domains

POLICY_NAMES = ("uniform", "utilization", "balancer", "capctl", "oracle")
UTILIZATION_PERIOD_S = 90.0
BALANCER_PERIOD_S = 10.0
BALANCER_STEP_W = 10.0
BALANCER_TOL = 0.01
CAPCTL_REFIT_COST_S = 0.001
"""Simulated cost of one full curve refit charged to the coordinator's per-interval refit budget
(``coordinator.models.REFIT_BUDGET_FRACTION`` and what follows it): one batched fit
(``capctl.allocator.batchfit``) takes ~1 ms (``coordinator.refitcost``)."""
THERMAL_BITS = 0x20 | 0x40  # NVML SwThermalSlowdown | HwThermalSlowdown


@dataclass
class Context:
    """Static facts every policy may know: topology, budget, the capctl policy, the device."""

    topo: Topology
    budget_w: float
    policy: object  # capctl.policy.Policy
    profile: object  # capctl.simgpu.profiles.DeviceProfile
    node: object     # the SimNode (the oracle reads true parameters from it)


@dataclass
class Observation:
    """What the engine hands a policy at a decision (arrays of G GPUs; W, °C, MHz, s).

    ``jobs``: running jobs; ``job_of_gpu`` indexes that list (-1 idle). ``tele``: structured copy
    of the GPUs' state now (power_avg_w, enforced_w, temp_c, sm_clock_mhz, reasons,
    utilization_pct, progress ...). ``progress`` is the per-GPU work integral: a policy may only
    use it where the real counterpart measures step times (the balancer).
    """

    t_s: float
    jobs: list
    job_of_gpu: np.ndarray
    tele: np.ndarray
    event: bool


def waterfill(total_w: float, weight: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Caps with sum ``total_w`` (if reachable) proportional to ``weight``, clipped to [lo, hi]
    (bisection on the multiplier; weight 0 -> lo). Returns W."""
    if np.sum(hi) <= total_w:
        return hi.copy()
    if np.sum(lo) >= total_w or not np.any(weight > 0):
        return lo.copy()
    a, b = 0.0, float(np.max(hi / np.maximum(weight, 1e-12)))
    for _ in range(100):
        mid = 0.5 * (a + b)
        if np.clip(mid * weight, lo, hi).sum() > total_w:
            b = mid
        else:
            a = mid
    return np.clip(a * weight, lo, hi)


class Uniform:
    """Policy 1 (see module docstring)."""

    name = "uniform"
    period_s = math.inf
    on_events = False

    def reset(self, ctx: Context) -> None:
        self.ctx = ctx

    def decide(self, obs: Observation):
        t = self.ctx.topo
        share = self.ctx.budget_w / t.n_gpus
        caps = np.clip(np.full(t.n_gpus, share), t.min_cap_w, t.max_cap_w)
        return fit_to_domains(caps, t.min_cap_w, t)


class Utilization:
    """Policy 2 (see module docstring)."""

    name = "utilization"
    period_s = UTILIZATION_PERIOD_S
    on_events = False

    def reset(self, ctx: Context) -> None:
        self.ctx = ctx

    def decide(self, obs: Observation):
        t = self.ctx.topo
        util = np.clip(obs.tele["utilization_pct"], 0.0, 100.0)
        caps = waterfill(self.ctx.budget_w, util, t.min_cap_w, t.max_cap_w)
        return fit_to_domains(caps, t.min_cap_w, t)


class Balancer:
    """Policy 3 (see module docstring)."""

    name = "balancer"
    period_s = BALANCER_PERIOD_S
    on_events = False

    def reset(self, ctx: Context) -> None:
        self.ctx = ctx
        t = ctx.topo
        self.share_w = float(np.clip(ctx.budget_w / t.n_gpus, t.min_cap_w[0], t.max_cap_w[0]))
        n_nodes = len(t.node_names)
        self.node_limit = np.full(n_nodes, self.share_w * t.gpus_per_node)
        self.node_job = [None] * n_nodes
        self.last_progress = None
        self.last_t = None

    def decide(self, obs: Observation):
        t = self.ctx.topo
        gpn = t.gpus_per_node
        lo_n, hi_n = t.min_cap_w[0] * gpn, t.max_cap_w[0] * gpn
        prog = obs.tele["progress"]
        measured = None
        if self.last_progress is not None and obs.t_s > self.last_t:
            measured = (prog - self.last_progress) / (obs.t_s - self.last_t)
        self.last_progress, self.last_t = prog.copy(), obs.t_s
        running = {j.job_id: j for j in obs.jobs}
        # nodes whose job changed: back to the uniform share (a new job's budget = its share)
        fresh = set()
        for n in range(len(t.node_names)):
            g0 = n * gpn
            k = int(obs.job_of_gpu[g0])
            jid = obs.jobs[k].job_id if k >= 0 else None
            if jid != self.node_job[n]:
                self.node_limit[n] = self.share_w * gpn
                self.node_job[n] = jid
                if jid is not None:
                    fresh.add(jid)
        if measured is not None:
            for jid, job in running.items():
                if jid in fresh:
                    continue
                nodes = np.unique(job.gpus // gpn)
                node_rate = measured[job.gpus].reshape(-1, gpn).min(axis=1)
                nodes_of_rows = job.gpus[::gpn] // gpn
                rate = dict(zip(nodes_of_rows.tolist(), node_rate.tolist()))
                r = np.array([rate[int(n)] for n in nodes])
                slowest = r.min()
                if not slowest > 0:
                    continue
                fast = r > slowest * (1.0 + BALANCER_TOL)
                freed = 0.0
                for i in np.nonzero(fast)[0]:
                    n = int(nodes[i])
                    new = max(lo_n, self.node_limit[n] - BALANCER_STEP_W * gpn)
                    freed += self.node_limit[n] - new
                    self.node_limit[n] = new
                slow = [int(nodes[i]) for i in np.nonzero(~fast)[0]]
                for _ in range(3):  # give to the slowest nodes; what they cannot take to the others
                    if freed <= 1e-9:
                        break
                    takers = [n for n in slow if self.node_limit[n] < hi_n - 1e-9] or \
                             [int(n) for n in nodes if self.node_limit[int(n)] < hi_n - 1e-9]
                    if not takers:
                        break
                    each = freed / len(takers)
                    for n in takers:
                        add = min(each, hi_n - self.node_limit[n])
                        self.node_limit[n] += add
                        freed -= add
        caps = np.repeat(self.node_limit / gpn, gpn)
        caps = np.clip(caps, t.min_cap_w, t.max_cap_w)
        return fit_to_domains(caps, t.min_cap_w, t)


def nvml_memory_utilization_pct(tele, max_sm_clock_mhz: float) -> np.ndarray:
    """What ``nvmlDeviceGetUtilizationRates().memory`` of the simulated driver returns for each GPU
    of ``tele`` (fields ``utilization_pct``, ``memory_bound_fraction``, ``sm_clock_mhz``; [G]), in
    percent: the memory-busy share of the step-time model at the GPU's clock ratio, rounded as
    the driver's ``lround`` (csrc/simnvml/nvml.c, ``nvmlDeviceGetUtilizationRates``; tested equal
    to what pynvml reads). ``max_sm_clock_mhz``: the device's maximum SM clock (MHz)."""
    m = tele["memory_bound_fraction"].astype(float)
    r = tele["sm_clock_mhz"].astype(float) / max_sm_clock_mhz if max_sm_clock_mhz > 0 else np.ones(len(tele))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(r > 0, m / (m + (1.0 - m) / np.where(r > 0, r, 1.0)), 0.0)
    return np.floor(tele["utilization_pct"].astype(float) * share + 0.5)


class _AllocatorPolicy:
    """Shared part of capctl and the oracle: the AllocationProblem from per-GPU arrays."""

    on_events = True

    def reset(self, ctx: Context) -> None:
        self.ctx = ctx
        self.period_s = float(ctx.policy.interval_s)
        t = ctx.topo
        pol = ctx.policy
        lo = t.min_cap_w.copy()
        if pol.min_cap_w is not None:
            lo = np.maximum(lo, np.minimum(pol.min_cap_w, t.max_cap_w))
        self.lo = lo
        self.hi = t.max_cap_w.copy()
        self.solve_s = 0.0
        self.solves = 0

    def _problem(self, obs, curves, speed, ceiling):
        from capctl.allocator.problem import AllocationProblem

        t = self.ctx.topo
        pol = self.ctx.policy
        G = t.n_gpus
        enforced = obs.tele["enforced_w"].astype(float)
        if pol.idle_cap_w is not None:
            idle = np.clip(np.full(G, float(pol.idle_cap_w)), self.lo, self.hi)
        elif pol.reserve_pre_job_limits:  # idle GPUs keep their pre-job limits reserved (docs/policy.md)
            idle = np.clip(enforced, self.lo, self.hi)
        else:  # running jobs first: an idle GPU at its minimum, as the coordinator's solve sees it (the
            # oracle reserved idle GPUs' limits here, below capctl itself: capctl/oracle 1.158 on 96 V100
            # with 16 idle GPUs at 0.6 x TDP; found by a review)
            idle = self.lo.copy()
        a, k, sat, vmin = curves
        weights = np.array([float(pol.job_weight()) for _ in obs.jobs]) if obs.jobs else np.zeros(0)
        return AllocationProblem(
            min_cap_w=self.lo, max_cap_w=self.hi, thermal_ceiling_w=ceiling,
            curve_a=a, curve_k_w=k, curve_sat_w=sat, curve_min_w=vmin, speed=speed,
            job_of_gpu=obs.job_of_gpu.astype(np.int64), prev_cap_w=enforced, idle_cap_w=idle,
            domain_of_gpu=t.domain_of_gpu, job_weight=weights, domain_parent=t.domain_parent,
            domain_limit_w=t.domain_limit_w, objective=pol.objective, slew_w=pol.slew_w,
            job_names=tuple(j.job_id for j in obs.jobs),
            domain_names=tuple(d["name"] for d in t.domains),
            domain_kinds=tuple(str(d.get("kind", "")) for d in t.domains),
        ).validate()

    def _solve(self, problem):
        from capctl.allocator.fast import solve

        t0 = time.perf_counter()
        res = solve(problem)
        self.solve_s += time.perf_counter() - t0
        self.solves += 1
        return res


class Capctl(_AllocatorPolicy):
    """Policy 4 (see module docstring)."""

    name = "capctl"

    def reset(self, ctx: Context) -> None:
        import random

        from coordinator.models import Models
        from coordinator.planner import DomainSpec

        super().reset(ctx)
        self.keys = ctx.topo.keys()
        self.domain_specs = [
            DomainSpec(d["name"], str(d.get("kind", "")), None if d["limit_w"] is None else float(d["limit_w"]),
                       frozenset(self.keys[g] for g in ctx.topo.domain_members[i]))
            for i, d in enumerate(ctx.topo.domains)
        ]
        self.index = {key: g for g, key in enumerate(self.keys)}
        self.registry = self._make_registry(ctx)
        self._bound_jobs = None
        self._now = 0.0
        # the coordinator's own per-GPU models on simulated time: the refit throttle reads the
        # simulated clock; the per-interval refit budget (the daemon: 10-100 ms of perf_counter) is
        # charged CAPCTL_REFIT_COST_S per refit, so the run is deterministic
        self.models = Models(clock=lambda: self._now,
                             budget_clock=lambda: self._now + self.models.refits * CAPCTL_REFIT_COST_S,
                             rng=random.Random(0))
        self.jobs_seen: set = set()
        self._plan_keys: list | None = None  # the problem's GPU order, its topology positions and domains
        self._plan_pos = self._plan_doms = None

    @staticmethod
    def _make_registry(ctx):
        """The coordinator's Registry as the agents' hellos would fill it (constraints from the device)."""
        from coordinator.registry import GpuObs, NodeObs, Registry

        reg = Registry(clock=lambda: 0.0)
        p = ctx.profile
        for name in ctx.topo.node_names:
            node = NodeObs(name=name, simulated=True)
            node.session = object()  # connected
            for i in range(ctx.topo.gpus_per_node):
                node.gpus[i] = GpuObs(node=name, index=i, name=p.nvml_name, min_cap_w=p.min_limit_w,
                                      max_cap_w=p.max_limit_w, default_cap_w=p.default_limit_w,
                                      slowdown_temp_c=p.slowdown_temp_c, shutdown_temp_c=p.shutdown_temp_c,
                                      max_sm_clock_mhz=int(p.max_sm_clock_mhz), enforced_w=p.default_limit_w)
            reg.nodes[name] = node
        return reg

    def _sync_registry(self, obs: Observation) -> None:
        """Mirror the telemetry into the coordinator's own Registry as ``on_telemetry`` would:
        readings and one model sample per GPU (what the agents would report each interval)."""
        from coordinator.registry import Binding, Sample, stuck_slowdown
        from capctl.simgpu.node import reason_names

        tele = obs.tele
        gpn = self.ctx.topo.gpus_per_node
        names_cache: dict[int, tuple[str, ...]] = {}
        # columns as Python lists once (reading a numpy record per GPU and field costs ~1 us each)
        power, limit, enforced, temp, clock, util, bits_of = (
            tele[f].tolist() for f in ("power_avg_w", "limit_w", "enforced_w", "temp_c", "sm_clock_mhz",
                                       "utilization_pct", "reasons"))
        mem_util = nvml_memory_utilization_pct(tele, float(self.ctx.profile.max_sm_clock_mhz)).tolist()
        t_s = obs.t_s
        for k, name in enumerate(self.ctx.topo.node_names):
            node = self.registry.nodes[name]
            node.last_report_mono = t_s
            for i, g in node.gpus.items():
                j = k * gpn + i
                g.have_reading = True
                g.power_w = float(power[j])
                g.cap_w = float(limit[j])
                g.enforced_w = float(enforced[j])
                g.temp_c = float(temp[j])
                g.sm_clock_mhz = int(clock[j])
                g.utilization_pct = float(util[j])
                g.memory_utilization_pct = mem_util[j]
                bits = int(bits_of[j])
                names = names_cache.get(bits)
                if names is None:
                    names = names_cache[bits] = tuple(n.upper() for n in reason_names(bits))
                g.reasons = names  # the pace loop's inputs, as on_telemetry records them
                g.sample_enforced_w, g.sample_mono = g.enforced_w, t_s
                g.slowdown_run = g.slowdown_run + 1 if (g.utilization_pct >= 20.0 and stuck_slowdown(names)) else 0
                g.new_samples.append(Sample(time_s=t_s, power_w=g.power_w, enforced_w=g.enforced_w,
                                            temp_c=g.temp_c, sm_clock_mhz=float(clock[j]),
                                            reasons=names, utilization_pct=g.utilization_pct,
                                            memory_utilization_pct=g.memory_utilization_pct))
        if obs.event or self._bound_jobs is None:
            for node in self.registry.nodes.values():
                node.bindings.clear()
            for job in obs.jobs:
                self.jobs_seen.add(job.job_id)
                for node_idx in np.unique(job.gpus // gpn):
                    name = self.ctx.topo.node_names[int(node_idx)]
                    idx = tuple(int(g - node_idx * gpn) for g in job.gpus if g // gpn == node_idx)
                    self.registry.nodes[name].bindings[job.job_id] = Binding(job.job_id, name, idx)
            self._bound_jobs = [j.job_id for j in obs.jobs]

    def decide(self, obs: Observation):
        from coordinator import allocation

        pol = self.ctx.policy
        self._now = obs.t_s
        self._sync_registry(obs)
        self.models.memory_bound_share = getattr(getattr(pol, "models", None), "memory_bound_share", "estimate")
        self.models.update(self.registry, float(pol.interval_s))
        # the coordinator's own snapshot -> problem -> fast allocator (ack memory = one interval,
        # as Coordinator.ack_memory_s)
        inputs = allocation.build_inputs(self.registry, self.models, pol, obs.t_s, float(pol.failsafe.lease_s),
                                         float(pol.interval_s))
        t0 = time.perf_counter()
        out = allocation.solve(inputs)
        self.solve_s += time.perf_counter() - t0
        self.models.idle_grants.record(out.idle_grant_w)  # as Coordinator._record_solution
        self.solves += 1
        return self._two_phase(out, obs.tele["enforced_w"].astype(float))

    def _two_phase(self, out, enforced: np.ndarray) -> np.ndarray:
        """The coordinator's two-phase apply with its deadband on arrays
        (:func:`coordinator.planner.plan_decreases_arrays`, then
        :func:`~coordinator.planner.plan_increases_arrays` on the caps after phase 1: acknowledged at
        once here). ``enforced``: W per GPU of the topology; returns the caps (W)."""
        from coordinator.planner import (EXACT_DECREASE_TICKS, PlanArrays, domain_index, plan_decreases_arrays,
                                         plan_increases_arrays)

        t = self.ctx.topo
        keys = list(out.desired_w)
        if self._plan_keys != keys:  # the GPU order of the problem (fixed unless the topology changes)
            self._plan_keys = keys
            self._plan_pos = np.fromiter((self.index[k] for k in keys), np.int64, len(keys))
            self._plan_doms = domain_index(self.domain_specs, keys)
        pos = self._plan_pos
        desired = np.fromiter(out.desired_w.values(), float, len(keys))
        live = np.ones(len(keys), bool)
        lo, hi, none = t.min_cap_w[pos], t.max_cap_w[pos], np.zeros(len(keys))
        caps = enforced.copy()
        now = enforced[pos]
        # exact decreases in the first intervals, as the daemon after its start
        # (planner.EXACT_DECREASE_TICKS; the policy does not change during a run)
        sel, caps_w = plan_decreases_arrays(PlanArrays(keys, desired, now, now, lo, hi, live, none),
                                            doms=self._plan_doms, exact_over=self.solves <= EXACT_DECREASE_TICKS)
        caps[pos[sel]] = caps_w
        now = caps[pos]
        sel, caps_w = plan_increases_arrays(PlanArrays(keys, desired, now, now, lo, hi, live, none), self._plan_doms)
        caps[pos[sel]] = caps_w
        return caps

    @property
    def refits(self) -> int:
        """Full curve refits of the coordinator's models."""
        return self.models.refits

    def learned_summary(self) -> dict:
        """How the per-GPU models ended: GPUs on the full fit / on the scaled prior, scale range."""
        full = sum(1 for m in self.models.gpus.values() if m._full_fit_ready())
        scales = np.array([m.scale for m in self.models.gpus.values()]) if self.models.gpus else np.ones(1)
        return {"gpus_full_fit": full, "gpus_prior_scaled": len(self.models.gpus) - full,
                "power_scale_min": round(float(scales.min()), 3), "power_scale_max": round(float(scales.max()), 3)}


class Oracle(_AllocatorPolicy):
    """Policy 5 (see module docstring)."""

    name = "oracle"

    def reset(self, ctx: Context) -> None:
        super().reset(ctx)
        self.curves: dict[str, object] = {}

    def _true_curve(self, job, power_factor):
        """The job's nominal-part (power_factor 1) curve, fitted to the physics' steady state on the
        nominal caps its GPUs span: a part with factor k at cap P runs exactly as a nominal part at
        ``P_static + (P - P_static) / k`` (physics.c), so per-GPU curves follow in closed form."""
        from capctl.allocator.curves import CurveParams, fit_curve
        from capctl.simgpu.node import steady_state

        c = self.curves.get(job.job_id)
        if c is None:
            p = self.ctx.profile
            ps = p.idle_w
            lo = ps + (p.min_limit_w - ps) / float(np.max(power_factor))
            hi = ps + (p.max_limit_w - ps) / float(np.min(power_factor))
            caps = np.linspace(lo, max(hi, lo + 10.0), 26)
            r, _, _ = steady_state(p.name, caps, demand_w=job.profile.demand_w,
                                   memory_bound_fraction=job.profile.memory_bound_fraction, speed=1.0,
                                   power_factor=1.0, thermal=False, quantized=True)
            f = fit_curve(caps, r, valid_min_w=float(lo), loss="linear")
            c = self.curves[job.job_id] = CurveParams(f.a, f.k_w, f.sat_w, float(lo), f.fit_rmse, f.fit_max_err,
                                                      "physics steady state")
        return c

    def decide(self, obs: Observation):
        from capctl.allocator.thermal import thermal_ceiling_w

        t = self.ctx.topo
        pol = self.ctx.policy
        G = t.n_gpus
        p = self.ctx.profile
        ps = p.idle_w
        a = np.full(G, 1.0)
        k = np.full(G, 50.0)
        sat = np.full(G, p.max_limit_w)
        vmin = np.full(G, p.min_limit_w)
        pf_all = obs.tele["power_factor"].astype(float)
        for job in obs.jobs:
            pf = pf_all[job.gpus]
            c = self._true_curve(job, pf)
            a[job.gpus] = c.a
            k[job.gpus] = c.k_w * pf
            sat[job.gpus] = ps + pf * (c.sat_w - ps)
        live = {j.job_id for j in obs.jobs}
        for jid in [j for j in self.curves if j not in live]:
            del self.curves[jid]
        tele = obs.tele
        ceil = thermal_ceiling_w(tele["temp_c"].astype(float), tele["inlet_c"].astype(float),
                                 tele["thermal_resistance_c_per_w"].astype(float), tele["tau_s"].astype(float),
                                 float(pol.interval_s), tele["slowdown_temp_c"].astype(float),
                                 float(pol.thermal.margin_c))
        problem = self._problem(obs, (a, k, sat, vmin), tele["speed"].astype(float), ceil)
        return self._solve(problem).cap_w.copy()


class OracleNvml(Oracle):
    """The oracle with NVML's view of the rate: every job's curve is fitted as if its workload were
    compute-bound (memory-bound fraction 0: the step rate taken as the SM clock's, which is what
    NVML shows and what the coordinator learns from); all else as :class:`Oracle`. Not one of the
    five compared policies: bench/sim_compare.py --matrix runs it to split capctl's gap to the
    oracle into what NVML cannot show (a workload's memory-bound share) and the rest."""

    name = "oracle-nvml"

    def _true_curve(self, job, power_factor):
        from dataclasses import replace

        return super()._true_curve(replace(job, profile=replace(job.profile, memory_bound_fraction=0.0)),
                                   power_factor)


def make_policy(name: str):
    """A fresh policy object by name (:data:`POLICY_NAMES`, or ``oracle-nvml``: :class:`OracleNvml`)."""
    return {"uniform": Uniform, "utilization": Utilization, "balancer": Balancer,
            "capctl": Capctl, "oracle": Oracle, "oracle-nvml": OracleNvml}[name]()
