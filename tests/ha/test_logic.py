"""Small logic tests of the HA parts (no etcd): the agent's term fence, the link's choice of
coordinator, endpoint parsing, the status view's HA fields."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from pathlib import Path

import jsonschema
import pytest

from capctl.errors import UserInputError
from capctl.statusview import render_status, status_dict
from capctl.v1 import capctl_pb2 as pb
from coordinator.etcdconn import EtcdConn, EtcdError, parse_endpoints
from nodeagent.fencing import TermFence
from nodeagent.link import AgentLinkClient

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "status-schema.json").read_text())


def test_fence_admits_the_newest_term_only():
    f = TermFence()
    assert f.admit(0) == ""  # a coordinator without etcd
    f.see(7)  # a Welcome of term 7
    assert f.admit(7) == "" and f.newest == 7
    assert "term 5 refused: term 7 seen" in f.admit(5)
    assert f.admit(0) != ""  # no fallback to an unfenced coordinator once a term was seen
    assert f.admit(9) == "" and f.newest == 9 and "term 7" in f.admit(7)
    assert f.refused == 3


def _link(target: str) -> AgentLinkClient:
    return AgentLinkClient(target, lambda: None, lambda w: None, lambda p: None)


def test_link_rotates_through_the_coordinators_and_follows_a_named_leader():
    link = _link("unix:/a, unix:/b,unix:/c")
    assert link.targets == ["unix:/a", "unix:/b", "unix:/c"]
    picks = []
    for _ in range(4):
        link.target_now = link._pick_target()
        picks.append(link.target_now)
    assert picks == ["unix:/a", "unix:/b", "unix:/c", "unix:/a"]

    class Refusal:
        def trailing_metadata(self):
            return (("capctl-leader", "unix:/c"),)
    link._note_leader(Refusal())
    assert link._pick_target() == "unix:/c"

    class Elsewhere:
        def trailing_metadata(self):
            return (("capctl-leader", "unix:/not-mine"),)
    link.target_now = "unix:/a"
    link._note_leader(Elsewhere())  # a leader we do not know: keep rotating
    assert link._pick_target() == "unix:/b"
    assert _link("unix:/only").targets == ["unix:/only"]


def test_parse_endpoints():
    assert parse_endpoints("http://127.0.0.1:2379,https://h:1") == [("http", "127.0.0.1", 2379), ("https", "h", 1)]
    with pytest.raises(UserInputError, match=r"endpoint '127\.0\.0\.2:2380' has no scheme; write http://127\.0\.0\.2:2380"):
        parse_endpoints("127.0.0.2:2380")  # refused as in the policy (found by a try-out: the flag took it as http)
    # (an unclosed IPv6 bracket was a traceback; a path, a query, user:pw@ or text after the host
    # were dropped silently: found by a review)
    for bad in ("", "ftp://h:1", "http://h", "http://h:0", "http://h:99999", "http://[::1:23790",
                "http://[::1]x:23790", "http://u:p@h:1", "http://h:2379/v3", "http://h:2379?x=1"):
        with pytest.raises(UserInputError, match="--etcd-endpoints"):
            parse_endpoints(bad)
    assert parse_endpoints("https://[::1]:2379,http://h:2379/") == [("https", "::1", 2379), ("http", "h", 2379)]


def test_ha_refuses_an_empty_endpoint_list_and_a_wildcard_address_to_advertise():
    """``--etcd-endpoints ''`` turned high availability off without a word (a second leader of term
    0), and a wildcard --listen was advertised as "0.0.0.0:7373" (found by a review)."""
    import argparse

    from capctl.policy import parse_policy
    from coordinator.hadaemon import HaSetup, _check_advertise

    policy = parse_policy("version: 1\nbudget_w: 20000\n")
    args = argparse.Namespace(etcd_endpoints="", listen="unix:/x", advertise=None)
    with pytest.raises(UserInputError, match="--etcd-endpoints '': empty"):
        HaSetup.from_args(args, policy)
    with pytest.raises(UserInputError, match="--listen 0.0.0.0:7373: a wildcard address cannot be advertised"):
        _check_advertise(argparse.Namespace(listen="0.0.0.0:7373", advertise=None))
    _check_advertise(argparse.Namespace(listen="0.0.0.0:7373", advertise="head1:7373"))
    _check_advertise(argparse.Namespace(listen="127.0.0.5:7373", advertise=None))
    _check_advertise(argparse.Namespace(listen="unix:/run/capctl/c.sock", advertise=None))


def test_etcd_replies_that_are_no_etcd_reply_count_as_that_member_failing():
    """A member answering ``{}`` or ``[]`` raised KeyError / AttributeError in the election thread,
    which never campaigned again, and the next member was not tried (found by a review)."""
    import http.server
    import json
    import threading

    def member(body):
        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        srv = http.server.HTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv

    bad, junk, good = member({}), member([]), member({"ID": "7", "TTL": "3"})
    try:
        ends = lambda *s: parse_endpoints(",".join(f"http://127.0.0.1:{x.server_address[1]}" for x in s))  # noqa: E731
        with pytest.raises(EtcdError, match="no etcd reply"):
            EtcdConn(ends(bad, junk)).grant(3)
        assert EtcdConn(ends(bad, good)).grant(3) == (7, 3)  # the next member is asked
    finally:
        for srv in (bad, junk, good):
            srv.shutdown()
            srv.server_close()


def test_status_shows_leader_term_and_standbys():
    reply = pb.StatusReply(budget_w=2800, interval_s=0.4, ha_role="standby", leader="h1:7373", term=42,
                           standbys=["h2:7373", "h3:7373"])
    d = status_dict(reply)
    jsonschema.validate(d, SCHEMA)
    assert d["ha"] == {"role": "standby", "leader": "h1:7373", "term": 42, "standbys": ["h2:7373", "h3:7373"]}
    text = render_status(d)
    assert "this coordinator is standby; leader h1:7373, term 42; standbys h2:7373, h3:7373" in text
    assert "a standby holds no agents (they follow the leader): for the cluster's view ask " \
           "capctl status --coordinator h1:7373" in text
    leader = render_status(status_dict(pb.StatusReply(budget_w=2800, ha_role="leader", leader="h1:7373", term=42)))
    assert "a standby holds no agents" not in leader
    unknown = render_status(status_dict(pb.StatusReply(budget_w=2800, ha_role="standby", leader="", term=0)))
    assert "this coordinator is standby; leader (none known), term 0" in unknown  # etcd silent: not "elected"
    assert "ask the leader, once one is elected" in unknown
    single = status_dict(pb.StatusReply(budget_w=2800))
    assert "ha" not in single and "high availability" not in render_status(single)


def test_policy_coordinator_etcd(tmp_path):
    from capctl.policy import PolicyError, load_policy

    base = ("version: 1\nbudget_w: 1000\ndomains: {name: c, kind: cluster, limit_w: 1000, nodes: 'n[1-2]'}\n"
            "coordinator:\n  etcd: {endpoints: [%s]%s}\n")
    path = tmp_path / "p.yaml"
    path.write_text(base % ("'http://127.0.0.1:2379', 'https://e2:2380'", ", lease_ttl_s: 3"))
    etcd = load_policy(str(path)).coordinator.etcd
    assert (etcd.endpoints, etcd.prefix, etcd.lease_ttl_s) == (("http://127.0.0.1:2379", "https://e2:2380"), "/capctl", 3)
    path.write_text(base % ("'ftp://x:1'", ""))
    with pytest.raises(PolicyError) as err:
        load_policy(str(path))
    text = "\n".join(err.value.errors)
    assert "p.yaml:5" in text and "ftp://x:1" in text and "http://HOST:PORT" in text, text
    path.write_text(base % ("'http://h:1'", ", lease_ttl_s: 0"))
    with pytest.raises(PolicyError, match="lease_ttl_s"):
        load_policy(str(path))


def test_agent_state_keeps_the_newest_term(tmp_path):
    from nodeagent import agentstate

    path = tmp_path / "agent-state.json"
    agentstate.write(path, node="n1", jobs={}, safe_caps={}, plan_seq=3, coordinator_id="x", coordinator_term=41)
    assert agentstate.coordinator_term(agentstate.read(path)) == 41
    assert agentstate.coordinator_term({}) == 0 and agentstate.coordinator_term({"coordinator_term": "junk"}) == 0


def test_agent_refuses_a_plan_of_an_older_term_and_keeps_caps_and_lease(tmp_path):
    from nodeagent.link import LeaveCoordinator
    from tests.nodeagent.puredevice import PureDevice
    from tests.nodeagent.test_agent_logic import make_agent

    dev = PureDevice(2, limit_w=400.0)
    agent = make_agent(tmp_path, dev)
    agent.on_welcome(pb.Welcome(protocol_version="capctl.v1", coordinator_id="new", interval_s=1.0, term=12))
    ack = agent.on_plan(pb.CapPlan(seq=1, term=12, lease_s=5.0, caps=[pb.CapAssignment(index=0, cap_w=350.0)]))
    assert ack.ok and agent.plan_term == 12
    expiry = agent.lease.expiry_mono_s
    with pytest.raises(LeaveCoordinator, match="term 9 refused: term 12 seen"):
        agent.on_plan(pb.CapPlan(seq=2, term=9, lease_s=60.0, caps=[pb.CapAssignment(index=0, cap_w=200.0)]))
    assert agent.backend.get_cap_w(0) == 350.0  # the deposed leader changed nothing
    assert agent.lease.expiry_mono_s == expiry and agent.plan_term == 12 and agent.fence.refused == 1
    st = agent.local_status()
    assert (st.coordinator_term, st.plans_refused, st.plan_term) == (12, 1, 12)


def test_agent_refuses_clear_text_to_any_coordinator_of_its_list(tmp_path):
    """Every address of an HA list is checked on its own: a unix socket first does not let a network
    address through in clear text (192.0.2.1: TEST-NET-1, RFC 5737, never reached)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPCTL_", "NOTIFY_SOCKET"))}
    argv = [sys.executable, "-m", "nodeagent.daemon", "--node", "n1", "--coordinator",
            f"unix:{tmp_path / 'c1.sock'},192.0.2.1:7373", "--socket", str(tmp_path / "a.sock"),
            "--state-dir", str(tmp_path / "a")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--coordinator 192.0.2.1:7373: a network address needs TLS" in r.stderr, r.stderr


def _free_port() -> int:
    """A loopback TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unanswered_etcd_request_names_each_members_cause():
    """Every member's cause is named (a refused connection; TLS spoken to a plain-HTTP port), not an
    empty "ConnectionFailedError: " for the last member only (found by a try-out)."""
    srv = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        refused = _free_port()
        conn = EtcdConn(parse_endpoints(f"http://127.0.0.1:{refused},https://127.0.0.1:{srv.server_port}"),
                        timeout_s=2.0)
        with pytest.raises(EtcdError) as err:
            conn.get("/x")
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)
    text = str(err.value)
    assert f"http://127.0.0.1:{refused}: ConnectionFailedError: [Errno 111] Connection refused;" in text
    assert f"https://127.0.0.1:{srv.server_port}: " in text and "SSL" in text


def test_a_lasting_etcd_outage_is_logged_again_with_its_duration(monkeypatch, caplog):
    """An unreachable etcd was logged once (the same text is not repeated): a standby that can never
    lead then looked healthy in its log. A lasting outage is said again every ERROR_REPEAT_S."""
    import logging
    import time

    from coordinator import election

    class Down:
        def grant(self, ttl_s):
            raise election.EtcdError("etcd: no member answered /v3/lease/grant (http://127.0.0.1:1: refused)")

    monkeypatch.setattr(election, "ERROR_REPEAT_S", 0.2)
    monkeypatch.setattr(election, "CAMPAIGN_PERIOD_S", 0.02)
    caplog.set_level(logging.WARNING, logger="capctl.coordinator.election")
    lead = election.Leadership(Down(), "/x", "A", "unix:/a", ttl_s=1)
    lead.leader, lead.leader_term = "unix:/b", 7  # the leader it read before etcd went away
    lead.start()
    try:
        time.sleep(0.5)
        assert lead.describe()["leader"] == "unix:/b"  # within a lease TTL it may still lead
        time.sleep(0.8)
    finally:
        lead._stop.set()
        lead._thread.join(5)
    lines = [r.getMessage() for r in caplog.records if "no member answered" in r.getMessage()]
    assert 4 <= len(lines) <= 9, lines  # ~every 0.2 s over 1.3 s, not every 0.02 s round
    assert "failing for" not in lines[0] and "this coordinator cannot lead" in lines[-1]
    assert lead.error.startswith("etcd: no member answered")
    # after a lease TTL without etcd, that leader may be gone: no longer named (a try-out: a standby
    # named a leader that had stepped down during a quorum loss)
    assert lead.describe() == {"role": "standby", "leader": "", "term": 0, "standbys": []}


def test_an_etcd_error_reply_is_named_with_its_body():
    """A member that answers with an HTTP error: its reason and etcd's own text (the body) are
    named, not the reason alone (found by a review)."""

    class NoLeader(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = b'{"error":"etcdserver: no leader","code":14}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), NoLeader)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(EtcdError) as err:
            EtcdConn(parse_endpoints(f"http://127.0.0.1:{srv.server_port}"), timeout_s=2.0).get("/x")
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)
    assert "etcdserver: no leader" in str(err.value), str(err.value)


def test_a_reload_of_another_file_is_refused_in_high_availability(tmp_path):
    """In high availability each coordinator reads its start file when it takes over: a reload of
    another file was lost on failover (a lowered rack limit went back up; found by a review). Such
    a reload is refused naming the start file; a reload of the start file itself goes through."""
    import asyncio

    from capctl.policy import load_policy
    from coordinator.loop import Coordinator

    start = tmp_path / "policy.yaml"
    start.write_text("version: 1\nbudget_w: 20000\n")
    other = tmp_path / "low.yaml"
    other.write_text("version: 1\nbudget_w: 10000\n")
    coord = Coordinator(load_policy(str(start)), str(start))
    coord.ha = object()  # (a leader: standbys refuse every reload before this)
    reply = asyncio.run(coord.reload_policy(str(other)))
    assert not reply.ok and f"every coordinator reads its start file ({start})" in reply.errors[0]
    assert coord.policy.budget_w == 20000
    assert asyncio.run(coord.reload_policy(str(start))).ok
    coord.ha = None
    assert asyncio.run(coord.reload_policy(str(other))).ok and coord.policy.budget_w == 10000


def test_an_etcd_lease_ttl_flag_that_outlasts_the_agents_lease_is_an_alert_until_a_reload_fixes_it(tmp_path):
    """``policy validate`` checks the etcd TTL against ``failsafe.lease_s`` for the policy's own
    ``coordinator.etcd`` block only; a TTL given with ``--etcd-lease-ttl-s`` was never checked (found
    by a review). The daemon checks the TTL in force when HA is attached and at every reload."""
    import asyncio
    from types import SimpleNamespace

    from capctl.policy import load_policy
    from coordinator import ha
    from coordinator.loop import Coordinator

    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nbudget_w: 20000\ninterval_s: 2\nfailsafe:\n  lease_s: 10\n")
    coord = Coordinator(load_policy(str(path)), str(path))
    coord.ha = SimpleNamespace(ttl_s=6)  # the Leadership's TTL (s), as --etcd-lease-ttl-s 6 gives it
    ha.attach(coord)
    alert = coord.persistent_alerts.get("failover", "")
    assert "etcd lease TTL 6 s + 2 intervals = 10 s is not shorter than failsafe.lease_s 10 s" in alert, alert
    assert "every agent falls back to its safe cap" in alert
    path.write_text("version: 1\nbudget_w: 20000\ninterval_s: 2\nfailsafe:\n  lease_s: 11\n")
    assert asyncio.run(coord.reload_policy("")).ok
    assert "failover" not in coord.persistent_alerts
    coord.ha = SimpleNamespace(ttl_s=8)
    assert "8 s + 2 intervals = 12 s" in ha.check_failover_time(coord)
    coord.ha = SimpleNamespace(ttl_s=2, granted_ttl_s=8)  # etcd granted more than asked (its minimum TTL)
    assert "8 s + 2 intervals = 12 s" in ha.check_failover_time(coord)


class _SharedStore:
    """The admin state as an etcd store shows it to a coordinator (shared by the site's coordinators)."""

    shared = True
    ok = True
    path = "etcd"

    def __init__(self, override):
        self.override = override
        self.cleared = 0

    def budget_override(self):
        return self.override

    def get(self, key):
        return None  # (no other setting: no policy file reloaded by an admin)

    def clear_budget_override(self):
        self.cleared += 1
        self.override = None

    def load_nodes(self):
        return {}


def test_a_coordinator_on_a_shared_store_keeps_an_override_its_file_disagrees_with(tmp_path):
    """A standby starting with another file than the leader's deleted the leader's override from
    etcd (the next leader then ran its own, higher budget without a word: found by a review); and
    at a takeover an override below the new file's minimum caps left that file's full budget in
    force while the alert said the override's was. Now the override is kept, the budget in force
    is the lower one or the least the file's minimum caps allow, and the alert says which."""
    from capctl.policy import load_policy
    from coordinator.loop import Coordinator

    path = tmp_path / "b.yaml"
    path.write_text("version: 1\nbudget_w: 3200\n")
    store = _SharedStore({"budget_w": 2500.0, "policy_budget_w": 2800.0})
    coord = Coordinator(load_policy(str(path)), str(path), store=store)
    assert store.cleared == 0 and store.override is not None and coord.policy.budget_w == 2500.0
    assert "the lower, 2500 W, is in force and the override is kept" in coord.persistent_alerts["budget"]
    path.write_text("version: 1\nbudget_w: 6000\nmin_cap_w: 350\nstart_cap_w: 400\n"
                    "domains: {name: c, kind: cluster, gpu_model: H100-SXM, gpus_per_node: 8, nodes: 'n[1-2]'}\n")
    store = _SharedStore({"budget_w": 4000.0, "policy_budget_w": 5000.0})
    coord = Coordinator(load_policy(str(path)), str(path), store=store)
    assert coord.policy.budget_w == 5600.0 and store.cleared == 0  # 16 GPUs x 350 W: as low as the file allows
    assert "the sum of this file's minimum caps, 5600 W, is in force" in coord.persistent_alerts["budget"]
    store = _SharedStore({"budget_w": 4000.0, "policy_budget_w": 5000.0})
    store.shared = False  # one coordinator's own database: the file changed since, the file wins
    coord = Coordinator(load_policy(str(path)), str(path), store=store)
    assert coord.policy.budget_w == 6000.0 and store.cleared == 1 and "budget" not in coord.persistent_alerts


def test_a_new_leader_counts_a_node_its_ledger_does_not_name_as_never_heard_of(tmp_path):
    """At takeover a node without a stream is counted as the last leader's ledger says; one the
    ledger does not name (etcd lost its data) was counted at the caps this coordinator knew in an
    earlier term (1.8 W over a 2,800 W budget for 345 ms in tests/ha/test_failover.py). Now it is a
    policy node never heard of: counted at the most it may draw until it reports."""
    import time as _time

    from capctl.policy import load_policy
    from coordinator import allocation, ha
    from coordinator.loop import Coordinator
    from coordinator.registry import GpuObs, NodeObs
    from tests.coordinator.conftest import write_policy

    path = write_policy(tmp_path / "policy.yaml", nodes=["n1", "n2"], budget_w=3000.0)
    coord = Coordinator(load_policy(str(path)), str(path))
    reg = coord.registry
    old = NodeObs(name="n2")  # from this coordinator's earlier term: 2 x 250 W, long out of date
    old.gpus = {i: GpuObs(node="n2", index=i, min_cap_w=200.0, max_cap_w=700.0, have_reading=True, cap_w=250.0,
                          enforced_w=250.0) for i in range(2)}
    reg.nodes["n2"] = old
    ledger = {"n1": {"gpus": {0: (400.0, 200.0, 700.0, 300.0), 1: (400.0, 200.0, 700.0, 300.0)},
                     "seen_s": _time.time()}}
    ha.elected(coord, state=(None, ledger))
    assert sorted(reg.nodes) == ["n1"]
    table = reg.gpu_table()
    max_w = [g.max_cap_w for g in table.gpus]
    reserved = allocation.unreported_reserve(coord.policy, table.topology, table.node_of, max_w)
    assert reserved == {"n2": allocation.declared_draw_w(coord.policy, "n2")} and reserved["n2"] >= 1400.0  # n1: 2 x 700 W
