"""AgentLocal over the agent's unix socket: JobStart/JobEnd/LocalStatus semantics and the
SO_PEERCRED check (a real unprivileged process is refused)."""

from __future__ import annotations

import errno
import os
import select
import socket
import stat
import threading

import pytest

from capctl.errors import PermissionDeniedError, UnreachableError, UserInputError
from nodeagent.local import PeerCred, peer_allowed
from tests.conftest import require
from tests.support.processes import sim_node, start_agent, write_policy

pytestmark = pytest.mark.integration


def lone_agent(tmp_path, gpus: int, prepare=None):
    """Yield ``(SimNode, AgentProc)``: a real agent on a simulated node of ``gpus`` GPUs (pre-job
    limit 700 W unless ``prepare(node)`` sets one), start cap 320 W, no coordinator; stopped after."""
    node = sim_node(tmp_path / "sim", gpus, seed=5)
    if prepare is not None:
        prepare(node)
    policy = write_policy(tmp_path / "p.yaml", nodes=["n1"], budget_w=4000, start_cap_w=320.0)
    a = start_agent(tmp_path, "n1", f"unix:{tmp_path}/no-coordinator.sock", sim_env=node.env(), policy=policy,
                    interval_s=0.3)
    try:
        a.wait_ready(20)
        yield node, a
    finally:
        a.stop()
        node.close()


@pytest.fixture
def agent(tmp_path):
    yield from lone_agent(tmp_path, 8, lambda node: node.set_param(5, "pre_job_limit_w", 610.0))  # a site limit below the default


def test_job_start_end_idempotent_and_restores_site_limits(agent):
    node, a = agent
    with a.client() as c:
        r = c.job_start("500", ["4", "5"], user="bob", partition="gpu")
        assert r.ok and not r.coordinator_connected
        assert [(g.index, g.cap_w, g.enforced_w) for g in r.gpus] == [(4, 320.0, 320.0), (5, 320.0, 320.0)]
        assert node.read(5)["limit_w"] == 320.0
        again = c.job_start("500", ["4", "5"])  # prolog run twice
        assert again.ok and "already bound" in again.message
        st = c.local_status()
        assert [(j.job_id, list(j.gpu_indices), j.user) for j in st.jobs] == [("500", [4, 5], "bob")]
        by_index = {g.index: g for g in st.gpus}
        assert by_index[4].job_id == "500" and by_index[0].job_id == ""

        end = c.job_end("500")
        assert end.ok
        assert {g.index: g.cap_w for g in end.gpus} == {4: 700.0, 5: 610.0}  # pre-job limits, not defaults
        assert node.read(5)["limit_w"] == 610.0 and node.read(4)["limit_w"] == 700.0
        again = c.job_end("500")  # epilog twice
        assert again.ok and list(again.gpus) == [] and "not bound" in again.message
        never = c.job_end("777")  # epilog without prolog (allocation without steps)
        assert never.ok and "not bound" in never.message
        assert list(c.local_status().jobs) == []


def test_two_jobs_own_gpus_and_shared_gpu_restored_by_last_job(agent):
    node, a = agent
    with a.client() as c:
        assert c.job_start("1", ["0", "1", "2", "3"]).ok
        assert c.job_start("2", ["4", "5", "6", "7"]).ok
        st = c.local_status()
        assert {j.job_id: list(j.gpu_indices) for j in st.jobs} == {"1": [0, 1, 2, 3], "2": [4, 5, 6, 7]}
        # a GPU shared by two jobs (MIG slices of one physical GPU): restored when the last one leaves
        assert c.job_start("3", ["7"]).ok
        assert {g.index: g.job_id for g in c.local_status().gpus}[7] == "2,3"
        end = c.job_end("2")
        assert {g.index for g in end.gpus} == {4, 5, 6}  # 7 still held by job 3
        assert node.read(7)["limit_w"] == 320.0 and node.read(4)["limit_w"] == 700.0
        end = c.job_end("3")
        assert [g.index for g in end.gpus] == [7] and node.read(7)["limit_w"] == 700.0
        assert node.read(0)["limit_w"] == 320.0  # job 1 untouched


def test_bad_requests_are_clear_errors(agent):
    _, a = agent
    with a.client() as c:
        with pytest.raises(UserInputError, match=r"GPU id '12' \(GPU_ID_MINOR\) matches no GPU on n1; known: 0, 1"):
            c.job_start("5", ["12"])
        with pytest.raises(UserInputError, match="job_id"):
            c.job_start("", ["1"])
        assert list(c.local_status().jobs) == []  # nothing half-bound


def test_unreachable_agent_is_a_clean_error(tmp_path):
    from capctl.agentclient import LocalClient

    with LocalClient(str(tmp_path / "absent.sock"), timeout_s=1.0) as c:
        with pytest.raises(UnreachableError, match="unreachable"):
            c.local_status()


_CONNECT_AS = r"""
import os, socket, sys
fd, path = int(sys.argv[1]), sys.argv[2]
back = socket.socket(fileno=fd)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(path)
    socket.send_fds(back, [b"K"], [s.fileno()])
except OSError as err:
    back.sendall(b"E%d" % err.errno)
"""


def _connect_as(uid: int, gid: int, path: str):
    """Connect to ``path`` from a helper process running as ``uid``/``gid`` (``setpriv``: no fork in
    this process, which has gRPC loaded); return the connected socket (passed back with SCM_RIGHTS,
    so its SO_PEERCRED credentials are the helper's) or the errno."""
    import shutil
    import subprocess
    import sys

    setpriv = shutil.which("setpriv")
    require(setpriv is not None, "setpriv (util-linux) is needed to connect as another user")
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.run([setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable,
                               "-c", _CONNECT_AS, str(child.fileno()), path], pass_fds=[child.fileno()],
                              capture_output=True, text=True, timeout=30)
        child.close()
        assert proc.returncode == 0, f"helper as uid {uid} failed: {proc.stderr[-2000:]}"
        parent.settimeout(10)
        msg, fds, _, _ = socket.recv_fds(parent, 64, 1)
    finally:
        child.close()
        parent.close()
    if fds:
        return socket.socket(fileno=fds[0])
    return int(msg[1:])


def _call_over(conn: socket.socket, tmp_path, fn):
    """Run ``fn(LocalClient)`` through a proxy socket spliced onto the already connected ``conn``."""
    from capctl.agentclient import LocalClient

    proxy_path = str(tmp_path / "proxy.sock")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(proxy_path)
    lst.listen(1)

    def splice():
        c, _ = lst.accept()
        socks = [c, conn]
        try:
            while True:
                ready, _, _ = select.select(socks, [], [], 5.0)
                if not ready:
                    return
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (conn if s is c else c).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            c.close()

    t = threading.Thread(target=splice, daemon=True)
    t.start()
    try:
        with LocalClient(proxy_path, timeout_s=3.0) as client:
            return fn(client)
    finally:
        t.join(5.0)
        conn.close()
        lst.close()


def test_socket_mode_and_unprivileged_peer_refused(agent, tmp_path):
    node, a = agent
    mode = stat.S_IMODE(os.stat(a.socket_path).st_mode)
    assert mode == 0o600
    require(os.geteuid() == 0, "needs root to connect as an unprivileged user")
    # the file mode keeps uid 65534 out ...
    assert _connect_as(65534, 65534, a.socket_path) == errno.EACCES
    # ... and with the mode loosened (socket and the test's temp directories), SO_PEERCRED still refuses it
    os.chmod(a.socket_path, 0o666)
    d = os.path.dirname(a.socket_path)
    while d not in ("/", "/tmp"):
        os.chmod(d, os.stat(d).st_mode | 0o001)
        d = os.path.dirname(d)
    conn = _connect_as(65534, 65534, a.socket_path)
    assert isinstance(conn, socket.socket)
    with pytest.raises(PermissionDeniedError, match="SO_PEERCRED"):
        _call_over(conn, tmp_path, lambda c: c.job_start("66", ["0"]))
    assert node.read(0)["limit_w"] == 700.0
    with a.client() as c:  # root is still served, and nothing was bound
        assert list(c.local_status().jobs) == []
    assert "local connection refused: permission denied: peer uid 65534" in a.log_path.read_text()


def test_peer_allowed_rules():
    groups = {4242: {27, 1000}}.get
    me = 1234
    assert peer_allowed(PeerCred(1, 0, 0), agent_uid=me, allowed_gid=None)[0]
    assert peer_allowed(PeerCred(1, me, 5), agent_uid=me, allowed_gid=None)[0]
    ok, why = peer_allowed(PeerCred(4242, 1001, 1001), agent_uid=me, allowed_gid=None)
    assert not ok and "uid 1001" in why and "pid 4242" in why
    assert peer_allowed(PeerCred(4242, 1001, 1000), agent_uid=me, allowed_gid=1000, groups_of=groups)[0]
    assert peer_allowed(PeerCred(4242, 1001, 1001), agent_uid=me, allowed_gid=27,
                        groups_of=lambda pid: groups(pid) or set())[0]
    ok, why = peer_allowed(PeerCred(4242, 1001, 1001), agent_uid=me, allowed_gid=99,
                           groups_of=lambda pid: groups(pid) or set())
    assert not ok and "gid 99" in why


def test_permission_error_type_is_mapped():
    assert PermissionDeniedError.exit_code == 4


def test_corrupt_agent_state_file_keeps_bindings_from_cap_manager(tmp_path):
    node = sim_node(tmp_path / "sim", 2)
    a = start_agent(tmp_path, "n1", f"unix:{tmp_path}/none.sock", sim_env=node.env(), interval_s=0.3)
    a.wait_ready(20)
    with a.client() as c:
        assert c.job_start("31", ["1"], user="erin").ok
    a.stop()
    (a.state_dir / "agent-state.json").write_text("{ truncated")
    b = start_agent(tmp_path, "n1", f"unix:{tmp_path}/none.sock", sim_env=node.env(), interval_s=0.3)
    try:
        st = b.wait_ready(20)
        # the binding itself lives in the cap manager's state: kept; only the job's metadata is lost
        assert [(j.job_id, list(j.gpu_indices), j.user) for j in st.jobs] == [("31", [1], "")]
        assert "agent-state.json unreadable" in b.log_path.read_text()
        with b.client() as c:
            assert c.job_end("31").ok
        assert node.read(1)["limit_w"] == 700.0
    finally:
        b.stop()
        node.close()


def test_second_agent_on_same_socket_is_refused_and_first_keeps_serving(tmp_path):
    """A second agent on a live --socket must not hijack it (nor delete it on exit); a stale socket
    file left by a killed agent is replaced."""
    node = sim_node(tmp_path / "sim", 2)
    first = start_agent(tmp_path, "n1", f"unix:{tmp_path}/none.sock", sim_env=node.env(), interval_s=0.3)
    try:
        first.wait_ready(20)
        inode = os.stat(first.socket_path).st_ino
        second = start_agent(tmp_path, "n1", f"unix:{tmp_path}/none.sock", sim_env=node.env(), interval_s=0.3)
        assert second.popen.wait(30) == 1
        second.stop()
        log = second.log_path.read_text()
        assert "Traceback" not in log
        line = [x for x in log.splitlines() if x.startswith("capctl-agent:")]
        assert line == [f"capctl-agent: --socket: another agent is serving on {first.socket_path} "
                        f"(pid {first.pid}); stop it first"], log
        # the first agent's socket is untouched and still answers
        assert os.stat(first.socket_path).st_ino == inode
        assert first.status().ready
        first.kill()  # SIGKILL: leaves a stale socket file behind
        assert stat.S_ISSOCK(os.stat(first.socket_path).st_mode)
        third = start_agent(tmp_path, "n1", f"unix:{tmp_path}/none.sock", sim_env=node.env(), interval_s=0.3)
        try:
            assert third.wait_ready(20).ready  # the stale file was replaced
        finally:
            third.stop()
        assert not os.path.exists(third.socket_path)  # ours: removed on stop
    finally:
        first.stop()
        node.close()


def test_local_server_stop_leaves_a_replaced_socket_alone(tmp_path):
    """stop() unlinks the socket only if it is still the file it bound (same inode)."""
    from nodeagent.local import LocalServer
    from capctl.v1 import capctl_pb2_grpc

    path = str(tmp_path / "s.sock")
    server = LocalServer(path, capctl_pb2_grpc.AgentLocalServicer())
    server.start()
    try:
        os.unlink(path)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(path)  # someone else's socket now lives at the path
    finally:
        server.stop()
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    other.close()
