"""Protocol messages of the node agent: the ``capctl.v1`` protobufs it builds (pure functions).

Every builder takes plain values (W, °C, MHz, J, seconds) and returns a message; none reads a
device or agent state, none raises for odd inputs: a non-finite number goes out as 0 (the wire
carries no NaN), a missing value as its protobuf default. Also here: reading the outcome of a
:class:`~nodeagent.caps.CapManager` write (:func:`result_error`, :func:`results_iter`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

from capctl import capstates, readings
from nodeagent.backend import DeviceInfo, GpuSample
from nodeagent.link import PROTOCOL_VERSION


def finite(value, default: float = 0.0) -> float:
    """``value`` as a float, or ``default`` when it is not a finite number (never raises)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


# ----------------------------------------------------------------------------------------------
# CapManager results (CapResult / SetResult / error markers)

def result_error(r) -> str:
    """The error text of one per-GPU write result ("" when it succeeded; "no result" for None)."""
    if r is None:
        return "no result"
    if isinstance(r, BaseException):
        return str(r)
    err = getattr(r, "error", None)
    if err:
        return str(err)
    if getattr(r, "ok", True) is False:
        return str(getattr(r, "message", "") or "failed")
    return ""


def results_iter(res, batch) -> Iterator[tuple[int, object]]:
    """Yield ``(index, result)`` from a CapManager result (dict by index or list of records)."""
    if res is None:
        return
    if isinstance(res, dict):
        for i, r in res.items():
            yield int(i), r
        return
    for r in res:
        idx = getattr(r, "index", None)
        if idx is not None:
            yield int(idx), r


def cap_result(index: int, r):
    """``GpuCapResult`` of one write result: caps in W, ``ok``/``error`` from :func:`result_error`."""
    from capctl.v1 import capctl_pb2

    err = result_error(r)
    cap = getattr(r, "cap_w", None)
    if cap is None:
        cap = getattr(r, "restored_w", getattr(r, "written_w", 0.0))
    return capctl_pb2.GpuCapResult(index=index, cap_w=finite(cap), enforced_w=finite(getattr(r, "enforced_w", 0.0)),
                                   ok=not err, error=err)


def cap_results(indices: Iterable[int], results: dict | None, samples: Sequence[GpuSample]) -> list:
    """``GpuCapResult`` per GPU of ``indices``: its write result when ``results`` has one, else the
    requested/enforced limits (W) of its last sample, ``ok``."""
    from capctl.v1 import capctl_pb2

    results = results or {}
    by_index = {s.index: s for s in samples}
    out = []
    for i in indices:
        if i in results:
            out.append(cap_result(i, results[i]))
        else:
            s = by_index.get(i)
            out.append(capctl_pb2.GpuCapResult(index=i, cap_w=finite(getattr(s, "cap_w", 0)),
                                               enforced_w=finite(getattr(s, "enforced_w", 0)), ok=True))
    return out


# ----------------------------------------------------------------------------------------------
# AgentHello parts, bindings, telemetry

def gpu_info(dev: DeviceInfo, pre_job_cap_w: float):
    """``GpuInfo`` of one device (limits W, thresholds °C, clock MHz; ``pre_job_cap_w`` W, 0: none)."""
    from capctl.v1 import capctl_pb2

    return capctl_pb2.GpuInfo(
        index=dev.index, uuid=dev.uuid or "", name=dev.name or "",
        minor_number=max(0, int(dev.minor_number)), pci_bus_id=dev.pci_bus_id or "",
        min_cap_w=finite(dev.min_cap_w), max_cap_w=finite(dev.max_cap_w),
        default_cap_w=finite(dev.default_cap_w), slowdown_temp_c=finite(dev.slowdown_temp_c),
        shutdown_temp_c=finite(dev.shutdown_temp_c), max_sm_clock_mhz=int(dev.max_sm_clock_mhz or 0),
        pre_job_cap_w=finite(pre_job_cap_w),
    )


def job_binding(node: str, job_id: str, meta: dict):
    """``JobBinding`` of ``job_id`` from its record (``gpu_indices``, user, ..., ``start_time_s``)."""
    from capctl.v1 import capctl_pb2

    return capctl_pb2.JobBinding(job_id=job_id, node=node, gpu_indices=meta["gpu_indices"], user=meta["user"],
                                 partition=meta["partition"], account=meta["account"], qos=meta["qos"],
                                 start_time_s=meta["start_time_s"])


def telemetry_state(sample: GpuSample, cap_state: str, safe_mode: bool) -> str:
    """The cap state a GPU reports: ``SAFE_CAP`` for an ``OK`` GPU held by the failsafe, ``LOST`` /
    ``STALLED`` / ``ERROR`` for a sample that could not be read (lost GPU / an NVML call past its
    timeout, :mod:`nodeagent.callguard` / other), else the CapManager's ``cap_state``."""
    state = cap_state
    if safe_mode and state == capstates.OK:
        state = capstates.SAFE_CAP
    if getattr(sample, "error", None):
        state = {"GpuLostError": capstates.LOST, "NvmlStalledError": capstates.STALLED}.get(
            getattr(sample, "error_type", ""), capstates.ERROR)
    return state


def gpu_telemetry(s: GpuSample, *, state: str, job_ids: Sequence[str], error: str, pre_job_cap_w: float):
    """``GpuTelemetry`` of one sample (W, °C, MHz, %, J); ``state`` from :func:`telemetry_state`;
    ``error``: the sample's own error, else ``error`` (the GPU's last set-cap error).
    ``utilization_rates`` is set only when both utilization values were read (finite)."""
    from capctl.v1 import capctl_pb2

    util, mem = s.utilization_pct, getattr(s, "memory_utilization_pct", math.nan)
    rates = (capctl_pb2.UtilizationRates(gpu_pct=util, memory_pct=mem)
             if math.isfinite(util) and math.isfinite(mem) else None)
    return capctl_pb2.GpuTelemetry(
        utilization_rates=rates, index=s.index, power_w=finite(s.power_w), cap_w=finite(s.cap_w), enforced_w=finite(s.enforced_w),
        temp_c=finite(s.temp_c), sm_clock_mhz=int(s.sm_clock_mhz or 0),
        clocks_event_reasons=list(s.clocks_event_reasons or ()), utilization_pct=finite(s.utilization_pct),
        energy_j=finite(s.energy_j), job_id=",".join(job_ids), **capstates.wire_fields(state),
        error=getattr(s, "error", None) or error, pre_job_cap_w=finite(pre_job_cap_w),
    )


def hello(*, node: str, agent_version: str, driver_version: str | None, simulated: bool, gpus: list,
          jobs: list, last_plan_seq: int, coordinator_term: int = 0):
    """``AgentHello`` of a (re)connect (``gpus``: ``GpuInfo``; ``jobs``: ``JobBinding``;
    ``coordinator_term``: the newest coordinator term the agent has seen, :mod:`nodeagent.fencing`)."""
    from capctl.v1 import capctl_pb2

    return capctl_pb2.AgentHello(
        protocol_version=PROTOCOL_VERSION, node=node, agent_version=agent_version,
        driver_version=driver_version or "", simulated=bool(simulated),
        gpus=gpus, jobs=jobs, last_plan_seq=last_plan_seq, packed_plans=True,  # reads capctl.plancaps rows
        coordinator_term=coordinator_term,
    )


def node_telemetry(node: str, timestamp_s: float, seq: int, gpus: list, job_energy: Sequence = (),
                   packed: bool = False):
    """``AgentMessage`` carrying one ``NodeTelemetry`` (``timestamp_s``: Unix time, s; ``job_energy``:
    ``JobEnergy`` messages of the running jobs, :func:`job_energy`). ``packed``: the GPUs
    (``GpuTelemetry``) go as one ``GpuReadings`` (:func:`capctl.readings.pack`; to a coordinator
    whose ``Welcome`` asked for it)."""
    from capctl.v1 import capctl_pb2

    tele = capctl_pb2.NodeTelemetry(node=node, timestamp_s=timestamp_s, seq=seq, job_energy=job_energy)
    readings.fill(tele, gpus, packed)
    return capctl_pb2.AgentMessage(telemetry=tele)


def job_energy(node: str, rec):
    """``JobEnergy`` of one :class:`~nodeagent.energy.JobEnergy` record (J, GPU-s, W, Unix s)."""
    from capctl.v1 import capctl_pb2

    return capctl_pb2.JobEnergy(
        job_id=rec.job_id, node=node, energy_j=finite(rec.energy_j), gpu_s=finite(rec.gpu_s),
        capped_s=finite(rec.capped_s), thermal_s=finite(rec.thermal_s), power_w=finite(rec.power_w),
        peak_power_w=finite(rec.peak_power_w), start_time_s=finite(rec.start_time_s),
        end_time_s=finite(rec.end_time_s), resets=max(0, int(rec.resets)), gpus=max(0, int(rec.gpus)),
        user=rec.user, partition=rec.partition, account=rec.account)


def cap_ack(seq: int, ok: bool, gpus: list, errors: Sequence[str], packed: bool = False):
    """``CapAck`` of plan ``seq`` with the read-back of its GPUs (``GpuTelemetry``; ``packed``: as
    one ``GpuReadings``, see :func:`node_telemetry`) and the errors joined by "; "."""
    from capctl.v1 import capctl_pb2

    ack = capctl_pb2.CapAck(seq=seq, ok=ok, error="; ".join(errors))
    readings.fill(ack, gpus, packed)
    return ack


def job_started(binding):
    """``AgentMessage`` telling the coordinator a job started (``binding``: a ``JobBinding``)."""
    from capctl.v1 import capctl_pb2

    return capctl_pb2.AgentMessage(job_started=capctl_pb2.JobStarted(binding=binding))


def job_ended(job_id: str, node: str, energy=None):
    """``AgentMessage`` telling the coordinator ``job_id`` ended on ``node``, with the job's final
    :class:`~nodeagent.energy.JobEnergy` there (None: the agent never saw it start)."""
    from capctl.v1 import capctl_pb2

    msg = capctl_pb2.JobEnded(job_id=job_id, node=node)
    if energy is not None:
        msg.energy.CopyFrom(job_energy(node, energy))
    return capctl_pb2.AgentMessage(job_ended=msg)
