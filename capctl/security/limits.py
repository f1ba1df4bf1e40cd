"""Input bounds of every capctl interface: constants and validators.

Every message a daemon accepts from the network or a local socket is bounded twice: gRPC refuses
messages over the size limits below (``RESOURCE_EXHAUSTED``) before they are parsed, and the
validators here check counts, string lengths and numbers of the parsed message. Validators return
``""`` when the message is acceptable, else one line naming the field, the value (truncated) and
what is allowed — suitable for an ``INVALID_ARGUMENT`` status.

Sources of the bounds: NVML supports at most 64 devices per node (``nvmlDeviceGetCount``; DGX/HGX
nodes have 8 or 16); RFC 1035 host names are at most 253 characters; Slurm job ids are
``<id>[_<array index>][+<het offset>]``; the remaining bounds are generous round numbers far above
real use (a 256-job node, 1 GW budget) that still cap the memory one peer can make us hold.
"""

from __future__ import annotations

import math
import re

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest gRPC message the coordinator receives or sends (4 MiB: a 64-GPU hello is ~20 KiB)."""
MAX_LOCAL_MESSAGE_BYTES = 1 * 1024 * 1024
"""Largest gRPC message on an agent's local (Slurm hook) socket."""
MAX_DENIED_MESSAGE_BYTES = 64 * 1024
"""Largest message read from a caller refused by the SO_PEERCRED check."""
MAX_GPUS_PER_NODE = 64
MAX_JOBS_PER_NODE = 256
MAX_JOBS = 65536
"""Most job bindings the coordinator holds cluster-wide."""
MAX_NODES = 16384
"""Most agents (nodes) the coordinator accepts."""
MAX_NAME_LEN = 253
"""Node / host name length (RFC 1035)."""
MAX_JOB_ID_LEN = 128
MAX_LABEL_LEN = 128
"""user, partition, account, qos, versions, cap_state_name."""
MAX_ERROR_LEN = 1024
"""Error strings carried in telemetry and acks."""
MAX_CLOCK_REASONS = 32
MAX_PATH_LEN = 4096
MAX_BUDGET_W = 1e9
"""Largest budget accepted by ``SetBudget``, W (1 GW)."""
MAX_CAP_W = 1e5
"""Largest per-GPU power figure accepted, W (far above any GPU's max limit)."""

_NODE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:-]*$")
_JOB_RE = re.compile(r"^[A-Za-z0-9_.+:-]+$")
_CONTROL_RE = re.compile("[\x00-\x1f\x7f]")
"""A control character: ``ord(c) < 32 or ord(c) == 127``."""


def _show(value: str, n: int = 64) -> str:
    return repr(value if len(value) <= n else value[:n] + "...")


def check_node_name(value: str, field: str = "node") -> str:
    """A Slurm node / host name: 1..253 of ``[A-Za-z0-9._:-]`` (no spaces, no '/')."""
    if not value or len(value) > MAX_NAME_LEN or not _NODE_RE.match(value):
        return f"{field} {_show(value)}: need a node name of 1..{MAX_NAME_LEN} characters from [A-Za-z0-9._:-]"
    return ""


def check_job_id(value: str, field: str = "job_id") -> str:
    """A Slurm job id: 1..128 of ``[A-Za-z0-9_.+:-]`` (e.g. ``1234``, ``1234_7``, ``1234+1``)."""
    if not value or len(value) > MAX_JOB_ID_LEN or not _JOB_RE.match(value):
        return f"{field} {_show(value)}: need a Slurm job id of 1..{MAX_JOB_ID_LEN} characters from [A-Za-z0-9_.+:-]"
    return ""


JOB_LABELS = ("user", "partition", "account")
"""Who ran a job: the JobStart's labels, carried in its bindings and its agents' energy records."""


def label_or_empty(value) -> str:
    """``value`` when it is a label :func:`check_label` takes, else "" (a label from a state file or
    an agent's energy record is kept or left out, never the reason to drop the record)."""
    return value if isinstance(value, str) and not check_label(value, "") else ""


def check_label(value: str, field: str, max_len: int = MAX_LABEL_LEN) -> str:
    """A free-text label (user, partition, ...): at most ``max_len`` characters, no control characters."""
    if len(value) > max_len:
        return f"{field}: {len(value)} characters, at most {max_len} allowed"
    if _CONTROL_RE.search(value):
        return f"{field} {_show(value)}: control characters are not allowed"
    return ""


def check_watts(value: float, field: str, *, allow_zero: bool = True, max_w: float = MAX_CAP_W) -> str:
    """A finite number of watts in [0, max_w] (or (0, max_w] without ``allow_zero``)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero) or value > max_w:
        low = "0 <=" if allow_zero else "0 <"
        from capctl.wattunits import format_watts

        return f"{field} {format_watts(value)}: need {low} W <= {format_watts(max_w)} (finite)"
    return ""


def clip(text: str, max_len: int = MAX_ERROR_LEN) -> str:
    """``text`` cut to ``max_len`` characters (with a marker) for storing peer-provided strings."""
    return text if len(text) <= max_len else text[: max_len - 3] + "..."


def _first(*problems: str) -> str:
    return next((p for p in problems if p), "")


def validate_binding(b, node: str | None = None, field: str = "binding") -> str:
    """A ``JobBinding``: job id, node (equal to ``node`` when given), GPU indices, labels."""
    p = _first(check_job_id(b.job_id, f"{field}.job_id"),
               check_label(b.user, f"{field}.user"), check_label(b.partition, f"{field}.partition"),
               check_label(b.account, f"{field}.account"), check_label(b.qos, f"{field}.qos"))
    if p:
        return p
    if b.node and node is not None and b.node != node:
        return f"{field}.node {_show(b.node)}: a binding of node {_show(node)} must name it"
    if len(b.gpu_indices) > MAX_GPUS_PER_NODE:
        return f"{field}.gpu_indices: {len(b.gpu_indices)} GPUs, at most {MAX_GPUS_PER_NODE} allowed"
    if any(i >= MAX_GPUS_PER_NODE for i in b.gpu_indices):
        return f"{field}.gpu_indices: index above {MAX_GPUS_PER_NODE - 1}"
    if not math.isfinite(b.start_time_s):
        return f"{field}.start_time_s {b.start_time_s!r}: need a finite Unix time"
    return ""


_CLEAN_MAX = 4096
"""Most entries of each memo of :func:`validate_gpu_telemetry` (cleared when full)."""
_CLEAN_LABELS: set = set()
"""``(cap_state_name, job_id)`` pairs found acceptable (a fleet reports a few distinct pairs)."""
_CLEAN_REASONS: set = set()
"""Clocks-event-reason tuples found acceptable (a fleet reports a few distinct sets)."""


def validate_gpu_telemetry(g, field: str = "gpus") -> str:
    """A ``GpuTelemetry``: index, string lengths, reason count. Numbers are not judged here
    (the coordinator treats non-finite readings as missing).

    Every GPU of every report and acknowledgement comes through here: a reading whose labels and
    reason set were already found acceptable is passed on a memo (two set lookups,
    :data:`_CLEAN_LABELS`, :data:`_CLEAN_REASONS`; bounded by :data:`_CLEAN_MAX`); anything
    else takes the full checks below (:func:`_gpu_telemetry_problem`), whose verdict is the one
    returned (tested equal on random readings, tests/security/test_limits.py)."""
    if _known_clean(g):
        return ""
    reasons = tuple(g.clocks_event_reasons)
    labels = (g.cap_state_name, g.job_id)
    problem = _gpu_telemetry_problem(g, field)
    if not problem:
        for memo, key in ((_CLEAN_LABELS, labels), (_CLEAN_REASONS, reasons)):
            if len(memo) >= _CLEAN_MAX:
                memo.clear()
            memo.add(key)
    return problem


def _known_clean(g) -> bool:
    """True when ``g`` (a ``GpuTelemetry``) passes on the memo of :func:`validate_gpu_telemetry`."""
    reasons = g.clocks_event_reasons
    return (g.index < MAX_GPUS_PER_NODE and len(g.error) <= MAX_ERROR_LEN
            and (g.cap_state_name, g.job_id) in _CLEAN_LABELS and (not reasons or tuple(reasons) in _CLEAN_REASONS))


def _gpus_problem(gpus, field: str) -> str:
    """:func:`validate_gpu_telemetry` of each of ``gpus``: the first problem, "" when none (the
    memo's check inlined: every GPU of every report and acknowledgement)."""
    clean_labels, clean_reasons = _CLEAN_LABELS, _CLEAN_REASONS
    for g in gpus:
        reasons = g.clocks_event_reasons
        if (g.index < MAX_GPUS_PER_NODE and len(g.error) <= MAX_ERROR_LEN
                and (g.cap_state_name, g.job_id) in clean_labels and (not reasons or tuple(reasons) in clean_reasons)):
            continue
        p = validate_gpu_telemetry(g, field)
        if p:
            return p
    return ""


def _gpu_telemetry_problem(g, field: str) -> str:
    """The full checks of :func:`validate_gpu_telemetry` ("" when acceptable)."""
    if g.index >= MAX_GPUS_PER_NODE:
        return f"{field}.index {g.index}: at most {MAX_GPUS_PER_NODE - 1}"
    if len(g.clocks_event_reasons) > MAX_CLOCK_REASONS:
        return f"{field}[{g.index}].clocks_event_reasons: {len(g.clocks_event_reasons)}, at most {MAX_CLOCK_REASONS}"
    if any(len(r) > MAX_LABEL_LEN for r in g.clocks_event_reasons):
        return f"{field}[{g.index}].clocks_event_reasons: a reason longer than {MAX_LABEL_LEN} characters"
    if len(g.error) > MAX_ERROR_LEN:
        return f"{field}[{g.index}].error: {len(g.error)} characters, at most {MAX_ERROR_LEN} allowed"
    state, job = g.cap_state_name, g.job_id
    if len(state) > MAX_LABEL_LEN or len(job) > MAX_LABEL_LEN * 8 or _CONTROL_RE.search(state) \
            or _CONTROL_RE.search(job):  # (the field names are built only for a message: every GPU, every interval)
        return _first(check_label(state, f"{field}[{g.index}].cap_state_name"),
                      check_label(job, f"{field}[{g.index}].job_id", MAX_LABEL_LEN * 8))
    return ""


def validate_hello(hello) -> str:
    """An ``AgentHello``: node name, counts of GPUs and jobs, each GPU's limit constraints, each binding."""
    p = _first(check_node_name(hello.node, "AgentHello.node"),
               check_label(hello.protocol_version, "AgentHello.protocol_version"),
               check_label(hello.agent_version, "AgentHello.agent_version"),
               check_label(hello.driver_version, "AgentHello.driver_version"))
    if p:
        return p
    if len(hello.gpus) > MAX_GPUS_PER_NODE:
        return f"AgentHello.gpus: {len(hello.gpus)} GPUs, at most {MAX_GPUS_PER_NODE} allowed"
    if len(hello.jobs) > MAX_JOBS_PER_NODE:
        return f"AgentHello.jobs: {len(hello.jobs)} jobs, at most {MAX_JOBS_PER_NODE} allowed"
    seen: set[int] = set()
    for g in hello.gpus:
        if g.index in seen:
            return f"AgentHello.gpus: index {g.index} twice"
        if g.index >= MAX_GPUS_PER_NODE:
            return f"AgentHello.gpus: index {g.index}, at most {MAX_GPUS_PER_NODE - 1}"
        seen.add(g.index)
        vals = (g.min_cap_w, g.max_cap_w, g.default_cap_w, g.slowdown_temp_c, g.pre_job_cap_w)
        # min > max, (0, 0), below 0 or above any board (a 1e12 W maximum) ... are bad device data,
        # not a bad message: that GPU is held (UNSUPPORTED_CONSTRAINTS, capctl.devicedata) and the
        # node's other GPUs are controlled. Only what no agent sends is refused: a non-finite number
        # (the agent sends an unreadable value as 0, nodeagent/messages.py).
        if not all(math.isfinite(v) for v in vals):
            return (f"AgentHello.gpus[{g.index}]: limit constraints min_cap_w={g.min_cap_w} max_cap_w={g.max_cap_w}, "
                    f"default_cap_w={g.default_cap_w} slowdown_temp_c={g.slowdown_temp_c} "
                    f"pre_job_cap_w={g.pre_job_cap_w}: need finite numbers")
        p = _first(check_label(g.uuid, f"AgentHello.gpus[{g.index}].uuid"),
                   check_label(g.name, f"AgentHello.gpus[{g.index}].name"),
                   check_label(g.pci_bus_id, f"AgentHello.gpus[{g.index}].pci_bus_id"))
        if p:
            return p
    for b in hello.jobs:
        p = validate_binding(b, hello.node, "AgentHello.jobs[]")
        if p:
            return p
    return ""


def validate_telemetry(t, node: str | None = None) -> str:
    """A ``NodeTelemetry``: node (equal to ``node`` when given), GPU count, each GPU."""
    if t.node and node is not None and t.node != node:
        return f"NodeTelemetry.node {_show(t.node)} on the stream of {_show(node)}"
    if len(t.gpus) > MAX_GPUS_PER_NODE:
        return f"NodeTelemetry.gpus: {len(t.gpus)} GPUs, at most {MAX_GPUS_PER_NODE} allowed"
    return _gpus_problem(t.gpus, "NodeTelemetry.gpus")


def validate_ack(ack) -> str:
    """A ``CapAck``: GPU count, each GPU's read-back, error length."""
    if len(ack.gpus) > MAX_GPUS_PER_NODE:
        return f"CapAck.gpus: {len(ack.gpus)} GPUs, at most {MAX_GPUS_PER_NODE} allowed"
    if len(ack.error) > 16 * MAX_ERROR_LEN:
        return f"CapAck.error: {len(ack.error)} characters, at most {16 * MAX_ERROR_LEN}"
    return _gpus_problem(ack.gpus, "CapAck.gpus")


def validate_job_start(req) -> str:
    """A ``JobStartRequest`` from a Slurm hook: job id, GPU id count and lengths, labels."""
    p = _first(check_job_id(req.job_id.strip(), "job_id"), check_label(req.user, "user"),
               check_label(req.partition, "partition"), check_label(req.account, "account"),
               check_label(req.qos, "qos"))
    if p:
        return p
    if len(req.gpu_ids) > MAX_GPUS_PER_NODE:
        return f"gpu_ids: {len(req.gpu_ids)} ids, at most {MAX_GPUS_PER_NODE} allowed"
    for gid in req.gpu_ids:
        if not gid or len(gid) > MAX_LABEL_LEN:
            return f"gpu_ids: id {_show(gid)}: need 1..{MAX_LABEL_LEN} characters"
    return ""


def validate_budget(budget_w: float) -> str:
    """A budget for ``SetBudget``: finite, > 0, at most :data:`MAX_BUDGET_W`."""
    return check_watts(budget_w, "budget_w", allow_zero=False, max_w=MAX_BUDGET_W)


def validate_policy_path(path: str) -> str:
    """A ``ReloadPolicyRequest.path``: at most :data:`MAX_PATH_LEN` characters, no NUL."""
    if len(path) > MAX_PATH_LEN:
        return f"path: {len(path)} characters, at most {MAX_PATH_LEN} allowed"
    if "\x00" in path:
        return "path: contains a NUL character"
    return ""


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC server options bounding message sizes (receive and send) and metadata size."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_metadata_size", 16 * 1024)]
