"""Caps after a load step, on real agents (simulated driver): direction changes and settling.

Run: ``.venv/bin/python bench/load_step.py [--interval-s 2] [--intervals 16] [--seed 100]
[--power-factors 1,1.15,0.9,1.3] [--continuous]``
(about 16 intervals + 15 s). The issue-12 setup: 2 nodes x 4 simulated H100 (200..700 W), one
synchronous job on all 8 GPUs, budget 0.7 x TDP (3,920 W), demand 300 W then 650 W on every GPU.

Per GPU, the requested limit is sampled on the device at the middle of each interval after the step
(``limit_w``, the simulated driver's true state) with its 1 s-averaged power reading
(``power_avg_w``, what NVML reports on Ampere/Hopper). Printed per GPU: the caps, how many times
the cap changed direction (changes smaller than 1 % of the limit range are not moves), and the
interval after which it stayed within 1 % of the range (5 W) of its final value. A summary line
gives the worst GPU. ``--continuous``: the devices' SM clock follows the cap continuously (whole
MHz off the 15 MHz grid, the simulated driver's ``continuous_clock``) instead of in 15 MHz steps,
so the pace loop runs without its clock-step alignment (coordinator/pacealign.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.client import AdminClient  # noqa: E402
from tests.coordinator.conftest import wait_for  # noqa: E402
from tests.support.processes import Cluster  # noqa: E402

RANGE_W = 500.0  # H100 limit constraints 200..700 W
TOL_W = 0.01 * RANGE_W
IDLE_LOAD_W = 80.0  # an idle GPU's demand before its job starts (``--job-start``)


def reversals(caps: list[float]) -> int:
    """Direction changes of ``caps``, ignoring moves below :data:`TOL_W`."""
    signs = []
    for a, b in zip(caps, caps[1:]):
        if abs(b - a) >= TOL_W:
            signs.append(1 if b > a else -1)
    return sum(1 for s, t in zip(signs, signs[1:]) if s != t)


def settled_after(caps: list[float]) -> int:
    """The first interval from which every cap stays within :data:`TOL_W` of the last one."""
    final = caps[-1]
    k = len(caps)
    while k > 0 and abs(caps[k - 1] - final) <= TOL_W:
        k -= 1
    return k + 1


def run(workdir: Path, interval_s: float, intervals: int, seed: int, power_factors=(), continuous=False,
        job_start: bool = False, budget_tdp: float = 0.7) -> dict:
    """The caps and 1 s power of every GPU at the middle of each interval after the step (see the
    module docstring); ``job_start``: the step is the job's start (its GPUs idle before, 650 W demand
    from the moment the job is bound) instead of a load change of a running job; ``budget_tdp``: the
    cluster budget as a fraction of the GPUs' TDP (700 W each)."""
    kw = {"n1": {"seed": seed}, "n2": {"seed": seed + 1}}
    with Cluster(workdir, {"n1": 4, "n2": 4}, budget_w=budget_tdp * 700.0 * 8, interval_s=interval_s,
                 lease_s=max(3.0, 4 * interval_s), sim_kwargs=kw) as cl:
        for j, sim in enumerate(cl.sims.values()):
            for i in range(4):
                sim.set_load(i, 300.0)
                if power_factors:
                    sim.set_param(i, "power_factor", power_factors[(4 * j + i) % len(power_factors)])
                if continuous:  # the clock follows the cap continuously (no 15 MHz steps)
                    sim.inject(i, "continuous_clock")
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 2 and all(not n.stale for n in c.status().nodes), 30, "agents")
            if job_start:  # idle GPUs (no job, light load) settle first
                for sim in cl.sims.values():
                    for i in range(4):
                        sim.set_load(i, IDLE_LOAD_W)
                time.sleep(6 * interval_s)
                for sim in cl.sims.values():
                    for i in range(4):
                        sim.set_load(i, 650.0)
            assert cl.agent("n1").client().job_start("J", ["0", "1", "2", "3"]).ok
            assert cl.agent("n2").client().job_start("J", ["0", "1", "2", "3"]).ok
            if not job_start:
                time.sleep(6 * interval_s)
                for sim in cl.sims.values():
                    for i in range(4):
                        sim.set_load(i, 650.0)
            t0 = time.monotonic()
            caps = {(n, i): [] for n in cl.sims for i in range(4)}
            power = {(n, i): [] for n in cl.sims for i in range(4)}
            for k in range(intervals):
                time.sleep(max(0.0, t0 + (k + 0.5) * interval_s - time.monotonic()))
                for (n, i) in caps:
                    r = cl.sims[n].read(i)
                    caps[(n, i)].append(r["limit_w"])
                    power[(n, i)].append(r["power_avg_w"])
    return {"caps": caps, "power": power}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--intervals", type=int, default=16)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--power-factors", type=lambda t: [float(x) for x in t.split(",")], default=[],
                    help="per-GPU dynamic power factors, cycled (e.g. 1,1.15,0.9,1.3: parts needing more power)")
    ap.add_argument("--continuous", action="store_true",
                    help="a plant whose SM clock moves continuously with its cap (the simulated driver's "
                         "continuous_clock), not in 15 MHz steps")
    ap.add_argument("--job-start", action="store_true",
                    help="the step is a job's start: its GPUs idle (no job, light load) before, 650 W demand once "
                         "the job is bound")
    ap.add_argument("--budget-tdp", type=float, default=0.7,
                    help="the cluster budget as a fraction of the 8 GPUs' TDP (default 0.7, the issue-12 setup)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = run(Path(d), args.interval_s, args.intervals, args.seed, args.power_factors, args.continuous,
                  args.job_start, args.budget_tdp)
    worst_rev = worst_settle = 0
    for key, caps in out["caps"].items():
        rev, settle = reversals(caps), settled_after(caps)
        worst_rev, worst_settle = max(worst_rev, rev), max(worst_settle, settle)
        print(f"{key[0]}/{key[1]}: caps {[round(c) for c in caps]} | 1 s power {[round(p) for p in out['power'][key]]}"
              f" | direction changes {rev}, settled after interval {settle}")
    print(f"plant: {'continuous clock' if args.continuous else '15 MHz clock steps'}; step: "
          f"{'the job starts (its GPUs idle before)' if args.job_start else 'load 300 -> 650 W of a running job'}")
    print(f"worst GPU: {worst_rev} direction changes, settled (within {TOL_W:g} W) after interval {worst_settle} "
          f"of {args.intervals} (goal: <= 1 and <= 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
