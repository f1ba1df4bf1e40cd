"""Coordinator high availability on a real etcd (``-m ha``): kill -9 and SIGSTOP of the leader, etcd
quorum lost, network loss between one agent and the leader, a rolling restart of both coordinators.
Every case: the rig's invariants throughout (exact journal check of every domain, no GPU above the
caps allocated to it, no binding lost; tests/ha/conftest.py)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from capctl.capstates import of as cap_state_of
from capctl.demo.processes import wait_until
from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc
from tests.ha.rig import COORDINATORS, INTERVAL_S, LEASE_S, PROXIED, TTL_S

pytestmark = pytest.mark.ha


def _other(name: str) -> str:
    return next(c for c in COORDINATORS if c != name)


def _set_budget(rig, budget_w: float) -> None:
    reply = rig.admin("SetBudget", pb.SetBudgetRequest(budget_w=budget_w))
    assert reply.ok, reply.message


def _wait_standby(rig, name: str, leader: str) -> None:
    def ok():
        st = rig.ha_status(name)
        return st is not None and st.ha_role == "standby" and st.leader == f"unix:{rig.sock(leader)}"
    wait_until(ok, 20.0, 0.05, f"{name} a standby of {leader}")


def test_standby_answers_reads_and_redirects_writes(rig):
    leader = rig.leader_name()
    standby = _other(leader)
    st = rig.ha_status(standby)
    assert (st.ha_role, st.leader, st.term) == ("standby", f"unix:{rig.sock(leader)}", rig.status().term)
    assert rig.status().standbys == [f"unix:{rig.sock(standby)}"]
    with grpc.insecure_channel(rig.coordinators[standby].admin_address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.AdminStub(ch).SetBudget(pb.SetBudgetRequest(budget_w=2500.0), timeout=5.0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"the leader is unix:{rig.sock(leader)}" in err.value.details()
    assert rig.status().budget_w == 2800.0  # nothing changed
    for name, agent in rig.agents.items():  # every agent follows the leader (n2 through its proxy)
        local = agent.status()
        assert local.coordinator_address.endswith(f"{leader}.sock"), (name, local.coordinator_address)
        assert local.plan_term == rig.status().term and local.plans_refused == 0


def _rack_limits(rig) -> dict:
    return {d.name: d.limit_w for d in rig.status().domains if d.kind == "rack"}


def test_kill9_leader_standby_takes_over(rig):
    _set_budget(rig, 2600.0)  # an admin change just before the kill: must not be lost
    # and a policy reload (a lower rack limit): it reaches only the leader; the new one reads the file
    original = rig.policy_path.read_text()
    rig.policy_path.write_text(original.replace("name: rack-b, kind: rack, limit_w: 1500", "name: rack-b, kind: rack, limit_w: 1200"))
    assert rig.admin("ReloadPolicy", pb.ReloadPolicyRequest()).ok
    new_limits = {"rack-a": 1500.0, "rack-b": 1200.0}
    wait_until(lambda: _rack_limits(rig) == new_limits, 10.0, 0.1, "the reloaded rack limit in force")
    rig.wait_settled()
    old = rig.leader_name()
    old_term = rig.status().term
    t_kill = time.monotonic()
    rig.coordinators[old].kill()
    new, term, took_s = rig.wait_failover(old, t_kill)
    print(f"\nfailover after kill -9: {took_s:.3f} s (bound TTL + 2 intervals = {TTL_S + 2 * INTERVAL_S:g} s)")
    assert new == _other(old) and term > old_term
    assert took_s < LEASE_S  # before any agent lease ran out: no fallback
    assert not rig.safe_cap_seen, f"agents fell back to safe caps: {rig.safe_cap_seen}"
    assert rig.status().budget_w == 2600.0  # from etcd
    # the file, read again at takeover (the new leader's status, one interval after it took over)
    wait_until(lambda: _rack_limits(rig) == new_limits, 10.0, 0.1, "the new leader at the reloaded rack limit")
    wait_until(lambda: sum(rig.enforced("n2")) <= 1200.0 + 1e-6, 10.0, 0.1, "rack-b within its new limit")
    rig.start_one(old)
    _wait_standby(rig, old, new)
    rig.policy_path.write_text(original)
    assert rig.admin("ReloadPolicy", pb.ReloadPolicyRequest()).ok
    _set_budget(rig, 2800.0)
    rig.wait_settled()


def test_sigstop_leader_past_its_lease_steps_down_and_never_sends_again(rig):
    old = rig.leader_name()
    proc = rig.coordinators[old]
    t_stop = time.monotonic()
    proc.signal(signal.SIGSTOP)
    try:
        new, term, took_s = rig.wait_failover(old, t_stop)
        # a new leader is elected only once the old one's etcd lease lapsed: TTL after its last
        # keepalive, sent every TTL/4 (coordinator.election), so from 3/4 TTL after the stop on
        # (it asserted more than TTL: a failover that came sooner, as it may, failed it now and then)
        assert time.monotonic() - t_stop > 0.75 * TTL_S - 0.1, took_s
    finally:
        proc.signal(signal.SIGCONT)
    _wait_standby(rig, old, new)
    assert "stepping down as leader" in proc.log_path.read_text()
    st = rig.ha_status(old)  # no frozen view of its last interval as leader shown as live
    assert st.ha_role == "standby" and len(st.nodes) == 0 and len(st.jobs) == 0 and st.enforced_w == 0.0, st
    sent = rig.plans_sent(old)
    time.sleep(3 * INTERVAL_S)
    assert rig.plans_sent(old) == sent  # the deposed leader sends nothing (its own counter)
    assert rig.plans_sent(new) > 0
    for name, agent in rig.agents.items():  # no plan of the old term reached any agent after SIGCONT
        local = agent.status()
        assert local.plans_refused == 0 and local.plan_term == term, (name, local.plans_refused, local.plan_term)
    assert not rig.safe_cap_seen
    rig.wait_settled()


def test_etcd_quorum_lost_leader_steps_down_agents_keep_caps_then_safe_caps(rig):
    leader = rig.leader_name()
    rig.etcd.stop_member(1)
    rig.etcd.stop_member(2)
    t_lost = time.monotonic()
    try:
        wait_until(lambda: rig.ha_status(leader) is not None and rig.ha_status(leader).ha_role == "standby",
                   TTL_S + 3.0, 0.05, f"{leader} steps down without an etcd quorum")
        stepped_s = time.monotonic() - t_lost
        held = {n: rig.enforced(n) for n in rig.sims}
        assert stepped_s < LEASE_S - 1.0, stepped_s
        time.sleep(0.5)  # agents keep their caps while their lease holds
        assert not rig.safe_cap_seen and {n: rig.enforced(n) for n in rig.sims} == held
        assert all(rig.ha_status(c).ha_role == "standby" for c in COORDINATORS)  # nobody leads
        wait_until(lambda: set(rig.sims) <= rig.safe_cap_seen, LEASE_S + 3.0, 0.05, "every agent at its safe caps")
        for n in rig.sims:  # the failsafe only lowers
            assert all(a <= h + 0.5 for a, h in zip(rig.enforced(n), held[n])), (n, held[n], rig.enforced(n))
            assert all(cap_state_of(g) == "SAFE_CAP" for g in rig.agents[n].status().gpus
                       if g.job_id), n
    finally:
        rig.etcd.start_member(1)
        rig.etcd.start_member(2)
    rig.wait_leader()
    rig.wait_no_safe_caps(15.0)
    rig.wait_settled()


def test_network_loss_between_one_agent_and_the_leader(rig):
    leader = rig.leader_name()
    proxy = rig.proxies[leader]
    caps_before = rig.enforced(PROXIED)
    proxy.cut()
    try:
        wait_until(lambda: PROXIED in rig.safe_cap_seen, LEASE_S + 5.0, 0.05, f"{PROXIED} at its safe caps")
        assert all(a <= b + 0.5 for a, b in zip(rig.enforced(PROXIED), caps_before))
        st = rig.status()
        assert rig.leader_name() == leader  # the leader is fine: it counts n2 stale at its caps
        assert [n.stale for n in st.nodes if n.name == PROXIED] == [True]
        assert "n1" not in rig.safe_cap_seen
    finally:
        proxy.heal()
    rig.wait_no_safe_caps(15.0)
    rig.wait_settled()


def test_rolling_restart_of_every_coordinator(rig):
    _set_budget(rig, 2700.0)
    leader = rig.leader_name()
    standby = _other(leader)
    rig.coordinators[standby].stop()  # SIGTERM: the standby first
    rig.start_one(standby)
    _wait_standby(rig, standby, leader)
    t = time.monotonic()
    rig.coordinators[leader].stop()  # SIGTERM: the leader revokes its etcd lease, the standby takes over
    new, _term, took_s = rig.wait_failover(leader, t)
    print(f"\nhand-over on SIGTERM of the leader: {took_s:.3f} s")
    assert new == standby
    rig.start_one(leader)
    _wait_standby(rig, leader, standby)
    assert not rig.safe_cap_seen
    assert rig.status().budget_w == 2700.0
    assert rig.bindings_complete()
    _set_budget(rig, 2800.0)
    rig.wait_settled()


def test_etcd_data_lost_the_new_leader_raises_its_term_and_the_agents_follow_it(rig):
    """etcd lost its data (rebuilt empty: revisions, so create revisions, so terms restart). Before,
    the agents refused every plan of the new leader for good ("term N seen") and fell back to their
    safe caps; now the leader learns their term from their hellos and raises its own above it
    (docs/ha.md, "etcd data loss"). The sampler's invariants hold throughout (conftest)."""
    from coordinator.etcdconn import EtcdConn, b64, parse_endpoints

    conn = EtcdConn(parse_endpoints(rig.etcd.endpoints))
    for i in range(60):  # revisions well above what a fresh store reaches before its first election
        conn.put("/scratch/revisions", str(i))
    leader = rig.leader_name()
    before = rig.status().term
    conn.post("kv/deleterange", {"key": b64("/capctl/leader")})  # a new election: a term above 60
    terms = []

    def on_a_term_above(floor: int):
        def ok():
            try:
                st = rig.status(1.0)
            except grpc.RpcError:
                return False
            terms[:] = [st.term]
            return st.term > floor and rig.agents_on_term(st.term)
        return ok
    wait_until(on_a_term_above(max(before, 60)), 20.0, 0.05, "re-elected above revision 60, every agent on it")
    old_term = terms[0]
    # the fault itself breaks the invariants for a moment: the node ledger (the caps the last leader
    # left each node at) is lost with etcd, so until every agent has reported the new leader counts a
    # node at the caps it last knew itself (seen: 1.8 W over the 2,800 W budget for 345 ms, in one
    # run of eight), and a plan the deposed leader sent just before may never have shown in a status
    # (the sampler's "allocated" caps); excused until recovery, asserted after it (docs/ha.md)
    rig.sampler.excuse(LEASE_S + 20.0)
    rig.etcd.lose_data()
    t = time.monotonic()
    wait_until(on_a_term_above(old_term), LEASE_S + 15.0, 0.05, "a leader above the agents' term, every agent on it")
    took_s = time.monotonic() - t
    print(f"\netcd rebuilt empty -> every agent on the new leader's term: {took_s:.2f} s (term {old_term} -> "
          f"{rig.status().term}; leader before {leader}, now {rig.leader_name()})")
    fresh = EtcdConn(parse_endpoints(rig.etcd.endpoints)).get("/capctl/leader")["create_revision"]
    assert fresh < old_term  # the case: the fresh store's revision alone was below the agents' term
    # and the admin hears of it: an override kept in etcd is gone with it (it reverted silently)
    wait_until(lambda: any("etcd lost its data?" in a and "the budget in force is" in a for a in rig.status().alerts),
               10.0, 0.05, "the data-loss alert")
    rig.wait_no_safe_caps(15.0)
    rig.wait_settled()
    rig.sampler.excuse(0)  # recovered: from here on the invariants hold again (checked after the test)
    time.sleep(4 * INTERVAL_S)
