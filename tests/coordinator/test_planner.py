"""Two-phase planning and failsafe caps (pure functions of coordinator.planner)."""

from __future__ import annotations

import random

from coordinator.planner import DomainSpec, GpuPlanInput, plan_decreases, plan_increases, safe_caps


def gpu(node, i, desired, observed, accounted=None, live=True, lo=200.0, hi=700.0, prev_safe=0.0):
    return GpuPlanInput(key=(node, i), desired_w=desired, observed_w=observed,
                        accounted_w=observed if accounted is None else accounted, min_cap_w=lo, max_cap_w=hi,
                        live=live, prev_safe_w=prev_safe)


def test_decreases_only_lower_and_skip_stale_and_deadband():
    gpus = [gpu("a", 0, 300, 400), gpu("a", 1, 399, 400), gpu("b", 0, 250, 500, live=False), gpu("b", 1, 500, 300)]
    assert plan_decreases(gpus) == {("a", 0): 300}


def test_decrease_cancels_unacked_increase():
    # read-back 300, increase to 500 sent but not acked (accounted 500); now desired 400 -> send 400
    assert plan_decreases([gpu("a", 0, 400, 300, accounted=500)]) == {("a", 0): 400}


def test_increases_bounded_by_every_domain_headroom():
    gpus = [gpu("a", 0, 600, 300), gpu("a", 1, 600, 300), gpu("b", 0, 600, 300), gpu("b", 1, 300, 500)]
    doms = [DomainSpec("cluster", "cluster", 1900.0, frozenset(g.key for g in gpus)),
            DomainSpec("pdu-a", "pdu", 800.0, frozenset({("a", 0), ("a", 1)}))]
    inc = plan_increases(gpus, doms)
    # GPU b/1 still counted at 500 (its decrease is not acked): cluster headroom 1900-1400 = 500
    assert set(inc) <= {("a", 0), ("a", 1), ("b", 0)}
    after = {g.key: inc.get(g.key, g.accounted_w) for g in gpus}
    assert sum(after.values()) <= 1900 + 1e-6
    assert after[("a", 0)] + after[("a", 1)] <= 800 + 1e-6
    assert all(after[k] <= 600 + 1e-9 for k in inc)
    assert sum(after.values()) > 1850  # the headroom is actually used


def test_increases_never_exceed_limits_randomized():
    rnd = random.Random(7)
    for _ in range(300):
        gpus = []
        for n in range(3):
            for i in range(4):
                obs = rnd.uniform(200, 700)
                acc = obs + (rnd.uniform(0, 100) if rnd.random() < 0.3 else 0.0)
                gpus.append(gpu(f"n{n}", i, rnd.uniform(150, 750), obs, accounted=min(acc, 700), live=rnd.random() > 0.1))
        keys = [g.key for g in gpus]
        used = sum(g.accounted_w for g in gpus)
        doms = [DomainSpec("cluster", "cluster", used + rnd.uniform(-200, 800), frozenset(keys)),
                DomainSpec("n0", "node", rnd.uniform(1000, 2800), frozenset(k for k in keys if k[0] == "n0"))]
        inc = plan_increases(gpus, doms)
        for d in doms:
            before = sum(g.accounted_w for g in gpus if g.key in d.members)
            after = sum(max(inc.get(g.key, g.accounted_w), g.accounted_w) for g in gpus if g.key in d.members)
            # never more than the limit, and never more than before when already over it
            assert after <= max(d.limit_w, before) + 1e-6
        for g in gpus:
            if g.key in inc:
                assert g.live and 200 <= inc[g.key] <= 700 and inc[g.key] > g.observed_w


def test_safe_caps_hold_every_domain_and_never_exceed_target():
    gpus = [gpu("a", i, 600, 600) for i in range(4)] + [gpu("b", i, 600, 600, live=False, prev_safe=400) for i in range(4)]
    keys = frozenset(g.key for g in gpus)
    doms = [DomainSpec("cluster", "cluster", 3000.0, keys)]
    targets = {g.key: 600.0 for g in gpus}
    safe = safe_caps(targets, gpus, doms, policy_safe_cap_w=None)
    assert sum(safe.values()) <= 3000 + 1e-6
    assert all(safe[("b", i)] == 400 for i in range(4))  # stale: what they were last sent
    assert all(200 <= safe[("a", i)] <= 600 for i in range(4))
    safe2 = safe_caps(targets, gpus, doms, policy_safe_cap_w=250.0)
    assert all(safe2[("a", i)] == 250 for i in range(4))
