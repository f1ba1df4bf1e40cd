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
   coordinator's own :class:`~capctl.coordinator.registry.Registry`; its observation rule
   (:func:`capctl.coordinator.models.rate_observation`) feeds the allocator's
   :class:`~capctl.allocator.curves.OnlineCurveFit` (prior
   :func:`capctl.coordinator.models.prior_curve`) and
   :class:`~capctl.allocator.thermal.OnlineThermalFit`; then the coordinator's
   :func:`capctl.coordinator.allocation.build_inputs` and :func:`~capctl.coordinator.allocation.solve`
   (fast allocator) and its two-phase planner with the deadband (:mod:`capctl.coordinator.planner`).
   It sees only NVML telemetry — no step rates, no speeds. This class stands in for
   ``coordinator.models.Models`` (whose refit throttle reads ``time.monotonic()``, so it is not
   deterministic in-process): rate curves are learned per job (all GPUs of a job pooled into one
   OnlineCurveFit, the allocator's documented "one job's" use) instead of per GPU, refitted at most
   every :data:`CAPCTL_REFIT_S` simulated seconds (the coordinator: per GPU, every
   ``CURVE_REFIT_S``), and one OnlineThermalFit covers all GPUs (the coordinator: one per node; the
   same per-GPU estimator). Per-GPU fits see the same observations up to noise in this simulator
   (the clock-based observation does not depend on a GPU's speed).
5. ``oracle`` — the same allocator given the truth: each job's rate curve fitted to the physics'
   steady-state curve (:func:`capctl.simgpu.node.steady_state`), every GPU's true speed, and the
   thermal ceiling from the true R, tau, inlet and temperature.
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
CAPCTL_REFIT_S = 60.0
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
        else:
            idle = np.clip(enforced, self.lo, self.hi)
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
        from capctl.allocator.thermal import OnlineThermalFit
        from capctl.coordinator.models import prior_curve
        from capctl.coordinator.planner import DomainSpec

        super().reset(ctx)
        p = ctx.profile
        self.prior = prior_curve(p.nvml_name, p.min_limit_w, p.max_limit_w)
        # job id -> [OnlineCurveFit, last refit t, caps not yet fitted, caps fitted, current CurveParams]
        self.fits: dict[str, list] = {}
        self.thermal_fit = OnlineThermalFit(ctx.topo.n_gpus, nominal_interval_s=float(ctx.policy.interval_s))
        self.keys = ctx.topo.keys()
        self.domain_specs = [
            DomainSpec(d["name"], str(d.get("kind", "")), None if d["limit_w"] is None else float(d["limit_w"]),
                       frozenset(self.keys[g] for g in ctx.topo.domain_members[i]))
            for i, d in enumerate(ctx.topo.domains)
        ]
        self.refits = 0
        self.index = {key: g for g, key in enumerate(self.keys)}
        self.node_index = {n: k for k, n in enumerate(ctx.topo.node_names)}
        self.registry = self._make_registry(ctx)
        self._bound_jobs = None
        self.jobs_seen: set = set()
        self.jobs_learned: set = set()  # jobs whose fitted curve left the prior

    @staticmethod
    def _make_registry(ctx):
        """The coordinator's Registry as the agents' hellos would fill it (constraints from the device)."""
        from capctl.coordinator.registry import GpuObs, NodeObs, Registry

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

    def _learn(self, obs):
        from capctl.allocator.curves import OnlineCurveFit
        from capctl.coordinator.models import rate_observation
        from capctl.coordinator.registry import Sample
        from capctl.simgpu.node import reason_names

        tele = obs.tele
        maxclk = float(self.ctx.profile.max_sm_clock_mhz)
        live = {j.job_id for j in obs.jobs}
        for jid in [j for j in self.fits if j not in live]:
            del self.fits[jid]
        names_cache: dict[int, tuple[str, ...]] = {}
        for k, job in enumerate(obs.jobs):
            entry = self.fits.get(job.job_id)
            if entry is None:
                entry = self.fits[job.job_id] = [OnlineCurveFit(self.prior), -math.inf, set(), set(), self.prior]
                self.jobs_seen.add(job.job_id)
            fit, _, bins, seen_bins, _ = entry
            for g in job.gpus:
                row = tele[g]
                bits = int(row["reasons"])
                names = names_cache.get(bits)
                if names is None:
                    names = names_cache[bits] = tuple(n.upper() for n in reason_names(bits))
                s = Sample(time_s=obs.t_s, power_w=float(row["power_avg_w"]), enforced_w=float(row["enforced_w"]),
                           temp_c=float(row["temp_c"]), sm_clock_mhz=float(row["sm_clock_mhz"]), reasons=names,
                           utilization_pct=float(row["utilization_pct"]))
                rho = rate_observation(s, maxclk)
                if rho is not None and math.isfinite(s.enforced_w):
                    fit.add(s.enforced_w, rho)
                    b = int(round(s.enforced_w))
                    if b not in seen_bins:
                        bins.add(b)
        self.thermal_fit.add(obs.t_s, tele["power_avg_w"].astype(float), tele["temp_c"].astype(float))

    def _curve(self, entry, t_s):
        fit, last, bins, seen, cur = entry
        due = (bins and t_s - last >= CAPCTL_REFIT_S) or (t_s - last >= 10 * CAPCTL_REFIT_S)
        if due:
            entry[1] = t_s
            try:
                entry[4] = fit.params()
                self.refits += 1
            except (ValueError, FloatingPointError, np.linalg.LinAlgError):
                pass  # keep the last fit, as the coordinator's GpuModel does
            seen |= bins
            bins.clear()
        return entry[4]

    def _sync_registry(self, obs: Observation) -> None:
        """Mirror the telemetry into the coordinator's own Registry (what the agents would report)."""
        from capctl.coordinator.registry import Binding

        tele = obs.tele
        gpn = self.ctx.topo.gpus_per_node
        for k, name in enumerate(self.ctx.topo.node_names):
            node = self.registry.nodes[name]
            node.last_report_mono = obs.t_s
            for i, g in node.gpus.items():
                row = tele[k * gpn + i]
                g.have_reading = True
                g.power_w = float(row["power_avg_w"])
                g.cap_w = float(row["limit_w"])
                g.enforced_w = float(row["enforced_w"])
                g.temp_c = float(row["temp_c"])
                g.sm_clock_mhz = int(row["sm_clock_mhz"])
                g.utilization_pct = float(row["utilization_pct"])
        if obs.event or self._bound_jobs is None:
            for node in self.registry.nodes.values():
                node.bindings.clear()
            for job in obs.jobs:
                for node_idx in np.unique(job.gpus // gpn):
                    name = self.ctx.topo.node_names[int(node_idx)]
                    idx = tuple(int(g - node_idx * gpn) for g in job.gpus if g // gpn == node_idx)
                    self.registry.nodes[name].bindings[job.job_id] = Binding(job.job_id, name, idx)
            self._bound_jobs = [j.job_id for j in obs.jobs]

    def decide(self, obs: Observation):
        from capctl.coordinator import allocation
        from capctl.coordinator.planner import GpuPlanInput, plan_decreases, plan_increases

        t = self.ctx.topo
        pol = self.ctx.policy
        self._learn(obs)
        self._sync_registry(obs)
        self._curves = {}
        for job in obs.jobs:
            c = self._curve(self.fits[job.job_id], obs.t_s)
            if c is not self.prior:
                self.jobs_learned.add(job.job_id)
            self._curves[job.job_id] = c
        self._job_of = obs.job_of_gpu
        self._jobs = obs.jobs
        r, tau, inlet = self.thermal_fit.params()
        self._thermal = (r, tau, inlet)
        # the coordinator's own snapshot -> problem -> fast allocator (ack memory = one interval,
        # as Coordinator.ack_memory_s)
        inputs = allocation.build_inputs(self.registry, self, pol, obs.t_s, float(pol.failsafe.lease_s),
                                         float(pol.interval_s))
        t0 = time.perf_counter()
        out = allocation.solve(inputs)
        self.solve_s += time.perf_counter() - t0
        self.solves += 1
        # the coordinator's two-phase apply with its deadband (acknowledged at once here)
        enforced = obs.tele["enforced_w"].astype(float)
        index = self.index
        plan = [GpuPlanInput(key, float(out.desired_w[key]), float(enforced[index[key]]),
                             float(enforced[index[key]]), float(t.min_cap_w[index[key]]),
                             float(t.max_cap_w[index[key]]), True) for key in out.desired_w]
        caps = enforced.copy()
        for key, v in plan_decreases(plan).items():
            caps[index[key]] = v
        after = [GpuPlanInput(i.key, i.desired_w, caps[index[i.key]], caps[index[i.key]], i.min_cap_w,
                              i.max_cap_w, True) for i in plan]
        for key, v in plan_increases(after, self.domain_specs).items():
            caps[index[key]] = v
        return caps

    # --- the two methods of coordinator.models.Models that allocation.build_inputs calls ------

    def curve(self, key):
        """Rate curve of GPU ``key`` (its job's pooled fit, else the prior)."""
        k = int(self._job_of[self.index[key]])
        if k < 0:
            return self.prior
        return self._curves.get(self._jobs[k].job_id, self.prior)

    def thermal(self, node_name: str) -> dict:
        """GPU index -> (R °C/W, tau s, inlet °C) of ``node_name`` from the online thermal fit."""
        r, tau, inlet = self._thermal
        gpn = self.ctx.topo.gpus_per_node
        k = self.node_index[node_name]
        return {i: (float(r[k * gpn + i]), float(tau[k * gpn + i]), float(inlet[k * gpn + i])) for i in range(gpn)}


class Oracle(_AllocatorPolicy):
    """Policy 5 (see module docstring)."""

    name = "oracle"

    def reset(self, ctx: Context) -> None:
        super().reset(ctx)
        self.curves: dict[str, object] = {}

    def _true_curve(self, profile):
        from capctl.allocator.curves import CurveParams, fit_curve
        from capctl.simgpu.node import steady_state

        c = self.curves.get(profile.name)
        if c is None:
            p = self.ctx.profile
            caps = np.linspace(p.min_limit_w, p.max_limit_w, 26)
            r, _, _ = steady_state(p.name, np.append(caps, p.max_limit_w), demand_w=profile.demand_w,
                                   memory_bound_fraction=profile.memory_bound_fraction, speed=1.0,
                                   thermal=False, quantized=True)
            rel = r[:-1] / r[-1]
            f = fit_curve(caps, rel, valid_min_w=p.min_limit_w, loss="linear")
            c = self.curves[profile.name] = CurveParams(f.a, f.k_w, f.sat_w, p.min_limit_w, f.fit_rmse,
                                                        f.fit_max_err, "physics steady state")
        return c

    def decide(self, obs: Observation):
        from capctl.allocator.thermal import thermal_ceiling_w

        t = self.ctx.topo
        pol = self.ctx.policy
        G = t.n_gpus
        p = self.ctx.profile
        a = np.full(G, 1.0)
        k = np.full(G, 50.0)
        sat = np.full(G, p.max_limit_w)
        vmin = np.full(G, p.min_limit_w)
        for job in obs.jobs:
            c = self._true_curve(job.profile)
            a[job.gpus], k[job.gpus], sat[job.gpus], vmin[job.gpus] = c.a, c.k_w, c.sat_w, c.valid_min_w
        tele = obs.tele
        ceil = thermal_ceiling_w(tele["temp_c"].astype(float), tele["inlet_c"].astype(float),
                                 tele["thermal_resistance_c_per_w"].astype(float), tele["tau_s"].astype(float),
                                 float(pol.interval_s), tele["slowdown_temp_c"].astype(float),
                                 float(pol.thermal.margin_c))
        problem = self._problem(obs, (a, k, sat, vmin), tele["speed"].astype(float), ceil)
        return self._solve(problem).cap_w.copy()


def make_policy(name: str):
    """A fresh policy object by name (:data:`POLICY_NAMES`)."""
    return {"uniform": Uniform, "utilization": Utilization, "balancer": Balancer,
            "capctl": Capctl, "oracle": Oracle}[name]()
