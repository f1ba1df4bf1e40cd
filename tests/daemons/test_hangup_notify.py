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
        (line,) = [x for x in log.splitlines() if "budget_w: -3 W" in x]  # one log line: what and why
        assert "ERROR" in line and "SIGHUP: " in line, line
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


def test_daemons_refuse_clear_text_on_a_network_address(tmp_path):
    """Secure by default: no TLS on a non-loopback TCP address is exit 1 with one line naming the flag
    and both ways out, before anything is bound or any GPU touched (192.0.2.1: TEST-NET-1, RFC 5737,
    never reached)."""
    import subprocess
    import sys

    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1600.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPCTL_", "NOTIFY_SOCKET"))}
    runs = {
        "--listen 192.0.2.1:7373": [sys.executable, "-m", "coordinator.daemon", "--policy", str(policy), "--listen",
                                    "192.0.2.1:7373", "--state-dir", str(tmp_path / "s"), "--admin-socket", "none",
                                    "--metrics-port", "-1"],
        "--coordinator 192.0.2.1:7373": [sys.executable, "-m", "nodeagent.daemon", "--node", "n1", "--coordinator",
                                         "192.0.2.1:7373", "--socket", str(tmp_path / "a.sock"), "--state-dir",
                                         str(tmp_path / "a")],
    }
    for flag, argv in runs.items():
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"{flag}: a network address needs TLS" in r.stderr and "--insecure" in r.stderr


def test_insecure_allows_clear_text_with_a_loud_warning(caplog):
    import logging

    from capctl.errors import UserInputError
    from capctl.security.plaintext import check_plaintext, is_local

    log = logging.getLogger("test.plaintext")
    for local in ("unix:/run/x.sock", "127.0.0.5:7373", "[::1]:7373", "localhost:7373"):
        assert is_local(local)
        check_plaintext(local, "--listen", tls=False, insecure=False, log=log)
    assert not is_local("10.1.2.3:7373") and not is_local("head01:7373") and not is_local("[::]:7373")
    with pytest.raises(UserInputError, match="--listen head01:7373: a network address needs TLS"):
        check_plaintext("head01:7373", "--listen", tls=False, insecure=False, log=log)
    check_plaintext("head01:7373", "--listen", tls=True, insecure=False, log=log)
    assert caplog.records == []
    with caplog.at_level(logging.WARNING):
        check_plaintext("head01:7373", "--listen", tls=False, insecure=True, log=log)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "INSECURE" in caplog.records[0].getMessage()
