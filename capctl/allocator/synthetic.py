"""Synthetic clusters for tests, benchmarks and what-if runs (deterministic given a seed).

``synthetic_cluster(n_gpus, seed, ...)`` -> AllocationProblem: 8 GPUs per node, 32 nodes per
rack, racks under one cluster domain; jobs of 8-1024 GPUs (log-uniform, node-aligned) filling
``busy_fraction`` of the GPUs; H100 curves with per-GPU jitter; speeds ~N(1, 0.08) clipped to
[0.8, 1.2] (Sinha et al. SC'22 spread); thermal ceilings from the RC model with inlet
22-32 °C, R 0.06-0.10 °C/W, tau 20-60 s, current temperatures 45-85 °C, slowdown 87 °C, margin
3 °C (the hot tail gets ceilings inside or below the cap range). Limits: node 8*max*node_frac,
rack and cluster fractions of their maximum draw.
"""

from __future__ import annotations

import numpy as np

from .curves import DEFAULT_CURVES
from .problem import AllocationProblem
from .thermal import thermal_ceiling_w

__all__ = ["synthetic_cluster"]


def synthetic_cluster(n_gpus: int, seed: int = 0, *, gpus_per_node: int = 8, nodes_per_rack: int = 32,
                      busy_fraction: float = 0.9, cluster_frac: float = 0.7, rack_frac: float = 0.85,
                      node_frac: float = 1.0, objective: str = "proportional",
                      min_job: int = 8, max_job: int = 1024) -> AllocationProblem:
    rng = np.random.default_rng(seed)
    n_nodes = max(1, n_gpus // gpus_per_node)
    G = n_nodes * gpus_per_node
    n_racks = -(-n_nodes // nodes_per_rack)
    c = DEFAULT_CURVES["H100"]
    mn, mx = 200.0, 700.0
    # domains: 0 cluster, 1..R racks, then nodes
    parent = np.concatenate([[-1], np.zeros(n_racks, np.int64),
                             1 + np.arange(n_nodes) // nodes_per_rack]).astype(np.int64)
    node_dom = 1 + n_racks + np.arange(n_nodes)
    limit = np.concatenate([[cluster_frac * G * mx],
                            rack_frac * mx * gpus_per_node * np.bincount(np.arange(n_nodes) // nodes_per_rack),
                            np.full(n_nodes, node_frac * gpus_per_node * mx)])
    # jobs: node-aligned, sizes log-uniform in [min_job, max_job]
    job_of = np.full(G, -1, np.int64)
    start, j = 0, 0
    target = int(busy_fraction * G)
    sizes = []
    while start < target:
        size = int(2 ** rng.uniform(np.log2(min_job), np.log2(max_job)))
        size = max(gpus_per_node if min_job >= gpus_per_node else 1, size - size % min(gpus_per_node, min_job))
        size = min(size, target - start)
        if size <= 0:
            break
        job_of[start:start + size] = j
        sizes.append(size)
        start += size
        j += 1
    J = j
    temp = rng.uniform(45, 85, G)
    inlet = rng.uniform(22, 32, G)
    r = rng.uniform(0.06, 0.10, G)
    tau = rng.uniform(20, 60, G)
    ceiling = thermal_ceiling_w(temp, inlet, r, tau, 5.0, 87.0, 3.0)
    jitter = rng.uniform(0.9, 1.1, G)
    return AllocationProblem(
        min_cap_w=np.full(G, mn), max_cap_w=np.full(G, mx), thermal_ceiling_w=ceiling,
        curve_a=np.full(G, c.a) * rng.uniform(0.9, 1.1, G), curve_k_w=np.full(G, c.k_w) * jitter,
        curve_sat_w=np.minimum(c.sat_w * rng.uniform(0.85, 1.1, G), mx + 50),
        curve_min_w=np.full(G, c.valid_min_w), speed=np.clip(rng.normal(1, 0.08, G), 0.8, 1.2),
        job_of_gpu=job_of, prev_cap_w=np.full(G, np.nan), idle_cap_w=np.full(G, mn),
        domain_of_gpu=node_dom[np.arange(G) // gpus_per_node], job_weight=rng.choice([1.0, 2.0, 4.0], J),
        domain_parent=parent, domain_limit_w=limit, objective=objective,
        domain_names=tuple(["cluster"] + [f"rack{i}" for i in range(n_racks)] + [f"node{i}" for i in range(n_nodes)]),
        domain_kinds=tuple(["cluster"] + ["rack"] * n_racks + ["node"] * n_nodes),
    ).validate()
