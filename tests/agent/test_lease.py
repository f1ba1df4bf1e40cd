"""Lease and failsafe arithmetic of the agent (pure logic; the process-level behaviour is in
test_agent_link.py)."""

from __future__ import annotations

from nodeagent.lease import Lease, failsafe_caps, late_s


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


def test_a_plan_past_its_lease_expiry_renews_nothing():
    """``lease_expiry_s`` not after the agent's wall clock on arrival: late (``late_s``, s), and the
    lease is not renewed: one still held ends now, one run out stays as it is (its failsafe, applied
    already, not re-armed). A coordinator clock ahead or no absolute expiry is never late."""
    assert late_s(5000.0, 5012.5) == 12.5 and late_s(5000.0, 5000.0) == 0.0
    assert late_s(5000.1, 5000.0) is None and late_s(0.0, 5000.0) is None and late_s(9e9, 5000.0) is None
    lease = Lease()
    assert lease.renew(10.0, 5010.0, now_mono_s=100.0, now_unix_s=5000.0)
    assert not lease.renew(10.0, 4990.0, now_mono_s=102.0, now_unix_s=5000.0)  # late: the lease ends
    assert lease.expiry_mono_s == 102.0 and lease.expired(102.0) and not lease.expired_applied
    lease.expired_applied = True  # (the failsafe ran)
    assert not lease.renew(10.0, 5000.0, now_mono_s=105.0, now_unix_s=5000.0)  # exactly at its expiry: late
    assert lease.expiry_mono_s == 102.0 and lease.expired_applied  # not re-armed, not moved
    assert lease.renew(10.0, 5000.5, now_mono_s=106.0, now_unix_s=5000.0)  # in time: renewed for 0.5 s
    assert lease.active(106.4) and lease.expired(106.5) and not lease.expired_applied
    fresh = Lease()
    assert not fresh.renew(10.0, 4000.0, now_mono_s=1.0, now_unix_s=5000.0) and fresh.expired(1.0)
    assert not Lease().renew(0.0, 0.0, now_mono_s=1.0, now_unix_s=5000.0)  # no lease fields: nothing held


def test_safe_caps_updated_per_gpu():
    lease = Lease()
    lease.set_safe_caps({0: 300, 1: 320})
    lease.set_safe_caps({})
    assert lease.safe_caps_w == {0: 300.0, 1: 320.0}
    lease.set_safe_caps({1: 250})  # a plan naming a subset: the others keep their safe cap
    assert lease.safe_caps_w == {0: 300.0, 1: 250.0}
    # a plan past its lease expiry: only lower safe caps (a GPU without one takes it); bad ones refused
    refused = lease.set_safe_caps({0: 310, 1: 240, 2: 200, 3: float("nan"), 4: -1.0}, only_lower=True)
    assert sorted(refused) == [3, 4]
    assert lease.safe_caps_w == {0: 300.0, 1: 240.0, 2: 200.0}
