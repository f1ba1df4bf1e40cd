"""Test certificates made with the ``cryptography`` library (DEVELOPERS.md: "cryptography (test certs)").

A cluster CA and certificates issued the way docs/security.md describes for production (there with
``openssl``): role in a SAN URI ``capctl-role:<role>``, the node name as CN (and DNS SAN) of an
agent certificate, the coordinator's host names/IPs as SANs of its server certificate.

Example::

    from tests.support.certs import make_pki
    pki = make_pki(tmp_path)                 # writes PEM files under tmp_path/pki
    pki.server.cert_path, pki.ca_path        # coordinator: --tls-cert/--tls-key/--tls-ca
    pki.agent("n1").cert_path                # agent n1 (CN n1, role agent)
    pki.admin.cert_path                      # admin CLI (role admin)
    pki.wrong_ca_client, pki.expired_client  # must be refused

Keys are EC P-256 (fast to generate); all files are written with mode 0600.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLE_URI_PREFIX = "capctl-role:"
"""Must match :data:`capctl.security.identity.ROLE_URI_PREFIX` (checked by a test)."""


@dataclass
class Issued:
    """One certificate and its key, in memory (PEM bytes) and on disk."""

    name: str
    cert_pem: bytes
    key_pem: bytes
    cert_path: Path
    key_path: Path
    cert: x509.Certificate = field(repr=False)
    key: ec.EllipticCurvePrivateKey = field(repr=False)


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, 0o600)
    return path


def make_ca(directory: Path, name: str = "ca", cn: str = "capctl test cluster CA") -> Issued:
    """A self-signed CA certificate (10 years, pathlen 0) written as ``<name>.pem``/``<name>.key``."""
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "capctl tests"),
                         x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = _key_pem(key)
    directory = Path(directory)
    return Issued(name, cert_pem, key_pem, _write(directory / f"{name}.pem", cert_pem),
                  _write(directory / f"{name}.key", key_pem), cert, key)


def issue(ca: Issued, directory: Path, name: str, cn: str, *, dns: tuple[str, ...] = (),
          ips: tuple[str, ...] = (), roles: tuple[str, ...] = (), server: bool = False, client: bool = True,
          not_before: _dt.datetime | None = None, not_after: _dt.datetime | None = None,
          organizational_unit: str | None = None) -> Issued:
    """Issue a leaf certificate from ``ca``; writes ``<name>.pem`` and ``<name>.key`` in ``directory``.

    Args:
        cn: subject common name (an agent's node name, the coordinator's host name, a person).
        dns, ips: subject alternative names (DNS names, IP addresses).
        roles: capctl roles, each as a SAN URI ``capctl-role:<role>`` (``admin``, ``agent``, ``reader``).
        server, client: extended key usages serverAuth / clientAuth.
        not_before, not_after: validity (default: 5 minutes ago .. 1 year).
        organizational_unit: optional subject OU (capctl ignores it; used to show that it does).
    """
    key = _key()
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "capctl tests")]
    if organizational_unit:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, organizational_unit))
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    now = _now()
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    sans += [x509.UniformResourceIdentifier(ROLE_URI_PREFIX + r) for r in roles]
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs)).issuer_name(ca.cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - _dt.timedelta(minutes=5))
        .not_valid_after(not_after or now + _dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = _key_pem(key)
    directory = Path(directory)
    return Issued(name, cert_pem, key_pem, _write(directory / f"{name}.pem", cert_pem),
                  _write(directory / f"{name}.key", key_pem), cert, key)


class TestPKI:
    """A cluster CA with the certificates the tests need; agent certificates made on demand.

    Attributes:
        ca: the cluster CA; ``ca_path`` its certificate (what every daemon gets as ``--tls-ca``).
        server: the coordinator's certificate (CN ``capctl-coordinator``, SANs ``localhost``,
            ``127.0.0.1``, ``::1``; serverAuth + clientAuth).
        admin: a person with role ``admin`` (CN ``alice``).
        reader: a client with role ``reader`` only (read-only status).
        norole: a valid client certificate of the cluster CA without any capctl role.
        wrong_ca_client: role ``admin`` but issued by another CA (must be refused).
        expired_client: role ``admin`` from the cluster CA, expired yesterday (must be refused).
        other_ca: that other CA.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        d = self.directory
        self.ca = make_ca(d)
        self.ca_path = self.ca.cert_path
        self.server = issue(self.ca, d, "coordinator", "capctl-coordinator", dns=("localhost",),
                            ips=("127.0.0.1", "::1"), server=True, client=True)
        self.admin = issue(self.ca, d, "admin", "alice", roles=("admin",))
        self.reader = issue(self.ca, d, "reader", "bob", roles=("reader",))
        self.norole = issue(self.ca, d, "norole", "carol")
        self.ou_admin = issue(self.ca, d, "ou-admin", "mallory", organizational_unit="admin")
        self.other_ca = make_ca(d, "other-ca", "some other CA")
        self.wrong_ca_client = issue(self.other_ca, d, "wrong-ca-admin", "eve", roles=("admin",))
        self.wrong_ca_server = issue(self.other_ca, d, "wrong-ca-server", "capctl-coordinator",
                                     dns=("localhost",), ips=("127.0.0.1",), server=True)
        yesterday = _now() - _dt.timedelta(days=1)
        self.expired_client = issue(self.ca, d, "expired-admin", "oscar", roles=("admin",),
                                    not_before=yesterday - _dt.timedelta(days=30), not_after=yesterday)
        self._agents: dict[str, Issued] = {}

    def agent(self, node: str) -> Issued:
        """The agent certificate of ``node`` (CN and DNS SAN = node name, role ``agent``)."""
        if node not in self._agents:
            self._agents[node] = issue(self.ca, self.directory, f"agent-{node}", node, dns=(node,), roles=("agent",))
        return self._agents[node]

    def tls_args(self, issued: Issued) -> list[str]:
        """``--tls-ca/--tls-cert/--tls-key`` arguments for a daemon or the CLI using ``issued``."""
        return ["--tls-ca", str(self.ca_path), "--tls-cert", str(issued.cert_path), "--tls-key", str(issued.key_path)]


def make_pki(directory: Path) -> TestPKI:
    """Create a :class:`TestPKI` under ``directory / "pki"``."""
    return TestPKI(Path(directory) / "pki")
