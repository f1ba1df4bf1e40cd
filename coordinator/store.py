"""Persistent admin state of the coordinator: SQLite in ``--state-dir`` (``coordinator.db``).

Admin changes live here: the budget set by ``capctl budget set``, with the policy budget it
overrode, and an audit trail. The cluster's soft state is rebuilt from the agents, except one
safety record: the *node ledger*, the highest cap each GPU of each known node may be enforcing
(written before any increase is sent, and every 30 s). After a restart, nodes whose agents have
not reconnected yet are counted at those caps (stale, spent) instead of being invisible.

Rule for budget vs policy file: the newest explicit change wins. An override is kept across
restarts and policy reloads as long as the policy file still says the budget it overrode; when the
policy file's ``budget_w`` changes, the file wins and the override is dropped.

Errors: :class:`StoreError` (a ``CapctlError``) with the path and SQLite's reason, e.g. a corrupt
or truncated file or an unwritable directory. The daemon logs it, raises an alert and keeps running
on its last good state in memory.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from contextlib import contextmanager

from capctl.errors import CapctlError

log = logging.getLogger("capctl.coordinator.store")

DB_NAME = "coordinator.db"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 2.0
"""Bounded wait on a locked database, seconds."""


class StoreError(CapctlError):
    """The state database cannot be opened, read or written (message names path and reason)."""


class Store:
    """The coordinator's SQLite state file. Every method raises :class:`StoreError` on failure."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, DB_NAME)
        self._db: sqlite3.Connection | None = None

    def open(self) -> None:
        """Create/open the database and check its integrity (``PRAGMA quick_check``)."""
        try:
            os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"state directory {self.state_dir}: cannot create: {exc.strerror}") from None
        try:
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            ok = db.execute("PRAGMA quick_check").fetchone()
            if not ok or ok[0] != "ok":
                db.close()
                raise StoreError(f"state database {self.path} is corrupt: quick_check says {ok[0] if ok else '?'}")
            db.execute(
                "CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL, updated_s REAL NOT NULL)"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS audit (id INTEGER PRIMARY KEY AUTOINCREMENT, time_s REAL NOT NULL,"
                " action TEXT NOT NULL, detail TEXT NOT NULL)"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS nodes (name TEXT PRIMARY KEY, data TEXT NOT NULL, updated_s REAL NOT NULL)"
            )
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            raise StoreError(f"state database {self.path}: {exc} (move it away to start afresh)") from None
        self._db = db

    @property
    def ok(self) -> bool:
        """True when the database is open."""
        return self._db is not None

    def close(self) -> None:
        """Close the database (idempotent)."""
        if self._db is not None:
            self._db.close()
            self._db = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"state database {self.path} is not open")
        return self._db

    def get(self, key: str):
        """The JSON value stored under ``key``, or None."""
        try:
            row = self._conn().execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"state database {self.path}: read {key}: {exc}") from None
        return json.loads(row[0]) if row else None

    def put(self, key: str, value, action: str) -> None:
        """Store ``value`` (JSON-serialisable) under ``key`` and append an audit record, atomically."""
        now = time.time()
        with self._write(key) as db:
            if value is None:
                db.execute("DELETE FROM settings WHERE key = ?", (key,))
            else:
                db.execute(
                    "INSERT INTO settings(key, value, updated_s) VALUES (?, ?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_s = excluded.updated_s",
                    (key, json.dumps(value), now),
                )
            db.execute(
                "INSERT INTO audit(time_s, action, detail) VALUES (?, ?, ?)", (now, action, json.dumps(value))
            )

    @contextmanager
    def _write(self, what: str):
        """One write transaction (``BEGIN IMMEDIATE`` .. ``COMMIT``, rolled back on any exception).

        Raises:
            StoreError: a SQLite error, naming the database and ``what`` was being written.
        """
        try:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"state database {self.path}: write {what}: {exc}") from None

    # -- budget override ------------------------------------------------------------------------
    def budget_override(self) -> dict | None:
        """``{"budget_w": W, "policy_budget_w": W, "time_s": t}`` or None."""
        value = self.get("budget_override")
        return value if isinstance(value, dict) and "budget_w" in value else None

    def set_budget_override(self, budget_w: float, policy_budget_w: float) -> None:
        """Persist an admin budget (W) overriding the policy file's ``policy_budget_w``."""
        self.put(
            "budget_override",
            {"budget_w": float(budget_w), "policy_budget_w": float(policy_budget_w), "time_s": time.time()},
            "budget set",
        )

    def clear_budget_override(self) -> None:
        """Drop the budget override (the policy file's budget applies)."""
        self.put("budget_override", None, "budget override cleared")

    # -- node ledger ------------------------------------------------------------------------------
    def save_nodes(self, nodes: dict[str, dict]) -> None:
        """Replace the node ledger: ``{node: {"gpus": {index: [accounted_w, min_cap_w, max_cap_w,
        safe_cap_w]}, "seen_s": unix time}}`` (W, s), in one transaction."""
        now = time.time()
        with self._write("node ledger") as db:
            db.execute("DELETE FROM nodes")
            db.executemany("INSERT INTO nodes(name, data, updated_s) VALUES (?, ?, ?)",
                           [(name, json.dumps(data), now) for name, data in nodes.items()])

    def load_nodes(self) -> dict[str, dict]:
        """The node ledger (see :meth:`save_nodes`); malformed rows are skipped."""
        try:
            rows = self._conn().execute("SELECT name, data FROM nodes").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"state database {self.path}: read node ledger: {exc}") from None
        out = {}
        for name, data in rows:
            try:
                value = json.loads(data)
                gpus = {int(k): [float(x) for x in v[:4]] for k, v in value["gpus"].items()}
                out[str(name)] = {"gpus": gpus, "seen_s": float(value.get("seen_s", 0.0))}
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("node ledger: malformed row for %r skipped", name)
        return out
