"""systemd's service notification protocol (sd_notify(3)), for ``Type=notify`` units.

systemd passes ``$NOTIFY_SOCKET`` (a unix datagram socket path; ``@`` = abstract namespace) to a
service; the service sends newline-separated ``KEY=VALUE`` assignments as one datagram:
``READY=1`` when serving, ``RELOADING=1`` + ``MONOTONIC_USEC=`` when a reload starts and
``READY=1`` when it ends, ``STOPPING=1`` on shutdown, ``STATUS=...`` free text shown by
``systemctl status``. Without ``$NOTIFY_SOCKET`` (not started by systemd) every call does nothing.
Source: sd_notify(3), systemd.service(5) (``Type=notify``, ``Type=notify-reload``).
"""

from __future__ import annotations

import os
import socket
import time

ENV = "NOTIFY_SOCKET"


def notify(*assignments: str) -> bool:
    """Send ``assignments`` (``"READY=1"``, ``"STATUS=serving"``...) to systemd.

    Returns True when sent, False without ``$NOTIFY_SOCKET`` or when the socket is gone (a daemon
    never fails for lack of systemd). Never raises.
    """
    path = os.environ.get(ENV)
    if not path or not assignments:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(path)
            sock.sendall("\n".join(assignments).encode())
        return True
    except OSError:
        return False


def ready(status: str = "") -> bool:
    """``READY=1`` (and ``STATUS=status``): the service is serving."""
    return notify("READY=1", *([f"STATUS={status}"] if status else []))


def reloading() -> bool:
    """``RELOADING=1`` with ``MONOTONIC_USEC`` (CLOCK_MONOTONIC, µs) as systemd requires."""
    return notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


def stopping() -> bool:
    """``STOPPING=1``: shutdown has begun."""
    return notify("STOPPING=1")
