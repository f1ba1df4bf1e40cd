"""The registry forgets silent nodes on its monotonic clock, never on wall time."""

from __future__ import annotations

import time

from coordinator.registry import Registry


def test_forget_silent_uses_the_monotonic_clock_not_wall_time():
    now = [1000.0]
    reg = Registry(clock=lambda: now[0])
    ledger = {"n1": {"gpus": {0: (400.0, 200.0, 700.0, 300.0)}, "seen_s": time.time() - 10.0}}
    assert reg.restore_ledger(ledger, forget_s=100.0) == 1
    assert reg.nodes["n1"].seen_mono == pytest_approx(990.0)
    assert reg.forget_silent(100.0) == []  # silent for 10 s: kept
    now[0] = 1085.0
    assert reg.forget_silent(100.0) == []  # 95 s
    now[0] = 1095.0
    assert reg.forget_silent(100.0) == ["n1"]  # 105 s: forgotten
    assert "n1" not in reg.nodes


def pytest_approx(value: float):
    import pytest

    return pytest.approx(value, abs=0.5)


def test_a_policy_node_is_never_forgotten_nor_its_old_ledger_entry_dropped():
    # a dead agent's GPUs keep their last caps: a node the policy lists stays counted at them
    now = [1000.0]
    reg = Registry(clock=lambda: now[0])
    old = time.time() - 3 * 86400.0
    ledger = {"n1": {"gpus": {0: (400.0, 200.0, 700.0, 300.0)}, "seen_s": old},
              "x9": {"gpus": {0: (500.0, 200.0, 700.0, 300.0)}, "seen_s": old}}
    assert reg.restore_ledger(ledger, forget_s=86400.0, keep=frozenset({"n1"})) == 1
    assert list(reg.nodes) == ["n1"] and reg.nodes["n1"].gpus[0].accounted_w(now[0], 5.0) == 400.0
    reg.restore_ledger({"x9": {"gpus": {0: (500.0, 200.0, 700.0, 300.0)}, "seen_s": time.time()}}, 86400.0)
    now[0] += 10 * 86400.0
    assert reg.forget_silent(86400.0, keep=frozenset({"n1"})) == ["x9"]  # outside the policy: forgotten
    assert list(reg.nodes) == ["n1"]


def test_the_coordinator_keeps_its_policy_nodes(tmp_path, monkeypatch):
    from coordinator import loop
    from tests.coordinator.conftest import write_policy

    from capctl.policy import load_policy

    path = write_policy(tmp_path / "policy.yaml", nodes=["n1", "n2"], budget_w=3000.0)
    coord = loop.Coordinator(load_policy(str(path)), str(path))
    now = [1000.0]
    coord.registry.clock = lambda: now[0]
    ledger = {name: {"gpus": {0: (400.0, 200.0, 700.0, 300.0)}, "seen_s": time.time()} for name in ("n1", "x9")}
    assert coord.registry.restore_ledger(ledger, loop.NODE_FORGET_S) == 2
    now[0] += 2 * loop.NODE_FORGET_S
    coord._after_plans(None)
    assert sorted(coord.registry.nodes) == ["n1"]


def test_a_forgotten_node_back_charges_no_energy_from_before_it_was_forgotten():
    # its agent's energy counter kept counting while the node was forgotten (a day): the first
    # report after its return starts the counter again; before 7 Dec 2026 the registry kept the
    # counter's old value and charged the job bound now the whole gap (86,400 s x 700 W here)
    from capctl.v1 import capctl_pb2 as pb

    now = [1000.0]
    reg = Registry(clock=lambda: now[0])
    job = [pb.JobBinding(job_id="j1", node="n1", gpu_indices=[0])]

    def hello():
        reg.on_hello(pb.AgentHello(node="n1", gpus=[pb.GpuInfo(index=0, uuid="GPU-a", min_cap_w=200.0, max_cap_w=700.0)],
                                   jobs=job), session=object())

    def report(energy_j: float):
        reg.on_telemetry("n1", pb.NodeTelemetry(node="n1", seq=1, gpus=[pb.GpuTelemetry(
            index=0, power_w=700.0, cap_w=700.0, enforced_w=700.0, temp_c=60.0, energy_j=energy_j)]))

    hello()
    report(1000.0)
    now[0] += 1.0
    report(1700.0)
    assert reg.job_energy_j["j1"] == 700.0
    reg.on_disconnect("n1", reg.nodes["n1"].session)
    now[0] += 2 * 86400.0
    assert reg.forget_silent(86400.0) == ["n1"]
    hello()
    report(1700.0 + 700.0 * 86400.0)
    now[0] += 1.0
    report(1700.0 + 700.0 * 86401.0)
    assert reg.job_energy_j["j1"] == 1400.0  # the second after its return, not the day before it
