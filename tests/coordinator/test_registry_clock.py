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
