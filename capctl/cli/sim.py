"""``capctl sim``: the what-if cluster simulator (docs/sim.md).

    capctl sim --policy FILE --cluster FILE [--duration S] [--seed N] [--policies LIST]
               [--json] [--plot DIR]

Runs the cluster file's scenario under the five policies (uniform, utilization, balancer, capctl,
oracle) with the same workload and seed, in-process and faster than real time, and prints the
comparison table (or one JSON object with ``--json``). Exit 0, or 1 with a ``file:line:col``
message for a bad policy or cluster file.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from capctl.errors import UserInputError


def register(subparsers) -> None:
    """Add the ``sim`` subcommand."""
    p = subparsers.add_parser(
        "sim", help="what-if simulation: compare capctl with other power policies on a cluster file",
        description="Simulate a cluster (YAML) under the policy file and four other policies; "
                    "watts, degrees C, seconds.")
    p.add_argument("--policy", required=True, metavar="FILE", help="capctl policy YAML (budget, domains)")
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster YAML (see examples/clusters/)")
    p.add_argument("--duration", type=float, metavar="S", help="simulated seconds (default: the cluster file's)")
    p.add_argument("--seed", type=int, metavar="N", help="seed (default: the cluster file's)")
    p.add_argument("--policies", metavar="LIST",
                   help="comma-separated subset of uniform,utilization,balancer,capctl,oracle (default all)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.set_defaults(func=run, extra="sim")  # extra: named when a module is missing


def _check_plot_dir(path: str) -> None:
    """``--plot DIR`` must be a writable directory (created if missing; parents too).

    Raises:
        UserInputError: DIR is a file, cannot be created, or is not writable; or matplotlib is missing.
    """
    import importlib.util
    import os
    from pathlib import Path

    allowed = "give a directory for the PNG files (created if missing)"
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserInputError(f"--plot {path}: exists and is not a directory; {allowed}")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserInputError(f"--plot {path}: cannot create it ({(exc.strerror or str(exc)).lower()}); {allowed}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise UserInputError(f"--plot {path}: not writable; {allowed}")
    if importlib.util.find_spec("matplotlib") is None:
        raise UserInputError("--plot needs matplotlib: pip install 'capctl[plot]'")


SEED_MAX = 2**63 - 1
"""The largest seed (the cluster file's ``seed`` bound, a signed 64-bit integer)."""


def _warn_policy(policy) -> None:
    """The policy file's validation warnings on stderr (as ``capctl policy validate`` prints them),
    and one for ``dry_run: true``, which the simulation does not follow (capctl's row applies its
    caps: the what-if of the policy with it off)."""
    import sys

    for w in policy.warnings:
        print(w, file=sys.stderr)
    if policy.dry_run:
        print(f"{policy.source}: warning: dry_run: true is not simulated; capctl's row applies its caps "
              "(the policy with dry_run: false)", file=sys.stderr)


def _load_both(args: argparse.Namespace):
    """``(policy, cluster spec)`` of ``--policy`` and ``--cluster``. Raises PolicyError /
    ClusterError as their loaders do, with a hint when the file looks like the other kind (the two
    swapped gave "unknown key 'gpu_model'; did you mean 'models'?": found by a try-out)."""
    from capctl.policy import PolicyError, load_policy
    from capctl.sim.cluster import ClusterError, load_cluster

    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        if any(f"unknown key '{k}'" in e for e in exc.errors for k in ("racks", "gpu_model", "workload")):
            raise PolicyError(exc.errors + [f"{args.policy}: this looks like a cluster file (racks, gpu_model, "
                                            "workload): give it with --cluster, and a policy with --policy"],
                              exc.warnings) from None
        raise
    _warn_policy(policy)
    try:
        spec = load_cluster(args.cluster)
    except ClusterError as exc:
        if any(f"unknown key '{k}'" in str(exc) for k in ("budget_w", "domains")):
            raise ClusterError(f"{exc}\n{args.cluster}: this looks like a policy file (budget_w, domains): give it "
                               "with --policy, and a cluster file with --cluster") from None
        raise
    return policy, spec


def run(args: argparse.Namespace) -> int:
    from capctl.sim.engine import build_scenario, run_policy
    from capctl.sim.policies import POLICY_NAMES
    from capctl.sim.report import plot, table, to_json

    names = list(POLICY_NAMES)
    if args.policies is not None:  # (an empty list is an error, not "all")
        raw = [n.strip() for n in args.policies.split(",")]
        names = [n for n in raw if n]
        bad = [n for n in names if n not in POLICY_NAMES]
        if not names:
            raise UserInputError(f"--policies {args.policies!r} names no policy; allowed: a comma-separated list "
                                 f"of {', '.join(POLICY_NAMES)}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if "" in raw or twice:  # (both were taken without a word: a try-out)
            what = f"{twice[0]!r} named twice" if twice else "an empty name between commas"
            raise UserInputError(f"--policies {args.policies!r}: {what}; allowed: each of {', '.join(POLICY_NAMES)} "
                                 "at most once, comma-separated")
        if bad:
            raise UserInputError(f"--policies {args.policies!r}: {bad[0]!r} is unknown; "
                                 f"allowed: {', '.join(POLICY_NAMES)}")
    if args.duration is not None and not (0 < args.duration <= 30 * 86400):
        raise UserInputError(f"--duration {args.duration:g} is invalid; allowed: seconds > 0 and <= {30 * 86400}")
    if args.seed is not None and not 0 <= args.seed <= SEED_MAX:
        raise UserInputError(f"--seed {args.seed} is invalid; allowed: an integer >= 0 and <= {SEED_MAX}")
    if args.plot:
        _check_plot_dir(args.plot)  # before simulating: a bad --plot must not lose the results
    policy, spec = _load_both(args)
    if args.duration is not None:
        if args.duration < spec.step_s:
            raise UserInputError(f"--duration {args.duration:g} is shorter than one simulation step of {args.cluster} "
                                 f"(step_s {spec.step_s:g} s); allowed: seconds >= {spec.step_s:g}")
        spec = replace(spec, duration_s=float(args.duration))
    if args.seed is not None:
        spec = replace(spec, seed=int(args.seed))
    t0 = time.perf_counter()
    scn = build_scenario(spec, policy)
    runs = {n: run_policy(scn, n) for n in names}
    wall = time.perf_counter() - t0
    try:
        files = plot(scn, runs, args.plot) if args.plot else []
    except OSError as exc:
        raise UserInputError(f"--plot {args.plot}: cannot write the plots: {(exc.strerror or str(exc)).lower()}") from None
    if args.json:
        obj = to_json(scn, runs, wall)
        if files:
            obj["plots"] = files
        print(json.dumps(obj, sort_keys=False))
    else:
        print(table(scn, runs, wall))
        for f in files:
            print(f"wrote {f}")
    return 0
