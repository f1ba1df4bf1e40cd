"""``capctl-agent``: the node agent daemon (one per compute node).

::

    capctl-agent --node NAME --coordinator ADDR --socket PATH --state-dir DIR
                 [--nvml-library system|simulated|PATH] [--allow-simulated] [--policy FILE]
                 [--interval-s S] [--socket-group GROUP] [--log-level LEVEL]
                 [--tls-ca FILE --tls-cert FILE --tls-key FILE [--tls-server-name NAME]] [--insecure]
                 [--metrics-listen HOST:PORT] [--version]

What it does (docs/protocol.md):

- Opens NVML through :class:`nodeagent.nvml.NvmlBackend` (refusing the simulated driver unless
  ``--nvml-library simulated``, or a path with ``--allow-simulated``; the agent itself is typed
  against :class:`nodeagent.backend.GpuBackend`) and manages caps through
  :class:`nodeagent.caps.CapManager` (pre-job limits and job bindings persist in the state
  directory across agent restarts).
- Boot: GPUs found at their default limit (reboot, driver reload) while a safe cap is known (the
  last one the coordinator pushed, saved in the state directory, or the policy's
  ``failsafe.safe_cap_w``) are moved to the safe cap before the agent reports ready
  (``LocalStatus.ready``).
- Keeps one AgentLink stream to the coordinator (:mod:`nodeagent.link`): hello with GPUs,
  bindings and last plan seq; telemetry every interval; job events; plans applied (decreases first,
  clamped to the limit constraints) and acknowledged with the enforced read-back.
- Lease (:mod:`nodeagent.lease`): when it runs out, the GPUs with caps move to
  min(current, safe cap), reported as cap_state ``SAFE_CAP``.
- Drift: :meth:`CapManager.reconcile` every interval; its per-GPU cap_state goes into telemetry.
- Serves AgentLocal (JobStart/JobEnd/LocalStatus) for the Slurm hooks on a root-only unix socket
  with an SO_PEERCRED check (:mod:`nodeagent.local`).

Module layout: this module holds :class:`Agent` (servers and lifecycle) and the command line;
the agent's state and cap helpers are in :mod:`nodeagent.core`, the boot failsafe, link callbacks
and periodic tick in :mod:`nodeagent.loop`, JobStart/JobEnd in :mod:`nodeagent.jobs`, the state
file in :mod:`nodeagent.agentstate` and the protobuf builders in :mod:`nodeagent.messages`.

SIGTERM/SIGINT stop it cleanly (caps stay where they are: the lease/safe caps protect the budget);
SIGHUP re-reads ``--policy`` (:mod:`nodeagent.hangup`); sd_notify readiness (:mod:`capctl.sdnotify`);
Prometheus endpoint with ``--metrics-listen`` (:mod:`nodeagent.metrics`).
Exit codes as :mod:`capctl.errors` (1 bad input, 5 NVML/hardware).
"""


from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from capctl import lifeline
from capctl.errors import CapctlError, UserInputError, run_for_person
from nodeagent.jobs import JobBinding
from nodeagent.link import AgentLinkClient
from nodeagent.loop import AgentLoop

log = logging.getLogger("capctl.agent")

DEFAULT_INTERVAL_S = 5.0
DEFAULT_START_CAP_W = 300.0
"""Start cap (W) without a policy."""


class Agent(JobBinding, AgentLoop):
    """The node agent: the CapManager, the AgentLink client, the local server and the loop.

    Constructed with the arguments of :class:`nodeagent.core.AgentCore`; construction starts
    nothing. :meth:`start` starts the local server, the link and the loop thread; :meth:`stop` ends
    them. Logic tests construct it and call its methods directly (no servers, no threads).
    """

    def local_status(self):
        """AgentLocal.LocalStatus: node, link state, bindings, last telemetry and ``ready``."""
        from capctl.v1 import capctl_pb2

        with self.lock:
            bound = self.bound_indices()
            states = self.caps.states()
            return capctl_pb2.LocalStatusReply(
                node=self.node, coordinator_connected=bool(self.link and self.link.connected),
                jobs=[self._binding(j) for j in sorted(self.jobs)],
                gpus=[self._gpu_telemetry(s, bound, states) for s in self.last_samples], ready=self.ready,
                coordinator_term=self.fence.newest, plans_refused=self.fence.refused, plan_term=self.plan_term,
                coordinator_address=getattr(self.link, "target_now", "") if self.link and self.link.connected else "")

    # ------------------------------------------------------------------------------------------
    # lifecycle
    def start(self) -> None:
        """Load state, apply boot safe caps, report ready, then start the local server, link and loop.

        Raises:
            UserInputError: the local socket cannot be served (another agent holds it, bad path).
        """
        from nodeagent.local import LocalServer

        self.load_state()
        with self.lock:
            self.boot_safe_caps()
            self.arm_boot_lease()
            self.ready = True
        log.info("agent %s ready: %d GPU(s), %d job(s)", self.node, len(self.devices), len(self.jobs))
        self.local = LocalServer(self.socket_path, _LocalServicer(self), allowed_gid=self.socket_gid)
        self.local.start()
        creds, options = None, []
        if self.tls is not None:
            from capctl.security import tls as tls_mod

            creds, options = tls_mod.channel_credentials(self.tls), tls_mod.channel_options(self.tls)
        self.link = AgentLinkClient(self.coordinator, self.hello, self.on_welcome, self.on_plan, self.on_disconnect,
                                    credentials=creds, channel_options=options, backoff_max_s=self.backoff_max_s)
        self.link.start()
        self._loop_thread = threading.Thread(target=self._loop, name="agent-loop", daemon=True)
        self._loop_thread.start()

    def stop(self) -> None:
        """Stop the loop, the link and the local server; save the state file. Caps are left as they are."""
        self.stop_event.set()
        self.wake.set()
        if self.link is not None:
            self.link.stop()
        if self.local is not None:
            self.local.stop()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=5.0)
        with self.lock:
            self.save_state()


class _LocalServicer:
    """AgentLocal gRPC servicer: maps user errors to INVALID_ARGUMENT, hardware errors to INTERNAL."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def _guard(self, fn, request, context):
        try:
            return fn(request)
        except UserInputError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except CapctlError as err:
            context.abort(grpc.StatusCode.INTERNAL, str(err))
        except Exception as err:  # noqa: BLE001
            log.exception("local call failed")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    def JobStart(self, request, context):  # noqa: N802 (gRPC naming)
        return self._guard(self.agent.job_start, request, context)

    def JobEnd(self, request, context):  # noqa: N802
        return self._guard(self.agent.job_end, request, context)

    def LocalStatus(self, request, context):  # noqa: N802
        return self._guard(lambda _r: self.agent.local_status(), request, context)


# ----------------------------------------------------------------------------------------------
# command line

def build_parser() -> argparse.ArgumentParser:
    from capctl.progdoc import add_standard_arguments

    p = add_standard_arguments(argparse.ArgumentParser(prog="capctl-agent", description="capctl node agent (one per compute node)."))
    p.add_argument("--node", required=True, help="Slurm node name of this host")
    p.add_argument("--coordinator", required=True, help="coordinator gRPC address (host:port or unix:/path); several, comma-separated, for coordinators in HA")
    p.add_argument("--socket", default=None,
                   help="AgentLocal unix socket path (%%n = node name; default: the policy's agent.socket_path)")
    p.add_argument("--state-dir", required=True, help="state directory (pre-job limits, bindings); created 0700")
    p.add_argument("--nvml-library", default="system",
                   help="'system' (default), 'simulated' (our simulated driver) or an absolute path")
    p.add_argument("--allow-simulated", action="store_true",
                   help="accept the simulated driver at an absolute --nvml-library path")
    p.add_argument("--policy", default=None, help="policy YAML (start cap, safe cap, socket group, interval)")
    p.add_argument("--interval-s", type=float, default=None,
                   help="telemetry/reconcile period in seconds until the coordinator's Welcome (default: policy's)")
    p.add_argument("--nvml-timeout-s", type=float, default=None,
                   help="per-GPU NVML call timeout in seconds: a GPU whose call does not return in time is "
                        "reported STALLED while the others go on (default 0.5; nodeagent/callguard.py)")
    p.add_argument("--rewrite-interval-s", type=float, default=None,
                   help="a GPU whose limit another process keeps setting (FOREIGN_WRITER) is re-written "
                        "at most once per this many seconds (1..3600; default 30; nodeagent/caps.py)")
    p.add_argument("--socket-group", default=None, help="group allowed on the local socket besides root")
    p.add_argument("--reconnect-max-s", type=float, default=5.0, help="ceiling of the reconnect backoff, seconds")
    p.add_argument("--metrics-listen", default="none", metavar="HOST:PORT",
                   help="Prometheus endpoint (loopback recommended, e.g. 127.0.0.1:9465; default 'none' = off)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    try:
        from capctl.security.tls import add_tls_arguments
    except ImportError:  # pragma: no cover - security module absent
        return p
    add_tls_arguments(p, what="the link to the coordinator")
    from capctl.security.plaintext import add_insecure_argument

    add_insecure_argument(p, "--coordinator address")
    return p


def _load_policy(path: str | None):
    """The policy of ``path``, or the default policy without one.

    Raises:
        UserInputError: the policy file is unreadable or invalid (names file and field).
    """
    from capctl import policy as policy_mod

    if path:
        return policy_mod.load_policy(path)
    return getattr(policy_mod, "DEFAULT_POLICY", None)


@dataclass(frozen=True)
class _Settings:
    """The agent's settings from the command line and the policy (W, s)."""

    socket_path: str
    state_dir: Path
    start_cap_w: float
    safe_cap_w: float | None
    interval_s: float
    socket_gid: int | None
    tls: object | None


def _check_flags(args: argparse.Namespace) -> None:
    """Check the numeric flags, the node name and the coordinator address.

    Raises:
        UserInputError: a value out of range (the message names the flag and what is allowed).
    """
    from capctl.addresses import check_address

    if args.interval_s is not None and not (0.05 <= args.interval_s <= 3600):
        raise UserInputError(f"--interval-s {args.interval_s}: allowed 0.05..3600 seconds")
    if args.nvml_timeout_s is not None and not (0.01 <= args.nvml_timeout_s <= 60):
        raise UserInputError(f"--nvml-timeout-s {args.nvml_timeout_s}: allowed 0.01..60 seconds")
    if args.rewrite_interval_s is not None and not (1 <= args.rewrite_interval_s <= 3600):
        raise UserInputError(f"--rewrite-interval-s {args.rewrite_interval_s}: allowed 1..3600 seconds")
    if not (0.2 <= args.reconnect_max_s <= 300):
        raise UserInputError(f"--reconnect-max-s {args.reconnect_max_s}: allowed 0.2..300 seconds")
    if not args.node.strip() or "/" in args.node:
        raise UserInputError(f"--node {args.node!r}: give the Slurm node name")
    for one in args.coordinator.split(","):  # several: coordinators in HA (the link follows the leader)
        check_address(one.strip(), "--coordinator")


def _tls_config(args: argparse.Namespace):
    """The mTLS configuration of the ``--tls-*`` flags (files read now), or None without them.

    Raises:
        UserInputError: incomplete flags or unreadable files.
    """
    if not (getattr(args, "tls_ca", None) or getattr(args, "tls_cert", None) or getattr(args, "tls_key", None)):
        return None
    from capctl.security.tls import tls_from_args

    tls_config = tls_from_args(args)
    tls_config.read()  # fail now, with the flag named, rather than on every reconnect
    return tls_config


def _socket_path(args: argparse.Namespace, policy) -> str:
    """The AgentLocal socket path (``%n`` = node name), checked and not served by a live agent.

    Raises:
        UserInputError: no path given, a bad path, or another agent serving on it.
    """
    from capctl.addresses import check_socket_path
    from nodeagent.local import socket_in_use

    if args.socket is not None:
        socket_path = args.socket.replace("%n", args.node)
    elif policy is not None:
        socket_path = policy.socket_path(args.node)
    else:
        raise UserInputError("--socket: give the AgentLocal socket path (or a --policy with agent.socket_path)")
    socket_path = check_socket_path(socket_path, "--socket")
    if os.path.exists(socket_path):
        live, detail = socket_in_use(socket_path)
        if live:  # checked before touching any GPU; LocalServer.start checks again when binding
            raise UserInputError(f"--socket: another agent is serving on {socket_path} ({detail}); stop it first")
    return socket_path


def _state_dir(args: argparse.Namespace) -> Path:
    """The state directory, created 0700 when missing.

    Raises:
        UserInputError: it cannot be created or is not writable.
    """
    state_dir = Path(args.state_dir)
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise UserInputError(f"--state-dir {state_dir}: cannot create it ({err.strerror})") from None
    if not os.access(state_dir, os.W_OK):
        raise UserInputError(f"--state-dir {state_dir}: not writable")
    st = state_dir.stat()
    if st.st_mode & 0o022 or st.st_uid != os.geteuid():
        log.warning("--state-dir %s: mode %04o, owner uid %d: others can replace its bindings and pre-job limits; "
                    "make it this user's only (chmod 700, chown)", state_dir, st.st_mode & 0o7777, st.st_uid)
    return state_dir


LOCK_FILE = "agent.lock"
"""The state directory's lock (one agent per state directory, hence per node)."""


def lock_state_dir(state_dir: Path) -> int:
    """Take the state directory's lock (``flock`` on :data:`LOCK_FILE`, our pid written in it) and
    return its descriptor, held until the process ends. Two agents on one state directory called
    each other FOREIGN_WRITER and undid each other's restores (found by a review).

    Raises:
        UserInputError: another agent holds it (its pid named), or the file cannot be opened.
    """
    import fcntl

    path = Path(state_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise UserInputError(f"--state-dir {state_dir}: cannot open its lock {path} ({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise UserInputError(f"--state-dir {state_dir}: another capctl-agent holds it (pid {holder}); one agent "
                             f"per node and state directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _settings(args: argparse.Namespace) -> _Settings:
    """Validate the command line and the policy, before any GPU is touched.

    Raises:
        UserInputError: a bad flag, policy, group, socket or state directory.
    """
    from nodeagent.local import resolve_group

    from capctl.security.plaintext import check_plaintext

    _check_flags(args)
    tls_config = _tls_config(args)
    for one in args.coordinator.split(","):  # each coordinator of an HA list on its own
        check_plaintext(one.strip(), "--coordinator", tls=tls_config is not None,
                        insecure=bool(getattr(args, "insecure", False)), log=log)
    policy = _load_policy(args.policy)
    group = args.socket_group or (policy.agent.socket_group if policy is not None else None)
    socket_gid = resolve_group(group)
    socket_path = _socket_path(args, policy)
    return _Settings(
        socket_path=socket_path, state_dir=_state_dir(args),
        start_cap_w=policy.start_cap_w if policy is not None else DEFAULT_START_CAP_W,
        safe_cap_w=policy.failsafe.safe_cap_w if policy is not None else None,
        interval_s=args.interval_s or (policy.interval_s if policy is not None else DEFAULT_INTERVAL_S),
        socket_gid=socket_gid, tls=tls_config,
    )


def _stop_on_signals() -> tuple[threading.Event, threading.Event]:
    """Events set by SIGTERM / SIGINT (stop) and SIGHUP (reload the policy); handlers installed now."""
    stop, hangup = threading.Event(), threading.Event()

    def _signal(signum, _frame):
        log.info("signal %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _signal)
    signal.signal(signal.SIGINT, _signal)
    signal.signal(signal.SIGHUP, lambda _s, _f: hangup.set())
    return stop, hangup


def _metrics_address(value: str) -> tuple[str, int] | None:
    """``--metrics-listen`` as (host, port), None for 'none'.

    Raises:
        UserInputError: not HOST:PORT with a port 0..65535.
    """
    if value.lower() == "none":
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UserInputError(f"--metrics-listen {value!r}: expected HOST:PORT (port 0..65535, e.g. 127.0.0.1:9465) or 'none'")
    return host.strip("[]") or "127.0.0.1", int(port)


def _serve_metrics(agent, address: tuple[str, int] | None):
    """The agent's metrics endpoint on ``address`` (None: off); an address that cannot be bound is
    logged and the agent runs without it (enforcement matters more than metrics)."""
    if address is None:
        return None
    from nodeagent.metrics import AgentMetrics

    metrics = AgentMetrics(agent)
    try:
        port = metrics.serve(*address)
    except OSError as exc:
        log.error("--metrics-listen %s:%d not served: %s", address[0], address[1], exc.strerror or exc)
        return metrics
    log.info("metrics on http://%s:%d/metrics", address[0], port)
    return metrics


def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM/SIGINT; returns 0.

    Raises:
        UserInputError: bad flags or policy (before any GPU is touched).
        NvmlError: NVML cannot be opened (see :meth:`nodeagent.nvml.NvmlBackend.open`).
    """
    from nodeagent.callguard import DEFAULT_TIMEOUT_S, GuardedBackend
    from nodeagent.caps import CapManager
    from nodeagent.nvml import NvmlBackend

    from capctl import sdnotify
    from nodeagent.hangup import reload_policy

    s = _settings(args)
    metrics_address = _metrics_address(args.metrics_listen)
    lock_fd = lock_state_dir(s.state_dir)  # (before any GPU is touched)  # noqa: F841 (held until exit)
    nvml = NvmlBackend(args.nvml_library, allow_simulated=bool(args.allow_simulated))
    nvml.open()
    backend = GuardedBackend(nvml, args.nvml_timeout_s or DEFAULT_TIMEOUT_S)  # per-GPU NVML timeouts
    agent = metrics = None
    stop, hangup = _stop_on_signals()
    try:
        caps = CapManager(backend, s.state_dir, **({} if args.rewrite_interval_s is None
                                                   else {"rewrite_interval_s": args.rewrite_interval_s}))
        agent = Agent(args.node, args.coordinator, s.socket_path, s.state_dir, backend, caps,
                      start_cap_w=s.start_cap_w, policy_safe_cap_w=s.safe_cap_w, interval_s=s.interval_s,
                      socket_gid=s.socket_gid, backoff_max_s=args.reconnect_max_s, tls=s.tls)
        agent.start()
        metrics = _serve_metrics(agent, metrics_address)
        sdnotify.ready(f"{len(agent.devices)} GPU(s) at their boot caps; coordinator {args.coordinator}")
        while not stop.wait(0.2):
            if hangup.is_set():
                hangup.clear()
                reload_policy(agent, args.policy, metrics.reloaded if metrics is not None else None)
    finally:
        sdnotify.stopping()
        if metrics is not None:
            metrics.close()
        if agent is not None:
            agent.stop()
        backend.close()
    log.info("agent %s stopped", args.node)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``capctl-agent``; returns the exit status."""
    lifeline.watch_parent()  # started by a test or the demo: stop when that parent dies
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until run() handles it: a reload, never an exit
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s capctl-agent[%(process)d] %(levelname)s %(name)s: %(message)s")
    from capctl.security import redact

    redact.install()  # no secrets in logs
    return run_for_person("capctl-agent", run, args)


if __name__ == "__main__":
    sys.exit(main())
