"""Client of a node agent's AgentLocal service (Slurm hooks, demo, tests).

Shared by :mod:`slurm` and :mod:`nodeagent` (which serves the other end) so that neither
imports the other. Wire format: plain gRPC (``capctl.v1.AgentLocal``) over the agent's unix socket; see
:mod:`nodeagent.local` for the server and its SO_PEERCRED check.
"""

from __future__ import annotations

import grpc

from capctl.errors import PermissionDeniedError, UnreachableError, UserInputError

DEFAULT_CALL_TIMEOUT_S = 5.0
"""Default deadline of one AgentLocal call in seconds (the Slurm hooks pass their own remaining time)."""


class LocalClient:
    """Client of a node agent's AgentLocal service (what the Slurm hooks and the demo use).

    Args:
        socket_path: the agent's socket path (``unix:`` prefix optional).
        timeout_s: deadline of each call in seconds.

    Methods raise :class:`UnreachableError` (agent not running / deadline), :class:`PermissionDeniedError`
    (SO_PEERCRED refusal) or :class:`UserInputError` (bad request, e.g. unknown GPU ids).
    """

    def __init__(self, socket_path: str, timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        path = socket_path[5:] if socket_path.startswith("unix:") else socket_path
        self.socket_path = path
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(f"unix:{path}")
        from capctl.v1 import capctl_pb2_grpc

        self._stub = capctl_pb2_grpc.AgentLocalStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            code = err.code()
            if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                raise PermissionDeniedError(f"agent at unix:{self.socket_path}: {err.details()}") from None
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.FAILED_PRECONDITION):
                raise UserInputError(f"agent at unix:{self.socket_path}: {err.details()}") from None
            raise UnreachableError(
                f"agent at unix:{self.socket_path} unreachable ({code.name}): {err.details()}"
            ) from None

    def job_start(self, job_id: str, gpu_ids: list[str], gpu_id_kind: int = 0, *, user: str = "",
                  partition: str = "", account: str = "", qos: str = ""):
        """Send JobStart; returns ``JobStartReply``. ``gpu_id_kind``: ``capctl_pb2.GPU_ID_*``."""
        from capctl.v1 import capctl_pb2

        req = capctl_pb2.JobStartRequest(job_id=job_id, gpu_ids=[str(g) for g in gpu_ids],
                                         gpu_id_kind=gpu_id_kind, user=user, partition=partition,
                                         account=account, qos=qos)
        return self._call("JobStart", req)

    def job_end(self, job_id: str):
        """Send JobEnd; returns ``JobEndReply``."""
        from capctl.v1 import capctl_pb2

        return self._call("JobEnd", capctl_pb2.JobEndRequest(job_id=job_id))

    def local_status(self):
        """Return the agent's ``LocalStatusReply``."""
        from capctl.v1 import capctl_pb2

        return self._call("LocalStatus", capctl_pb2.LocalStatusRequest())
