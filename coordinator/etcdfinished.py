"""Finished jobs in etcd (high availability): the etcd backend of
:class:`coordinator.finished.FinishedJobStore`, beside SQLite (the default for one coordinator).

Keys, under the site prefix (as the election's and :mod:`coordinator.etcdstore`'s)::

    <prefix>/finished/<job id>   JSON of :class:`~coordinator.finished.FinishedJob`

Writes (a record, or the deletions of an expiry) are fenced by the election like every other
admin write (:func:`coordinator.etcdstore.fenced_txn`): a deposed leader cannot add or drop a record.
The retention applies at open, and on :meth:`EtcdFinishedJobs.put` at most every
:data:`EXPIRE_EVERY_S` (an expiry reads every record; per job end that would cost O(records)).
Listing reads the whole range and sorts by end time: fine for the default 100,000 records
(~30 MB); a site keeping more should lower ``--finished-max-jobs``.

Errors: :class:`~coordinator.store.StoreError` naming etcd and what failed.
"""

from __future__ import annotations

import logging
import time

from coordinator.etcdconn import EtcdConn, EtcdError, b64
from coordinator.etcdstore import fenced_txn
from coordinator.finished import MAX_LIST, FinishedJob, FinishedJobStore, Retention
from coordinator.store import StoreError

log = logging.getLogger("capctl.coordinator.etcdfinished")

EXPIRE_EVERY_S = 60.0
"""Least time (s) between two expiries triggered by :meth:`EtcdFinishedJobs.put`."""
TXN_OPS = 100
"""Deletions per transaction (etcd 3.4's default ``--max-txn-ops`` is 128)."""


class EtcdFinishedJobs(FinishedJobStore):
    """Finished jobs under ``<prefix>/finished/`` (see the module docstring).

    Args:
        conn: the etcd cluster; prefix: the site's key prefix; retention: the bounds;
        leadership: the :class:`~coordinator.election.Leadership` fencing writes (None: unfenced, for
            tools and tests; set by :class:`coordinator.hadaemon.HaSetup` before serving).
    """

    blocking_io = True
    """Calls wait on the network: the coordinator makes them off its event loop (coordinator.storeio)."""

    def __init__(self, conn: EtcdConn, prefix: str, retention: Retention | None = None, leadership=None) -> None:
        self.conn = conn
        self.prefix = (prefix.rstrip("/") or "/capctl") + "/finished/"
        self.retention = retention or Retention()
        self.leadership = leadership
        self.path = f"etcd {','.join(conn.endpoints)} {self.prefix}"
        self._expired_mono = float("-inf")

    def _txn(self, ops: list[dict], what: str) -> None:
        fenced_txn(self.conn, self.leadership, ops, f"finished jobs in {self.path}: {what}")

    def put(self, job: FinishedJob) -> None:
        self._txn([{"request_put": {"key": b64(self.prefix + job.job_id), "value": b64(job.to_json())}}],
                  f"write job {job.job_id}")
        if time.monotonic() - self._expired_mono >= EXPIRE_EVERY_S:
            self.expire(time.time())

    def get(self, job_id: str) -> FinishedJob | None:
        try:
            kv = self.conn.get(self.prefix + job_id)
        except EtcdError as exc:
            raise StoreError(f"finished jobs in {self.path}: read job {job_id}: {exc}") from None
        return _parse(kv) if kv is not None else None

    def _all(self) -> list[FinishedJob]:
        """Every readable record, newest end first (malformed ones are logged and skipped)."""
        try:
            kvs = self.conn.get_prefix(self.prefix)
        except EtcdError as exc:
            raise StoreError(f"finished jobs in {self.path}: list: {exc}") from None
        jobs = [j for j in (_parse(kv) for kv in kvs) if j is not None]
        return sorted(jobs, key=lambda j: (j.end_time_s, j.job_id), reverse=True)

    def since(self, since_s: float = 0.0, limit: int = MAX_LIST) -> list[FinishedJob]:
        return [j for j in self._all() if j.end_time_s >= since_s][:max(0, min(int(limit), MAX_LIST))]

    def expire(self, now_s: float) -> int:
        self._expired_mono = time.monotonic()
        jobs = self._all()
        oldest_kept_s = now_s - self.retention.max_age_s
        drop = [j for k, j in enumerate(jobs) if k >= self.retention.max_jobs or j.end_time_s < oldest_kept_s]
        for start in range(0, len(drop), TXN_OPS):
            batch = drop[start:start + TXN_OPS]
            self._txn([{"request_delete_range": {"key": b64(self.prefix + j.job_id)}} for j in batch],
                      f"expire {len(batch)} job(s)")
        return len(drop)


def _parse(kv: dict) -> FinishedJob | None:
    try:
        return FinishedJob.from_json(kv["value"].decode())
    except (ValueError, UnicodeDecodeError, TypeError):
        log.warning("%s: not a finished-job record; ignored", kv.get("key"))
        return None
