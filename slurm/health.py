"""Slurm ``HealthCheckProgram``: keep jobs off a node until its capctl agent controls the GPUs.

Run as ``python -m slurm.health [--drain]`` by the ``slurm/healthcheck`` wrapper (slurmd
runs ``HealthCheckProgram`` as root every ``HealthCheckInterval`` seconds, with no PATH).

The check asks the local agent's ``AgentLocal.LocalStatus`` (socket from the same configuration
as the prolog, :mod:`slurm.config`) within ``--timeout-s``:

- healthy: the agent answers and reports ``ready`` (after a boot or driver reload it has applied
  its safe cap). Exit 0. With ``--drain``, a drain that this check set earlier (reason starting
  with :data:`REASON_PREFIX`) is lifted with ``scontrol update ... State=RESUME``; a drain set by
  anyone else is never touched (nor replaced by ours: :func:`drain_action`).
- unhealthy: no answer, or ``ready`` false. Exit 1, one line on stdout. With ``--drain`` (the
  admin's explicit choice in slurm.conf), the node is drained with reason ``capctl: <why>`` so that
  running jobs finish and no new job starts on GPUs capctl does not control.

Never a traceback; a failing ``scontrol`` is reported and the exit status still says the health.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from slurm.config import load_config

REASON_PREFIX = "capctl:"
"""Drain reasons set by this check start with this; only those are lifted by it."""

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1


def agent_health(socket_path: str, timeout_s: float) -> tuple[bool, str]:
    """Ask the agent on ``socket_path``; returns ``(healthy, text)``. Never raises for agent errors."""
    from capctl.agentclient import LocalClient
    from capctl.errors import CapctlError

    try:
        with LocalClient(socket_path, timeout_s=timeout_s) as client:
            reply = client.local_status()
    except CapctlError as err:
        return False, f"agent not reachable on {socket_path} ({str(err).splitlines()[0]})"
    if not reply.ready:
        return False, f"agent on {reply.node or '?'} not ready (safe cap not yet applied)"
    link = "connected to" if reply.coordinator_connected else "not connected to"
    return True, f"agent on {reply.node} ready, {link} the coordinator"


def _scontrol() -> str | None:
    return shutil.which("scontrol", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")


UNKNOWN = None
""":func:`node_reason` when the node's state could not be read (no scontrol, a failure, a timeout)."""


def node_reason(node: str, timeout_s: float) -> str | None:
    """The node's current reason from ``scontrol -o show node`` ("" when it has none: not drained,
    down or failing for any reason), or :data:`UNKNOWN` (None) when it could not be read."""
    exe = _scontrol()
    if exe is None:
        return UNKNOWN
    try:
        res = subprocess.run([exe, "-o", "show", "node", node], capture_output=True, text=True,
                             timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    out = res.stdout
    if res.returncode != 0 or f"NodeName={node} " not in out + " ":
        return UNKNOWN
    for field in out.split():
        if field.startswith("Reason="):
            # Reason=<text> [user@time] may contain spaces: take the rest of the line after it
            return out.split("Reason=", 1)[1].split(" [", 1)[0].strip()
    return ""


def set_drain(node: str, reason: str | None, timeout_s: float) -> str:
    """Drain ``node`` with ``reason`` (or resume it when ``reason`` is None); returns a status text."""
    exe = _scontrol()
    if exe is None:
        return "scontrol not found: node state unchanged"
    args = ([exe, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"] if reason
            else [exe, "update", f"NodeName={node}", "State=RESUME"])
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol failed: {err}"
    if res.returncode != 0:
        return f"scontrol failed: {(res.stderr or res.stdout).strip()}"
    return f"node {node} {'drained' if reason else 'resumed'}"


def drain_action(node: str, healthy: bool, text: str, current: str | None, timeout_s: float) -> str:
    """With ``--drain``: what to do given the node's current reason ``current`` (:func:`node_reason`)
    and the check's verdict; returns the text appended to the line ("" when nothing is done).

    Only this check's own drain is set or lifted: an unhealthy node is drained only when it has no
    reason at all, a healthy one resumed only from a reason of ours (:data:`REASON_PREFIX`); a node
    drained, down or failing for anyone else's reason, or whose state could not be read, is left
    as it is (a review found an admin's ``maintenance`` drain replaced by ours, then lifted)."""
    if current is UNKNOWN:
        return "; node state unknown (scontrol): left as it is"
    ours = current.startswith(REASON_PREFIX)
    if not healthy and not current:
        return f"; {set_drain(node, f'{REASON_PREFIX} {text}', timeout_s)}"
    if not healthy and not ours:
        return f"; already has a reason of another ({current[:80]!r}): left as it is"
    if healthy and ours:
        return f"; {set_drain(node, None, timeout_s)}"
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns :data:`EXIT_HEALTHY` or :data:`EXIT_UNHEALTHY`."""
    from capctl.progdoc import add_standard_arguments

    parser = add_standard_arguments(argparse.ArgumentParser(prog="capctl-healthcheck", description=__doc__.splitlines()[0]))
    parser.add_argument("--drain", action="store_true",
                        help="drain the node while unhealthy and lift only this check's own drain")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline of the agent call (s)")
    args = parser.parse_args(argv)
    if not 0 < args.timeout_s <= 60:
        print(f"capctl-healthcheck: --timeout-s {args.timeout_s}: allowed 0 < s <= 60", file=sys.stderr)
        return 2
    cfg = load_config()
    healthy, text = agent_health(cfg.socket_path, args.timeout_s)
    line = f"capctl health {cfg.node}: {'ok' if healthy else 'UNHEALTHY'}: {text}"
    if args.drain:
        line += drain_action(cfg.node, healthy, text, node_reason(cfg.node, args.timeout_s), args.timeout_s)
    print(line)
    return EXIT_HEALTHY if healthy else EXIT_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
