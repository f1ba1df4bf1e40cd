"""Job ends left for the agent when the epilog could not deliver them (shared by slurm/ and nodeagent/).

An epilog that cannot reach the local agent (down, restarting, paused, too slow within the hook's
time bound) used to lose the job's end: the agent kept the finished job bound for good, its GPUs at
the job's caps, its budget share taken from running jobs (found on a real Slurm cluster). So the
epilog leaves one empty file per such job in the agent's drop box, ``<agent socket path>.ended/``
(the directory 0700, root's like the socket), and the agent ends every job it finds there at its
next interval (``JobEnd`` semantics: idempotent, so a JobEnd that did arrive late changes nothing),
then removes the file.

File names are the job ids; only ids made of ``[A-Za-z0-9_.+:-]`` (the ids the agent takes) (Slurm's: digits, ``_`` for array
tasks, ``+`` for heterogeneous jobs), at most :data:`MAX_ID_LEN` characters, are written or read.
"""

from __future__ import annotations

import os
import re

MAX_ID_LEN = 128
_ID = re.compile(r"[A-Za-z0-9_.+:-]{1,%d}" % MAX_ID_LEN)  # as capctl.security.limits.check_job_id
SUFFIX = ".ended"


def drop_box(socket_path: str) -> str:
    """The drop box directory of the agent listening on ``socket_path``."""
    return str(socket_path) + SUFFIX


def leave(socket_path: str, job_id: str) -> str:
    """Leave ``job_id``'s end in the drop box of the agent at ``socket_path``; returns the file's
    path, or "" when the id is not a plain job id (nothing written). Raises OSError when the
    directory or the file cannot be written, the agent's directory (the socket's) missing included
    (the caller logs it)."""
    if not _ID.fullmatch(job_id or "") or job_id in (".", ".."):
        return ""
    box = drop_box(socket_path)
    try:  # (the box only: the agent's directory must exist, no other is created)
        os.mkdir(box, 0o700)
    except FileExistsError:
        pass
    path = os.path.join(box, job_id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    return path


def waiting(socket_path: str) -> list[str]:
    """The job ids left in the drop box of the agent at ``socket_path`` (sorted; none when it does
    not exist). Names that are no plain job id are ignored."""
    try:
        names = os.listdir(drop_box(socket_path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if _ID.fullmatch(n) and n not in (".", ".."))


def left_at(socket_path: str, job_id: str) -> float | None:
    """When ``job_id``'s end was left (the file's modification time, Unix s), or None when it is gone."""
    try:
        return os.stat(os.path.join(drop_box(socket_path), job_id), follow_symlinks=False).st_mtime
    except OSError:
        return None


def done(socket_path: str, job_id: str) -> None:
    """Remove ``job_id``'s file from the drop box (gone already: nothing to do)."""
    try:
        os.unlink(os.path.join(drop_box(socket_path), job_id))
    except FileNotFoundError:
        pass
