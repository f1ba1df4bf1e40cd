"""The daemon's high-availability options: coordinators sharing an etcd cluster elect one leader
(:mod:`coordinator.election`) and keep their admin state there (:mod:`coordinator.etcdstore`).

Flags (``capctl-coordinator``)::

    --etcd-endpoints http://127.0.0.1:2379,...   etcd members (HA on; without it: one coordinator, SQLite)
    --etcd-prefix /capctl                        key prefix of this site's coordinators
    --etcd-lease-ttl-s 2                         lease TTL, whole seconds (failover takes about this long)
    --etcd-ca FILE --etcd-cert FILE --etcd-key FILE
                                                 TLS to https:// members (CA; client certificate for
                                                 etcd's --client-cert-auth). An http:// member that is
                                                 not loopback is refused unless --insecure.
    --advertise ADDR                             the address agents and the CLI reach this coordinator at
                                                 (default: the bound --listen address)
"""

from __future__ import annotations

import logging

from capctl.errors import UserInputError

log = logging.getLogger("capctl.coordinator.ha")


def add_ha_arguments(p) -> None:
    """The HA flags of ``capctl-coordinator`` (see module docstring)."""
    from coordinator.election import DEFAULT_TTL_S

    g = p.add_argument_group("high availability (etcd)")
    g.add_argument("--etcd-endpoints", metavar="URLS",
                   help="comma-separated etcd members (http://HOST:PORT); coordinators sharing them elect one leader")
    g.add_argument("--etcd-prefix", metavar="PREFIX", help="etcd key prefix (default: the policy's, else /capctl)")
    g.add_argument("--etcd-lease-ttl-s", type=int, metavar="S",
                   help=f"etcd lease TTL of the leader, whole seconds >= 1 (default: the policy's, else {DEFAULT_TTL_S})")
    g.add_argument("--etcd-ca", metavar="FILE", help="CA certificate(s) verifying the https:// etcd members "
                   "(default: the system's trust store)")
    g.add_argument("--etcd-cert", metavar="FILE", help="client certificate for etcd's --client-cert-auth (with --etcd-key)")
    g.add_argument("--etcd-key", metavar="FILE", help="key of --etcd-cert")
    g.add_argument("--advertise", metavar="ADDR",
                   help="address agents and the CLI use for this coordinator (default: the bound --listen address)")


def _tls_of(args):
    """The ``--etcd-ca/--etcd-cert/--etcd-key`` files of ``args`` (absent flags: None)."""
    from coordinator.etcdconn import EtcdTls

    return EtcdTls(getattr(args, "etcd_ca", None), getattr(args, "etcd_cert", None), getattr(args, "etcd_key", None))


class _Quiet:
    """A logger that drops its lines (the flag check before the policy: :class:`HaSetup` logs them)."""

    def warning(self, *args, **kwargs) -> None:
        pass


def check_flags(args) -> None:
    """Check the ``--etcd-*`` flags given, those that need no policy, before the policy is read: a
    bad flag is reported even when the policy file is missing or invalid (flags first).

    Raises:
        UserInputError: a TTL out of 1..3600, a prefix not starting with '/', a malformed
            endpoint, or a TLS setting :func:`coordinator.etcdconn.check_tls` refuses.
    """
    from coordinator.etcdconn import check_tls, parse_endpoints

    ttl = getattr(args, "etcd_lease_ttl_s", None)
    if ttl is not None and not 1 <= ttl <= 3600:
        raise UserInputError(f"--etcd-lease-ttl-s {ttl}: expected 1..3600 whole seconds")
    prefix = getattr(args, "etcd_prefix", None)
    if prefix is not None and not prefix.startswith("/"):
        raise UserInputError(f"--etcd-prefix {prefix!r}: expected a key prefix starting with '/'")
    if getattr(args, "etcd_endpoints", None):
        check_tls(parse_endpoints(args.etcd_endpoints), _tls_of(args), insecure=bool(getattr(args, "insecure", False)),
                  log_=_Quiet())


def _check_advertise(args) -> None:
    """In high availability the address a coordinator advertises is where the others send agents
    and the CLI: a wildcard ``--listen`` (0.0.0.0, ::) without ``--advertise`` is refused (the
    standbys named the leader "0.0.0.0:7373"; found by a review).

    Raises:
        UserInputError: the listen address is a wildcard and ``--advertise`` is not given.
    """
    if getattr(args, "advertise", None):
        return
    listen = str(getattr(args, "listen", "") or "")
    host = listen.rpartition(":")[0].strip("[]") if not listen.startswith("unix:") else "unix"
    if host in ("", "0.0.0.0", "::", "*"):
        raise UserInputError(f"--listen {listen}: a wildcard address cannot be advertised to agents and the CLI in "
                             f"high availability; give --advertise HOST:PORT (this coordinator's reachable address)")


class HaSetup:
    """The etcd connection, store and election of one coordinator daemon."""

    def __init__(self, args, etcd_policy=None) -> None:
        from coordinator.election import DEFAULT_TTL_S
        from coordinator.etcdconn import EtcdConn, check_tls, parse_endpoints

        if args.etcd_prefix is None:
            args.etcd_prefix = etcd_policy.prefix if etcd_policy is not None else "/capctl"
        if args.etcd_lease_ttl_s is None:
            args.etcd_lease_ttl_s = etcd_policy.lease_ttl_s if etcd_policy is not None else DEFAULT_TTL_S
        if not args.etcd_endpoints:
            args.etcd_endpoints = ",".join(etcd_policy.endpoints)
        if args.etcd_lease_ttl_s < 1 or args.etcd_lease_ttl_s > 3600:
            raise UserInputError(f"--etcd-lease-ttl-s {args.etcd_lease_ttl_s}: expected 1..3600 whole seconds")
        if not args.etcd_prefix.startswith("/"):
            raise UserInputError(f"--etcd-prefix {args.etcd_prefix!r}: expected a key prefix starting with '/'")
        self.args = args
        endpoints = parse_endpoints(args.etcd_endpoints)
        tls = _tls_of(args)
        check_tls(endpoints, tls, insecure=bool(getattr(args, "insecure", False)), log_=log)
        self.conn = EtcdConn(endpoints, tls=tls)
        self.leadership = None

    @classmethod
    def from_args(cls, args, policy) -> HaSetup | None:
        """None without ``--etcd-endpoints`` and without the policy's ``coordinator.etcd``.

        Raises:
            UserInputError: a malformed endpoint, prefix or TTL.
        """
        etcd_policy = policy.coordinator.etcd
        if args.etcd_endpoints is not None and not args.etcd_endpoints.strip():
            # (an unset variable in a unit file: high availability silently off, a second leader of
            # term 0 beside the others; found by a review)
            raise UserInputError("--etcd-endpoints '': empty; give the etcd members (http(s)://HOST:PORT,...) or "
                                 "leave the flag out for a single coordinator")
        if args.etcd_endpoints or etcd_policy is not None:
            _check_advertise(args)
            return cls(args, etcd_policy)
        tls = _tls_of(args)
        given = [f for f, v in (("--etcd-ca", tls.ca_file), ("--etcd-cert", tls.cert_file), ("--etcd-key", tls.key_file)) if v]
        if given:
            raise UserInputError(f"{'/'.join(given)} given without --etcd-endpoints (or the policy's coordinator.etcd): "
                                 "high availability is off, so they would be ignored")
        return None

    def store(self):
        """(the etcd store, "") — fenced by the election made in :meth:`start`."""
        from coordinator.etcdstore import EtcdStore

        self._store = EtcdStore(self.conn, self.args.etcd_prefix)
        return self._store, ""

    def finished(self, retention):
        """The finished-job store in etcd (:class:`coordinator.etcdfinished.EtcdFinishedJobs`), fenced
        by the election made in :meth:`attach`."""
        from coordinator.etcdfinished import EtcdFinishedJobs

        self._finished = EtcdFinishedJobs(self.conn, self.args.etcd_prefix, retention)
        return self._finished

    def attach(self, coord) -> None:
        """Make ``coord`` a standby before anything is served (it leads only once elected)."""
        from coordinator.election import Leadership

        self.leadership = Leadership(self.conn, self.args.etcd_prefix, coord.coordinator_id, "",
                                     ttl_s=self.args.etcd_lease_ttl_s)
        self._store.leadership = self.leadership
        if getattr(self, "_finished", None) is not None:
            self._finished.leadership = self.leadership
        coord.ha = self.leadership
        from coordinator import ha

        ha.attach(coord)

    def start(self, coord, listen_addr: str, loop) -> None:
        """Start campaigning for ``coord``, advertised at ``--advertise`` or ``listen_addr``."""
        from coordinator import ha

        address = self.args.advertise or listen_addr
        self.leadership.address = address
        self.leadership.on_change = ha.on_change_threadsafe(coord, loop)
        self.leadership.start()
        log.info("high availability: etcd %s, prefix %s, lease TTL %d s, advertised as %s",
                 ",".join(self.conn.endpoints), self.args.etcd_prefix, self.args.etcd_lease_ttl_s, address)

    def stop(self) -> None:
        if self.leadership is not None:
            self.leadership.stop()
