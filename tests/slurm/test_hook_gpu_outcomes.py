"""What the hooks log about a GPU the agent could not read or may not write: the real hook programs
against a real agent on a simulated node (no cluster).

A stalled GPU was logged by the prolog with ``"cap_w": 0.0, "enforced_w": 0.0`` (unknown, not 0 W);
a GPU held for unusable limit constraints made the epilog say "could not be restored and will be
retried" although it is never written (found by a try-out).
"""

from __future__ import annotations

import time

import pytest

from tests.agent.test_agent_local import lone_agent
from tests.slurm.test_hooks_process import REPO, run_hook

pytestmark = pytest.mark.integration
# (PYTHONPATH=REPO: the hook runs this checkout's slurm.hooks, not the one the interpreter has installed)


@pytest.fixture
def agent(tmp_path):
    """(SimNode, AgentProc): 4 GPUs, pre-job limit 700 W, start cap 320 W, no coordinator."""
    yield from lone_agent(tmp_path, 4)


def test_the_prolog_logs_a_stalled_gpus_limits_as_unknown_not_0_w(agent, tmp_path):
    node, a = agent
    node.inject(2, "nvml_stall", 3.0)  # every NVML call on GPU 2 takes 3 s (the agent waits 0.5 s)
    proc, _, events = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="1,2", CAPCTL_AGENT_SOCKET=a.socket_path, PYTHONPATH=REPO)
    assert proc.returncode == 0, proc.stderr
    (ev,) = events
    gpus = {g["index"]: g for g in ev["gpus"]}
    assert gpus[1] == {"index": 1, "cap_w": 320.0, "enforced_w": 320.0, "ok": True}, gpus
    assert gpus[2]["cap_w"] is None and gpus[2]["enforced_w"] is None and not gpus[2]["ok"], gpus
    assert "has not returned" in gpus[2]["error"]
    assert '"cap_w": null, "enforced_w": null' in proc.stderr


def test_the_epilog_says_a_gpu_with_unusable_constraints_is_held_not_retried(agent, tmp_path):
    node, a = agent
    proc, _, _ = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="1,2", CAPCTL_AGENT_SOCKET=a.socket_path, PYTHONPATH=REPO)
    assert proc.returncode == 0, proc.stderr
    node.inject(2, "bad_constraints", 0.0, max_w=0.0)
    proc, _, events = run_hook("epilog", tmp_path, SLURM_JOB_GPUS="1,2", CAPCTL_AGENT_SOCKET=a.socket_path, PYTHONPATH=REPO)
    assert proc.returncode == 0, proc.stderr
    ev = events[-1]  # (the prolog's first: one log file)
    assert ev["hook"] == "epilog" and ev["outcome"] == "unbound", ev
    gpus = {g["index"]: g for g in ev["gpus"]}
    assert gpus[1]["ok"] and gpus[1]["cap_w"] == 700.0 and gpus[2]["cap_w"] == 320.0 and not gpus[2]["ok"], gpus
    assert ("GPU 2 held at 320 W: unsupported limit constraints (limit constraints read from the device: min 0 W, "
            "max 0 W; the minimum is below 1 W (a device never enforces 0 W)): never written, its pre-job limit "
            "700 W not restored by capctl while the device reports them") in proc.stderr, proc.stderr
    assert "could not be restored" not in proc.stderr and "will be retried" not in proc.stderr
    assert node.read(2)["limit_w"] == 320.0


def _wait_state(a, index: int, state: str, timeout_s: float = 15.0) -> None:
    """Wait until the agent reports GPU ``index`` in cap ``state`` (its LocalStatus)."""
    from capctl import capstates

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with a.client() as c:
            gpus = {g.index: g for g in c.local_status().gpus}
        if capstates.of(gpus[index]) == state:
            return
        time.sleep(0.1)
    pytest.fail(f"GPU {index} never reached {state}: {capstates.of(gpus[index])}")


def test_the_epilog_reports_a_foreign_writers_limit_and_lists_a_stalled_gpu(agent, tmp_path):
    """Job on GPUs 1, 2: GPU 2 stalls from the start (its start cap never written), another process
    sets GPU 1 to 650 W every 2 s (FOREIGN_WRITER). The epilog logged GPU 1 at capctl's own write
    and left GPU 2 out (a try-out: "GPU 1 at 537.478 W of 700 W" while the driver had 700 W)."""
    node, a = agent
    node.inject(2, "nvml_stall", 3.0)
    proc, _, _ = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="1,2", CAPCTL_AGENT_SOCKET=a.socket_path, PYTHONPATH=REPO)
    assert proc.returncode == 0, proc.stderr
    node.inject(1, "foreign_writer", 650.0, period_s=2.0)
    _wait_state(a, 1, "FOREIGN_WRITER")
    assert node.read(1)["limit_w"] == 650.0  # (re-written once at the first drift, then at most every 30 s)
    proc, _, events = run_hook("epilog", tmp_path, SLURM_JOB_GPUS="1,2", CAPCTL_AGENT_SOCKET=a.socket_path, PYTHONPATH=REPO)
    assert proc.returncode == 0, proc.stderr
    ev = events[-1]
    assert ev["hook"] == "epilog" and ev["outcome"] == "unbound", ev
    gpus = {g["index"]: g for g in ev["gpus"]}
    assert sorted(gpus) == [1, 2], ev["gpus"]
    assert (gpus[1]["cap_w"], gpus[1]["enforced_w"], gpus[1]["ok"]) == (650.0, 650.0, False), gpus
    assert "another process keeps setting the power limit (now 650.000 W" in gpus[1]["error"], gpus
    assert "GPU 1 held by another writer at 650 W (read before the restore)" in proc.stderr, proc.stderr
    assert (gpus[2]["cap_w"], gpus[2]["enforced_w"], gpus[2]["ok"]) == (None, None, False), gpus
    assert "has not returned" in gpus[2]["error"], gpus
    assert "GPU 2 in state STALLED, never written for this job (nothing to restore)" in proc.stderr, proc.stderr
    assert "restored 2 GPU(s)" not in proc.stderr
