#!/usr/bin/env python3
"""One stalled NVML call on a real agent: do the node's other GPUs keep reporting?

    .venv/bin/python bench/nvml_stall.py [--gpus 3] [--interval-s 0.25] [--stall-s 1.0] [--watch-s 4.0]

A real coordinator and agent on one simulated node of ``--gpus`` H100s (real pynvml on the
simulated driver), one job on all of them. Then every NVML call on GPU 1 stalls ``--stall-s``
seconds (fault ``nvml_stall``) and GPU 0's load drops 650 -> 300 W; for ``--watch-s`` seconds the
node's status is polled every 0.1 s. Prints the largest report age (s) seen, how many polls found
the node stale, GPU 0's power as the coordinator last saw it (W: 300 when its reports kept coming)
and GPU 1's cap state; last line: one JSON object. Runs on any capctl with the ``nvml_stall`` fault
(before the per-GPU timeouts of nodeagent/callguard.py too). Everything started is stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(workdir: Path, gpus: int, interval_s: float, stall_s: float, watch_s: float) -> dict:
    """One cluster, one stall; returns the figures (s, W, counts)."""
    from coordinator.client import AdminClient
    from tests.support.processes import Cluster

    def node(c):
        return next(n for n in c.status().nodes if n.name == "n1")

    with Cluster(workdir, {"n1": gpus}, budget_w=500.0 * gpus, interval_s=interval_s, lease_s=8 * interval_s) as cl:
        sim = cl.sims["n1"]
        for i in range(gpus):
            sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (c.status().nodes and not node(c).stale):
                time.sleep(0.1)
            assert cl.agent("n1").client().job_start("S1", [str(i) for i in range(gpus)]).ok
            time.sleep(8 * interval_s)
            sim.inject(1, "nvml_stall", stall_s)
            sim.set_load(0, 300.0)
            t0, ages, stale = time.monotonic(), [], 0
            while time.monotonic() - t0 < watch_s:
                n = node(c)
                ages.append(n.last_report_age_s)
                stale += bool(n.stale)
                time.sleep(0.1)
            n = node(c)
            sim.clear(1, "nvml_stall")
    return {"gpus": gpus, "interval_s": interval_s, "stall_s": stall_s, "watch_s": watch_s,
            "max_report_age_s": round(max(ages), 2), "polls": len(ages), "polls_stale": stale,
            "gpu0_power_seen_w": round(n.gpus[0].power_w, 1), "gpu1_state": n.gpus[1].cap_state_name}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=3)
    p.add_argument("--interval-s", type=float, default=0.25)
    p.add_argument("--stall-s", type=float, default=1.0)
    p.add_argument("--watch-s", type=float, default=4.0)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="capctl-stall-") as d:
        r = run(Path(d), a.gpus, a.interval_s, a.stall_s, a.watch_s)
    print(f"stall of {r['stall_s']:g} s per NVML call on GPU 1 of {r['gpus']}, interval {r['interval_s']:g} s: "
          f"max report age {r['max_report_age_s']:.2f} s, {r['polls_stale']}/{r['polls']} polls stale, "
          f"GPU 0 power seen {r['gpu0_power_seen_w']:.0f} W (its load went 650 -> 300 W), GPU 1 {r['gpu1_state']}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
