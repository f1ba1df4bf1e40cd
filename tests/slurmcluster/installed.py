"""Where the test cluster takes capctl's programs from: the source tree, or installed wheels.

``make test`` builds the wheel from a clean clone and installs ``capctl[agent]`` and
``capctl[coordinator]`` into two fresh virtual environments (``tests/release/wheelenvs.sh``); it
names them in these variables, and the cluster then runs the daemons, the hooks and the CLI from
those installations (console scripts ``capctl-agent``/``capctl-coordinator``, hooks written by
``capctl install hooks DIR``), never from the source tree:

=============================  =============================================================
``CAPCTL_TEST_AGENT_VENV``     venv with ``capctl[agent]``: capctl-agent, the Slurm hooks
``CAPCTL_TEST_COORDINATOR_VENV``  venv with ``capctl[coordinator]``: capctl-coordinator, capctl
=============================  =============================================================

Unset (a developer's ``pytest tests/slurm``): the source tree's modules through ``sys.executable``.
The test harness itself (Slurm, simulated GPU nodes, the clients in the tests) always runs from the
source tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

AGENT_VENV = "CAPCTL_TEST_AGENT_VENV"
COORDINATOR_VENV = "CAPCTL_TEST_COORDINATOR_VENV"
REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT_MAIN = "import sys; from nodeagent.daemon import main; sys.exit(main())"
COORDINATOR_MAIN = "import sys; from coordinator.daemon import main; sys.exit(main())"


def venv(var: str) -> Path | None:
    """The virtual environment named by ``var`` (:data:`AGENT_VENV` / :data:`COORDINATOR_VENV`), or None.

    Raises:
        RuntimeError: the variable names a directory without ``bin/python``.
    """
    value = os.environ.get(var)
    if not value:
        return None
    path = Path(value)
    if not (path / "bin" / "python").exists():
        raise RuntimeError(f"${var}={value}: no bin/python there (tests/release/wheelenvs.sh makes it)")
    return path


def agent_argv() -> list[str]:
    """Command that starts ``capctl-agent`` (arguments follow)."""
    env = venv(AGENT_VENV)
    return [str(env / "bin" / "capctl-agent")] if env else [sys.executable, "-c", AGENT_MAIN]


def coordinator_argv() -> list[str]:
    """Command that starts ``capctl-coordinator`` (arguments follow)."""
    env = venv(COORDINATOR_VENV)
    return [str(env / "bin" / "capctl-coordinator")] if env else [sys.executable, "-c", COORDINATOR_MAIN]


def hook_python() -> str:
    """Interpreter the Slurm hooks run ``slurm.hooks`` with (``CAPCTL_PYTHON``)."""
    env = venv(AGENT_VENV)
    return str(env / "bin" / "python") if env else sys.executable


def cli_bin_dir() -> str:
    """Directory whose ``capctl`` the tests run (first on their PATH)."""
    env = venv(COORDINATOR_VENV)
    return str(env / "bin") if env else str(Path(sys.executable).parent)


def install_hooks(dest: Path) -> dict[str, str]:
    """The Slurm hook scripts: ``{"prolog": path, "epilog": path, "healthcheck": path,
    "epilog_slurmctld": path}``.

    Installed mode: written into ``dest`` by the agent venv's ``capctl install hooks DEST``. Source
    mode: the source tree's ``slurm/`` scripts.

    Raises:
        subprocess.CalledProcessError: ``capctl install hooks`` failed.
    """
    env = venv(AGENT_VENV)
    names = ("prolog", "epilog", "healthcheck", "epilog_slurmctld")
    if env is None:
        return {n: str(REPO_ROOT / "slurm" / n) for n in names}
    subprocess.run([str(env / "bin" / "capctl"), "install", "hooks", str(dest)], check=True,
                   capture_output=True, text=True, timeout=60, cwd="/")
    return {n: str(dest / n) for n in names}
