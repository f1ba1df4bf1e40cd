"""Solver inputs of two idle nodes under two PDUs (the admin try-out's cluster), for the idle-rule tests."""

from __future__ import annotations

import math

from capctl.allocator.curves import DEFAULT_CURVES
from coordinator import allocation


def two_idle_nodes(limit_a_w: float = 1700.0) -> allocation.SolveInputs:
    """No jobs; budget 3,600 W; pdu-a ``limit_a_w`` (W) over n1's 4 GPUs, pdu-b 2,200 W over n2's 4;
    every GPU 200-700 W at 200 W with a 700 W pre-job limit (``idle_target_w``)."""
    domains = [{"name": "c", "parent": None, "limit_w": 3600.0, "kind": "cluster"},
               {"name": "pdu-a", "parent": "c", "limit_w": limit_a_w, "kind": "pdu"},
               {"name": "pdu-b", "parent": "c", "limit_w": 2200.0, "kind": "pdu"},
               {"name": "node:n1", "parent": "pdu-a", "limit_w": None, "kind": "node"},
               {"name": "node:n2", "parent": "pdu-b", "limit_w": None, "kind": "node"}]
    gpus, members = [], {"c": set(), "pdu-a": set(), "pdu-b": set(), "node:n1": set(), "node:n2": set()}
    for node, pdu in (("n1", "pdu-a"), ("n2", "pdu-b")):
        for i in range(4):
            key = (node, i)
            for d in ("c", pdu, f"node:{node}"):
                members[d].add(key)
            gpus.append(allocation.GpuInput(key, f"node:{node}", 200.0, 700.0, False, 200.0, 200.0, None,
                                            DEFAULT_CURVES["H100"], math.inf, 200.0, idle_target_w=700.0))
    return allocation.SolveInputs(gpus=gpus, jobs={}, domains=domains, objective="proportional", slew_w=None,
                                  node_domain={}, domain_members={k: frozenset(v) for k, v in members.items()})
