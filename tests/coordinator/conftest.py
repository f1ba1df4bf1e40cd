"""Fixtures for coordinator tests: a real ``capctl-coordinator`` process on loopback / unix sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capctl import lifeline
from tests.conftest import require
from tests.support.waiting import wait_for  # noqa: F401 (re-exported to the tests)

REPO = Path(__file__).resolve().parents[2]


def write_policy(path: Path, *, nodes: list[str], budget_w: float, interval_s: float = 0.25, lease_s: float = 2.0,
                 gpus_per_node: int = 4, idle_cap_w: float | None = 200.0, pdus: dict[str, tuple[list[str], float]] | None = None,
                 extra: str = "") -> Path:
    """Write a valid policy: one cluster domain, optionally PDUs {name: (nodes, limit_w)}."""
    idle = "null" if idle_cap_w is None else f"{idle_cap_w:g}"
    lines = [
        "version: 1",
        f"budget_w: {budget_w:g}",
        f"interval_s: {interval_s:g}",
        "objective: proportional",
        "thermal: {margin_c: 5}",
        f"idle_cap_w: {idle}",
        "start_cap_w: 300",
        f"failsafe: {{lease_s: {lease_s:g}, safe_cap_w: null}}",
        extra,
        "domains:",
        "  name: cluster",
        "  kind: cluster",
        "  gpu_model: H100-SXM",
        f"  gpus_per_node: {gpus_per_node}",
    ]
    if pdus:
        lines.append("  children:")
        for name, (pnodes, limit) in pdus.items():
            lines.append(f"    - {{name: {name}, kind: pdu, limit_w: {limit:g}, nodes: \"{','.join(pnodes)}\"}}")
        rest = [n for n in nodes if not any(n in p[0] for p in pdus.values())]
        if rest:
            lines.append(f"  nodes: \"{','.join(rest)}\"")
    else:
        lines.append(f"  nodes: \"{','.join(nodes)}\"")
    path.write_text("\n".join(lines) + "\n")
    return path


class Coordinator:
    """A running coordinator process (``coordinator.daemon``) and its addresses."""

    def __init__(self, workdir: Path, policy: Path, *, listen: str = "127.0.0.1:0", dry_run: bool = False,
                 state_dir: Path | None = None, extra: list[str] | None = None) -> None:
        self.workdir = workdir
        self.policy = policy
        self.state_dir = state_dir or workdir / "state"
        self.ready_file = workdir / f"ready-{time.monotonic_ns()}.json"
        self.admin_socket = workdir / "admin.sock"
        self.log_path = workdir / f"coordinator-{time.monotonic_ns()}.log"
        argv = [sys.executable, "-m", "coordinator.daemon", "--policy", str(policy), "--listen", listen,
                "--state-dir", str(self.state_dir), "--admin-socket", str(self.admin_socket), "--metrics-port", "0",
                "--ready-file", str(self.ready_file), "--log-level", "INFO"]
        if dry_run:
            argv.append("--dry-run")
        argv += extra or []
        self._log = open(self.log_path, "wb")
        self.proc = lifeline.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 30
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"coordinator exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"coordinator not ready within 30 s:\n{self.log()}")
            time.sleep(0.05)
        self.ready_mono = time.monotonic()
        self.info = json.loads(self.ready_file.read_text())
        self.address = self.info["listen"]
        self.admin_address = f"unix:{self.admin_socket}"
        self.metrics_port = self.info["metrics_port"]

    def client(self, admin: bool = True, **kw):
        from coordinator.client import AdminClient

        return AdminClient(self.admin_address if admin else self.address, **kw)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode



def one_node_cluster(tmp_path, **kw):
    """A :class:`tests.support.processes.Cluster` of one simulated node n1 with 4 GPUs, interval 0.5 s,
    lease 3 s (real coordinator and agent); ``kw`` as ``Cluster`` takes them."""
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    return Cluster(tmp_path, {"n1": 4}, interval_s=0.5, lease_s=3.0, **kw)


def gpus_by_index(status) -> dict:
    """GPU index -> ``GpuStatus`` of a one-node ``StatusReply``."""
    return {g.index: g for n in status.nodes for g in n.gpus}

@pytest.fixture
def start_coordinator(tmp_path):
    """Factory: ``start_coordinator(policy_path, **kw) -> Coordinator``; every one is stopped at the end."""
    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    started: list[Coordinator] = []

    def start(policy: Path, **kw) -> Coordinator:
        c = Coordinator(tmp_path, policy, **kw)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


@pytest.fixture
def agents():
    """List to put FakeAgents in; all are stopped at the end."""
    out = []
    yield out
    for a in out:
        a.stop()


def importlib_ok() -> bool:
    try:
        from capctl.v1 import capctl_pb2, capctl_pb2_grpc  # noqa: F401
    except ImportError:
        return False
    return True


