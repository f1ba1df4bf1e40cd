"""Workloads of the what-if simulator: per-job GPU workload parameters and the job timeline.

Workload profiles (what a job's GPUs run) are inputs of the simulated driver's physics
(:func:`capctl.simgpu.node.steady_state`): uncapped demand ``demand_w`` and memory-bound
fraction ``memory_bound_fraction``. With ``curves: zeus`` there is one profile per
power-sensitive workload of the Zeus traces (``../shared/data/zeus-power-traces/``, Zeus project,
Apache-2.0, read at run time, never copied): each trace's cap axis is mapped affinely from the
trace's cap range onto the device's limit constraints, and (demand_w, memory_bound_fraction) are
least-squares fitted so that the physics' steady-state relative rate matches the trace on its
concave range (the range the allocator found, :func:`capctl.allocator.curves.concave_start_w`).
With ``curves: default`` there is one profile fitted to the allocator's shipped default curve for
the model (:data:`capctl.allocator.curves.DEFAULT_CURVES`, derived from the same traces).

The job timeline is generated once per scenario (seeded) and is the same for every policy: jobs
start and end at fixed times (a policy changes how fast they run, not when they run).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from capctl.errors import UserInputError


@dataclass(frozen=True)
class WorkloadProfile:
    """Physics inputs of one workload (W, fraction) and the fit error (relative rate) vs its source."""

    name: str
    demand_w: float
    memory_bound_fraction: float
    fit_rmse: float
    source: str


@dataclass(frozen=True)
class Job:
    """One synchronous job: its nodes, GPU indices (simulation order), times (s) and workload."""

    job_id: str
    nodes: tuple[str, ...]
    gpus: np.ndarray
    start_s: float
    end_s: float
    profile: WorkloadProfile

    @property
    def n_gpus(self) -> int:
        return int(self.gpus.size)


def _physics_rel(model: str, caps: np.ndarray, demand_w: float, m: float, max_w: float) -> np.ndarray:
    from capctl.simgpu.node import steady_state

    r, _, _ = steady_state(model, np.append(caps, max_w), demand_w=demand_w, memory_bound_fraction=m,
                           speed=1.0, thermal=False, quantized=False)
    return r[:-1] / r[-1]


def fit_profile(model: str, caps_w: np.ndarray, rel: np.ndarray, name: str, source: str) -> WorkloadProfile:
    """Fit (demand_w, memory_bound_fraction) of the physics to relative rates ``rel`` at ``caps_w``.

    Least squares (scipy) from the best point of a coarse grid; bounds: demand in
    [device min + 10 W, device max], m in [0, 0.9].
    """
    from capctl.simgpu.profiles import get as get_profile

    prof = get_profile(model)
    lo_d, hi_d = prof.min_limit_w + 10.0, prof.max_limit_w
    caps_w = np.asarray(caps_w, float)
    rel = np.asarray(rel, float)

    def resid(x):
        return _physics_rel(model, caps_w, x[0], x[1], prof.max_limit_w) - rel

    best = None
    for d in np.linspace(lo_d, hi_d, 7):
        for m in (0.0, 0.3, 0.6, 0.85):
            c = float(np.sum(resid((d, m)) ** 2))
            if best is None or c < best[0]:
                best = (c, d, m)
    sol = least_squares(resid, x0=[best[1], best[2]], bounds=([lo_d, 0.0], [hi_d, 0.9]), diff_step=1e-3)
    err = resid(sol.x)
    return WorkloadProfile(name, float(sol.x[0]), float(sol.x[1]), float(np.sqrt(np.mean(err ** 2))), source)


@functools.lru_cache(maxsize=8)
def zeus_profiles(model: str, data_dir: str) -> tuple[WorkloadProfile, ...]:
    """One profile per power-sensitive Zeus workload (A40 and V100 traces), scaled to ``model``.

    Raises UserInputError when the trace directory or files are missing.
    """
    from capctl.allocator.curves import DATA_DIR_ENV, concave_start_w, load_zeus_traces, power_sensitive
    from capctl.simgpu.profiles import get as get_profile

    prof = get_profile(model)
    d = Path(data_dir)
    files = sorted(d.glob("summary_power_*.csv"))
    if not files:
        raise UserInputError(
            f"workload.curves: zeus needs the Zeus traces in {d} (summary_power_*.csv); they are not there. "
            f"Set {DATA_DIR_ENV}=DIR to the directory that holds zeus-power-traces/ (without it, "
            "../shared/data is looked for beside the working directory), or use curves: default")
    out = []
    for f in files:
        traces = power_sensitive(load_zeus_traces(f))
        if not traces:
            continue
        lo_src = float(min(c.min() for c, _ in traces.values()))
        hi_src = float(max(c.max() for c, _ in traces.values()))
        start = concave_start_w(traces)
        scale = (prof.max_limit_w - prof.min_limit_w) / (hi_src - lo_src)
        for key in sorted(traces):
            caps, rel = traces[key]
            keep = caps >= start
            if np.count_nonzero(keep) < 3:
                continue
            mapped = prof.min_limit_w + (caps[keep] - lo_src) * scale
            r = rel[keep] / rel[keep][np.argmax(caps[keep])] if rel[keep][np.argmax(caps[keep])] > 0 else rel[keep]
            gpu = f.stem.replace("summary_power_", "")
            out.append(fit_profile(model, mapped, np.minimum(r, 1.0), f"{gpu}:{'/'.join(key)}",
                                   f"Zeus {f.name} {'/'.join(key)}, caps [{lo_src:g}, {hi_src:g}] W -> "
                                   f"[{prof.min_limit_w:g}, {prof.max_limit_w:g}] W"))
    if not out:
        raise UserInputError(f"workload.curves: zeus: no power-sensitive workload found in {d}")
    return tuple(out)


@functools.lru_cache(maxsize=8)
def default_profiles(model: str) -> tuple[WorkloadProfile, ...]:
    """One profile fitted to the allocator's shipped default curve of ``model``'s family."""
    from coordinator.models import prior_curve
    from capctl.simgpu.profiles import get as get_profile

    prof = get_profile(model)
    curve = prior_curve(prof.nvml_name, prof.min_limit_w, prof.max_limit_w)
    caps = np.linspace(max(curve.valid_min_w, prof.min_limit_w), prof.max_limit_w, 12)
    return (fit_profile(model, caps, curve.rate(caps), f"default:{model}", curve.source),)


def zeus_dir() -> Path:
    """``<repo>/../shared/data/zeus-power-traces`` (the allocator's :func:`zeus_data_dir`)."""
    from capctl.allocator.curves import zeus_data_dir

    return zeus_data_dir()


def profiles_for(spec) -> tuple[WorkloadProfile, ...]:
    """The workload profiles of a :class:`~capctl.sim.cluster.ClusterSpec`."""
    if spec.curves == "zeus":
        return zeus_profiles(spec.gpu_model, str(zeus_dir()))
    return default_profiles(spec.gpu_model)


def make_jobs(spec, profiles, rng: np.random.Generator) -> list[Job]:
    """The job timeline of ``spec`` (deterministic for ``rng``'s seed).

    Jobs are node-granular (sizes are multiples of gpus_per_node). At t=0 the queue fills the
    cluster up to ``jobs.occupancy`` (first fit, backfilling smaller jobs); those jobs are already
    running, so their remaining time is a uniform fraction of their duration. Whenever a job ends,
    queued jobs that fit start (FIFO with backfill) while occupancy allows. Placement prefers
    contiguous free nodes (lowest index), else the lowest free nodes (a job may span racks).
    ``spec.fixed_jobs`` run first, on their named nodes from t = 0 for their full duration (they
    count toward the occupancy); the mix fills the other nodes.
    """
    mix = spec.jobs
    gpn = spec.gpus_per_node
    node_names = spec.node_names
    n_nodes = len(node_names)
    cap_nodes = max(1, int(math.floor(mix.occupancy * n_nodes + 1e-9)))
    sizes = np.array(mix.sizes_gpus) // gpn
    p = np.array(mix.size_weights) / np.sum(mix.size_weights)
    horizon = spec.duration_s
    queue = []
    counter = [0]

    def draw_profile():
        prof = profiles[int(rng.integers(len(profiles)))]
        if spec.demand_w is not None:  # the trace keeps the shape (m); the demand is the file's
            prof = replace(prof, demand_w=float(rng.uniform(*spec.demand_w)))
        return prof

    def new_job():
        counter[0] += 1
        k = counter[0] - 1
        size = int(sizes[rng.choice(sizes.size, p=p)])
        size = min(size, cap_nodes)
        dur = float(rng.uniform(*mix.duration_s))
        queue.append([f"job{k + 1:04d}", size, dur, draw_profile()])

    free = np.ones(n_nodes, bool)
    used = 0
    running = []  # (end_s, node indices, job)
    jobs: list[Job] = []

    def place(size):
        for start in range(0, n_nodes - size + 1):
            if free[start:start + size].all():
                return np.arange(start, start + size)
        idx = np.nonzero(free)[0]
        return idx[:size] if idx.size >= size else None

    def start_jobs(t, first):
        nonlocal used
        i = 0
        scanned = 0
        while scanned < 64:
            if i >= len(queue):
                new_job()
            jid, size, dur, prof = queue[i]
            scanned += 1
            if used + size <= cap_nodes:
                where = place(size)
                if where is not None:
                    queue.pop(i)
                    free[where] = False
                    used += size
                    remaining = dur * float(rng.uniform(0.05, 1.0)) if first else dur
                    end = t + remaining
                    gidx = (where[:, None] * gpn + np.arange(gpn)[None, :]).ravel()
                    job = Job(jid, tuple(node_names[k] for k in where), gidx, t, end, prof)
                    jobs.append(job)
                    running.append((end, where, job))
                    continue
            i += 1
            if used >= cap_nodes:
                break

    index_of = {n: k for k, n in enumerate(node_names)}
    for fx in getattr(spec, "fixed_jobs", ()):  # on their own nodes from t = 0, for their full duration
        counter[0] += 1
        where = np.array([index_of[n] for n in fx.nodes], dtype=np.int64)
        free[where] = False
        used += where.size
        gidx = (where[:, None] * gpn + np.arange(gpn)[None, :]).ravel()
        job = Job(f"job{counter[0]:04d}", tuple(fx.nodes), gidx, 0.0, fx.duration_s, draw_profile())
        jobs.append(job)
        running.append((fx.duration_s, where, job))
    start_jobs(0.0, True)
    guard = 0
    while running and guard < 100_000:
        guard += 1
        running.sort(key=lambda x: x[0])
        end, where, _job = running.pop(0)
        if end >= horizon:
            break
        free[where] = True
        used -= where.size
        start_jobs(end, False)
    jobs.sort(key=lambda j: (j.start_s, j.job_id))
    return jobs
