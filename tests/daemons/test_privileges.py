"""Privileges as the units bound them. The coordinator needs none (its unit runs it as a dynamic
user with an empty capability bounding set): started as ``nobody`` with no capabilities at all
(util-linux ``setpriv``), it serves, tells systemd it is ready, reloads on SIGHUP and stops cleanly;
root's ``capctl`` reaches its admin socket. The agent needs only CAP_SYS_ADMIN and CAP_CHOWN."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from capctl import lifeline
from tests.conftest import require
from tests.support.processes import require_coordinator, wait_until, write_policy

pytestmark = pytest.mark.integration

NOBODY = 65534


def _status_line(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def test_coordinator_runs_as_nobody_without_capabilities():
    require_coordinator()
    require(os.geteuid() == 0 and shutil.which("setpriv") is not None, "root and setpriv (util-linux)")
    work = Path(tempfile.mkdtemp(prefix="capctl-unpriv-", dir="/tmp"))
    proc = None
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        os.chmod(work, 0o755)
        policy = write_policy(work / "policy.yaml", nodes=["n1"], budget_w=1600.0)
        os.chmod(policy, 0o644)
        state = work / "state"
        state.mkdir()
        os.chown(state, NOBODY, NOBODY)
        run = work / "run"
        run.mkdir()
        os.chown(run, NOBODY, NOBODY)
        notify.bind(str(work / "notify.sock"))
        os.chmod(work / "notify.sock", 0o777)
        notify.settimeout(30.0)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPCTL_")}
        env["NOTIFY_SOCKET"] = str(work / "notify.sock")
        argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", sys.executable, "-m", "coordinator.daemon",
                "--policy", str(policy), "--listen", f"unix:{run}/coordinator.sock", "--state-dir", str(state),
                "--admin-socket", str(run / "admin.sock"), "--metrics-port", "-1"]
        proc = lifeline.Popen(argv, cwd=str(work), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert notify.recv(4096).decode().startswith("READY=1")
        assert _status_line(proc.pid, "Uid").split()[1] == str(NOBODY)  # effective uid
        assert int(_status_line(proc.pid, "CapEff"), 16) == 0 and int(_status_line(proc.pid, "CapBnd"), 16) == 0
        assert (state / "coordinator.db").stat().st_uid == NOBODY
        assert (run / "admin.sock").stat().st_mode & 0o777 == 0o600

        cli = [sys.executable, "-m", "capctl.cli.main", "--coordinator", f"unix:{run}/admin.sock", "--json", "status"]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and '"budget_w": 1600' in out.stdout, out.stderr
        write_policy(policy, nodes=["n1"], budget_w=1500.0)
        os.kill(proc.pid, signal.SIGHUP)
        wait_until(lambda: '"budget_w": 1500' in subprocess.run(cli, capture_output=True, text=True, timeout=30).stdout,
                   15.0, 0.1, "budget 1500 W after SIGHUP")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not (run / "admin.sock").exists()  # removed on a clean stop
    finally:
        notify.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


CAP_CHOWN, CAP_SYS_ADMIN = 0, 21
"""Linux capability numbers (linux/capability.h)."""


def test_agent_works_with_only_the_capabilities_its_unit_allows(tmp_path):
    """The agent unit's CapabilityBoundingSet=CAP_SYS_ADMIN CAP_CHOWN: with exactly those (root, every
    other capability dropped) it boots, serves the hooks' socket and applies a job's start cap."""
    from tests.support.processes import sim_node

    require(os.geteuid() == 0 and shutil.which("setpriv") is not None, "root and setpriv (util-linux)")
    node = sim_node(tmp_path / "sim", 2)
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1400.0, start_cap_w=280.0, gpus_per_node=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPCTL_")}
    env.update(node.env())
    sock = tmp_path / "agent.sock"
    argv = ["setpriv", "--bounding-set=-all,+sys_admin,+chown", "--inh-caps=-all", "--no-new-privs",
            sys.executable, "-m", "nodeagent.daemon", "--node", "n1", "--coordinator", f"unix:{tmp_path}/none.sock",
            "--socket", str(sock), "--state-dir", str(tmp_path / "state"), "--nvml-library", "simulated",
            "--policy", str(policy)]
    log = open(tmp_path / "agent.log", "wb")
    proc = lifeline.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        from capctl.agentclient import LocalClient
        from capctl.errors import CapctlError

        def ready():
            try:
                with LocalClient(str(sock), timeout_s=1.0) as c:
                    return c.local_status().ready
            except CapctlError:
                return False

        wait_until(ready, 30.0, 0.1, "agent ready")
        assert int(_status_line(proc.pid, "CapBnd"), 16) == (1 << CAP_SYS_ADMIN) | (1 << CAP_CHOWN)
        with LocalClient(str(sock), timeout_s=5.0) as c:
            c.job_start("5", ["1"])
        assert abs(node.read(1)["limit_w"] - 280.0) < 1e-6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        node.close()
