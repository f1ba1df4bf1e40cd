"""The decision's per-node dicts built per run of a node's GPUs (``decide.by_node``) equal the
per-GPU definition; ``decide.KeyedValues`` reads as the dict it replaces (issue 12, item 7)."""

from __future__ import annotations

import random

import numpy as np

from coordinator import decide


def _reference(keys, positions, values) -> dict:
    out: dict = {}
    for i, v in zip(positions, values):
        n, x = keys[i]
        out.setdefault(n, {})[x] = v
    return out


def test_by_node_equals_the_per_gpu_definition():
    rng = random.Random(2)
    keys = tuple((f"n{k:03d}", i) for k in range(40) for i in sorted(rng.sample(range(8), rng.randrange(1, 9))))
    for keyset in (keys, list(keys), keys):
        for positions in (list(range(len(keys))), sorted(rng.sample(range(len(keys)), 50)),
                          rng.sample(range(len(keys)), 70), [3, 3, 1, 0, 3], [], np.arange(len(keys))[::-3]):
            values = [rng.uniform(100, 700) for _ in range(len(positions))]
            got = decide.by_node(keyset, positions, iter(values))
            want = _reference(keyset, list(positions), values)
            assert got == want
            assert list(got) == list(want) and all(list(got[n]) == list(want[n]) for n in want)  # same order


def test_keyed_values_read_as_a_dict():
    keys = (("a", 0), ("a", 1), ("b", 0))
    kv = decide.KeyedValues(keys, np.array([1.5, 2.0, 3.0]))
    want = {("a", 0): 1.5, ("a", 1): 2.0, ("b", 0): 3.0}
    assert kv == want and want == kv and dict(kv) == want and len(kv) == 3 and list(kv) == list(keys)
    assert kv[("a", 1)] == 2.0 and kv.get(("z", 0)) is None and ("b", 0) in kv
    assert type(kv[("b", 0)]) is float


def test_the_solve_keeps_its_desired_array_equal_to_its_dict(monkeypatch):
    """``SolveOutput.desired_at`` (the desired caps as an array, updated by the pace split, the
    step margin, the idle rule and the spare watts instead of read back from the dict each step)
    == the dict, value for value, on bench/interval_cost.py's fleet with the spare watts on and off."""
    import asyncio
    import dataclasses
    import sys
    from pathlib import Path

    from coordinator import allocation

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import interval_cost as ic

    seen = []
    inner = allocation.solve

    def checked(inputs):
        out = inner(inputs)
        keys = allocation.columns_of(inputs).keys
        assert out.desired_at.tolist() == allocation.values_at(out.desired_w, keys).tolist()
        seen.append((inputs.spread_spare, len(out.idle_grant_w)))
        return out

    monkeypatch.setattr(allocation, "solve", checked)
    for spread in (False, True):
        bench = ic.IntervalBench(512, seed=2)
        bench.coord.policy = dataclasses.replace(bench.coord.policy, spread_spare_watts=spread)
        asyncio.run(bench.run(4, 2, ""))
    assert {s for s, _ in seen} == {False, True} and any(n for _, n in seen)
