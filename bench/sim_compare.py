#!/usr/bin/env python3
"""The what-if scenarios: five power policies, one cluster, one workload, one seed (or a matrix).

    .venv/bin/python bench/sim_compare.py [--cluster FILE] [--policy FILE] [--seed N] [--plot DIR]
    .venv/bin/python bench/sim_compare.py --matrix [--scenarios A,B] [--seeds S,S] [--duration S]
    .venv/bin/python bench/sim_compare.py --spare [--all-cores]

Default: runs examples/clusters/shared-64x8.yaml under examples/policies/shared-64x8.yaml with
``capctl sim``'s engine, pinned to one CPU core (issue 6's "under 60 s on one core"), prints the
comparison table, then the goals (measured, never asserted) and, as the last line, one JSON
object: the ``capctl sim --json`` object plus ``goals`` (each with its target, the measured value
and whether it is met) and ``cpu``.

``--matrix`` (issue 12, item 8): every scenario of :data:`MATRIX` x three seeds (the file's own,
11 and 12), one after the other: per run capctl/oracle, gain capture against the best baseline
(``capctl.sim.report.gain_capture``), capctl/uniform, thermal slowdown time and energy per step,
and capctl against the oracle blind to a workload's memory-bound share (``OracleNvml``: what NVML
cannot show);
then the goals (capctl/oracle >= 0.99, gain capture >= 0.95 in every run) and, as the last line,
one JSON object with every row. Needs the simulated driver (``make build``) and the Zeus traces in
../shared/data/zeus-power-traces (read at run time).
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


MATRIX = {  # scenario -> (cluster file, policy file), under examples/
    "shared-64x8": ("clusters/shared-64x8.yaml", "policies/shared-64x8.yaml"),
    "one-big-job-128x8": ("clusters/one-big-job-128x8.yaml", "policies/one-big-job-128x8.yaml"),
    "hard-budget-a100-32x8": ("clusters/hard-budget-a100-32x8.yaml", "policies/hard-budget-a100-32x8.yaml"),
    "mix-one-large-64x8": ("clusters/mix-one-large-64x8.yaml", "policies/shared-64x8.yaml"),
}
MATRIX_SEEDS = (None, 11, 12)  # None: the cluster file's own seed
MATRIX_GOALS = {"capctl/oracle": 0.99, "gain_capture": 0.95}  # issue 12 item 8, every run


def matrix_row(name: str, seed, duration_s) -> dict:
    """Run one scenario of :data:`MATRIX` with all five policies; its row of the matrix."""
    from capctl.policy import load_policy
    from capctl.sim.cluster import load_cluster
    from capctl.sim.engine import build_scenario, run_policy
    from capctl.sim.policies import POLICY_NAMES
    from capctl.sim.report import gain_capture, ratios

    cluster, policy = MATRIX[name]
    spec = load_cluster(ROOT / "examples" / cluster)
    if seed is not None:
        spec = replace(spec, seed=seed)
    if duration_s is not None:
        spec = replace(spec, duration_s=duration_s)
    t0 = time.perf_counter()
    scn = build_scenario(spec, load_policy(ROOT / "examples" / policy))
    runs = {n: run_policy(scn, n) for n in POLICY_NAMES}
    nvml = run_policy(scn, "oracle-nvml")  # the oracle blind to what NVML cannot show
    rt = ratios(runs)
    gc = gain_capture(runs) or {}
    gc_nvml = gain_capture({**runs, "oracle": nvml}) or {}
    per = {n: {"throughput": round(r.throughput, 4),
               "thermal_slowdown_pct": round(100 * r.thermal_slowdown_fraction, 4),
               "energy_per_step_j": round(r.energy_per_step_j, 2), "max_overshoot_w": round(r.max_overshoot_w, 1)}
           for n, r in runs.items()}
    return {"scenario": name, "seed": spec.seed, "duration_s": spec.duration_s, "gpus": scn.topo.n_gpus,
            "jobs": len(scn.jobs), "capctl/oracle": rt.get("capctl/oracle"), "capctl/uniform": rt.get("capctl/uniform"),
            "gain_capture": gc.get("gain_capture"), "best_baseline": gc.get("best_baseline"),
            "capctl/oracle-nvml": round(runs["capctl"].throughput / nvml.throughput, 4),
            "gain_capture_vs_oracle_nvml": gc_nvml.get("gain_capture"),
            "oracle-nvml_throughput": round(nvml.throughput, 4),
            "policies": per, "capctl_extra": runs["capctl"].extra, "wall_s": round(time.perf_counter() - t0, 1)}


def _fmt_row(r: dict) -> str:
    p = r["policies"]
    gc = "-" if r["gain_capture"] is None else f"{100 * r['gain_capture']:.1f}"
    return (f"{r['scenario']:<22} {r['seed']:>9} {r['gpus']:>5} {r['jobs']:>4} {r['capctl/oracle']:>7.4f} "
            f"{gc:>6} {str(r['best_baseline']):<11} {r['capctl/uniform']:>7.4f} "
            f"{p['capctl']['thermal_slowdown_pct']:>6.3f} {p['uniform']['thermal_slowdown_pct']:>6.3f} "
            f"{p['oracle']['thermal_slowdown_pct']:>6.3f} {p['capctl']['energy_per_step_j']:>7.1f} "
            f"{p['uniform']['energy_per_step_j']:>7.1f} {p['oracle']['energy_per_step_j']:>7.1f} "
            f"{r['capctl/oracle-nvml']:>7.4f} {r['wall_s']:>6.0f}")


def run_matrix(args) -> int:
    """``--matrix``: the issue-12 table, its goals and one JSON line (see the module docstring)."""
    names = args.scenarios.split(",") if args.scenarios else list(MATRIX)
    unknown = [n for n in names if n not in MATRIX]
    if unknown:
        print(f"--scenarios: {unknown[0]!r} is unknown; allowed: {', '.join(MATRIX)}", file=sys.stderr)
        return 2
    seeds = [None if s == "file" else int(s) for s in args.seeds.split(",")] if args.seeds else list(MATRIX_SEEDS)
    print(f"{'scenario':<22} {'seed':>9} {'GPUs':>5} {'jobs':>4} {'c/orac':>7} {'gain%':>6} {'best base':<11} "
          f"{'c/unif':>7} {'thr%c':>6} {'thr%u':>6} {'thr%o':>6} {'J/st c':>7} {'J/st u':>7} {'J/st o':>7} {'c/o-nv':>7} "
          f"{'wall':>6}",
          flush=True)
    rows = []
    for name in names:
        for seed in seeds:
            rows.append(matrix_row(name, seed, args.duration))
            print(_fmt_row(rows[-1]), flush=True)
    print("\n(c = capctl, u = uniform, o = oracle; thr% = thermal slowdown, share of busy GPU-time; "
          "J/st = energy per GPU-step; c/o-nv = capctl / the oracle with NVML's view of the rate, "
          "capctl.sim.policies.OracleNvml)")
    goals = {}
    print("goals (measured, not asserted; every run):")
    for key, target in MATRIX_GOALS.items():
        vals = [r[key] for r in rows]
        worst = min((v for v in vals if v is not None), default=None)
        met = all(v is not None and v >= target for v in vals)
        goals[key] = {"target": f">= {target:g}", "worst": worst, "met": met,
                      "missed_in": [f"{r['scenario']}/{r['seed']}" for r in rows if r[key] is None or r[key] < target]}
        print(f"  {key:<16} >= {target:<5g} worst {worst}  {'met' if met else 'MISSED in ' + ', '.join(goals[key]['missed_in'])}")
    print(json.dumps({"matrix": rows, "goals": goals, "cpu": args.cpu}))
    return 0


SPARE_CASES = (("small-4x8", (7, 8, 9, 10)), ("shared-64x8", (None, 11, 12)), ("one-big-job-128x8", (None, 11, 12)))
"""``--spare``: scenario (examples/clusters and examples/policies of that name) -> seeds (None: the file's)."""


def spare_row(name: str, seed) -> dict:
    """One ``--spare`` row: capctl with the example policy's ``spread_spare_watts`` false, then
    true (docs/policy.md, "Spare watts"), against uniform and the oracle (run once, the flag is
    capctl's): capctl/uniform, capctl/oracle and energy per GPU-step (J), each ``[off, on]``."""
    from capctl.policy import load_policy
    from capctl.sim.cluster import load_cluster
    from capctl.sim.engine import build_scenario, run_policy

    spec = load_cluster(ROOT / "examples" / "clusters" / f"{name}.yaml")
    if seed is not None:
        spec = replace(spec, seed=seed)
    base = load_policy(ROOT / "examples" / "policies" / f"{name}.yaml")
    scn = build_scenario(spec, replace(base, spread_spare_watts=False))
    u, o = run_policy(scn, "uniform").throughput, run_policy(scn, "oracle").throughput
    c = [run_policy(build_scenario(spec, replace(base, spread_spare_watts=on)), "capctl") for on in (False, True)]
    return {"scenario": name, "seed": spec.seed, "capctl/uniform": [round(r.throughput / u, 4) for r in c],
            "capctl/oracle": [round(r.throughput / o, 4) for r in c],
            "energy_per_step_j": [round(r.energy_per_step_j, 1) for r in c]}


def run_spare() -> int:
    """``--spare``: the table of docs/policy.md "Spare watts"; one JSON line per row."""
    for name, seeds in SPARE_CASES:
        for seed in seeds:
            print(json.dumps(spare_row(name, seed)), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--matrix", action="store_true", help="the issue-12 table: four scenarios x three seeds")
    ap.add_argument("--scenarios", help=f"with --matrix: a subset of {','.join(MATRIX)}")
    ap.add_argument("--seeds", help="with --matrix: seeds, e.g. file,11,12 (file = the cluster file's)")
    ap.add_argument("--cluster", default=str(ROOT / "examples/clusters/shared-64x8.yaml"))
    ap.add_argument("--policy", default=str(ROOT / "examples/policies/shared-64x8.yaml"))
    ap.add_argument("--seed", type=int)
    ap.add_argument("--duration", type=float)
    ap.add_argument("--plot", metavar="DIR")
    ap.add_argument("--all-cores", action="store_true", help="do not pin to one core")
    ap.add_argument("--spare", action="store_true",
                    help="the spread_spare_watts table of docs/policy.md (off -> on, three scenarios)")
    args = ap.parse_args(argv)
    cpu = None
    if not args.all_cores and hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
    if args.matrix:
        args.cpu = {"pinned_core": cpu, "host_cpus": os.cpu_count()}
        return run_matrix(args)
    if args.spare:
        return run_spare()
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
