"""The view's GPU rows (coordinator.loop.view_gpu_rows, what Coordinator._publish snapshots): the
accounted caps come from one column computation for the fleet; every row must equal the per-GPU
one (GpuObs fields, GpuObs.accounted_w, GpuObs.throttle_counts) on random fleets: readings,
zeroed samples, pending caps, acknowledged read-backs (recent and old), unusable constraints,
nodes that never reported, and the rows keep the registry's order (nodes by name, GPUs by index).

In-process: the real Registry fed real protobuf messages (sessions: the stand-ins of
test_problem_inputs)."""

from __future__ import annotations

import random

import pytest

from capctl.v1 import capctl_pb2 as pb
from coordinator import loop
from coordinator.registry import Registry
from tests.coordinator.test_problem_inputs import Session, hello, telemetry

ACK_MEMORY_S = 2.0


def _per_gpu_rows(reg, now: float) -> list:
    """The rows as _publish built them before (one method call per GPU)."""
    out = []
    for name in sorted(reg.nodes):
        gpus = reg.nodes[name].gpus
        out.append([(loop._GPU_FIELDS(g), g.accounted_w(now, ACK_MEMORY_S), g.throttle_counts(now))
                    for g in map(gpus.__getitem__, sorted(gpus))])
    return out


def _random_registry(seed: int):
    rng = random.Random(seed)
    clock = [1000.0]
    reg = Registry(clock=lambda: clock[0])
    names = [f"n{rng.randrange(10_000):05d}" for _ in range(40)]
    for name in dict.fromkeys(names):
        n_gpus = rng.randint(1, 8)
        reg.on_hello(hello(name, n_gpus=n_gpus), Session())
        node = reg.nodes[name]
        if rng.random() < 0.1:
            continue  # never reported: counted at its maximum limit
        rows = [(0.0, 0.0, 0.0) if rng.random() < 0.1 else
                (rng.uniform(200, 700), rng.uniform(100, 700), rng.uniform(30, 90)) for _ in range(n_gpus)]
        reg.on_telemetry(name, telemetry(name, 1, rows))
        for idx, g in node.gpus.items():
            r = rng.random()
            if r < 0.3:
                g.pending[rng.randint(1, 50)] = rng.uniform(200, 700)
            elif r < 0.5:
                g.last_ack_w = rng.uniform(200, 700)
                g.last_ack_mono = clock[0] - rng.choice([0.5, ACK_MEMORY_S, 3.0, 10.0])
            if rng.random() < 0.05:  # unusable constraints
                g.min_cap_w, g.max_cap_w = rng.choice([(800.0, 300.0), (float("nan"), 700.0), (200.0, 1e12)])
    reg.nodes[names[0]].gpus[0].pending[99] = 650.0
    g = reg.nodes[names[0]].gpus[0]
    reg.on_ack(names[0], pb.CapAck(seq=99, ok=True, gpus=[pb.GpuTelemetry(index=0, enforced_w=650.0, cap_w=650.0)]),
               {0: 650.0})
    clock[0] += 0.5
    return reg, clock[0], g


@pytest.mark.parametrize("seed", range(8))
def test_view_rows_equal_the_per_gpu_rows_on_random_fleets(seed):
    reg, now, _g = _random_registry(seed)
    got = loop.view_gpu_rows(reg.gpu_table(), now, ACK_MEMORY_S)
    want = _per_gpu_rows(reg, now)
    assert len(got) == len(want) == len(reg.nodes)
    for node_got, node_want in zip(got, want):
        assert len(node_got) == len(node_want)
        for (f1, acc1, th1), (f2, acc2, th2) in zip(node_got, node_want):
            assert f1 == f2 or repr(f1) == repr(f2)  # NaN fields compare unequal to themselves
            assert acc1 == pytest.approx(acc2, abs=1e-9, nan_ok=True)  # NaN max limit, no reading: NaN both ways
            assert th1 == th2


def test_view_rows_count_the_acknowledged_read_back_and_the_node_order():
    reg, now, g = _random_registry(3)
    rows = loop.view_gpu_rows(reg.gpu_table(), now, ACK_MEMORY_S)
    first = sorted(reg.nodes).index(g.node)
    fields, acc_w, _counts = rows[first][0]
    assert fields[0] == 0 and acc_w >= 650.0
    assert [r[0][0] for r in rows[first]] == sorted(reg.nodes[g.node].gpus)


def test_view_rows_of_an_empty_registry_are_empty():
    assert loop.view_gpu_rows(Registry().gpu_table(), 0.0, ACK_MEMORY_S) == []
