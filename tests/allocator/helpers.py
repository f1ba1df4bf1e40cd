"""Instance builders and exact feasibility checks for allocator tests."""

from __future__ import annotations

import numpy as np

from capctl.allocator.problem import AllocationProblem
from capctl.allocator._core import ancestors


def small_cluster(*, n_nodes=4, gpus_per_node=4, nodes_per_rack=2, jobs=None, cluster_w=None,
                  rack_w=None, node_w=None, ceilings=None, speeds=None, weights=None,
                  objective="proportional", model="A40", idle_cap_w=None, slew_w=None, prev=None):
    """Cluster -> racks -> nodes; ``jobs``: list giving each GPU's job name or None."""
    G = n_nodes * gpus_per_node
    n_racks = -(-n_nodes // nodes_per_rack)
    domains = [{"name": "cluster", "parent": None, "limit_w": cluster_w, "kind": "cluster"}]
    domains += [{"name": f"rack{r}", "parent": "cluster", "limit_w": rack_w, "kind": "rack"} for r in range(n_racks)]
    domains += [{"name": f"node{n}", "parent": f"rack{n // nodes_per_rack}", "limit_w": node_w, "kind": "node"}
                for n in range(n_nodes)]
    jobs = jobs if jobs is not None else [None] * G
    names = sorted({j for j in jobs if j is not None})
    weights = weights or {}
    gpus = []
    for g in range(G):
        gpus.append({"name": f"n{g // gpus_per_node}g{g % gpus_per_node}", "domain": f"node{g // gpus_per_node}",
                     "min_cap_w": 100.0, "max_cap_w": 300.0, "model": model, "job": jobs[g],
                     "thermal_ceiling_w": None if ceilings is None else ceilings[g],
                     "speed": 1.0 if speeds is None else speeds[g],
                     "prev_cap_w": None if prev is None else prev[g]})
    return AllocationProblem.build(gpus=gpus, jobs={n: weights.get(n, 1.0) for n in names}, domains=domains,
                                   objective=objective, idle_cap_w=idle_cap_w, slew_w=slew_w)


def assert_exactly_feasible(pb: AllocationProblem, res) -> None:
    """Every finite domain sum <= limit (floats) unless in deficit; caps in bounds; whole mW."""
    cap = res.cap_w
    assert cap.shape == (pb.n_gpus,)
    assert np.all(np.abs(np.round(cap * 1000) - cap * 1000) < 1e-6), "caps must be whole milliwatts"
    assert np.all(cap >= pb.min_cap_w), "cap below device minimum"
    hi = np.maximum(np.minimum(pb.max_cap_w, pb.thermal_ceiling_w), pb.min_cap_w)
    assert np.all(cap <= hi), "cap above min(max, ceiling)"
    pd, pg = ancestors(pb)
    for d in range(pb.n_domains):
        s = float(np.sum(cap[pg[pd == d]]))
        if res.domain_deficit_w[d] > 0:
            assert not res.feasible
            continue
        assert s <= pb.domain_limit_w[d], f"domain {d}: {s} > {pb.domain_limit_w[d]}"
