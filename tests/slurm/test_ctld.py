"""Our EpilogSlurmctld (slurm/epilog_slurmctld, slurm.ctld) without a cluster: the AdminComment
word, another tool's comment kept, array task ids, and the program as slurmctld runs it (empty
environment): bounded and fail-open when the coordinator is unreachable, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from slurm.ctld import accounting_id, comment, merged

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def test_the_comment_word_and_merging_with_another_tools_comment():
    word = comment(NS(energy_j=1234.56, gpu_s=20.04, capped_s=3.0))
    assert word == "capctl:energy_j=1234.6,gpu_s=20.0,capped_s=3.0"
    assert merged("", word) == word
    assert merged("JS1:abc", word) == f"JS1:abc {word}"
    assert merged(f"JS1:abc capctl:energy_j=1.0,gpu_s=1.0,capped_s=0.0", word) == f"JS1:abc {word}"


def test_array_tasks_are_named_as_in_the_accounting_database():
    assert accounting_id({"SLURM_JOB_ID": "77"}) == "77"
    assert accounting_id({"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}) == "77_3"
    assert accounting_id({"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}) == "80"


def test_coordinator_unreachable_exits_0_soon(tmp_path):
    log = tmp_path / "hooks.log"
    env = {"SLURM_JOB_ID": "4242", "CAPCTL_HOOK_LOG": str(log), "CAPCTL_PYTHON": sys.executable,
           "CAPCTL_HOOKS_ENV": str(tmp_path / "none.env"), "CAPCTL_CTLD_TIMEOUT_S": "30",
           "CAPCTL_COORDINATOR": f"unix:{tmp_path / 'no-coordinator.sock'}"}
    t0 = time.monotonic()
    proc = subprocess.run([str(REPO / "slurm" / "epilog_slurmctld")], env=env, capture_output=True, text=True,
                          timeout=30, cwd="/")
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert elapsed < 6.0  # gives up after 3 s of an unreachable coordinator, well before the bound
    (ev,) = [json.loads(line[line.index("{"):]) for line in log.read_text().splitlines() if "{" in line]
    assert ev["outcome"] == "no-record" and ev["job_id"] == "4242" and ev["exit"] == 0 and ev["timeout_s"] == 30.0
    assert "no-coordinator.sock" in ev["coordinator_error"], ev
