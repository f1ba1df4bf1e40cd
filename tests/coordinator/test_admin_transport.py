"""The admin transport at scale: the coordinator's real gRPC server
(:func:`coordinator.server.build_server`), the CLI's real client and ``capctl`` itself over a unix
socket. A large cluster's status (over gRPC's default 4 MiB) reaches ``capctl``; ``--timeout`` sets
each call's deadline and a late answer says so. The coordinator behind the server is a stand-in
that answers one ``StatusReply`` (building a 40,000-GPU view takes the registry and the models of
that many GPUs: bench/interval_cost.py measures that; here the transport is under test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import types

import pytest

from tests.coordinator.conftest import importlib_ok, require

pytestmark = pytest.mark.integration

NODES, GPUS_PER_NODE = 5000, 8
"""40,000 GPUs: ~6 MiB of status (measured on bench/interval_cost.py's coordinator)."""


class _Coord:
    """Answers ``status_reply`` with ``reply`` (what AdminServicer.Status asks of the coordinator)."""

    def __init__(self, reply) -> None:
        self.reply = reply

    def status_reply(self, view=None):
        return self.reply if view is None else view.status


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


@contextlib.contextmanager
def _served(coord, address: str):
    """The coordinator's real Admin server for ``coord`` on ``address``, in a thread of its own."""
    from coordinator.server import TrustAll, build_server

    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), threading.Event()

    async def build():
        return build_server(coord, address, TrustAll(), agent_link=False)[0]

    server = loop.run_until_complete(build())
    thread = threading.Thread(target=_serve, args=(server, ready, stop, loop), name="admin-test-server", daemon=True)
    thread.start()
    try:
        assert ready.wait(10), "server did not start"
        yield
    finally:
        stop.set()
        thread.join(10)
        loop.close()
    assert not thread.is_alive()


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capctl.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_status_above_4_mib_reaches_the_client(tmp_path):
    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    from capctl.v1 import capctl_pb2 as pb
    from coordinator.client import AdminClient
    from coordinator.server import MAX_MESSAGE_BYTES

    reply = _big_status(pb)
    size = reply.ByteSize()
    assert size > MAX_MESSAGE_BYTES  # what failed: more than the 4 MiB the server sent at most
    address = f"unix:{tmp_path}/admin.sock"
    with _served(_Coord(reply), address):
        with AdminClient(address, timeout_s=30.0) as client:
            got = client.status()
        assert got.ByteSize() == size
        assert len(got.nodes) == NODES and sum(len(n.gpus) for n in got.nodes) == NODES * GPUS_PER_NODE
        assert got.nodes[-1].name == f"gpu{NODES - 1:05d}" and got.nodes[-1].gpus[-1].cap_w == 512.0 + GPUS_PER_NODE - 1
        # the CLI's own channel (capctl.cli.rpc: TLS and token options) had gRPC's default 4 MiB
        out = _cli("--coordinator", address, "--json", "nodes")
        assert out.returncode == 0, out.stderr[-2000:]
        nodes = json.loads(out.stdout)["nodes"]
        assert len(nodes) == NODES and sum(len(n["gpus"]) for n in nodes) == NODES * GPUS_PER_NODE


class _SlowCoord(_Coord):
    """Answers after ``delay_s`` (a coordinator building a large cluster's view)."""

    def __init__(self, reply, delay_s: float) -> None:
        super().__init__(reply)
        self.delay_s = delay_s

    def status_reply(self, view=None):
        time.sleep(self.delay_s)
        return self.reply


def test_timeout_flag_sets_each_calls_deadline_and_a_late_answer_says_so(tmp_path):
    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    from capctl.v1 import capctl_pb2 as pb

    address = f"unix:{tmp_path}/admin.sock"
    with _served(_SlowCoord(pb.StatusReply(budget_w=1234.0), 1.0), address):
        late = _cli("--coordinator", address, "--timeout", "0.3", "status")
        assert late.returncode == 3 and "did not answer in time" in late.stderr and "--timeout" in late.stderr, late
        assert "Traceback" not in late.stderr
        ok = _cli("--coordinator", address, "--json", "status", "--timeout", "10")  # (after the subcommand too)
        assert ok.returncode == 0 and json.loads(ok.stdout)["budget_w"] == 1234.0, ok.stderr
        env = _cli("--coordinator", address, "--json", "status", env={"CAPCTL_TIMEOUT_S": "0.3"})
        assert env.returncode == 3 and json.loads(env.stdout)["exit_code"] == 3
    for bad in ("0", "-1", "nan", "abc", "1e9"):
        out = _cli("--coordinator", address, "--timeout", bad, "status")
        assert out.returncode == 1 and f"--timeout {bad!r}: need seconds, more than 0 and at most 3600" in out.stderr, out
    out = _cli("--coordinator", address, "status", env={"CAPCTL_TIMEOUT_S": "soon"})
    assert out.returncode == 1 and "$CAPCTL_TIMEOUT_S 'soon'" in out.stderr, out
    # a command that never connects takes no deadline (as the TLS settings)
    from tests.coordinator.conftest import REPO

    out = _cli("policy", "validate", str(REPO / "examples" / "policies" / "lab-4node.yaml"),
               env={"CAPCTL_TIMEOUT_S": "soon"})
    assert out.returncode == 0 and "CAPCTL_TIMEOUT_S" not in out.stderr, out


def test_a_status_view_is_built_off_the_event_loop(tmp_path):
    """A large cluster's view takes seconds to build (bench/interval_cost.py: ~40 us per GPU);
    the admin service builds it in a worker thread, so the event loop (reports, acknowledgements:
    here a health check on the same server) keeps answering meanwhile, and the reply is the
    view's."""
    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from capctl.v1 import capctl_pb2 as pb
    from coordinator.client import AdminClient
    from coordinator.view import LazyView

    built = threading.Event()

    def build():
        time.sleep(1.5)  # (sleeps: releases the GIL, as the view's numpy work partly does)
        built.set()
        return types.SimpleNamespace(status=pb.StatusReply(budget_w=4321.0))

    coord = _Coord(pb.StatusReply())
    coord.view = LazyView(build, 0.0, 0)
    address = f"unix:{tmp_path}/admin.sock"
    with _served(coord, address):
        box: dict = {}
        caller = threading.Thread(target=lambda: box.update(st=AdminClient(address, timeout_s=30.0).status()))
        caller.start()
        time.sleep(0.3)  # the status call is building
        with grpc.insecure_channel(address) as ch:
            t0 = time.monotonic()
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5.0)
            took_s = time.monotonic() - t0
        assert not built.is_set() and took_s < 0.5, took_s  # answered while the view was still building
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        caller.join(10)
        assert box["st"].budget_w == 4321.0


class _SlowAdminCoord(_Coord):
    """Applies a budget, then answers after ``delay_s`` (a coordinator busy with a large cluster)."""

    def __init__(self, delay_s: float) -> None:
        from capctl.v1 import capctl_pb2 as pb

        super().__init__(pb.StatusReply())
        self.pb, self.delay_s, self.applied = pb, delay_s, []
        self.policy = types.SimpleNamespace(domains=types.SimpleNamespace(nodes=["n1"], children=[]))

    def may_send(self):
        return True

    async def set_budget(self, budget_w):
        self.applied.append(budget_w)
        await asyncio.sleep(self.delay_s)
        return self.pb.SetBudgetReply(ok=True, budget_w=budget_w, message=f"budget set to {budget_w:g} W")


def test_a_change_past_its_deadline_says_it_may_have_been_applied(tmp_path):
    """``budget set`` cut off by ``--timeout`` said only "did not answer in time ... is
    capctl-coordinator running there?" while the budget was applied and saved (found by a
    try-out): a script retried or assumed the old budget. It says the change may have been
    applied and to look at the status first."""
    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    coord = _SlowAdminCoord(1.0)
    address = f"unix:{tmp_path}/admin.sock"
    with _served(coord, address):
        out = _cli("--coordinator", address, "--timeout", "0.3", "budget", "set", "2890")
        assert out.returncode == 3 and "the change may have been applied" in out.stderr, out
        assert "capctl status" in out.stderr and coord.applied == [2890.0]
        ok = _cli("--coordinator", address, "budget", "set", "2880")
        assert ok.returncode == 0 and "budget set to 2880 W" in ok.stdout + ok.stderr, ok
