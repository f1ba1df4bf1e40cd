"""The CLI's connection to the coordinator: :func:`admin_client` gives an
:class:`coordinator.client.AdminClient` (the one client API) on a channel with the command line's TLS
settings and admin token; errors are mapped to :mod:`capctl.errors` there.

Address resolution: ``--coordinator ADDR`` flag, else ``$CAPCTL_COORDINATOR``, else
:data:`DEFAULT_COORDINATOR`. Addresses are gRPC targets: ``unix:/path`` or ``host:port``.

Security (docs/security.md): for a ``host:port`` target, ``--tls-ca/--tls-cert/--tls-key``
(or ``$CAPCTL_TLS_CA/CERT/KEY``) make the channel mTLS with that certificate (an admin needs one
with the role ``admin``); ``--admin-token-file FILE`` (or ``$CAPCTL_ADMIN_TOKEN_FILE``, a
root-only file) sends the coordinator's admin token with every call, only over TLS, a unix socket
or loopback. Unix-socket targets always use a plain channel (their file mode is the identity).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import grpc

from capctl.errors import UserInputError
from coordinator.client import CHANNEL_OPTIONS, DEFAULT_TIMEOUT_S, AdminClient, coordinator_address

_CONNECTION: dict = {"args": None, "token_file": None, "timeout": None}
"""The parsed command line (its TLS flags are read when a channel is made) and the token file
(:func:`configure`); the environment otherwise."""


def add_connection_arguments(parser, *, suppress: bool = False) -> None:
    """Add ``--tls-ca/--tls-cert/--tls-key/--tls-server-name`` and ``--admin-token-file``.

    ``suppress``: for subcommand parsers, so that a flag given before the subcommand is kept.
    """
    import argparse

    from capctl.security.tls import add_tls_arguments

    if suppress:
        g = parser.add_argument_group("TLS / admin identity (also accepted before the subcommand)")
        for flag, help_ in (("--tls-ca", "cluster CA certificate (PEM)"), ("--tls-cert", "client certificate (PEM)"),
                            ("--tls-key", "its private key (PEM)"), ("--tls-server-name", "name to verify"),
                            ("--admin-token-file", "root-only file with the coordinator's admin token")):
            g.add_argument(flag, metavar="FILE" if "name" not in flag else "NAME", default=argparse.SUPPRESS, help=help_)
        g.add_argument("--timeout", metavar="S", default=argparse.SUPPRESS, help=_TIMEOUT_HELP)
        return
    add_tls_arguments(parser, what="host:port coordinator addresses")
    parser.add_argument("--admin-token-file", metavar="FILE", default=None,
                        help="root-only file with the coordinator's admin token (default $CAPCTL_ADMIN_TOKEN_FILE)")
    parser.add_argument("--timeout", metavar="S", default=None, help=_TIMEOUT_HELP)


_TIMEOUT_HELP = (f"deadline of each call to the coordinator, seconds (default $CAPCTL_TIMEOUT_S or "
                 f"{DEFAULT_TIMEOUT_S:g}; a large cluster's status takes longer)")
MAX_TIMEOUT_S = 3600.0
"""Longest ``--timeout`` taken (s)."""


def timeout_s(text: str | None, source: str = "--timeout") -> float:
    """The call deadline ``text`` (s) of ``source`` (a flag or variable); None: the default.

    Raises:
        UserInputError: not a number of seconds in (0, :data:`MAX_TIMEOUT_S`].
    """
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= MAX_TIMEOUT_S:  # (NaN fails too)
        raise UserInputError(f"{source} {text!r}: need seconds, more than 0 and at most {MAX_TIMEOUT_S:g}")
    return value


def configure(args) -> None:
    """Take TLS and token settings from parsed arguments (falling back to the environment). The
    TLS flags are checked when a command connects (:func:`_channel`), not here: a command that
    never connects (``policy validate``, ``sim``, ``install``) works whatever they say (a partial
    ``$CAPCTL_TLS_*`` setting refused them all; found by a review)."""
    _CONNECTION["args"] = args
    _CONNECTION["timeout"] = getattr(args, "timeout", None)  # the flag as given: checked when a command connects (as TLS)
    _CONNECTION["token_file"] = getattr(args, "admin_token_file", None) or os.environ.get("CAPCTL_ADMIN_TOKEN_FILE") or None


def _is_local(target: str) -> bool:
    from capctl.security.tls import is_unix_target

    if is_unix_target(target):
        return True
    host = target.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Adds ``authorization: Bearer <token>`` metadata to every unary call."""

    def __init__(self, metadata) -> None:
        self._metadata = tuple(metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        md = tuple(client_call_details.metadata or ()) + self._metadata
        details = client_call_details._replace(metadata=md) if hasattr(client_call_details, "_replace") else \
            _CallDetails(client_call_details.method, client_call_details.timeout, md,
                         client_call_details.credentials, getattr(client_call_details, "wait_for_ready", None),
                         getattr(client_call_details, "compression", None))
        return continuation(details, request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def _channel(target: str, credentials):
    """The channel to ``target``: TLS per :func:`configure` for host:port, the token if configured."""
    from capctl.security import tls as tlsmod

    tls_config = tlsmod.tls_from_args(_CONNECTION["args"], use_env=True)  # (UserInputError: a partial setting)
    # the client's own limits (CHANNEL_OPTIONS: a large cluster's status is more than gRPC's
    # default 4 MiB; this channel had none, so capctl status failed there: found by a review)
    options: list = list(CHANNEL_OPTIONS)
    if credentials is None and tls_config is not None and not tlsmod.is_unix_target(target):
        credentials = tlsmod.channel_credentials(tls_config)
        options += tlsmod.channel_options(tls_config)
    channel = (grpc.secure_channel(target, credentials, options=options) if credentials
               else grpc.insecure_channel(target, options=options))
    token_file = _CONNECTION["token_file"]
    if token_file:
        from capctl.security.authz import bearer_metadata, load_token_file

        if credentials is None and not _is_local(target):
            channel.close()
            raise UserInputError(f"--admin-token-file: refusing to send the admin token in clear text to {target}; "
                                 "use TLS (--tls-ca/--tls-cert/--tls-key) or the coordinator's unix socket")
        token = load_token_file(token_file)
        channel = grpc.intercept_channel(channel, _TokenInterceptor(bearer_metadata(token)))
    return channel


@contextlib.contextmanager
def admin_client(address: str | None = None) -> Iterator[AdminClient]:
    """Yield an :class:`AdminClient` on a fresh channel with the configured TLS and token; closes it.

    Raises:
        CapctlError subclasses (see :func:`coordinator.client.map_rpc_error`) for gRPC failures.
    """
    target = coordinator_address(address)
    flag = _CONNECTION["timeout"]
    deadline_s = (timeout_s(flag) if flag is not None
                  else timeout_s(os.environ.get("CAPCTL_TIMEOUT_S") or None, "$CAPCTL_TIMEOUT_S"))
    client = AdminClient(target, timeout_s=deadline_s, channel=_channel(target, None))
    try:
        yield client
    finally:
        client.close()
