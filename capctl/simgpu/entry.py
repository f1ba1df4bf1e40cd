"""Console-script entry of ``capctl-simgpu``: :func:`capctl.simgpu.cli.main`, imported only here so
that an installation without ``capctl[sim]`` (numpy) gets one line naming the extra instead of an
ImportError traceback from the console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run ``capctl-simgpu``; exit 1 with one line when the ``sim`` extra is missing, 141 (quietly)
    when the reader of stdout went away (``capctl-simgpu ... | head``)."""
    from capctl.errors import quiet_when_stdout_closes

    return quiet_when_stdout_closes(_main, argv)


def _main(argv: list[str] | None) -> int:
    from capctl.extras import missing_extra_message

    try:
        from capctl.simgpu.cli import main as cli_main
    except ModuleNotFoundError as exc:
        message = missing_extra_message("capctl-simgpu", exc, "sim")
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
