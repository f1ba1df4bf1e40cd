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
