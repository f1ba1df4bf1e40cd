"""``capctl-simgpu``: create and drive simulated GPU nodes (see docs/simulated-gpus.md).

Commands::

    capctl-simgpu init DIR --gpus N [--model NAME] [--profile K=V,...] [--profile-file F]
                       [--inlet-c X | X,Y,...] [--manual-clock] [--seed S]
    capctl-simgpu load DIR --gpu I|all --demand-w W [--util PCT] [--memory-bound-fraction M]
    capctl-simgpu show DIR [--json]
    capctl-simgpu fault DIR KIND [--gpu I|all] [--value W] [--period-s S] [--clear]
    capctl-simgpu reload DIR
    capctl-simgpu advance DIR SECONDS
    capctl-simgpu models
    capctl-simgpu journal [NAME=]DIR ... [--limit-w W] [--gpu NODE:I,J ...] [--since-ns T] [--until-ns T] [--json]

``DIR`` holds one node's state file ``DIR/node.state``.  Bad input prints one line naming the
argument, the value and what is allowed, and exits 1 (never a traceback).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from capctl.errors import CapctlError, UserInputError
from capctl.simgpu._lib import FAULT_CODES

from capctl.simgpu.journal import STATE_FILE


def state_path(directory: str | Path) -> Path:
    """Path of the node state file in ``directory``."""
    return Path(directory).absolute() / STATE_FILE


def _parse_inlets(text: str) -> float | list[float]:
    parts = [p.strip() for p in text.split(",")]
    vals = []
    for p in parts:
        try:
            vals.append(float(p))
        except ValueError:
            raise UserInputError(
                f"--inlet-c {text!r} is invalid; allowed: a temperature in C or a comma-separated "
                "list with one per GPU"
            ) from None
    return vals[0] if len(vals) == 1 else vals


def _gpu_indices(text: str, count: int) -> list[int]:
    if text == "all":
        return list(range(count))
    out = []
    for part in text.split(","):
        try:
            i = int(part)
        except ValueError:
            raise UserInputError(
                f"--gpu {text!r} is invalid; allowed: 'all' or indices 0..{count - 1}"
            ) from None
        if not 0 <= i < count:
            raise UserInputError(f"--gpu {i} is out of range; allowed: 'all' or 0..{count - 1}")
        out.append(i)
    return out


def _open(directory: str):
    from capctl.simgpu.node import SimNode

    path = state_path(directory)
    if not path.is_file():
        raise UserInputError(
            f"DIR {directory!r} holds no simulated node ({path} missing); "
            "create one with 'capctl-simgpu init DIR --gpus N --model NAME'"
        )
    return SimNode.open(path)


def cmd_init(args: argparse.Namespace) -> int:
    from capctl.simgpu.node import SimNode

    directory = Path(args.dir)
    if directory.exists() and not directory.is_dir():
        raise UserInputError(f"DIR {args.dir!r} exists and is not a directory")
    if args.gpus < 1 or args.gpus > 4096:
        raise UserInputError(f"--gpus {args.gpus} is out of range; allowed: 1..4096")
    if args.seed < 0:
        raise UserInputError(f"--seed {args.seed} is invalid; allowed: an integer >= 0")
    inlets = _parse_inlets(args.inlet_c)
    profile = _init_profile(args)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # (/proc/x, a file in the path, no permission: a traceback before, found by a try-out)
        raise UserInputError(f"DIR {args.dir!r}: cannot create it ({exc.strerror or exc}); "
                             "allowed: a writable directory (created if missing)") from None
    with SimNode.create(
        state_path(directory), gpus=args.gpus, model=args.model, inlet_c=inlets,
        seed=args.seed, manual_clock=args.manual_clock, profile=profile,
    ) as node:
        for key, value in node.env().items():
            print(f"export {key}={shlex.quote(value)}")
    return 0


def _init_profile(args: argparse.Namespace):
    """The device profile of ``init``: None for a plain ``--model``; else ``--model`` (the base,
    unless the file or ``--profile`` names ``base``) with the file's fields and ``--profile``'s
    on top (ProfileError naming the option or file:line for a bad value)."""
    from capctl.simgpu import profiles

    if not args.profile and not args.profile_file:
        return None
    values, where = profiles.parse_pairs(args.profile or [], "--profile")
    if args.profile_file:
        return profiles.load_file(args.profile_file, base=args.model, overrides=values, override_where=where)
    return profiles.custom(values, where, base=args.model)


def cmd_load(args: argparse.Namespace) -> int:
    with _open(args.dir) as node:
        for i in _gpu_indices(args.gpu, node.gpu_count):
            node.set_load(i, args.demand_w, args.util, args.memory_bound_fraction)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _open(args.dir) as node:
        rows = [node.read(i) for i in range(node.gpu_count)]
        if args.json:
            print(json.dumps({"path": str(node.path), "model": node.model, "custom": node.custom, "gpus": rows},
                             indent=2))
            return 0
        clock = "manual" if node.manual_clock else "real"
        model = f"{node.model} (custom profile)" if node.custom else node.model
        print(f"node {node.path}  model {model}  gpus {node.gpu_count}  "
              f"clock {clock} t={node.now_s():.3f} s  driver reloads {node.driver_generation}")
        hdr = (f"{'gpu':>3} {'demand_w':>8} {'power_w':>8} {'avg_w':>7} {'limit_w':>7} "
               f"{'enf_w':>6} {'temp_c':>6} {'sm_mhz':>6} {'rate':>5} {'energy_j':>10}  reasons / faults")
        print(hdr)
        for i, r in enumerate(rows):
            tags = r["reason_names"] + [f"FAULT:{f}" for f in r["faults"]]
            print(f"{i:>3} {r['demand_w']:>8.1f} {r['power_w']:>8.1f} {r['power_avg_w']:>7.1f} "
                  f"{r['limit_w']:>7.1f} {r['enforced_w']:>6.1f} {r['temp_c']:>6.1f} "
                  f"{r['sm_clock_mhz']:>6.0f} {r['rate']:>5.3f} {r['energy_j']:>10.1f}  "
                  f"{','.join(tags) or '-'}")
    return 0


def cmd_fault(args: argparse.Namespace) -> int:
    with _open(args.dir) as node:
        for i in _gpu_indices(args.gpu, node.gpu_count):
            if args.clear:
                node.clear(i, args.kind)
            else:
                node.inject(i, args.kind, args.value, args.period_s, max_w=args.max_w)
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    with _open(args.dir) as node:
        node.driver_reload()
    return 0


def cmd_advance(args: argparse.Namespace) -> int:
    with _open(args.dir) as node:
        if not node.manual_clock:
            raise UserInputError(
                f"node in {args.dir!r} follows the real clock; advance needs one created with "
                "'capctl-simgpu init DIR ... --manual-clock'"
            )
        node.advance(args.seconds)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from capctl.simgpu.profiles import all_profiles

    print(f"{'model':<10} {'nvml name':<24} {'min_w':>6} {'max_w':>6} {'def_w':>6} {'idle_w':>6} "
          f"{'max_mhz':>7} {'slow_c':>6} {'shut_c':>6}")
    for p in all_profiles():
        print(f"{p.name:<10} {p.nvml_name:<24} {p.min_limit_w:>6.0f} {p.max_limit_w:>6.0f} "
              f"{p.default_limit_w:>6.0f} {p.idle_w:>6.0f} {p.max_sm_clock_mhz:>7.0f} "
              f"{p.slowdown_temp_c:>6.0f} {p.shutdown_temp_c:>6.0f}")
    return 0


def cmd_journal(args: argparse.Namespace) -> int:
    from capctl.simgpu.journal import main_check

    return main_check(args)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 1 with one line, as for other bad input
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    """The ``capctl-simgpu`` argument parser."""
    from capctl.progdoc import add_standard_arguments

    p = add_standard_arguments(_Parser(prog="capctl-simgpu", description="Create and drive simulated GPU nodes."))
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("init", help="create a simulated node in DIR and print export lines")
    s.add_argument("dir")
    s.add_argument("--gpus", type=int, required=True)
    s.add_argument("--model", default="H100-SXM",
                   help="built-in device profile (the base of --profile / --profile-file)")
    s.add_argument("--profile", action="append", metavar="KEY=VALUE[,KEY=VALUE...]",
                   help="custom device: fields over the base profile, e.g. name=B200,min_limit_w=200,"
                        "max_limit_w=1000,default_limit_w=1000 (docs/simulated-gpus.md)")
    s.add_argument("--profile-file", metavar="FILE", help="custom device from a YAML/JSON mapping of fields")
    s.add_argument("--inlet-c", default="25")
    s.add_argument("--manual-clock", action="store_true")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_init)

    s = sub.add_parser("load", help="set workload demand of GPUs")
    s.add_argument("dir")
    s.add_argument("--gpu", required=True)
    s.add_argument("--demand-w", type=float, required=True)
    s.add_argument("--util", type=float, default=100.0)
    s.add_argument("--memory-bound-fraction", type=float, default=None)
    s.set_defaults(func=cmd_load)

    s = sub.add_parser("show", help="print the node's true state")
    s.add_argument("dir")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("fault", help="inject (or --clear) a fault")
    s.add_argument("dir")
    s.add_argument("kind", choices=list(FAULT_CODES))
    s.add_argument("--gpu", default="all")
    s.add_argument("--value", type=float, default=None,
                   help="W for oob_limit / foreign_writer / bad_constraints (reported min); clock fraction "
                        "for stuck_slowdown; s for nvml_stall")
    s.add_argument("--max-w", type=float, default=None, help="bad_constraints: the reported maximum limit (W)")
    s.add_argument("--period-s", type=float, default=10.0, help="foreign_writer period")
    s.add_argument("--clear", action="store_true")
    s.set_defaults(func=cmd_fault)

    s = sub.add_parser("reload", help="simulate a driver reload (limits back to default)")
    s.add_argument("dir")
    s.set_defaults(func=cmd_reload)

    s = sub.add_parser("advance", help="advance a manual-clock node")
    s.add_argument("dir")
    s.add_argument("seconds", type=float)
    s.set_defaults(func=cmd_advance)

    s = sub.add_parser("models", help="list device profiles")
    s.set_defaults(func=cmd_models)

    s = sub.add_parser("journal", help="exact max sum of enforced limits from the nodes' journals "
                                       "(exit 2: the limit was exceeded, 1: journal incomplete)")
    s.add_argument("nodes", nargs="+", metavar="[NAME=]DIR", help="node directories (name: the directory's)")
    s.add_argument("--limit-w", type=float, default=None, help="domain limit to check (W)")
    s.add_argument("--gpu", action="append", metavar="NODE:I[,J...]", help="GPUs to sum (default: all)")
    s.add_argument("--since-ns", type=int, default=None, help="CLOCK_MONOTONIC start (ns)")
    s.add_argument("--until-ns", type=int, default=None, help="CLOCK_MONOTONIC end (ns; default now)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_journal)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0, or the error's exit code)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CapctlError as err:
        print(f"capctl-simgpu: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
