"""An idle GPU is raised only with headroom that held (coordinator/idlegrants.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from capctl.allocator.curves import DEFAULT_CURVES
from coordinator import allocation
from coordinator.idlegrants import RAISE_INTERVALS, IdleGrants


def test_the_lowest_grant_of_the_last_intervals_and_a_gpu_not_idle_forgets():
    g = IdleGrants()
    keys = (("n1", 0), ("n1", 1), ("n2", 0))
    assert np.isinf(g.recent(keys)).all()  # no history: a job just ended, its grant applies at once
    g.record({("n1", 0): 600.0, ("n1", 1): 300.0})
    g.record({("n1", 0): 450.0, ("n1", 1): 500.0})
    assert g.recent(keys).tolist() == [450.0, 300.0, math.inf]
    g.record({("n1", 0): 700.0})  # n1/1 busy now: its history is gone
    assert g.recent(keys).tolist() == [450.0 if RAISE_INTERVALS >= 3 else 700.0, math.inf, math.inf]
    g.record({("n1", 0): 700.0})
    g.record({("n1", 0): 700.0})
    assert g.recent(keys).tolist()[0] == 700.0  # the headroom held: the raise goes through
    off = IdleGrants(raise_intervals=1)
    off.record({("n1", 0): 600.0})
    assert np.isinf(off.recent(keys)).all()


def _two_idle_nodes(limit_a_w: float = 1700.0):
    """Budget 3,600 W; pdu-a 1,700 W over n1's 4 idle GPUs, pdu-b 2,200 W over n2's 4 idle GPUs;
    pre-job limits 700 W (tests/coordinator/test_model_arrays.py's cluster)."""
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


def test_a_raise_waits_until_the_headroom_held_and_a_cut_applies_at_once():
    grants = IdleGrants()
    caps = []
    # the headroom of pdu-a as the running jobs elsewhere leave it: n1's 4 GPUs may have 1,700 W,
    # then 1,000 W for one interval, then 1,700 W again (a solve's transient)
    for limit_a in (1700.0, 1000.0, 1700.0, 1700.0, 1700.0):
        inputs = _two_idle_nodes(limit_a)
        cols = allocation.columns_of(inputs)
        cols.idle_recent_w = grants.recent(cols.keys)
        desired = {g.key: 200.0 for g in inputs.gpus}  # the solve sees idle GPUs at their minimum cap
        raw = allocation.idle_from_headroom(inputs, desired)
        grants.record(raw)
        n1 = sum(v for k, v in desired.items() if k[0] == "n1")
        assert n1 <= limit_a + 1e-6  # never over a limit, whatever the history
        caps.append(round(n1, 1))
        assert sorted(raw) == [g.key for g in inputs.gpus] and all(200.0 < w <= 700.0 for w in raw.values())
    # at once (no history), cut at once, then up again only once 1,700 W held for RAISE_INTERVALS
    assert caps[:2] == [1700.0, 1000.0], caps
    assert caps[2:] == [1000.0] * (RAISE_INTERVALS - 1) + [1700.0] * (3 - (RAISE_INTERVALS - 1)), caps


def test_without_history_the_rule_is_the_one_without_memory():
    inputs = _two_idle_nodes()
    a, b = {g.key: 200.0 for g in inputs.gpus}, {g.key: 200.0 for g in inputs.gpus}
    allocation.columns_of(inputs).idle_recent_w = None
    allocation.idle_from_headroom(inputs, a)
    allocation.columns_of(inputs).idle_recent_w = np.full(len(inputs.gpus), math.inf)
    allocation.idle_from_headroom(inputs, b)
    assert a == pytest.approx(b) and sum(a.values()) == pytest.approx(3600.0, abs=0.1)
