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


def run_for_person(prog: str, func, *args, extra: str | None = None) -> int:
    """Call ``func(*args)`` as a command-line entry point and return the process exit status.

    :class:`CapctlError` is printed as ``<prog>: <message>`` on stderr and yields its
    ``exit_code`` (no traceback for a person's error); Ctrl-C yields 130. A module of an extra that
    is not installed (:mod:`capctl.extras`) is one line naming the extra (``extra`` when the
    command belongs to one, e.g. "sim"), exit 1. Other exceptions propagate.
    """
    import sys

    from capctl.extras import missing_extra_message

    try:
        return int(func(*args) or 0)
    except CapctlError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        message = missing_extra_message(prog, exc, extra)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1
