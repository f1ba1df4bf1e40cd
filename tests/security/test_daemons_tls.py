"""mTLS and admin identity on the real daemons (processes, 127.0.0.1 and unix sockets).

A coordinator with ``--tls-*``, ``--admin-token-file`` and ``--status-socket``; agents on simulated
nodes with their node certificates; the ``capctl`` CLI with admin, reader and bad certificates;
an ordinary user on the status socket. docs/security.md describes what is checked here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from capctl.demo.processes import ProcessGroup, free_port, start_agent, start_coordinator, wait_until
from capctl.security import tls
from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc
from tests.security.conftest import UNPRIVILEGED_USER, run_as
from tests.support.certs import make_pki
from tests.support.processes import sim_node, write_policy

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOKEN = "f00dfeed" * 8


def _creds(pki, issued):
    return tls.channel_credentials(tls.TlsConfig(pki.ca_path, issued.cert_path, issued.key_path))


def _status(address, creds, timeout_s=3.0):
    with grpc.secure_channel(address, creds) as ch:
        return pb_grpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=timeout_s)


class TlsCluster:
    def __init__(self, workdir: Path, pki) -> None:
        self.workdir = workdir
        self.pki = pki
        self.group = ProcessGroup()
        self.sims = {n: sim_node(workdir / f"sim-{n}", 2, seed=11 + i) for i, n in enumerate(("n1", "n2"))}
        policy = write_policy(workdir / "policy.yaml", nodes=["n1", "n2"], budget_w=1400.0, gpus_per_node=2)
        policy.write_text(policy.read_text() + f"coordinator: {{status_group: {UNPRIVILEGED_USER}}}\n")
        self.token_file = workdir / "admin.token"
        self.token_file.write_text(TOKEN + "\n")
        os.chmod(self.token_file, 0o600)
        self.status_socket = workdir / "status.sock"
        self.address = f"127.0.0.1:{free_port()}"
        self.coordinator = self.group.add(start_coordinator(
            workdir, policy, listen=self.address,
            extra_args=pki.tls_args(pki.server) + ["--admin-token-file", str(self.token_file),
                                                  "--status-socket", str(self.status_socket)]))
        wait_until(lambda: _status(self.address, _creds(pki, pki.reader), 1.0), 30.0, 0.1, "TLS coordinator serving",
                   proc=self.coordinator)
        self.policy = policy
        self.agents = {}

    def agent(self, node: str, cert_node: str | None = None):
        issued = self.pki.agent(cert_node or node)
        a = self.group.add(start_agent(self.workdir / (node + (cert_node or "")), node, self.address,
                                       sim_env=self.sims[node].env(), policy=self.policy, reconnect_max_s=0.5,
                                       extra_args=self.pki.tls_args(issued) + ["--tls-server-name", "localhost"]))
        self.agents[node] = a
        return a

    def cli(self, *args, issued=None, extra=(), env=None, timeout=30):
        cert = self.pki.tls_args(issued) if issued is not None else []
        e = dict(os.environ)
        for k in ("CAPCTL_TLS_CA", "CAPCTL_TLS_CERT", "CAPCTL_TLS_KEY", "CAPCTL_ADMIN_TOKEN_FILE", "CAPCTL_COORDINATOR"):
            e.pop(k, None)
        e.update(env or {})
        return subprocess.run([sys.executable, "-m", "capctl.cli.main", *cert, *extra, *args], cwd=REPO, env=e,
                              capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        self.group.stop_all()
        for s in self.sims.values():
            s.close()


@pytest.fixture(scope="module")
def cluster(unprivileged_user):
    d = Path(tempfile.mkdtemp(prefix="capctl-tls-", dir="/tmp"))
    d.chmod(0o755)
    pki = make_pki(d)
    c = TlsCluster(d, pki)
    try:
        c.agent("n1").wait_ready(30.0, connected=True)
        yield c
    finally:
        c.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_agents_connect_over_mtls_and_caps_are_applied(cluster):
    pki = cluster.pki
    a2 = cluster.agent("n2")
    a2.wait_ready(30.0, connected=True)
    # (the policy's nodes are listed from the start, stale and never_reported until their hello)
    st = wait_until(lambda: (s := _status(cluster.address, _creds(pki, pki.reader))) and len(s.nodes) == 2
                    and not any(n.stale for n in s.nodes) and s, 10.0, 0.1, "both agents registered over mTLS")
    assert sorted(n.name for n in st.nodes) == ["n1", "n2"] and not any(n.stale for n in st.nodes)
    with a2.client() as c:
        assert c.job_start("77", ["0", "1"]).ok
    wait_until(lambda: any(j.job_id == "77" for j in _status(cluster.address, _creds(pki, pki.reader)).jobs), 10.0,
               0.1, "job 77 at the coordinator")


def test_an_agent_certificate_only_speaks_for_its_own_node(cluster):
    cluster.sims["n3"] = sim_node(cluster.workdir / "sim-n3", 1, seed=13)
    impostor = cluster.agent("n3", cert_node="n1")  # a node using n1's certificate to register as n3
    wait_until(lambda: "not node 'n3'" in cluster.coordinator.log_tail(200), 15.0, 0.1,
               "the coordinator refusing n3 with n1's certificate", proc=impostor)
    st = _status(cluster.address, _creds(cluster.pki, cluster.pki.reader))
    assert "n3" not in [n.name for n in st.nodes]
    assert not impostor.status().coordinator_connected
    impostor.stop()


@pytest.mark.parametrize("who", [None, "wrong_ca_client", "expired_client"])
def test_clients_without_a_valid_certificate_are_refused(cluster, who):
    pki = cluster.pki
    if who is None:  # plaintext to the TLS port
        r = cluster.cli("status", "--coordinator", cluster.address)
    else:
        r = cluster.cli("status", "--coordinator", cluster.address, issued=getattr(pki, who))
    assert r.returncode == 3 and "unreachable" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_admin_needs_the_admin_role_or_the_token(cluster):
    pki = cluster.pki
    r = cluster.cli("status", "--json", "--coordinator", cluster.address, issued=pki.reader)
    assert r.returncode == 0 and '"budget_w": 1400' in r.stdout.replace(".0", ""), r.stderr
    r = cluster.cli("budget", "set", "1300", "--coordinator", cluster.address, issued=pki.reader)
    assert r.returncode == 4 and "capctl-role:admin" in r.stderr, r.stderr
    r = cluster.cli("budget", "set", "1300", "--coordinator", cluster.address, issued=pki.ou_admin)
    assert r.returncode == 4
    r = cluster.cli("budget", "set", "1300", "--coordinator", cluster.address, issued=pki.admin)
    assert r.returncode == 0, r.stderr
    r = cluster.cli("budget", "set", "1350", "--coordinator", cluster.address, issued=pki.reader,
                    extra=["--admin-token-file", str(cluster.token_file)])
    assert r.returncode == 0, r.stderr
    assert _status(cluster.address, _creds(pki, pki.reader)).budget_w == 1350.0
    # flags after the subcommand work too, and the environment
    r = cluster.cli("policy", "reload", "--coordinator", cluster.address, "--tls-ca", str(pki.ca_path),
                    "--tls-cert", str(pki.admin.cert_path), "--tls-key", str(pki.admin.key_path))
    assert r.returncode == 0, r.stderr
    r = cluster.cli("budget", "set", "1400", "--coordinator", cluster.address,
                    env={"CAPCTL_TLS_CA": str(pki.ca_path), "CAPCTL_TLS_CERT": str(pki.admin.cert_path),
                         "CAPCTL_TLS_KEY": str(pki.admin.key_path)})
    assert r.returncode == 0, r.stderr
    log = cluster.coordinator.log_tail(400)
    assert "budget set by" in log and "cert CN=alice roles=admin" in log and "admin token" in log
    assert TOKEN not in log and TOKEN not in cluster.coordinator.log_path.read_text()


def test_status_socket_serves_the_status_group_read_only(cluster, unprivileged_user):
    name, _, gid = unprivileged_user
    st = os.stat(cluster.status_socket)
    assert st.st_gid == gid and oct(st.st_mode & 0o777) == "0o660"
    code = f"""
import json
from capctl.v1 import capctl_pb2 as pb, capctl_pb2_grpc as pbg
out = {{}}
with grpc.insecure_channel("unix:{cluster.status_socket}") as ch:
    s = pbg.AdminStub(ch)
    out["nodes"] = sorted(n.name for n in s.Status(pb.StatusRequest(), timeout=5).nodes)
    try:
        s.SetBudget(pb.SetBudgetRequest(budget_w=1000.0), timeout=5)
        out["set"] = "ok"
    except grpc.RpcError as e:
        out["set"] = e.code().name
        out["details"] = e.details()
print("RESULT " + json.dumps(out))
"""
    got = run_as(name, code)
    assert got["nodes"][:1] == ["n1"] and got["set"] == "PERMISSION_DENIED", got
    # the admin socket stays root-only
    admin = Path(cluster.coordinator.admin_address[5:])
    assert oct(os.stat(admin).st_mode & 0o777) == "0o600"
    code_admin = f"""
import json
from capctl.v1 import capctl_pb2 as pb, capctl_pb2_grpc as pbg
try:
    with grpc.insecure_channel("unix:{admin}") as ch:
        pbg.AdminStub(ch).SetBudget(pb.SetBudgetRequest(budget_w=1000.0), timeout=5)
    r = "ok"
except grpc.RpcError as e:
    r = e.code().name
print("RESULT " + json.dumps({{"set": r}}))
"""
    assert run_as(name, code_admin)["set"] == "UNAVAILABLE"  # EACCES on connect
    assert _status(cluster.address, _creds(cluster.pki, cluster.pki.reader)).budget_w != 1000.0
