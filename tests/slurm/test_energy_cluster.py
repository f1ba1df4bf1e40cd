"""Per-job GPU energy in Slurm's accounting: a real sbatch job with an srun step on the test cluster
(slurmctld + slurmdbd on MariaDB, real agents on simulated GPUs, a real coordinator); our
EpilogSlurmctld writes ``capctl:energy_j=...,gpu_s=...,capped_s=...`` into the job's AdminComment
and ``sacct -j JOB -o AdminComment`` shows it (issue 13)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import require
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slurm

COMMENT = re.compile(r"capctl:energy_j=([0-9.]+),gpu_s=([0-9.]+),capped_s=([0-9.]+)")


def _energy_j(cluster, node: str, indices) -> float:
    sim = cluster.sim_node(node)
    try:
        return sum(float(sim.read(i)["energy_j"]) for i in indices)
    finally:
        sim.close()


def test_a_jobs_gpu_energy_shows_in_sacct(capctl_cluster):
    c = capctl_cluster
    require(c.accounting, "slurmdbd/mariadb-server not installed (make slurm-deps)")
    sim = c.sim_node("n2")
    try:
        for i in range(8):
            sim.set_load(i, 450.0)  # busy GPUs: the job's share is well above idle draw
    finally:
        sim.close()
    try:
        before_j = _energy_j(c, "n2", range(8))
        job = c.sbatch("-w", "n2", "--gres=gpu:2", "--time=2", script="#!/bin/sh\nsrun sleep 2\n")
        info = c.wait_job(job, timeout_s=60)
        assert info["JobState"] == "COMPLETED", info

        def sacct_comment():
            out = c.run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "AdminComment"], check=False).stdout
            return COMMENT.search(out)

        m = wait_for(sacct_comment, 40, f"sacct AdminComment of job {job}")
        after_j = _energy_j(c, "n2", range(8))
    finally:
        sim = c.sim_node("n2")
        try:
            for i in range(8):
                sim.set_load(i, 0.0)
        finally:
            sim.close()
    energy_j, gpu_s, capped_s = (float(x) for x in m.groups())
    from coordinator.client import AdminClient

    with AdminClient(c.coordinator_address) as admin:
        (rec,) = admin.finished_jobs(job_id=job)
    # the comment is the coordinator's finished record, rounded to 0.1
    assert rec.gpus == 2 and list(rec.nodes) == ["n2"]
    assert energy_j == pytest.approx(rec.energy_j, abs=0.06)
    assert gpu_s == pytest.approx(rec.gpu_s, abs=0.06) and capped_s == pytest.approx(rec.capped_s, abs=0.06)
    # 2 of the node's 8 GPUs, bound for at least the 2 s step: a quarter of the node's energy at
    # most, and at least 2 GPU x 2 s at the start cap's lowest power (the device minimum 200 W)
    assert 2 * 2.0 <= gpu_s <= 2 * (rec.end_time_s - rec.start_time_s) + 0.1
    assert 2 * 2.0 * 200.0 <= energy_j <= (after_j - before_j) / 4 + 1.0
    assert rec.peak_power_w >= rec.mean_power_w > 0
    ctld = [e for e in c.hook_events() if e.get("hook") == "epilog_slurmctld" and e.get("job_id") == job]
    assert ctld and ctld[-1]["outcome"] == "commented" and ctld[-1]["exit"] == 0, ctld
