"""A small in-test AgentLink server (real gRPC on a unix socket) that records what agents send and
lets a test push ``CapPlan``s. Used to test the agent's protocol side independently of the real
coordinator (tests against the real one live in test_agent_coordinator.py)."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent import futures

import grpc

from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc


class FakeCoordinator(pb_grpc.AgentLinkServicer):
    """AgentLink servicer. ``hellos``, ``telemetry``, ``acks``, ``events`` record the upstream
    messages; :meth:`push_plan` sends a plan to the (latest) stream of a node."""

    def __init__(self, address: str, *, interval_s: float = 0.2, lease_s: float = 2.0,
                 safe_caps: dict[int, float] | None = None, protocol_version: str = "capctl.v1",
                 packed_readings: bool = False) -> None:
        """``packed_readings``: the Welcome asks for ``GpuReadings`` (as the real coordinator's)."""
        self.address = address
        self.packed_readings = packed_readings
        self.protocol_version = protocol_version
        self.interval_s = interval_s
        self.lease_s = lease_s
        self.safe_caps = safe_caps or {}
        self.coordinator_id = uuid.uuid4().hex[:8]
        self.lock = threading.Lock()
        self.hellos: list[pb.AgentHello] = []
        self.telemetry: list[pb.NodeTelemetry] = []
        self.telemetry_mono: list[float] = []  # receipt time (monotonic s) of each telemetry message
        self.acks: list[pb.CapAck] = []
        self.events: list[pb.AgentMessage] = []
        self.outboxes: dict[str, queue.Queue] = {}
        self.seq = 0
        self.server: grpc.Server | None = None

    def Connect(self, request_iterator, context):  # noqa: N802
        first = next(request_iterator)
        hello = first.hello
        if hello.protocol_version.split(".")[:2] != ["capctl", "v1"]:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "protocol version")
        out: queue.Queue = queue.Queue()
        with self.lock:
            self.hellos.append(hello)
            self.outboxes[hello.node] = out
        done = threading.Event()

        def reader():
            try:
                for msg in request_iterator:
                    kind = msg.WhichOneof("body")
                    with self.lock:
                        if kind == "telemetry":
                            self.telemetry.append(msg.telemetry)
                            self.telemetry_mono.append(time.monotonic())
                        elif kind == "ack":
                            self.acks.append(msg.ack)
                        else:
                            self.events.append(msg)
            except grpc.RpcError:
                pass
            finally:
                done.set()

        threading.Thread(target=reader, daemon=True).start()
        yield pb.CoordinatorMessage(welcome=pb.Welcome(
            protocol_version=self.protocol_version, coordinator_id=self.coordinator_id, interval_s=self.interval_s,
            lease_s=self.lease_s, safe_caps=[pb.CapAssignment(index=i, cap_w=c) for i, c in self.safe_caps.items()],
            packed_readings=self.packed_readings))
        while not done.is_set() and context.is_active():
            try:
                item = out.get(timeout=0.1)
            except queue.Empty:
                continue
            yield item

    def push_plan(self, node: str, caps: dict[int, float], *, phase: str = "decrease", lease_s: float | None = None,
                  safe_caps: dict[int, float] | None = None, dry_run: bool = False, term: int = 0,
                  report_in_s: float = 0.0, caps_rows: bytes | None = None) -> int:
        """Send a plan to ``node``'s stream; returns its seq. ``caps_rows``: the caps as packed rows
        instead (capctl.plancaps; ``caps`` then unused), the safe caps packed too."""
        lease = self.lease_s if lease_s is None else lease_s
        with self.lock:
            self.seq += 1
            seq = self.seq
            out = self.outboxes[node]
        safe = safe_caps or self.safe_caps
        if caps_rows is not None:
            from capctl import plancaps

            plan = pb.CapPlan(seq=seq, phase=phase, caps_rows=caps_rows, safe_caps_rows=plancaps.pack(safe),
                              lease_expiry_s=time.time() + lease, lease_s=lease, dry_run=dry_run, term=term,
                              report_in_s=report_in_s)
        else:
            plan = pb.CapPlan(
                seq=seq, phase=phase, caps=[pb.CapAssignment(index=i, cap_w=c) for i, c in caps.items()],
                lease_expiry_s=time.time() + lease, lease_s=lease,
                safe_caps=[pb.CapAssignment(index=i, cap_w=c) for i, c in safe.items()],
                dry_run=dry_run, term=term, report_in_s=report_in_s)
        out.put(pb.CoordinatorMessage(plan=plan))
        return seq

    def ack_for(self, seq: int) -> pb.CapAck | None:
        with self.lock:
            return next((a for a in self.acks if a.seq == seq), None)

    def start(self, server_credentials: grpc.ServerCredentials | None = None) -> FakeCoordinator:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_AgentLinkServicer_to_server(self, self.server)
        if server_credentials is not None:
            self.server.add_secure_port(self.address, server_credentials)
        else:
            self.server.add_insecure_port(self.address)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0.2).wait(3.0)
