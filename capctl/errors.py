"""Error types shared by every capctl component.

User errors (bad input, unreachable services, missing permissions) are raised as
:class:`CapctlError` subclasses; command-line entry points print ``str(err)`` and exit with
``err.exit_code`` instead of a traceback.

Exit codes (documented in docs/cli.md):

====  =====================================================
0     success
1     invalid input (policy file, arguments, values)
2     usage error (argparse)
3     coordinator or agent unreachable
4     permission denied (admin operation without admin identity)
5     hardware / NVML error
6     not found (job, node)
====  =====================================================
"""

from __future__ import annotations


class CapctlError(Exception):
    """Base class of all errors meant for a person; ``exit_code`` is the CLI exit status."""

    exit_code = 1
    json_fields: dict | None = None
    """Keys (besides ``ok``, ``error``, ``exit_code``) of the JSON object a ``--json`` command prints
    for this error, e.g. the refused ``budget set``'s ``budget_w``; set on the instance."""


class UserInputError(CapctlError):
    """Bad input: names the field or file:line, the value, and what is allowed."""

    exit_code = 1


class UnreachableError(CapctlError):
    """A coordinator or agent could not be reached within the deadline."""

    exit_code = 3


class PermissionDeniedError(CapctlError):
    """The caller lacks the identity needed for the operation."""

    exit_code = 4


class HardwareError(CapctlError):
    """An NVML/hardware operation failed; the message carries a remedy."""

    exit_code = 5


class NotFoundError(CapctlError):
    """The named job, node or GPU does not exist."""

    exit_code = 6


STDOUT_CLOSED_EXIT = 141
"""Exit status when the reader of stdout went away (``capctl status | head -1``): 128 + SIGPIPE, as
a command killed by SIGPIPE has in the shell."""


def run_for_person(prog: str, func, *args, extra: str | None = None, json_errors: bool = False) -> int:
    """Call ``func(*args)`` as a command-line entry point and return the process exit status.

    :class:`CapctlError` is printed as ``<prog>: <message>`` on stderr and yields its
    ``exit_code`` (no traceback for a person's error); Ctrl-C yields 130. A module of an extra that
    is not installed (:mod:`capctl.extras`) is one line naming the extra (``extra`` when the
    command belongs to one, e.g. "sim"), exit 1. Other exceptions propagate. ``json_errors`` (a
    ``--json`` command): each of these outcomes also prints one JSON object on stdout,
    ``{"ok": false, ..., "error": message, "exit_code": N}`` (see :func:`print_json_error`).
    """
    import sys

    from capctl.extras import missing_extra_message

    def fail(line: str, message: str, code: int, fields: dict | None = None) -> int:
        print(line, file=sys.stderr)
        return print_json_error(message, code, fields) if json_errors else code

    try:
        return int(func(*args) or 0)
    except CapctlError as err:
        return fail(f"{prog}: {err}", str(err), err.exit_code, err.json_fields)
    except KeyboardInterrupt:
        return print_json_error("interrupted", 130) if json_errors else 130
    except ModuleNotFoundError as exc:
        message = missing_extra_message(prog, exc, extra)
        if message is None:
            raise
        return fail(message, message, 1)


def print_json_error(message: str, exit_code: int, fields: dict | None = None) -> int:
    """Print ``{"ok": false, **fields, "error": message, "exit_code": exit_code}`` as one line on
    stdout (a ``--json`` command's failed outcome); returns ``exit_code``."""
    import json
    import sys

    obj = {"ok": False, **(fields or {}), "error": message, "exit_code": exit_code}
    obj["ok"] = False
    sys.stdout.write(json.dumps(obj) + "\n")
    return exit_code


def quiet_when_stdout_closes(func, *args) -> int:
    """Run the entry point ``func(*args)`` (returning an exit status) and flush stdout; when the
    reader of stdout has gone (``| head``): :data:`STDOUT_CLOSED_EXIT`, no traceback, no "Exception
    ignored" at exit (stdout goes to /dev/null, the Python docs' SIGPIPE note). A
    :class:`BrokenPipeError` of anything but stdout propagates. ``SystemExit`` (argparse's
    ``--help``) propagates after the flush."""
    import os
    import sys

    try:
        try:
            status = func(*args)
        except SystemExit:  # argparse's --help, --version: printed, maybe not yet written
            _flush_stdout()
            raise
        _flush_stdout()
        return status
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return STDOUT_CLOSED_EXIT


def _flush_stdout() -> None:
    import sys

    if sys.stdout is not None:
        sys.stdout.flush()


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose other end is closed (poll: POLLERR/POLLHUP)."""
    import select
    import sys

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True  # no poll, or no real stdout: a BrokenPipeError writing it is the likely cause
