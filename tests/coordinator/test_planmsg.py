"""The plan messages built from the per-node cache of serialized failsafe caps
(coordinator/planmsg.py) equal the ones built field by field, whatever the sequence of plans."""

from __future__ import annotations

import math
import random

import numpy as np
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


def _random_caps(rng, n_max=9):
    """Index -> W with indices across the varint sizes (0, < 128, >= 128, uint32 max) and caps
    across the values a plan may hold (> 0 and finite: the smallest double, ints, numpy scalars,
    1e300; 0.0 and -0.0 are refused, test_refused_caps_raise_before_anything_is_serialized)."""
    pool = [0, 1, 7, 127, 128, 300, 16_383, 16_384, 2**21, 2**32 - 1]
    out = {}
    for i in rng.sample(pool, rng.randint(0, min(n_max, len(pool)))):
        out[rng.choice([i, np.uint32(i), np.int64(i)]) if rng.random() < 0.2 else i] = rng.choice(
            [5e-324, 1, 200, rng.uniform(200, 700), np.float64(rng.uniform(200, 700)), np.float32(350.25),
             np.int64(400), 1e300])
    return out


def test_wire_written_assignments_equal_direct_ones_across_index_and_value_encodings():
    rng = random.Random(11)
    cache = planmsg.SafeCapsCache()
    for seq in range(1, 300):
        caps, safe = _random_caps(rng), _random_caps(rng)
        fields = dict(seq=seq, phase="increase", lease_expiry_s=2e9, lease_s=10.0, term=3)
        got = planmsg.cap_plan(cache, "n1", caps, safe, **fields)
        want = _direct(caps, safe, **fields)
        assert got == want, (caps, safe)
        assert got.SerializeToString() == want.SerializeToString()
        assert [(a.index, a.cap_w) for a in got.plan.caps] == [(int(i), float(c)) for i, c in sorted(caps.items())]


def test_an_empty_plan_is_still_a_plan():
    got = planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", {}, {})
    assert got.WhichOneof("body") == "plan" and got == _direct({}, {})
    assert got.SerializeToString() == b"\x12\x00"


@pytest.mark.parametrize("caps", [{-1: 300.0}, {2**32: 300.0}, {1.5: 300.0}, {"0": 300.0}])
def test_bad_indices_raise_like_protobuf(caps):
    with pytest.raises((TypeError, ValueError)) as direct:
        _direct(caps, {})
    with pytest.raises(direct.type):
        planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", caps, {})
    with pytest.raises(direct.type):
        planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", {}, caps)



REFUSED = [None, True, False, np.True_, "300", b"300", math.nan, np.float64(math.nan), math.inf, -math.inf,
           np.float32(math.inf), 0.0, -0.0, 0, -1, -250.0, np.float32(0.0), 10**400]


@pytest.mark.parametrize("bad", REFUSED, ids=lambda v: repr(v)[:24])
@pytest.mark.parametrize("field", ["caps", "safe_caps"])
def test_refused_caps_raise_before_anything_is_serialized(field, bad):
    """protobuf alone takes None as 0 W and True as 1 W: every cap that is not a finite real number
    > 0 W is refused with a ValueError naming the node, the field, the GPU index and the value,
    before a message is built or a failsafe part cached."""
    cache = planmsg.SafeCapsCache()
    good = {0: 300.0, 1: 310.0}
    bad_caps = {0: 300.0, 5: bad, 7: 320.0}
    caps, safe = (bad_caps, good) if field == "caps" else (good, bad_caps)
    with pytest.raises(ValueError) as err:
        planmsg.cap_plan(cache, "gpu-a01", caps, safe, seq=1, phase="increase")
    text = str(err.value)
    assert "'gpu-a01'" in text and f"{field} GPU 5" in text and "allowed: a finite int or float > 0 (W)" in text
    assert repr(bad)[:30] in text
    assert cache._by_node == {}  # nothing serialized, nothing cached
    # the node's cached failsafe part is neither replaced nor used by a refused plan
    kept = planmsg.cap_plan(cache, "gpu-a01", {}, good, seq=2, phase="hold")
    entry = cache._by_node["gpu-a01"]
    with pytest.raises(ValueError):
        planmsg.cap_plan(cache, "gpu-a01", caps, safe, seq=3, phase="increase")
    assert cache._by_node["gpu-a01"] is entry and kept == _direct({}, good, seq=2, phase="hold")


def test_a_bool_equal_to_a_cached_cap_is_still_refused():
    cache = planmsg.SafeCapsCache()
    planmsg.cap_plan(cache, "n1", {}, {0: 1.0})  # (1 W: a real number; the device limits are not checked here)
    with pytest.raises(ValueError, match=r"safe_caps GPU 0: cap_w True is not a number of watts \(a bool\)"):
        planmsg.cap_plan(cache, "n1", {}, {0: True})  # True == 1.0: the cache key alone would take it


@pytest.mark.parametrize("good", [300, np.int64(300), np.uint16(300), np.float64(300.5), np.float32(300.5),
                                  np.float16(300.0), 5e-324, 1e300], ids=repr)
def test_ints_and_numpy_reals_are_accepted(good):
    caps = {2: good}
    got = planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", caps, caps, seq=4)
    assert got == _direct(caps, caps, seq=4)
    assert [(a.index, a.cap_w) for a in got.plan.caps] == [(2, float(good))] == [
        (a.index, a.cap_w) for a in got.plan.safe_caps]


def test_packed_plans_carry_the_same_caps():
    """To an agent that reads packed plans: the caps and safe caps as packed rows
    (capctl.plancaps), decoding to exactly the dicts given; the scalar fields as the plain plan's;
    bad caps refused the same way."""
    import random

    from capctl import plancaps

    rng = random.Random(9)
    for seq in range(1, 200):
        caps = {i: rng.uniform(200, 700) for i in rng.sample(range(8), rng.randint(0, 8))}
        safe = {i: float(rng.choice([200, 350.5, 700])) for i in rng.sample(range(8), rng.randint(0, 8))}
        fields = dict(seq=seq, phase=rng.choice(["hold", "decrease"]), lease_expiry_s=1e9 + seq, lease_s=10.0,
                      term=rng.choice([0, 7]), snapshot_time_s=seq * 1.5)
        got = planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", caps, safe, packed=True, **fields)
        plain = planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", caps, safe, **fields)
        plan = pb.CoordinatorMessage.FromString(got.SerializeToString()).plan
        assert got.WhichOneof("body") == "plan" and not plan.caps and not plan.safe_caps
        assert plancaps.of_plan(plan) == (caps, safe, "") == plancaps.of_plan(plain.plan)
        assert (plan.seq, plan.phase, plan.term, plan.lease_s) == (seq, fields["phase"], fields["term"], 10.0)
    with pytest.raises(ValueError, match="cap_w nan"):
        planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", {0: math.nan}, {}, packed=True)


def test_bad_packed_plan_rows_are_named_and_apply_nothing():
    from capctl import plancaps

    plan = pb.CapPlan(seq=1, caps_rows=plancaps.pack({0: 300.0})[:-1])
    assert plancaps.of_plan(plan) == ({}, {}, "CapPlan.caps_rows: 11 bytes, not a whole number of 12-byte rows")
    plan = pb.CapPlan(seq=1, caps_rows=plancaps.pack({0: 300.0}), safe_caps_rows=plancaps.pack({0: 1.0}) * 65)
    assert plancaps.of_plan(plan) == ({}, {}, "CapPlan.safe_caps_rows: 65 caps, at most 64 allowed")
    both = pb.CapPlan(caps=[pb.CapAssignment(index=1, cap_w=250.0)], caps_rows=plancaps.pack({0: 300.0}))
    assert plancaps.of_plan(both) == ({}, {}, "CapPlan.caps_rows and CapPlan.caps both set: a coordinator sends one form")
    with pytest.raises(ValueError, match="packed caps"):  # as the per-GPU form: one except for both in send_plan
        planmsg.cap_plan(planmsg.SafeCapsCache(), "n1", {-1: 250.0}, {}, packed=True, seq=1)


def _field_by_field(caps, safe, **fields):
    """The packed plan built field by field (cap_plan's way)."""
    from capctl import plancaps

    msg = pb.CoordinatorMessage()
    msg.plan.SetInParent()
    for name, value in fields.items():
        setattr(msg.plan, name, value)
    if caps:
        msg.plan.caps_rows = plancaps.pack(caps)
    if safe:
        msg.plan.safe_caps_rows = plancaps.pack(safe)
    return msg


def test_packed_plans_equal_the_ones_built_field_by_field():
    """coordinator/planmsg.py makes the coordinator's packed plans in one constructor call: the
    message is the one built field by field, and serializes to the same bytes, across seq and
    term sizes (0 to 2^64 - 1), zeros and -0.0 in the times, phases of any length, up to 64 caps;
    values of other types give the same result or error."""
    rng = random.Random(5)
    for _ in range(3000):
        caps = {i: rng.uniform(1, 1e4) for i in rng.sample(range(64), rng.randint(0, 64 if rng.random() < 0.1 else 8))}
        safe = {i: rng.uniform(1, 1e4) for i in rng.sample(range(64), rng.randint(0, 8))}
        fields = dict(seq=rng.choice([0, 1, 127, 128, 300, 2**32, 2**64 - 1, rng.randrange(2**40)]),
                      phase=rng.choice(["", "hold", "decrease", "increase", "\u00e9" * 200]),
                      lease_expiry_s=rng.choice([0.0, -0.0, 1.7e9 + rng.random(), math.inf, math.nan]),
                      lease_s=rng.choice([0.0, 10.0, 1e-300]), dry_run=rng.random() < 0.5,
                      term=rng.choice([0, 1, 200, 2**63, 2**64 - 1]),
                      snapshot_time_s=rng.choice([0.0, -0.0, 1.7e9 + rng.random()]))
        want = _field_by_field(caps, safe, **fields).SerializeToString()
        got = planmsg.packed_plan("n1", caps, safe, **fields)
        assert got.SerializeToString() == want and got.WhichOneof("body") == "plan"
        assert planmsg.cap_plan(None, "n1", caps, safe, packed=True, **fields).SerializeToString() == want
        if not math.isnan(fields["lease_expiry_s"]):
            assert got == _field_by_field(caps, safe, **fields)
    other = dict(seq=np.int64(7), phase="hold", lease_expiry_s=5, lease_s=np.float64(10.0), dry_run=np.True_,
                 term=np.uint32(2), snapshot_time_s=1)  # not the coordinator's own types
    assert planmsg.packed_plan("n1", {0: 300.0}, {}, **other) == _field_by_field({0: 300.0}, {}, **other)
    for bad in (dict(seq=-1), dict(seq=2**64), dict(term=-1), dict(phase="\ud800"), dict(lease_s="10")):
        fields = dict(seq=1, phase="hold", lease_expiry_s=1.0, lease_s=10.0, dry_run=False, term=0,
                      snapshot_time_s=1.0) | bad
        with pytest.raises((TypeError, ValueError)) as direct:
            _field_by_field({}, {}, **fields)
        with pytest.raises(direct.type):
            planmsg.packed_plan("n1", {}, {}, **fields)
    with pytest.raises(ValueError, match="safe_caps GPU 3: cap_w True"):
        planmsg.packed_plan("n1", {}, {3: True}, 1, "hold", 1.0, 10.0, False, 0, 1.0)


def test_packed_rows_equal_each_nodes_own_check_and_pack():
    """planmsg.packed_rows (every node's failsafe caps checked and packed at once) gives, for each
    node it keeps, plancaps.pack of its caps, and keeps exactly the nodes whose caps check_caps
    takes with ascending indices (bad values: NaN, inf, 0, < 0, above the largest double; indices
    out of order, above uint32); values or indices of other types: nothing (each plan packs its own)."""
    from capctl import plancaps

    rng = random.Random(4)
    bad_values = [math.nan, math.inf, -math.inf, 0.0, -0.0, -5.0]
    for _ in range(300):
        by_node = {}
        for k in range(rng.randint(0, 12)):
            caps = {i: rng.uniform(100, 700) for i in sorted(rng.sample(range(16), rng.randint(0, 8)))}
            roll = rng.random()
            if caps and roll < 0.15:
                caps[rng.choice(list(caps))] = rng.choice(bad_values)
            elif len(caps) > 1 and roll < 0.25:
                caps = dict(reversed(list(caps.items())))  # indices out of order
            elif roll < 0.28:
                caps[2**32 + rng.randint(0, 5)] = 300.0
            by_node[f"n{k}"] = caps
        got = planmsg.packed_rows(by_node)
        for node, caps in by_node.items():
            ascending = list(caps) == sorted(caps)
            try:
                planmsg.check_caps(node, "safe_caps", caps)
                want = plancaps.pack(caps)
            except ValueError:
                want = None
            if want is not None and ascending:
                assert got[node] == want
            else:
                assert node not in got
    assert planmsg.packed_rows({"a": {0: 300.0}, "b": {0: np.float64(300.0)}}) == {}
    assert planmsg.packed_rows({"a": {0: 300.0}, "b": {True: 300.0}}) == {}
    assert planmsg.packed_rows({"a": {0: 300.0}, "b": {2**70: 300.0}}) == {}
    assert planmsg.packed_rows({}) == {} and planmsg.packed_rows({"a": {}}) == {"a": b""}


def test_packed_plan_with_safe_rows_given_is_the_same_plan():
    safe = {0: 310.5, 3: 250.0}
    fields = (9, "hold", 1.7e9, 10.0, False, 2, 1.6e9)
    rows = planmsg.packed_rows({"n1": safe})["n1"]
    assert planmsg.packed_plan("n1", {}, safe, *fields, rows) == planmsg.packed_plan("n1", {}, safe, *fields)
