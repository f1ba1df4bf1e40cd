"""Security of capctl's daemons and CLI (issue 7; docs/security.md).

Modules:

* :mod:`capctl.security.tls` — mTLS material from a cluster CA: ``--tls-ca/--tls-cert/--tls-key``
  flags, gRPC server credentials that *require* a client certificate, channel credentials.
* :mod:`capctl.security.identity` — the caller's identity from gRPC's ``auth_context()``: common
  name, DNS SANs, and capctl roles carried as SAN URIs ``capctl-role:<role>``.
* :mod:`capctl.security.authz` — who may run admin operations (budget set, policy reload): a
  certificate with role ``admin``, the root-only admin unix socket, or the bearer token from a
  root-only token file (compared in constant time, never logged).
* :mod:`capctl.security.limits` — input bounds (message sizes, GPUs per node, jobs, string
  lengths) as constants and validators returning a one-line problem or ``""``.
* :mod:`capctl.security.redact` — a logging filter that masks bearer tokens and private keys.

Nothing here imports the coordinator, the node agent or the Slurm hooks: all three may use it.
"""
