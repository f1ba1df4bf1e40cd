"""Per-job energy at the coordinator: the agents' ``JobEnergy`` reports summed over a job's nodes,
and the :class:`~coordinator.finished.FinishedJob` record made when its last node ends it.

Each agent sends, per running job, its cumulative figures since the job's start on that node (in
every ``NodeTelemetry``) and the final ones (in ``JobEnded``); see :mod:`nodeagent.energy` for how
they are measured. The latest report of a node replaces its earlier ones, so a lost or duplicated
message costs nothing and a coordinator restart loses nothing (the next report carries the
totals). A job's figures are the sums over its nodes; its peak power is the sum of each node's
peak interval power (an upper bound when its nodes peak at different times; exact on one node);
its mean power is its energy over its wall time (end - start).

Owned by the coordinator's event loop, like the registry (no locks).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

from capctl.security.limits import JOB_LABELS, label_or_empty
from coordinator.finished import FinishedJob

log = logging.getLogger("capctl.coordinator.jobenergy")

MAX_RECORDS = 4096
"""At most this many ``JobEnergy`` records of one report are taken (the rest are ignored)."""
MAX_JOB_ID_CHARS = 128

FIELDS = ("energy_j", "gpu_s", "capped_s", "thermal_s", "power_w", "peak_power_w", "start_time_s",
          "end_time_s", "resets", "gpus")


_VALUES = operator.attrgetter(*FIELDS)
"""A ``JobEnergy``'s numbers, in :data:`FIELDS` order (one C call)."""
_LABELS = operator.attrgetter(*JOB_LABELS)
_GOOD_LABELS: set = set()
"""Labels :func:`capctl.security.limits.label_or_empty` kept as they are (a fleet's few users,
partitions and accounts; bounded by :data:`MAX_RECORDS`)."""


def problem(je, values: tuple | None = None) -> str:
    """Why a ``JobEnergy`` from an agent is not taken ("" when it is valid): a job id of 1-128
    characters and every number finite and >= 0. ``values``: its :data:`FIELDS` when already read.

    Speed: all numbers >= 0 with a finite sum are all finite and >= 0 (the first bad one is named
    only otherwise); the numbers read once (one ``attrgetter``) for the check and the
    :class:`NodeEnergy`, built with positional arguments, its labels on a memo: a report with one
    record, :meth:`JobEnergyBook.on_telemetry` ~5.5 -> ~3.8 us (measured 7 Dec 2026; every report
    of a node running a job carries one record per job)."""
    if not 0 < len(je.job_id) <= MAX_JOB_ID_CHARS:
        return f"job_id {je.job_id[:40]!r}: 1-{MAX_JOB_ID_CHARS} characters allowed"
    values = _VALUES(je) if values is None else values
    if min(values) >= 0 and math.isfinite(sum(values)):
        return ""
    for f, v in zip(FIELDS, values):
        if not (math.isfinite(v) and v >= 0):
            return f"job {je.job_id}: {f} {v!r}: a finite number >= 0 allowed"
    return ""


def _label(value: str) -> str:
    """:func:`capctl.security.limits.label_or_empty`, on a memo of the labels it kept."""
    if value in _GOOD_LABELS:
        return value
    out = label_or_empty(value)
    if out:
        if len(_GOOD_LABELS) >= MAX_RECORDS:
            _GOOD_LABELS.clear()
        _GOOD_LABELS.add(out)
    return out


@dataclasses.dataclass
class NodeEnergy:
    """One node's latest ``JobEnergy`` of one job (J, GPU-s, W, Unix s); ``final``: from JobEnded."""

    energy_j: float = 0.0
    gpu_s: float = 0.0
    capped_s: float = 0.0
    thermal_s: float = 0.0
    power_w: float = 0.0
    peak_power_w: float = 0.0
    start_time_s: float = 0.0
    end_time_s: float = 0.0
    resets: int = 0
    gpus: int = 0
    final: bool = False
    user: str = ""
    partition: str = ""
    account: str = ""

    @classmethod
    def from_proto(cls, msg, final: bool = False, values: tuple | None = None) -> "NodeEnergy":
        """From a ``JobEnergy`` (``values``: its :data:`FIELDS` when already read); who ran it, as
        the agent's record says ("" from older agents, or for a label not allowed)."""
        return cls(*(_VALUES(msg) if values is None else values), final, *map(_label, _LABELS(msg)))


class JobEnergyBook:
    """Running jobs' energy per node, and the finished record at a job's end."""

    MAX_JOBS = 100_000
    """Bound on the running jobs tracked (a job never ended by its agents is dropped beyond it)."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, NodeEnergy]] = {}

    def on_telemetry(self, node: str, msg, finished=lambda job_id: False) -> list[str]:
        """Take the ``job_energy`` of one ``NodeTelemetry`` from ``node`` (a final record stays);
        records of jobs ``finished(job_id)`` says are kept already are ignored. Returns the ids of
        the jobs it brought an ended record of (an agent repeating ``JobEnded`` after a reconnect)."""
        ended = []
        for k, je in enumerate(msg.job_energy):
            values = _VALUES(je)
            bad = problem(je, values) or (f"more than {MAX_RECORDS} records in one report" if k >= MAX_RECORDS else "")
            if bad:
                log.warning("agent %s: JobEnergy ignored: %s", node, bad)
                if k >= MAX_RECORDS:
                    break
                continue
            if je.end_time_s > 0:
                if not finished(je.job_id):
                    self.jobs.setdefault(je.job_id, {})[node] = NodeEnergy.from_proto(je, True, values)
                    ended.append(je.job_id)
                continue
            nodes = self.jobs.get(je.job_id)
            if nodes is None:
                if len(self.jobs) >= self.MAX_JOBS:
                    continue
                nodes = self.jobs[je.job_id] = {}
            if not (node in nodes and nodes[node].final):
                nodes[node] = NodeEnergy.from_proto(je, False, values)
        return ended

    def on_job_ended(self, node: str, ended) -> None:
        """Take the final ``JobEnded.energy`` of ``ended.job_id`` on ``node`` (when the agent sent one)."""
        if ended.HasField("energy") and ended.energy.job_id == ended.job_id and not problem(ended.energy):
            self.jobs.setdefault(ended.job_id, {})[node] = NodeEnergy.from_proto(ended.energy, final=True)

    def energy_j(self) -> dict[str, float]:
        """Job id -> its energy so far (J), summed over its nodes."""
        return {job: sum(n.energy_j for n in nodes.values()) for job, nodes in self.jobs.items()}

    def finish(self, job_id: str, bindings: list, end_time_s: float) -> FinishedJob:
        """The finished record of ``job_id`` (forgotten here); ``bindings``: its
        :class:`~coordinator.registry.Binding` s (user, partition, account, nodes, GPUs)."""
        nodes = self.jobs.pop(job_id, {})
        # who ran it: its binding, else its agents' records (a job bound while another coordinator
        # led, or none did, and ended before this one learnt its binding: found by a try-out)
        first = bindings[0] if bindings else next((n for _, n in sorted(nodes.items()) if n.user), None)
        names = sorted({b.node for b in bindings} | set(nodes))
        starts = [n.start_time_s for n in nodes.values() if n.start_time_s > 0]
        starts += [b.start_time_s for b in bindings if b.start_time_s > 0]
        ends = [n.end_time_s for n in nodes.values() if n.final and n.end_time_s > 0]
        start = min(starts) if starts else 0.0
        end = max(ends) if ends else end_time_s
        energy = sum(n.energy_j for n in nodes.values())
        # per node: its binding's GPUs, else its agent's record's (the bindings passed are those
        # left when the last node ended it: 8 GPUs on 2 nodes were counted 4, a try-out)
        per_node = {b.node: len(b.gpu_indices) for b in bindings}
        for name, n in nodes.items():
            per_node.setdefault(name, n.gpus)
        gpus = sum(per_node.values())
        return FinishedJob(
            job_id=job_id, user=first.user if first else "", partition=first.partition if first else "",
            account=first.account if first else "", nodes=tuple(names), gpus=gpus, start_time_s=start,
            end_time_s=end, energy_j=energy, gpu_s=sum(n.gpu_s for n in nodes.values()),
            mean_power_w=energy / (end - start) if end > start > 0 else 0.0,
            peak_power_w=sum(n.peak_power_w for n in nodes.values()),
            capped_s=sum(n.capped_s for n in nodes.values()), thermal_s=sum(n.thermal_s for n in nodes.values()),
            resets=sum(n.resets for n in nodes.values()),
            # without a binding the job's nodes are not known (it ran while another coordinator led,
            # or none did): records of other nodes may come later, so it is not called complete
            complete=bool(nodes) and bool(bindings) and all(n.final for n in nodes.values())
            and set(nodes) >= {b.node for b in bindings},
        )
