"""The caller's SO_PEERCRED credentials through capctl.security.peercred.CredentialSplice: a real
gRPC aio server behind the splice sees the connecting process's uid, gid and pid; a look-alike
name bound outside the splice's private directory names nobody."""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from capctl.security.peercred import CredentialSplice, caller_of


class _Recorder(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.peers: list[str] = []

    async def Check(self, request, context):  # noqa: N802
        self.peers.append(context.peer())
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_the_spliced_server_sees_the_callers_uid_and_pid_and_a_forged_name_is_refused(tmp_path):
    public = str(tmp_path / "admin.sock")
    splice = CredentialSplice(public)
    rec = _Recorder()

    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(rec, server)
        server.add_insecure_port(splice.private_address)
        await server.start()
        splice.start()
        try:
            for _ in range(2):
                # a subchannel of its own: gRPC would otherwise share one connection between channels
                own = [("grpc.use_local_subchannel_pool", 1)]
                async with grpc.aio.insecure_channel(f"unix:{public}", options=own) as ch:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return [caller_of(p) for p in rec.peers]  # while the splice runs
        finally:
            splice.stop()
            await server.stop(0)

    callers = asyncio.run(main())
    assert all(c is not None and (c.uid, c.gid, c.pid) == (os.getuid(), os.getgid(), os.getpid()) for c in callers)
    assert rec.peers[0] != rec.peers[1]  # one name per connection
    assert f"uid {os.getuid()} " in callers[0].describe() and f"pid {os.getpid()}" in callers[0].describe()
    assert not os.path.exists(public) and not os.path.exists(splice.private_dir)  # stop() cleans up
    # the same name shape, bound by a client outside the (now gone) private directory: nobody
    fake = tmp_path / f"peer-0-0-{os.getpid()}-1"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(fake))
    s.close()
    assert caller_of(f"unix:{fake}") is None and caller_of(rec.peers[0]) is None and caller_of("unix:") is None
