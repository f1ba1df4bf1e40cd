"""The fault rig (tests/faults/rig.py) with two coordinators in high availability on a real
3-member etcd cluster (tests/etcdcluster): c1 and c2, each with its own state directory and
sockets, sharing admin state in etcd; every agent lists both (n2 through cuttable proxies,
tests/ha/proxy.py). The sampler's invariants hold throughout: the exact journal check of every
domain, no GPU above the caps ever allocated to it, no binding lost.

Timing: interval :data:`INTERVAL_S`, etcd lease TTL :data:`TTL_S`, agent lease :data:`LEASE_S`
(longer than the failover bound TTL + 2 intervals, so no agent falls back on a failover).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import grpc

from capctl.demo.processes import CoordinatorProc, start_agent, wait_until
from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc
from tests.etcdcluster import EtcdCluster
from tests.faults import rig as faultrig
from tests.faults.rig import CLOCK_MAIN, FaultRig
from tests.ha.proxy import UnixProxy

INTERVAL_S = 0.5
TTL_S = 2
LEASE_S = 5.0
RECONNECT_MAX_S = 0.3
FAILOVER_BOUND_S = TTL_S + 2 * INTERVAL_S
COORDINATORS = ("c1", "c2")
PROXIED = "n2"

POLICY = (faultrig.POLICY.replace(f"interval_s: {faultrig.INTERVAL_S}", f"interval_s: {INTERVAL_S}")
          .replace(f"lease_s: {faultrig.LEASE_S}", f"lease_s: {LEASE_S}"))


class HaRig(FaultRig):
    """:class:`~tests.faults.rig.FaultRig` with coordinators c1, c2 on etcd (see module docstring).
    ``coordinator`` is the leader last found; :meth:`status` asks the leader, whichever it is."""

    policy_text = POLICY

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        assert f"interval_s: {INTERVAL_S}" in POLICY and f"lease_s: {LEASE_S}" in POLICY
        self.etcd = EtcdCluster(self.workdir / "etcd")
        self.coordinators: dict[str, CoordinatorProc] = {}
        self.proxies: dict[str, UnixProxy] = {}

    def start(self) -> HaRig:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.etcd.start()
        return super().start()

    def stop(self) -> None:
        super().stop()
        for p in self.proxies.values():
            p.close()
        self.etcd.stop()

    # -- processes ------------------------------------------------------------------------------
    def sock(self, name: str) -> str:
        return str(self.workdir / f"{name}.sock")

    def start_coordinator(self) -> CoordinatorProc:
        for name in COORDINATORS:
            self.start_one(name)
        return self.wait_leader()

    def start_one(self, name: str) -> CoordinatorProc:
        """Start coordinator ``name`` (a standby until elected)."""
        argv = [sys.executable, "-c", CLOCK_MAIN, "--policy", str(self.policy_path),
                "--listen", f"unix:{self.sock(name)}", "--state-dir", str(self.workdir / f"{name}-state"),
                "--admin-socket", str(self.workdir / f"{name}-admin.sock"), "--metrics-listen", "127.0.0.1:0",
                "--ready-file", str(self.workdir / f"{name}.ready"),
                "--etcd-endpoints", self.etcd.endpoints, "--etcd-lease-ttl-s", str(TTL_S),
                "--advertise", f"unix:{self.sock(name)}"]
        env = dict(os.environ)
        env.pop("CAPCTL_SIMGPU_NODE", None)
        env.update(PYTHONUNBUFFERED="1", CAPCTL_TEST_CLOCK_OFFSET_FILE=str(self.clock_file))
        proc = CoordinatorProc(name, argv, self.workdir / f"{name}.log", env=env)
        proc.address = f"unix:{self.sock(name)}"
        proc.admin_address = f"unix:{self.workdir / f'{name}-admin.sock'}"
        proc.state_dir = self.workdir / f"{name}-state"
        self.group.add(proc)
        self.coordinators[name] = proc
        proc.wait_serving(30.0)
        return proc

    def start_agent(self, name: str):
        targets = [f"unix:{self.sock(c)}" for c in COORDINATORS]
        if name == PROXIED:
            for c in COORDINATORS:
                if c not in self.proxies:
                    self.proxies[c] = UnixProxy(str(self.workdir / f"proxy-{name}-{c}.sock"), self.sock(c))
            targets = [self.proxies[c].address for c in COORDINATORS]
        agent = self.group.add(start_agent(self.workdir, name, ",".join(targets), sim_env=self.sims[name].env(),
                                           policy=self.policy_path, reconnect_max_s=RECONNECT_MAX_S))
        self.agents[name] = agent
        return agent

    def plans_sent(self, name: str) -> float:
        """How many cap plans coordinator ``name`` has sent (its Prometheus counter ``capctl_plans``)."""
        import json
        import urllib.request

        port = json.loads((self.workdir / f"{name}.ready").read_text())["metrics_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2.0) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("capctl_plans_total"))

    # -- leadership -----------------------------------------------------------------------------
    def ha_status(self, name: str, timeout_s: float = 1.0):
        """Coordinator ``name``'s StatusReply, or None when it does not answer."""
        proc = self.coordinators.get(name)
        if proc is None or proc.poll() is not None:
            return None
        try:
            with grpc.insecure_channel(proc.address) as ch:
                return pb_grpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return None

    def leader_name(self) -> str | None:
        for name in COORDINATORS:
            st = self.ha_status(name, 0.5)
            if st is not None and st.ha_role == "leader":
                return name
        return None

    def wait_leader(self, exclude: str | None = None, timeout_s: float = 20.0) -> CoordinatorProc:
        found: list = []

        def ok():
            name = self.leader_name()
            if name is not None and name != exclude:
                found.append(name)
                return True
            return False
        wait_until(ok, timeout_s, 0.05, f"a leader among the coordinators{f' other than {exclude}' if exclude else ''}")
        self.coordinator = self.coordinators[found[-1]]
        return self.coordinator

    def status(self, timeout_s: float = 2.0):
        """The leader's status (the last leader found first, then the others)."""
        order = [self.coordinator] + [p for p in self.coordinators.values() if p is not self.coordinator]
        last = None
        for proc in order:
            if proc is None or proc.poll() is not None:
                continue
            try:
                with grpc.insecure_channel(proc.address) as ch:
                    st = pb_grpc.AdminStub(ch).Status(pb.StatusRequest(), timeout=timeout_s)
            except grpc.RpcError as exc:
                last = exc
                continue
            if st.ha_role == "leader":
                self.coordinator = proc
                return st
        if last is not None:
            raise last
        raise grpc.RpcError("no leader")

    def agents_on_term(self, term: int) -> bool:
        """Every agent applied a plan of ``term`` (and acknowledged it: every plan applied is acked)."""
        try:
            return all(a.status(timeout_s=0.5).plan_term == term for a in self.agents.values())
        except Exception:  # noqa: BLE001
            return False

    def wait_failover(self, old: str, since: float, timeout_s: float = 20.0) -> tuple[str, int, float]:
        """Wait until a coordinator other than ``old`` leads and every agent applied a plan of its
        term. Returns (new leader, its term, seconds since ``since``, monotonic)."""
        got: list = []

        def ok():
            for name in COORDINATORS:
                if name == old:
                    continue
                st = self.ha_status(name, 0.5)
                if st is not None and st.ha_role == "leader" and self.agents_on_term(st.term):
                    got[:] = [name, st.term, time.monotonic() - since]
                    return True
            return False
        wait_until(ok, timeout_s, 0.02, f"failover from {old}: a new leader and every agent on its term")
        self.coordinator = self.coordinators[got[0]]
        return got[0], got[1], got[2]

    def healthy(self) -> bool:
        if any(p.poll() is not None for p in self.coordinators.values()) or len(self.coordinators) != 2:
            return False
        if any(p.cut_now for p in self.proxies.values()) or any(p is None for p in self.etcd.procs.values()):
            return False
        if not self.etcd.healthy():
            return False
        return super().healthy()
