"""The node agent's Prometheus endpoint (``capctl-agent --metrics-listen HOST:PORT``; off by default).

Families (names and units per the Prometheus conventions; docs/metrics.md):

- ``capctl_build_info``, ``process_*``, ``python_info`` (:mod:`capctl.capmetrics`);
- ``capctl_gpu_cap_state{node,gpu,uuid,state}`` (1 for the current state) — alert on
  ``SAFE_CAP``, ``RESTORE_FAILED``, ``SET_FAILED``;
- ``capctl_gpu_cap_watts`` / ``capctl_gpu_enforced_cap_watts`` / ``capctl_gpu_power_watts``
  (W) and ``capctl_gpu_energy_joules`` (J, NVML counter) of the last telemetry sample;
- ``capctl_agent_cap_write_failures_total{action}``: NVML cap writes that failed (set, restore...);
- ``capctl_agent_reconnects_total``: coordinator streams lost after a welcome;
- ``capctl_agent_coordinator_connected``: 1 while the link is up;
- ``capctl_policy_reloads_total{result}``: SIGHUP reloads (ok, error).

The collector reads the agent's state under its lock when scraped (no extra work per interval).
prometheus_client (part of ``capctl[agent]``) is imported only when the endpoint is on.
"""

from __future__ import annotations

import math

from capctl import capmetrics
from nodeagent import messages

GPU_LABELS = capmetrics.GPU_LABELS


class AgentMetrics:
    """Registry and HTTP server of one agent's metrics."""

    def __init__(self, agent) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.agent = agent
        self.registry = CollectorRegistry(auto_describe=False)
        capmetrics.register_process_metrics(self.registry)
        self.reloads = Counter("capctl_policy_reloads", "Policy reloads on SIGHUP, by result (ok, error).",
                               ["result"], registry=self.registry)
        for result in ("ok", "error"):
            self.reloads.labels(result=result)
        self.registry.register(_AgentCollector(agent))
        self._server = None

    def reloaded(self, result: str) -> None:
        """Count one SIGHUP reload with ``result`` "ok" or "error"."""
        self.reloads.labels(result=result).inc()

    def serve(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0 = any); returns the bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        """Stop the HTTP server (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _AgentCollector:
    def __init__(self, agent) -> None:
        self.agent = agent

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        a = self.agent
        with a.lock:
            samples = list(a.last_samples)
            states = dict(a.caps.states())
            uuids = {i: d.uuid for i, d in a.devices.items()}
            failed = dict(getattr(a.caps, "failed_writes", {}))
            safe_mode = set(a.safe_mode)
            link = a.link
        fams = {k: GaugeMetricFamily(n, h, labels=GPU_LABELS) for k, n, h in (
            ("cap", "capctl_gpu_cap_watts", "Requested power limit of the GPU (W)."),
            ("enf", "capctl_gpu_enforced_cap_watts", "Enforced power limit read back from NVML (W)."),
            ("pw", "capctl_gpu_power_watts", "GPU power draw, NVML power usage (W)."))}
        energy = CounterMetricFamily("capctl_gpu_energy_joules", "NVML total energy counter since driver load (J).",
                                     labels=GPU_LABELS)
        rows = []
        for s in samples:
            lab = [a.node, str(s.index), uuids.get(s.index, "")]
            # the state the report carries (LOST / STALLED / ERROR for a sample that could not be read)
            state = states.get(s.index, "")
            rows.append((a.node, s.index, lab[2], messages.telemetry_state(s, state, s.index in safe_mode) if state
                         else state))
            for key, value in (("cap", s.cap_w), ("enf", s.enforced_w), ("pw", s.power_w)):
                if not math.isnan(value):
                    fams[key].add_metric(lab, value)
            if not math.isnan(s.energy_j):
                energy.add_metric(lab, s.energy_j)
        yield capmetrics.cap_state_family(rows)
        yield from fams.values()
        yield energy
        writes = CounterMetricFamily("capctl_agent_cap_write_failures", "NVML cap writes that failed, by action.",
                                     labels=["action"])
        for action, n in sorted(failed.items()):
            writes.add_metric([action], n)
        yield writes
        yield CounterMetricFamily("capctl_agent_nvml_stalls", "NVML calls that did not return within the "
                                  "per-GPU timeout (nodeagent/callguard.py).",
                                  value=getattr(a.backend, "stalls", 0))
        connects = getattr(link, "connects", 0) if link is not None else 0
        yield CounterMetricFamily("capctl_agent_reconnects", "Coordinator streams lost after a welcome.",
                                  value=max(0, connects - 1))
        up = GaugeMetricFamily("capctl_agent_coordinator_connected", "1 while the link to the coordinator is up.")
        up.add_metric([], 1.0 if link is not None and link.connected else 0.0)
        yield up
