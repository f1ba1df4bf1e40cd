"""The node agent's cap state file: pre-job (site) limits, job bindings, last written caps.

One JSON file per node (default ``/var/lib/capctl/caps-state.json``), readable and writable by
root only (mode 0600, directory 0700). Every write is atomic: a temporary file in the same
directory is written, fsync'ed, renamed over the old one, and the directory fsync'ed, so a crash
leaves either the old or the new file, never a mix (POSIX rename(2) atomicity).

Format (``format``/``version`` identify it; watts as JSON numbers)::

    {"format": "capctl-node-caps", "version": 1,
     "gpus": {"<index>": {"uuid": "GPU-...", "saved_limit_w": 250.0, "saved_source": "read",
                          "written_w": 200.0, "restore_pending": false}},
     "bindings": {"<job_id>": [0, 1]}}

``saved_source`` is ``"read"`` (the limit read from the device before capctl's first write) or
``"recovered"`` (read after the state file was found corrupt: possibly a job's cap, never higher
than what was in force, so restoring it never raises a cap).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from capctl.errors import CapctlError

FORMAT = "capctl-node-caps"
VERSION = 1
STATE_FILE_NAME = "caps-state.json"
"""File name of the state file inside the agent's state directory."""


class SavedStateError(CapctlError):
    """The cap state file is unreadable, truncated or malformed; the message names the file.

    ``path`` is the file, ``moved_to`` where the corrupt file was kept aside (or None).
    """

    exit_code = 5

    def __init__(self, message: str, *, path: Path, moved_to: Path | None = None):
        super().__init__(message)
        self.path = path
        self.moved_to = moved_to


@dataclass
class GpuRecord:
    """What capctl remembers about one GPU it has written to (W)."""

    uuid: str
    saved_limit_w: float
    saved_source: str = "read"
    written_w: float | None = None
    restore_pending: bool = False


@dataclass
class NodeCapState:
    """Contents of the state file: per-GPU records by index, job bindings (job id -> indices)."""

    gpus: dict[int, GpuRecord] = field(default_factory=dict)
    bindings: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The JSON document written to disk."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "gpus": {
                str(i): {
                    "uuid": r.uuid,
                    "saved_limit_w": r.saved_limit_w,
                    "saved_source": r.saved_source,
                    "written_w": r.written_w,
                    "restore_pending": r.restore_pending,
                }
                for i, r in sorted(self.gpus.items())
            },
            "bindings": {job: sorted(ix) for job, ix in sorted(self.bindings.items())},
        }


def _positive_watts(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {value!r} is not a positive number of watts")
    return float(value)


def parse_state(doc: object) -> NodeCapState:
    """Validate a decoded JSON document; raise ValueError naming the bad field."""
    if not isinstance(doc, dict):
        raise ValueError("top level: expected an object")
    if doc.get("format") != FORMAT:
        raise ValueError(f"format: {doc.get('format')!r}, expected {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise ValueError(f"version: {doc.get('version')!r}, expected {VERSION}")
    gpus_doc = doc.get("gpus")
    bindings_doc = doc.get("bindings")
    if not isinstance(gpus_doc, dict) or not isinstance(bindings_doc, dict):
        raise ValueError("gpus/bindings: expected objects")
    state = NodeCapState()
    for key, rec in gpus_doc.items():
        where = f"gpus.{key}"
        if not key.isdigit() or not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a GPU index with an object")
        uuid = rec.get("uuid")
        if not isinstance(uuid, str):
            raise ValueError(f"{where}.uuid: {uuid!r} is not a string")
        written = rec.get("written_w")
        source = rec.get("saved_source", "read")
        if source not in ("read", "recovered"):
            raise ValueError(f"{where}.saved_source: {source!r}, expected 'read' or 'recovered'")
        pending = rec.get("restore_pending", False)
        if not isinstance(pending, bool):
            raise ValueError(f"{where}.restore_pending: {pending!r} is not a boolean")
        state.gpus[int(key)] = GpuRecord(
            uuid=uuid,
            saved_limit_w=_positive_watts(rec.get("saved_limit_w"), f"{where}.saved_limit_w"),
            saved_source=source,
            written_w=None if written is None else _positive_watts(written, f"{where}.written_w"),
            restore_pending=pending,
        )
    from capctl.security.limits import check_job_id

    for job, indices in bindings_doc.items():
        if not isinstance(indices, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 64 for i in indices
        ):
            raise ValueError(f"bindings.{job}: {indices!r} is not a list of GPU indices (0 to 63)")
        problem = check_job_id(str(job), f"bindings key {str(job)[:40]!r}")
        if problem:  # (no Slurm job id: the coordinator refused every hello with it; found by a review)
            raise ValueError(problem)
        state.bindings[str(job)] = sorted(set(indices))
    return state


def load_state(path: Path) -> NodeCapState:
    """Read the state file; a missing file is an empty state.

    Raises:
        SavedStateError: unreadable, truncated or malformed (message names the file and what is
            wrong). The file is left in place; see :func:`quarantine`.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return NodeCapState()
    except OSError as err:
        raise SavedStateError(f"cap state file {path}: cannot read it: {err}", path=path) from None
    try:
        return parse_state(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SavedStateError(
            f"cap state file {path}: corrupt or truncated ({len(raw)} bytes): {err}", path=path
        ) from None
    except ValueError as err:
        raise SavedStateError(f"cap state file {path}: malformed: {err}", path=path) from None


def quarantine(path: Path, *, now_s: float | None = None) -> Path | None:
    """Move a corrupt state file aside as ``<name>.corrupt.<unix time>``; return the new path."""
    path = Path(path)
    stamp = int(time.time() if now_s is None else now_s)
    target = path.with_name(f"{path.name}.corrupt.{stamp}")
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt.{stamp}.{n}")
    try:
        os.replace(path, target)
    except OSError:
        return None
    return target


def store_state(path: Path, state: NodeCapState) -> None:
    """Write the state file atomically (see :func:`atomic_write`).

    Raises:
        OSError: the directory is not writable (the caller reports it; caps are still applied).
    """
    atomic_write(path, (json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n").encode("utf-8"))


def atomic_write(path: Path, data: bytes) -> None:
    """The one atomic write of the agent's state directory: a temp file (0600, ``O_NOFOLLOW``) in
    the same directory, written and fsync'ed, renamed over ``path``, then the directory fsync'ed,
    so a crash leaves either the old or the new content, never a partial file.

    Raises:
        OSError: the directory is not writable (or ``path``'s temp name is a symlink).
    """
    path = Path(path)
    ensure_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        finally:
            raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` (mode 0700) if missing; existing directories are left as they are."""
    directory = Path(directory)
    if not directory.is_dir():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
