"""``Models.update`` on the flat sequence of every node's GPUs equals the record-by-record models
(issue 12, item 7: the models stage on arrays, 7 Dec 2026).

The reference below is the per-GPU definition: each GPU's model fed every sample with
``GpuModel.add`` (a fresh model when the GPU is first seen or bound to a new job, the first
binding's), its memory-bound share by ``_update_memory_bound`` on its latest sample, each node's
thermal model fed ``_common_times`` one time at a time (a fresh one when its GPU indices change),
the models of GPUs the registry no longer has dropped. Seeded random steps: 0, 1 or 2 samples per
GPU, as ``Sample`` objects or the registry's plain tuples (a few GPUs' lists as tuples); readings
without a limit, NaN / inf powers and temperatures, unreported memory utilization, reason sets as
lists; between steps jobs start and end, a node's records are replaced (a hello, fewer GPUs, a
record replaced in place), nodes leave and join. Every model's state, thermal parameters and
memory-bound share equal within 1e-9.
"""

from __future__ import annotations

import math
import random

import pytest

from coordinator import models as M
from coordinator.registry import Binding, GpuObs, NodeObs, Registry, Sample, gpu_jobs

H100 = "NVIDIA H100 80GB HBM3"
REASONS = ((), ("SW_POWER_CAP",), ("SW_THERMAL_SLOWDOWN",), ("HW_SLOWDOWN",), ["SW_POWER_CAP"])


def _sample(rng: random.Random, t: float):
    valid = [rng.uniform(150.0, 700.0), float(rng.randrange(200, 700, 25))]
    enforced = rng.choice([0.0, math.inf, math.nan] + valid * 4)
    temp_c = rng.choice([0.0, math.nan, math.inf] + [rng.uniform(30, 90)] * 20)
    power_w = rng.choice([math.nan, 0.0] + [rng.uniform(0.0, 720.0)] * 10)
    fields = (t, power_w, enforced, temp_c, float(rng.choice([0, rng.randrange(600, 1995, 15)])),
              rng.choice(REASONS), rng.choice([0.0, 10.0, 50.0, 100.0]),
              rng.choice([math.nan, rng.uniform(0, 100)]))
    return Sample(*fields) if rng.random() < 0.5 else fields  # the registry's form: a plain tuple


def _node(name: str, n: int, rng: random.Random) -> NodeObs:
    node = NodeObs(name=name)
    for i in range(n):
        node.gpus[i] = GpuObs(node=name, index=i, name=H100 if rng.random() < 0.8 else "NVIDIA B200",
                              min_cap_w=200.0, max_cap_w=700.0, max_sm_clock_mhz=rng.choice([1980, 0]))
    return node


class _Reference:
    """The record-by-record models (module docstring)."""

    def __init__(self) -> None:
        self.gpus: dict = {}
        self.nodes: dict = {}

    def update(self, reg: Registry) -> None:
        for name, node in reg.nodes.items():
            indices = tuple(sorted(node.gpus))
            nt = self.nodes.get(name)
            if nt is None or nt.indices != indices:
                nt = self.nodes[name] = M.NodeThermal(indices, 1.0)
            job_of = gpu_jobs(node.bindings.values())
            per_gpu = []
            for i in indices:
                g = node.gpus[i]
                m = self.gpus.get(g.key)
                job = job_of.get(i, "")
                if m is None or (job and job != m.job_id):
                    m = self.gpus[g.key] = M.GpuModel(g.name, g.min_cap_w, g.max_cap_w)
                    m.job_id = job
                for smp in g.new_samples:
                    m.add(smp, g.max_sm_clock_mhz)
                if g.new_samples and g.new_samples[-1][M.S_MEM] == g.new_samples[-1][M.S_MEM]:
                    M._update_memory_bound([(m, g.new_samples[-1], g.max_sm_clock_mhz)])
                per_gpu.append(g.new_samples)
            if per_gpu and all(per_gpu):
                for t, power, temp in M._common_times(per_gpu):
                    nt.add(t, power, temp)
        for key in [k for k in self.gpus if k[0] not in reg.nodes or k[1] not in reg.nodes[k[0]].gpus]:
            del self.gpus[key]
        for name in [n for n in self.nodes if n not in reg.nodes]:
            del self.nodes[name]


def _state(m: M.GpuModel) -> tuple:
    f = m.curve_fit
    return (m._scale_sum, m._scale_wt, m._new_caps, m._full_fit_ready(), sorted(m._caps), m._cap_lo, m._cap_hi,
            f.n_samples, sorted(f._sum.items()), sorted(f._wt.items()), m.mem_share, m.mem_weight, m.job_id)


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _change(reg: Registry, rng: random.Random, step: int) -> None:
    """One random change of the registry between updates (or none)."""
    names = sorted(reg.nodes)
    node = reg.nodes[rng.choice(names)]
    kind = rng.choice(["none", "none", "job", "end", "hello", "fewer", "record", "leave", "join"])
    if not node.gpus and kind in ("job", "record"):
        return
    if kind == "job":
        idx = tuple(sorted(rng.sample(sorted(node.gpus), k=min(2, len(node.gpus)))))
        node.bindings[f"j{step}"] = Binding(f"j{step}", node.name, idx)
    elif kind == "end" and node.bindings:
        node.bindings.pop(rng.choice(sorted(node.bindings)))
    elif kind == "hello":  # the same records in a new dict, bindings replaced by equal ones
        node.gpus = dict(node.gpus)
        node.bindings = {k: Binding(b.job_id, b.node, b.gpu_indices) for k, b in node.bindings.items()}
    elif kind == "fewer" and len(node.gpus) > 1:
        node.gpus = {i: g for i, g in node.gpus.items() if i != max(node.gpus)}
    elif kind == "record":  # a record replaced in place (another GPU at that index)
        i = rng.choice(sorted(node.gpus))
        node.gpus[i] = GpuObs(node=node.name, index=i, name="NVIDIA A100-SXM4-80GB", min_cap_w=100.0,
                              max_cap_w=400.0, max_sm_clock_mhz=1410)
    elif kind == "leave" and len(names) > 2:
        del reg.nodes[node.name]
    elif kind == "join":
        reg.nodes[f"m{step}"] = _node(f"m{step}", rng.choice([0, 2, 4]), rng)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_update_on_the_flat_sequence_equals_record_by_record(seed):
    rng = random.Random(seed)
    reg = Registry(clock=lambda: 0.0)
    for k in range(8):
        reg.nodes[f"n{k}"] = _node(f"n{k}", 4, rng)
    models = M.Models(clock=lambda: 0.0, budget_clock=lambda: 0.0, rng=random.Random(0))
    ref = _Reference()
    ready = shares = 0
    for step in range(40):
        _change(reg, rng, step)
        for node in reg.nodes.values():
            for g in node.gpus.values():
                count = rng.choice([0, 1, 1, 1, 1, 1, 1, 2]) if step % 5 else 1  # every 5th: all one sample
                g.new_samples = [_sample(rng, step + 0.1 * j) for j in range(count)]
                if rng.random() < 0.02:  # set by hand as another sequence: taken alike
                    g.new_samples = tuple(g.new_samples)
        ref.update(reg)
        models.update(reg, 1.0)
        models.forget_missing(reg)
        assert all(not g.new_samples for node in reg.nodes.values() for g in node.gpus.values())
        assert set(models.gpus) == set(ref.gpus)
        for key, r in ref.gpus.items():
            assert _close(_state(models.gpus[key]), _state(r)), (step, key)
        assert set(models.nodes) == set(ref.nodes)
        for name, r in ref.nodes.items():
            got, want = models.thermal(name), r.params()
            assert sorted(got) == sorted(want)
            for idx in want:
                assert _close(list(got[idx]), list(want[idx])), (step, name, idx)
        ready += sum(1 for m in models.gpus.values() if m._full_fit_ready())
        shares += sum(1 for m in models.gpus.values() if m.mem_weight > 0)
    assert ready > 0 and shares > 0  # both curve regimes and the memory-bound share are exercised


def test_registry_samples_are_plain_tuples_of_the_sample_fields():
    """The registry's plain tuples read as ``Sample`` (``take_samples`` makes them one)."""
    assert Sample._fields[M.S_TIME] == "time_s" and Sample._fields[M.S_MEM] == "memory_utilization_pct"
    assert [Sample._fields[i] for i in (M.S_POWER, M.S_ENFORCED, M.S_TEMP, M.S_CLOCK, M.S_REASONS, M.S_UTIL)] == [
        "power_w", "enforced_w", "temp_c", "sm_clock_mhz", "reasons", "utilization_pct"]
    reg = Registry(clock=lambda: 0.0)
    reg.nodes["n"] = _node("n", 2, random.Random(0))
    reg.nodes["n"].gpus[0].new_samples = [(1.0, 300.0, 400.0, 50.0, 1500.0, (), 90.0, math.nan)]
    taken = reg.take_samples()
    assert list(taken) == [("n", 0)]
    smp = taken[("n", 0)][0]
    assert type(smp) is Sample and smp.enforced_w == 400.0 and math.isnan(smp.memory_utilization_pct)
    assert reg.nodes["n"].gpus[0].new_samples == []
