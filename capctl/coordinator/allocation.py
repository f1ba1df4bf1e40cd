"""From observed state to the allocator's problem, and back (the coordinator's side of the solve).

:func:`build_inputs` (event-loop thread, reads the registry) snapshots everything the solve needs
into plain data: :class:`SolveInputs`. :func:`solve` (worker thread, pure) builds the allocator's
:class:`~capctl.allocator.problem.AllocationProblem` and solves it with the fast path
(:func:`capctl.allocator.fast.solve`).

Problem construction (issue 4, "Control loop"):

* domains: the policy's tree (root limit = the budget in force) plus one node domain per node
  under the domain listing it (the policy's own ``kind: node`` domain when it lists exactly that
  node: its ``limit_w`` is the node limit; otherwise ``node:<name>`` without a limit);
* GPUs of live nodes: limit constraints from NVML (raised to the policy's ``min_cap_w``), rate
  curve from the online model, thermal ceiling from the thermal model
  (:func:`capctl.allocator.thermal.thermal_ceiling_w` with the policy's ``thermal.margin_c`` and
  the device's slowdown temperature), previous cap = observed enforced cap (slew limit);
* GPUs of stale nodes, and GPUs without a reading yet, are *fixed* at their accounted cap
  (``min = max = accounted``): held and counted as spent, never as free budget;
* idle GPUs (no job bound) get the policy's ``idle_cap_w``; when it is null they keep their
  current cap (counted as spent), as the default policy documents;
* jobs: the bindings the agents hold; weight from the policy (qos > account > partition >
  default).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from capctl.allocator.thermal import thermal_ceiling_w

GpuKey = tuple[str, int]

FIXED_EPS_W = 1e-3


@dataclasses.dataclass
class GpuInput:
    """One GPU of the problem (W, degC)."""

    key: GpuKey
    domain: str
    min_cap_w: float
    max_cap_w: float
    fixed: bool
    accounted_w: float
    observed_w: float
    job: str | None
    curve: object
    thermal_ceiling_w: float
    idle_cap_w: float


@dataclasses.dataclass
class SolveInputs:
    """Everything one solve needs (plain data; safe to hand to a worker thread)."""

    gpus: list[GpuInput]
    jobs: dict[str, float]
    domains: list[dict]
    objective: str
    slew_w: float | None
    node_domain: dict[str, str]
    domain_members: dict[str, set]  # domain name -> GPU keys below it (all levels)


@dataclasses.dataclass
class SolveOutput:
    """The allocator's answer mapped back to GPU keys and job ids."""

    desired_w: dict[GpuKey, float]
    job_rate: dict[str, float]
    job_binding: dict[str, str]
    job_slowest: dict[str, GpuKey | None]
    domain_price: dict[str, float]
    domain_deficit_w: dict[str, float]
    domain_load_w: dict[str, float]
    feasible: bool
    alerts: list[str]
    solve_s: float
    solver: str


def ceiling_w(temp_c, thermal, interval_s, slowdown_temp_c, margin_c) -> float:
    """Thermal ceiling (W) of one GPU, +inf when the slowdown temperature or model is unknown."""
    if not thermal or slowdown_temp_c <= 0 or not math.isfinite(temp_c):
        return math.inf
    r, tau, inlet = thermal
    try:
        value = float(thermal_ceiling_w(temp_c, inlet, r, tau, interval_s, slowdown_temp_c, margin_c))
    except ValueError:
        return math.inf
    return value if not math.isnan(value) else math.inf


def build_domains(policy, node_names) -> tuple[list[dict], dict[str, str]]:
    """Allocator domain dicts (tree + node domains) and node -> its node-domain name."""
    out = []
    seen = set()
    for d, parent in _walk_with_parent(policy.domains, None):
        limit = policy.budget_w if parent is None else d.limit_w
        out.append({"name": d.name, "parent": parent, "limit_w": limit, "kind": d.kind})
        seen.add(d.name)
    node_domain = {}
    for node in node_names:
        path = policy.domain_path(node)
        leaf = path[-1]
        if leaf.kind == "node" and tuple(leaf.nodes) == (node,) and not leaf.children:
            node_domain[node] = leaf.name
            continue
        name = f"node:{node}"
        if name in seen:
            name = f"node:{node}#"
        out.append({"name": name, "parent": leaf.name, "limit_w": None, "kind": "node"})
        seen.add(name)
        node_domain[node] = name
    return out, node_domain


def _walk_with_parent(domain, parent):
    yield domain, parent
    for child in domain.children:
        yield from _walk_with_parent(child, domain.name)


def build_inputs(registry, models, policy, now_mono: float, lease_s: float, ack_memory_s: float) -> SolveInputs:
    """Snapshot the registry and models into :class:`SolveInputs` (see module docstring)."""
    node_names = sorted(registry.nodes)
    domains, node_domain = build_domains(policy, node_names)
    parent = {d["name"]: d["parent"] for d in domains}
    members: dict[str, set] = {d["name"]: set() for d in domains}
    jobs: dict[str, float] = {}
    gpus: list[GpuInput] = []
    policy_min = policy.min_cap_w
    for name in node_names:
        node = registry.nodes[name]
        stale = node.stale(now_mono, lease_s)
        thermal = models.thermal(name)
        job_of = {}
        for b in node.bindings.values():
            for i in b.gpu_indices:
                job_of[i] = b.job_id
            if b.job_id not in jobs:
                jobs[b.job_id] = float(policy.job_weight(partition=b.partition or None, account=b.account or None,
                                                         qos=b.qos or None))
        for idx in sorted(node.gpus):
            g = node.gpus[idx]
            key = (name, idx)
            accounted = g.accounted_w(now_mono, ack_memory_s)
            fixed = stale or not g.have_reading or g.max_cap_w <= 0
            job = job_of.get(idx)
            if fixed:
                v = max(accounted, FIXED_EPS_W)
                lo = hi = v
                ceil = math.inf
                idle = v
            else:
                lo = g.min_cap_w if policy_min is None else max(g.min_cap_w, min(policy_min, g.max_cap_w))
                hi = g.max_cap_w
                lo = max(lo, FIXED_EPS_W)
                ceil = ceiling_w(g.temp_c, thermal.get(idx), policy.interval_s, g.slowdown_temp_c, policy.thermal.margin_c)
                if policy.idle_cap_w is not None:
                    idle = min(max(policy.idle_cap_w, lo), hi)
                else:
                    idle = min(max(accounted, lo), hi)
            gpus.append(GpuInput(
                key=key, domain=node_domain[name], min_cap_w=lo, max_cap_w=hi, fixed=fixed,
                accounted_w=accounted, observed_w=g.enforced_w if g.have_reading else accounted, job=job,
                curve=models.curve(key), thermal_ceiling_w=ceil, idle_cap_w=idle,
            ))
            d = node_domain[name]
            while d is not None:
                members[d].add(key)
                d = parent[d]
    # jobs whose GPUs are all unknown to the registry cannot be allocated
    used = {g.job for g in gpus if g.job}
    jobs = {j: w for j, w in jobs.items() if j in used}
    return SolveInputs(gpus=gpus, jobs=jobs, domains=domains, objective=policy.objective, slew_w=policy.slew_w,
                       node_domain=node_domain, domain_members=members)


def solve(inputs: SolveInputs) -> SolveOutput:
    """Build the :class:`AllocationProblem` and solve it with the allocator's fast path.

    Raises ValueError (from the allocator) when the problem is malformed.
    """
    from capctl.allocator.fast import solve as fast_solve
    from capctl.allocator.problem import AllocationProblem

    t0 = time.perf_counter()
    if not inputs.gpus:
        return SolveOutput({}, {}, {}, {}, {d["name"]: 0.0 for d in inputs.domains},
                           {d["name"]: 0.0 for d in inputs.domains}, {d["name"]: 0.0 for d in inputs.domains},
                           True, [], time.perf_counter() - t0, "none")
    specs = []
    for g in inputs.gpus:
        spec = {
            "name": f"{g.key[0]}/{g.key[1]}",
            "domain": g.domain,
            "min_cap_w": g.min_cap_w,
            "max_cap_w": g.max_cap_w,
            "thermal_ceiling_w": None if not math.isfinite(g.thermal_ceiling_w) else g.thermal_ceiling_w,
            "job": g.job,
            "prev_cap_w": None if g.fixed else g.observed_w,
            "idle_cap_w": g.idle_cap_w,
        }
        if g.curve is not None:
            spec["curve"] = g.curve
        specs.append(spec)
    problem = AllocationProblem.build(gpus=specs, jobs=inputs.jobs, domains=inputs.domains,
                                      objective=inputs.objective, slew_w=inputs.slew_w)
    result = fast_solve(problem)
    solve_s = time.perf_counter() - t0
    keys = [g.key for g in inputs.gpus]
    desired = {}
    for i, g in enumerate(inputs.gpus):
        desired[g.key] = g.accounted_w if g.fixed else float(result.cap_w[i])
    names = list(problem.job_names)
    job_rate = {n: float(result.job_rate[j]) for j, n in enumerate(names)}
    job_binding = {n: str(result.job_binding[j]) for j, n in enumerate(names)}
    slowest = {}
    for j, n in enumerate(names):
        s = int(result.slowest_gpu[j])
        slowest[n] = keys[s] if 0 <= s < len(keys) else None
    dnames = list(problem.domain_names)
    price = {n: float(result.domain_price[d]) for d, n in enumerate(dnames)}
    deficit = {n: float(result.domain_deficit_w[d]) for d, n in enumerate(dnames)}
    load = {n: float(result.domain_load_w[d]) for d, n in enumerate(dnames)}
    return SolveOutput(desired, job_rate, job_binding, slowest, price, deficit, load, bool(result.feasible),
                       [str(a) for a in result.alerts], solve_s, getattr(result, "solver", "fast"))


def minimum_needed_w(inputs: SolveInputs) -> float:
    """Watts the cluster needs at least: live GPUs at their minimum cap, fixed ones at their
    accounted cap (what a budget below would leave in deficit)."""
    return float(np.sum([g.min_cap_w if not g.fixed else g.accounted_w for g in inputs.gpus])) if inputs.gpus else 0.0
