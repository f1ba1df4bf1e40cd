"""``AdminClient``: a small synchronous client of the coordinator's Admin service.

Used by the ``capctl`` CLI, the demo and the tests::

    from capctl.coordinator.client import AdminClient
    with AdminClient("unix:/run/capctl/coordinator.sock") as c:
        st = c.status()                  # capctl.v1.StatusReply
        c.set_budget(16000.0)            # SetBudgetReply (ok, budget_w, deficit_w, message)
        c.reload_policy()                # ReloadPolicyReply (ok, errors, message)
        c.explain("1234")                # ExplainReply
        c.health()                       # "SERVING"
        status_to_dict(st)               # the stable JSON schema of `capctl status --json`

Addresses are gRPC targets (``unix:/path`` or ``host:port``); None means ``$CAPCTL_COORDINATOR`` or
the default admin socket (:func:`capctl.cli.rpc.coordinator_address`). Every call has a deadline
(``timeout_s``). gRPC failures raise :class:`capctl.errors.CapctlError` subclasses
(unreachable: exit code 3, permission denied: 4, not found: 6; see :func:`capctl.cli.rpc.map_rpc_error`).
"""

from __future__ import annotations

import time

import grpc

from capctl.cli.rpc import DEFAULT_TIMEOUT_S, coordinator_address, map_rpc_error
from capctl.errors import UnreachableError

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 1024 * 1024),
]


class AdminClient:
    """Synchronous Admin client (see module docstring). Close it, or use it as a context manager.

    Args:
        address: gRPC target; None = ``$CAPCTL_COORDINATOR`` or the default admin socket.
        timeout_s: deadline of every call, seconds.
        token: admin bearer token (sent as ``authorization: Bearer ...``) for admin RPCs over TCP.
        credentials: channel credentials for TLS (None = plaintext; the unix socket needs none).
    """

    def __init__(self, address: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        from capctl.v1 import capctl_pb2, capctl_pb2_grpc

        self.address = coordinator_address(address)
        self.timeout_s = float(timeout_s)
        self._pb = capctl_pb2
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if credentials is not None:
            self._channel = grpc.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = capctl_pb2_grpc.AdminStub(self._channel)

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel (idempotent)."""
        self._channel.close()

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise map_rpc_error(err, self.address) from None

    def status(self):
        """``StatusReply``: budget, allocated/enforced/drawn watts, nodes, jobs, domains, alerts."""
        return self._call("Status", self._pb.StatusRequest())

    def nodes(self):
        """``StatusReply`` (same content as :meth:`status`; the CLI shows the nodes)."""
        return self._call("Nodes", self._pb.StatusRequest())

    def jobs(self):
        """``StatusReply`` (same content as :meth:`status`; the CLI shows the jobs)."""
        return self._call("Jobs", self._pb.StatusRequest())

    def explain(self, job_id: str):
        """``ExplainReply`` for ``job_id``. Raises NotFoundError for an unknown job."""
        return self._call("Explain", self._pb.ExplainRequest(job_id=job_id))

    def set_budget(self, budget_w: float):
        """``SetBudgetReply``; ``ok`` False (with ``deficit_w``) when below the minimum caps.

        Admin only: PermissionDeniedError without an admin identity."""
        return self._call("SetBudget", self._pb.SetBudgetRequest(budget_w=float(budget_w)))

    def reload_policy(self, path: str = ""):
        """``ReloadPolicyReply``; ``ok`` False with ``file:line:col`` errors for a broken policy
        (the old one stays). ``path`` "" reloads the coordinator's own file. Admin only."""
        return self._call("ReloadPolicy", self._pb.ReloadPolicyRequest(path=path))

    def health(self, service: str = "") -> str:
        """gRPC health status name of ``service`` ("" = the server), e.g. ``"SERVING"``."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise map_rpc_error(err, self.address) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the coordinator answers health checks with SERVING (bounded).

        Raises UnreachableError after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                if self.health() == "SERVING":
                    return
            except Exception as exc:  # noqa: BLE001 (retry until the deadline)
                last = str(exc)
            time.sleep(0.05)
        raise UnreachableError(f"coordinator at {self.address} not ready within {timeout_s:g} s {last}".strip())


def status_to_dict(st) -> dict:
    """A ``StatusReply`` as the stable JSON of ``capctl status --json`` (docs/status-schema.json);
    the CLI owns the schema, this delegates to :func:`capctl.cli.status.status_dict`."""
    from capctl.cli.status import status_dict

    return status_dict(st)
