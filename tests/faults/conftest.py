"""Fault-injection suite (``-m faults``): one shared rig, rebuilt when a test leaves it unhealthy."""

from __future__ import annotations

import pytest

from tests.faults.rig import FaultRig


@pytest.fixture(scope="module")
def _rig_holder(tmp_path_factory):
    holder = {"rig": None, "n": 0}
    yield holder
    if holder["rig"] is not None:
        holder["rig"].stop()


@pytest.fixture
def rig(_rig_holder, tmp_path_factory):
    """A healthy :class:`FaultRig` whose sampler starts clean; invariants are asserted after the test."""
    r = _rig_holder["rig"]
    if r is None or not r.healthy():
        if r is not None:
            r.stop()
        _rig_holder["n"] += 1
        r = FaultRig(tmp_path_factory.mktemp(f"faults{_rig_holder['n']}")).start()
        _rig_holder["rig"] = r
    r.wait_no_safe_caps()  # a previous case may leave an agent in its failsafe for an interval
    r.sampler.violations.clear()
    r.safe_cap_seen.clear()
    yield r
    # every case: bounded recovery, then the invariants over the whole test
    r.sampler.sample_devices()
    r.assert_invariants()
