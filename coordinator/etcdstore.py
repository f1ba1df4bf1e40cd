"""Admin state of the coordinators in etcd (high availability): the second backend of the state
store, beside SQLite (:mod:`coordinator.store`, the default for a single coordinator).

Same interface as :class:`coordinator.store.Store` (:class:`coordinator.statestore.StateStore`):
the budget override, the node ledger, an audit trail. Keys, under the site prefix::

    <prefix>/state/budget_override   JSON {"budget_w", "policy_budget_w", "time_s"}
    <prefix>/state/nodes             JSON node ledger {node: {"gpus": {index: [W, W, W, W]}, "seen_s"}}
    <prefix>/audit/<unix ns>         JSON {"action", "value"}

Every write is fenced by the election (:mod:`coordinator.election`): one etcd transaction that
succeeds only while the leader key still has this coordinator's term as its create revision, so a
deposed leader can never overwrite what its successor wrote. A refused or failed write raises
:class:`~coordinator.store.StoreError`, as SQLite's do.
"""

from __future__ import annotations

import json
import logging
import time

from coordinator.etcdconn import EtcdConn, EtcdError, b64
from coordinator.store import StoreError

log = logging.getLogger("capctl.coordinator.etcdstore")


def fence(leadership, what: str) -> list[dict]:
    """The etcd transaction comparison that makes a write succeed only while ``leadership`` (a
    :class:`~coordinator.election.Leadership`, or None: unfenced) still holds the leader key with its
    term as create revision; ``what`` names the write in errors.

    Raises:
        StoreError: this coordinator does not lead now (the write is refused before it is sent).
    """
    if leadership is None:
        return []
    term = leadership.term
    if term <= 0 or not leadership.may_send():
        raise StoreError(f"{what} refused: this coordinator is not the leader")
    return [{"key": b64(leadership.leader_key), "result": "EQUAL", "target": "CREATE", "create_revision": term}]


def fenced_txn(conn: EtcdConn, leadership, ops: list[dict], what: str) -> None:
    """Apply ``ops`` in one etcd transaction fenced by ``leadership`` (:func:`fence`); ``what``
    names the write in errors.

    Raises:
        StoreError: not the leader, etcd unreachable, or the leader key is no longer ours.
    """
    compare = fence(leadership, what)
    try:
        r = conn.txn(compare=compare, success=ops)
    except EtcdError as exc:
        raise StoreError(f"{what}: {exc}") from None
    if compare and not r.get("succeeded"):
        raise StoreError(f"{what} refused: the leader key is no longer ours (term {compare[0]['create_revision']})")


class EtcdStore:
    """The admin state in etcd (see module docstring). Every method raises :class:`StoreError`.
    ``shared``: every coordinator of the site reads and writes it (coordinator.loop keeps an
    override its own policy file disagrees with).

    Args:
        conn: the etcd cluster.
        prefix: the site's key prefix (as the election's).
        leadership: the :class:`~coordinator.election.Leadership` whose term fences writes (None:
            writes are not fenced; for tools and tests).
    """

    shared = True

    blocking_io = True
    """Calls wait on the network: the coordinator makes them off its event loop (coordinator.storeio)."""

    def __init__(self, conn: EtcdConn, prefix: str, leadership=None) -> None:
        self.conn = conn
        self.prefix = prefix.rstrip("/") or "/capctl"
        self.leadership = leadership
        self.path = f"etcd {','.join(conn.endpoints)} {self.prefix}/state"
        self.ok = True

    def open(self) -> None:
        """Nothing to open (requests carry their own connections)."""

    def close(self) -> None:
        """Nothing to close."""

    def get(self, key: str):
        """The JSON value stored under ``<prefix>/state/<key>``, or None."""
        try:
            kv = self.conn.get(f"{self.prefix}/state/{key}")
        except EtcdError as exc:
            raise StoreError(f"state in {self.path}: read {key}: {exc}") from None
        if kv is None:
            return None
        try:
            return json.loads(kv["value"].decode())
        except (ValueError, UnicodeDecodeError):
            log.warning("%s/state/%s: not JSON; ignored", self.prefix, key)
            return None

    def put(self, key: str, value, action: str) -> None:
        """Store ``value`` (JSON) under ``key`` (None deletes it) with an audit record, in one
        transaction fenced by the leader's term.

        Raises:
            StoreError: etcd unreachable, or this coordinator no longer leads (the write is refused).
        """
        full = b64(f"{self.prefix}/state/{key}")
        op = ({"request_delete_range": {"key": full}} if value is None
              else {"request_put": {"key": full, "value": b64(json.dumps(value))}})
        audit = {"request_put": {"key": b64(f"{self.prefix}/audit/{time.time_ns():020d}"),
                                 "value": b64(json.dumps({"action": action, "value": value}))}}
        fenced_txn(self.conn, self.leadership, [op, audit], f"state in {self.path}: write {key}")

    # -- budget override (as coordinator.store.Store) ----------------------------------------
    def budget_override(self) -> dict | None:
        value = self.get("budget_override")
        return value if isinstance(value, dict) and "budget_w" in value else None

    def set_budget_override(self, budget_w: float, policy_budget_w: float) -> None:
        self.put("budget_override", {"budget_w": float(budget_w), "policy_budget_w": float(policy_budget_w),
                                     "time_s": time.time()}, "budget set")

    def clear_budget_override(self) -> None:
        self.put("budget_override", None, "budget override cleared")

    # -- node ledger --------------------------------------------------------------------------
    def save_nodes(self, nodes: dict[str, dict]) -> None:
        """Replace the node ledger (shape: :meth:`coordinator.store.Store.save_nodes`)."""
        data = {name: {"gpus": {str(i): list(v) for i, v in d["gpus"].items()}, "seen_s": d.get("seen_s", 0.0)}
                for name, d in nodes.items()}
        self.put("nodes", data, "node ledger")

    def load_nodes(self) -> dict[str, dict]:
        """The node ledger; malformed entries are skipped."""
        value = self.get("nodes") or {}
        out = {}
        for name, entry in (value.items() if isinstance(value, dict) else ()):
            try:
                gpus = {int(k): [float(x) for x in v[:4]] for k, v in entry["gpus"].items()}
                out[str(name)] = {"gpus": gpus, "seen_s": float(entry.get("seen_s", 0.0))}
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("node ledger: malformed entry for %r skipped", name)
        return out
