"""Agents that vanish (process killed, connection reset) end their streams cleanly: the coordinator
detaches them and neither leaves stream tasks pending nor unretrieved task exceptions behind
(asyncio's "Task was destroyed but it is pending" / "Task exception was never retrieved")."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from capctl import lifeline
from tests.coordinator.conftest import REPO, wait_for, write_policy

AGENT = r"""
import sys, time
import grpc
from capctl.v1 import capctl_pb2 as pb, capctl_pb2_grpc

node, address = sys.argv[1], sys.argv[2]
gpus = [pb.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H100 80GB HBM3", min_cap_w=200, max_cap_w=700,
                   default_cap_w=700, slowdown_temp_c=89, shutdown_temp_c=92, max_sm_clock_mhz=1980) for i in range(4)]

def requests():
    yield pb.AgentMessage(hello=pb.AgentHello(protocol_version="capctl.v1", node=node, gpus=gpus, jobs=[
        pb.JobBinding(job_id="job-" + node, node=node, gpu_indices=[0, 1, 2, 3])]))
    seq = 0
    while True:
        seq += 1
        yield pb.AgentMessage(telemetry=pb.NodeTelemetry(node=node, seq=seq, gpus=[
            pb.GpuTelemetry(index=i, power_w=600, cap_w=700, enforced_w=700, temp_c=60, sm_clock_mhz=1900,
                            clocks_event_reasons=["SW_POWER_CAP"], utilization_pct=100, job_id="job-" + node, cap_state="OK")
            for i in range(4)]))
        time.sleep(0.1)

channel = grpc.insecure_channel(address)
for msg in capctl_pb2_grpc.AgentLinkStub(channel).Connect(requests()):
    print(msg.WhichOneof("body"), flush=True)  # no acks: plans stay queued for this stream
"""


def test_killed_agents_leave_no_pending_or_unretrieved_tasks(tmp_path, start_coordinator):
    nodes = [f"n{i}" for i in range(4)]
    policy = write_policy(tmp_path / "policy.yaml", nodes=nodes, budget_w=4 * 4 * 500.0, interval_s=0.2)
    coord = start_coordinator(policy)
    procs = []
    try:
        for n in nodes:
            procs.append(lifeline.Popen([sys.executable, "-c", AGENT, n, coord.address], cwd=REPO,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        for p in procs:  # each got its Welcome and at least one plan
            seen = []
            deadline = time.monotonic() + 20
            while "plan" not in seen and time.monotonic() < deadline:
                line = p.stdout.readline()
                if not line:
                    break
                seen.append(line.strip())
            assert "welcome" in seen and "plan" in seen, seen
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        try:
            wait_for(lambda: coord.log().count("disconnected") >= len(nodes), 15, "every agent detached")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\ncoordinator log (tail):\n{coord.log()[-4000:]}") from None
        time.sleep(1.0)  # a few intervals with the streams gone
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
            if p.stdout:
                p.stdout.close()
    assert coord.stop() == 0
    log = coord.log()
    assert "Task was destroyed but it is pending" not in log, log[-3000:]
    assert "Task exception was never retrieved" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


class _SlowCancelContext:
    """A gRPC servicer context whose reads hang and take 0.5 s to unwind once cancelled (as a read
    in gRPC's core may), so the handler's cleanup wait is still running when it is cancelled again."""

    def __init__(self, hello) -> None:
        self._first = hello
        self.written = []

    async def read(self):
        import asyncio

        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)
            raise

    async def write(self, msg):
        self.written.append(msg)

    def peer(self):
        return "ipv4:127.0.0.1:1"


class _Coord:
    def __init__(self):
        from capctl.v1 import capctl_pb2 as pb

        self.pb = pb
        self.attached, self.detached = [], []

    def may_send(self):
        return True

    def claim_problem(self, hello, session):
        return ""  # (no other agent claims the node)

    def attach(self, hello, session):
        self.attached.append(hello.node)

    def detach(self, node, session):
        self.detached.append((node, session.closed.is_set()))

    def welcome_for(self, node):
        return self.pb.Welcome(protocol_version="capctl.v1")


def test_a_handler_cancelled_twice_still_detaches_its_node():
    """gRPC cancels a handler whose RPC ended; cancelled again while it waits for its reader, it
    must still close the session and detach the node (else the node stays attached to a dead stream)."""
    import asyncio

    from tests.coordinator.conftest import require, importlib_ok

    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    from capctl.v1 import capctl_pb2 as pb
    from coordinator.server import AgentLinkServicer

    coord = _Coord()
    hello = pb.AgentMessage(hello=pb.AgentHello(protocol_version="capctl.v1", node="n1", gpus=[
        pb.GpuInfo(index=0, uuid="GPU-n1-0", name="NVIDIA H100 80GB HBM3", min_cap_w=200, max_cap_w=700,
                   default_cap_w=700, slowdown_temp_c=89, shutdown_temp_c=92, max_sm_clock_mhz=1980)]))

    async def scenario():
        handler = asyncio.ensure_future(AgentLinkServicer(coord)._serve(_SlowCancelContext(hello), coord))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if coord.attached:
                break
        assert coord.attached == ["n1"]
        handler.cancel()
        await asyncio.sleep(0.1)  # the handler now waits for its reader to unwind
        assert coord.detached == []
        handler.cancel()
        try:
            await handler
        except asyncio.CancelledError:
            pass

    asyncio.run(scenario())
    assert coord.detached == [("n1", True)]
