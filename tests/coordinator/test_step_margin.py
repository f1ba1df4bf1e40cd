"""The headroom the clock-step alignment leaves goes back as margin within each GPU's step
(coordinator.allocation.step_margin, coordinator.pacealign.step_top_w), and the planner sends
sub-deadband decreases that block a domain's increases (coordinator.planner.plan_decreases_arrays).

Plant: the cube-law, 15 MHz-quantized one of tests/coordinator/test_pacealign.py."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import allocation, pacealign, planner
from tests.coordinator.test_pacealign import MAX_MHZ, STATIC_W, STEP_MHZ, _clock, _draw, _gpus

DYN = [520.0, 600.0, 455.0, 780.0, 560.0, 610.0]


def _inputs(caps, limit_w):
    gpus = _gpus(caps, DYN)
    for g in gpus:
        g.domain = "cluster"
    keys = frozenset(g.key for g in gpus)
    domains = [{"name": "cluster", "parent": None, "limit_w": limit_w, "kind": "cluster"}]
    return allocation.SolveInputs(gpus=gpus, jobs={"J": 1.0}, domains=domains, objective="proportional",
                                  slew_w=None, node_domain={}, domain_members={"cluster": keys})


@pytest.mark.parametrize("extra_w", [3.0, 9.0, 17.0, 23.0])
def test_the_alignments_leftover_is_handed_out_within_each_gpus_step(extra_w):
    start = [STATIC_W + d * (1605.0 / MAX_MHZ) ** 3 + 3.0 for d in DYN]  # all on 1605 MHz
    limit = sum(start) + extra_w  # the job's watts: more than it uses, less than a step more for all
    inputs = _inputs(start, limit)
    desired = {g.key: limit / len(start) for g in inputs.gpus}
    aligned = allocation.paced_split(inputs, desired)
    assert aligned == {"J"}
    after_align = dict(desired)
    assert sum(after_align.values()) < limit - 2.0  # the alignment keeps what buys no step
    clocks = {k: _clock(c, d) for (k, c), d in zip(after_align.items(), DYN)}
    allocation.step_margin(inputs, desired, aligned)
    total = sum(desired.values())
    assert total <= limit + 1e-9  # never above the domain's limit
    room = sum(pacealign.step_top_w([g.pace], [g.pace_step], [g.draw_w], [g.pace_at_w], [70.0],
                                    [after_align[g.key]])[0] - after_align[g.key] for g in inputs.gpus)
    # all of the leftover when the steps have room for it, else every GPU at 7/8 of its step
    assert total == pytest.approx(min(limit - allocation.LIMIT_SLACK_W, sum(after_align.values()) + room), abs=1e-6)
    for k, d in zip(desired, DYN):
        assert desired[k] >= after_align[k] - 1e-12
        assert _clock(desired[k], d) == clocks[k]  # the same step: the same clock, draw and pace


def test_step_top_is_seven_eighths_of_the_step_the_cap_gives():
    f, s = 1380.0 / 1980.0, 15.0 / 1980.0
    draw = 70.0 + 200.0
    mid = 70.0 + 200.0 * ((f + 0.5 * s) / f) ** 3
    top = pacealign.step_top_w([f, f, 1.0], [s, s, s], [draw, draw, 300.0], [draw, draw, 400.0], [70.0] * 3,
                               [mid, draw, 400.0])
    want = 70.0 + 200.0 * ((f + 0.875 * s) / f) ** 3
    assert top[0] == pytest.approx(want, abs=1e-9) and top[1] == pytest.approx(want, abs=1e-9)
    assert top[2] == 400.0  # at its max clock: no room
    below = 70.0 + 200.0 * ((f - 0.5 * s) / f) ** 3  # a cap a step lower: that step's top
    assert pacealign.step_top_w([f], [s], [draw], [draw], [70.0], [below])[0] == pytest.approx(
        70.0 + 200.0 * ((f - 0.125 * s) / f) ** 3, abs=1e-9)


def _plan(desired, observed, limit_w):
    n = len(desired)
    keys = [("n", i) for i in range(n)]
    obs = np.array(observed, float)
    pa = planner.PlanArrays(keys, np.array(desired, float), obs, obs.copy(), np.full(n, 200.0), np.full(n, 700.0),
                            np.ones(n, bool), np.zeros(n))
    doms = planner.domain_index([planner.DomainSpec("c", "cluster", limit_w, frozenset(keys))], keys)
    return pa, doms


def test_sub_deadband_decreases_that_block_an_increase_are_sent():
    # the real-agent state: 2,400 W fully enforced; six GPUs 1.7 W down, two 5.2 W up
    observed = [274.0] * 6 + [378.0] * 2
    desired = [272.25] * 6 + [383.2] * 2
    pa, doms = _plan(desired, observed, 2400.0)
    assert planner.plan_decreases_arrays(pa)[0].size == 0  # the deadband alone sends nothing
    sel, caps = planner.plan_decreases_arrays(pa, doms=doms)
    assert sel.tolist() == list(range(6)) and caps.tolist() == [272.25] * 6
    after = np.array(observed, float)
    after[sel] = caps
    pa2, _ = _plan(desired, after.tolist(), 2400.0)
    sel2, caps2 = planner.plan_increases_arrays(pa2, doms)
    assert sel2.tolist() == [6, 7] and after[:6].sum() + caps2.sum() <= 2400.0 + 1e-9
    assert caps2 == pytest.approx([383.2, 383.2], abs=0.01)


def test_sub_deadband_decreases_stay_unsent_when_the_headroom_covers_the_increases():
    observed = [274.0] * 6 + [378.0] * 2
    desired = [272.25] * 6 + [383.2] * 2
    pa, doms = _plan(desired, observed, 2420.0)  # 20 W free: the raise needs none of the decreases
    assert planner.plan_decreases_arrays(pa, doms=doms)[0].size == 0
