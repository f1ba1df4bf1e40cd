"""The election and the admin-state store on a real 3-member etcd (``-m ha``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from capctl.demo.processes import wait_until
from coordinator.election import Leadership
from coordinator.etcdconn import EtcdConn, b64, parse_endpoints
from coordinator.etcdstore import EtcdStore
from coordinator.store import StoreError
from tests.etcdcluster import EtcdCluster

pytestmark = pytest.mark.ha


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


def _leader_and_standby(conn, prefix: str) -> tuple[Leadership, Leadership]:
    """A elected under ``prefix``, then B started and seeing A lead; the caller stops both."""
    a = Leadership(conn, prefix, "A", "unix:/a").start()
    wait_until(a.may_send, 10.0, 0.02, "A elected")
    b = Leadership(conn, prefix, "B", "unix:/b").start()
    try:
        wait_until(lambda: b.leader == "unix:/a", 10.0, 0.02, "B sees A lead")
    except BaseException:
        b.stop()
        a.stop()
        raise
    return a, b


def test_one_leader_newer_terms_and_fenced_writes(etcd):
    conn = EtcdConn(parse_endpoints(etcd.endpoints))
    a, b = _leader_and_standby(conn, "/t1")
    try:
        assert not b.may_send() and b.describe()["role"] == "standby"
        store_a, store_b = EtcdStore(conn, "/t1", a), EtcdStore(conn, "/t1", b)
        store_a.set_budget_override(2500.0, 2800.0)
        with pytest.raises(StoreError, match="not the leader"):
            store_b.set_budget_override(1.0, 2800.0)
        term_a = a.term
        a._stop.set()  # A freezes: no keep-alive, no revoke
        a._thread.join()
        wait_until(b.may_send, 10.0, 0.02, "B elected after A's lease expired")
        assert b.term > term_a and not a.may_send()
        a.term, a._deadline_mono = term_a, time.monotonic() + 60  # a deposed leader that believes it leads
        with pytest.raises(StoreError, match="no longer ours"):
            store_a.set_budget_override(9999.0, 2800.0)  # fenced by the leader key's create revision
        assert store_b.budget_override()["budget_w"] == 2500.0  # the change before the failover is kept
        store_b.save_nodes({"n1": {"gpus": {0: [300.0, 200.0, 700.0, 250.0]}, "seen_s": 1.0}})
        assert store_a.load_nodes() == {"n1": {"gpus": {0: [300.0, 200.0, 700.0, 250.0]}, "seen_s": 1.0}}
    finally:
        b.stop()
        a.term = 0
        a._lease_id = 0
    assert conn.get("/t1/leader") is None  # revoked on stop: the next one takes over at once


def test_finished_jobs_in_etcd_are_fenced_listed_and_expired(etcd):
    """Issue 15's admin state includes finished jobs: kept in etcd (shared by the coordinators),
    written only by the leader, listed newest first, and bounded by the retention."""
    from coordinator.etcdfinished import EtcdFinishedJobs
    from coordinator.finished import FinishedJob, Retention

    conn = EtcdConn(parse_endpoints(etcd.endpoints))
    a, b = _leader_and_standby(conn, "/t9")
    try:
        now = time.time()
        leader = EtcdFinishedJobs(conn, "/t9", Retention(max_age_s=3600.0, max_jobs=3), leadership=a)
        standby = EtcdFinishedJobs(conn, "/t9", Retention(max_age_s=3600.0, max_jobs=3), leadership=b)
        for k in range(4):
            leader.put(FinishedJob(job_id=f"j{k}", end_time_s=now - 100 + k, energy_j=1000.0 + k, nodes=("n1",)))
        with pytest.raises(StoreError, match="not the leader"):
            standby.put(FinishedJob(job_id="x", end_time_s=now))
        assert standby.get("j2").energy_j == 1002.0 and standby.get("x") is None  # one store for all
        assert [j.job_id for j in standby.since(0.0)] == ["j3", "j2", "j1", "j0"]
        assert [j.job_id for j in standby.since(now - 98.5, limit=1)] == ["j3"]
        leader.put(FinishedJob(job_id="old", end_time_s=now - 7200.0))
        assert leader.expire(now) == 2  # beyond 3 records the oldest go, and anything past 1 h
        assert [j.job_id for j in standby.since(0.0)] == ["j3", "j2", "j1"]
        conn.put("/t9/finished/garbage", b"not json")
        assert [j.job_id for j in standby.since(0.0)] == ["j3", "j2", "j1"]  # a bad record is skipped
    finally:
        b.stop()
        a.stop()


def test_etcd_over_mutual_tls_and_clear_text_refused_on_the_network(tmp_path):
    """A 1-member etcd with https:// and --client-cert-auth: the election runs with --etcd-ca/cert/key;
    without the client certificate, or with another CA, no member answers. Clear text to a
    non-loopback member is refused unless --insecure."""
    from capctl.errors import UserInputError
    from coordinator.etcdconn import EtcdError, EtcdTls, check_tls
    from coordinator.hadaemon import HaSetup
    from tests.etcdcluster import HOSTS
    from tests.support.certs import issue, make_ca

    ca = make_ca(tmp_path / "pki")
    srv = issue(ca, tmp_path / "pki", "etcd", "etcd", ips=HOSTS, server=True, client=True)
    cli = issue(ca, tmp_path / "pki", "coord", "capctl-coordinator")
    other = make_ca(tmp_path / "pki", "other", "another CA")
    tls = EtcdTls(str(ca.cert_path), str(cli.cert_path), str(cli.key_path))
    with EtcdCluster(tmp_path / "etcd", members=1,
                     tls=(ca.cert_path, srv.cert_path, srv.key_path, cli.cert_path, cli.key_path)) as etcd:
        assert etcd.endpoints.startswith("https://")
        args = SimpleNamespace(etcd_endpoints=etcd.endpoints, etcd_prefix="/tls", etcd_lease_ttl_s=2, etcd_ca=tls.ca_file,
                               etcd_cert=tls.cert_file, etcd_key=tls.key_file, insecure=False, advertise=None)
        conn = HaSetup(args).conn  # the daemon's own flags -> connection
        a = Leadership(conn, "/tls", "A", "unix:/a").start()
        try:
            wait_until(a.may_send, 10.0, 0.02, "A elected over mutual TLS")
            assert conn.get("/tls/leader")["value"].decode().find("unix:/a") >= 0
        finally:
            a.stop()
        for bad in (EtcdTls(str(ca.cert_path)), EtcdTls(str(other.cert_path), str(cli.cert_path), str(cli.key_path))):
            with pytest.raises(EtcdError, match="no member answered"):
                EtcdConn(parse_endpoints(etcd.endpoints), tls=bad).get("/tls/leader")
    far = parse_endpoints("http://10.0.0.5:2379,http://127.0.0.1:2379")
    with pytest.raises(UserInputError, match=r"--etcd-endpoints http://10\.0\.0\.5:2379: clear text to etcd"):
        check_tls(far, EtcdTls(), insecure=False)
    check_tls(far, EtcdTls(), insecure=True)  # allowed, with a warning
    check_tls(parse_endpoints("http://127.0.0.1:2379"), EtcdTls(), insecure=False)  # loopback
    with pytest.raises(UserInputError, match="--etcd-cert and --etcd-key go together"):
        check_tls(parse_endpoints(etcd.endpoints), EtcdTls(cert_file=tls.cert_file), insecure=False)
    with pytest.raises(UserInputError, match="every etcd endpoint is http://"):
        check_tls(parse_endpoints("http://127.0.0.1:2379"), tls, insecure=False)
    with pytest.raises(UserInputError, match=r"--etcd-ca /nonexistent/ca.pem: cannot read it"):
        check_tls(parse_endpoints(etcd.endpoints), EtcdTls("/nonexistent/ca.pem"), insecure=False)
    fifo = tmp_path / "ca.fifo"
    os.mkfifo(fifo)  # a plain open() of a FIFO blocks the coordinator's start
    with pytest.raises(UserInputError, match=r"--etcd-ca .*ca.fifo: not a regular file"):
        check_tls(parse_endpoints(etcd.endpoints), EtcdTls(str(fifo)), insecure=False)
    open_key = tmp_path / "open.key"
    open_key.write_bytes(Path(tls.key_file).read_bytes())
    open_key.chmod(0o644)
    with pytest.raises(UserInputError, match=r"--etcd-key .*open.key: private key readable by every user \(mode 0644\)"):
        check_tls(parse_endpoints(etcd.endpoints), EtcdTls(tls.ca_file, tls.cert_file, str(open_key)), insecure=False)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(UserInputError, match=r"--etcd-ca .*junk.pem: not PEM CA certificates"):
        check_tls(parse_endpoints(etcd.endpoints), EtcdTls(str(junk)), insecure=False)
    with pytest.raises(UserInputError, match="not a PEM certificate and its key"):  # swapped
        check_tls(parse_endpoints(etcd.endpoints), EtcdTls(tls.ca_file, tls.key_file, tls.cert_file), insecure=False)
    assert EtcdConn(parse_endpoints("http://[::1]:2379")).endpoints == ["http://[::1]:2379"]
    no_ha = SimpleNamespace(etcd_endpoints=None, etcd_ca=tls.ca_file, etcd_cert=None, etcd_key=None)
    with pytest.raises(UserInputError, match="--etcd-ca given without --etcd-endpoints"):
        HaSetup.from_args(no_ha, SimpleNamespace(coordinator=SimpleNamespace(etcd=None)))


@pytest.mark.parametrize("how", ["key deleted", "stepped down"])
def test_a_deposed_leader_leads_again_only_under_a_newer_term(etcd, how):
    """An operator deletes the leader key, or the leader steps down when no keep-alive was confirmed
    in time (etcd without quorum) while etcd keeps its lease and so its leader key (etcd renews
    leases on a change of its own leader). Either way it leads again only under a higher term
    (docs/ha.md). The second was found by a try-out: after a 27 s quorum loss the same coordinator
    was elected with the same term 138."""
    prefix = "/t2" if how == "key deleted" else "/t3"
    conn = EtcdConn(parse_endpoints(etcd.endpoints))
    changes = []
    a = Leadership(conn, prefix, "A", "unix:/a", on_change=changes.append).start()
    try:
        wait_until(a.may_send, 10.0, 0.02, "A elected")
        term, lease = a.term, a._lease_id
        if how == "key deleted":
            conn.post("kv/deleterange", {"key": b64(f"{prefix}/leader")})
        else:
            a._lose("test: no keep-alive confirmed in time")  # the lease lives on at etcd
        wait_until(lambda: len(changes) >= 3 and a.term > 0, 10.0, 0.02, "A elected again")
        assert a.term > term and conn.get(f"{prefix}/leader")["create_revision"] == a.term
        assert a._lease_id == lease  # the same lease: only the key was made anew
        assert changes == [True, False, True]
    finally:
        a.stop()


def test_a_leader_below_a_term_agents_have_seen_raises_its_term_and_later_leaders_stay_above(etcd):
    """etcd lost its data (revisions restart): agents had seen term 5,000, far above any create
    revision of a fresh store, and refused every plan of the new leader for good. The leader raises
    the term base (fenced) so its term is one above what an agent reports; the next leader's term is
    above that one's (the base only grows), so a deposed leader's plans stay refused (docs/ha.md)."""
    prefix = "/t4"
    conn = EtcdConn(parse_endpoints(etcd.endpoints))
    a, b = _leader_and_standby(conn, prefix)
    try:
        low = a.plan_term
        assert low == a.term and a.term_base == 0 and 0 < low < 5000  # no base yet: the create revision
        assert not a.want_term_above(low - 1) and not a.want_term_above(low)  # at or below ours (every agent
        # that reconnects reports the leader's own term): nothing to do
        assert not b.want_term_above(5000)  # a standby raises nothing
        assert a.want_term_above(5000)
        wait_until(lambda: a.plan_term == 5001, 10.0, 0.02, "A's term raised above the agents'")
        assert int(conn.get(f"{prefix}/term_base")["value"]) == 5001 - a.term
        assert a.describe()["term"] == 5001
        wait_until(lambda: b.describe()["term"] == 5001, 10.0, 0.02, "the standby shows the leader's raised term")
        assert not a.want_term_above(2 ** 48) and not a.want_term_above(2 ** 64 - 1)  # MAX_TERM and beyond:
        # logged, not followed
        assert not a.want_term_above(5001)  # a reconnect at the raised term: no second raise
        time.sleep(1.0)  # (two election rounds)
        assert a.plan_term == 5001
        raised = a.plan_term
        conn.post("kv/deleterange", {"key": b64(f"{prefix}/leader")})  # A deposed: B or A leads anew
        wait_until(lambda: (a.may_send() or b.may_send()) and max(a.plan_term, b.plan_term) > raised, 10.0, 0.02,
                   "a new leader, under a term above the raised one")
        assert max(a.plan_term, b.plan_term) < raised + 50  # create revision + the same base: no jump
    finally:
        b.stop()
        a.stop()


def test_a_term_base_that_is_no_integer_reads_as_zero(etcd, caplog):
    prefix = "/t5"
    conn = EtcdConn(parse_endpoints(etcd.endpoints))
    conn.put(f"{prefix}/term_base", "-3 watts")
    a = Leadership(conn, prefix, "A", "unix:/a").start()
    try:
        wait_until(a.may_send, 10.0, 0.02, "A elected")
        assert a.term_base == 0 and a.plan_term == a.term
        assert "/t5/term_base holds '-3 watts', not a term base" in caplog.text
    finally:
        a.stop()


def test_a_new_leader_whose_file_says_another_budget_keeps_the_admins_override_and_runs_the_lower(etcd, tmp_path):
    """An admin's ``budget set`` under leader A's file (2,800 W); B takes over with a file that says
    another budget. Before, B took its file for the admin's newer word: it cleared the override
    in etcd and ran its own budget, 3,200 W, above the admin's 2,500 W (found by a review). Now B
    runs the lower of the two, keeps the override, and says why until a reload settles it."""
    import asyncio

    from capctl.policy import load_policy
    from coordinator import ha
    from coordinator.loop import Coordinator

    conn = EtcdConn(parse_endpoints(etcd.endpoints))
    a, b = _leader_and_standby(conn, "/t12")
    try:
        EtcdStore(conn, "/t12", a).set_budget_override(2500.0, 2800.0)
        a._stop.set()  # A freezes: B takes over once A's lease expires
        a._thread.join()
        wait_until(b.may_send, 10.0, 0.02, "B elected after A's lease expired")
        store_b = EtcdStore(conn, "/t12", b)
        for file_w, want_w in ((3200.0, 2500.0), (2000.0, 2000.0), (2800.0, 2500.0)):
            path = tmp_path / f"b{file_w:.0f}.yaml"
            path.write_text(f"version: 1\nbudget_w: {file_w:.0f}\n")
            coord = Coordinator(load_policy(str(path)), str(path))
            coord.store = store_b
            ha.elected(coord)
            assert coord.policy.budget_w == want_w, (file_w, coord.policy.budget_w)
            assert store_b.budget_override()["budget_w"] == 2500.0  # the admin's word is kept in etcd
            alert = coord.persistent_alerts.get("budget", "")
            if file_w == 2800.0:  # the file the override was set under: the override, no doubt
                assert not alert
                continue
            assert ("budget override 2500 W was set while the policy file said 2800 W" in alert
                    and f"says {file_w:.0f} W" in alert and f"the lower, {want_w:.0f} W, is in force" in alert), alert
        path.write_text("version: 1\nbudget_w: 3000\n")  # the admin edits the file and reloads it: the file wins
        reply = asyncio.run(coord.reload_policy(""))
        assert reply.ok and coord.policy.budget_w == 3000.0 and "budget" not in coord.persistent_alerts, reply
        assert store_b.budget_override() is None
    finally:
        b.stop()
        a.term = 0
        a._lease_id = 0


def _ledger(nodes: int, gpus: int = 8, seen_s: float = 1.0) -> dict:
    """A node ledger of ``nodes`` nodes x ``gpus`` GPUs (store.save_nodes's shape; W, s)."""
    return {f"gpu{n:05d}": {"gpus": {i: [200.0 + (n * 8 + i) % 500 + 0.123456789, 200.0, 700.0, 250.0]
                                     for i in range(gpus)}, "seen_s": seen_s}
            for n in range(nodes)}


def test_a_100k_gpu_node_ledger_is_saved_in_etcd_without_an_audit_copy_and_shrinks(etcd):
    """The node ledger of 12,500 nodes x 8 GPUs (6.5 MB of JSON) is saved and read back whole,
    though etcd takes at most 1.5 MiB per request (its default ``--max-request-bytes``): it was
    one value, and failed from ~1,400 nodes on. Soft state rewritten every 30 s and before
    increases leaves no audit record (each was a full copy: etcd grew by the ledger's size at
    every write until its space quota stopped all writes). A smaller ledger leaves no node of the
    larger one behind; an admin's budget change is still audited."""
    conn = EtcdConn(parse_endpoints(etcd.endpoints))
    a = Leadership(conn, "/big", "A", "unix:/a").start()
    try:
        wait_until(a.may_send, 10.0, 0.02, "A elected")
        store = EtcdStore(conn, "/big", a)
        big = _ledger(12500)
        store.save_nodes(big)
        assert store.load_nodes() == big
        store.save_nodes(big)
        small = _ledger(3, seen_s=2.0)
        store.save_nodes(small)
        assert store.load_nodes() == small
        assert conn.get_prefix("/big/audit/") == []
        gens = {kv["key"].split("/")[4] for kv in conn.get_prefix("/big/state/nodes/")}
        assert len(gens) == 1  # the larger generations' chunks are gone
        # a write cut short (its chunks, not its pointer) changes nothing; the next write removes it
        conn.put("/big/state/nodes/99999999999999999999/00000", '{"ghost": {"gpus": {}, "seen_s": 3.0}}')
        conn.put("/big/state/nodes/00000000000000000001/00000", '{"ghost": {"gpus": {}, "seen_s": 3.0}}')
        assert store.load_nodes() == small
        store.save_nodes(small)
        assert len({kv["key"].split("/")[4] for kv in conn.get_prefix("/big/state/nodes/")}) == 1
        assert store.load_nodes() == small
        store.set_budget_override(2500.0, 2800.0)
        audits = conn.get_prefix("/big/audit/")
        assert len(audits) == 1 and b"budget set" in audits[0]["value"]
    finally:
        a.stop()


def test_a_node_ledger_of_an_older_release_is_read_then_replaced(etcd):
    """The one-key ledger (``<prefix>/state/nodes``) an older release wrote is what a new leader
    reads until it writes its own; its first write removes it."""
    import json

    conn = EtcdConn(parse_endpoints(etcd.endpoints))
    old = {"n1": {"gpus": {"0": [300.0, 200.0, 700.0, 250.0]}, "seen_s": 1.0}}
    conn.put("/legacy/state/nodes", json.dumps(old))
    a = Leadership(conn, "/legacy", "A", "unix:/a").start()
    try:
        wait_until(a.may_send, 10.0, 0.02, "A elected")
        store = EtcdStore(conn, "/legacy", a)
        assert store.load_nodes() == {"n1": {"gpus": {0: [300.0, 200.0, 700.0, 250.0]}, "seen_s": 1.0}}
        new = _ledger(2)
        store.save_nodes(new)
        assert conn.get("/legacy/state/nodes") is None and store.load_nodes() == new
    finally:
        a.stop()
