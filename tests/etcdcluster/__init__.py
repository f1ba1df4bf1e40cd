"""A real 3-member etcd cluster on loopback for the coordinator HA tests (``-m ha``).

Debian's ``etcd-server`` 3.4 (installed by ``tests/etcdcluster/install.sh``, which ``make test``
runs), each member on free ports of its own 127.0.0.x address (client and peer), data under the
test's temporary directory, started with :class:`capctl.lifeline.Popen` (they die with the test
process) and stopped by :meth:`EtcdCluster.stop`. Raft timing is tightened (heartbeat 50 ms,
election 500 ms) so that a lost member is noticed within a second on a loaded 2-core host.

Example::

    with EtcdCluster(tmp_path) as etcd:
        etcd.endpoints        # "http://127.0.0.11:PORT,http://127.0.0.12:PORT,http://127.0.0.13:PORT"
        etcd.stop_member(1)   # SIGKILL one member; start_member(1) brings it back with its data
"""

from __future__ import annotations

import shutil
import socket
import time
import urllib.request
from pathlib import Path

from capctl.demo.processes import Proc, wait_until
from tests.conftest import require

ETCD = "/usr/bin/etcd"
HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")


def require_etcd() -> None:
    """Skip locally / fail under CI when etcd is not installed (``bash tests/etcdcluster/install.sh``)."""
    require(shutil.which("etcd") is not None or Path(ETCD).is_file(),
            "etcd not installed (bash tests/etcdcluster/install.sh installs Debian's etcd-server)")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EtcdCluster:
    """Three etcd members on loopback (see module docstring)."""

    def __init__(self, workdir: Path, members: int = 3, tls=None) -> None:
        """``tls``: None (http://), or ``(ca_path, server_cert, server_key, client_cert, client_key)``:
        https:// client URLs that require a client certificate of that CA (``--client-cert-auth``);
        the server certificate must name the member addresses (:data:`HOSTS`)."""
        require_etcd()
        self.workdir = Path(workdir)
        self.tls = tls
        self.scheme = "https" if tls else "http"
        self.names = [f"m{i}" for i in range(members)]
        self.client = {n: (HOSTS[i], free_port(HOSTS[i])) for i, n in enumerate(self.names)}
        self.peer = {n: (HOSTS[i], free_port(HOSTS[i])) for i, n in enumerate(self.names)}
        self.procs: dict[str, Proc | None] = {n: None for n in self.names}
        self.token = f"capctl-test-{time.time_ns()}"

    @property
    def endpoints(self) -> str:
        return ",".join(f"{self.scheme}://{h}:{p}" for h, p in self.client.values())

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.names)):
            self.start_member(i, wait=False)
        wait_until(self.healthy, timeout_s, 0.1, "etcd cluster healthy")
        return self

    def start_member(self, i: int, wait: bool = True) -> None:
        name = self.names[i]
        (h, cp), (_, pp) = self.client[name], self.peer[name]
        cluster = ",".join(f"{n}=http://{ph}:{pport}" for n, (ph, pport) in self.peer.items())
        argv = [shutil.which("etcd") or ETCD, "--name", name, "--data-dir", str(self.workdir / f"{name}.etcd"),
                "--listen-client-urls", f"{self.scheme}://{h}:{cp}", "--advertise-client-urls", f"{self.scheme}://{h}:{cp}",
                "--listen-peer-urls", f"http://{h}:{pp}", "--initial-advertise-peer-urls", f"http://{h}:{pp}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", self.token,
                "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn", "--logger", "zap"]
        if self.tls:
            ca, cert, key = self.tls[:3]
            argv += ["--cert-file", str(cert), "--key-file", str(key), "--trusted-ca-file", str(ca),
                     "--client-cert-auth"]
        self.procs[name] = Proc(f"etcd-{name}", argv, self.workdir / f"{name}.log")
        if wait:
            wait_until(lambda: self.member_healthy(i), 20.0, 0.1, f"etcd member {name} healthy")

    def lose_data(self, timeout_s: float = 30.0) -> None:
        """Every member killed, its data directory removed, and a new cluster started on the same
        addresses (a new cluster token): etcd's revisions restart from 1, as after a rebuild."""
        for i in range(len(self.names)):
            self.stop_member(i)
        for name in self.names:
            shutil.rmtree(self.workdir / f"{name}.etcd", ignore_errors=True)
        self.token = f"capctl-test-{time.time_ns()}"
        self.start(timeout_s)

    def stop_member(self, i: int) -> None:
        """SIGKILL member ``i`` (its data stays for :meth:`start_member`)."""
        proc = self.procs[self.names[i]]
        if proc is not None:
            proc.kill()
            proc.stop()
            self.procs[self.names[i]] = None

    def member_healthy(self, i: int) -> bool:
        h, p = self.client[self.names[i]]
        context = None
        if self.tls:
            import ssl

            context = ssl.create_default_context(cafile=str(self.tls[0]))
            context.load_cert_chain(str(self.tls[3]), str(self.tls[4]))
        try:
            with urllib.request.urlopen(f"{self.scheme}://{h}:{p}/health", timeout=1.0, context=context) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def healthy(self) -> bool:
        return all(self.member_healthy(i) for i in range(len(self.names)) if self.procs[self.names[i]] is not None)

    def stop(self) -> None:
        for name, proc in self.procs.items():
            if proc is not None:
                proc.stop()
                self.procs[name] = None
