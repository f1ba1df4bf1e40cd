"""The simulated cluster's static layout: GPUs, nodes, racks and the policy's power domains.

GPU ``g`` of the simulation is GPU ``g % gpus_per_node`` of node ``g // gpus_per_node`` (nodes in
the cluster file's order). Power domains are the policy's tree (root limit = ``budget_w``) plus
one node domain per node, built by the coordinator's own
:func:`coordinator.allocation.build_domains`, so the simulator and the coordinator see the
same tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capctl.errors import UserInputError


@dataclass
class Topology:
    """Static arrays (G GPUs, D domains); watts."""

    node_names: tuple[str, ...]
    gpus_per_node: int
    node_of_gpu: np.ndarray          # [G] node index
    rack_of_gpu: np.ndarray          # [G] rack index
    rack_names: tuple[str, ...]
    min_cap_w: np.ndarray            # [G] device limit constraints
    max_cap_w: np.ndarray
    domains: list[dict]              # allocator domain dicts (name, parent, limit_w, kind)
    domain_parent: np.ndarray        # [D]
    domain_limit_w: np.ndarray       # [D] (+inf none)
    domain_of_gpu: np.ndarray        # [G] leaf (node) domain
    domain_members: list[np.ndarray]  # [D] GPU indices below each domain
    node_domain: dict[str, str]

    @property
    def n_gpus(self) -> int:
        return int(self.node_of_gpu.size)

    def keys(self) -> list[tuple[str, int]]:
        """Coordinator GPU keys ``(node, index)`` in simulation order."""
        g = self.gpus_per_node
        return [(self.node_names[i // g], i % g) for i in range(self.n_gpus)]

    def limited_domains(self):
        """(name, limit_w, member GPU indices) of every domain with a finite limit, root first."""
        return [(self.domains[d]["name"], float(self.domain_limit_w[d]), self.domain_members[d])
                for d in range(len(self.domains)) if np.isfinite(self.domain_limit_w[d])]


def _more(names: list) -> str:
    """`` (and N more)`` after the first of ``names`` when there are others, else ""."""
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def build_topology(spec, policy, min_cap_w: float, max_cap_w: float) -> Topology:
    """Match the cluster file's nodes against the policy's domains and build the arrays.

    Raises UserInputError when a cluster node is in no domain of the policy, or a policy node is
    not in the cluster (the scenario would not describe the policy's cluster).
    """
    from coordinator.allocation import build_domains

    names = spec.node_names
    missing = [n for n in names if not policy.has_node(n)]
    if missing:
        raise UserInputError(
            f"{spec.source}: node {missing[0]!r}{_more(missing)} is in no domain of the policy "
            f"{policy.source}; the policy must list every node of the cluster")
    extra = [n for n in policy.domains.all_nodes() if n not in set(names)]
    if extra:
        raise UserInputError(
            f"{policy.source}: node {extra[0]!r}{_more(extra)} is not in the cluster file "
            f"{spec.source}; both files must describe the same nodes")
    _same_gpus(spec, policy)
    gpn = spec.gpus_per_node
    G = len(names) * gpn
    node_of = np.repeat(np.arange(len(names)), gpn)
    rack_index = {}
    for ri, r in enumerate(spec.racks):
        for n in r.nodes:
            rack_index[n] = ri
    rack_of = np.array([rack_index[names[k]] for k in node_of], dtype=np.int64)
    domains, node_domain = build_domains(policy, list(names))
    index = {d["name"]: i for i, d in enumerate(domains)}
    parent = np.array([-1 if d["parent"] is None else index[d["parent"]] for d in domains], dtype=np.int64)
    limit = np.array([np.inf if d["limit_w"] is None else float(d["limit_w"]) for d in domains])
    leaf_of_node = np.array([index[node_domain[n]] for n in names], dtype=np.int64)
    dom_of = leaf_of_node[node_of]
    members: list[list[int]] = [[] for _ in domains]
    for g in range(G):
        d = int(dom_of[g])
        while d >= 0:
            members[d].append(g)
            d = int(parent[d])
    _feasible(spec, policy, domains, members, float(min_cap_w))
    return Topology(
        node_names=tuple(names), gpus_per_node=gpn, node_of_gpu=node_of, rack_of_gpu=rack_of,
        rack_names=tuple(r.name for r in spec.racks), min_cap_w=np.full(G, float(min_cap_w)),
        max_cap_w=np.full(G, float(max_cap_w)), domains=domains, domain_parent=parent,
        domain_limit_w=limit, domain_of_gpu=dom_of,
        domain_members=[np.array(m, dtype=np.int64) for m in members], node_domain=node_domain,
    )


def _same_gpus(spec, policy) -> None:
    """Raise UserInputError when a domain of the policy names another GPU model or GPU count per
    node than the cluster file (the policy's checks, such as its sum of minimum caps, would be
    about other GPUs than the simulated ones)."""
    from capctl.policy.devices import canonical_model

    for d in policy.domains.walk():
        for field, theirs, ours in (("gpu_model", d.gpu_model, spec.gpu_model),
                                    ("gpus_per_node", d.gpus_per_node, spec.gpus_per_node)):
            same = theirs == ours or (field == "gpu_model" and canonical_model(theirs) == ours)
            if theirs is not None and not same:
                raise UserInputError(
                    f"{policy.source}: domain {d.name!r} {field} {theirs!r} does not match the cluster file "
                    f"{spec.source}: {field} {ours!r}; allowed: the cluster file's value, or leave it out")


def _feasible(spec, policy, domains: list[dict], members: list[list[int]], min_cap_w: float) -> None:
    """Raise UserInputError when a limit (the budget for the root, ``limit_w`` below it) is below
    the sum of its GPUs' minimum caps (``min_cap_w`` W each: the cluster's model): every policy
    would exceed it whatever it does (found by a try-out: 2,200 W over a PDU, shown as never over)."""
    for d, dom in enumerate(domains):
        if dom["limit_w"] is None:
            continue
        limit_w, n = float(dom["limit_w"]), len(members[d])
        need_w = n * min_cap_w
        if need_w > limit_w + 1e-9:
            field = "budget_w" if dom["parent"] is None else f"domain {dom['name']!r} limit_w"
            raise UserInputError(
                f"{policy.source}: {field} {limit_w:g} W is below the minimum caps of its {n} GPUs "
                f"({n} x {min_cap_w:g} W = {need_w:g} W, {spec.gpu_model} from the cluster file {spec.source}); "
                f"allowed: at least {need_w:g} W")


def fit_to_domains(caps_w: np.ndarray, floor_w: np.ndarray, topo: Topology, passes: int = 8) -> np.ndarray:
    """Lower ``caps_w`` toward ``floor_w`` (proportionally to each GPU's room) wherever a domain's
    sum exceeds its limit; root first, repeated ``passes`` times. Returns a new array (W), floored
    to whole milliwatts. Used by the baselines so that they respect the same budget and limits."""
    caps = np.array(caps_w, float)
    for _ in range(passes):
        changed = False
        for _name, limit, idx in topo.limited_domains():
            total = caps[idx].sum()
            if total <= limit:
                continue
            room = (caps[idx] - floor_w[idx]).sum()
            if room <= 0:
                continue
            ratio = max(0.0, 1.0 - (total - limit) / room)
            caps[idx] = floor_w[idx] + (caps[idx] - floor_w[idx]) * ratio
            changed = True
        caps = np.floor(caps * 1000.0) / 1000.0
        if not changed:
            break
    return caps
