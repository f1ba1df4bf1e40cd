"""Prometheus metrics of the coordinator (prometheus_client), served on a loopback HTTP port.

Names follow the Prometheus conventions (base units, ``_total`` for counters, ``_seconds``,
``_watts``, ``_celsius``, ``_joules``, ``_ratio`` for 0..1 fractions). The full list with meanings
is in docs/metrics.md. Per-interval values are read from the coordinator's published view (a
custom collector: consistent within one interval, no locks); histograms and counters are updated
as events happen.

Per-GPU series are exported for the GPUs the policy's ``metrics.per_gpu_series`` selects
(:func:`coordinator.opsmetrics.exported_gpus`: all, flagged or none; ``auto`` = all up to
``metrics.all_up_to_gpus`` GPUs): a scrape of every GPU costs ~23 series and ~200 us of CPU per GPU
(bench/scrape_cost.py: 8,000 GPUs 1.6-1.8 s, 100,000 GPUs 23-30 s). Aggregates per cluster, domain, job and cap state are always exported.
"""

from __future__ import annotations

import logging
import math

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.samples import Sample

from capctl import capstates

log = logging.getLogger("capctl.coordinator.metrics")

SOLVE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ACK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

GPU_LABELS = ["node", "gpu", "uuid"]
FINISHED_EXPORT_S = 600.0
"""A finished job's ``capctl_job_gpu_energy_joules_total`` series stays this long after its end (s)."""
FINISHED_EXPORT_MAX = 1000
"""At most this many finished jobs' series at once (newest kept): bounded cardinality."""


class ViewCollector:
    """Exports the latest :class:`~coordinator.view.View` of a coordinator."""

    def __init__(self, coord, jobs=None) -> None:
        self.coord = coord
        self.jobs = jobs  # coordinator.opsmetrics.JobLinger: finished jobs' series linger

    def describe(self):
        return []

    def collect(self):
        """Every family of the latest view: cluster, GPU, agent, domain, job and fleet figures."""
        from coordinator.opsmetrics import exported_gpus

        view = self.coord.view
        st = view.status
        exp = exported_gpus(st, self.coord.policy.metrics)
        rows = exp.rows
        yield from _cluster_families(view)
        exported = _gauge("capctl_metrics_gpus_exported", "GPUs with per-GPU series in this scrape "
                          "(policy metrics.per_gpu_series).")
        exported.add_metric([], float(len(rows)))
        yield exported
        yield from _gpu_families(view, rows)
        yield from _agent_families(st)
        yield from _domain_families(st)
        yield from _job_families(st, self.jobs.rows(st.jobs) if self.jobs is not None else st.jobs)
        yield _job_energy_family(st, getattr(self.coord, "recent_finished", ()))
        yield from _fleet_families(view)
        yield from _observed_families(st, rows, exp.stragglers)


def _gauge(name: str, doc: str, labels=()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _cluster_families(view):
    """Cluster-wide gauges: budget, allocated, enforced and drawn watts, settings, durations (W, s)."""
    st = view.status
    for name, doc, value in (
        ("capctl_budget_watts", "Cluster power budget in force (W).", st.budget_w),
        ("capctl_allocated_watts", "Sum of allocated (desired) caps (W).", st.allocated_w),
        ("capctl_enforced_watts", "Sum of the caps the GPUs may be enforcing (accounted caps, W).", st.enforced_w),
        ("capctl_draw_watts", "Sum of GPU power draw (NVML power usage, W).", st.draw_w),
        ("capctl_dry_run", "1 when the coordinator applies nothing (dry run).", 1.0 if st.dry_run else 0.0),
        ("capctl_interval_seconds", "Reconcile interval (s).", st.interval_s),
        ("capctl_last_solve_timestamp_seconds", "Unix time of the last solve (s).", st.last_solve_time_s),
        ("capctl_reconcile_duration_seconds", "Duration of the last reconcile interval's work (s).", view.tick_s),
        ("capctl_alerts", "Number of active alerts.", len(st.alerts)),
    ):
        family = _gauge(name, doc)
        if not math.isnan(value):  # (NaN: unknown, e.g. the draw while no GPU has a live reading: no sample)
            family.add_metric([], value)
        yield family


def _gpu_families(view, rows):
    """Per-GPU families (W, degC, Hz, ratios, J) of the GPUs in ``rows`` ((node name, GpuStatus,
    cap state) as :func:`coordinator.opsmetrics.exported_gpus`)."""
    g = _gauge
    cap = g("capctl_gpu_cap_watts", "Allocated (desired) power cap of a GPU (W).", GPU_LABELS)
    ecap = g("capctl_gpu_enforced_cap_watts", "Enforced power limit read back from NVML (W).", GPU_LABELS)
    pw = g("capctl_gpu_power_watts", "GPU power draw, NVML power usage (W).", GPU_LABELS)
    tmp = g("capctl_gpu_temperature_celsius", "GPU core temperature (degC).", GPU_LABELS)
    clk = g("capctl_gpu_sm_clock_hertz", "SM clock (Hz).", GPU_LABELS)
    ceil = g("capctl_gpu_thermal_ceiling_watts", "Largest cap the thermal model allows, at most the GPU's maximum "
             "limit (W; the maximum limit when the thermal model does not bind).", GPU_LABELS)
    margin = g("capctl_gpu_hotspot_margin_celsius", "Slowdown temperature minus temperature (degC).", GPU_LABELS)
    inten = g("capctl_gpu_throttle_intensity_ratio", "Clock lost vs the maximum SM clock, 1 - sm/max (0..1, busy GPUs).", GPU_LABELS)
    thf = g("capctl_gpu_thermal_throttle_time_ratio",
            "Fraction of telemetry samples in the last 60 s with a thermal slowdown reason (0..1).", GPU_LABELS)
    pwf = g("capctl_gpu_power_throttle_time_ratio",
            "Fraction of telemetry samples in the last 60 s with a power-cap reason (0..1).", GPU_LABELS)
    energy = CounterMetricFamily("capctl_gpu_energy_joules", "NVML total energy counter of the GPU since driver load (J).",
                                 labels=GPU_LABELS)
    mem = g("capctl_gpu_memory_bound_ratio", "Memory-bound share of the GPU's step, from NVML memory utilization "
            "(0..0.9; absent without an estimate; policy models.memory_bound_share).", GPU_LABELS)
    extra = {(e.node, e.index): e for e in view.gpus} if rows else {}
    # samples appended directly, one label dict per GPU shared by its 11 series: add_metric builds a
    # dict per series (4.4 us each, 87,000 calls per scrape at 8,000 GPUs); same exposition
    add = [f.samples.append for f in (cap, ecap, pw, tmp, clk, ceil, margin, inten, thf, pwf, energy)]
    names = [f.name for f in (cap, ecap, pw, tmp, clk, ceil, margin, inten, thf, pwf)] + [energy.name + "_total"]
    for node, gs, _state in rows:
        lab = {"node": node, "gpu": str(gs.index), "uuid": gs.uuid}
        add[0](Sample(names[0], lab, gs.cap_w))
        if gs.enforced_w == gs.enforced_w:  # (not NaN: never read)
            add[1](Sample(names[1], lab, gs.enforced_w))
        if not gs.no_live_reading:  # no live reading (LOST, STALLED, ...): no sample rather than a stale one
            add[2](Sample(names[2], lab, gs.power_w))
            add[3](Sample(names[3], lab, gs.temp_c))
            add[4](Sample(names[4], lab, gs.sm_clock_mhz * 1e6))
        if gs.thermal_ceiling_w > 0:
            add[5](Sample(names[5], lab, gs.thermal_ceiling_w))
        if gs.HasField("memory_bound_fraction"):
            mem.samples.append(Sample(mem.name, lab, gs.memory_bound_fraction))
        e = extra.get((node, gs.index))
        if e is not None:
            if not math.isnan(e.hotspot_margin_c):
                add[6](Sample(names[6], lab, e.hotspot_margin_c))
            add[7](Sample(names[7], lab, e.throttle_intensity))
            add[8](Sample(names[8], lab, e.thermal_fraction))
            add[9](Sample(names[9], lab, e.power_fraction))
            add[10](Sample(names[10], lab, e.energy_j))
    return (cap, ecap, pw, tmp, clk, ceil, margin, inten, thf, pwf, energy, mem)


def _agent_families(st):
    """Per-node agent staleness (s) and up (0/1); the watts held for a policy node whose agent never
    reported (``NodeStatus.held_w``: counted against its domains at the most it may draw)."""
    stale = _gauge("capctl_agent_staleness_seconds", "Seconds since the node's agent last reported.", ["node"])
    up = _gauge("capctl_agent_up", "1 when the node's agent is connected and reporting within its lease.", ["node"])
    held = _gauge("capctl_node_held_watts", "Watts counted for a policy node whose agent never reported (the most "
                  "it may draw; absent for nodes whose GPUs are known).", ["node"])
    for n in st.nodes:
        if not n.never_reported and math.isfinite(n.last_report_age_s):  # (no report: no age; capctl_agent_up 0 says it)
            stale.add_metric([n.name], max(0.0, n.last_report_age_s))
        up.add_metric([n.name], 0.0 if n.stale else 1.0)
        if n.never_reported:
            held.add_metric([n.name], n.held_w)
    return (stale, up, held)


def _domain_families(st):
    """Per-domain limit, allocated, enforced and drawn watts, price (per W), deficit (W)."""
    g = _gauge
    lim = g("capctl_domain_limit_watts", "Power domain limit (W; absent when the domain has none).", ["domain", "kind"])
    dal = g("capctl_domain_allocated_watts", "Sum of allocated caps in the domain (W).", ["domain", "kind"])
    den = g("capctl_domain_enforced_watts", "Sum of accounted (possibly enforced) caps in the domain (W).", ["domain", "kind"])
    ddr = g("capctl_domain_draw_watts", "Sum of GPU power draw in the domain (W; absent when none of its GPUs has a "
            "live reading).", ["domain", "kind"])
    dpr = g("capctl_domain_price", "Marginal objective value of one more watt in the domain (per W).", ["domain", "kind"])
    dde = g("capctl_domain_deficit_watts", "Minimum caps minus the domain limit when positive (W).", ["domain", "kind"])
    for d in st.domains:
        lab = [d.name, d.kind]
        if d.limit_w > 0:
            lim.add_metric(lab, d.limit_w)
        dal.add_metric(lab, d.allocated_w)
        den.add_metric(lab, d.enforced_w)
        if math.isfinite(d.draw_w):  # (no live reading in it: unknown, not 0 W)
            ddr.add_metric(lab, d.draw_w)
        dpr.add_metric(lab, d.price_rate_per_w)
        dde.add_metric(lab, d.deficit_w)
    return (lim, dal, den, ddr, dpr, dde)


def _job_families(st, jobs=None):
    """Per-job predicted step rate (0..1), allocated watts, weight, energy (J) of ``jobs`` (default
    ``st.jobs``)."""
    rate = _gauge("capctl_job_predicted_step_rate", "Predicted synchronous step rate relative to uncapped (0..1).", ["job"])
    jal = _gauge("capctl_job_allocated_watts", "Sum of the job's allocated caps (W).", ["job"])
    jw = _gauge("capctl_job_weight", "Job weight from the policy.", ["job"])
    jen = CounterMetricFamily("capctl_job_energy_joules", "DEPRECATED (removed in 0.4): use capctl_job_gpu_energy_joules_total. "
                              "Energy used by the job's GPUs since the coordinator saw it start "
                              "(NVML energy counter deltas, J).", labels=["job"])
    for j in st.jobs if jobs is None else jobs:
        if math.isfinite(j.predicted_step_rate):  # NaN: no prediction (coordinator.observed.predicted_rate)
            rate.add_metric([j.job_id], j.predicted_step_rate)
        jal.add_metric([j.job_id], j.allocated_w)
        jw.add_metric([j.job_id], j.weight)
        jen.add_metric([j.job_id], j.energy_j)
    return (rate, jal, jw, jen)


def _job_energy_family(st, finished) -> CounterMetricFamily:
    """``capctl_job_gpu_energy_joules_total{job_id}``: the GPU energy (J) of every running job
    (from the GPUs' energy counters, coordinator/jobenergy.py) and of the jobs finished within
    :data:`FINISHED_EXPORT_S` (at most :data:`FINISHED_EXPORT_MAX`; ``finished``: (job id,
    energy J, end Unix s) newest first). Constant once the job ended; the series then expires."""
    import time

    fam = CounterMetricFamily("capctl_job_gpu_energy_joules", "GPU energy used by the job, from the GPUs' total-energy "
                              "counters read at job start, end and every report (J); finished jobs expire after "
                              f"{FINISHED_EXPORT_S:.0f} s.", labels=["job_id"])
    seen = set()
    for j in st.jobs:
        seen.add(j.job_id)
        fam.add_metric([j.job_id], j.energy_j)
    cutoff = time.time() - FINISHED_EXPORT_S
    n = 0
    for job_id, energy_j, end_s in finished:
        if n >= FINISHED_EXPORT_MAX or end_s < cutoff:
            break
        if job_id not in seen:
            seen.add(job_id)
            fam.add_metric([job_id], energy_j)
            n += 1
    return fam


def _observed_families(st, rows=None, stragglers: int | None = None):
    """Observed-state figures (issue 12): stragglers and GPUs held for bad limit constraints (1 per
    flagged GPU of ``rows``, as :func:`_gpu_families`, default every GPU of ``st``), the number of
    stragglers over every GPU, measured step rate per job (0..1, SM clock / max SM clock of its
    slowest GPU, through its memory-bound share: :func:`coordinator.membound.rate_of_clock`)."""
    if rows is None:
        from capctl.policy.model import MetricsPolicy
        from coordinator.opsmetrics import exported_gpus

        exp = exported_gpus(st, MetricsPolicy(per_gpu_series="all"))
        rows, stragglers = exp.rows, exp.stragglers
    strag = _gauge("capctl_gpu_straggler", "1 for a GPU whose pace does not respond to power (STRAGGLER).", GPU_LABELS)
    bad = _gauge("capctl_gpu_unsupported_constraints",
                 "1 for a GPU held at its limit because its limit constraints are unusable.", GPU_LABELS)
    rate = _gauge("capctl_job_measured_step_rate",
                  "Measured step rate of the job's slowest busy GPU: its SM clock / max SM clock, through its "
                  "memory-bound share when it has an estimate (0..1).", ["job"])
    n_strag = _gauge("capctl_stragglers", "GPUs flagged STRAGGLER (every GPU, whatever metrics.per_gpu_series).")
    n_strag.add_metric([], float(stragglers))
    oob = _gauge("capctl_gpu_oob_limited", "1 for a GPU held below its cap by another limiter (an out-of-band limit: "
                 "its agent reports OOB_LIMITED, or the coordinator keeps it within one it saw).", GPU_LABELS)
    for node, gs, state in rows:
        lab = [node, str(gs.index), gs.uuid]
        if "STRAGGLER" in gs.flags:
            strag.add_metric(lab, 1.0)
        if state == capstates.OOB_LIMITED or capstates.OOB_LIMITED in gs.flags:
            oob.add_metric(lab, 1.0)
        if state == capstates.UNSUPPORTED_CONSTRAINTS:
            bad.add_metric(lab, 1.0)
    for j in st.jobs:
        if j.measured_step_rate > 0:
            rate.add_metric([j.job_id], j.measured_step_rate)
    return (strag, n_strag, bad, rate, oob)


def _fleet_families(view):
    """Node temperature spread (degC) and estimated throughput lost to capping (0..1)."""
    spread = _gauge("capctl_node_temperature_spread_celsius",
                    "Max minus min over reporting nodes of the mean GPU temperature (degC).")
    spread.add_metric([], view.temp_spread_c)
    lost = _gauge("capctl_throughput_lost_ratio",
                  "Estimated throughput lost to capping: GPU-weighted mean over jobs of 1 - predicted step rate (0..1).")
    lost.add_metric([], view.throughput_lost)
    return (spread, lost)


class Metrics:
    """Counters and histograms of one coordinator plus the view collector, in a private registry."""

    def __init__(self, coord=None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.solve = Histogram("capctl_solve_duration_seconds", "Duration of one allocation solve (s).",
                               buckets=SOLVE_BUCKETS_S, registry=self.registry)
        self.ack = Histogram("capctl_plan_ack_duration_seconds", "Cap plan sent -> CapAck received (s).",
                             buckets=ACK_BUCKETS_S, registry=self.registry)
        self.control = Histogram("capctl_control_latency_seconds",
                                 "Telemetry received -> CapAck of the plan computed from it (s).",
                                 buckets=ACK_BUCKETS_S, registry=self.registry)
        self.plans = Counter("capctl_plans", "Cap plans sent, by phase.", ["phase"], registry=self.registry)
        from coordinator.opsmetrics import OpsMetrics

        self.ops = OpsMetrics(self.registry)  # build info, process metrics, error counters, cap states
        self._server = None
        if coord is not None:
            self.attach(coord)

    def attach(self, coord) -> None:
        """Export ``coord``'s views."""
        self.registry.register(ViewCollector(coord, self.ops.jobs))
        self.ops.attach(coord)

    def observe_solve(self, seconds: float) -> None:
        self.solve.observe(seconds)

    def observe_ack(self, rtt_s: float, control_s: float | None) -> None:
        self.ack.observe(rtt_s)
        if control_s is not None:
            self.control.observe(control_s)

    def plan_sent(self, phase: str) -> None:
        self.plans.labels(phase=phase).inc()

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter on ``host:port`` (port 0 = any); returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        """Stop the HTTP exporter (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
