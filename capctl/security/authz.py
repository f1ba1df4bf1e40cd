"""Who may run admin operations on the coordinator (``SetBudget``, ``ReloadPolicy``).

A caller is admin when one of these holds (docs/security.md, "Admin identity"):

1. it came over the coordinator's **admin unix socket** (mode 0600, root-only; or 0660 with the
   policy's ``coordinator.admin_group``): file permissions are the identity (:class:`TrustedTransport`);
2. it presented a **client certificate** verified against the cluster CA carrying the role
   ``admin`` (SAN URI ``capctl-role:admin``; :class:`CertRoleAuthorizer`);
3. it sent metadata ``authorization: Bearer <token>`` equal to the token in the coordinator's
   **root-only token file** (``--admin-token-file``; :class:`TokenAuthorizer`): compared with
   :func:`hmac.compare_digest` (constant time), never logged, never echoed in an error.

Read-only calls (Status, Nodes, Jobs, Explain) need no admin identity; who can reach them is
decided by the transport: any verified certificate on a TLS listener, members of the policy's
``coordinator.status_group`` on the status unix socket.

Every authorizer has ``allowed(context) -> bool``, ``decide(context) -> str | None`` (how the caller
was authorized, for the audit log, or None) and ``describe() -> str`` (what would be accepted, for
the PERMISSION_DENIED message). They duck-type the coordinator's ``AdminAuthorizer``.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from capctl.errors import UserInputError
from capctl.security.files import read_regular_file
from capctl.security.identity import ROLE_ADMIN, ROLE_URI_PREFIX, peer_identity

MAX_TOKEN_BYTES = 4096
"""Largest token file read, bytes."""
MIN_TOKEN_CHARS = 8
"""Shortest token accepted (``openssl rand -hex 32`` gives 64 characters)."""
METADATA_KEY = "authorization"
BEARER = "Bearer "


class Secret:
    """A secret string: hidden from ``repr``/``str``; compared in constant time."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value.encode("utf-8")

    def matches(self, candidate: str | bytes) -> bool:
        """Constant-time comparison with ``candidate`` (:func:`hmac.compare_digest`)."""
        if isinstance(candidate, str):
            candidate = candidate.encode("utf-8", "replace")
        return bool(self._value) and hmac.compare_digest(candidate, self._value)

    def reveal(self) -> str:
        """The secret itself (only for putting it on the wire)."""
        return self._value.decode("utf-8")

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __eq__(self, other) -> bool:  # constant time, and never equal to a plain string by accident
        return isinstance(other, Secret) and hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash(len(self._value))


def load_token_file(path: str | os.PathLike, flag: str = "--admin-token-file", *, owner_uids: Iterable[int] | None = None) -> Secret:
    """Read an admin token from a root-only file.

    The file must be a regular file owned by root or by this process's user (``owner_uids``
    overrides), with no permission bits for group or others (mode 0600 or 0400), holding one
    line of at least :data:`MIN_TOKEN_CHARS` printable ASCII characters without spaces.

    Raises:
        UserInputError: naming ``flag``, the path and what to fix — never the file's content.
    """
    path = Path(path)
    allowed_owners = set(owner_uids) if owner_uids is not None else {0, os.geteuid()}

    def check(st: os.stat_result) -> None:
        if st.st_uid not in allowed_owners:
            raise UserInputError(f"{flag} {path}: owned by uid {st.st_uid}; the token file must belong to root "
                                 f"(chown root:root {path})")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise UserInputError(f"{flag} {path}: mode {mode:04o} lets other users read or change the token; "
                                 f"run: chmod 600 {path}")

    raw = read_regular_file(flag, path, MAX_TOKEN_BYTES, check)
    if len(raw) > MAX_TOKEN_BYTES:
        raise UserInputError(f"{flag} {path}: longer than {MAX_TOKEN_BYTES} bytes")
    text = raw.decode("ascii", "replace").strip()
    if not text:
        raise UserInputError(f"{flag} {path}: empty token")
    if len(text) < MIN_TOKEN_CHARS or any(not (33 <= ord(c) <= 126) for c in text):
        raise UserInputError(f"{flag} {path}: the token must be one line of at least {MIN_TOKEN_CHARS} printable "
                             "ASCII characters without spaces (e.g. openssl rand -hex 32)")
    return Secret(text)


def bearer_metadata(token: Secret) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``token`` (what the CLI sends with admin calls)."""
    return ((METADATA_KEY, BEARER + token.reveal()),)


def bearer_from_metadata(metadata: Iterable | None) -> str | None:
    """The bearer token in ``authorization`` metadata, or None."""
    for i, item in enumerate(metadata or ()):
        if i >= 64:
            break
        try:
            key, value = item
        except (TypeError, ValueError):
            key, value = getattr(item, "key", None), getattr(item, "value", None)
        if key == METADATA_KEY and isinstance(value, str) and value.startswith(BEARER):
            return value[len(BEARER):].strip()
    return None


class Authorizer:
    """Base class: subclasses implement :meth:`decide` and :meth:`describe`."""

    def decide(self, context) -> str | None:
        """How the caller is authorized (for the audit log), or None when it is not."""
        raise NotImplementedError

    def allowed(self, context) -> bool:
        """True when the caller has an admin identity."""
        return self.decide(context) is not None

    def describe(self) -> str:
        """What would be accepted, for PERMISSION_DENIED messages."""
        return ""


class TrustedTransport(Authorizer):
    """Every caller is admin: for the admin unix socket, whose file mode is the identity. The audit
    text names the caller's uid, gid and pid when the socket is served through a
    :class:`capctl.security.peercred.CredentialSplice` (``SO_PEERCRED``)."""

    def __init__(self, where: str = "the admin socket") -> None:
        self.where = where

    def decide(self, context) -> str | None:
        from capctl.security.peercred import caller_of

        try:
            caller = caller_of(context.peer())
        except Exception:  # noqa: BLE001 (a context without a peer: no caller to name)
            caller = None
        return f"via {self.where}" + (f", {caller.describe()}" if caller is not None else "")

    def describe(self) -> str:
        return f"connect through {self.where}"


class NoOne(Authorizer):
    """Nobody is admin (a listener without any admin means)."""

    def __init__(self, hint: str = "") -> None:
        self.hint = hint

    def decide(self, context) -> str | None:
        return None

    def describe(self) -> str:
        return self.hint


class CertRoleAuthorizer(Authorizer):
    """Admin when the verified client certificate carries ``capctl-role:<role>``."""

    def __init__(self, role: str = ROLE_ADMIN) -> None:
        self.role = role

    def decide(self, context) -> str | None:
        ident = peer_identity(context)
        if ident.has_role(self.role):
            return ident.describe()
        return None

    def describe(self) -> str:
        return f"a client certificate with SAN URI {ROLE_URI_PREFIX}{self.role}"


class TokenAuthorizer(Authorizer):
    """Admin when the call's ``authorization: Bearer <token>`` metadata matches the token file."""

    def __init__(self, token: Secret) -> None:
        self._token = token

    def decide(self, context) -> str | None:
        try:
            metadata = context.invocation_metadata()
        except Exception:  # noqa: BLE001
            return None
        candidate = bearer_from_metadata(metadata)
        if candidate is not None and self._token.matches(candidate):
            return "admin token"
        return None

    def describe(self) -> str:
        return "the admin token (capctl --admin-token-file)"


class AnyOf(Authorizer):
    """Admin when any of ``authorizers`` says so (checked in order)."""

    def __init__(self, *authorizers: Authorizer) -> None:
        self.authorizers = tuple(a for a in authorizers if a is not None)

    def decide(self, context) -> str | None:
        for a in self.authorizers:
            how = a.decide(context)
            if how is not None:
                return how
        return None

    def describe(self) -> str:
        parts = [d for d in (a.describe() for a in self.authorizers) if d]
        return "admin operations need " + (" or ".join(parts) if parts else "the coordinator's admin unix socket")


def listener_authorizer(*, tls: bool, token: Secret | None, admin_socket: str | None) -> Authorizer:
    """The admin authorizer of the coordinator's ``--listen`` server.

    Args:
        tls: the listener requires client certificates (admin role accepted).
        token: the admin token, if ``--admin-token-file`` was given.
        admin_socket: path of the admin unix socket (only named in the refusal message).
    """
    parts: list[Authorizer] = []
    if tls:
        parts.append(CertRoleAuthorizer(ROLE_ADMIN))
    if token is not None:
        parts.append(TokenAuthorizer(token))
    parts.append(NoOne(f"the root-only admin socket (unix:{admin_socket})" if admin_socket
                       else "the coordinator's admin unix socket"))
    return AnyOf(*parts)
