"""``capctl demo``: a coordinator, agents and synchronous jobs on simulated GPUs, live, with a summary.

See :mod:`capctl.demo.run` for what runs and how every figure is measured; docs/cli.md for the
summary's JSON keys.
"""

from __future__ import annotations

import argparse
import json
import sys

from capctl.errors import UnreachableError


def cmd_demo(args) -> int:
    from capctl.demo.run import Demo, render_summary

    # the live view redraws the screen every second: on a terminal only (piped to a file it wrote a
    # full status per second, 2,275 lines for one run: found by a try-out); else progress lines
    live = not args.no_live and not args.json and sys.stdout.isatty()
    demo = Demo(duration_s=args.duration, nodes=args.nodes, live=live, keep=args.keep)
    try:
        summary = demo.run()
    except KeyboardInterrupt:
        print("capctl demo: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    except TimeoutError as err:  # a daemon did not come up: its log tail is in the message
        raise UnreachableError(f"demo: {err}") from None
    if args.json:
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(render_summary(summary))
    return 0


def register(subparsers) -> None:
    """Add ``capctl demo`` to the ``capctl`` parser."""
    p = subparsers.add_parser(
        "demo", help="run capctl on a simulated 4-node cluster and compare with uniform static caps",
        description="Start simulated nodes, a coordinator and agents, bind synchronous jobs, show a live "
                    "status view, then a summary (throughput vs uniform static caps, largest sum of enforced "
                    "caps vs the budget, time in thermal slowdown). Stops everything it started.")
    p.add_argument("--duration", type=float, default=75.0, metavar="S",
                   help="length of the show in seconds (default 75; 10..3600)")
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes of 8 H100-class GPUs (default 4)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print only the summary, as one JSON object")
    p.add_argument("--no-live", action="store_true", help="no live status view (progress lines on stderr; the default when stdout is not a terminal)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, state) afterwards")
    p.set_defaults(func=cmd_demo, extra="sim")  # extra: named when a module is missing
