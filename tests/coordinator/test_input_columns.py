"""The solver inputs built on columns (``allocation.build_inputs``) equal the per-GPU rules they
replaced (issue 12, item 7a): ``_reference`` below is the per-record code of main before, field by
field, on a random registry with every rule's case (stale node, no reading, pending caps, an
acknowledgement within its memory, unusable constraints, uncontrollable and out-of-band states,
stragglers, stale samples, idle GPUs with and without a pre-job limit) under the three idle rules
and a policy minimum."""

from __future__ import annotations

import math
import random

import pytest

from capctl import capstates
from capctl.reasons import is_thermal
from capctl.policy.validate import parse_policy
from coordinator import allocation as A
from coordinator.models import Models
from coordinator.registry import Binding, GpuObs, NodeObs, Registry, Sample

H100 = "NVIDIA H100 80GB HBM3"
NOW = 1000.0


def _policy(idle: str, min_cap: str, reserve: bool):
    nodes = ",".join(f"n{k:02d}" for k in range(16))
    return parse_policy(f"""
version: 1
budget_w: 40000
interval_s: 1
objective: proportional
thermal: {{margin_c: 5}}
idle_cap_w: {idle}
min_cap_w: {min_cap}
reserve_pre_job_limits: {str(reserve).lower()}
failsafe: {{lease_s: 10, safe_cap_w: null}}
domains:
  name: cluster
  kind: cluster
  gpu_model: H100-SXM
  gpus_per_node: 4
  children:
    - {{name: pdu-a, kind: pdu, limit_w: 24000, nodes: "{nodes}"}}
""", "<test>")


def _registry(rng: random.Random) -> tuple[Registry, Models]:
    reg = Registry(clock=lambda: NOW)
    states = ["OK"] * 6 + [capstates.OOB_LIMITED, capstates.OOB_LIMITED, capstates.SET_FAILED, capstates.LOST]
    for k in range(16):
        name = f"n{k:02d}"
        node = NodeObs(name=name, session=object(), last_report_mono=NOW - (30.0 if k == 7 else 0.5))  # n07: stale
        for i in range(4):
            lo, hi = rng.choice([(200.0, 700.0)] * 6 + [(0.0, 700.0), (200.0, 0.0)])
            g = GpuObs(node=name, index=i, name=H100, min_cap_w=lo, max_cap_w=hi, default_cap_w=700.0,
                       slowdown_temp_c=rng.choice([0.0, 89.0, 89.0]), max_sm_clock_mhz=rng.choice([0, 1980, 1980]),
                       have_reading=rng.random() < 0.9, enforced_w=rng.uniform(250, 650), power_w=rng.uniform(100, 650),
                       temp_c=rng.choice([math.nan, rng.uniform(40, 92)]), sm_clock_mhz=rng.randrange(900, 1980, 15),
                       cap_state=rng.choice(states), utilization_pct=rng.choice([0.0, 100.0]),
                       reasons=rng.choice([(), ("SW_POWER_CAP",), ("HW_SLOWDOWN",), ("SW_THERMAL_SLOWDOWN",), ("HW_THERMAL_SLOWDOWN",)]),
                       pre_job_cap_w=rng.choice([0.0, 650.0]), last_ack_w=rng.uniform(250, 700),
                       last_ack_mono=rng.choice([-1e18, NOW - 0.5]), safe_cap_w=rng.uniform(200, 400),
                       slowdown_run=rng.choice([0, 3]), sample_mono=rng.choice([NOW - 1.0, NOW - 1.0, NOW - 60.0]))
            gap = rng.choice([0.0, 40.0])
            g.cap_w = g.enforced_w + (40.0 if g.cap_state == capstates.OOB_LIMITED else gap)
            g.sample_enforced_w = g.enforced_w
            if rng.random() < 0.2:
                g.pending[1] = rng.uniform(250, 700)
            node.gpus[i] = g
        if k == 5:  # reason sets of several names, a list, lower case (the rules' memo: allocation.reason_codes)
            for g, r in zip(node.gpus.values(), [("SW_POWER_CAP", "HW_SLOWDOWN"), ["HW_THERMAL_SLOWDOWN", "SW_POWER_CAP"],
                                                 ("sw_power_cap",), ("HW_SLOWDOWN", "sw_thermal_slowdown")]):
                g.reasons = r
        if k % 3:
            node.bindings[f"j{k // 3}"] = Binding(f"j{k // 3}", name, (0, 1, 2) if k % 2 else (1, 3))
        reg.nodes[name] = node
    ticks = iter(range(10**9))  # a budget clock that moves on: no refit budget left (curves: test_columns)
    models = Models(clock=lambda: NOW, budget_clock=lambda: float(next(ticks)), rng=random.Random(0))
    for step in range(6):  # samples: scaled curves, thermal fits
        for node in reg.nodes.values():
            for g in node.gpus.values():
                g.new_samples = [Sample(NOW - 6 + step, g.power_w, g.enforced_w - 20 * step, 50.0 + step, 1500.0,
                                        ("SW_POWER_CAP",), 100.0)]
        models.update(reg, 1.0)
    return reg, models


def _reference(registry, models, policy, now, lease_s, ack_memory_s) -> list[dict]:
    """The per-GPU rules of main before (the per-record GpuInput rows of allocation before the columns), as dicts."""
    out = []
    for name in sorted(registry.nodes):
        node = registry.nodes[name]
        stale = node.stale(now, lease_s)
        job_of = {}
        for b in node.bindings.values():  # a GPU bound to several jobs: the first binding's
            for i in b.gpu_indices:
                job_of.setdefault(i, b.job_id)
        thermal = models.thermal(name) if not stale else {}
        for idx in sorted(node.gpus):
            g = node.gpus[idx]
            acc = g.accounted_w(now, ack_memory_s)
            target, strag, ceiling = 0.0, "", math.inf
            fixed = (stale or not g.have_reading or g.max_cap_w <= 0 or g.cap_state in A.UNCONTROLLABLE_STATES
                     or bool(g.constraints_problem))
            if fixed:
                lo = hi = idle = max(acc, A.FIXED_EPS_W)
            else:
                pmin = policy.min_cap_w
                lo = g.min_cap_w if pmin is None else max(g.min_cap_w, min(pmin, g.max_cap_w))
                lo, hi = max(lo, A.FIXED_EPS_W), g.max_cap_w
                strag = A.straggler_reason(g, now) if g.slowdown_run >= A.STRAGGLER_SAMPLES else ""
                if strag:
                    hi = max(lo, min(hi, g.sample_enforced_w, A.STRAGGLER_MARGIN * g.power_w + 5.0))
                if g.cap_state == capstates.OOB_LIMITED and g.enforced_w < g.cap_w - A.OOB_TOLERANCE_W:
                    hi = max(lo, min(hi, g.enforced_w))
                th = thermal.get(idx)
                if th and g.slowdown_temp_c > 0 and math.isfinite(g.temp_c):
                    ceiling = A.ceiling_w(g.temp_c, th, policy.interval_s, g.slowdown_temp_c, policy.thermal.margin_c)
                known = g.slowdown_temp_c > 0 and math.isfinite(g.temp_c)
                if known and math.isfinite(ceiling):  # thermal_damping, GPU by GPU
                    margin = policy.thermal.margin_c
                    aim, step = g.slowdown_temp_c - margin, A.NEAR_STEP_FRACTION * max(g.max_cap_w - lo, 0.0)
                    if aim - A.NEAR_BAND_FRACTION * margin <= g.temp_c < g.slowdown_temp_c - A.HOLD_MARGIN_FRACTION * margin:
                        drop = step * (1.0 + A.DROP_STEPS_PER_C * max(g.temp_c - aim, 0.0))
                        ceiling = min(max(ceiling, acc - drop), acc + step)
                    elif g.temp_c < aim - A.NEAR_BAND_FRACTION * margin and th and th[0] > 0:
                        ceiling = min(ceiling, acc + max(step, (aim - g.temp_c) / min(th[0], 0.1)))  # the prior's R at most
                # thermal_guard, GPU by GPU
                if (known and g.temp_c >= g.slowdown_temp_c - A.HOLD_MARGIN_FRACTION * policy.thermal.margin_c
                        or is_thermal(g.reasons)):
                    ceiling = min(ceiling, acc)
                if (known and g.temp_c >= g.slowdown_temp_c) or (not known and "HW_THERMAL_SLOWDOWN" in g.reasons):
                    pw = g.power_w if math.isfinite(g.power_w) and g.power_w > 0 else acc
                    ceiling = min(ceiling, max(min(acc, pw) - A.HOT_STEP_FRACTION * max(g.max_cap_w - lo, 0.0), lo))
                back = min(max(g.pre_job_cap_w if g.pre_job_cap_w > 0 else acc, lo), hi)
                if policy.idle_cap_w is not None:
                    idle = min(max(policy.idle_cap_w, lo), hi)
                elif policy.reserve_pre_job_limits:
                    idle = back
                else:
                    idle, target = lo, back
            job = job_of.get(idx)
            row = dict(key=(name, idx), min_cap_w=lo, max_cap_w=hi, fixed=fixed, accounted_w=acc,
                       observed_w=g.enforced_w if g.have_reading else acc, job=job, thermal_ceiling_w=ceiling,
                       idle_cap_w=idle, idle_target_w=target if job is None else 0.0, pace=math.nan, pace_at_w=0.0,
                       paced=False, straggler="", curve=models.curve((name, idx)), draw_w=0.0, pace_step=0.0)
            if not fixed and g.max_sm_clock_mhz > 0 and now - g.sample_mono <= A.PACE_FRESH_S:
                pace = min(1.0, max(0.0, g.sm_clock_mhz / g.max_sm_clock_mhz))
                slowed = any("SLOWDOWN" in r.upper() for r in g.reasons)
                capped = any("POWER_CAP" in r.upper() for r in g.reasons)
                row.update(pace=pace, pace_at_w=g.sample_enforced_w, straggler=strag,
                           draw_w=g.power_w if math.isfinite(g.power_w) and g.power_w > 0 else 0.0,
                           pace_step=A.CLOCK_STEP_MHZ / g.max_sm_clock_mhz,
                           paced=(not strag and g.utilization_pct >= 20.0 and not slowed and (capped or pace >= 0.99)
                                  and pace > 0 and g.sample_enforced_w > 0))
            out.append(row)
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-12)
    return a == b


@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("idle,min_cap,reserve", [("200", "null", False), ("null", "300", False),
                                                  ("null", "null", True)])
def test_columns_equal_the_per_gpu_rules(seed, idle, min_cap, reserve):
    rng = random.Random(seed)
    reg, models = _registry(rng)
    policy = _policy(idle, min_cap, reserve)
    got = A.build_inputs(reg, models, policy, NOW, 10.0, 1.0)
    want = _reference(reg, models, policy, NOW, 10.0, 1.0)
    assert len(got.gpus) == len(want) == 64
    for gi, w in zip(got.gpus, want):
        for field, value in w.items():
            assert _same(getattr(gi, field), value), (w["key"], field, getattr(gi, field), value)
    fixed = sum(w["fixed"] for w in want)
    oob = [w for w in want if not w["fixed"] and reg.nodes[w["key"][0]].gpus[w["key"][1]].cap_state == capstates.OOB_LIMITED]
    assert oob and all(w["max_cap_w"] < 700.0 for w in oob)  # held within their enforced limit
    assert 0 < fixed < len(want) and any(w["straggler"] for w in want) and any(w["paced"] for w in want)
    assert any(math.isfinite(w["thermal_ceiling_w"]) for w in want) and any(w["idle_target_w"] for w in want) == (
        idle == "null" and not reserve)
    assert got.jobs == {j: 1.0 for j in sorted({w["job"] for w in want if w["job"]})}


def test_reason_and_state_codes_equal_the_per_gpu_rules():
    """``reason_codes`` / ``state_codes`` (one pass over a memo of distinct values) == the rules per
    GPU (thermal code, a slowdown, the power cap; uncontrollable, out-of-band), on tuples, lists,
    any case, unknown names, the memo filled, cleared at its bound and read again."""
    names = ["SW_POWER_CAP", "HW_SLOWDOWN", "SW_THERMAL_SLOWDOWN", "HW_THERMAL_SLOWDOWN", "hw_power_brake_slowdown",
             "GPU_IDLE", "sw_power_cap", "APPLICATIONS_CLOCKS_SETTING", "X"]
    rng = random.Random(3)
    sets = [tuple(rng.sample(names, rng.randrange(0, 4))) for _ in range(300)] + [["HW_THERMAL_SLOWDOWN"], []]

    def want(r):
        up = [x.upper() for x in r]
        thermal = 2 if "HW_THERMAL_SLOWDOWN" in r else 1 if is_thermal(r) else 0
        return (thermal | (A.PACE_SLOWDOWN_BIT if any("SLOWDOWN" in x for x in up) else 0)
                | (A.PACE_POWER_CAP_BIT if any("POWER_CAP" in x for x in up) else 0))

    for _ in range(2):  # a cold memo (filled one by one), then the one pass
        assert A.reason_codes(sets).tolist() == [want(r) for r in sets]
    A._REASON_BITS.clear()
    many = [(f"R{i}",) for i in range(A._MEMO_MAX + 10)] + [("HW_THERMAL_SLOWDOWN",)]
    assert A.reason_codes(many).tolist() == [want(r) for r in many] and len(A._REASON_BITS) <= A._MEMO_MAX
    states = ["", "OK", capstates.OOB_LIMITED, capstates.LOST, capstates.SET_FAILED, "ZZZ"] + sorted(A.UNCONTROLLABLE_STATES)
    for _ in range(2):
        got = A.state_codes(states).tolist()
        assert got == [(A.UNCONTROLLABLE_BIT if s in A.UNCONTROLLABLE_STATES else 0)
                       | (A.OOB_BIT if s == capstates.OOB_LIMITED else 0) for s in states]
    assert A.reason_codes([]).shape == A.state_codes(()).shape == (0,)


def test_jobs_follow_binding_changes_between_intervals():
    """The jobs of the inputs (computed again only when the policy, topology or bindings changed:
    ``allocation._jobs_of``) follow a job's start and end, a binding replaced by an equal one, and
    a new policy object; each call returns fresh objects."""
    rng = random.Random(0)
    reg, models = _registry(rng)
    policy = _policy("null", "null", False)

    def check(p=policy):
        got = A.build_inputs(reg, models, p, NOW, 10.0, 1.0)
        want = _reference(reg, models, p, NOW, 10.0, 1.0)
        assert [g.job for g in got.gpus] == [w["job"] for w in want]
        assert got.jobs == {j: 1.0 for j in dict.fromkeys(w["job"] for w in want if w["job"])}
        return got

    first = check()
    again = check()
    assert again.jobs == first.jobs and again.jobs is not first.jobs
    again.jobs["x"] = 2.0  # (a caller's change does not reach the next interval's)
    assert "x" not in check().jobs
    reg.nodes["n00"].bindings["new"] = Binding("new", "n00", (0, 3))
    assert "new" in check().jobs
    reg.nodes["n00"].bindings["new"] = Binding("new", "n00", (0, 3))  # equal, another object
    check()
    del reg.nodes["n01"].bindings["j0"]
    check()
    reg.nodes["n01"].bindings = {}
    check(_policy("null", "null", False))
