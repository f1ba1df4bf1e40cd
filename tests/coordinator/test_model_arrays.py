"""Batched model code (coordinator/models.py) against the per-node/per-GPU code it replaces."""

from __future__ import annotations

import numpy as np
import pytest

from capctl.allocator.thermal import OnlineThermalFit
from coordinator import models as M


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thermal_bank_equals_one_online_fit_per_node(seed):
    # random nodes, powers, temperatures and jittered sample times (some off the mean dt: screened)
    rng = np.random.default_rng(seed)
    n_nodes, G, steps = 7, 4, 40
    bank = M.ThermalBank(G)
    rows = np.array([bank.new_row(2.0) for _ in range(n_nodes)])
    fits = [OnlineThermalFit(G, nominal_interval_s=2.0) for _ in range(n_nodes)]
    t = rng.uniform(0, 5, n_nodes)
    for _ in range(steps):
        t = t + np.where(rng.random(n_nodes) < 0.1, rng.uniform(3.5, 6.0, n_nodes), rng.uniform(1.8, 2.2, n_nodes))
        p = rng.uniform(100, 700, (n_nodes, G))
        temp = rng.uniform(30, 85, (n_nodes, G))
        some = rng.random(n_nodes) < 0.8  # not every node reports every round
        bank.add(rows[some], t[some], p[some], temp[some])
        for k in np.nonzero(some)[0]:
            fits[k].add(t[k], p[k], temp[k])
    r, tau, inlet = bank.params(rows)
    for k, fit in enumerate(fits):
        r1, tau1, inlet1 = fit.params()
        np.testing.assert_allclose(r[k], r1, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(tau[k], tau1, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(inlet[k], inlet1, rtol=1e-9, atol=1e-12)
    # the estimates moved from the prior (the comparison above is not of two untouched priors)
    assert np.ptp(r) > 1e-3


def test_thermal_bank_rows_are_reused_at_the_prior_and_grow():
    bank = M.ThermalBank(2)
    rows = [bank.new_row(1.0) for _ in range(40)]  # past the first allocation
    assert rows == list(range(40))
    bank.add(np.array([3]), np.array([1.0]), np.array([[300.0, 300.0]]), np.array([[50.0, 50.0]]))
    bank.add(np.array([3]), np.array([2.0]), np.array([[600.0, 600.0]]), np.array([[70.0, 70.0]]))
    moved = bank.params(np.array([3]))[0].copy()
    bank.release(3)
    assert bank.new_row(1.0) == 3
    fresh = OnlineThermalFit(2, nominal_interval_s=1.0).params()
    np.testing.assert_allclose(bank.params(np.array([3]))[0][0], fresh[0], rtol=1e-12)
    assert not np.allclose(moved[0], fresh[0])


# -- pace split and idle rule: domain sums on arrays == the per-key sums they replace ----------
import math  # noqa: E402
import random  # noqa: E402

from capctl.allocator.curves import DEFAULT_CURVES  # noqa: E402
from coordinator import allocation, paceloop  # noqa: E402


def _cluster(rnd: random.Random):
    """Random inputs: 2 racks (limits) x 3 nodes x 4 GPUs, jobs of (mostly) paced GPUs, idle GPUs
    wanting their pre-job limit back (a few fixed); desired caps near the limits."""
    domains = [{"name": "c", "parent": None, "limit_w": rnd.uniform(9500, 12500), "kind": "cluster"}]
    members: dict = {"c": set()}
    gpus = []
    for r in range(2):
        rack = f"r{r}"
        domains.append({"name": rack, "parent": "c", "limit_w": rnd.uniform(4800, 6500), "kind": "rack"})
        members[rack] = set()
        for n in range(3):
            node = f"n{r}{n}"
            domains.append({"name": f"node:{node}", "parent": rack, "limit_w": None, "kind": "node"})
            members[f"node:{node}"] = set()
            job = rnd.choice([None, f"j{r}", "jx"])
            for i in range(4):
                key = (node, i)
                for d in ("c", rack, f"node:{node}"):
                    members[d].add(key)
                cap = rnd.uniform(250, 650)
                fixed = job is None and rnd.random() < 0.2
                g = allocation.GpuInput(key, f"node:{node}", 200.0, 700.0, fixed, cap, cap, job,
                                        DEFAULT_CURVES["H100"], rnd.choice([math.inf, rnd.uniform(400, 700)]), 200.0,
                                        idle_target_w=rnd.uniform(300, 700) if job is None else 0.0)
                g.pace, g.pace_at_w, g.paced = rnd.uniform(0.6, 1.0), cap, rnd.random() < 0.97
                gpus.append(g)
    jobs = {"j0": 1.0, "j1": 2.0, "jx": 1.0}
    inputs = allocation.SolveInputs(gpus=gpus, jobs=jobs, domains=domains, objective="proportional", slew_w=None,
                                    node_domain={}, domain_members={k: frozenset(v) for k, v in members.items()})
    desired = {g.key: g.accounted_w * rnd.uniform(0.8, 1.1) for g in gpus}
    return inputs, desired


def _limited(inputs):
    return [(d["name"], float(d["limit_w"])) for d in inputs.domains if d["limit_w"] is not None]


def _in_order(inputs, name: str) -> list:
    """The GPU keys of domain ``name`` in the inputs' order (the arrays' summation order: a set's
    order follows the hash seed, and a sum within 1e-12 of the idle rule's 0.01 W stop flipped a
    water-filling pass, 0.014 W apart, under PYTHONHASHSEED=1)."""
    members = inputs.domain_members.get(name, frozenset())
    return [g.key for g in inputs.gpus if g.key in members]


def _reference_paced_split(inputs, desired):
    """The per-key version the arrays replaced (coordinator/allocation.py before issue 12 item 7)."""
    limited = _limited(inputs)
    load = {n: sum(desired.get(k, 0.0) for k in _in_order(inputs, n)) for n, _ in limited}
    head = {n: lim - load[n] - allocation.LIMIT_SLACK_W for n, lim in limited}

    granted, granted_w = {}, {}

    def extra_w(members, caps=None):
        keys = {g.key for g in members}
        mine = [n for n, _ in limited if keys & inputs.domain_members.get(n, frozenset())]
        if caps is not None:  # the job's grant back, its real moves booked (issue 12 item 8)
            for n in granted.pop(members[0].job, ()):
                head[n] += granted_w[n]
            for n, _ in limited:
                head[n] -= sum(c - desired[k] for k, c in caps.items() if k in inputs.domain_members.get(n, ()))
            return 0.0
        grant = max(0.0, min((head[n] for n in mine), default=0.0))
        for n in mine:
            head[n] -= grant
        granted[members[0].job] = mine
        granted_w.update({n: grant for n in mine})
        return grant

    moved = paceloop.correct(inputs.gpus, desired, inputs.jobs, extra_w)
    job_of = {g.key: g.job for g in inputs.gpus}
    by_job: dict = {}
    for k, c in moved.items():
        by_job.setdefault(job_of[k], {})[k] = c
    for caps in by_job.values():
        delta = {n: sum(c - desired[k] for k, c in caps.items() if k in inputs.domain_members.get(n, ()))
                 for n, _ in limited}
        if all(load[n] + delta[n] <= lim + 1e-6 for n, lim in limited):
            desired.update(caps)
            for n in load:
                load[n] += delta[n]


def _reference_idle(inputs, desired):
    # (within the thermal ceiling, never below the minimum: a hot idle GPU is not raised past it)
    target = {g.key: min(g.idle_target_w, max(g.min_cap_w, g.thermal_ceiling_w)) if g.idle_target_w > 0 else 0.0
              for g in inputs.gpus}
    active = [g.key for g in inputs.gpus
              if target[g.key] > 0 and not g.fixed and g.job is None and target[g.key] > desired[g.key] + 1e-6]
    for _ in range(allocation.IDLE_PASSES):  # the same water-filling, per key
        want = {k: target[k] - desired[k] for k in active}
        ratio = {}
        for name, lim in _limited(inputs):
            members = _in_order(inputs, name)
            wanted = sum(want.get(k, 0.0) for k in members)
            if wanted <= 0:
                continue
            head = lim - sum(desired.get(k, 0.0) for k in members)
            ratio[name] = 1.0 if head >= wanted - 1e-9 else min(1.0, max(0.0, (head - allocation.LIMIT_SLACK_W) / wanted))
        granted, still = 0.0, []
        for k, w in want.items():
            r = min([ratio[n] for n in ratio if k in inputs.domain_members[n]], default=1.0)
            desired[k] += w * r
            granted += w * r
            if 0 < r < 1.0:
                still.append(k)
        active = still
        if not active or granted < allocation.IDLE_PASS_MIN_W:
            break


@pytest.mark.parametrize("seed", range(12))
def test_pace_split_and_idle_rule_on_arrays_equal_the_per_key_rules(seed):
    inputs, desired = _cluster(random.Random(seed))
    mine, ref = dict(desired), dict(desired)
    allocation.paced_split(inputs, mine)
    _reference_paced_split(inputs, ref)
    assert mine.keys() == ref.keys()
    for k in ref:
        assert mine[k] == pytest.approx(ref[k], abs=1e-9)
    allocation.idle_from_headroom(inputs, mine)
    _reference_idle(inputs, ref)
    for k in ref:
        assert mine[k] == pytest.approx(ref[k], abs=1e-9)


def test_the_rules_act_on_these_inputs():
    # the comparison above is not between two no-ops: over the seeds, the pace split moves caps and
    # the idle rule raises idle GPUs
    moved = raised = 0
    for seed in range(12):
        inputs, desired = _cluster(random.Random(seed))
        out = dict(desired)
        allocation.paced_split(inputs, out)
        moved += sum(abs(out[k] - desired[k]) > 1e-6 for k in desired)
        before = dict(out)
        allocation.idle_from_headroom(inputs, out)
        raised += sum(out[k] > before[k] + 1e-6 for k in out)
    assert moved > 0 and raised > 0


@pytest.mark.parametrize("seed", range(3))
def test_cached_domain_positions_equal_the_planners_domain_index(seed):
    from coordinator import decide, planner

    inputs, _ = _cluster(random.Random(seed))
    keys = [g.key for g in inputs.gpus]
    want = planner.domain_index(decide.domain_specs(inputs), keys)
    got = allocation.limited_positions(inputs)
    assert [lim for lim, _ in got] == [lim for lim, _ in want] and len(want) == 3
    for (_l1, a), (_l2, b) in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_the_idle_rule_passes_on_what_a_full_pdu_cannot_take():
    """No jobs, budget 3,600 W, pdu-a 1,700 W over n1's 4 GPUs, pdu-b 2,200 W over n2's 4, every
    pre-job limit 700 W (the admin try-out's cluster): n1 gets what pdu-a allows and n2 the rest of
    the budget. One pass left 100 W unallocated (n1 425 W, n2 450 W each: 3,500 W)."""
    from tests.coordinator.idleinputs import two_idle_nodes

    inputs = two_idle_nodes()
    gpus = inputs.gpus
    desired = {g.key: 200.0 for g in gpus}  # the solve sees idle GPUs at their minimum cap
    allocation.idle_from_headroom(inputs, desired)
    n1 = sum(v for k, v in desired.items() if k[0] == "n1")
    n2 = sum(v for k, v in desired.items() if k[0] == "n2")
    assert n1 <= 1700.0 and n2 <= 2200.0 and n1 + n2 <= 3600.0
    assert n1 == pytest.approx(1700.0, abs=0.05) and n2 == pytest.approx(1900.0, abs=0.05)
    ref = {g.key: 200.0 for g in gpus}
    _reference_idle(inputs, ref)
    assert all(ref[k] == pytest.approx(desired[k], abs=1e-9) for k in ref)
