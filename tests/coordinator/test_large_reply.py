"""The status of a large cluster reaches ``capctl``: the coordinator's real gRPC server
(:func:`coordinator.server.build_server`) and the CLI's real client (:class:`coordinator.client.AdminClient`)
over a unix socket. The coordinator behind the server is a stand-in that answers one big
``StatusReply`` (building a 40,000-GPU view takes the registry and the models of that many GPUs:
bench/interval_cost.py measures that; here only the transport's limits are under test)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.coordinator.conftest import importlib_ok, require

pytestmark = pytest.mark.integration

NODES, GPUS_PER_NODE = 5000, 8
"""40,000 GPUs: ~6 MiB of status (measured on bench/interval_cost.py's coordinator)."""


class _Coord:
    """Answers ``status_reply`` with ``reply`` (what AdminServicer.Status asks of the coordinator)."""

    def __init__(self, reply) -> None:
        self.reply = reply

    def status_reply(self):
        return self.reply


def _big_status(pb):
    """A StatusReply of NODES nodes x GPUS_PER_NODE GPUs, every field a real status fills."""
    st = pb.StatusReply(budget_w=NODES * GPUS_PER_NODE * 560.0, interval_s=1.0)
    for n in range(NODES):
        node = st.nodes.add(name=f"gpu{n:05d}", last_report_age_s=0.4)
        for i in range(GPUS_PER_NODE):
            node.gpus.add(index=i, uuid=f"GPU-{n:08x}-{i:04x}-4e1f-9c3d-51a7e2b0c8d4", cap_w=512.0 + i,
                          enforced_w=512.0 + i, power_w=498.5, temp_c=71.0, slowdown_temp_c=87.0,
                          sm_clock_mhz=1755, clocks_event_reasons=["SW_POWER_CAP"], job_id=f"{1000 + n // 4}",
                          min_cap_w=200.0, max_cap_w=700.0)
    return st


def _serve(server, ready: threading.Event, stop: threading.Event, loop: asyncio.AbstractEventLoop) -> None:
    async def main():
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0.5)

    loop.run_until_complete(main())


def test_status_above_4_mib_reaches_the_client(tmp_path):
    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    from capctl.v1 import capctl_pb2 as pb
    from coordinator.client import AdminClient
    from coordinator.server import MAX_MESSAGE_BYTES, TrustAll, build_server

    reply = _big_status(pb)
    size = reply.ByteSize()
    assert size > MAX_MESSAGE_BYTES  # what failed: more than the 4 MiB the server sent at most
    address = f"unix:{tmp_path}/admin.sock"
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), threading.Event()
    server = None

    async def build():
        return build_server(_Coord(reply), address, TrustAll(), agent_link=False)[0]

    server = loop.run_until_complete(build())
    thread = threading.Thread(target=_serve, args=(server, ready, stop, loop), name="large-reply-server", daemon=True)
    thread.start()
    try:
        assert ready.wait(10), "server did not start"
        with AdminClient(address, timeout_s=30.0) as client:
            got = client.status()
        assert got.ByteSize() == size
        assert len(got.nodes) == NODES and sum(len(n.gpus) for n in got.nodes) == NODES * GPUS_PER_NODE
        assert got.nodes[-1].name == f"gpu{NODES - 1:05d}" and got.nodes[-1].gpus[-1].cap_w == 512.0 + GPUS_PER_NODE - 1
    finally:
        stop.set()
        thread.join(10)
        loop.close()
    assert not thread.is_alive()
