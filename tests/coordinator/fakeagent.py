"""Lightweight node agents for coordinator tests: real gRPC (capctl.v1.AgentLink) over loopback or
unix sockets, with a small first-order GPU physics instead of NVML.

Not a mock of the coordinator's side: the coordinator under test is a real process; these agents
speak the real protocol (docs/protocol.md), apply plans to simulated GPUs, and acknowledge with
read-backs — optionally late (``ack_lag_s``) to make the two-phase rule observable.

:class:`Ledger` records every change of every GPU's enforced cap across all fake agents of a test
(under one lock), so the *exact* sum of enforced caps at every instant is known: ``max_sum_w`` and
per-domain maxima.

GPU physics (units W, degC, MHz, s): power = min(demand, enforced cap) when busy, ``idle_w`` when
idle; temperature relaxes to ``inlet_c + r_c_per_w * power`` with time constant ``tau_s``; the SM
clock is ``max_sm_clock_mhz * rho(enforced)`` where rho is the allocator's H100 default curve
(so the coordinator's online fit agrees with the prior); at or above the slowdown temperature the
clock drops 30 % and the reason HW_THERMAL_SLOWDOWN is reported. ``power_factor`` (default 1: every
GPU the same plant) varies the plant per GPU: a part with factor ``p`` needs ``p`` times the
dynamic power (above ``idle_w``) of a nominal one for the same clock, ``rho(idle + (enforced -
idle) / p)``, as parts of one product differ (issue 12: power factors 0.9-1.3).
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time

import grpc

from capctl.allocator.curves import DEFAULT_CURVES
from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc

H100_NAME = "NVIDIA H100 80GB HBM3"


class Ledger:
    """Exact sums of enforced caps across fake agents (W), with their maxima over time."""

    def __init__(self, domains: dict[str, set] | None = None) -> None:
        self.lock = threading.Lock()
        self.caps: dict[tuple[str, int], float] = {}
        self.domains = domains or {}  # name -> set of node names
        self.max_sum_w = 0.0
        self.max_domain_w: dict[str, float] = {}
        self.changes = 0
        self.history: list[tuple[float, float]] = []

    def set(self, key: tuple[str, int], cap_w: float) -> None:
        with self.lock:
            self.caps[key] = cap_w
            self.changes += 1
            total = sum(self.caps.values())
            self.max_sum_w = max(self.max_sum_w, total)
            self.history.append((time.monotonic(), total))
            for name, nodes in self.domains.items():
                s = sum(v for k, v in self.caps.items() if k[0] in nodes)
                self.max_domain_w[name] = max(self.max_domain_w.get(name, 0.0), s)

    def total(self) -> float:
        with self.lock:
            return sum(self.caps.values())

    def reset_max(self) -> None:
        with self.lock:
            self.max_sum_w = sum(self.caps.values())
            self.max_domain_w = {}


@dataclasses.dataclass
class FakeGpu:
    index: int
    cap_w: float = 300.0
    min_cap_w: float = 200.0
    max_cap_w: float = 700.0
    default_cap_w: float = 700.0
    slowdown_temp_c: float = 87.0
    shutdown_temp_c: float = 92.0
    max_sm_clock_mhz: int = 1980
    inlet_c: float = 25.0
    r_c_per_w: float = 0.06
    tau_s: float = 2.0
    demand_w: float = 650.0
    idle_w: float = 70.0
    power_factor: float = 1.0
    busy: bool = False
    temp_c: float = 0.0
    power_w: float = 0.0
    energy_j: float = 0.0
    max_temp_c: float = 0.0
    thermal_samples: int = 0

    def __post_init__(self) -> None:
        if self.temp_c == 0.0:
            self.temp_c = self.inlet_c + self.r_c_per_w * self.idle_w
        if self.power_w == 0.0:
            self.power_w = self.idle_w

    @property
    def enforced_w(self) -> float:
        return min(max(self.cap_w, self.min_cap_w), self.max_cap_w)

    def step(self, dt: float) -> None:
        self.power_w = min(self.demand_w, self.enforced_w) if self.busy else self.idle_w
        t_ss = self.inlet_c + self.r_c_per_w * self.power_w
        self.temp_c = t_ss + (self.temp_c - t_ss) * math.exp(-dt / self.tau_s)
        self.max_temp_c = max(self.max_temp_c, self.temp_c)
        self.energy_j += self.power_w * dt

    def clocks(self) -> tuple[int, list[str]]:
        if not self.busy:
            return 345, ["GPU_IDLE"]
        reasons = []
        curve = DEFAULT_CURVES["H100"]
        nominal_w = self.idle_w + (self.enforced_w - self.idle_w) / self.power_factor
        rho = float(curve.rate(nominal_w)) if self.enforced_w < self.demand_w else 1.0
        if self.enforced_w < self.demand_w:
            reasons.append("SW_POWER_CAP")
        clock = self.max_sm_clock_mhz * min(1.0, rho)
        if self.temp_c >= self.slowdown_temp_c:
            clock *= 0.7
            reasons.append("HW_THERMAL_SLOWDOWN")
            self.thermal_samples += 1
        return int(clock), reasons

    def info(self, node: str = "") -> pb.GpuInfo:
        """Its ``GpuInfo``; the UUID names ``node`` (a GPU's UUID is unique in a cluster: the
        coordinator refuses a hello whose GPUs another node serves)."""
        return pb.GpuInfo(index=self.index, uuid=f"GPU-fake-{node}-{self.index:04d}", name=H100_NAME,
                          minor_number=self.index,
                          pci_bus_id=f"00000000:{0x18 + self.index:02X}:00.0", min_cap_w=self.min_cap_w,
                          max_cap_w=self.max_cap_w, default_cap_w=self.default_cap_w,
                          slowdown_temp_c=self.slowdown_temp_c, shutdown_temp_c=self.shutdown_temp_c,
                          max_sm_clock_mhz=self.max_sm_clock_mhz)

    def telemetry(self, job_id: str) -> pb.GpuTelemetry:
        clock, reasons = self.clocks()
        return pb.GpuTelemetry(index=self.index, power_w=self.power_w, cap_w=self.cap_w, enforced_w=self.enforced_w,
                               temp_c=self.temp_c, sm_clock_mhz=clock, clocks_event_reasons=reasons,
                               utilization_pct=95.0 if self.busy else 0.0, energy_j=self.energy_j, job_id=job_id,
                               cap_state="OK")


class FakeAgent:
    """One fake node agent (threads: stream reader, telemetry sender). Reconnects until stopped."""

    def __init__(self, node: str, address: str, gpus: list[FakeGpu], ledger: Ledger, *, interval_s: float = 0.25,
                 ack_lag_s: float = 0.0, protocol_version: str = "capctl.v1", follow_advice: bool = False) -> None:
        self.node = node
        self.address = address
        self.gpus = {g.index: g for g in gpus}
        self.ledger = ledger
        self.interval_s = interval_s
        self.ack_lag_s = ack_lag_s
        self.protocol_version = protocol_version
        self.jobs: dict[str, pb.JobBinding] = {}
        self.lock = threading.Lock()
        self.plans: list[tuple[float, pb.CapPlan]] = []
        self.welcomes: list[pb.Welcome] = []
        self.errors: list[str] = []
        self.connected = threading.Event()
        self._out: queue.Queue | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.connects = 0
        self.last_plan_seq = 0
        self.silent = threading.Event()  # set: like SIGSTOP, no telemetry, plans neither applied nor acked
        self.clock_offset_s = 0.0  # its reports' timestamp_s: the host's wall clock plus this (a skewed node clock)
        # report timing (docs/protocol.md): with follow_advice, reports go out when the latest
        # CapPlan.report_in_s says, then every interval, as the real agent's (nodeagent/reportclock.py)
        self.follow_advice = follow_advice
        self.report_due_mono = time.monotonic() + interval_s
        self.reports: list[tuple[float, float]] = []  # (Unix s, monotonic s) of every report sent
        for g in gpus:
            ledger.set((node, g.index), g.enforced_w)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "FakeAgent":
        for target in (self._link_loop, self._telemetry_loop):
            t = threading.Thread(target=target, name=f"fake-{self.node}-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        q = self._out
        if q is not None:
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _requests(self, q: queue.Queue):
        while True:
            item = q.get()
            if item is None:
                return
            yield item

    def _link_loop(self) -> None:
        while not self._stop.is_set():
            q: queue.Queue = queue.Queue()
            with self.lock:
                hello = pb.AgentHello(protocol_version=self.protocol_version, node=self.node, agent_version="fake",
                                      driver_version="fake", simulated=True,
                                      gpus=[g.info(self.node) for g in self.gpus.values()], jobs=list(self.jobs.values()),
                                      last_plan_seq=self.last_plan_seq)
            q.put(pb.AgentMessage(hello=hello))
            channel = grpc.insecure_channel(self.address)
            try:
                stream = pb_grpc.AgentLinkStub(channel).Connect(self._requests(q))
                for msg in stream:
                    kind = msg.WhichOneof("body")
                    if kind == "welcome":
                        self.welcomes.append(msg.welcome)
                        self._out = q
                        self.connects += 1
                        self.connected.set()
                        self._send_telemetry()
                    elif kind == "plan":
                        self._apply(msg.plan)
                    if self._stop.is_set():
                        break
            except grpc.RpcError as err:
                code = err.code()
                self.errors.append(f"{code.name}: {err.details()}")
            finally:
                self.connected.clear()
                self._out = None
                q.put(None)
                channel.close()
            self._stop.wait(0.1)

    def _apply(self, plan: pb.CapPlan) -> None:
        self.plans.append((time.monotonic(), plan))
        if self.follow_advice and 0 < plan.report_in_s <= 2 * self.interval_s:
            self.report_due_mono = self.plans[-1][0] + plan.report_in_s
        if self.silent.is_set():
            return
        if self.ack_lag_s and plan.caps:
            time.sleep(self.ack_lag_s)  # a slow agent: applies and acks late, in order
        with self.lock:
            touched = []
            if not plan.dry_run:
                for a in plan.caps:
                    g = self.gpus.get(a.index)
                    if g is None:
                        continue
                    g.cap_w = a.cap_w
                    self.ledger.set((self.node, g.index), g.enforced_w)
                    touched.append(g)
            self.last_plan_seq = plan.seq
            ack = pb.CapAck(seq=plan.seq, ok=True, gpus=[g.telemetry(self._job_of(g.index)) for g in touched])
        q = self._out
        if q is not None:
            q.put(pb.AgentMessage(ack=ack))

    def _job_of(self, index: int) -> str:
        for j in self.jobs.values():
            if index in j.gpu_indices:
                return j.job_id
        return ""

    def _send_telemetry(self) -> None:
        q = self._out
        if q is None or self.silent.is_set():
            return
        with self.lock:
            msg = pb.NodeTelemetry(node=self.node, timestamp_s=time.time() + self.clock_offset_s,
                                   seq=int(time.monotonic() * 1000),
                                   gpus=[g.telemetry(self._job_of(i)) for i, g in sorted(self.gpus.items())])
            self.reports.append((msg.timestamp_s, time.monotonic()))
        q.put(pb.AgentMessage(telemetry=msg))

    def _wait_report(self) -> bool:
        """Wait until the next report is due; False once stopped."""
        if not self.follow_advice:
            return not self._stop.wait(self.interval_s)
        while not self._stop.wait(0.005):
            if time.monotonic() >= self.report_due_mono:
                self.report_due_mono = time.monotonic() + self.interval_s  # until an advice moves it
                return True
        return False

    def _telemetry_loop(self) -> None:
        last = time.monotonic()
        while self._wait_report():
            now = time.monotonic()
            with self.lock:
                for g in self.gpus.values():
                    g.step(now - last)
            last = now
            self._send_telemetry()

    # -- jobs --------------------------------------------------------------------------------
    def start_job(self, job_id: str, indices: list[int], partition: str = "batch", account: str = "", qos: str = "") -> None:
        b = pb.JobBinding(job_id=job_id, node=self.node, gpu_indices=indices, user="alice", partition=partition,
                          account=account, qos=qos, start_time_s=time.time())
        with self.lock:
            self.jobs[job_id] = b
            for i in indices:
                self.gpus[i].busy = True
        q = self._out
        if q is not None:
            q.put(pb.AgentMessage(job_started=pb.JobStarted(binding=b)))

    def end_job(self, job_id: str) -> None:
        with self.lock:
            b = self.jobs.pop(job_id, None)
            if b is not None:
                for i in b.gpu_indices:
                    self.gpus[i].busy = False
        q = self._out
        if q is not None:
            q.put(pb.AgentMessage(job_ended=pb.JobEnded(job_id=job_id, node=self.node)))

    # -- inspection ----------------------------------------------------------------------------
    def caps(self) -> dict[int, float]:
        with self.lock:
            return {i: g.enforced_w for i, g in self.gpus.items()}

    def plans_since(self, t_mono: float) -> list[pb.CapPlan]:
        return [p for t, p in list(self.plans) if t >= t_mono]
