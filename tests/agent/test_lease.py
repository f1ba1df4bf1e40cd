"""Lease and failsafe arithmetic of the agent (pure logic; the process-level behaviour is in
test_agent_link.py)."""

from __future__ import annotations

from nodeagent.lease import Lease, failsafe_caps


def test_failsafe_caps_never_raise():
    current = {0: 500.0, 1: 260.0, 2: 450.0, 3: 700.0}
    safe = {0: 300.0, 1: 350.0, 2: 450.0, 4: 200.0}
    assert failsafe_caps(current, safe) == {0: 300.0}  # 1: safe above current; 2: equal; 3: no safe cap
    assert failsafe_caps({0: 500.0}, {0: 0.0}) == {}  # a zero safe cap is "none", never a write of 0 W


def test_lease_renew_uses_monotonic_and_bounded_by_absolute_expiry():
    lease = Lease()
    assert not lease.active(0.0) and not lease.expired(0.0)  # no lease yet: no failsafe
    lease.renew(10.0, 0.0, now_mono_s=100.0, now_unix_s=5000.0)
    assert lease.active(109.9) and lease.expired(110.0)
    # coordinator clock far ahead: its absolute expiry cannot stretch the lease beyond lease_s
    lease.renew(10.0, 9e9, now_mono_s=200.0, now_unix_s=5000.0)
    assert lease.expired(210.0)
    # absolute expiry sooner than lease_s (e.g. the plan was delayed in flight): the sooner one wins
    lease.renew(10.0, 5003.0, now_mono_s=300.0, now_unix_s=5000.0)
    assert lease.active(302.9) and lease.expired(303.0)
    lease.expired_applied = True
    lease.renew(10.0, 0.0, now_mono_s=400.0, now_unix_s=5000.0)
    assert not lease.expired_applied  # a renewal re-arms the failsafe


def test_safe_caps_updated_per_gpu():
    lease = Lease()
    lease.set_safe_caps({0: 300, 1: 320})
    lease.set_safe_caps({})
    assert lease.safe_caps_w == {0: 300.0, 1: 320.0}
    lease.set_safe_caps({1: 250})  # a plan naming a subset: the others keep their safe cap
    assert lease.safe_caps_w == {0: 300.0, 1: 250.0}
