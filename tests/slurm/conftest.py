"""Session-scoped real Slurm cluster for the ``slurm`` tests (see tests/slurmcluster).

One slurmctld, three ``slurmd -N n1..n3`` (8 fake GPUs each), munge, MariaDB + slurmdbd, and — when the capctl daemons
are available — simulated GPU nodes, a coordinator, one agent per node and our prolog/epilog.
Slurm is installed by ``make test`` (tests/slurmcluster/install.sh); the fixture installs it too
when running as root. Missing parts skip locally and FAIL under CI=true (tests.conftest.require).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require
from tests.slurmcluster import SlurmCluster, slurm_installed

INSTALL = Path(__file__).resolve().parents[1] / "slurmcluster" / "install.sh"


def capctl_parts_missing() -> list[str]:
    """Names of the capctl pieces the full cluster needs that are not available."""
    from capctl.simgpu.build import library_path

    missing = []
    if not Path(library_path()).is_file():
        missing.append(f"simulated NVML driver {library_path()} (make build)")
    for mod in ("capctl.simgpu.node", "coordinator.daemon", "nodeagent.daemon",
                "nodeagent.local", "capctl.v1.capctl_pb2_grpc"):
        if importlib.util.find_spec(mod) is None:
            missing.append(mod)
    return missing


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The running test cluster (:class:`tests.slurmcluster.SlurmCluster`), shared by the session."""
    from tests.slurmcluster import accounting
    from tests.slurmcluster.cluster import which

    if not (slurm_installed() and accounting.installed(which)) and os.geteuid() == 0:
        subprocess.run(["bash", str(INSTALL)], check=False, timeout=600)
    require(slurm_installed(), "Slurm/munge not installed (make slurm-deps)")
    require(os.geteuid() == 0, "the test Slurm cluster needs root")
    missing = capctl_parts_missing()
    # accounting (MariaDB + slurmdbd: sacct, our EpilogSlurmctld) when installed (make slurm-deps)
    cluster = SlurmCluster(run_dir=tmp_path_factory.mktemp("slurm"), capctl=not missing,
                           accounting=accounting.installed(which))
    cluster.missing = missing
    try:
        cluster.up()
        yield cluster
    finally:
        try:
            _HOOK_SUMMARY.extend(hook_duration_summary(cluster))
        finally:
            cluster.down()


_HOOK_SUMMARY: list[str] = []


def hook_duration_summary(cluster: SlurmCluster) -> list[str]:
    """Lines "prolog: n=.. median=.. max=.." over every hook run of the session (from the hook log)."""
    import statistics

    evs = [e for e in cluster.hook_events() if e.get("outcome") != "begin" and "duration_s" in e]
    lines = []
    for hook in ("prolog", "epilog"):
        d = [float(e["duration_s"]) for e in evs if e.get("hook") == hook]
        if d:
            lines.append(f"{hook}: {len(d)} runs, median {statistics.median(d):.3f} s, max {max(d):.3f} s "
                         f"(bound {cluster.hook_timeout_s:g} s)")
    return lines


def pytest_terminal_summary(terminalreporter):
    if _HOOK_SUMMARY:
        terminalreporter.write_sep("-", "capctl Slurm hook durations on the test cluster")
        for line in _HOOK_SUMMARY:
            terminalreporter.write_line(line)


@pytest.fixture()
def capctl_cluster(slurm_cluster):
    """The test cluster with capctl agents, coordinator and hooks; every node idle and every daemon
    up before the test (tests may stop daemons; this puts them back)."""
    require(slurm_cluster.capctl, f"capctl parts missing: {', '.join(slurm_cluster.missing)}")
    restore(slurm_cluster)
    yield slurm_cluster
    restore(slurm_cluster)


def restore(cluster: SlurmCluster) -> None:
    """Restart any stopped capctl daemon and wait for idle nodes (after a test that broke things)."""
    import time

    from tests.slurmcluster import procs

    cluster.run(["scancel", "--quiet", "-u", "root"], check=False)  # jobs a failed test left behind
    deadline = time.monotonic() + 20.0
    while cluster.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not procs.running(cluster.run_dir, "coordinator"):
        cluster.start_coordinator()
    for node in cluster.nodes:
        if not procs.running(cluster.run_dir, f"agent-{node}"):
            cluster.start_agent(node)
    # a restarted coordinator: the agents that kept running reconnect on their own backoff (up to
    # --reconnect-max-s, then hello/welcome); a prolog before that sees coordinator_connected False
    # (measured: all 3 agents not yet connected when the daemons were back, connected 0.25-0.57 s
    # later on an idle host, longer under load)
    from tests.support.waiting import wait_for

    wait_for(lambda: all(getattr(cluster.agent_status(n, 1.0), "coordinator_connected", False) for n in cluster.nodes),
             30.0, "every agent connected to the coordinator again")
    for node in cluster.nodes:
        st = cluster.node_info(node).get("State", "")
        if "DRAIN" in st:
            cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
    cluster.wait_nodes_idle()
