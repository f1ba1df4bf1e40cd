"""gRPC channels from the CLI to the coordinator, with errors mapped to :mod:`capctl.errors`.

Address resolution: ``--coordinator ADDR`` flag, else ``$CAPCTL_COORDINATOR``, else
:data:`DEFAULT_COORDINATOR`. Addresses are gRPC targets: ``unix:/path`` or ``host:port``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import grpc

from capctl.errors import CapctlError, NotFoundError, PermissionDeniedError, UnreachableError, UserInputError

DEFAULT_COORDINATOR = "unix:/run/capctl/coordinator.sock"
"""Default admin address of the coordinator (root-only unix socket on the head node)."""

DEFAULT_TIMEOUT_S = 5.0
"""Deadline of one admin RPC in seconds."""


def coordinator_address(flag: str | None = None) -> str:
    """Return the coordinator address: ``flag``, ``$CAPCTL_COORDINATOR`` or the default."""
    return flag or os.environ.get("CAPCTL_COORDINATOR") or DEFAULT_COORDINATOR


def map_rpc_error(err: grpc.RpcError, address: str) -> CapctlError:
    """Translate a gRPC error into the matching user-facing :class:`CapctlError`."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return UnreachableError(f"coordinator at {address} unreachable ({code.name}): {details}")
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return PermissionDeniedError(f"{details} (coordinator {address})")
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFoundError(details)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE):
        return UserInputError(details)
    return CapctlError(f"coordinator at {address}: {code.name if code else 'error'}: {details}")


@contextlib.contextmanager
def admin_stub(address: str | None = None, credentials: grpc.ChannelCredentials | None = None) -> Iterator[object]:
    """Yield a ``capctl.v1.Admin`` stub on a fresh channel; closes the channel afterwards.

    Raises:
        CapctlError subclasses (see :func:`map_rpc_error`) for gRPC failures inside the block.
    """
    from capctl.v1 import capctl_pb2_grpc

    target = coordinator_address(address)
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    try:
        yield capctl_pb2_grpc.AdminStub(channel)
    except grpc.RpcError as err:
        raise map_rpc_error(err, target) from None
    finally:
        channel.close()
