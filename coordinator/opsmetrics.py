"""The coordinator's operational metrics, beside the per-interval ones of :mod:`coordinator.metrics`:
build info and process metrics (:mod:`capctl.capmetrics`), ``capctl_policy_reloads_total{result}``
(SIGHUP and admin reloads), per-GPU cap state (for the GPUs the policy's ``metrics.per_gpu_series`` selects,
:func:`exported_gpus`), GPUs per cap state, and lingering per-job series.

Per-job series linger: a job's ``capctl_job_*`` series keep their last values for
:data:`JOB_SERIES_LINGER_S` after the job leaves the view, so that ``rate()``/``increase()`` over the
energy counter still see its last increase (a series that vanishes between two scrapes loses it).
"""

from __future__ import annotations

import dataclasses
import time

from prometheus_client import Counter

from capctl import capmetrics, capstates

JOB_SERIES_LINGER_S = 300.0
"""How long a finished job's series stay exported (s): a few scrape intervals (Prometheus' default
scrape interval is 60 s), enough for rate() windows of 1-5 min to see the job's last increase."""


class OpsMetrics:
    """Build info, process metrics and error counters in ``registry``; :meth:`attach` adds the cap
    state family and the job-series linger for a coordinator."""

    def __init__(self, registry) -> None:
        self.registry = registry
        capmetrics.register_process_metrics(registry)
        self.reloads = Counter("capctl_policy_reloads", "Policy reloads (SIGHUP or capctl policy reload), by result (ok, error).",
                               ["result"], registry=registry)
        for result in ("ok", "error"):
            self.reloads.labels(result=result)
        self.jobs = JobLinger()

    def reloaded(self, result: str) -> None:
        """Count one reload with ``result`` "ok" or "error"."""
        self.reloads.labels(result=result).inc()

    def attach(self, coord) -> None:
        """Export ``coord``'s per-GPU cap states."""
        self.registry.register(_CapStateCollector(coord))


class JobLinger:
    """Remembers each job's last status row; :meth:`rows` returns the current rows plus those of jobs
    gone for less than :data:`JOB_SERIES_LINGER_S` (their last values)."""

    def __init__(self, linger_s: float = JOB_SERIES_LINGER_S, clock=time.monotonic) -> None:
        self.linger_s = linger_s
        self.clock = clock
        self._gone: dict[str, tuple[float, object]] = {}
        self._last: dict[str, object] = {}

    def rows(self, jobs) -> list:
        """``jobs`` (rows with ``job_id``) plus the lingering rows of jobs absent from ``jobs``."""
        now = self.clock()
        current = {j.job_id: j for j in jobs}
        for job_id, row in self._last.items():
            if job_id not in current and job_id not in self._gone:
                self._gone[job_id] = (now, row)
        for job_id in list(self._gone):
            if job_id in current or now - self._gone[job_id][0] > self.linger_s:
                del self._gone[job_id]
        self._last = current
        return [*jobs, *(row for _, row in self._gone.values())]


@dataclasses.dataclass(frozen=True)
class ExportedGpus:
    """Which GPUs of one view get per-GPU series, and the counts over every GPU.

    Attributes:
        rows: ``(node name, GpuStatus, cap state name)`` of the exported GPUs, node order.
        by_state: cap state name -> GPUs in it, every GPU ("" = no state reported yet).
        stragglers: GPUs flagged STRAGGLER, every GPU.
    """

    rows: list
    by_state: dict
    stragglers: int


def exported_gpus(status, metrics_policy) -> ExportedGpus:
    """The GPUs of ``status`` (``StatusReply``) that get per-GPU series under ``metrics_policy``
    (:class:`capctl.policy.model.MetricsPolicy`): all (``all``), the :func:`flagged` ones
    (``flagged``) or none (``none``); ``auto`` resolved by the number of GPUs in ``status``.
    Computed once per view and policy (the two collectors of a scrape share it)."""
    global _last_exported
    last = _last_exported
    if last is not None and last[0] is status and last[1] == metrics_policy:
        return last[2]
    n_gpus = sum(len(n.gpus) for n in status.nodes)
    mode = metrics_policy.mode(n_gpus)
    rows, counts, stragglers = [], {}, 0
    of = capstates.of
    for n in status.nodes:
        for g in n.gpus:
            state = of(g)
            counts[state] = counts.get(state, 0) + 1
            straggler = "STRAGGLER" in g.flags
            stragglers += straggler
            if mode == "all" or (mode == "flagged" and (len(g.flags) or (state != capstates.OK and state != ""))):
                rows.append((n.name, g, state))
    out = ExportedGpus(rows, counts, stragglers)
    _last_exported = (status, metrics_policy, out)
    return out


_last_exported = None
"""(status, metrics policy, result) of the last :func:`exported_gpus` call."""


class _CapStateCollector:
    """``capctl_gpu_cap_state`` of the exported GPUs and ``capctl_gpus_by_cap_state`` from the
    coordinator's latest view."""

    def __init__(self, coord) -> None:
        self.coord = coord

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        exp = exported_gpus(self.coord.view.status, self.coord.policy.metrics)
        counts = exp.by_state
        yield capmetrics.cap_state_family((node, g.index, g.uuid, state) for node, g, state in exp.rows)
        fam = GaugeMetricFamily("capctl_gpus_by_cap_state", "GPUs in each cap state (every GPU, whatever "
                                "metrics.per_gpu_series; state \"\" = none reported yet).", labels=["state"])
        for state in capmetrics.CAP_STATES:
            fam.add_metric([state], float(counts.get(state, 0)))
        for state in sorted(set(counts) - set(capmetrics.CAP_STATES)):
            fam.add_metric([state], float(counts[state]))
        yield fam
