"""Finished jobs the coordinator keeps: energy, GPU-seconds, mean and peak power, time capped and
time in thermal slowdown of every job that ended (issue 13; docs/coordinator.md, "Finished jobs").

The store is an interface, :class:`FinishedJobStore`, with two backends here:
:class:`SqliteFinishedJobs` (``finished-jobs.db`` in ``--state-dir``: survives restarts) and
:class:`MemoryFinishedJobs` (no state directory, or the database cannot be opened). Another
backend (e.g. etcd for a replicated coordinator) implements the same five methods.

Retention is bounded (:class:`Retention`): records older than ``max_age_s`` (by end time) are
dropped, and beyond ``max_jobs`` the oldest go first. Both apply at every :meth:`put` and at open,
so the store never holds more than ``max_jobs`` records.

Errors: :class:`~coordinator.store.StoreError` naming the database and what failed; the caller
logs it, raises an alert and keeps running (the record is kept in memory instead).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import sqlite3
import time

from coordinator.store import BUSY_TIMEOUT_S, StoreError

DB_NAME = "finished-jobs.db"
DEFAULT_MAX_AGE_S = 30 * 86400.0
"""Default retention: 30 days (s) after a job's end."""
DEFAULT_MAX_JOBS = 100_000
"""Default cap on the number of finished jobs kept (~300 bytes each in SQLite: ~30 MB)."""
MAX_LIST = 10_000
"""At most this many records per query (newest first)."""


@dataclasses.dataclass(frozen=True)
class Retention:
    """How long finished jobs are kept: ``max_age_s`` seconds after their end, at most ``max_jobs``.

    Raises:
        ValueError: a non-positive bound.
    """

    max_age_s: float = DEFAULT_MAX_AGE_S
    max_jobs: int = DEFAULT_MAX_JOBS

    def __post_init__(self) -> None:
        if not self.max_age_s > 0:
            raise ValueError(f"finished-job retention {self.max_age_s!r} s: give a positive number of seconds")
        if not int(self.max_jobs) >= 1:
            raise ValueError(f"finished-job maximum {self.max_jobs!r}: give a positive count")


@dataclasses.dataclass
class FinishedJob:
    """One finished job, summed over its nodes (J, GPU-seconds, W, Unix s); see ``FinishedJob``
    in protos/capctl/v1/capctl.proto for each field."""

    job_id: str
    user: str = ""
    partition: str = ""
    account: str = ""
    nodes: tuple[str, ...] = ()
    gpus: int = 0
    start_time_s: float = 0.0
    end_time_s: float = 0.0
    energy_j: float = 0.0
    gpu_s: float = 0.0
    mean_power_w: float = 0.0
    peak_power_w: float = 0.0
    capped_s: float = 0.0
    thermal_s: float = 0.0
    resets: int = 0
    complete: bool = True

    def to_proto(self):
        """The ``capctl.v1.FinishedJob`` of this record."""
        from capctl.v1 import capctl_pb2 as pb

        d = dataclasses.asdict(self)
        d["nodes"] = list(self.nodes)
        return pb.FinishedJob(**d)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FinishedJob":
        """Parse :meth:`to_json`'s output; unknown keys are ignored.

        Raises:
            ValueError: not a JSON object with a ``job_id``.
        """
        d = json.loads(text)
        if not isinstance(d, dict) or "job_id" not in d:
            raise ValueError("not a finished-job record")
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        d["nodes"] = tuple(d.get("nodes", ()))
        return cls(**d)


class FinishedJobStore(abc.ABC):
    """Where finished jobs are kept (see the module docstring). Methods raise ``StoreError``."""

    retention: Retention
    path: str = ""

    @abc.abstractmethod
    def put(self, job: FinishedJob) -> None:
        """Keep ``job`` (replacing a record of the same id), then apply the retention."""

    @abc.abstractmethod
    def get(self, job_id: str) -> FinishedJob | None:
        """The record of ``job_id``, or None."""

    @abc.abstractmethod
    def since(self, since_s: float = 0.0, limit: int = MAX_LIST) -> list[FinishedJob]:
        """Records of jobs that ended at or after ``since_s`` (Unix s), newest first, at most ``limit``."""

    @abc.abstractmethod
    def expire(self, now_s: float) -> int:
        """Apply the retention at ``now_s`` (Unix s); returns how many records were dropped."""

    def close(self) -> None:
        """Release the backend (idempotent)."""


class MemoryFinishedJobs(FinishedJobStore):
    """In-memory backend (lost at exit): no state directory, or its database is broken."""

    def __init__(self, retention: Retention | None = None) -> None:
        self.retention = retention or Retention()
        self._jobs: dict[str, FinishedJob] = {}

    def put(self, job: FinishedJob) -> None:
        self._jobs.pop(job.job_id, None)
        self._jobs[job.job_id] = job
        self.expire(time.time())

    def get(self, job_id: str) -> FinishedJob | None:
        return self._jobs.get(job_id)

    def since(self, since_s: float = 0.0, limit: int = MAX_LIST) -> list[FinishedJob]:
        rows = sorted((j for j in self._jobs.values() if j.end_time_s >= since_s),
                      key=lambda j: (j.end_time_s, j.job_id), reverse=True)
        return rows[:max(0, min(int(limit), MAX_LIST))]

    def expire(self, now_s: float) -> int:
        cutoff = now_s - self.retention.max_age_s
        old = [k for k, j in self._jobs.items() if j.end_time_s < cutoff]
        for k in old:
            del self._jobs[k]
        extra = len(self._jobs) - int(self.retention.max_jobs)
        if extra > 0:
            for j in sorted(self._jobs.values(), key=lambda j: (j.end_time_s, j.job_id))[:extra]:
                del self._jobs[j.job_id]
        return len(old) + max(0, extra)


class SqliteFinishedJobs(FinishedJobStore):
    """SQLite backend: ``finished-jobs.db`` in the state directory (one row per job, JSON data).

    Raises:
        StoreError: on open when the file cannot be created, is corrupt or is not a database.
    """

    def __init__(self, state_dir: str, retention: Retention | None = None) -> None:
        self.retention = retention or Retention()
        self.path = os.path.join(state_dir, DB_NAME)
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            ok = db.execute("PRAGMA quick_check").fetchone()
            if not ok or ok[0] != "ok":
                db.close()
                raise StoreError(f"finished-job database {self.path} is corrupt: quick_check says {ok[0] if ok else '?'}")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS finished_jobs (job_id TEXT PRIMARY KEY, end_time_s REAL NOT NULL,"
                       " data TEXT NOT NULL)")
            db.execute("CREATE INDEX IF NOT EXISTS finished_jobs_end ON finished_jobs(end_time_s)")
        except OSError as exc:
            raise StoreError(f"finished-job database {self.path}: {exc.strerror}") from None
        except sqlite3.Error as exc:
            raise StoreError(f"finished-job database {self.path}: {exc} (move it away to start afresh)") from None
        self._db: sqlite3.Connection | None = db
        self.expire(time.time())

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"finished-job database {self.path} is not open")
        return self._db

    def _run(self, what: str, sql: str, args=()):
        try:
            return self._conn().execute(sql, args)
        except sqlite3.Error as exc:
            raise StoreError(f"finished-job database {self.path}: {what}: {exc}") from None

    def put(self, job: FinishedJob) -> None:
        self._run(f"write job {job.job_id}", "INSERT OR REPLACE INTO finished_jobs(job_id, end_time_s, data) "
                  "VALUES (?, ?, ?)", (job.job_id, float(job.end_time_s), job.to_json()))
        self.expire(time.time())

    def get(self, job_id: str) -> FinishedJob | None:
        row = self._run(f"read job {job_id}", "SELECT data FROM finished_jobs WHERE job_id = ?", (job_id,)).fetchone()
        return self._parse(row[0]) if row else None

    def since(self, since_s: float = 0.0, limit: int = MAX_LIST) -> list[FinishedJob]:
        rows = self._run("list jobs", "SELECT data FROM finished_jobs WHERE end_time_s >= ? "
                         "ORDER BY end_time_s DESC, job_id DESC LIMIT ?",
                         (float(since_s), max(0, min(int(limit), MAX_LIST)))).fetchall()
        return [j for j in (self._parse(r[0]) for r in rows) if j is not None]

    def expire(self, now_s: float) -> int:
        cur = self._run("expire", "DELETE FROM finished_jobs WHERE end_time_s < ?",
                        (now_s - self.retention.max_age_s,))
        n = cur.rowcount
        cur = self._run("expire", "DELETE FROM finished_jobs WHERE job_id IN (SELECT job_id FROM finished_jobs "
                        "ORDER BY end_time_s DESC, job_id DESC LIMIT -1 OFFSET ?)", (int(self.retention.max_jobs),))
        return n + cur.rowcount

    @staticmethod
    def _parse(text: str) -> FinishedJob | None:
        try:
            return FinishedJob.from_json(text)
        except (ValueError, TypeError):
            return None  # a malformed row is skipped (never a crash of the daemon)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def explain_finished(job: FinishedJob) -> str:
    """The human text ``capctl explain`` shows for a finished job (J, W, s)."""
    import datetime

    def when(t: float) -> str:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if t else "?"

    wall_s = job.end_time_s - job.start_time_s if job.end_time_s > job.start_time_s > 0 else 0.0
    lines = [
        f"job {job.job_id}: finished {when(job.end_time_s)} after {wall_s:.1f} s on {job.gpus} GPU(s) "
        f"({', '.join(job.nodes) or '?'}).",
        f"Energy {job.energy_j:.1f} J ({job.energy_j / 3.6e6:.4f} kWh), {job.gpu_s:.1f} GPU-seconds, mean power "
        f"{job.mean_power_w:.1f} W, peak {job.peak_power_w:.1f} W.",
        f"Power-capped {job.capped_s:.1f} GPU-s"
        + (f" ({100 * job.capped_s / job.gpu_s:.0f} %)" if job.gpu_s > 0 else "")
        + f", in thermal slowdown {job.thermal_s:.1f} GPU-s"
        + (f" ({100 * job.thermal_s / job.gpu_s:.0f} %)." if job.gpu_s > 0 else "."),
    ]
    if job.resets:
        lines.append(f"An energy counter was reset (driver reload) in {job.resets} interval(s): the energy may be "
                     "short by up to one report interval each.")
    if not job.complete:
        lines.append("Incomplete: some node did not send its final energy (figures up to its last report).")
    return "\n".join(lines)


def open_store(state_dir: str | None, retention: Retention | None = None) -> tuple[FinishedJobStore, str]:
    """The finished-job store of ``state_dir`` (SQLite) and the error met opening it ("" when none);
    a broken database or no directory gives the in-memory store."""
    if not state_dir:
        return MemoryFinishedJobs(retention), ""
    try:
        return SqliteFinishedJobs(state_dir, retention), ""
    except StoreError as exc:
        return MemoryFinishedJobs(retention), str(exc)
