"""The node ledger as the coordinator saves it (coordinator.loop.ledger_rows): every GPU counted at
max(accounted cap, planned cap, floor), per the per-GPU rule GpuObs.accounted_w (pending caps, a
recent acknowledged read-back, no reading: the maximum limit), with its limits and safe cap.

In-process: the real Registry fed real protobuf messages (sessions: the stand-ins of
test_problem_inputs)."""

from __future__ import annotations

from capctl.v1 import capctl_pb2 as pb
from coordinator.loop import ledger_rows
from coordinator.registry import Registry
from tests.coordinator.test_problem_inputs import Session, hello, telemetry

ACK_MEMORY_S = 2.0


def _registry():
    now = [100.0]
    reg = Registry(clock=lambda: now[0])
    for n in ("node1", "node2", "node3"):
        reg.on_hello(hello(n, n_gpus=3), Session())
    reg.on_telemetry("node1", telemetry("node1", 1, [(450.0, 440.0, 50.0), (500.0, 480.0, 55.0), (300.0, 290.0, 60.0)]))
    reg.on_telemetry("node2", telemetry("node2", 1, [(600.0, 590.0, 50.0), (0.0, 0.0, 0.0), (350.0, 340.0, 52.0)]))
    # node3 never reported: counted at its maximum limit
    reg.nodes["node1"].gpus[0].pending[5] = 620.0  # a cap sent, not acknowledged
    reg.nodes["node1"].gpus[2].safe_cap_w = 250.0
    g = reg.nodes["node2"].gpus[2]
    g.pending[3] = 480.0
    reg.on_ack("node2", pb.CapAck(seq=3, ok=True, gpus=[pb.GpuTelemetry(index=2, enforced_w=480.0, cap_w=480.0)]),
               {2: 480.0})
    now[0] += 0.5
    return reg, now[0]


def test_ledger_rows_count_every_gpu_by_the_per_gpu_rule_planned_and_floor():
    reg, now = _registry()
    planned = {("node1", 1): 650.0, ("node1", 2): 100.0}  # 100 W below what it counts: no effect
    floor = {("node2", 0): 640.0, ("node3", 1): 10.0}
    ledger, saved = ledger_rows(reg, now, ACK_MEMORY_S, planned, floor)
    assert set(ledger) == {"node1", "node2", "node3"}
    for name, node in reg.nodes.items():
        assert ledger[name]["seen_s"] == node.seen_s
        assert set(ledger[name]["gpus"]) == set(node.gpus)
        for idx, g in node.gpus.items():
            key = (name, idx)
            want = max(g.accounted_w(now, ACK_MEMORY_S), planned.get(key, 0.0), floor.get(key, 0.0))
            assert ledger[name]["gpus"][idx] == [want, g.min_cap_w, g.max_cap_w, g.safe_cap_w], key
            assert saved[key] == want
    # the facts behind the rule, spelled out
    assert saved[("node1", 0)] == 620.0  # pending cap above the read-back
    assert saved[("node1", 1)] == 650.0  # planned increase
    assert saved[("node1", 2)] == 300.0 and ledger["node1"]["gpus"][2][3] == 250.0
    assert saved[("node2", 0)] == 640.0  # the floor (the write-ahead's high-water mark)
    assert saved[("node2", 1)] == 700.0  # zeroed sample: no reading, its maximum limit
    assert saved[("node2", 2)] == 480.0  # acknowledged read-back
    assert all(saved[("node3", i)] == 700.0 for i in range(3))  # never reported


def test_ledger_rows_of_an_empty_registry_are_empty():
    assert ledger_rows(Registry(), 0.0, ACK_MEMORY_S, {}, {}) == ({}, {})
