"""A real multi-node Slurm cluster on one host, for the tests and for ``make slurm-up``.

One ``slurmctld`` and one ``slurmd -N nX`` per node (Debian's slurmd is built with multiple-slurmd
support), each node with its own port, loopback address (127.0.0.11, .12, ...) and fake GPU gres
(``File=`` pointing at character devices ``c 195 N`` created in the run directory, never in /dev);
``munged`` with its own key and socket in the run directory. With ``capctl=True`` also one simulated
GPU node, one ``capctl-agent`` per Slurm node (socket ``<run>/agent/<node>.sock``) and a
``capctl-coordinator``, and slurm.conf ``Prolog=``/``Epilog=`` running our ``slurm/prolog`` and
``slurm/epilog``. With ``accounting=True`` also MariaDB and ``slurmdbd`` (:mod:`tests.slurmcluster.accounting`:
``sacct`` works) and our ``EpilogSlurmctld`` (``slurm/epilog_slurmctld``: the job's energy in its
AdminComment).

Everything lives under the run directory (configs, state, logs, sockets, pid records); ``down``
stops every process the cluster started (see :mod:`tests.slurmcluster.procs`). Only loopback
addresses and unix sockets are used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.slurmcluster import installed, procs

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RUN_DIR = Path("/tmp/capctl-slurm")
NVIDIA_MAJOR = 195
"""Character-device major number of NVIDIA GPUs (/dev/nvidiaN is ``c 195 N``)."""

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def which(name: str) -> str | None:
    """Absolute path of ``name`` in the system directories (independent of $PATH)."""
    for d in SBIN:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def slurm_installed() -> bool:
    """True when every Slurm/munge binary the cluster needs is installed."""
    return all(which(b) for b in SLURM_BINARIES)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    socks, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class ClusterError(RuntimeError):
    """The cluster could not be brought up; the message names the log to read."""


@dataclass
class SlurmCluster:
    """A test Slurm cluster rooted at ``run_dir``.

    Args:
        run_dir: directory holding every file of the cluster (created; must not be world-writable).
        nodes: Slurm node names; node i gets NodeAddr 127.0.0.(11+i).
        gpus_per_node: fake GPU gres (and simulated GPUs) per node.
        cpus_per_node: CPUs declared per node (``SlurmdParameters=config_overrides``).
        capctl: also run simulated GPU nodes, agents, a coordinator and our prolog/epilog.
        gpu_model: simulated GPU model name (capctl.simgpu).
        hook_timeout_s: bound of one prolog/epilog run (policy ``prolog.timeout_s``).
        interval_s, lease_s, start_cap_w, safe_cap_w, on_unreachable: policy values (W, s).
        pre_job_limit_w: site limit of every simulated GPU before any job (W).
        budget_w: policy budget (W); None = 700 W x every GPU (never binding).
        prolog, epilog: other Prolog=/Epilog= programs (default: ours when ``capctl``).
        accounting: also MariaDB + slurmdbd (sacct) and, with ``capctl``, our EpilogSlurmctld.
    """

    run_dir: Path = DEFAULT_RUN_DIR
    nodes: tuple[str, ...] = ("n1", "n2", "n3")
    gpus_per_node: int = 8
    cpus_per_node: int = 16
    capctl: bool = True
    gpu_model: str = "H100-SXM"
    hook_timeout_s: float = 1.8
    interval_s: float = 1.0
    lease_s: float = 10.0
    start_cap_w: float = 300.0
    safe_cap_w: float = 350.0
    pre_job_limit_w: float = 650.0
    budget_w: float | None = None
    on_unreachable: str = "fail-open"
    prolog: str | None = None
    epilog: str | None = None
    accounting: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).resolve()

    # ---------------------------------------------------------------- paths and environment
    @property
    def conf_path(self) -> Path:
        return self.run_dir / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge" / "munge.socket"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "log"

    @property
    def hook_log(self) -> Path:
        """File where our prolog/epilog append one line per event (see slurm)."""
        return self.log_dir / "capctl-hooks.log"

    @property
    def coordinator_address(self) -> str:
        return f"unix:{self.run_dir / 'coordinator' / 'coordinator.sock'}"

    @property
    def policy_path(self) -> Path:
        return self.run_dir / "etc" / "policy.yaml"

    def agent_socket(self, node: str) -> Path:
        return self.run_dir / "agent" / f"{node}.sock"

    def node_addr(self, node: str) -> str:
        return f"127.0.0.{11 + self.nodes.index(node)}"

    def dev_dir(self, node: str) -> Path:
        return self.run_dir / "dev" / node

    def simnode_path(self, node: str) -> Path:
        return self.run_dir / "simgpu" / node

    def env(self) -> dict[str, str]:
        """Environment for Slurm client commands (sbatch, srun, scontrol, ...) and `capctl`."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf_path)
        env["CAPCTL_COORDINATOR"] = self.coordinator_address
        env["PATH"] = ":".join([installed.cli_bin_dir(), *SBIN, env.get("PATH", "")])
        for var in list(env):
            # Never let the caller's own Slurm job environment leak into test submissions.
            if var.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and var != "SLURM_CONF":
                del env[var]
        env.update(self.extra_env)
        return env

    # ---------------------------------------------------------------- client helpers
    def run(self, argv: list[str], timeout_s: float = 30.0, check: bool = True, input: str | None = None,
            ) -> subprocess.CompletedProcess:
        """Run a Slurm client command (by name) against this cluster; returns the completed process."""
        exe = which(argv[0]) or argv[0]
        proc = subprocess.run([exe, *argv[1:]], env=self.env(), capture_output=True, text=True,
                              timeout=timeout_s, input=input)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def node_info(self, node: str) -> dict[str, str]:
        """``scontrol show node`` fields of ``node`` as a dict (State, Reason, Gres, ...)."""
        out = self.run(["scontrol", "-o", "show", "node", node]).stdout
        return _parse_scontrol(out)

    def node_states(self) -> dict[str, str]:
        """``{node: State}`` (e.g. "IDLE", "ALLOCATED", "IDLE+DRAIN")."""
        return {n: self.node_info(n).get("State", "") for n in self.nodes}

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` fields of ``job_id`` (JobState, ExitCode, NodeList, Reason, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False).stdout
        return _parse_scontrol(out)

    def sbatch(self, *args: str, script: str = "#!/bin/sh\nsleep 1\n") -> str:
        """Submit a batch job; returns its job id."""
        out = self.run(["sbatch", "--parsable", f"--chdir={self.run_dir}",
                        f"--output={self.log_dir}/job-%j.out", *args], input=script).stdout
        return out.strip().split(";")[0]

    def wait_job(self, job_id: str, states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                 "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"),
                 timeout_s: float = 30.0, poll_s: float = 0.1) -> dict[str, str]:
        """Wait until ``job_id`` reaches one of ``states``; returns its fields."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s} s: {info.get('JobState')}")

    def wait_nodes_idle(self, nodes: tuple[str, ...] | None = None, timeout_s: float = 30.0) -> None:
        """Wait until every node is IDLE with no flags (not draining, not completing)."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = {n: self.node_info(n).get("State", "") for n in (nodes or self.nodes)}
            if all(s == "IDLE" for s in states.values()):
                return
            time.sleep(0.1)
        raise ClusterError(f"nodes not idle after {timeout_s} s: {states} (logs: {self.log_dir})")

    def hook_events(self) -> list[dict]:
        """Events logged by our prolog/epilog (one JSON object per line of the hook log)."""
        try:
            lines = self.hook_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            start = line.find("{")
            if start >= 0:
                try:
                    events.append(json.loads(line[start:]))
                except ValueError:
                    pass
        return events

    # ---------------------------------------------------------------- up / down
    def up(self, timeout_s: float = 60.0) -> "SlurmCluster":
        """Write configs, start every daemon, wait until all nodes are idle. Idempotent per run dir."""
        from tests.slurmcluster import accounting

        if not slurm_installed() or (self.accounting and not accounting.installed(which)):
            raise ClusterError("Slurm/munge (or slurmdbd/mariadb-server) not installed: run `make slurm-deps` "
                               "(tests/slurmcluster/install.sh)")
        if os.geteuid() != 0:
            raise ClusterError("the test Slurm cluster needs root (slurmd runs jobs as their user)")
        procs.stop_orphans()
        self.down()
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, mode=0o755)
        os.chmod(self.run_dir, 0o755)
        for sub in ("etc", "log", "munge", "ctld", "spool", "agent", "coordinator", "simgpu", "state"):
            (self.run_dir / sub).mkdir(mode=0o755)
        try:
            self._make_devices()
            ports = free_ports(3 + len(self.nodes))
            self._acct_ports = ports[-2:] if self.accounting else None
            self._write_configs(ports[0], ports[1:1 + len(self.nodes)])
            self._start_munge()
            if self.accounting:
                accounting.start(self, which, *self._acct_ports)
            if self.capctl:
                self._start_capctl()
            self._start_slurm()
            self.wait_nodes_idle(timeout_s=timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Cancel jobs and stop every process started for this run dir. Safe when nothing runs."""
        if not (self.run_dir / "pids.json").exists() and not procs.marked_pids(self.run_dir):
            return
        if procs.running(self.run_dir, "slurmctld"):
            self.run(["scancel", "--full", "--quiet", "-u", "root"], check=False, timeout_s=10)
            self.run(["scancel", "--quiet", "--state=PENDING"], check=False, timeout_s=10)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                out = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout_s=10).stdout.strip()
                if not out:
                    break
                time.sleep(0.1)
        order = ["slurmctld", *[f"slurmd-{n}" for n in self.nodes], *[f"agent-{n}" for n in self.nodes],
                 "coordinator", "slurmdbd", "mariadbd", "munged"]
        procs.stop_all(self.run_dir, order)

    def status(self) -> dict[str, bool]:
        """``{process name: running}`` for every recorded process."""
        return {name: procs.running(self.run_dir, name) for name in procs.recorded(self.run_dir)}

    # ---------------------------------------------------------------- pieces
    def _make_devices(self) -> None:
        for node in self.nodes:
            d = self.dev_dir(node)
            d.mkdir(parents=True)
            for i in range(self.gpus_per_node):
                os.mknod(d / f"nvidia{i}", 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, i))

    def _write_configs(self, ctld_port: int, node_ports: list[int]) -> None:
        etc = self.run_dir / "etc"
        lines = [
            "# Generated by tests/slurmcluster (capctl test cluster). Do not edit.",
            "ClusterName=capctltest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.run_dir}/ctld",
            f"SlurmdSpoolDir={self.run_dir}/spool/%n",
            f"SlurmctldPidFile={self.run_dir}/slurmctld.pid",
            f"SlurmdPidFile={self.run_dir}/spool/slurmd.%n.pid",
            f"SlurmctldLogFile={self.log_dir}/slurmctld.log",
            f"SlurmdLogFile={self.log_dir}/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "SlurmdParameters=config_overrides",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "ReturnToService=2",
            "SlurmdTimeout=60",
            "SlurmctldTimeout=60",
            "MessageTimeout=10",
            "InactiveLimit=0",
            "KillWait=2",
            "MinJobAge=600",
            "MaxJobCount=10000",
            "PrologEpilogTimeout=30",
        ]
        hooks = installed.install_hooks(self.run_dir / "hooks") if self.capctl else {}
        self.hooks = hooks
        prolog = self.prolog or hooks.get("prolog")
        epilog = self.epilog or hooks.get("epilog")
        if prolog or epilog:
            lines.append("PrologFlags=Alloc")
        if prolog:
            lines.append(f"Prolog={prolog}")
        if epilog:
            lines.append(f"Epilog={epilog}")
        if self.accounting:
            from tests.slurmcluster import accounting

            lines = [ln for ln in lines if not ln.startswith("AccountingStorageType=")]
            lines += accounting.conf_lines(self._acct_ports[1], self.munge_socket)
            if self.capctl:
                lines.append(f"EpilogSlurmctld={self._write_ctld_epilog()}")
        for node, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={node} NodeAddr={self.node_addr(node)} NodeHostname={node} Port={port} "
                f"CPUs={self.cpus_per_node} RealMemory=4096 Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            )
        lines.append(f"PartitionName=gpu Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf_path.write_text("\n".join(lines) + "\n")
        gres = ["# Generated by tests/slurmcluster: fake GPUs are character devices c 195 N."]
        for node in self.nodes:
            last = self.gpus_per_node - 1
            gres.append(f"NodeName={node} Name=gpu File={self.dev_dir(node)}/nvidia[0-{last}]")
        (etc / "gres.conf").write_text("\n".join(gres) + "\n")
        # slurmd 22.05 always initialises a cgroup plugin (no "disabled" before 23.02); no Constrain*.
        (etc / "cgroup.conf").write_text("# Generated by tests/slurmcluster: no cgroup constraints.\n"
                                         "CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        if self.capctl:
            self._write_hooks_env()

    def _write_hooks_env(self) -> None:
        """Hook configuration next to slurm.conf, where ``slurm/prolog`` looks for it
        (``<dir of $SLURM_CONF>/capctl-hooks.env``): Prolog=/Epilog= name our scripts directly."""
        env_lines = [
            "# capctl Slurm hook configuration (generated by tests/slurmcluster; see docs/slurm.md)",
            f"CAPCTL_PYTHON={installed.hook_python()}",
            f"CAPCTL_POLICY={self.policy_path}",
            f"CAPCTL_HOOK_LOG={self.hook_log}",
            f"CAPCTL_COORDINATOR={self.coordinator_address}",
        ]
        (self.run_dir / "etc" / "capctl-hooks.env").write_text("\n".join(env_lines) + "\n")

    def _write_ctld_epilog(self) -> Path:
        """A wrapper for EpilogSlurmctld= in the run dir: slurmctld gives its epilog no SLURM_CONF,
        which both our script (to find capctl-hooks.env) and scontrol need here."""
        path = self.run_dir / "etc" / "epilog_slurmctld"
        path.write_text(f"#!/bin/sh\nSLURM_CONF={self.conf_path}\nexport SLURM_CONF\n"
                        f"exec {self.hook_script('epilog_slurmctld')} \"$@\"\n")
        path.chmod(0o755)
        return path

    def _daemon_env(self) -> dict[str, str]:
        env = {"PATH": ":".join(SBIN), "SLURM_CONF": str(self.conf_path), "LANG": "C.UTF-8"}
        return env

    def _start_munge(self) -> None:
        key = self.run_dir / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        procs.start(self.run_dir, "munged", [
            which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={self.run_dir}/munge/munged.pid",
            f"--seed-file={self.run_dir}/munge/munged.seed", f"--log-file={self.log_dir}/munged.log",
        ], self._daemon_env(), self.log_dir / "munged.out")
        _wait_for(lambda: self.munge_socket.exists(), 10.0, f"munged socket (see {self.log_dir}/munged.log)")

    def _start_slurm(self) -> None:
        env = self._daemon_env()
        procs.start(self.run_dir, "slurmctld",
                    [which("slurmctld"), "-D", "-i", "-f", str(self.conf_path)], env,
                    self.log_dir / "slurmctld.out")
        _wait_for(lambda: "UP" in self.run(["scontrol", "ping"], check=False, timeout_s=5).stdout,
                  20.0, f"slurmctld (see {self.log_dir}/slurmctld.log)")
        for node in self.nodes:
            (self.run_dir / "spool" / node).mkdir(parents=True, exist_ok=True)
            procs.start(self.run_dir, f"slurmd-{node}",
                        [which("slurmd"), "-D", "-N", node, "-f", str(self.conf_path)], env,
                        self.log_dir / f"slurmd.{node}.out")

    def hook_script(self, name: str) -> str:
        """Path of our Slurm hook ``name`` (prolog, epilog, healthcheck) that this cluster runs
        (source tree or installed, :mod:`tests.slurmcluster.installed`)."""
        return getattr(self, "hooks", {}).get(name) or str(REPO_ROOT / "slurm" / name)

    # ---------------------------------------------------------------- capctl daemons
    def _start_capctl(self) -> None:
        from tests.slurmcluster import capctl_parts

        capctl_parts.start(self)

    def start_agent(self, node: str, connected: bool = True) -> None:
        """(Re)start ``node``'s agent; waits until ready (and connected when asked)."""
        from tests.slurmcluster import capctl_parts

        capctl_parts.start_agent(self, node, connected=connected)

    def stop_agent(self, node: str) -> None:
        from tests.slurmcluster import capctl_parts

        capctl_parts.stop_agent(self, node)

    def start_coordinator(self) -> None:
        from tests.slurmcluster import capctl_parts

        capctl_parts.start_coordinator(self)

    def stop_coordinator(self) -> None:
        from tests.slurmcluster import capctl_parts

        capctl_parts.stop_coordinator(self)

    def signal_process(self, name: str, sig: int) -> int:
        """Send ``sig`` to a recorded process (``agent-n1``, ``coordinator``, ``slurmd-n2``...)."""
        return procs.send_signal(self.run_dir, name, sig)

    def sim_limits_w(self, node: str) -> list[float]:
        """Requested power limit (W) of every simulated GPU of ``node``, read from the simulator."""
        sim = self.sim_node(node)
        try:
            return [float(sim.read(i)["limit_w"]) for i in range(sim.gpu_count)]
        finally:
            sim.close()

    def agent_status(self, node: str, timeout_s: float = 2.0):
        """``LocalStatusReply`` of ``node``'s agent, or None when it does not answer."""
        from tests.slurmcluster import capctl_parts

        return capctl_parts.agent_status(self, node, timeout_s)

    def coordinator_status(self, timeout_s: float = 2.0):
        """Coordinator ``StatusReply``, or None when it does not answer."""
        from tests.slurmcluster import capctl_parts

        return capctl_parts.coordinator_status(self, timeout_s)

    def sim_node(self, node: str):
        """``node``'s simulated GPU node (capctl.simgpu.node.SimNode) for reads and fault injection."""
        from tests.slurmcluster import capctl_parts

        return capctl_parts.sim_node(self, node)


def _wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (OSError, subprocess.SubprocessError, ClusterError):
            pass
        time.sleep(poll_s)
    raise ClusterError(f"timed out after {timeout_s} s waiting for {what}")


_FIELD = re.compile(r"(\w+(?::\w+)?)=(\S*)")


def _parse_scontrol(text: str) -> dict[str, str]:
    """Parse one-line ``scontrol -o show`` output into ``{field: value}`` (first record)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return {k: v for k, v in _FIELD.findall(line)}
