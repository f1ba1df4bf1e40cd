"""Under ``make test`` the Slurm cluster runs capctl as installed from the wheel (tests/slurmcluster/
installed.py): the agents from the ``capctl[agent]`` venv (which holds no solver stack), the
coordinator from the ``capctl[coordinator]`` venv, and slurm.conf's Prolog=/Epilog= are hooks written
by that agent venv's ``capctl install hooks``. Locally without the venvs this skips; under CI it fails."""

from __future__ import annotations

import pytest

from tests.conftest import require
from tests.slurmcluster import installed, procs

pytestmark = pytest.mark.slurm


def _interpreter(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode()


def test_the_cluster_runs_the_installed_daemons_and_hooks(capctl_cluster):
    c = capctl_cluster
    agent_env, coord_env = installed.venv(installed.AGENT_VENV), installed.venv(installed.COORDINATOR_VENV)
    require(agent_env is not None and coord_env is not None,
            f"${installed.AGENT_VENV} / ${installed.COORDINATOR_VENV} not set (make test sets them)")
    recorded = procs.recorded(c.run_dir)
    for node in c.nodes:
        rec = recorded[f"agent-{node}"]
        assert rec["argv"][0] == str(agent_env / "bin" / "capctl-agent")
        assert _interpreter(rec["pid"]).startswith(str(agent_env / "bin" / "python"))
    rec = recorded["coordinator"]
    assert rec["argv"][0] == str(coord_env / "bin" / "capctl-coordinator")
    assert _interpreter(rec["pid"]).startswith(str(coord_env / "bin" / "python"))
    conf = c.conf_path.read_text()
    assert f"Prolog={c.run_dir}/hooks/prolog" in conf and f"Epilog={c.run_dir}/hooks/epilog" in conf
    assert f"CAPCTL_PYTHON={agent_env}/bin/python" in (c.run_dir / "etc" / "capctl-hooks.env").read_text()
    out = c.run(["srun", "-N1", "-w", "n1", "--gres=gpu:1", "true"])
    assert out.returncode == 0
    bound = [e for e in c.hook_events() if e.get("hook") == "prolog" and e.get("outcome") == "bound"]
    assert bound, "the installed prolog bound the job's GPU"
