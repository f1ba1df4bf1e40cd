"""CapManager against the compiled simulated driver through the real pynvml (issue 2, section 3)."""

from __future__ import annotations

import json
import logging
import math
import os
import stat

import pytest

from capctl.errors import UserInputError
from nodeagent.caps import (
    FOREIGN_WRITER,
    LOST,
    OK,
    OOB_LIMITED,
    RESTORE_FAILED,
    SET_FAILED,
    CapManager,
)
from nodeagent.savedstate import STATE_FILE_NAME

pytestmark = pytest.mark.integration


def limits_w(node) -> list[float]:
    return [node.read(i)["limit_w"] for i in range(node.gpu_count)]


def set_counts(node) -> list[int]:
    return [node.read(i)["set_count"] for i in range(node.gpu_count)]


class SpyBackend:
    """The real backend, recording the order of set_cap_w calls (index, cap_w)."""

    def __init__(self, backend):
        self._backend = backend
        self.sets: list[tuple[int, float]] = []

    def set_cap_w(self, index, cap_w):
        self.sets.append((index, cap_w))
        return self._backend.set_cap_w(index, cap_w)

    def __getattr__(self, name):
        return getattr(self._backend, name)


# --- pre-job limits ---------------------------------------------------------------------------


def test_restore_returns_to_the_site_limit_not_the_default(site_node, tmp_path):
    node, backend = site_node
    assert backend.devices()[0].default_cap_w == 480.0 and backend.get_cap_w(0) == 250.0
    state_dir = tmp_path / "state"
    mgr = CapManager(backend, state_dir)
    mgr.bind("job-1", [0])
    result = mgr.set_caps({0: 200.0})[0]
    assert result.ok and result.cap_w == 200.0 and node.read(0)["limit_w"] == 200.0
    assert mgr.saved_limits_w() == {0: 250.0}
    path = state_dir / STATE_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    doc = json.loads(path.read_text())
    assert doc["gpus"]["0"]["saved_limit_w"] == 250.0 and doc["bindings"] == {"job-1": [0]}
    assert sorted(os.listdir(state_dir)) == [STATE_FILE_NAME]  # no temp file left behind
    # a second write does not overwrite the saved pre-job limit with the job's cap
    mgr.set_caps({0: 220.0})
    assert mgr.saved_limits_w() == {0: 250.0}
    restored = mgr.release("job-1")
    assert restored[0].ok and restored[0].cap_w == 250.0
    assert node.read(0)["limit_w"] == 250.0  # the site limit, not the 480 W default
    assert mgr.saved_limits_w() == {} and mgr.bindings() == {}
    assert mgr.release("job-1") == {}  # epilog twice: no-op


def test_one_gpu_failing_restore_never_stops_the_others(site_node, tmp_path):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    mgr.bind("job-8", list(range(8)))
    assert all(r.ok for r in mgr.set_caps({i: 200.0 + i for i in range(8)}).values())
    node.inject(3, "set_no_permission")
    results = mgr.release("job-8")
    assert sorted(results) == list(range(8))
    assert [i for i, r in results.items() if r.ok] == [0, 1, 2, 4, 5, 6, 7]
    assert results[3].state == RESTORE_FAILED and "NO_PERMISSION" in results[3].error  # (the remedy: test_nvml_backend)
    assert limits_w(node) == [250.0] * 3 + [203.0] + [250.0] * 4
    assert mgr.saved_limits_w() == {3: 250.0}  # kept until restored
    assert mgr.states()[3] == RESTORE_FAILED
    # still failing: retried, still pending, also reported by reconcile
    assert not mgr.retry_pending()[3].ok
    assert mgr.reconcile({}) == {3: RESTORE_FAILED}
    # survives a restart of the manager
    mgr2 = CapManager(backend, tmp_path)
    assert mgr2.saved_limits_w() == {3: 250.0} and mgr2.states()[3] == RESTORE_FAILED
    node.clear(3, "set_no_permission")
    retried = mgr2.retry_pending()
    assert retried[3].ok and node.read(3)["limit_w"] == 250.0
    assert mgr2.saved_limits_w() == {} and mgr2.states()[3] == OK
    assert mgr2.retry_pending() == {}


def test_shared_gpu_is_restored_when_its_last_job_leaves(site_node, tmp_path):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    mgr.bind("a", [0, 1])
    mgr.bind("b", [1])
    mgr.set_caps({0: 300.0, 1: 300.0})
    assert mgr.job_count(1) == 2
    assert sorted(mgr.release("a")) == [0]
    assert limits_w(node)[:2] == [250.0, 300.0]
    assert mgr.saved_limits_w() == {1: 250.0}
    assert sorted(mgr.release("b")) == [1]
    assert limits_w(node)[:2] == [250.0, 250.0]


def test_bind_rejects_bad_input(site_node, tmp_path):
    _, backend = site_node
    mgr = CapManager(backend, tmp_path)
    with pytest.raises(UserInputError, match="GPU index 8 does not exist.*0..7"):
        mgr.bind("j", [0, 8])
    with pytest.raises(UserInputError, match="job_id"):
        mgr.bind("", [0])
    assert mgr.bindings() == {}


# --- writing ------------------------------------------------------------------------------------


def test_decreases_are_written_before_increases(site_node, tmp_path):
    node, backend = site_node
    spy = SpyBackend(backend)
    mgr = CapManager(spy, tmp_path)
    mgr.set_caps({0: 300.0, 1: 600.0, 2: 400.0})
    spy.sets.clear()
    results = mgr.set_caps({0: 500.0, 1: 250.0, 2: 350.0, 3: 240.0})
    assert all(r.ok for r in results.values())
    assert spy.sets == [(1, 250.0), (2, 350.0), (3, 240.0), (0, 500.0)]
    assert limits_w(node)[:4] == [500.0, 250.0, 350.0, 240.0]


def test_per_gpu_errors_do_not_abort_the_others(site_node, tmp_path):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    node.inject(1, "set_not_supported")
    node.inject(2, "gpu_lost")
    results = mgr.set_caps({0: 300.0, 1: 300.0, 2: 300.0, 3: 300.0, 4: math.nan})
    assert results[0].ok and results[3].ok
    assert results[1].state == SET_FAILED and "does not allow power limits" in results[1].error
    assert results[2].state == LOST and results[2].error_type == "GpuLostError"
    assert not results[4].ok and "cap_w" in results[4].error
    assert limits_w(node)[:5] == [300.0, 250.0, 250.0, 300.0, 250.0]
    assert mgr.states()[2] == LOST
    node.clear(2, "gpu_lost")
    assert mgr.reconcile({2: 300.0})[2] == OK and node.read(2)["limit_w"] == 300.0


def test_below_minimum_cap_is_clamped_and_saved_limit_is_kept(site_node, tmp_path):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    result = mgr.set_caps({0: 120.0})[0]
    assert result.ok and result.cap_w == 200.0 and node.read(0)["limit_w"] == 200.0
    assert mgr.saved_limits_w() == {0: 250.0}


def test_unwritable_state_dir_means_no_write(site_node, tmp_path):
    node, backend = site_node
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mgr = CapManager(backend, blocker / "state")
    before = set_counts(node)
    result = mgr.set_caps({0: 200.0})[0]
    assert not result.ok and str(blocker / "state" / STATE_FILE_NAME) in result.error
    assert set_counts(node) == before and node.read(0)["limit_w"] == 250.0
    assert mgr.saved_limits_w() == {}


# --- restart and corruption ---------------------------------------------------------------------


def test_restart_keeps_caps_bindings_and_saved_limits(site_node, tmp_path, open_backend):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    mgr.bind("j1", [0, 1])
    mgr.set_caps({0: 200.0, 1: 220.0})
    desired = {0: 200.0, 1: 220.0}
    assert mgr.reconcile(desired) == {0: OK, 1: OK}
    before = set_counts(node)
    backend.close()  # the agent process goes away ...
    backend2 = open_backend()  # ... and a new one starts
    mgr2 = CapManager(backend2, tmp_path)
    assert set_counts(node) == before and limits_w(node)[:2] == [200.0, 220.0]
    assert mgr2.bindings() == {"j1": [0, 1]} and mgr2.saved_limits_w() == {0: 250.0, 1: 250.0}
    assert mgr2.reconcile(desired) == {0: OK, 1: OK}
    assert set_counts(node) == before  # nothing re-written, nothing reset
    assert all(r.ok for r in mgr2.release("j1").values())
    assert limits_w(node)[:2] == [250.0, 250.0]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong_type"])
def test_corrupt_state_file_is_kept_aside_and_caps_never_raised(site_node, tmp_path, caplog, damage):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    mgr.bind("j1", [0])
    mgr.set_caps({0: 200.0})
    path = tmp_path / STATE_FILE_NAME
    text = path.read_text()
    path.write_text({
        "truncated": text[: len(text) // 2],
        "garbage": "\x00\x17not json",
        "wrong_type": text.replace("250.0", '"250"'),
    }[damage])
    before = set_counts(node)
    with caplog.at_level(logging.ERROR, logger="capctl.nodeagent.caps"):
        mgr2 = CapManager(backend, tmp_path)
    error = mgr2.state_file_error
    assert error is not None and str(path) in str(error) and str(path) in caplog.text
    assert error.moved_to is not None and error.moved_to.exists() and ".corrupt." in error.moved_to.name
    assert str(error.moved_to) in str(error)
    assert json.loads(path.read_text())["gpus"] == {}  # a fresh, valid file
    assert set_counts(node) == before and node.read(0)["limit_w"] == 200.0  # nothing reset
    # the job goes on; its release restores the limit in force at recovery: never higher
    mgr2.bind("j1", [0])
    mgr2.set_caps({0: 210.0})
    assert mgr2.saved_limits_w() == {0: 200.0}
    mgr2.release("j1")
    assert node.read(0)["limit_w"] == 200.0


# --- drift ----------------------------------------------------------------------------------------


def test_driver_reload_is_reapplied_within_one_reconcile(site_node, tmp_path):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    mgr.bind("j", list(range(8)))
    desired = {i: 300.0 for i in range(8)}
    assert set(mgr.reconcile(desired).values()) == {OK}
    assert limits_w(node) == [300.0] * 8
    node.driver_reload()
    assert limits_w(node) == [480.0] * 8  # back to the default
    assert set(mgr.reconcile(desired).values()) == {OK}
    assert limits_w(node) == [300.0] * 8
    assert mgr.saved_limits_w() == {i: 250.0 for i in range(8)}  # not the 480 W seen after reload
    mgr.release("j")
    assert limits_w(node) == [250.0] * 8


def test_out_of_band_limit_is_reported_and_not_fought(site_node, tmp_path):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    assert mgr.reconcile({0: 700.0, 1: 300.0}) == {0: OK, 1: OK}
    node.inject(0, "oob_limit", 500.0)
    before = set_counts(node)
    assert mgr.reconcile({0: 700.0, 1: 300.0}) == {0: OOB_LIMITED, 1: OK}
    status = mgr.status()[0]
    assert (status.cap_w, status.enforced_w, status.effective_cap_w) == (700.0, 500.0, 500.0)
    assert "500.000 W" in status.message
    assert set_counts(node) == before  # no write war with the out-of-band limit
    node.clear(0, "oob_limit")
    assert mgr.reconcile({0: 700.0, 1: 300.0}) == {0: OK, 1: OK}


def test_foreign_writer_raises_an_alarm_and_rewrites_are_rate_limited(site_node, tmp_path, clock, caplog):
    node, backend = site_node
    spy = SpyBackend(backend)
    mgr = CapManager(spy, tmp_path, clock=clock, rewrite_interval_s=30.0)
    desired = {0: 300.0, 1: 300.0}
    assert mgr.reconcile(desired) == {0: OK, 1: OK}
    node.inject(0, "foreign_writer", 600.0, period_s=5.0)  # sets 600 W now and every 5 s
    spy.sets.clear()
    states = []
    with caplog.at_level(logging.ERROR, logger="capctl.nodeagent.caps"):
        for _ in range(120):  # two minutes, one reconcile per second
            clock.advance(1.0)
            node.advance(1.0)
            states.append(mgr.reconcile(desired))
    rewrites = [s for s in spy.sets if s[0] == 0]
    assert 2 <= len(rewrites) <= 1 + 120 / 30 + 1  # first drift at once, then <= 1 per 30 s
    assert not [s for s in spy.sets if s[0] == 1]  # the other GPU is left alone
    assert states[-1] == {0: FOREIGN_WRITER, 1: OK}
    alarms = [r for r in caplog.records if "foreign writer" in r.getMessage()]
    assert 1 <= len(alarms) <= 5
    assert "GPU 0" in alarms[0].getMessage() and "600.000 W" in alarms[0].getMessage()
    # the writer goes away: re-applied, and OK once the window is quiet
    node.clear(0, "foreign_writer")
    for _ in range(150):
        clock.advance(1.0)
        node.advance(1.0)
        last = mgr.reconcile(desired)
    assert last == {0: OK, 1: OK} and node.read(0)["limit_w"] == 300.0


def test_lost_gpu_is_reported_and_recovers(site_node, tmp_path):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path)
    desired = {0: 300.0, 1: 300.0}
    mgr.reconcile(desired)
    node.inject(1, "gpu_lost")
    assert mgr.reconcile(desired) == {0: OK, 1: LOST}
    assert mgr.saved_limits_w() == {0: 250.0, 1: 250.0}
    node.clear(1, "gpu_lost")
    assert mgr.reconcile(desired) == {0: OK, 1: OK}


def test_restore_is_held_below_the_coordinators_allowance_then_completes(site_node, tmp_path):
    """A managed GPU's restore never rises above the coordinator's allowance (the budget holds);
    it stays pending and completes once the allowance reaches the saved pre-job limit."""
    node, backend = site_node
    mgr = CapManager(backend, tmp_path / "state")
    mgr.bind("job-1", [0])
    assert mgr.set_caps({0: 200.0})[0].ok
    restored = mgr.release("job-1", ceiling_w={0: 220.0})
    assert restored[0].ok and node.read(0)["limit_w"] == 220.0  # held at the allowance, not 250 W
    assert mgr.saved_limits_w() == {0: 250.0}  # still to be restored
    assert mgr.retry_pending() == {}  # nothing to do while the allowance stays at 220 W
    assert node.read(0)["limit_w"] == 220.0
    mgr.set_restore_ceiling(0, 300.0)  # the coordinator raised the idle GPU's allowance
    retried = mgr.retry_pending()
    assert retried[0].ok and node.read(0)["limit_w"] == 250.0  # the site limit, never 300 W
    assert mgr.saved_limits_w() == {}
    assert mgr.states()[0] == OK


def test_a_restore_held_at_a_fractional_milliwatt_allowance_succeeds(site_node, tmp_path):
    """The coordinator's allowances are floats (348.2347 W): the backend writes them rounded DOWN to
    whole mW (348234 mW, never above the allowance). The restore checks the read-back against what
    it wrote, so such a held restore is a success, not a "another writer?" failure retried forever
    (the flake of tests/agent/test_agent_coordinator.py's JobEnd: 348.235 W vs 348.234 W)."""
    node, backend = site_node
    mgr = CapManager(backend, tmp_path / "state")
    mgr.bind("job-1", [0, 1])
    assert all(r.ok for r in mgr.set_caps({0: 200.0, 1: 200.0}).values())
    restored = mgr.release("job-1", ceiling_w={0: 248.2347, 1: 230.0004})  # 248234.7 and 230000.4 mW
    assert [restored[i].ok for i in (0, 1)] == [True, True], restored
    assert node.read(0)["limit_w"] == 248.234 and node.read(1)["limit_w"] == 230.0  # rounded down
    assert mgr.states()[0] == OK and mgr.states()[1] == OK
    assert mgr.saved_limits_w() == {0: 250.0, 1: 250.0}  # held below the site limit: still pending
    assert mgr.retry_pending() == {}  # held at the allowance: nothing to write again
    mgr.set_restore_ceiling(0, 260.0004)  # above the saved limit: the restore completes at 250 W
    assert mgr.retry_pending()[0].ok and node.read(0)["limit_w"] == 250.0
    assert mgr.saved_limits_w() == {1: 250.0}


def test_a_foreign_write_over_a_held_restore_is_undone_and_reported(site_node, tmp_path, clock):
    """An idle GPU whose restore is held at the coordinator's allowance (220 W of its 250 W pre-job
    limit) gets 400 W from another process: re-written at once the first time, FOREIGN_WRITER (which
    the coordinator holds as spent) when it repeats. Before, a held restore was never read back: a
    try-out saw 700 W stay on such a GPU, state OK, with the cluster over its budget for 25 s."""
    node, backend = site_node
    mgr = CapManager(backend, tmp_path, clock=clock, rewrite_interval_s=3.0)
    mgr.bind("j", [0])
    assert mgr.set_caps({0: 200.0})[0].ok
    mgr.release("j", ceiling_w={0: 219.9996})  # an allowance the device keeps as 219.999 W
    for _ in range(3):  # its milliwatt rounding is no drift (it was taken as a foreign writer)
        clock.advance(1.0)
        node.advance(1.0)
        assert mgr.reconcile({}) == {0: OK} and node.read(0)["limit_w"] == pytest.approx(219.999, abs=1e-6)
    assert mgr.saved_limits_w() == {0: 250.0}  # held
    node.inject(0, "foreign_writer", 400.0, period_s=2.0)  # 400 W now and every 2 s
    clock.advance(1.0)
    node.advance(1.0)
    mgr.reconcile({})
    assert node.read(0)["limit_w"] == pytest.approx(220.0, abs=0.002) and mgr.states()[0] == OK  # a one-off: re-written at once
    seen = []
    for _ in range(12):
        clock.advance(1.0)
        node.advance(1.0)
        seen.append((mgr.reconcile({}).get(0), node.read(0)["limit_w"]))
    assert seen[-1][0] == FOREIGN_WRITER and any(abs(lim - 220.0) < 0.002 for _, lim in seen[4:])  # rate-limited rewrites
    node.clear(0, "foreign_writer")
    for _ in range(40):
        clock.advance(1.0)
        node.advance(1.0)
        last = mgr.reconcile({})
    assert last[0] == OK and node.read(0)["limit_w"] == pytest.approx(220.0, abs=0.002) and mgr.saved_limits_w() == {0: 250.0}
