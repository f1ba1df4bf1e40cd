"""HA suite (``-m ha``): one shared rig (two coordinators on a 3-member etcd, two agents), rebuilt
when a test leaves it unhealthy; the fault rig's invariants are asserted after every test."""

from __future__ import annotations

import time

import pytest

from tests.ha.rig import HaRig


@pytest.fixture(scope="module")
def _ha_holder():
    holder = {"rig": None, "n": 0}
    yield holder
    if holder["rig"] is not None:
        holder["rig"].stop()


@pytest.fixture
def rig(_ha_holder, tmp_path_factory):
    """A healthy :class:`HaRig` whose sampler starts clean; invariants asserted after the test."""
    r = _ha_holder["rig"]
    if r is None or not r.healthy():
        if r is not None:
            r.stop()
        _ha_holder["n"] += 1
        r = HaRig(tmp_path_factory.mktemp(f"ha{_ha_holder['n']}")).start()
        _ha_holder["rig"] = r
    r.wait_no_safe_caps(15.0)
    r.sampler.violations.clear()
    r.safe_cap_seen.clear()
    r.sampler.start_ns = time.monotonic_ns()  # the journal check (and its maximum) covers this test
    r.sampler.max_domain_w.clear()
    yield r
    r.sampler.sample_devices()
    r.assert_invariants()
    print(f"\nmax sum of enforced limits per domain (journal): "
          f"{ {k: round(v, 3) for k, v in r.sampler.max_domain_w.items()} }")
