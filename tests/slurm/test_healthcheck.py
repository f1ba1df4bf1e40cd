"""slurm/healthcheck against the real test cluster: healthy while the agent is ready; with
--drain, an agent that is down drains the node with a ``capctl:`` reason, and the check lifts only
its own drain once the agent is back."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.waiting import wait_for

pytestmark = pytest.mark.slurm


def run_check(c, node: str, *args: str) -> subprocess.CompletedProcess:
    env = c.env()
    env["SLURMD_NODENAME"] = node
    env.pop("PATH", None)  # slurmd gives HealthCheckProgram no PATH; the wrapper sets its own
    return subprocess.run([c.hook_script("healthcheck"), *args], env=env, capture_output=True, text=True, timeout=20)


def test_healthcheck_drains_only_while_the_agent_is_down_and_lifts_its_own_drain(capctl_cluster):
    c = capctl_cluster
    ok = run_check(c, "n3", "--drain")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "capctl health n3: ok: agent on n3 ready" in ok.stdout
    c.stop_agent("n3")
    try:
        bad = run_check(c, "n3", "--drain")
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert "UNHEALTHY: agent not reachable" in bad.stdout and "node n3 drained" in bad.stdout, bad.stdout
        info = wait_for(lambda: (lambda i: i if "DRAIN" in i["State"] else None)(c.node_info("n3")), 10,
                        "n3 drained by the health check")
        assert info["Reason"].startswith("capctl:"), info
        # without --drain the check only reports
        assert run_check(c, "n2").returncode == 0
    finally:
        c.start_agent("n3")
    back = run_check(c, "n3", "--drain")
    assert back.returncode == 0 and "node n3 resumed" in back.stdout, back.stdout + back.stderr
    wait_for(lambda: "DRAIN" not in c.node_info("n3")["State"], 10, "n3 resumed")
    # a drain set by someone else is never lifted by the check
    c.run(["scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=maintenance"])
    try:
        again = run_check(c, "n3", "--drain")
        assert again.returncode == 0 and "resumed" not in again.stdout, again.stdout
        assert "DRAIN" in c.node_info("n3")["State"] and c.node_info("n3")["Reason"].startswith("maintenance")
    finally:
        c.run(["scontrol", "update", "NodeName=n3", "State=RESUME"], check=False)
