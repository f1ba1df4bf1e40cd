"""The coordinator's client API: ``AdminClient``, the one synchronous client of its Admin service,
with address resolution and gRPC errors mapped to :mod:`capctl.errors`.

Used by the ``capctl`` CLI (through :func:`capctl.cli.rpc.admin_client`, which adds TLS and the
admin token from the command line) and the tests::

    from coordinator.client import AdminClient
    with AdminClient("unix:/run/capctl/coordinator.sock") as c:
        st = c.status()                  # capctl.v1.StatusReply
        c.set_budget(16000.0)            # SetBudgetReply (ok, budget_w, deficit_w, message)
        c.reload_policy()                # ReloadPolicyReply (ok, errors, message)
        c.explain("1234")                # ExplainReply
        c.health()                       # "SERVING"

Addresses are gRPC targets (``unix:/path`` or ``host:port``); None means ``$CAPCTL_COORDINATOR`` or
the default admin socket (:func:`coordinator_address`). Every call has a deadline
(``timeout_s``). gRPC failures raise :class:`capctl.errors.CapctlError` subclasses
(unreachable: exit code 3, permission denied: 4, not found: 6; see :func:`map_rpc_error`).
"""

from __future__ import annotations

import os
import time

import grpc

from capctl.errors import CapctlError, NotFoundError, PermissionDeniedError, UnreachableError, UserInputError

DEFAULT_COORDINATOR = "unix:/run/capctl/coordinator.sock"
"""Default admin address of the coordinator (root-only unix socket on the head node)."""

DEFAULT_TIMEOUT_S = 5.0
"""Deadline of one admin RPC in seconds."""
CHANGES = frozenset({"SetBudget", "ReloadPolicy"})
"""Admin RPCs that change the coordinator's state (a late answer may follow an applied change)."""

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 1024 * 1024),
]


def coordinator_address(flag: str | None = None) -> str:
    """Return the coordinator address: ``flag``, ``$CAPCTL_COORDINATOR`` or the default.

    Raises:
        UserInputError: the address is malformed (port outside 1..65535, ``unix:`` without a path ...),
            naming where it came from.
    """
    from capctl.addresses import check_address

    if flag is not None:
        return check_address(flag, "--coordinator")
    env = os.environ.get("CAPCTL_COORDINATOR")
    if env:
        return check_address(env, "$CAPCTL_COORDINATOR")
    return DEFAULT_COORDINATOR


def map_rpc_error(err: grpc.RpcError, address: str) -> CapctlError:
    """Translate a gRPC error into the matching user-facing :class:`CapctlError`: unreachable (also
    UNIMPLEMENTED: something else answers at ``address``, e.g. an agent's socket) exit 3, permission
    denied 4, not found 6, invalid argument 1."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        if "Failed parsing HTTP/2" in (details or "") or "Expected SETTINGS frame" in (details or ""):
            # an HTTP/1 server answered (a try-out: the coordinator's metrics port given as --coordinator)
            return UnreachableError(f"{address} answers but is no gRPC server (an HTTP/1 endpoint, e.g. the "
                                    "coordinator's metrics port?); give the coordinator's --listen address or "
                                    "its admin socket")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # (it may answer, only later: a large cluster's status)
            return UnreachableError(f"coordinator at {address} did not answer in time (DEADLINE_EXCEEDED): {details}; "
                                    "is capctl-coordinator running there? A large cluster's status may take "
                                    "longer: --timeout SECONDS")
        return UnreachableError(f"coordinator at {address} unreachable ({code.name}): {details}; is capctl-coordinator "
                                f"running there? Another address: --coordinator ADDR or $CAPCTL_COORDINATOR")
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return PermissionDeniedError(f"{details} (coordinator {address})")
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFoundError(details)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE):
        return UserInputError(details)
    if code == grpc.StatusCode.UNIMPLEMENTED:  # a gRPC server without the Admin service
        return UnreachableError(f"{address} answers but serves no capctl coordinator (an agent's socket?)")
    return CapctlError(f"coordinator at {address}: {code.name if code else 'error'}: {details}")


class AdminClient:
    """Synchronous Admin client (see module docstring). Close it, or use it as a context manager.

    Args:
        address: gRPC target; None = ``$CAPCTL_COORDINATOR`` or the default admin socket.
        timeout_s: deadline of every call, seconds.
        token: admin bearer token (sent as ``authorization: Bearer ...``) for admin RPCs over TCP.
        credentials: channel credentials for TLS (None = plaintext; the unix socket needs none).
        channel: a channel already made for ``address`` (the CLI's, with TLS and token
            interceptors); the client closes it.
    """

    def __init__(self, address: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None, channel: grpc.Channel | None = None) -> None:
        from capctl.v1 import capctl_pb2, capctl_pb2_grpc

        self.address = coordinator_address(address)
        self.timeout_s = float(timeout_s)
        self._pb = capctl_pb2
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if channel is not None:
            self._channel = channel
        elif credentials is not None:
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
            if method != "Status" and err.code() == grpc.StatusCode.UNIMPLEMENTED and self._is_coordinator():
                raise CapctlError(f"coordinator at {self.address} does not implement {method} "
                                  "(an older capctl-coordinator?)") from None
            if method in CHANGES and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # the request may have reached it: "did not answer" read as "nothing changed" and a
                # script retried or assumed the old budget (found by a try-out)
                raise UnreachableError(f"coordinator at {self.address} did not answer {method} within "
                                       f"{self.timeout_s:g} s: the change may have been applied (and saved); see "
                                       "capctl status before trying again (--timeout SECONDS for a slow "
                                       "coordinator)") from None
            raise map_rpc_error(err, self.address) from None

    def _is_coordinator(self) -> bool:
        """Whether ``Admin.Status`` answers (an Admin service is there, maybe of an older version)."""
        try:
            self._stub.Status(self._pb.StatusRequest(), timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError:
            return False
        return True

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

    def finished_jobs(self, since_s: float = 0.0, job_id: str = "", limit: int = 0) -> list:
        """Finished jobs the coordinator keeps (``FinishedJob`` messages, newest first): those that
        ended at or after ``since_s`` (Unix s), only ``job_id`` when given, at most ``limit`` (0:
        the server's maximum)."""
        req = self._pb.FinishedJobsRequest(since_s=float(since_s), job_id=job_id, limit=int(limit))
        return list(self._call("FinishedJobs", req).jobs)

    def finished_job(self, job_id: str):
        """``(record, running)`` for one job: its ``FinishedJob`` or None, and whether the coordinator
        has it bound and not ended (a record is still to come). A coordinator older than 0.2.1 never
        says running."""
        reply = self._call("FinishedJobs", self._pb.FinishedJobsRequest(job_id=job_id))
        return (reply.jobs[0] if reply.jobs else None), bool(reply.job_running)

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

