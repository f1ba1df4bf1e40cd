"""A connection to an etcd v3 cluster over its grpc-gateway JSON API, through ``etcd3gw``.

Why ``etcd3gw`` (OpenStack, Apache-2.0, released through 2026): it speaks etcd's own v3 API
(``/v3/kv/txn``, ``/v3/lease/*``, the grpc-gateway every etcd >= 3.4 serves, with API-path
discovery for 3.3/3.4/3.5), needs only ``requests`` (no generated protobuf code of its own, so it
cannot clash with the ``protobuf>=6``/``grpcio==1.85`` this project pins), and works on Python 3.11
and etcd 3.4.23. The alternatives: ``etcd3`` (python-etcd3) has had no release since 2020 and ships
protobuf code generated for protobuf 3 (it fails to import with protobuf >= 4 unless the slow
pure-Python protobuf is forced); its forks (etcd3-fc, etcd3-fork, etcd3-rs) are one-off releases;
``aetcd`` is asyncio-only (our election runs in a thread beside the event loop) and also brings its
own generated protobuf code. etcd3gw talks to one member; :class:`EtcdConn` adds the fail-over
across the members of a cluster.

Every request has a deadline (``timeout_s``); a member that does not answer, or answers with an
error, is skipped and the next one tried; when none answers the call raises :class:`EtcdError`.
Reads are linearizable (etcd's default): without a quorum they fail instead of returning old data.
"""

from __future__ import annotations

import base64
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from capctl.errors import CapctlError, UserInputError

log = logging.getLogger("capctl.coordinator.etcd")

DEFAULT_TIMEOUT_S = 0.5
"""Deadline of one HTTP request to one etcd member, seconds."""


class EtcdError(CapctlError):
    """No etcd member answered the request (message names each member and its cause)."""


def parse_endpoints(text: str, flag: str = "--etcd-endpoints") -> list[tuple[str, str, int]]:
    """``"http://127.0.0.1:2379,http://127.0.0.2:2379"`` -> ``[(scheme, host, port), ...]``.

    Raises:
        UserInputError: an empty list, or an endpoint that is not ``http(s)://HOST:PORT`` (named).
    """
    out = []
    for raw in [p.strip() for p in text.split(",") if p.strip()]:
        if "://" not in raw:  # as the policy's coordinator.etcd.endpoints: clear text is never implied
            raise UserInputError(f"{flag}: endpoint {raw!r} has no scheme; write http://{raw} (clear text) or "
                                 f"https://{raw} (TLS), as in the policy's coordinator.etcd.endpoints")
        try:  # (an unclosed IPv6 bracket raised ValueError from urlsplit: a traceback; a review)
            url = urlsplit(raw)
            port = url.port
            host = url.hostname
        except ValueError:
            url, port, host = None, None, None
        shown = f"[{host}]:{port}" if host and ":" in host else f"{host}:{port}"
        extra = url is not None and (url.path.strip("/") or url.query or url.fragment
                                     or url.netloc.lower() != shown.lower())
        if url is None or url.scheme not in ("http", "https") or not host or port is None or not 0 < port < 65536 \
                or extra:  # (a path, a query, user:pw@ or text after the port were dropped silently)
            raise UserInputError(f"{flag}: endpoint {raw!r}: expected http://HOST:PORT or https://HOST:PORT "
                                 "(port 1..65535), e.g. http://127.0.0.1:2379")
        out.append((url.scheme, host, port))
    if not out:
        raise UserInputError(f"{flag} {text!r}: no endpoint given; expected a comma-separated list of http://HOST:PORT")
    return out


def b64(text: str | bytes) -> str:
    """etcd's JSON API carries keys and values base64-encoded."""
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text or "")


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd's ``https://`` members: ``ca_file`` verifies their server certificates (None: the
    system's trust store), ``cert_file``/``key_file`` the client certificate etcd asks for with
    ``--client-cert-auth`` (both or neither). Paths, PEM."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


def check_tls(endpoints: list[tuple[str, str, int]], tls: EtcdTls, *, insecure: bool, log_=None) -> None:
    """Refuse a TLS setting that cannot work and clear text to etcd on the network.

    Raises:
        UserInputError: ``--etcd-cert`` without ``--etcd-key`` (or the reverse), a file that cannot
            be read or is no regular file, a key readable by every user, TLS files with only
            ``http://`` members, or an ``http://`` member that is not loopback without ``insecure``
            (each names the flag, the value and the ways out).
    """
    from capctl.security.plaintext import is_local
    from capctl.security.tls import read_pem

    if (tls.cert_file is None) != (tls.key_file is None):
        raise UserInputError("--etcd-cert and --etcd-key go together: give both (etcd's --client-cert-auth) or neither")
    for flag, path in (("--etcd-ca", tls.ca_file), ("--etcd-cert", tls.cert_file), ("--etcd-key", tls.key_file)):
        if path is not None:  # as the gRPC TLS files: a regular file (never a FIFO that blocks the
            read_pem(flag, Path(path), secret=flag == "--etcd-key")  # start), a key not world-readable
    _check_pem(tls)
    schemes = {s for s, _, _ in endpoints}
    if schemes == {"http"} and any((tls.ca_file, tls.cert_file)):
        raise UserInputError("--etcd-ca/--etcd-cert given but every etcd endpoint is http://: "
                             "write the members as https://HOST:PORT")
    plain = [_url(s, h, p) for s, h, p in endpoints if s == "http" and not is_local(f"{h}:{p}")]
    if plain and not insecure:
        raise UserInputError(f"--etcd-endpoints {','.join(plain)}: clear text to etcd over the network (anyone on "
                             "the path can read the admin state and forge a leader); use https:// members with "
                             "--etcd-ca/--etcd-cert/--etcd-key (docs/ha.md), loopback, or pass --insecure")
    if plain:
        (log_ or log).warning("INSECURE: etcd %s in clear text (--insecure); use https:// and --etcd-* (docs/ha.md)",
                              ",".join(plain))


def _session(tls: EtcdTls):
    """A ``requests`` session for one member that ignores the environment: ``REQUESTS_CA_BUNDLE``
    would replace ``--etcd-ca`` (requests' environment beats a session's ``verify``), and
    ``HTTP(S)_PROXY`` would send the coordinator's etcd traffic through a proxy."""
    import requests

    session = requests.Session()
    session.trust_env = False
    session.verify = tls.ca_file or True
    if tls.cert_file and tls.key_file:
        session.cert = (tls.cert_file, tls.key_file)
    return session


def _check_pem(tls: EtcdTls) -> None:
    """Load the TLS files once at start, so that a junk CA or a key that does not match its
    certificate is one clear error, not a failed election every second.

    Raises:
        UserInputError: not PEM, or the key does not belong to the certificate (names the flags).
    """
    import ssl

    try:
        ctx = ssl.create_default_context(cafile=tls.ca_file) if tls.ca_file else ssl.create_default_context()
    except (ssl.SSLError, ValueError) as exc:
        raise UserInputError(f"--etcd-ca {tls.ca_file}: not PEM CA certificates ({exc})") from None
    if tls.cert_file and tls.key_file:
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        except (ssl.SSLError, ValueError) as exc:
            raise UserInputError(f"--etcd-cert {tls.cert_file} --etcd-key {tls.key_file}: not a PEM certificate and "
                                 f"its key ({exc})") from None


def why(exc: BaseException, limit: int = 200) -> str:
    """The cause of an etcd request's failure in a few words (at most ``limit`` characters).
    etcd3gw raises its own exceptions with the cause in ``detail_text`` (``str()`` of them is empty:
    "ConnectionFailedError: " told a refused connection and a TLS handshake to a plain port apart
    by nothing); the requests exception they wrap is the fallback."""
    import re

    detail = " ".join(str(getattr(exc, "detail_text", "") or "").split())
    text = str(exc)
    if detail and detail not in text:  # an HTTP error reply: str() is its reason, the body says why
        text = f"{text}: {detail}" if text else detail
    if not text:
        inner = exc.__cause__ or exc.__context__
        text = f"{type(inner).__name__}: {inner}" if inner is not None else "no detail given"
    text = " ".join(text.split())
    # urllib3 buries the cause at the end of a long "HTTPConnectionPool(...): Max retries exceeded"
    for pattern in (r"\[Errno -?\d+\] [^'\")(]+", r"\[SSL[^\]]*\][^'\")(]*", r"[Rr]ead timed out[^'\")(]*",
                    r"timed out", r"RemoteDisconnected\([^)]*\)"):
        m = re.search(pattern, text)
        if m:
            return m.group(0).strip()[:limit]
    return text[:limit]


def _url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port`` with an IPv6 host in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class EtcdConn:
    """Requests to one etcd cluster, tried member after member (thread-safe).

    Args:
        endpoints: from :func:`parse_endpoints`.
        timeout_s: deadline of one request to one member, seconds.
        tls: certificates for the ``https://`` members (None: the system's trust store, no client
            certificate).
    """

    def __init__(self, endpoints: list[tuple[str, str, int]], timeout_s: float = DEFAULT_TIMEOUT_S,
                 tls: EtcdTls | None = None) -> None:
        import etcd3gw

        self.endpoints = [_url(s, h, p) for s, h, p in endpoints]
        self._clients = [etcd3gw.client(host=h, port=p, protocol=s, timeout=timeout_s, api_path="/v3/",
                                        session=_session(tls or EtcdTls()))
                         for s, h, p in endpoints]
        self._first = 0
        self._lock = threading.Lock()

    def post(self, path: str, payload: dict, need: tuple = ()) -> dict:
        """POST ``payload`` to ``/v3/<path>`` of the first member that answers; its JSON reply.
        A reply that is no JSON object, or lacks a key of ``need``, counts as that member failing
        (the next one is asked): a member answering ``{}`` or ``[]`` raised KeyError or
        AttributeError in the election thread, which then never campaigned again (a review).

        Raises:
            EtcdError: every member failed (timeout, refused, error status, no etcd reply).
        """
        from etcd3gw import exceptions as ex

        with self._lock:
            first = self._first
        failed = []
        n = len(self._clients)
        for k in range(n):
            i = (first + k) % n
            client = self._clients[i]
            try:
                reply = client.post(client.get_url(path), json=payload)
            except (ex.Etcd3Exception, OSError, ValueError) as exc:
                failed.append(f"{self.endpoints[i]}: {type(exc).__name__}: {why(exc)}")
                continue
            if not isinstance(reply, dict) or any(k not in reply for k in need):
                failed.append(f"{self.endpoints[i]}: no etcd reply ({str(reply)[:60]!r}: a JSON object with "
                              f"{', '.join(need) or 'fields'} expected)")
                continue
            with self._lock:
                self._first = i
            return reply
        raise EtcdError(f"etcd: no member answered /v3/{path} ({'; '.join(failed)})")

    # -- the few calls the coordinator makes --------------------------------------------------
    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease of ``ttl_s`` seconds; returns (lease id, granted TTL in s)."""
        r = self.post("lease/grant", {"TTL": int(ttl_s), "ID": 0}, need=("ID",))
        try:
            return int(r["ID"]), int(r.get("TTL", ttl_s))
        except (TypeError, ValueError):
            raise EtcdError(f"etcd: lease/grant answered ID {str(r.get('ID'))[:40]!r}, TTL "
                            f"{str(r.get('TTL'))[:40]!r}: not numbers") from None

    def keepalive(self, lease_id: int) -> int:
        """Refresh the lease; returns its TTL in s, or -1 when etcd says it has expired."""
        r = self.post("lease/keepalive", {"ID": lease_id})
        try:
            return int((r.get("result") or {}).get("TTL", -1))
        except (AttributeError, TypeError, ValueError):
            raise EtcdError(f"etcd: lease/keepalive answered {str(r)[:60]!r}: no TTL") from None

    def revoke(self, lease_id: int) -> None:
        """Revoke the lease (its keys are deleted at once)."""
        self.post("kv/lease/revoke", {"ID": lease_id})

    def txn(self, compare: list, success: list, failure: list | None = None) -> dict:
        """One transaction (etcd ``Txn``); the reply with ``succeeded`` and ``responses``."""
        return self.post("kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def get(self, key: str) -> dict | None:
        """The key-value record of ``key`` (``value`` decoded to bytes, revisions as ints), or None."""
        r = self.post("kv/range", {"key": b64(key)})
        kvs = r.get("kvs") or []
        return decode_kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[dict]:
        """Every record whose key starts with ``prefix`` (see :meth:`get`)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        r = self.post("kv/range", {"key": b64(prefix), "range_end": b64(end)})
        return [decode_kv(kv) for kv in r.get("kvs") or []]

    def put(self, key: str, value: bytes | str, lease_id: int = 0) -> None:
        """Write ``key`` (attached to ``lease_id`` when not 0)."""
        payload = {"key": b64(key), "value": b64(value)}
        if lease_id:
            payload["lease"] = lease_id
        self.post("kv/put", payload)


def decode_kv(kv: dict) -> dict:
    """One ``mvccpb.KeyValue`` of the JSON API with the key and value decoded, numbers as ints."""
    return {
        "key": unb64(kv.get("key", "")).decode(errors="replace"),
        "value": unb64(kv.get("value", "")),
        "create_revision": int(kv.get("create_revision", 0)),
        "mod_revision": int(kv.get("mod_revision", 0)),
        "lease": int(kv.get("lease", 0)),
    }
