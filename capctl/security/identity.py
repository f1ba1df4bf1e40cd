"""The identity of a gRPC caller, from the peer certificate that gRPC verified (mTLS).

Roles (docs/security.md, "Identities and roles"): a capctl role is carried in the certificate's
subject alternative names as a URI ``capctl-role:<role>`` (:data:`ROLE_URI_PREFIX`):

==========  ===============================================================================
``admin``   may run admin operations (``capctl budget set``, ``capctl policy reload``)
``agent``   may open an AgentLink stream, only for the node its certificate names (CN or DNS SAN)
``reader``  read-only status (any valid certificate of the cluster CA can read status)
==========  ===============================================================================

Why a SAN URI and not an OU: gRPC hands servers the verified SANs as separate properties
(``peer_uri``, ``peer_dns``) but the subject only as one formatted string; a URI can't be confused
with a host name, and a certificate can carry several roles. An OU in the subject is ignored.

Source of the property names: gRPC core ``grpc_security_constants.h`` / ``ssl_utils.cc``
(``transport_security_type``, ``x509_common_name``, ``x509_subject``, ``peer_dns``, ``peer_uri``),
checked against grpcio 1.85 by tests/security/test_identity.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ROLE_URI_PREFIX = "capctl-role:"
"""SAN URI prefix of a capctl role: ``capctl-role:admin``."""

ROLE_ADMIN = "admin"
ROLE_AGENT = "agent"
ROLE_READER = "reader"
KNOWN_ROLES = (ROLE_ADMIN, ROLE_AGENT, ROLE_READER)

_ROLE_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
_MAX_VALUES = 64  # SAN entries looked at per property (bounded input)
_MAX_VALUE_LEN = 1024


@dataclass(frozen=True)
class PeerIdentity:
    """Who is calling, as far as the transport proves it.

    Attributes:
        transport: gRPC's ``transport_security_type``: ``"ssl"`` (verified certificate),
            ``"insecure"`` (plain TCP or unix socket), ``"local"``, or ``""`` if unknown.
        common_name: subject CN of the verified client certificate ("" without one).
        dns_names: DNS SANs of that certificate.
        uris: URI SANs of that certificate.
        subject: the subject as gRPC formats it (e.g. ``"CN=alice,O=example"``), for logs.
    """

    transport: str = ""
    common_name: str = ""
    dns_names: tuple[str, ...] = ()
    uris: tuple[str, ...] = ()
    subject: str = ""

    @property
    def verified(self) -> bool:
        """True when the caller presented a certificate that gRPC verified against the CA."""
        return self.transport == "ssl" and bool(self.common_name or self.dns_names or self.uris)

    @property
    def roles(self) -> frozenset[str]:
        """capctl roles named by ``capctl-role:<role>`` SAN URIs (only for verified certificates)."""
        if not self.verified:
            return frozenset()
        out = set()
        for uri in self.uris:
            if uri.startswith(ROLE_URI_PREFIX):
                role = uri[len(ROLE_URI_PREFIX):]
                if _ROLE_RE.match(role):
                    out.add(role)
        return frozenset(out)

    def has_role(self, role: str) -> bool:
        return role in self.roles

    def names(self) -> frozenset[str]:
        """The host/person names the certificate proves: CN and DNS SANs (empty if not verified)."""
        if not self.verified:
            return frozenset()
        return frozenset(n for n in (self.common_name, *self.dns_names) if n)

    def describe(self) -> str:
        """Short form for logs and audit lines, e.g. ``cert CN=alice roles=admin``."""
        if not self.verified:
            return f"unauthenticated ({self.transport or 'unknown'} transport)"
        roles = ",".join(sorted(self.roles)) or "none"
        return f"cert CN={self.common_name or '?'} roles={roles}"


def _texts(values: Iterable | None) -> tuple[str, ...]:
    out = []
    for i, v in enumerate(values or ()):
        if i >= _MAX_VALUES:
            break
        s = v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)
        out.append(s[:_MAX_VALUE_LEN])
    return tuple(out)


def identity_from_auth_context(auth: Mapping[str, Iterable] | None) -> PeerIdentity:
    """Build a :class:`PeerIdentity` from gRPC's ``context.auth_context()`` mapping.

    ``auth`` maps property names to lists of bytes values; a missing or empty mapping gives an
    unauthenticated identity. Never raises on odd input.
    """
    if not auth:
        return PeerIdentity()
    get = lambda key: _texts(auth.get(key))  # noqa: E731
    transport = (get("transport_security_type") or ("",))[0]
    return PeerIdentity(
        transport=transport,
        common_name=(get("x509_common_name") or ("",))[0],
        dns_names=get("peer_dns"),
        uris=get("peer_uri"),
        subject=(get("x509_subject") or ("",))[0],
    )


def peer_identity(context) -> PeerIdentity:
    """The caller's :class:`PeerIdentity` from a gRPC servicer context (sync or aio)."""
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001 — a context without auth data is simply unauthenticated
        return PeerIdentity()
    return identity_from_auth_context(auth)


def agent_identity_problem(identity: PeerIdentity, node: str) -> str:
    """Check that a TLS caller may speak for agent ``node``; return "" if so, else the problem.

    Allowed: a verified certificate with role ``agent`` whose CN or a DNS SAN equals ``node``.
    Callers on insecure transports are not checked here (the coordinator only calls this on its
    TLS listener).
    """
    if not identity.verified:
        return "no verified client certificate"
    if ROLE_AGENT not in identity.roles:
        return (f"certificate {identity.describe()} lacks the agent role "
                f"(SAN URI {ROLE_URI_PREFIX}{ROLE_AGENT})")
    if node not in identity.names():
        names = ", ".join(sorted(identity.names())) or "none"
        return f"certificate names {names}, not node {node[:64]!r} (CN or DNS SAN must be the node name)"
    return ""
