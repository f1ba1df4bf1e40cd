"""The node agent's local socket (Slurm hooks -> agent) against a real unprivileged user.

An ordinary user on a node must not bind jobs or change caps: the socket is created 0600 (root
only), and even when its mode is loosened the agent's SO_PEERCRED check refuses the caller. The
client runs as the real account ``capctltest`` (created if missing) via ``runuser``.
"""

from __future__ import annotations

import os
import threading

import pytest

from nodeagent.local import LocalClient, LocalServer
from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc
from tests.security.conftest import client_code, run_as


class RecordingServicer(pb_grpc.AgentLocalServicer):
    """AgentLocal stand-in recording the calls that reached it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def JobStart(self, request, context):  # noqa: N802
        with self.lock:
            self.calls.append(f"JobStart {request.job_id}")
        return pb.JobStartReply(ok=True, message=f"bound {request.job_id}")

    def JobEnd(self, request, context):  # noqa: N802
        with self.lock:
            self.calls.append(f"JobEnd {request.job_id}")
        return pb.JobEndReply(ok=True)

    def LocalStatus(self, request, context):  # noqa: N802
        with self.lock:
            self.calls.append("LocalStatus")
        return pb.LocalStatusReply(node="n1", ready=True)


@pytest.fixture
def local_server(open_dir):
    started = []

    def start(allowed_gid=None):
        servicer = RecordingServicer()
        server = LocalServer(str(open_dir / "agent.sock"), servicer, allowed_gid=allowed_gid)
        server.start()
        started.append(server)
        return server, servicer

    yield start
    for s in started:
        s.stop()


JOB_START = 'c.job_start("666", ["0"], user="intruder")'


def test_root_only_socket_refuses_an_ordinary_user(unprivileged_user, local_server):
    name, uid, _ = unprivileged_user
    server, servicer = local_server()
    assert oct(os.stat(server.socket_path).st_mode & 0o777) == "0o600"
    got = run_as(name, client_code(server.socket_path, JOB_START))
    assert got["uid"] == uid != 0
    assert got["outcome"] == "unreachable" and "Permission denied" in got["message"], got
    assert servicer.calls == []
    # root (what slurmd runs the prolog as) gets through
    with LocalClient(server.socket_path) as c:
        assert c.job_start("7", ["0"]).ok
    assert servicer.calls == ["JobStart 7"]


def test_peercred_refuses_an_ordinary_user_even_if_the_mode_is_loosened(unprivileged_user, local_server, caplog):
    name, uid, gid = unprivileged_user
    server, servicer = local_server()
    os.chmod(server.socket_path, 0o666)  # an admin mistake: the SO_PEERCRED check must still hold
    for call in (JOB_START, 'c.job_end("7")', "c.local_status()"):
        got = run_as(name, client_code(server.socket_path, call))
        assert got["outcome"] == "permission_denied", got
        assert "permission denied" in got["message"] and "SO_PEERCRED" in got["message"]
    assert servicer.calls == []
    assert server.refused == 3
    assert caplog.text.count(f"local connection refused: permission denied: peer uid {uid} gid {gid}") == 3


def test_configured_group_is_let_in(unprivileged_user, local_server):
    name, _, gid = unprivileged_user
    server, servicer = local_server(allowed_gid=gid)
    st = os.stat(server.socket_path)
    assert st.st_gid == gid and oct(st.st_mode & 0o777) == "0o660"
    got = run_as(name, client_code(server.socket_path, "c.local_status()"))
    assert got["outcome"] == "ok", got
    assert servicer.calls == ["LocalStatus"]


def test_real_agent_refuses_an_ordinary_user_and_keeps_caps(unprivileged_user, open_dir):
    """A real capctl-agent on a simulated node: the ordinary user cannot bind a job nor move a cap."""
    from tests.support.processes import ProcessGroup, sim_node, start_agent, write_policy

    name, uid, _ = unprivileged_user
    node = sim_node(open_dir / "sim", gpus=2, seed=7)
    policy = write_policy(open_dir / "policy.yaml", nodes=["n1"], budget_w=1000, start_cap_w=250, gpus_per_node=2)
    before = [node.read(i)["limit_w"] for i in range(2)]
    with ProcessGroup() as group:
        agent = group.add(start_agent(open_dir, "n1", "127.0.0.1:9", sim_env=node.env(), policy=policy,
                                      reconnect_max_s=1.0))
        agent.wait_ready(30.0)
        assert oct(os.stat(agent.socket_path).st_mode & 0o777) == "0o600"
        got = run_as(name, client_code(agent.socket_path, JOB_START))
        assert got["outcome"] == "unreachable" and "Permission denied" in got["message"], got
        os.chmod(agent.socket_path, 0o666)
        got = run_as(name, client_code(agent.socket_path, JOB_START))
        assert got["outcome"] == "permission_denied", got
        assert [node.read(i)["limit_w"] for i in range(2)] == before
        assert list(agent.status().jobs) == []
        assert f"peer uid {uid}" in agent.log_tail(50)
        # root (slurmd's prolog) binds, and the start cap is applied
        with agent.client() as c:
            reply = c.job_start("42", ["0"], user="root")
        assert reply.ok, reply.message
        assert [j.job_id for j in agent.status().jobs] == ["42"]
        assert node.read(0)["limit_w"] == 250.0 and node.read(1)["limit_w"] == before[1]
    node.close()
