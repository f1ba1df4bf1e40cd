"""Secure by default: a daemon refuses clear-text gRPC on a network address.

A coordinator listening on, or an agent connecting to, a TCP address that is not loopback
(127.0.0.0/8, ``::1``, ``localhost``) needs mTLS (``--tls-ca/--tls-cert/--tls-key``,
docs/security.md): without it anyone on the network could register as an agent or read the fleet.
``--insecure`` lifts the refusal and logs a loud warning on every start. Unix sockets and loopback
are local and need neither.
"""

from __future__ import annotations

import ipaddress
import logging

from capctl.errors import UserInputError


def add_insecure_argument(parser, what: str) -> None:
    """Add ``--insecure`` to ``parser`` (``what``: the address it concerns, for the help text)."""
    parser.add_argument("--insecure", action="store_true",
                        help=f"allow clear-text gRPC on a non-loopback {what} (no TLS; anyone on the network "
                             "can talk to it). Without it such an address needs --tls-*")


def is_local(address: str) -> bool:
    """True for ``unix:``/``unix-abstract:`` targets and loopback hosts (127.0.0.0/8, ::1, localhost)."""
    if address.startswith("unix"):
        return True
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plaintext(address: str, flag: str, *, tls: bool, insecure: bool, log: logging.Logger) -> None:
    """Refuse clear text on a network ``address`` unless ``insecure``; warn loudly when allowed.

    Raises:
        UserInputError: ``address`` is TCP, not loopback, ``tls`` is False and ``insecure`` is False
            (the message names ``flag``, the address and both ways out).
    """
    if tls or is_local(address):
        return
    if not insecure:
        raise UserInputError(
            f"{flag} {address}: a network address needs TLS; give --tls-ca, --tls-cert and --tls-key "
            "(docs/security.md), use a unix socket or loopback, or pass --insecure to run in clear text")
    log.warning("INSECURE: %s %s without TLS (--insecure): anyone who can reach it can register as an agent, "
                "read the fleet and send plans; use mTLS (docs/security.md)", flag, address)
