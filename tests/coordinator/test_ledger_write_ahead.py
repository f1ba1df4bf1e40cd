"""The node ledger's write-ahead (coordinator.loop.Coordinator._write_ahead): no increase leaves the
coordinator unless the ledger a successor restores counts that GPU at or above its new cap.

Found with the exact journal of tests/ha/test_failover.py (etcd quorum lost): the leader's
write-ahead failed, its increases were sent anyway, and the new leader, counting the node at its
ledger caps from the agent's hello until its first telemetry, raised other GPUs into the watts
still enforced (2,801.9 W on a 2,800 W cluster for 273 ms).

In-process: the real Coordinator, Registry, planner and SQLite store (a real ``database is locked``
from a second connection holding a write transaction: the write fails as etcd's does without a
quorum); the agent sessions are the stand-ins of test_problem_inputs that keep every plan."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from capctl import plancaps
from capctl.policy.validate import parse_policy
from coordinator import store as store_mod
from coordinator.loop import Coordinator
from coordinator.store import Store
from tests.coordinator.test_problem_inputs import POLICY, Recording, hello, telemetry

NODES = ("node1", "node2")
LEDGER_W = 300.0
"""Every GPU's cap in the ledger the last leader saved, and enforced on the devices (W)."""


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An opened SQLite store holding the last leader's ledger; a locked database fails at once."""
    monkeypatch.setattr(store_mod, "BUSY_TIMEOUT_S", 0.0)
    st = Store(str(tmp_path / "state"))
    st.open()
    st.save_nodes({n: {"gpus": {i: [LEDGER_W, 200.0, 700.0, LEDGER_W] for i in range(2)}, "seen_s": time.time()}
                   for n in NODES})
    yield st
    st.close()


def _leader(store) -> tuple[Coordinator, dict]:
    """A coordinator on ``store`` whose agents reported every GPU at the ledger's caps, busy at them
    (its solve wants them higher: 20,000 W for 4 GPUs); node -> its recording session."""
    coord = Coordinator(parse_policy(POLICY), "<test>", store=store)
    sessions = {n: Recording() for n in NODES}
    for n, session in sessions.items():
        coord.registry.on_hello(hello(n, jobs=(f"job-{n}",)), session)
        coord.registry.on_telemetry(n, telemetry(n, 1, [(LEDGER_W, LEDGER_W, 50.0)] * 2))
    return coord, sessions


def _sent(sessions: dict, phase: str | None = None) -> dict:
    """(node, index) -> the last cap sent (W), of the plans of ``phase`` (None: every phase)."""
    out = {}
    for n, session in sessions.items():
        for msg in session.msgs:
            if phase is None or msg.plan.phase == phase:
                caps, _safe, problem = plancaps.of_plan(msg.plan)
                assert not problem
                out.update({(n, i): c for i, c in caps.items()})
    return out


def test_no_increase_above_the_ledger_when_its_write_ahead_fails_and_a_successor_counts_every_cap(store):
    leader, sessions = _leader(store)
    lock = sqlite3.connect(store.path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # the write-ahead fails (as etcd's without a quorum)
    try:
        asyncio.run(leader.tick())
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert leader.persistent_alerts["store"].startswith("node ledger not saved")
    # the agents' GPUs are where the plans left them (or at the ledger's caps, as before)
    enforced = {(n, i): LEDGER_W for n in NODES for i in range(2)} | _sent(sessions)
    # a successor (failover, restart) restores the ledger; each agent says hello, no telemetry yet:
    # every GPU it may plan with is counted at or above its enforced limit
    successor = Coordinator(parse_policy(POLICY), "<test>", store=store)
    for n in NODES:
        successor.registry.on_hello(hello(n, jobs=(f"job-{n}",)), Recording())
    now = successor.registry.clock()
    for (n, i), enforced_w in enforced.items():
        g = successor.registry.nodes[n].gpus[i]
        assert g.have_reading and g.accounted_w(now, successor.ack_memory_s()) >= enforced_w, (n, i, enforced_w)
    assert not _sent(sessions, "increase")  # held: the ledger still says 300 W
    assert all(msg.plan.phase == "hold" for s in sessions.values() for msg in s.msgs)


def test_the_held_increases_go_out_once_the_ledger_is_saved(store):
    leader, sessions = _leader(store)
    lock = sqlite3.connect(store.path, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    asyncio.run(leader.tick())
    lock.execute("ROLLBACK")
    lock.close()
    assert not _sent(sessions, "increase")
    asyncio.run(leader.tick())  # the database free again: written ahead, then raised
    raised = _sent(sessions, "increase")
    assert sorted(raised) == [(n, i) for n in NODES for i in range(2)]
    assert all(cap_w > LEDGER_W + 100.0 for cap_w in raised.values()), raised
    saved = store.load_nodes()
    for (n, i), cap_w in raised.items():
        assert saved[n]["gpus"][i][0] >= cap_w  # the ledger counts each raised GPU at its new cap


class _SlowStore:
    """The real SQLite ``store`` whose node-ledger writes wait for ``release`` (an etcd write in
    flight in the store worker, :mod:`coordinator.storeio`); every other call goes through."""

    def __init__(self, store) -> None:
        self._store = store
        self.release = __import__("threading").Event()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def save_nodes(self, ledger):
        assert self.release.wait(30.0)
        return self._store.save_nodes(ledger)


def test_a_rewrite_in_flight_makes_the_next_increase_write_ahead_again(store):
    """A full rewrite of the ledger submitted at T1 (each GPU at its accounted cap then) can land in
    the store worker after an increase checked against the older ledger: the increase skipped its
    write-ahead (the old value covered it) and the rewrite then replaced that value with a lower
    one. The rewrite now lowers what the ledger is taken to count as it is submitted."""
    from coordinator.storeio import StoreIO

    leader, _sessions = _leader(store)
    leader._ledger_w = {(n, i): 650.0 for n in NODES for i in range(2)}  # a high-water write saved earlier
    slow = _SlowStore(store)
    leader.store = slow

    async def run() -> None:
        leader.store_io = StoreIO("test-store-io")
        try:
            fut = leader._save_ledger({})  # the periodic rewrite: each GPU at its accounted 300 W
            assert fut is not None and leader.store_io.pending == 1
            # an increase to 620 W while it is in flight: the ledger it lands will say 300 W
            assert leader._ledger_below({("node1", 0): 620.0})
            slow.release.set()
            await asyncio.wait([fut])
        finally:
            leader.store_io.close()

    asyncio.run(run())
    assert store.load_nodes()["node1"]["gpus"][0][0] == LEDGER_W
    assert leader._ledger_w[("node1", 0)] == LEDGER_W


def test_a_leader_elected_again_forgets_the_ledger_it_saved_in_an_earlier_term(store):
    """Between two terms of one coordinator another leader may have saved a lower ledger; the
    value this coordinator kept from its earlier term let an increase skip its write-ahead."""
    from coordinator import ha

    leader, _sessions = _leader(store)
    leader._ledger_w = {(n, i): 650.0 for n in NODES for i in range(2)}  # saved in its earlier term
    ledger = store.load_nodes()  # what the leader in between left: 300 W each
    ha.elected(leader, state=(None, ledger))
    assert leader._ledger_below({("node1", 0): 620.0})
