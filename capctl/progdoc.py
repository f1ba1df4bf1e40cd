"""What every capctl command line offers besides its own flags (one helper for all of them):

- ``--version``: ``<prog> <version>`` (the one version, :data:`capctl.__version__`);
- ``--print-completion bash``: a bash completion script generated from the parser (shtab);
- ``--print-man``: a man page (roff, section 1) generated from the parser (argparse-manpage).

``capctl install completion DIR`` and ``capctl install man DIR`` collect them for every installed
command. Both generators are imported only when asked for.
"""

from __future__ import annotations

import argparse
import sys

from capctl import __version__

MAN_SECTION = 1


class _PrintMan(argparse.Action):
    """``--print-man``: write the parser's man page to stdout and exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(man_page(parser))
        parser.exit(0)


class _PrintCompletion(argparse.Action):
    """``--print-completion SHELL``: write the completion script to stdout and exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(completion(parser, values))
        parser.exit(0)


def add_standard_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--version``, ``--print-completion`` and ``--print-man`` to ``parser``; returns it."""
    parser.add_argument("--version", action="version", version=f"{parser.prog} {__version__}")
    parser.add_argument("--print-completion", choices=["bash"], action=_PrintCompletion, default=argparse.SUPPRESS,
                        metavar="SHELL", help="print a completion script for SHELL (bash) and exit")
    parser.add_argument("--print-man", action=_PrintMan, help="print a man page (roff) and exit")
    return parser


def completion(parser: argparse.ArgumentParser, shell: str = "bash") -> str:
    """The ``shell`` completion script of ``parser`` (shtab; shells: bash)."""
    import shtab

    return shtab.complete(parser, shell=shell)


def man_page(parser: argparse.ArgumentParser) -> str:
    """The man page (roff) of ``parser`` with every subcommand (argparse-manpage)."""
    from build_manpages.manpage import Manpage

    data = {"version": __version__, "project_name": "capctl", "manual_section": str(MAN_SECTION),
            "manual_title": "capctl manual", "url": "https://github.com/capctl/capctl",
            "description": parser.description}
    return str(Manpage(parser, _data=data))
