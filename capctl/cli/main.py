"""Entry point of the ``capctl`` admin command line.

Subcommands live in small modules of :mod:`capctl.cli`; each exposes
``register(subparsers) -> None`` which adds its parser(s) and sets ``func`` (a callable taking the
parsed ``argparse.Namespace`` and returning an int exit code). Modules are imported lazily so that a
missing optional piece never breaks the other commands.

Errors for people (:class:`capctl.errors.CapctlError`) are printed as ``capctl: <message>`` on
stderr with the error's exit code; never a traceback. With ``--json`` they are also one JSON object
on stdout (``{"ok": false, ..., "error", "exit_code"}``). A closed stdout (``| head``) ends any
command quietly with exit status 141.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from capctl import lifeline
from capctl.errors import quiet_when_stdout_closes, run_for_person

# Subcommand modules, in the order they appear in --help.
SUBCOMMAND_MODULES = (
    "capctl.cli.status",  # status, nodes, jobs, explain, budget
    "capctl.cli.policy",  # policy validate, policy reload
    "capctl.cli.demo",  # demo
    "capctl.cli.sim",  # sim
    "capctl.cli.install",  # install hooks|units|examples|completion|man DIR
)


class UsageError(Exception):
    """A command line argparse refused (exit 2): ``str(err)`` is its one-line message."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors raise :class:`UsageError` after printing the usage
    (the subcommands' parsers are of this class too: ``add_subparsers`` takes the parent's), so
    that ``--json`` can report them as JSON as well."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        raise UsageError(f"{self.prog}: error: {message}")


def wants_json(argv: list[str]) -> bool:
    """True when the command line ``argv`` asks for ``--json`` (before a ``--``, if any)."""
    return "--json" in (argv[:argv.index("--")] if "--" in argv else argv)


def need_action(parser: argparse.ArgumentParser, args, what: str) -> int:
    """A command line that stops before its ``what`` (COMMAND, ACTION): the help on stdout, exit
    2; with ``--json`` one JSON error object instead (it printed the help: found by a review)."""
    if getattr(args, "json", False):
        from capctl.errors import print_json_error

        return print_json_error(f"{parser.prog}: {what} is required (see {parser.prog} --help)", 2)
    parser.print_help()
    return 2


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every available subcommand registered."""
    parser = _Parser(
        prog="capctl",
        description="capctl: power-capping coordinator for Slurm GPU clusters (watts, degrees C).",
    )
    from capctl.cli.rpc import add_connection_arguments
    from capctl.progdoc import add_standard_arguments

    add_standard_arguments(parser)
    add_connection_arguments(parser)
    # common options, accepted before the subcommand too (subcommands declare them with default=SUPPRESS)
    parser.add_argument("--coordinator", metavar="ADDR", default=None,
                        help="coordinator address: unix:/path or host:port (default $CAPCTL_COORDINATOR or "
                             "unix:/run/capctl/coordinator.sock)")
    parser.add_argument("--json", action="store_true", default=False, help="JSON output (see docs/cli.md)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # subcommand not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``capctl``; returns the process exit code (see :mod:`capctl.errors`): 141 when the reader
    of stdout went away (``capctl status | head -1``), quietly, for every command."""
    return quiet_when_stdout_closes(_main, argv)


def _main(argv: list[str] | None) -> int:
    lifeline.watch_parent()  # `capctl demo` or `status --watch` started by a test: stop with it
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
    except UsageError as err:  # printed like argparse's own; with --json one JSON object too (docs/cli.md)
        print(err, file=sys.stderr)
        if wants_json(argv):
            from capctl.errors import print_json_error

            return print_json_error(str(err), 2)
        return 2
    if not getattr(args, "func", None):
        return need_action(parser, args, "COMMAND")

    def dispatch() -> int:
        from capctl.cli.rpc import configure

        configure(args)
        return args.func(args)

    # --json: every outcome is one JSON object on stdout, errors too (docs/cli.md)
    return run_for_person("capctl", dispatch, extra=getattr(args, "extra", None),
                          json_errors=bool(getattr(args, "json", False)))


if __name__ == "__main__":
    sys.exit(main())
