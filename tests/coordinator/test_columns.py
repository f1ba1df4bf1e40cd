"""The decision path on arrays equals its per-GPU definitions (issue 12, item 7a).

* batched model updates (``Models.update`` -> ``_add_batch``) == ``GpuModel.add`` per sample;
* the curves as arrays (``Models.curve_arrays``) == ``Models.curve`` per GPU;
* the gathered accounting (``gpucolumns.accounted_w``) == ``GpuObs.accounted_w`` per GPU;
* ``devicedata.constraints_unusable`` == ``constraints_problem != ""`` element-wise.

Random data (seeded), within 1e-9.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from capctl import devicedata
from coordinator import gpucolumns
from coordinator import models as M
from coordinator.registry import GpuObs, NodeObs, Registry, Sample

H100 = "NVIDIA H100 80GB HBM3"
REASONS = ((), ("SW_POWER_CAP",), ("SW_THERMAL_SLOWDOWN",), ("HW_SLOWDOWN",), ("SW_POWER_CAP", "HW_SLOWDOWN"))


def _registry(rng: random.Random, nodes: int, per_node: int) -> Registry:
    reg = Registry(clock=lambda: 0.0)
    for k in range(nodes):
        name = f"n{k:03d}"
        node = NodeObs(name=name)
        for i in range(per_node):
            node.gpus[i] = GpuObs(node=name, index=i, name=H100 if rng.random() < 0.8 else "NVIDIA B200",
                                  min_cap_w=200.0, max_cap_w=700.0 if rng.random() < 0.9 else 1000.0,
                                  max_sm_clock_mhz=1980)
        reg.nodes[name] = node
    return reg


def _sample(rng: random.Random, t: float) -> Sample:
    enforced = rng.choice([0.0, rng.uniform(150.0, 700.0), float(rng.randrange(200, 700, 25))])
    temp_c = 0.0 if rng.random() < 0.02 else rng.uniform(30, 90)  # no temperature: no thermal sample
    return Sample(time_s=t, power_w=rng.uniform(0.0, 720.0), enforced_w=enforced, temp_c=temp_c,
                  sm_clock_mhz=float(rng.choice([0, rng.randrange(600, 1995, 15)])), reasons=rng.choice(REASONS),
                  utilization_pct=rng.choice([0.0, 10.0, 50.0, 100.0]))


def _state(m: M.GpuModel) -> tuple:
    f = m.curve_fit
    return (m._scale_sum, m._scale_wt, m._new_caps, m._full_fit_ready(), sorted(m._caps), m._cap_lo, m._cap_hi,
            f.n_samples,
            sorted(f._sum.items()), sorted(f._wt.items()))


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_batched_model_updates_equal_per_gpu_adds(seed):
    rng = random.Random(seed)
    reg = _registry(rng, nodes=12, per_node=4)
    models = M.Models(clock=lambda: 0.0, budget_clock=lambda: 0.0, rng=random.Random(0))
    ref: dict = {}
    ref_thermal = {name: M.NodeThermal(tuple(sorted(node.gpus)), 1.0) for name, node in reg.nodes.items()}
    for step in range(40):
        for name, node in reg.nodes.items():
            per_gpu = []
            for g in node.gpus.values():
                count = rng.choice([0, 1, 1, 1, 1, 1, 2])  # mostly one sample (the batched path), some none or two
                g.new_samples = [_sample(rng, step + 0.1 * j) for j in range(count)]
                per_gpu.append(g.new_samples)
                r = ref.setdefault(g.key, M.GpuModel(g.name, g.min_cap_w, g.max_cap_w))
                for smp in g.new_samples:
                    r.add(smp, g.max_sm_clock_mhz)
            if all(per_gpu):  # the per-node thermal path: every common time, one at a time
                for t, power, temp in M._common_times(per_gpu):
                    ref_thermal[name].add(t, power, temp)
        models.update(reg, 1.0)
    assert set(models.gpus) == set(ref)
    for key, r in ref.items():
        assert _close(_state(models.gpus[key]), _state(r)), key
    for name, r in ref_thermal.items():
        got, want = models.thermal(name), r.params()
        assert sorted(got) == sorted(want)
        for idx in want:
            assert _close(list(got[idx]), list(want[idx])), (name, idx)
    assert sum(1 for m in models.gpus.values() if m._full_fit_ready()) > 0  # both regimes are exercised
    assert sum(1 for m in models.gpus.values() if not m._full_fit_ready()) > 0


def test_curve_arrays_equal_curve_per_gpu():
    rng = random.Random(7)
    reg = _registry(rng, nodes=10, per_node=4)
    models = M.Models(clock=lambda: 1e6, budget_clock=lambda: 0.0, rng=random.Random(0))
    for step in range(30):
        for node in reg.nodes.values():
            for g in node.gpus.values():
                g.new_samples = [_sample(rng, float(step))]
        models.update(reg, 1.0)
    keys = sorted(models.gpus) + [("unknown", 0)]
    arrays = models.curve_arrays(keys)  # refits what is due (budget clock 0 < deadline)
    assert models.refits > 0
    for i, key in enumerate(keys):
        want = models.curve(key)  # nothing left to refit: the same curves
        got = arrays.curve(i)
        if want is None:
            assert got is None
            want = M.DEFAULT_CURVES["H100"]
        else:
            assert got == want, key
        assert _close([arrays.a[i], arrays.k_w[i], arrays.sat_w[i], arrays.valid_min_w[i]],
                      [want.a, want.k_w, want.sat_w, want.valid_min_w]), key


def test_gathered_accounting_equals_accounted_w_per_gpu():
    rng = random.Random(11)
    gpus = []
    for i in range(300):
        lo, hi = rng.choice([(200.0, 700.0), (0.0, 700.0), (300.0, 1e12), (200.0, 700.0)])
        g = GpuObs(node="n", index=i, min_cap_w=lo, max_cap_w=hi, default_cap_w=rng.choice([0.0, 650.0]),
                   have_reading=rng.random() < 0.8, enforced_w=rng.uniform(150, 700),
                   last_ack_w=rng.uniform(150, 700), last_ack_mono=rng.choice([-1e18, 95.0, 99.5]),
                   foreign_w=rng.choice([math.nan, math.nan, rng.uniform(150, 700), 700.0]),
                   # a foreign-writer mark: held (inf), cleared within FOREIGN_HOLD_S (at its edge), expired, none
                   foreign_clear_mono=rng.choice([math.inf, 100.0 - gpucolumns.FOREIGN_HOLD_S, 80.0, 50.0, -1e18]))
        for seq in range(rng.choice([0, 0, 1, 3])):
            g.pending[seq] = rng.uniform(150, 700)
        gpus.append(g)
    c = gpucolumns.gather([g.key for g in gpus], gpus, gpucolumns.ACCOUNTING)
    problem = gpucolumns.constraints_unusable(c["min_cap_w"], c["max_cap_w"])
    got = gpucolumns.accounted_w(c, 100.0, 2.0, problem)
    want = np.array([g.accounted_w(100.0, 2.0) for g in gpus])
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_constraints_unusable_is_constraints_problem():
    values = [0.0, 1.0, 50.0, 100.0, 200.0, 700.0, 5000.0, 5001.0, 1e12, math.inf, -math.inf, math.nan, -5.0]
    lo, hi = np.meshgrid(values, values)
    got = gpucolumns.constraints_unusable(lo.ravel(), hi.ravel())
    want = [bool(devicedata.constraints_problem(a, b)) for a, b in zip(lo.ravel(), hi.ravel())]
    assert got.tolist() == want
    assert 0 < sum(want) < len(want)


def test_static_columns_follow_hellos_and_replaced_records():
    """``GpuTable.static`` (limit constraints, device facts read once per topology and hello) equals
    the records' fields after a hello rewrites them and after a record is replaced."""
    from capctl.v1 import capctl_pb2 as pb

    reg = Registry(clock=lambda: 0.0)

    def hello(max_w: float):
        return pb.AgentHello(node="n1", gpus=[pb.GpuInfo(index=i, min_cap_w=200.0, max_cap_w=max_w + i,
                                                         default_cap_w=max_w, slowdown_temp_c=87.0,
                                                         max_sm_clock_mhz=1980) for i in range(4)])

    def check():
        t = reg.gpu_table()
        c = gpucolumns.gather(t.keys, t.gpus, static=t.static)
        for name in gpucolumns.STATIC:
            assert c[name].tolist() == [float(getattr(g, name)) for g in t.gpus], name
        return t

    reg.on_hello(hello(700.0), session=object())
    first = check().static
    assert check().static is first  # nothing changed: the same arrays
    reg.on_hello(hello(600.0), session=object())  # same records, new facts
    assert check().static["max_cap_w"].tolist() == [600.0, 601.0, 602.0, 603.0]
    reg.nodes["n1"].gpus[2] = GpuObs(node="n1", index=2, min_cap_w=100.0, max_cap_w=300.0)
    assert check().static["max_cap_w"].tolist() == [600.0, 601.0, 300.0, 603.0]
    with pytest.raises(ValueError):
        reg.gpu_table().static["min_cap_w"][0] = 1.0  # read-only: no caller changes them in place


@pytest.mark.parametrize("seed", [4, 5])
def test_batched_memory_bound_share_equals_per_gpu_update(seed):
    """The memory-bound share of one-sample GPUs, kept on the CurveBank's columns
    (``_update_memory_bound_cols``), equals the per-GPU ``_update_memory_bound`` step of the same
    samples (and GPUs with two samples, which stay on the per-GPU path), to 1e-9."""
    rng = random.Random(seed)
    reg = _registry(rng, nodes=10, per_node=4)
    models = M.Models(clock=lambda: 0.0, budget_clock=lambda: 0.0, rng=random.Random(0))
    ref: dict = {}
    for step in range(30):
        for node in reg.nodes.values():
            for g in node.gpus.values():
                count = rng.choice([0, 1, 1, 1, 2])
                g.new_samples = [_sample(rng, step + 0.1 * j)._replace(
                    memory_utilization_pct=rng.choice([math.nan, -5.0, 0.0, rng.uniform(0, 100), 150.0]))
                    for j in range(count)]  # (a Sample is a tuple: the field set on a copy)
                r = ref.setdefault(g.key, M.GpuModel(g.name, g.min_cap_w, g.max_cap_w))
                if g.new_samples and not math.isnan(g.new_samples[-1].memory_utilization_pct):
                    M._update_memory_bound([(r, g.new_samples[-1], g.max_sm_clock_mhz)])
        models.update(reg, 1.0)
    shares = {k: (r.mem_share, r.mem_weight) for k, r in ref.items()}
    assert sum(1 for w in shares.values() if w[1] > 0) > 10  # estimates exist (not all NaN)
    for key, (share, weight) in shares.items():
        m = models.gpus[key]
        assert _close([m.mem_share, m.mem_weight], [share, weight]), key
        assert models.memory_bound(key) == (share if weight > 0 else None) or _close(models.memory_bound(key), share)


def test_gather_one_pass_equals_fields_record_by_record():
    """``gpucolumns.gather`` (numeric fields in one pass, converted back to bool / int) returns each
    field exactly as read record by record: NaN, infinities, huge limits, negative counters, empty
    and non-empty pending dicts, any subset of fields in any order."""
    rng = random.Random(5)
    odd = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e12, 5e-324, 2.0 ** 52 + 1.0]
    gpus = []
    for i in range(257):
        g = GpuObs(node="n", index=i, min_cap_w=rng.choice([200.0] + odd), max_cap_w=rng.choice([700.0] + odd),
                   have_reading=rng.random() < 0.7, reading_live=rng.random() < 0.5,
                   enforced_w=rng.choice([rng.uniform(150, 700)] + odd), cap_w=rng.uniform(0, 700),
                   power_w=rng.choice([rng.uniform(0, 720), math.nan]), temp_c=rng.choice([55.0, math.nan, -40.0]),
                   sm_clock_mhz=rng.choice([0, 1980, 2 ** 31 - 1]), max_sm_clock_mhz=rng.choice([0, 1980]),
                   reasons=rng.choice(REASONS), cap_state=rng.choice(["", "OK", "LOST"]),
                   slowdown_run=rng.choice([0, 3, 2 ** 40]), oob_w=rng.choice([math.nan, 321.5]),
                   foreign_w=rng.choice([math.nan, 700.0]), foreign_clear_mono=rng.choice([math.inf, -1e18, 7.5]),
                   last_ack_mono=rng.choice([-1e18, 99.5]), sample_mono=rng.choice([-1e18, 3.25]))
        if rng.random() < 0.3:
            g.pending[i] = rng.uniform(150, 700)
        gpus.append(g)
    all_names = [n for n, _ in gpucolumns.COLUMNS]
    for names in (None, gpucolumns.ACCOUNTING, gpucolumns.STATIC, ("power_w",), ("pending", "cap_state"),
                  rng.sample(all_names, 9)):
        c = gpucolumns.gather([g.key for g in gpus], gpus, names)
        for name in (all_names if names is None else names):
            want = [getattr(g, name) for g in gpus]
            got = c[name]
            if gpucolumns._DTYPE[name] is object:
                assert isinstance(got, tuple) and all(a is b for a, b in zip(got, want)), name
                continue
            assert got.dtype == np.dtype(gpucolumns._DTYPE[name]), name
            expect = np.array(want, dtype=gpucolumns._DTYPE[name])
            np.testing.assert_array_equal(got, expect, err_msg=name)
        assert list(c.col) == (all_names if names is None else list(names))
    assert len(gpucolumns.gather((), [], gpucolumns.ACCOUNTING)["enforced_w"]) == 0
