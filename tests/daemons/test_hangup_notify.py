"""Daemon conventions with real processes: ``kill -HUP`` reloads the policy (the last good one stays on
error, the daemon keeps running) and systemd's notify protocol (READY=1, RELOADING=1 + MONOTONIC_USEC,
READY=1, STOPPING=1) arrives on a real ``$NOTIFY_SOCKET`` datagram socket, as systemd would read it."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from tests.support.processes import (ProcessGroup, require_coordinator, sim_node, start_agent, start_coordinator,
                                     wait_until, write_policy)

pytestmark = pytest.mark.integration


@pytest.fixture()
def notify_socket(tmp_path, monkeypatch):
    """A unix datagram socket bound where ``$NOTIFY_SOCKET`` (set for the children) points."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30.0)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


def next_message(sock) -> dict[str, str]:
    """The next datagram as {KEY: VALUE}."""
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines())


def test_coordinator_sighup_reloads_keeps_the_last_good_policy_and_notifies(tmp_path, notify_socket):
    require_coordinator()
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1600.0)
    with ProcessGroup() as group:
        coord = group.add(start_coordinator(tmp_path, policy, metrics_port=-1))
        assert next_message(notify_socket)["READY"] == "1"
        coord.wait_serving(30.0)
        assert coord.status().budget_w == 1600.0

        write_policy(policy, nodes=["n1"], budget_w=2000.0)
        os.kill(coord.popen.pid, signal.SIGHUP)
        msg = next_message(notify_socket)
        assert msg["RELOADING"] == "1" and int(msg["MONOTONIC_USEC"]) > 0
        assert next_message(notify_socket)["READY"] == "1"
        wait_until(lambda: coord.status().budget_w == 2000.0, 10.0, 0.05, "budget 2000 W after SIGHUP", proc=coord)

        policy.write_text("version: 1\nbudget_w: -3\n")
        os.kill(coord.popen.pid, signal.SIGHUP)
        assert next_message(notify_socket)["RELOADING"] == "1"
        assert "FAILED" in next_message(notify_socket)["STATUS"]
        assert coord.popen.poll() is None and coord.status().budget_w == 2000.0
        log = coord.log_path.read_text()
        assert f"{policy}:2:11: budget_w: -3 W is not allowed" in log and "the policy from" in log
        assert coord.stop() == 0
        assert next_message(notify_socket)["STOPPING"] == "1"


def test_agent_sighup_reloads_its_policy_and_notifies(tmp_path, notify_socket):
    node = sim_node(tmp_path / "sim", 2)
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1600.0, start_cap_w=300.0)
    with ProcessGroup() as group:
        agent = group.add(start_agent(tmp_path, "n1", f"unix:{tmp_path}/no-coordinator.sock", sim_env=node.env(),
                                      policy=policy, reconnect_max_s=1.0))
        assert next_message(notify_socket)["READY"] == "1"
        agent.wait_ready(30.0)
        write_policy(policy, nodes=["n1"], budget_w=1600.0, start_cap_w=250.0)
        os.kill(agent.popen.pid, signal.SIGHUP)
        assert next_message(notify_socket)["RELOADING"] == "1"
        assert next_message(notify_socket)["READY"] == "1"
        wait_until(lambda: "start cap 250 W" in agent.log_path.read_text(), 10.0, 0.05, "reload logged", proc=agent)
        agent.client().job_start("7", ["0"])
        assert abs(node.read(0)["limit_w"] - 250.0) < 1e-6  # the start cap of the reloaded policy

        policy.write_text("version: 1\nstart_cap_w: [\n")
        os.kill(agent.popen.pid, signal.SIGHUP)
        assert next_message(notify_socket)["RELOADING"] == "1"
        assert "FAILED" in next_message(notify_socket)["STATUS"]
        wait_until(lambda: "rejected; the last good policy stays" in agent.log_path.read_text(), 10.0, 0.05,
                   "rejection logged", proc=agent)
        assert agent.popen.poll() is None and agent.status().ready
    node.close()
