"""The test Slurm cluster itself: three real slurmd answer a real multi-node srun."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slurm


def test_srun_three_nodes(slurm_cluster):
    out = slurm_cluster.run(["srun", "-N3", "--ntasks-per-node=1", "sh", "-c", "echo $SLURMD_NODENAME"]).stdout
    assert sorted(out.split()) == ["n1", "n2", "n3"]


def test_nodes_offer_eight_fake_gpus(slurm_cluster):
    slurm_cluster.wait_nodes_idle()  # the previous job's epilog may still run (COMPLETING)
    for node in slurm_cluster.nodes:
        info = slurm_cluster.node_info(node)
        assert info["Gres"] == "gpu:8", info
        assert info["State"] == "IDLE", info
    out = slurm_cluster.run(["srun", "-N1", "-w", "n2", "--gres=gpu:3", "sh", "-c",
                             "echo $CUDA_VISIBLE_DEVICES"]).stdout.strip()
    assert out == "0,1,2"
