#!/usr/bin/env python3
"""Per-job energy benchmark: a real coordinator and agent on 2 simulated GPUs (real pynvml on the
simulated driver), one short job at a time, its energy as capctl reports it against the devices'
own energy counters.

    .venv/bin/python bench/job_energy.py [--job-s 1.02] [--intervals 1.0,0.5] [--load-w 450]

For each interval: starts the cluster (budget and start cap at the devices' maximum, so the load
runs uncapped), loads both GPUs, reads both simulated energy counters, runs JobStart, polls
``capctl jobs`` (Admin.Jobs) every 0.1 s while the job runs, JobEnd, reads the counters again and
then asks for the finished job (Admin.FinishedJobs; missing on a coordinator without it). Prints,
per interval: the counter difference (J) from before JobStart to after JobEnd (and from after
JobStart returned to before JobEnd was called: the agent's own readings lie between the two), the most any running-job poll showed (J), the finished
record's energy (J, or "dropped"), and the ratios reported / counters. Last line: one JSON object.
Everything started is stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_run(workdir: Path, interval_s: float, job_s: float, load_w: float) -> dict:
    """One cluster, one job; returns the figures (J, s)."""
    from coordinator.client import AdminClient
    from tests.support.processes import Cluster

    with Cluster(workdir, {"n1": 2}, budget_w=1400.0, interval_s=interval_s, start_cap_w=700.0) as cl:
        sim = cl.sims["n1"]
        for i in range(2):
            sim.set_load(i, load_w)
        with AdminClient(cl.coordinator.admin_address) as c:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (c.status().nodes and not c.status().nodes[0].stale):
                time.sleep(0.1)
            time.sleep(2 * interval_s)
            agent = cl.agent("n1").client()
            e0 = sum(sim.read(i)["energy_j"] for i in range(2))
            assert agent.job_start("E1", ["0", "1"]).ok
            e0_in = sum(sim.read(i)["energy_j"] for i in range(2))
            polls, seen = 0, []
            end = time.monotonic() + job_s
            while time.monotonic() < end:
                jobs = {j.job_id: j for j in c.jobs().jobs}
                polls += 1
                seen.append(jobs["E1"].energy_j if "E1" in jobs else 0.0)
                time.sleep(min(0.1, max(0.0, end - time.monotonic())))
            e1_in = sum(sim.read(i)["energy_j"] for i in range(2))
            agent.job_end("E1")
            e1 = sum(sim.read(i)["energy_j"] for i in range(2))
            finished = _finished(c, "E1", 5.0)
    truth = e1 - e0
    return {"interval_s": interval_s, "counters_j": round(truth, 2), "counters_inner_j": round(e1_in - e0_in, 2),
            "polls": polls,
            "max_running_j": round(max(seen or [0.0]), 2), "finished_j": finished,
            "running_ratio": round(max(seen or [0.0]) / truth, 4),
            "finished_ratio": None if finished is None else round(finished / truth, 4)}


def _finished(c, job_id: str, wait_s: float):
    """The finished job's energy (J) as the coordinator keeps it, or None (not kept / no RPC)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            jobs = c.finished_jobs(job_id=job_id)
        except AttributeError:
            return None  # a coordinator/client without finished jobs
        if jobs:
            return round(jobs[0].energy_j, 2)
        time.sleep(0.1)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job-s", type=float, default=1.02)
    ap.add_argument("--intervals", default="1.0,0.5")
    ap.add_argument("--load-w", type=float, default=450.0)
    args = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="capctl-bench-energy-") as tmp:
        for k, iv in enumerate(float(x) for x in args.intervals.split(",")):
            work = Path(tmp) / f"run{k}"
            work.mkdir()
            r = one_run(work, iv, args.job_s, args.load_w)
            print(f"interval {iv:g} s: counters {r['counters_j']:.1f} J around the JobStart/JobEnd calls "
                  f"({r['counters_inner_j']:.1f} J between them) over {args.job_s:g} s; running polls "
                  f"({r['polls']}) max {r['max_running_j']:.1f} J ({100 * r['running_ratio']:.1f} %); finished "
                  + ("dropped" if r["finished_j"] is None else
                     f"{r['finished_j']:.1f} J ({100 * r['finished_ratio']:.2f} %)"))
            out.append(r)
    print(json.dumps({"job_energy": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
