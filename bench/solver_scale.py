"""Allocator scaling benchmark (issue 3): fast path vs cvxpy/Clarabel reference.

Sizes 1k, 8k, 32k, 100k GPUs: 8 GPUs per node, 32 nodes per rack, jobs of 8-1024 GPUs, thermal
ceilings from the RC model with a realistic spread (capctl.allocator.synthetic). Cluster limit 35 %
and rack limits 45 % of maximum draw, so cluster and rack constraints bind. Per size: fast-path
time (best of 3 runs), reference time (skipped above 8k GPUs, where Clarabel would exceed 60 s), relative objective
gap, largest constraint violation [W] (domain sums over limits and caps outside their bounds;
<= 0 means feasible). Last line: one JSON object. Goal (issue 3): 100k GPUs in <= 0.5 s.
Usage: python bench/solver_scale.py [sizes...]
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from capctl.allocator._core import ancestors
from capctl.allocator.fast import solve
from capctl.allocator.reference import ReferenceSolveError, solve_reference
from capctl.allocator.synthetic import synthetic_cluster

REFERENCE_MAX_GPUS = 8000
FAST_REPEATS = 3


def violation_w(pb, res):
    pd, pg = ancestors(pb)
    load = np.bincount(pd, res.cap_w[pg], minlength=pb.n_domains)
    over = np.where(res.domain_deficit_w > 0, -np.inf, load - pb.domain_limit_w)
    hi = np.maximum(np.minimum(pb.max_cap_w, pb.thermal_ceiling_w), pb.min_cap_w)
    bounds = np.concatenate([pb.min_cap_w - res.cap_w, res.cap_w - hi])
    return float(max(np.max(over, initial=-np.inf), np.max(bounds, initial=-np.inf)))


def main(sizes):
    rows = []
    for n in sizes:
        pb = synthetic_cluster(n, seed=1, cluster_frac=0.35, rack_frac=0.45)
        t_fast = float("inf")
        for _ in range(FAST_REPEATS):  # best of a few: the figure is the solver, not the machine's load
            t = time.perf_counter()
            fast = solve(pb)
            t_fast = min(t_fast, time.perf_counter() - t)
        row = {"gpus": pb.n_gpus, "jobs": pb.n_jobs, "domains": pb.n_domains, "fast_s": round(t_fast, 4),
               "fast_iterations": fast.iterations, "fast_violation_w": violation_w(pb, fast),
               "reference_s": None, "rel_gap": None, "reference_violation_w": None}
        if pb.n_gpus <= REFERENCE_MAX_GPUS:
            t = time.perf_counter()
            try:
                ref = solve_reference(pb)
                row["reference_s"] = round(time.perf_counter() - t, 4)
                row["rel_gap"] = abs(fast.objective_value - ref.objective_value) / max(1.0, abs(ref.objective_value))
                row["reference_violation_w"] = violation_w(pb, ref)
            except ReferenceSolveError as exc:
                row["reference_s"] = f"failed: {exc}"[:60]
        print(f"{row['gpus']:>7} GPUs {row['jobs']:>4} jobs: fast {row['fast_s']:.3f} s ({row['fast_iterations']} it), "
              f"reference {row['reference_s'] if row['reference_s'] is not None else 'skipped (>60 s)'}, "
              f"gap {row['rel_gap']}, max violation fast {row['fast_violation_w']:.3f} W "
              f"ref {row['reference_violation_w']}", flush=True)
        rows.append(row)
    print(json.dumps({"bench": "solver_scale", "goal_100k_s": 0.5, "sizes": rows}))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1000, 8000, 32000, 100000])
