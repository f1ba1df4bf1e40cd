#!/usr/bin/env python3
"""The shared what-if scenario: five power policies, one cluster, one workload, one seed.

    .venv/bin/python bench/sim_compare.py [--cluster FILE] [--policy FILE] [--seed N] [--plot DIR]

Runs examples/clusters/shared-64x8.yaml under examples/policies/shared-64x8.yaml with
``capctl sim``'s engine, pinned to one CPU core (the issue's "under 60 s on one core"), prints the
comparison table, then the goals (measured, never asserted) and, as the last line, one JSON
object: the ``capctl sim --json`` object plus ``goals`` (each with its target, the measured value
and whether it is met) and ``cpu``. Needs the simulated driver (``make build``) and the Zeus traces
in ../shared/data/zeus-power-traces (read at run time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOALS = {  # issue 6 "Goals": key -> (description, comparison, target)
    "capctl/oracle": (">=", 0.99),
    "capctl/uniform": (">=", 1.15),
    "capctl/balancer": (">=", 1.05),
    "capctl/utilization": (">=", 1.10),
    "capctl thermal_slowdown_fraction": ("<=", 0.005),
    "capctl max_overshoot_w": ("<=", 0.0),
    "wall_s (all five policies, one core)": ("<", 60.0),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--cluster", default=str(ROOT / "examples/clusters/shared-64x8.yaml"))
    ap.add_argument("--policy", default=str(ROOT / "examples/policies/shared-64x8.yaml"))
    ap.add_argument("--seed", type=int)
    ap.add_argument("--duration", type=float)
    ap.add_argument("--plot", metavar="DIR")
    ap.add_argument("--all-cores", action="store_true", help="do not pin to one core")
    args = ap.parse_args(argv)
    cpu = None
    if not args.all_cores and hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
    from capctl.policy import load_policy
    from capctl.sim.cluster import load_cluster
    from capctl.sim.engine import build_scenario, run_policy
    from capctl.sim.policies import POLICY_NAMES
    from capctl.sim.report import plot, table, to_json

    spec = load_cluster(args.cluster)
    if args.seed is not None:
        spec = replace(spec, seed=args.seed)
    if args.duration is not None:
        spec = replace(spec, duration_s=args.duration)
    policy = load_policy(args.policy)
    t0 = time.perf_counter()
    scn = build_scenario(spec, policy)
    runs = {n: run_policy(scn, n) for n in POLICY_NAMES}
    wall = time.perf_counter() - t0
    print(table(scn, runs, wall))
    obj = to_json(scn, runs, wall)
    c = obj["policies"]["capctl"]
    measured = dict(obj["ratios"])
    measured["capctl thermal_slowdown_fraction"] = c["thermal_slowdown_fraction"]
    measured["capctl max_overshoot_w"] = c["max_overshoot_w"]
    measured["wall_s (all five policies, one core)"] = obj["wall_s"]
    goals = {}
    print("\ngoals (measured, not asserted):")
    for key, (op, target) in GOALS.items():
        v = measured.get(key)
        ok = v is not None and (v >= target if op == ">=" else v <= target if op == "<=" else v < target)
        goals[key] = {"target": f"{op} {target:g}", "measured": v, "met": bool(ok)}
        print(f"  {key:<40} {op} {target:<8g} measured {v}  {'met' if ok else 'MISSED'}")
    if args.plot:
        for f in plot(scn, runs, args.plot):
            print(f"wrote {f}")
    obj["goals"] = goals
    obj["cpu"] = {"pinned_core": cpu, "host_cpus": os.cpu_count()}
    for p in obj["policies"].values():
        p.pop("jobs", None)  # the per-job rates are in the table above; keep the last line short
    print(json.dumps(obj))
    return 0


if __name__ == "__main__":
    sys.exit(main())
