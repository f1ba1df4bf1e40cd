"""The coordinator's column-wise problem build and batched thermal ceilings against the
per-GPU reference (AllocationProblem.build from spec dicts, allocation.ceiling_w per GPU)."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

from capctl.allocator.curves import DEFAULT_CURVES
from capctl.allocator.problem import AllocationProblem
from coordinator.allocation import GpuInput, SolveInputs, build_problem, ceiling_w, ceilings_w


def _inputs(rnd: random.Random) -> SolveInputs:
    domains = [{"name": "cluster", "parent": None, "limit_w": 20000.0, "kind": "cluster"},
               {"name": "rack1", "parent": "cluster", "limit_w": None, "kind": "rack"},
               {"name": "node:a", "parent": "rack1", "limit_w": None, "kind": "node"},
               {"name": "node:b", "parent": "cluster", "limit_w": 3000.0, "kind": "node"}]
    gpus = []
    for name in ("a", "b"):
        for i in range(8):
            fixed = rnd.random() < 0.2
            acc = rnd.uniform(200, 700)
            curve = rnd.choice([None, DEFAULT_CURVES["H100"], {"a": 1.3, "k_w": 140.0, "sat_w": 640.0}])
            ceil = rnd.choice([math.inf, rnd.uniform(150, 800)])
            gpus.append(GpuInput((name, i), f"node:{name}", acc if fixed else 200.0, acc if fixed else 700.0, fixed, acc,
                                 rnd.uniform(200, 700), rnd.choice([None, "j1", "j2"]), curve, ceil, rnd.uniform(200, 700)))
    return SolveInputs(gpus=gpus, jobs={"j1": 1.0, "j2": 2.5}, domains=domains, objective="proportional", slew_w=None,
                       node_domain={"a": "node:a", "b": "node:b"}, domain_members={})


def test_build_problem_equals_spec_build():
    rnd = random.Random(5)
    for _ in range(50):
        inputs = _inputs(rnd)
        specs = []
        for g in inputs.gpus:
            spec = {"name": f"{g.key[0]}/{g.key[1]}", "domain": g.domain, "min_cap_w": g.min_cap_w,
                    "max_cap_w": g.max_cap_w, "job": g.job, "idle_cap_w": g.idle_cap_w,
                    "thermal_ceiling_w": None if not math.isfinite(g.thermal_ceiling_w) else g.thermal_ceiling_w,
                    "prev_cap_w": None if g.fixed else g.observed_w}
            if g.curve is not None:
                spec["curve"] = g.curve
            specs.append(spec)
        ref = AllocationProblem.build(gpus=specs, jobs=inputs.jobs, domains=inputs.domains,
                                      objective=inputs.objective, slew_w=inputs.slew_w)
        got = build_problem(inputs)
        for f in dataclasses.fields(ref):
            a, b = getattr(ref, f.name), getattr(got, f.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), f.name
            else:
                assert a == b, f.name


def test_batched_ceilings_equal_per_gpu_ceilings():
    rnd = random.Random(3)
    rows = []
    for _ in range(500):
        rows.append((rnd.uniform(30, 95), rnd.choice([rnd.uniform(0.02, 0.2), 0.0, -0.1]),
                     rnd.choice([rnd.uniform(5, 120), 0.0]), rnd.uniform(15, 40), rnd.uniform(80, 95)))
    got = ceilings_w(rows, 1.0, 5.0)
    for (temp, r, tau, inlet, slowdown), value in zip(rows, got):
        assert value == ceiling_w(temp, (r, tau, inlet), 1.0, slowdown, 5.0)


def test_values_at_reads_every_key_and_falls_back_to_the_default():
    import math

    from coordinator.allocation import values_at

    keys = [("n1", 0), ("n1", 1), ("n2", 0)]
    assert values_at({k: float(i) for i, k in enumerate(keys)}, keys).tolist() == [0.0, 1.0, 2.0]
    got = values_at({("n1", 1): 5.0}, keys, math.nan)  # (keys without a value: the default)
    assert math.isnan(got[0]) and got[1] == 5.0 and math.isnan(got[2])
    assert values_at({}, []).shape == (0,)
