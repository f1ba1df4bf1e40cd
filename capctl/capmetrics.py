"""Prometheus families every capctl daemon exports (coordinator and agent), in one place.

- ``capctl_build_info{version, python}`` = 1 (the one version, :data:`capctl.__version__`);
- ``process_*`` (CPU seconds, resident memory, open fds, start time) and ``python_info``, by
  prometheus_client's process and platform collectors;
- ``capctl_gpu_cap_state{node, gpu, uuid, state}``: 1 for the GPU's current cap state, 0 for every
  other state of :mod:`capctl.capstates` (one series per state, so ``== 1`` alerts on ``SAFE_CAP``
  or ``RESTORE_FAILED`` work without regexes).

Names follow the Prometheus conventions (docs/metrics.md).
"""

from __future__ import annotations

import platform

from capctl import __version__, capstates

GPU_LABELS = ["node", "gpu", "uuid"]

CAP_STATES = (capstates.OK, capstates.SAFE_CAP, capstates.OOB_LIMITED, capstates.FOREIGN_WRITER,
              capstates.RESTORE_FAILED, capstates.LOST, capstates.SET_FAILED, capstates.ERROR,
              capstates.UNCONFIRMED, capstates.NO_READING, capstates.STALLED, capstates.UNSUPPORTED_CONSTRAINTS)
"""Every cap state exported as a ``state`` label value (UNSUPPORTED_CONSTRAINTS was missing: a series
only for the GPU in it, and none in ``capctl_gpus_by_cap_state`` until one was; found by a review)."""


def register_process_metrics(registry) -> None:
    """Add ``capctl_build_info``, ``process_*`` and ``python_info`` to ``registry``."""
    from prometheus_client import Info, PlatformCollector, ProcessCollector

    info = Info("capctl_build", "capctl version and Python of this process.", registry=registry)
    info.info({"version": __version__, "python": platform.python_version()})
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)


def cap_state_family(rows):
    """``capctl_gpu_cap_state`` from ``rows`` of (node, gpu index, uuid, cap state name) ("" = no state
    reported: every series 0)."""
    from prometheus_client.core import GaugeMetricFamily

    fam = GaugeMetricFamily("capctl_gpu_cap_state", "1 for the GPU's current cap state (label state), else 0.",
                            labels=[*GPU_LABELS, "state"])
    for node, index, uuid, state in rows:
        for s in CAP_STATES:
            fam.add_metric([node, str(index), uuid, s], 1.0 if s == state else 0.0)
        if state and state not in CAP_STATES:
            fam.add_metric([node, str(index), uuid, state], 1.0)
    return fam
