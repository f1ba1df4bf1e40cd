"""Reading small security-sensitive files (tokens, PEM material) safely.

The file is opened once and every check is made on that open descriptor (``fstat``), so the
file checked is the file read even if the path is swapped in between.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from capctl.errors import UserInputError


def read_regular_file(flag: str, path: Path, max_bytes: int,
                      check: Callable[[os.stat_result], None] | None = None) -> bytes:
    """Read at most ``max_bytes + 1`` bytes of the regular file ``path``.

    ``check(st)`` runs on the open file's ``fstat`` result before reading and raises
    :class:`UserInputError` to refuse it (owner, mode, size). Reading one byte more than
    ``max_bytes`` lets the caller tell a file that is too long.

    Raises:
        UserInputError: ``path`` cannot be opened or is not a regular file (naming ``flag`` and
            ``path``), or whatever ``check`` raises.
    """
    try:
        # O_NONBLOCK: a FIFO at the path must not block the open (no writer: forever); the
        # fstat below refuses it; for a regular file the flag changes nothing
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UserInputError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserInputError(f"{flag} {path}: not a regular file")
        if check is not None:
            check(st)
        return os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
