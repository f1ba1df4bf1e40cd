"""The plan messages built from the per-node cache of serialized failsafe caps
(coordinator/planmsg.py) equal the ones built field by field, whatever the sequence of plans."""

from __future__ import annotations

import random

import pytest

from capctl.v1 import capctl_pb2 as pb
from coordinator import planmsg


def _direct(caps, safe, **fields):
    return pb.CoordinatorMessage(plan=pb.CapPlan(
        caps=[pb.CapAssignment(index=i, cap_w=c) for i, c in sorted(caps.items())],
        safe_caps=[pb.CapAssignment(index=i, cap_w=c) for i, c in sorted(safe.items())], **fields))


def test_cached_plans_equal_direct_ones():
    rng = random.Random(3)
    cache = planmsg.SafeCapsCache(max_nodes=3)
    nodes = [f"n{i}" for i in range(5)]
    last_safe = {}
    hits = 0
    for seq in range(1, 400):
        node = rng.choice(nodes)
        if node in last_safe and rng.random() < 0.6:
            safe = dict(last_safe[node])  # unchanged failsafe caps: the cached part
            hits += 1
        else:
            safe = {i: float(rng.choice([200, 350.5, 700])) for i in rng.sample(range(8), rng.randint(0, 8))}
        last_safe[node] = safe
        caps = {i: rng.uniform(200, 700) for i in rng.sample(range(8), rng.randint(0, 3))}
        fields = dict(seq=seq, phase=rng.choice(["hold", "decrease", "increase"]), lease_expiry_s=1e9 + seq,
                      lease_s=10.0, dry_run=rng.random() < 0.1, term=rng.choice([0, 7]), snapshot_time_s=seq * 1.5)
        got = planmsg.cap_plan(cache, node, caps, safe, **fields)
        want = _direct(caps, safe, **fields)
        assert got == want
        assert got.SerializeToString() == want.SerializeToString()
        assert got.WhichOneof("body") == "plan"
    assert hits > 50
    assert len(cache._by_node) <= 3  # bounded


def test_cached_part_is_not_shared_between_messages():
    cache = planmsg.SafeCapsCache()
    a = planmsg.cap_plan(cache, "n1", {0: 300.0}, {0: 250.0}, seq=1, phase="decrease")
    b = planmsg.cap_plan(cache, "n1", {}, {0: 250.0}, seq=2, phase="hold")
    assert list(a.plan.caps) == [pb.CapAssignment(index=0, cap_w=300.0)] and not b.plan.caps
    assert (a.plan.seq, b.plan.seq) == (1, 2)


def test_bad_field_raises():
    with pytest.raises((AttributeError, TypeError, ValueError)):
        planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", {}, {}, no_such_field=1)
