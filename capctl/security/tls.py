"""mTLS material for capctl's gRPC links (agent <-> coordinator, CLI -> coordinator).

Every capctl TLS endpoint uses three PEM files issued from the cluster CA (docs/security.md):

* ``--tls-ca FILE``   the cluster CA certificate(s): the only roots trusted for peers;
* ``--tls-cert FILE`` this process's certificate (chain), issued by that CA;
* ``--tls-key FILE``  its private key (not readable by other users: mode 0600 or 0640).

Servers built with :func:`server_credentials` *require* a client certificate signed by the CA
(``require_client_auth=True``): a client without one, with one from another CA, or with an expired
one fails the TLS handshake and never reaches a servicer. Clients built with
:func:`channel_credentials` verify the server's certificate against the same CA and present their own.

The flags come in a set: all three or none (:func:`tls_from_args`). ``--tls-server-name NAME``
overrides the name checked against the server certificate's SANs (when connecting by an address
the certificate does not name). The CLI also reads ``$CAPCTL_TLS_CA``, ``$CAPCTL_TLS_CERT``,
``$CAPCTL_TLS_KEY`` and ``$CAPCTL_TLS_SERVER_NAME`` (:data:`ENV_VARS`).

Source of the gRPC API: https://grpc.github.io/grpc/python/grpc.html (ssl_server_credentials,
ssl_channel_credentials, option ``grpc.ssl_target_name_override``).
"""

from __future__ import annotations

import argparse
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from capctl.errors import UserInputError
from capctl.security.files import read_regular_file

MAX_PEM_BYTES = 1 << 20
"""Largest PEM file read (1 MiB): a CA bundle of a few hundred certificates fits easily."""

ENV_VARS = {"ca": "CAPCTL_TLS_CA", "cert": "CAPCTL_TLS_CERT", "key": "CAPCTL_TLS_KEY",
            "server_name": "CAPCTL_TLS_SERVER_NAME"}
"""Environment variables the CLI reads when the ``--tls-*`` flags are not given."""

_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_KEY_MARKS = (b"-----BEGIN PRIVATE KEY-----", b"-----BEGIN EC PRIVATE KEY-----", b"-----BEGIN RSA PRIVATE KEY-----")


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes read from a :class:`TlsConfig` (the key is never put into ``repr``)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:
        return f"TlsMaterial(ca={len(self.ca_pem)} B, cert={len(self.cert_pem)} B, key=<hidden>)"


@dataclass(frozen=True)
class TlsConfig:
    """Paths of the CA, certificate and key (and an optional server name override)."""

    ca_path: Path
    cert_path: Path
    key_path: Path
    server_name: str | None = None

    def read(self) -> TlsMaterial:
        """Read and sanity-check the three PEM files.

        Raises:
            UserInputError: a file is missing/unreadable/too large, is not PEM of the right kind,
                or the key is readable by every user (names the flag, the path and the fix).
        """
        ca = read_pem("--tls-ca", self.ca_path)
        cert = read_pem("--tls-cert", self.cert_path)
        key = read_pem("--tls-key", self.key_path, secret=True)
        if _CERT_MARK not in ca:
            raise UserInputError(f"--tls-ca {self.ca_path}: no PEM certificate in it (expected {_CERT_MARK.decode()})")
        if _CERT_MARK not in cert:
            raise UserInputError(f"--tls-cert {self.cert_path}: no PEM certificate in it "
                                 f"(expected {_CERT_MARK.decode()})")
        if not any(m in key for m in _KEY_MARKS):
            raise UserInputError(f"--tls-key {self.key_path}: no unencrypted PEM private key in it "
                                 "(expected -----BEGIN PRIVATE KEY-----; encrypted keys are not supported)")
        _check_pem(self, ca, cert, key)
        return TlsMaterial(ca, cert, key)


def _check_pem(config: TlsConfig, ca: bytes, cert: bytes, key: bytes) -> None:
    """Parse the three PEM files (``cryptography``) and check that the key belongs to the
    certificate; a file with the right markers around a body that is no certificate or key reached
    gRPC, which printed C-core log lines and reported the coordinator "unreachable" (exit 3; found
    by a review).

    Raises:
        UserInputError: naming the flag, the file and what is wrong.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        x509.load_pem_x509_certificates(ca)
    except ValueError as err:
        raise UserInputError(f"--tls-ca {config.ca_path}: not a valid PEM certificate ({err})") from None
    try:
        certificate = x509.load_pem_x509_certificate(cert)
    except ValueError as err:
        raise UserInputError(f"--tls-cert {config.cert_path}: not a valid PEM certificate ({err})") from None
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as err:
        raise UserInputError(f"--tls-key {config.key_path}: not a valid unencrypted PEM private key ({err})") from None
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(serialization.Encoding.DER, raw) != \
            certificate.public_key().public_bytes(serialization.Encoding.DER, raw):
        raise UserInputError(f"--tls-key {config.key_path}: not the private key of --tls-cert {config.cert_path}")


def read_pem(flag: str, path: Path, secret: bool = False) -> bytes:
    """The PEM file ``path`` of option ``flag``, read once from one open descriptor: a regular file
    of at most :data:`MAX_PEM_BYTES`, not empty; a ``secret`` one (a private key) not readable by
    every user.

    Raises:
        UserInputError: naming ``flag``, ``path`` and what is wrong (and the chmod that fixes a mode).
    """
    def check(st: os.stat_result) -> None:
        if secret and st.st_mode & stat.S_IROTH:
            raise UserInputError(f"{flag} {path}: private key readable by every user (mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}")
        if st.st_size > MAX_PEM_BYTES:
            raise UserInputError(f"{flag} {path}: {st.st_size} bytes, at most {MAX_PEM_BYTES} allowed")

    data = read_regular_file(flag, path, MAX_PEM_BYTES, check)
    if not data.strip():
        raise UserInputError(f"{flag} {path}: empty file")
    return data


def add_tls_arguments(parser: argparse.ArgumentParser, *, what: str, server: bool = False) -> None:
    """Add ``--tls-ca``, ``--tls-cert``, ``--tls-key`` (and ``--tls-server-name`` for clients).

    Args:
        what: the link they protect, for the help text (e.g. "the coordinator's --listen address").
        server: True for a server (no server-name override).
    """
    g = parser.add_argument_group("TLS (mTLS with certificates from the cluster CA; docs/security.md)")
    g.add_argument("--tls-ca", metavar="FILE", help=f"cluster CA certificate(s), PEM: enables mTLS on {what}")
    g.add_argument("--tls-cert", metavar="FILE", help="this process's certificate (PEM), issued by the cluster CA")
    g.add_argument("--tls-key", metavar="FILE", help="its private key (PEM, mode 0600)")
    if not server:
        g.add_argument("--tls-server-name", metavar="NAME",
                       help="name to check in the server certificate instead of the address's host")


def tls_from_args(args: argparse.Namespace, *, use_env: bool = False) -> TlsConfig | None:
    """The :class:`TlsConfig` named by the ``--tls-*`` flags (or, with ``use_env``, the environment).

    Returns None when none of them is given (insecure transport: unix sockets, loopback tests).

    Raises:
        UserInputError: only some of ``--tls-ca``, ``--tls-cert``, ``--tls-key`` are given.
    """
    def pick(name: str) -> str | None:
        value = getattr(args, f"tls_{name}", None)
        if not value and use_env:
            value = os.environ.get(ENV_VARS[name]) or None
        return value

    ca, cert, key = pick("ca"), pick("cert"), pick("key")
    given = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        env = f" (or ${', $'.join(ENV_VARS[m[6:]] for m in missing)})" if use_env else ""
        raise UserInputError(f"TLS needs --tls-ca, --tls-cert and --tls-key together; missing {', '.join(missing)}{env}")
    return TlsConfig(Path(ca), Path(cert), Path(key), pick("server_name") or None)


def server_credentials(config: TlsConfig) -> grpc.ServerCredentials:
    """gRPC server credentials requiring a client certificate issued by ``config``'s CA.

    Raises:
        UserInputError: see :meth:`TlsConfig.read`.
    """
    m = config.read()
    return grpc.ssl_server_credentials([(m.key_pem, m.cert_pem)], root_certificates=m.ca_pem,
                                       require_client_auth=True)


def channel_credentials(config: TlsConfig) -> grpc.ChannelCredentials:
    """gRPC channel credentials: trust only ``config``'s CA, present ``config``'s certificate.

    Raises:
        UserInputError: see :meth:`TlsConfig.read`.
    """
    m = config.read()
    return grpc.ssl_channel_credentials(root_certificates=m.ca_pem, private_key=m.key_pem, certificate_chain=m.cert_pem)


def channel_options(config: TlsConfig | None) -> list[tuple[str, object]]:
    """Channel options for ``config`` (the server-name override when one is set)."""
    if config is not None and config.server_name:
        return [("grpc.ssl_target_name_override", config.server_name)]
    return []


def is_unix_target(target: str) -> bool:
    """True for ``unix:PATH`` / ``unix://PATH`` / ``unix-abstract:`` gRPC targets."""
    return target.startswith("unix:") or target.startswith("unix-abstract:")
