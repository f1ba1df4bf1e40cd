"""``capctl status | nodes | jobs | explain JOB_ID | budget set WATTS``: the coordinator's view.

Every command takes ``--coordinator ADDR`` (else ``$CAPCTL_COORDINATOR``, else the default unix
socket, see :mod:`capctl.cli.rpc`) and ``--json`` (one JSON object on stdout; the schema of
``capctl status --json`` is docs/status-schema.json and is stable: fields are only ever added).
Tables are for people and may change. Exit codes: :mod:`capctl.errors` (3 = coordinator
unreachable, 4 = permission denied, 6 = job not found, 1 = refused input such as a budget below the
sum of minimum caps); with ``--json`` an error is also one JSON object on stdout
(``{"ok": false, ..., "error", "exit_code"}``, :func:`capctl.errors.run_for_person`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

from capctl.errors import CapctlError, UserInputError
from capctl.wattunits import format_watts

from capctl.statusview import (
    STATUS_SCHEMA_VERSION,
    _num,
    explain_dict,
    render_explain,
    render_gpus,
    render_jobs,
    render_nodes_summary,
    render_status,
    status_dict,
)


# ----------------------------------------------------------------------------------------------
# commands

def _emit(obj: dict) -> None:
    json.dump(obj, sys.stdout, sort_keys=False)
    sys.stdout.write("\n")
    sys.stdout.flush()


def fetch_status(address: str | None, method: str = "Status") -> dict:
    """Call Admin.Status (or Nodes/Jobs) and return :func:`status_dict`. Raises CapctlError."""
    from capctl.cli.rpc import admin_client

    with admin_client(address) as client:
        reply = {"Status": client.status, "Nodes": client.nodes, "Jobs": client.jobs}[method]()
    return status_dict(reply)


class GivenSeconds(float):
    """A number of seconds from the command line that keeps its text (``text``), for messages:
    ``--watch-interval-s 1e400`` read as inf was reported ``--watch-interval-s inf`` (a try-out)."""

    text: str

    def __new__(cls, text: str) -> "GivenSeconds":
        value = super().__new__(cls, text)  # ValueError for no number: argparse's "invalid value"
        value.text = text
        return value


def given(value) -> str:
    """``value`` as the user wrote it (:class:`GivenSeconds`), else ``{:g}``."""
    return getattr(value, "text", None) or f"{value:g}"


WATCH_MIN_INTERVAL_S = 0.2
"""Lower bound of ``--watch-interval-s`` (each refresh is three RPCs' worth of rendering)."""


WATCH_DEFAULT_INTERVAL_S = 2.0
"""``--watch-interval-s`` when not given."""


HOTTEST_DEFAULT = 5
"""How many of the hottest GPUs ``capctl status`` lists when ``--hottest`` is not given."""


def _watch_options(args) -> None:
    """Refuse ``--watch-interval-s`` without ``--watch`` (it was ignored without a word: a review),
    and fill in its default."""
    if args.watch_interval_s is not None and not args.watch:
        raise UserInputError(f"--watch-interval-s {given(args.watch_interval_s)}: only with --watch (it sets how often "
                             f"--watch refreshes); add --watch, or leave it out for one status")
    if args.count is not None and not args.watch:
        raise UserInputError(f"--count {args.count}: only with --watch (how many refreshes); add --watch, or leave "
                             "it out for one status")
    if args.watch_interval_s is None:
        args.watch_interval_s = WATCH_DEFAULT_INTERVAL_S
    elif not given(args.watch_interval_s).isascii():  # float() reads full-width and other Unicode digits
        raise UserInputError(f"--watch-interval-s {given(args.watch_interval_s)}: write the seconds in ASCII digits "
                             "0-9, e.g. 2 or 0.5")


def cmd_status(args) -> int:
    if args.hottest is not None and args.hottest < 0:
        raise UserInputError(f"--hottest {args.hottest}: give a count >= 0 (0: none)")
    if args.hottest is not None and args.json:  # (it was ignored without a word: a try-out)
        raise UserInputError(f"--hottest {args.hottest}: only for the text view (--json lists every GPU); leave "
                             "one of them out")
    args.hottest = HOTTEST_DEFAULT if args.hottest is None else args.hottest
    _watch_options(args)
    if not args.watch:
        d = fetch_status(args.coordinator)
        _emit(d) if args.json else print(render_status(d, hottest=args.hottest))
        return 0
    if not math.isfinite(args.watch_interval_s) or not WATCH_MIN_INTERVAL_S <= args.watch_interval_s <= 3600:
        raise UserInputError(f"--watch-interval-s {given(args.watch_interval_s)}: allowed {WATCH_MIN_INTERVAL_S:g}..3600 "
                             "seconds")
    state = {"reached": False}  # did the last refresh reach the coordinator? (Ctrl-C exit status)
    try:
        _watch(args, state)
    except KeyboardInterrupt:
        # the usual way out of --watch: 0 when the coordinator answered the last refresh,
        # 130 (interrupted) while it was unreachable
        return 0 if state["reached"] else 130
    return 0


def _watch(args, state: dict) -> None:
    """The ``--watch`` loop (until Ctrl-C or ``--count`` refreshes); ``state["reached"]`` tells
    whether the last refresh reached the coordinator."""
    shown = 0
    tty = sys.stdout.isatty()
    while args.count is None or shown < args.count:
        try:
            d = fetch_status(args.coordinator)
            text = json.dumps(d) if args.json else render_status(d, hottest=args.hottest)
            state["reached"] = True
        except CapctlError as err:
            if args.count is not None and shown == 0:
                raise
            state["reached"] = False
            text = (json.dumps({"ok": False, "error": str(err), "exit_code": err.exit_code, "retrying": True})
                    if args.json else f"capctl: {err} (retrying)")
        if args.json:
            print(text, flush=True)
        else:
            stamp = time.strftime("%H:%M:%S")
            out = (f"{text}\n\n[{stamp}] refreshing every {args.watch_interval_s:g} s — Ctrl-C to quit")
            sys.stdout.write(("\x1b[H\x1b[2J" if tty else "") + out + ("\n" if not tty else "") + ("\n" if tty else ""))
            sys.stdout.flush()
        shown += 1
        if args.count is not None and shown >= args.count:
            break
        time.sleep(args.watch_interval_s)


def cmd_nodes(args) -> int:
    d = fetch_status(args.coordinator, "Nodes")
    if args.json:
        _emit({"schema_version": STATUS_SCHEMA_VERSION, "nodes": d["nodes"]})
    else:
        print(render_nodes_summary(d))
        print()
        print(render_gpus(d))
    return 0


def cmd_jobs(args) -> int:
    if args.finished or args.since is not None:
        from capctl.cli.finished import cmd_jobs_finished

        return cmd_jobs_finished(args)
    d = fetch_status(args.coordinator, "Jobs")
    if args.json:
        _emit({"schema_version": STATUS_SCHEMA_VERSION, "jobs": d["jobs"]})
    else:
        print(render_jobs(d))
    return 0


def cmd_explain(args) -> int:
    from capctl.cli.rpc import admin_client

    from capctl.security.limits import check_job_id

    if not args.job_id.strip():
        raise UserInputError("JOB_ID: give a Slurm job id")
    problem = check_job_id(args.job_id, "JOB_ID")  # as the agents check it: no job can have another
    if problem:
        raise UserInputError(problem)
    with admin_client(args.coordinator) as client:
        reply = client.explain(args.job_id)
    d = explain_dict(reply)
    _emit(d) if args.json else print(render_explain(d))
    return 0


def parse_watts(text: str) -> float:
    """Parse ``WATTS`` for ``budget set``: a number of watts, optionally suffixed W/kW/MW/mW
    (case-correct SI prefixes, :mod:`capctl.wattunits`).

    Raises:
        UserInputError: not a number of watts, an ambiguous or unknown suffix, not > 0, or above
            :data:`capctl.security.limits.MAX_BUDGET_W`.
    """
    from capctl.wattunits import parse_watts_text

    value = parse_watts_text(text, "WATTS")
    if not math.isfinite(value) or value <= 0:
        raise UserInputError(f"WATTS {text!r}: give a finite number of watts > 0")
    from capctl.security.limits import MAX_BUDGET_W

    if value > MAX_BUDGET_W:
        raise UserInputError(f"WATTS {text!r}: {format_watts(value)} W is above the largest budget allowed, "
                             f"{format_watts(MAX_BUDGET_W)} W")
    return value


def cmd_budget_set(args) -> int:
    from capctl.cli.rpc import admin_client

    watts = parse_watts(args.watts)
    with admin_client(args.coordinator) as client:
        reply = client.set_budget(watts)
    d = {"ok": bool(reply.ok), "requested_w": _num(watts), "budget_w": _num(reply.budget_w),
         "deficit_w": _num(reply.deficit_w), "message": reply.message}
    if not reply.ok:  # --json: d with ok false and the error (capctl.errors.run_for_person)
        err = UserInputError(budget_refused_line(watts, reply))
        err.json_fields = d
        raise err
    _emit(d) if args.json else print(budget_set_line(reply))
    return 0


def budget_set_line(reply) -> str:
    """One line for an accepted ``budget set``: the coordinator's message when it says it all."""
    msg = (reply.message or "").strip()
    if msg.lower().startswith("budget set to"):
        return msg
    return f"budget set to {format_watts(reply.budget_w)} W" + (f"; {msg}" if msg else "")


def budget_refused_line(watts: float, reply) -> str:
    """One line for a refused ``budget set`` (no "refused: refused:", no repeated budget in force)."""
    msg = (reply.message or "").strip()
    while msg.lower().startswith("refused:"):
        msg = msg[len("refused:"):].strip()
    line = f"budget {format_watts(watts)} W refused" + (f": {msg}" if msg else "")
    if reply.deficit_w > 0 and "deficit" not in msg:
        line += f" (deficit {format_watts(reply.deficit_w)} W)"
    if "budget stays" not in msg and "in force" not in msg:
        line += f"; budget in force {format_watts(reply.budget_w)} W"
    return line


def _common(p: argparse.ArgumentParser) -> None:
    # default=SUPPRESS: the value given before the subcommand (top-level parser) is kept
    p.add_argument("--coordinator", metavar="ADDR", default=argparse.SUPPRESS,
                   help="coordinator address: unix:/path or host:port (default $CAPCTL_COORDINATOR or "
                        "unix:/run/capctl/coordinator.sock); also accepted before the subcommand")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="one JSON object on stdout (see docs/cli.md)")
    from capctl.cli.rpc import add_connection_arguments

    add_connection_arguments(p, suppress=True)


def register(subparsers) -> None:
    """Add status, nodes, jobs, explain and budget to the ``capctl`` parser."""
    p = subparsers.add_parser("status", help="budget, watts, domains, jobs, nodes, hottest GPUs",
                              description="Cluster status from the coordinator. --json: docs/status-schema.json.")
    _common(p)
    p.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    p.add_argument("--watch-interval-s", metavar="S", type=GivenSeconds, default=None,
                   help="refresh period for --watch, seconds (0.2..3600, default 2; only with --watch)")
    p.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)  # bounded --watch (tests)
    p.add_argument("--hottest", type=int, default=None,
                   help=f"how many hottest GPUs to list (default {HOTTEST_DEFAULT}; 0: none; text view only)")
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("nodes", help="nodes and their GPUs", description="Nodes and per-GPU state.")
    _common(p)
    p.set_defaults(func=cmd_nodes)

    p = subparsers.add_parser("jobs", help="jobs with predicted step rate and binding reason (--finished: "
                              "finished jobs with their energy)")
    _common(p)
    p.add_argument("--finished", action="store_true",
                   help="finished jobs the coordinator keeps: energy (J), GPU-seconds, mean/peak power, time capped")
    p.add_argument("--since", metavar="T", default=None,
                   help="finished jobs ended since T (implies --finished; Unix s, ISO 8601 time in UTC, or an age: 90m, 2h, 1d)")
    p.set_defaults(func=cmd_jobs)

    p = subparsers.add_parser("explain", help="why a job got its watts",
                              description="Why JOB_ID got these watts: binding constraint, slowest GPU, prices.")
    p.add_argument("job_id", metavar="JOB_ID")
    _common(p)
    p.set_defaults(func=cmd_explain)

    p = subparsers.add_parser("budget", help="change the cluster budget (admin)")
    sub = p.add_subparsers(dest="budget_command", metavar="ACTION")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON output (docs/cli.md)")
    s = sub.add_parser("set", help="set the cluster budget in watts (persists across coordinator restarts)")
    s.add_argument("watts", metavar="WATTS", help="budget in watts (suffix W, kW, MW or mW allowed: 17.9kW; mw and Mw are refused as ambiguous)")
    # "-5W" is a (refused) budget, not an unknown option: argparse's own test for negative numbers
    # (Python 3.11 argparse attribute) would let only "-5" through and say "WATTS is required"
    s._negative_number_matcher = re.compile(r"^-\.?\d")
    _common(s)
    s.set_defaults(func=cmd_budget_set)
    p.set_defaults(func=lambda args: _need_action(p, args))


def _need_action(parser, args) -> int:
    """``capctl budget`` without its ACTION (:func:`capctl.cli.main.need_action`)."""
    from capctl.cli.main import need_action

    return need_action(parser, args, "ACTION")
