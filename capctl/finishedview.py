"""A finished job (``capctl.v1.FinishedJob``) as the CLI and status views show it (JSON-ready dict)."""

from __future__ import annotations


def finished_dict(job) -> dict:
    """A ``FinishedJob`` message as a JSON-ready dict (J, W, GPU-seconds, Unix s)."""
    return {
        "job_id": job.job_id, "user": job.user, "partition": job.partition, "account": job.account,
        "nodes": list(job.nodes), "gpus": int(job.gpus), "start_time_s": job.start_time_s,
        "end_time_s": job.end_time_s, "energy_j": job.energy_j, "gpu_s": job.gpu_s,
        "mean_power_w": job.mean_power_w, "peak_power_w": job.peak_power_w, "capped_s": job.capped_s,
        "thermal_s": job.thermal_s, "resets": int(job.resets), "complete": bool(job.complete),
    }
