"""Start and stop capctl daemons as real processes (used by ``capctl demo`` and by the tests).

Everything here is bounded: every wait has a deadline, and :meth:`Proc.stop` sends SIGTERM, waits,
then SIGKILLs. :class:`ProcessGroup` stops everything it started (also on exceptions, as a context
manager). Addresses are unix sockets or 127.0.0.1 ports only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from capctl import lifeline
from capctl.errors import CapctlError, UnreachableError

AGENT_MODULE = "nodeagent.daemon"
"""Module of ``capctl-agent`` (see :func:`daemon_argv`: named processes, not ``python -c``)."""
COORDINATOR_MODULE = "coordinator.daemon"



def daemon_argv(script: str, module: str) -> list[str]:
    """Command line starting a daemon so that ``pgrep -f capctl-agent`` (``ps``) finds it.

    The console script next to the interpreter (``.venv/bin/capctl-agent``), run by this interpreter
    (same environment, same code); ``python -m MODULE`` where it is not installed.
    """
    candidate = Path(sys.executable).parent / script
    if candidate.is_file():
        return [sys.executable, str(candidate)]
    return [sys.executable, "-m", module]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (racy by nature; good enough for tests and the demo)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.05,
               what: str = "condition", proc: Proc | None = None):
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout_s`` passes.

    Raises:
        TimeoutError: the deadline passed (names ``what``); also when ``proc`` exited meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 — predicate may fail until ready
            last_exc = exc
        if proc is not None and proc.poll() is not None:
            raise TimeoutError(f"{what}: {proc.name} exited with {proc.poll()}:\n{proc.log_tail()}")
        if time.monotonic() >= deadline:
            extra = f" (last error: {last_exc})" if last_exc else ""
            tail = f"\n{proc.name} log:\n{proc.log_tail()}" if proc is not None else ""
            raise TimeoutError(f"{what} not reached within {timeout_s:g} s{extra}{tail}")
        time.sleep(interval_s)


class Proc:
    """A started daemon process with its log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = Path(log_path)
        self.env = env
        self._log = open(self.log_path, "ab")
        # own session (a Ctrl-C on the terminal reaches only us; we stop them in order), but they die
        # with us through their lifeline (capctl.lifeline: no fork-time code, safe with gRPC loaded),
        # so a SIGKILLed demo or test leaves no orphaned daemons behind
        self.popen = lifeline.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signum)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit status."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5.0)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL now (fault injection)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=5.0)


class AgentProc(Proc):
    """A ``capctl-agent`` process; ``socket_path`` is its AgentLocal socket."""

    node: str
    socket_path: str
    state_dir: Path

    def client(self, timeout_s: float = 5.0):
        from capctl.agentclient import LocalClient

        return LocalClient(self.socket_path, timeout_s=timeout_s)

    def status(self, timeout_s: float = 2.0):
        with self.client(timeout_s) as c:
            return c.local_status()

    def wait_ready(self, timeout_s: float = 20.0, connected: bool = False):
        """Wait until LocalStatus says ready (and connected to the coordinator if asked)."""
        def ok():
            st = self.status()
            return st if st.ready and (st.coordinator_connected or not connected) else None

        return wait_until(ok, timeout_s, 0.1, f"agent {self.node} ready" + (" and connected" if connected else ""),
                          proc=self)


class CoordinatorProc(Proc):
    """A ``capctl-coordinator`` process: ``address`` serves AgentLink and read-only Admin;
    ``admin_address`` (its root-only admin unix socket) the full Admin service (budget set)."""

    address: str
    admin_address: str
    state_dir: Path

    def wait_serving(self, timeout_s: float = 20.0) -> None:
        """Wait until the Admin service answers Status."""
        import grpc

        from capctl.v1 import capctl_pb2, capctl_pb2_grpc

        def ok():
            with grpc.insecure_channel(self.address) as ch:
                capctl_pb2_grpc.AdminStub(ch).Status(capctl_pb2.StatusRequest(), timeout=1.0)
            return True

        wait_until(ok, timeout_s, 0.1, f"coordinator at {self.address} serving", proc=self)

    def status(self, timeout_s: float = 2.0):
        import grpc

        from capctl.v1 import capctl_pb2, capctl_pb2_grpc

        with grpc.insecure_channel(self.address) as ch:
            return capctl_pb2_grpc.AdminStub(ch).Status(capctl_pb2.StatusRequest(), timeout=timeout_s)


def _base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CAPCTL_SIMGPU_NODE", None)
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def start_agent(workdir: Path, node: str, coordinator: str, *, sim_env: dict[str, str] | None = None,
                nvml_library: str = "simulated", policy: str | Path | None = None, interval_s: float | None = None,
                reconnect_max_s: float | None = None, extra_args: list[str] | None = None,
                log_level: str = "INFO") -> AgentProc:
    """Start ``capctl-agent`` for ``node`` with its socket and state dir under ``workdir``.

    ``sim_env``: the simulated node's environment (``SimNode.env()``). Does not wait; call
    :meth:`AgentProc.wait_ready`.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    socket_path = workdir / f"agent-{node}.sock"
    state_dir = workdir / f"agent-{node}-state"
    argv = [*daemon_argv("capctl-agent", AGENT_MODULE), "--node", node, "--coordinator", coordinator, "--socket",
            str(socket_path), "--state-dir", str(state_dir), "--nvml-library", nvml_library, "--log-level", log_level]
    if policy is not None:
        argv += ["--policy", str(policy)]
    if interval_s is not None:
        argv += ["--interval-s", str(interval_s)]
    if reconnect_max_s is not None:
        argv += ["--reconnect-max-s", str(reconnect_max_s)]
    argv += list(extra_args or [])
    proc = AgentProc(f"agent-{node}", argv, workdir / f"agent-{node}.log", env=_base_env(sim_env))
    proc.node = node
    proc.socket_path = str(socket_path)
    proc.state_dir = state_dir
    return proc


def start_coordinator(workdir: Path, policy: str | Path, *, listen: str | None = None, dry_run: bool = False,
                      extra_args: list[str] | None = None, name: str = "coordinator",
                      metrics_port: int = 0) -> CoordinatorProc:
    """Start ``capctl-coordinator`` on ``listen`` (default: a unix socket under ``workdir``) with its
    admin socket ``workdir/<name>-admin.sock``. Does not wait; call :meth:`CoordinatorProc.wait_serving`."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    listen = listen or f"unix:{workdir / (name + '.sock')}"
    admin_socket = workdir / f"{name}-admin.sock"
    state_dir = workdir / f"{name}-state"
    argv = [*daemon_argv("capctl-coordinator", COORDINATOR_MODULE), "--policy", str(policy), "--listen", listen,
            "--state-dir", str(state_dir), "--admin-socket", str(admin_socket)]
    argv += ["--metrics-port", str(metrics_port)]  # 0: any free loopback port, -1: off
    if dry_run:
        argv.append("--dry-run")
    argv += list(extra_args or [])
    proc = CoordinatorProc(name, argv, workdir / f"{name}.log", env=_base_env())
    proc.address = listen
    proc.admin_address = f"unix:{admin_socket}"
    proc.state_dir = state_dir
    return proc


class ProcessGroup:
    """Tracks started processes; :meth:`stop_all` (or leaving the ``with`` block) stops them all,
    agents before the coordinator."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def stop_all(self, timeout_s: float = 5.0) -> None:
        errors = []
        for proc in sorted(self.procs, key=lambda p: 0 if isinstance(p, AgentProc) else 1):
            try:
                proc.stop(timeout_s)
            except Exception as exc:  # noqa: BLE001 — stop the others anyway
                errors.append(f"{proc.name}: {exc}")
        self.procs.clear()
        if errors:
            raise CapctlError("could not stop: " + "; ".join(errors))

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def check_alive(procs: list[Proc]) -> None:
    """Raise :class:`UnreachableError` naming the first process that exited, with its log tail."""
    for p in procs:
        if p.poll() is not None:
            raise UnreachableError(f"{p.name} exited with status {p.poll()}; last log lines:\n{p.log_tail(15)}")
