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
    plan = _Planner(spec, profiles, rng)
    for fx in getattr(spec, "fixed_jobs", ()):  # on their own nodes from t = 0, for their full duration
        plan.start_fixed(fx)
    plan.start_jobs(0.0, True)
    plan.run_until(spec.duration_s)
    jobs = plan.jobs
    jobs.sort(key=lambda j: (j.start_s, j.job_id))
    return jobs


def _gpu_indices(where: np.ndarray, gpn: int) -> np.ndarray:
    """The GPU indices (simulation order) of node indices ``where``, ``gpn`` GPUs per node."""
    return (where[:, None] * gpn + np.arange(gpn)[None, :]).ravel()


class _Planner:
    """The state of :func:`make_jobs` while it builds the timeline: the queue of drawn jobs
    (``[job id, nodes, duration s, profile]``), the free nodes and how many are used (of
    ``cap_nodes`` allowed by the occupancy), the running jobs (``(end s, node indices, job)``)
    and every job started so far. All draws come from ``rng``, in the order of the calls."""

    def __init__(self, spec, profiles, rng: np.random.Generator) -> None:
        mix = spec.jobs
        self.spec = spec
        self.profiles = profiles
        self.rng = rng
        self.mix = mix
        self.gpn = spec.gpus_per_node
        self.node_names = spec.node_names
        self.n_nodes = len(self.node_names)
        self.cap_nodes = max(1, int(math.floor(mix.occupancy * self.n_nodes + 1e-9)))
        self.sizes = np.array(mix.sizes_gpus) // self.gpn
        self.p = np.array(mix.size_weights) / np.sum(mix.size_weights)
        self.queue: list = []
        self.counter = 0
        self.free = np.ones(self.n_nodes, bool)
        self.used = 0
        self.running: list = []
        self.jobs: list[Job] = []
        self.index_of = {n: k for k, n in enumerate(self.node_names)}

    def draw_profile(self) -> WorkloadProfile:
        """A job's workload: one of the profiles, with a demand (W) drawn from ``spec.demand_w`` if set."""
        prof = self.profiles[int(self.rng.integers(len(self.profiles)))]
        if self.spec.demand_w is not None:  # the trace keeps the shape (m); the demand is the file's
            prof = replace(prof, demand_w=float(self.rng.uniform(*self.spec.demand_w)))
        return prof

    def new_job(self) -> None:
        """Draw the next job of the mix (size in nodes, duration in s, workload) onto the queue."""
        self.counter += 1
        k = self.counter - 1
        size = int(self.sizes[self.rng.choice(self.sizes.size, p=self.p)])
        size = min(size, self.cap_nodes)
        dur = float(self.rng.uniform(*self.mix.duration_s))
        self.queue.append([f"job{k + 1:04d}", size, dur, self.draw_profile()])

    def place(self, size: int) -> np.ndarray | None:
        """Node indices for a job of ``size`` nodes: the lowest contiguous free ones, else the
        lowest free ones; None when fewer are free."""
        n_nodes, free = self.n_nodes, self.free
        for start in range(0, n_nodes - size + 1):
            if free[start:start + size].all():
                return np.arange(start, start + size)
        idx = np.nonzero(free)[0]
        return idx[:size] if idx.size >= size else None

    def run_until(self, horizon: float) -> None:
        """End the running jobs in order of their end (s), starting queued ones on the freed nodes,
        until the first end at or after ``horizon`` (s)."""
        guard = 0
        while self.running and guard < 100_000:
            guard += 1
            self.running.sort(key=lambda x: x[0])
            end, where, _job = self.running.pop(0)
            if end >= horizon:
                break
            self.free[where] = True
            self.used -= where.size
            self.start_jobs(end, False)

    def start_fixed(self, fx) -> None:
        """Start fixed job ``fx`` on its own nodes at t = 0 for its full duration (s)."""
        self.counter += 1
        where = np.array([self.index_of[n] for n in fx.nodes], dtype=np.int64)
        self.free[where] = False
        self.used += where.size
        gidx = _gpu_indices(where, self.gpn)
        job = Job(f"job{self.counter:04d}", tuple(fx.nodes), gidx, 0.0, fx.duration_s, self.draw_profile())
        self.jobs.append(job)
        self.running.append((fx.duration_s, where, job))

    def start_jobs(self, t: float, first: bool) -> None:
        """Start queued jobs at ``t`` (s) that fit (FIFO with backfill, at most 64 looked at) while
        the occupancy allows, drawing new jobs when the queue runs out. ``first``: the jobs at
        t = 0, already running (their remaining time a uniform fraction of their duration)."""
        i = 0
        scanned = 0
        while scanned < 64:
            if i >= len(self.queue):
                self.new_job()
            size = self.queue[i][1]
            scanned += 1
            if self.used + size <= self.cap_nodes:
                where = self.place(size)
                if where is not None:
                    self._start(i, where, t, first)
                    continue
            i += 1
            if self.used >= self.cap_nodes:
                break

    def _start(self, i: int, where: np.ndarray, t: float, first: bool) -> None:
        """Start queued job ``i`` at ``t`` (s) on node indices ``where`` (see :meth:`start_jobs`)."""
        jid, size, dur, prof = self.queue.pop(i)
        self.free[where] = False
        self.used += size
        remaining = dur * float(self.rng.uniform(0.05, 1.0)) if first else dur
        end = t + remaining
        gidx = _gpu_indices(where, self.gpn)
        job = Job(jid, tuple(self.node_names[k] for k in where), gidx, t, end, prof)
        self.jobs.append(job)
        self.running.append((end, where, job))
