"""Private temporary directories of the capctl daemons (their internal unix sockets), and the
removal of those a killed daemon left behind.

A daemon stopped cleanly removes its own (``nodeagent.local``, ``capctl.security.peercred``); one
killed with SIGKILL cannot, and its directory stayed in ``$TMPDIR`` for good (26 agent and 22
coordinator directories on the test host after a day of suites; under systemd ``PrivateTmp=yes``
removes them). :func:`make` writes the creating process's pid in :data:`OWNER_FILE` and first
removes this user's directories of the same prefix whose owner process is gone
(:func:`remove_stale`). Stdlib only (the agent's installation has no numpy).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = "owner.pid"
"""The file in a private directory holding the pid of the daemon that made it."""


def make(prefix: str) -> str:
    """A new private directory (mode 0700) in ``$TMPDIR`` named ``prefix`` + random, with this
    process's pid in :data:`OWNER_FILE`; the stale ones of ``prefix`` are removed first.

    Raises:
        OSError: the directory or its owner file cannot be made.
    """
    remove_stale(prefix)
    path = tempfile.mkdtemp(prefix=prefix)
    os.chmod(path, 0o700)  # whatever the umask: the daemon binds its sockets in it
    fd = os.open(os.path.join(path, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return path


def remove_stale(prefix: str, owner_file: str = OWNER_FILE) -> list[str]:
    """Remove this user's ``prefix*`` directories in ``$TMPDIR`` whose ``owner_file`` names a
    process that is gone; returns their paths. Kept: a directory without that file (one being
    made now, or an older release's), a live or unknown owner (a reused pid: the safe side), a
    symbolic link, another user's. (Also the demo's work directories: ``capctl.demo.run``.)"""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(prefix + "*"):
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.geteuid():
                continue
            pid = int((d / owner_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if pid <= 0 or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed
