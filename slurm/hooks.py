"""Slurm node prolog/epilog: bind a job's GPUs to the local node agent, bounded in time.

Run as ``python -m slurm.hooks prolog|epilog`` by the ``slurm/prolog`` / ``slurm/epilog``
wrappers (slurmd runs them as root, with the job's ``SLURM_*`` variables and no PATH).

- prolog: ``AgentLocal.JobStart(job, GPUs from SLURM_JOB_GPUS, user, partition, account, qos)``;
  the agent saves the pre-job limits, applies the policy's start cap and tells the coordinator.
- epilog: ``AgentLocal.JobEnd(job)``; the agent restores the pre-job limits per GPU (failures are
  retried by the agent and shown as ``RESTORE_FAILED``) and unbinds. Valid without a prolog.

Time bound: the whole run, interpreter start included, ends within the policy's
``prolog.timeout_s`` (:mod:`slurm.config`): the agent call gets the remaining time as its
gRPC deadline, and a watchdog thread ends the process at the bound whatever else happens.

Exit status: 0 when the job may run (success, or any failure under fail-open);
:data:`EXIT_FAIL_CLOSED` when ``prolog.on_unreachable: fail-closed`` and the agent or the
coordinator could not be used (the wrapper turns it into exit 1: Slurm then drains the node, the
admin's choice). Never a traceback: every outcome is one log line (file, stderr, syslog) with the
job id, the node, the outcome and the run's duration.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import socket
import sys
import threading
import time

EXIT_OK = 0
EXIT_FAIL_CLOSED = 75
"""Exit status of an on-purpose failure (fail-closed); the shell wrapper exits 1 on it."""
MARGIN_S = 0.15
"""Time kept after the agent call's deadline for logging and exit, in seconds."""
WATCHDOG_EARLY_S = 0.05
"""The watchdog ends the process this many seconds before the bound."""


def process_age_s() -> float:
    """Seconds since this process started (``/proc/self/stat`` start time vs ``/proc/uptime``);
    0.0 when unavailable. Includes the interpreter's start-up and the wrapper's exec."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime_s = float(fh.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


SYSLOG_SOCKET = "/dev/log"
"""The local syslog socket (journald, rsyslog: a datagram socket)."""
SYSLOG_MAX_BYTES = 2048
"""Longest syslog message sent (RFC 3164 relays keep 1,024; local daemons take more)."""


def send_syslog(tag: str, warning: bool, text: str, path: str = SYSLOG_SOCKET) -> bool:
    """One line to the local syslog (facility daemon; ``warning`` or info), ``<PRI>TAG[PID]: TEXT``
    (RFC 3164, as ``logger`` writes it), on a non-blocking datagram socket: dropped, never waited
    for, when syslog does not read. Returns True when sent.

    Why not the ``syslog`` module: its ``send`` blocks while the socket's queue is full; a hung
    journald held a prolog that had finished its work until slurmd's ``PrologEpilogTimeout`` (it
    blocked under the log's lock, so the watchdog could not end it either), and slurmd drains a
    node whose prolog times out (found by a review, 5 Dec 2026)."""
    pri = 3 * 8 + (4 if warning else 6)  # LOG_DAEMON (3) * 8 + LOG_WARNING (4) / LOG_INFO (6)
    data = f"<{pri}>{tag}[{os.getpid()}]: {text}".encode("utf-8", "replace")[:SYSLOG_MAX_BYTES]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(data, path)
    except OSError:  # no syslog, a full queue (BlockingIOError), a stream socket: the file and stderr have it
        return False
    return True


class HookLog:
    """One line per event: ``<UTC time> capctl-<hook>[pid]: job=J node=N <text> {json}``.

    Written to the hook log file (created with its directory when missing; skipped if unwritable),
    to stderr (slurmd keeps it in its log on failure) and to syslog (facility daemon).
    """

    def __init__(self, hook: str, job_id: str, node: str, path: str | None) -> None:
        self.hook, self.job_id, self.node, self.path = hook, job_id, node, path
        self.lock = threading.Lock()

    def set_path(self, path: str | None) -> None:
        self.path = path

    def event(self, text: str, fields: dict, *, to_stderr: bool = True, priority: str = "info") -> None:
        fields = {"hook": self.hook, "job_id": self.job_id, "node": self.node, "pid": os.getpid(), **fields}
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        line = (f"{now} capctl-{self.hook}[{os.getpid()}]: job={self.job_id or '-'} node={self.node} "
                f"{text} {json.dumps(fields, sort_keys=True, default=str)}")
        with self.lock:
            if self.path:
                try:
                    os.makedirs(os.path.dirname(self.path) or ".", mode=0o755, exist_ok=True)
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    try:
                        os.write(fd, (line + "\n").encode("utf-8", "replace"))
                    finally:
                        os.close(fd)
                except OSError:
                    pass
            if to_stderr:
                try:
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
                send_syslog(f"capctl-{self.hook}", priority == "warning",
                            f"job={self.job_id or '-'} node={self.node} {text}")


class Run:
    """State of one hook run: timing, log, and the single place where the process exits."""

    def __init__(self, hook: str, env: dict[str, str]) -> None:
        from slurm.config import DEFAULT_TIMEOUT_S, agent_socket_path, env_timeout_s, node_name

        self.hook = hook
        self.env = env
        self.t0 = time.monotonic() - process_age_s()  # monotonic time of the process start
        self.job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
        self.log = HookLog(hook, self.job_id, node_name(env), env.get("CAPCTL_HOOK_LOG"))
        self.fail_open = env.get("CAPCTL_ON_UNREACHABLE", "fail-open") != "fail-closed"
        self.timeout_s = env_timeout_s(env) or DEFAULT_TIMEOUT_S
        self.extra: dict = {}
        # the agent's socket before the configuration is loaded (a bound reached before it: the
        # job's end still goes to the drop box when that socket is there; found by a try-out)
        self.socket_guess = agent_socket_path(env)
        self._done = threading.Lock()
        self._timer: threading.Timer | None = None
        self.arm()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def remaining_s(self) -> float:
        return self.timeout_s - self.elapsed_s()

    def arm(self) -> None:
        """(Re)start the watchdog that ends the process at the bound."""
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.01, self.remaining_s() - WATCHDOG_EARLY_S)
        self._timer = threading.Timer(delay, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _leave_for_agent(self, fields: dict) -> None:
        """The epilog's end was not delivered: leave it in the agent's drop box
        (:mod:`capctl.endedjobs`), noted in ``fields`` (``left_for_agent``: the file, or the error)."""
        from capctl import endedjobs

        socket_path = self.extra.get("socket") or self.socket_guess
        if not self.job_id or not socket_path or not os.path.isdir(os.path.dirname(socket_path) or "."):
            # no agent directory (no agent deployed on this node): nothing is created (a review
            # found /run/capctl/ made, and a file left per job, on a node without an agent); an
            # agent that is down (its socket gone) still finds the job's end when it starts
            fields["left_for_agent"] = f"not written: no directory {os.path.dirname(socket_path) or '.'}"
            return
        try:
            path = endedjobs.leave(socket_path, self.job_id)
        except OSError as err:
            fields["left_for_agent"] = f"not written: {err}"
            return
        if path:
            fields["left_for_agent"] = path

    def _expire(self) -> None:
        self.finish("timeout", f"no answer within the {self.timeout_s:g} s bound", failure=True)

    def finish(self, outcome: str, text: str, *, failure: bool, job_data: bool = False, **fields) -> int:
        """Log the outcome and exit the process (from any thread); returns only in tests.
        ``job_data``: a failure of this job's own data (its GPU list, an id or label the agent
        refuses), which fails open even under fail-closed: draining the node would not fix it, and
        a requeued job would drain node after node (found by a review)."""
        if not self._done.acquire(blocking=False):
            return EXIT_OK  # another thread already finishing
        fail_closed = failure and not self.fail_open and not job_data
        code = EXIT_FAIL_CLOSED if fail_closed else EXIT_OK
        if failure and self.hook == "epilog":
            self._leave_for_agent(fields)
        if failure:
            text += " -> fail-closed: hook fails on purpose" if fail_closed else _fail_open_text(self.hook, outcome)
            if job_data and not self.fail_open:
                text += " (this job's data: fail-closed does not drain the node for it)"
        self.log.event(text, {"outcome": outcome, "exit": 0 if code == 0 else 1, "failure": failure,
                              "duration_s": round(self.elapsed_s(), 4), "timeout_s": self.timeout_s,
                              "fail_open": self.fail_open, **self.extra, **fields},
                       priority="warning" if failure else "info")
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os._exit(code)


def _watts(value_w: float) -> float | None:
    """A limit of a ``GpuCapResult`` (W) for the log, to 0.1 W; None where the agent could not read it:
    the message carries 0 then (proto3, no presence), and no GPU has a 0 W limit (a stalled GPU was
    logged with ``"cap_w": 0.0, "enforced_w": 0.0``; a try-out)."""
    return round(value_w, 1) if math.isfinite(value_w) and value_w > 0 else None


def _gpu_results(results) -> list[dict]:
    """The hook log's per-GPU outcome of the agent's ``GpuCapResult`` list (W; None: not read)."""
    return [{"index": g.index, "cap_w": _watts(g.cap_w), "enforced_w": _watts(g.enforced_w), "ok": g.ok,
             **({"error": g.error} if g.error else {})} for g in results]


def _run(run: Run) -> None:
    """The hook's work (see module docstring); every path ends in ``run.finish``."""
    cfg = _configure(run)
    if not run.job_id:
        run.finish("bad-env", "SLURM_JOB_ID not set (not run by slurmd?)", failure=False)
    gpus = None
    if run.hook == "prolog":
        gpus = _job_gpus(run)
    else:
        run.extra["gpu_ids"] = [g for g in (run.env.get("SLURM_JOB_GPUS") or "").split(",") if g]

    call_timeout_s = run.remaining_s() - MARGIN_S
    if call_timeout_s <= 0.01:
        run.finish("timeout", "no time left for the agent call", failure=True)
    reply = _call_agent(run, cfg.socket_path, gpus, call_timeout_s)
    if run.hook == "prolog":
        _finish_prolog(run, reply)
    else:
        _finish_epilog(run, reply)


def _configure(run: Run):
    """Load the hook configuration (:func:`slurm.config.load_config`) into ``run``: fail-open
    choice, time bound [s] (re-arming the watchdog), log path; logs "begin". Returns the config."""
    from slurm.config import load_config

    cfg = load_config(run.env)
    run.fail_open = cfg.fail_open
    run.timeout_s = cfg.timeout_s
    run.log.set_path(cfg.log_path)
    run.arm()
    run.extra = {"socket": cfg.socket_path}
    if cfg.problems:
        run.extra["config_problems"] = cfg.problems
    run.log.event("begin", {"outcome": "begin"}, to_stderr=False)
    return cfg


def _job_gpus(run: Run):
    """The job's GPUs on this node from ``SLURM_JOB_GPUS`` (:func:`slurm.gpus.parse_job_gpus`).

    Finishes the run on unparsable ids (failure) or no GPU (nothing to bind)."""
    from capctl.errors import UserInputError
    from slurm.gpus import parse_job_gpus

    gpus = None
    try:
        gpus = parse_job_gpus(run.env.get("SLURM_JOB_GPUS"))
    except UserInputError as err:
        run.finish("bad-gpus", str(err), failure=True, job_data=True)
    assert gpus is not None
    run.extra.update(gpu_ids=list(gpus.ids), gpu_id_kind=gpus.kind_name)
    if not gpus.ids:
        run.finish("no-gpus", "job holds no GPU on this node: nothing to bind", failure=False)
    return gpus


def _call_agent(run: Run, socket_path: str, gpus, call_timeout_s: float):
    """``JobStart`` (prolog, for ``gpus``) or ``JobEnd`` (epilog) on the local agent at
    ``socket_path`` with a ``call_timeout_s`` [s] deadline. Returns the reply; finishes the run
    (failure) when the agent is unreachable, refuses or rejects the call."""
    from capctl.agentclient import LocalClient
    from capctl.errors import PermissionDeniedError, UnreachableError, UserInputError

    try:
        with LocalClient(socket_path, timeout_s=call_timeout_s) as client:
            if run.hook == "prolog":
                return client.job_start(
                    run.job_id, list(gpus.ids), gpus.kind,
                    user=run.env.get("SLURM_JOB_USER", ""), partition=run.env.get("SLURM_JOB_PARTITION", ""),
                    account=run.env.get("SLURM_JOB_ACCOUNT", ""), qos=run.env.get("SLURM_JOB_QOS", ""))
            return client.job_end(run.job_id)
    except UnreachableError as err:
        run.finish("agent-unreachable", str(err), failure=True)
    except PermissionDeniedError as err:
        run.finish("agent-refused", str(err), failure=True)
    except UserInputError as err:
        run.finish("agent-rejected", str(err), failure=True, job_data=True)
    # run.finish returned: another thread (watchdog, signal) is already ending the process; end
    # this path like any other error, in main's handler
    raise RuntimeError("agent call failed while the run is being finished")


_UNTOUCHED = ("agent-unreachable", "agent-refused", "agent-rejected")
"""Prolog outcomes in which the agent changed no cap (its GPUs keep the caps they have)."""


def _fail_open_text(hook: str, outcome: str) -> str:
    """The suffix of a failure that fails open: the job runs; what its GPUs' caps are is said only
    where the agent did nothing (a prolog whose coordinator was down ran the job at the start cap,
    and the suffix said the caps were kept: found by a try-out)."""
    if hook != "prolog":
        return " -> fail-open"
    return " -> fail-open: the job runs" + (", its GPUs keep the caps they have" if outcome in _UNTOUCHED else "")


def _finish_prolog(run: Run, reply) -> None:
    """Finish the prolog from the agent's JobStart ``reply``: bound, start cap failed (failure) or
    coordinator not connected (failure: the job runs at the start/safe cap)."""
    results = _gpu_results(reply.gpus)
    connected = bool(reply.coordinator_connected)
    if not reply.ok:
        run.finish("start-cap-failed", f"agent could not apply the start cap: {reply.message}",
                   failure=True, gpus=results, coordinator_connected=connected)
    if not connected:
        run.finish("coordinator-unreachable",
                   "bound; coordinator not connected, the job runs at the start/safe cap",
                   failure=True, gpus=results, coordinator_connected=False)
    run.finish("bound", f"bound {len(results)} GPU(s), start cap applied", failure=False,
               gpus=results, coordinator_connected=True)


def _finish_epilog(run: Run, reply) -> None:
    """Finish the epilog from the agent's JobEnd ``reply``: unbound, or some pre-job limits not
    restored (not a failure: the agent keeps retrying and reports RESTORE_FAILED)."""
    results = _gpu_results(reply.gpus)
    if not reply.ok:
        # The agent keeps retrying and reports RESTORE_FAILED; draining the node would not help.
        run.finish("restore-failed", f"some pre-job limits not restored (agent retries): {reply.message}",
                   failure=False, gpus=results)
    # (held below the pre-job limit by the allowance, or held for unusable limit constraints)
    # (or a GPU reported not ok: held by another writer, or in a held state and never written)
    held = any(p in (reply.message or "") for p in ("held below the pre-job limit", "not restored by capctl")) \
        or not all(g.ok for g in reply.gpus)
    run.finish("unbound", f"unbound; {reply.message}" if held else f"restored {len(results)} GPU(s) and unbound",
               failure=False, gpus=results)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``argv`` = ``["prolog"]`` or ``["epilog"]``. Exits the process (see module doc)."""
    argv = sys.argv[1:] if argv is None else argv
    hook = argv[0] if argv else ""
    if hook not in ("prolog", "epilog"):
        sys.stderr.write("usage: python -m slurm.hooks prolog|epilog\n")
        return 2
    return run_guarded(Run(hook, dict(os.environ)), _run)


def run_guarded(run: Run, body) -> int:
    """Run ``body(run)``, which ends by :meth:`Run.finish` (exits the process). A signal (TERM, INT,
    HUP), an exception or a body that returns without an outcome still finish with one line and
    the hook's exit status, never a traceback."""

    def on_signal(signum, _frame):
        run.finish("signalled", f"terminated by signal {signum}", failure=True)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        body(run)
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - never a traceback from a Slurm hook
        run.finish("internal-error", f"{type(err).__name__}: {err}", failure=True)
    return run.finish("internal-error", "hook ended without an outcome", failure=True)


if __name__ == "__main__":
    sys.exit(main())
