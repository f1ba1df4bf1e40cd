"""Admin state of the coordinators in etcd (high availability): the second backend of the state
store, beside SQLite (:mod:`coordinator.store`, the default for a single coordinator).

Same interface as :class:`coordinator.store.Store` (:class:`coordinator.statestore.StateStore`):
the budget override, the node ledger, an audit trail. Keys, under the site prefix::

    <prefix>/state/budget_override   JSON {"budget_w", "policy_budget_w", "time_s"}
    <prefix>/state/nodes_gen         JSON {"gen": g}: the node ledger's generation in force
    <prefix>/state/nodes/<g>/<k>     JSON node ledger, chunk k: {node: {"gpus": {index: [W, W, W, W]}, "seen_s"}}
    <prefix>/audit/<unix ns>         JSON {"action", "value"} (admin changes: the budget)

The node ledger is soft state the leader rewrites every 30 s and before increases
(:data:`coordinator.loop.LEDGER_PERIOD_S`): it is written in chunks of at most
:data:`LEDGER_CHUNK_BYTES` (etcd takes at most 1.5 MiB per request by default), as a new
generation whose pointer ``nodes_gen`` is switched, and the older generations deleted, in one last
transaction: a reader sees one whole ledger, the old or the new (:meth:`EtcdStore.save_nodes`). It
leaves no audit record. It was one value with a full copy in the audit trail at every write:
refused by etcd from ~2,500 nodes of 8 GPUs on, and etcd grew by twice the ledger at every
write until its space quota stopped every write (found by a review).

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

LEDGER_CHUNK_BYTES = 512 * 1024
"""Most bytes of JSON in one node-ledger key (one etcd request each; etcd's default
``--max-request-bytes`` is 1.5 MiB, base64 on the JSON gateway included)."""


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

    def _range(self, start: str, end: str) -> dict:
        """A ``request_delete_range`` op of the keys in [``start``, ``end``) under ``<prefix>/state/``."""
        state = f"{self.prefix}/state/"
        return {"request_delete_range": {"key": b64(state + start), "range_end": b64(state + end)}}

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
        """Replace the node ledger (shape: :meth:`coordinator.store.Store.save_nodes`): its
        chunks as a new generation (one fenced transaction each), then the pointer switched to
        it and every other generation deleted (and the one-key ledger of older releases) in one
        fenced transaction. A write cut short leaves the old generation in force; its chunks
        are deleted by the next write."""
        gen = f"{time.time_ns():020d}"
        what = f"state in {self.path}: write node ledger"
        for k, text in enumerate(_ledger_chunks(nodes)):
            put = {"request_put": {"key": b64(f"{self.prefix}/state/nodes/{gen}/{k:05d}"), "value": b64(text)}}
            fenced_txn(self.conn, self.leadership, [put], what)
        pointer = {"request_put": {"key": b64(f"{self.prefix}/state/nodes_gen"), "value": b64(json.dumps({"gen": gen}))}}
        legacy = {"request_delete_range": {"key": b64(f"{self.prefix}/state/nodes")}}
        # every other generation: the keys below this one's and above it ('/' + 1 = '0')
        fenced_txn(self.conn, self.leadership,
                   [pointer, legacy, self._range("nodes/", f"nodes/{gen}/"), self._range(f"nodes/{gen}0", "nodes0")],
                   what)

    def load_nodes(self) -> dict[str, dict]:
        """The node ledger of the generation in force (the one-key ledger of an older release
        when there is none); malformed entries are skipped. One range read of every ``nodes*`` key
        (pointer and chunks at one etcd revision: read apart, a leader's write between the two
        could delete the generation the pointer named)."""
        base = f"{self.prefix}/state/nodes"
        try:
            kvs = {kv["key"]: kv["value"] for kv in self.conn.get_prefix(base)}
        except EtcdError as exc:
            raise StoreError(f"state in {self.path}: read node ledger: {exc}") from None
        pointer = _json_of(base + "_gen", kvs.get(base + "_gen"))
        value: dict = {}
        if isinstance(pointer, dict) and isinstance(pointer.get("gen"), str):
            head = f"{base}/{pointer['gen']}/"
            for key in sorted(k for k in kvs if k.startswith(head)):
                chunk = _json_of(key, kvs[key])
                if isinstance(chunk, dict):
                    value.update(chunk)
        else:
            legacy = _json_of(base, kvs.get(base))
            value = legacy if isinstance(legacy, dict) else {}
        out = {}
        for name, entry in (value.items() if isinstance(value, dict) else ()):
            try:
                gpus = {int(k): [float(x) for x in v[:4]] for k, v in entry["gpus"].items()}
                out[str(name)] = {"gpus": gpus, "seen_s": float(entry.get("seen_s", 0.0))}
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("node ledger: malformed entry for %r skipped", name)
        return out


def _json_of(key: str, raw: bytes | None):
    """The JSON value ``raw`` of etcd key ``key`` (None when absent or not JSON: logged)."""
    if raw is None:
        return None
    try:
        return json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        log.warning("%s: not JSON; ignored", key)
        return None


def _ledger_chunks(nodes: dict[str, dict]) -> list[str]:
    """The node ledger ``nodes`` as JSON objects of whole nodes, each at most
    :data:`LEDGER_CHUNK_BYTES` (a node larger than that alone: 64 GPUs take ~4 KB), nodes by
    name; one empty object for an empty ledger."""
    chunks, part, size = [], [], 0
    for name in sorted(nodes):
        d = nodes[name]
        text = json.dumps(name) + ":" + json.dumps(
            {"gpus": {str(i): list(v) for i, v in d["gpus"].items()}, "seen_s": d.get("seen_s", 0.0)})
        if part and size + len(text) + 1 > LEDGER_CHUNK_BYTES:
            chunks.append("{" + ",".join(part) + "}")
            part, size = [], 0
        part.append(text)
        size += len(text) + 1
    chunks.append("{" + ",".join(part) + "}")
    return chunks
