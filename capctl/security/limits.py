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
import operator
import re

from capctl import readings
from capctl.readings import R_ERROR, R_INDEX, R_JOB, R_REASONS, R_STATE

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
"""Most entries of each memo of :func:`rows_problem` (cleared when full)."""
_CLEAN_LABELS: set = set()
"""``(cap_state, job_id)`` pairs found acceptable (a fleet reports a few distinct pairs)."""
_CLEAN_REASONS: set = set()
"""Clocks-event-reason tuples found acceptable (a fleet reports a few distinct sets)."""


def rows_problem(rows: list, field: str) -> str:
    """The first problem of the decoded GPU rows ``rows`` (:func:`capctl.readings.rows_of`: a
    ``NodeTelemetry``'s or ``CapAck``'s GPUs, packed or not), "" when none: index, string lengths,
    reason count. Numbers are not judged here (the coordinator treats non-finite readings as missing).

    Every GPU of every report and acknowledgement comes through here: a row whose labels and reason
    set were already found acceptable passes on a memo (two set lookups, :data:`_CLEAN_LABELS`,
    :data:`_CLEAN_REASONS`; bounded by :data:`_CLEAN_MAX`); anything else takes the full checks
    (:func:`row_problem`), whose verdict is the one returned (tested equal on random readings,
    tests/security/test_limits.py)."""
    clean_labels, clean_reasons = _CLEAN_LABELS, _CLEAN_REASONS
    if len(rows) > 1 and len({row[R_INDEX] for row in rows}) != len(rows):
        seen: set = set()
        twice = next(row[R_INDEX] for row in rows if row[R_INDEX] in seen or seen.add(row[R_INDEX]))
        return f"{field}: GPU index {twice} twice; an agent reports each GPU once"
    for row in rows:
        reasons = row[R_REASONS]
        if (row[R_INDEX] < MAX_GPUS_PER_NODE and len(row[R_ERROR]) <= MAX_ERROR_LEN
                and (row[R_STATE], row[R_JOB]) in clean_labels and (not reasons or reasons in clean_reasons)):
            continue
        p = row_problem(row, field)
        if p:
            return p
        for memo, key in ((clean_labels, (row[R_STATE], row[R_JOB])), (clean_reasons, reasons)):
            if len(memo) >= _CLEAN_MAX:
                memo.clear()
            memo.add(key)
    return ""


def row_problem(row: tuple, field: str) -> str:
    """The full checks of one decoded GPU row (see :func:`rows_problem`; "" when acceptable)."""
    index, reasons, error = row[R_INDEX], row[R_REASONS], row[R_ERROR]
    if index >= MAX_GPUS_PER_NODE:
        return f"{field}: GPU index {index}, at most {MAX_GPUS_PER_NODE - 1}"
    if len(reasons) > MAX_CLOCK_REASONS:
        return f"{field} GPU {index}: clocks_event_reasons: {len(reasons)}, at most {MAX_CLOCK_REASONS}"
    if any(len(r) > MAX_LABEL_LEN for r in reasons):
        return f"{field} GPU {index}: clocks_event_reasons: a reason longer than {MAX_LABEL_LEN} characters"
    if any(_CONTROL_RE.search(r) for r in reasons):
        bad = next(r for r in reasons if _CONTROL_RE.search(r))
        return f"{field} GPU {index}: clocks_event_reasons {_show(bad)}: control characters are not allowed"
    if len(error) > MAX_ERROR_LEN:
        return f"{field} GPU {index}: error: {len(error)} characters, at most {MAX_ERROR_LEN} allowed"
    state, job = row[R_STATE], row[R_JOB]
    if len(state) > MAX_LABEL_LEN or len(job) > MAX_LABEL_LEN * 8 or _CONTROL_RE.search(state) \
            or _CONTROL_RE.search(job):  # (the field names are built only for a message: every GPU, every interval)
        return _first(check_label(state, f"{field} GPU {index}: cap_state_name"),
                      check_label(job, f"{field} GPU {index}: job_id", MAX_LABEL_LEN * 8))
    return ""


def printable(text: str) -> str:
    """``text`` with each control character written as its escape (``\\n``, ``\\x1b``): a peer's
    free text (a GPU's error, an acknowledgement's error) goes into log lines and alerts as one
    line that cannot rewrite the terminal (found by a review: ``"e\\n\\x1b[31mred"`` was taken as is)."""
    if not _CONTROL_RE.search(text):
        return text
    return _CONTROL_RE.sub(lambda m: repr(m.group())[1:-1], text)


def _checked_rows(part, field: str) -> tuple[list, str]:
    """``(rows, problem)`` of the GPUs of ``part`` (a ``NodeTelemetry`` or ``CapAck``; ``field``
    names its message): decoded once (:func:`capctl.readings.rows_of`), packed or not; rows are
    ``[]`` when ``problem`` is not ""."""
    if readings.is_packed(part):
        if len(part.gpus):
            return [], f"{field}: both gpus and readings (packed) set; an agent sends one"
        name = f"{field}.readings"
        rows, tails, p = readings.packed_rows_tails(part.readings, name, MAX_GPUS_PER_NODE)
        if p:
            return [], p
        errors = _packed_errors(rows, tails)
        if errors < 0:  # (anything new or wrong: the full checks, and the first problem's text)
            p = rows_problem(rows, name)
            if p:
                return [], p
            errors = any(tail[3] for tail in tails.values())
    else:
        if len(part.gpus) > MAX_GPUS_PER_NODE:
            return [], f"{field}.gpus: {len(part.gpus)} GPUs, at most {MAX_GPUS_PER_NODE} allowed"
        name = f"{field}.gpus"
        rows = readings.rows_of(part)
        p = rows_problem(rows, name)
        if p:
            return [], p
        errors = any(row[R_ERROR] for row in rows)
    if errors:  # (most reports: no error at all)
        rows = [row[:R_ERROR] + (printable(row[R_ERROR]),) + row[R_ERROR + 1:] for row in rows]
    return rows, ""


_CLEAN_INDICES: set = set()
"""Tuples of GPU indices (a report's, in its order) found distinct and below
:data:`MAX_GPUS_PER_NODE` (a node reports the same GPUs every time; bounded by :data:`_CLEAN_MAX`)."""
_FIRST = operator.itemgetter(R_INDEX)


def _packed_errors(rows: list, tails: dict) -> int:
    """Judge the packed ``rows`` on the whole report at once: -1 unless :func:`rows_problem` surely
    finds nothing in them, else 1 when some row has an error text, 0 when none. Sure: its GPU
    indices on the memo of index tuples found distinct and below :data:`MAX_GPUS_PER_NODE`
    (:data:`_CLEAN_INDICES`, filled here), and each of its distinct string parts ``tails``
    (:func:`capctl.readings.packed_rows_tails`: a node reports one or two) on the memos of labels
    and reason sets found acceptable, its error within :data:`MAX_ERROR_LEN`: exactly
    :func:`rows_problem`'s memo condition, for every row. -1 (anything new or wrong) sends the rows
    through :func:`rows_problem`, whose text is the one returned (tested equal on random packed
    reports, tests/coordinator/test_ingest_fastpaths.py).

    Why: the memo condition per row and the error scan cost ~0.36 us a GPU; per report and
    distinct part ~0.19 (:func:`telemetry_rows` 0.91 -> 0.74 us a GPU on bench/interval_cost.py's
    reports, 7 Dec 2026)."""
    indices = tuple(map(_FIRST, rows))
    if indices not in _CLEAN_INDICES:
        if len(set(indices)) != len(indices) or (indices and max(indices) >= MAX_GPUS_PER_NODE):
            return -1
        if len(_CLEAN_INDICES) >= _CLEAN_MAX:
            _CLEAN_INDICES.clear()
        _CLEAN_INDICES.add(indices)
    clean_labels, clean_reasons = _CLEAN_LABELS, _CLEAN_REASONS
    errors = 0
    for state, reasons, job, error in tails.values():
        if len(error) > MAX_ERROR_LEN or (state, job) not in clean_labels or (reasons and reasons not in clean_reasons):
            return -1
        if error:
            errors = 1
    return errors


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


def telemetry_rows(t, node: str | None = None) -> tuple[list, str]:
    """A ``NodeTelemetry``: node (equal to ``node`` when given), GPU count, each GPU (packed or
    not). Returns ``(rows, problem)``: its decoded GPU rows (:mod:`capctl.readings`; ``[]`` when
    refused) and "" or what is wrong."""
    if t.node and node is not None and t.node != node:
        return [], f"NodeTelemetry.node {_show(t.node)} on the stream of {_show(node)}"
    return _checked_rows(t, "NodeTelemetry")


def validate_telemetry(t, node: str | None = None) -> str:
    """The problem of :func:`telemetry_rows` ("" when acceptable)."""
    return telemetry_rows(t, node)[1]


def ack_rows(ack) -> tuple[list, str]:
    """A ``CapAck``: GPU count, each GPU's read-back (packed or not), error length. Returns
    ``(rows, problem)`` as :func:`telemetry_rows`."""
    if len(ack.error) > 16 * MAX_ERROR_LEN:
        return [], f"CapAck.error: {len(ack.error)} characters, at most {16 * MAX_ERROR_LEN}"
    return _checked_rows(ack, "CapAck")


def validate_ack(ack) -> str:
    """The problem of :func:`ack_rows` ("" when acceptable)."""
    return ack_rows(ack)[1]


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
