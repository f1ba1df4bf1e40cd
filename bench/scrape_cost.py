#!/usr/bin/env python3
"""CPU cost of one Prometheus scrape of the coordinator, by ``metrics.per_gpu_series`` mode.

    .venv/bin/python bench/scrape_cost.py [--gpus 8000,100000] [--modes all,flagged,none,auto] [--repeat 3]

The coordinator is bench/interval_cost.py's (the daemon's own :class:`coordinator.loop.Coordinator`
with stand-in agents sending real telemetry, 8 H100-class GPUs per node, racks of 32 nodes), run
for a few intervals; a random 0.5 % of its GPUs report cap state ``FOREIGN_WRITER`` (what ``flagged``
keeps). Then for each mode, with the policy's ``metrics`` set to it: the scrape as the HTTP exporter
does it, ``prometheus_client.generate_latest`` of the coordinator's whole registry
(:class:`coordinator.metrics.Metrics`: view families, cap states, process metrics). Building the
view the collectors read (:meth:`LazyView.resolve`, once per interval that is read, whatever the
mode) is not in these figures: bench/interval_cost.py's ``view`` stage has it. Reported per mode: CPU seconds of the scrape (best of
``--repeat``, ``time.process_time``), series (sample lines) and bytes of the exposition. The last
line is one JSON object.

The modes need a capctl with ``metrics.per_gpu_series`` (``--modes all`` runs on older sources too:
the "before" figure).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import interval_cost  # noqa: E402  (bench/interval_cost.py: puts the checkout on sys.path)

FLAGGED_FRACTION = 0.005
"""Fraction of GPUs reporting a non-OK cap state (FOREIGN_WRITER)."""


def _flag_some(fleet, fraction: float, seed: int) -> int:
    """Make ``fraction`` of ``fleet``'s GPUs report FOREIGN_WRITER (wraps its ``gpu_rows``); returns
    how many."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    flagged = rng.random((fleet.n, interval_cost.GPUS_PER_NODE)) < fraction
    rows_of = fleet.gpu_rows

    def gpu_rows(k: int):
        rows = rows_of(k)
        for i in np.flatnonzero(flagged[k]):
            rows[i].cap_state = fleet.pb.CapState.Value("FOREIGN_WRITER")
        return rows

    fleet.gpu_rows = gpu_rows
    return int(flagged.sum())


def _with_mode(policy, mode: str):
    """``policy`` with ``metrics.per_gpu_series`` = ``mode`` (``all`` on sources without the key)."""
    if not hasattr(policy, "metrics"):
        if mode != "all":
            raise SystemExit(f"--modes {mode}: this capctl has no metrics.per_gpu_series (only 'all' runs)")
        return policy
    return dataclasses.replace(policy, metrics=dataclasses.replace(policy.metrics, per_gpu_series=mode))


def measure(n_gpus: int, modes: list[str], repeat: int, seed: int = 0, intervals: int = 3) -> dict:
    """Build the coordinator, run ``intervals`` intervals, then scrape once per mode ``repeat`` times."""
    from prometheus_client import generate_latest

    from coordinator.metrics import Metrics

    bench = interval_cost.IntervalBench(n_gpus, seed)
    n_flagged = _flag_some(bench.fleet, FLAGGED_FRACTION, seed)
    asyncio.run(bench.run(intervals, 0, ""))
    coord = bench.coord
    metrics = Metrics(coord)
    coord.view.resolve()
    base = coord.policy
    out = {"gpus": n_gpus, "flagged_gpus": n_flagged, "modes": {}}
    try:
        for mode in modes:
            coord.policy = _with_mode(base, mode)
            best, text = float("inf"), b""
            for _ in range(repeat):
                t0 = time.process_time()
                text = generate_latest(metrics.registry)
                best = min(best, time.process_time() - t0)
            series = sum(1 for line in text.split(b"\n") if line and not line.startswith(b"#"))
            out["modes"][mode] = {"scrape_cpu_s": round(best, 4), "series": series, "bytes": len(text)}
    finally:
        coord.policy = base
        metrics.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="8000,100000", help="comma-separated cluster sizes (GPUs, multiples of 8)")
    ap.add_argument("--modes", default="all,flagged,none,auto", help="metrics.per_gpu_series values to scrape")
    ap.add_argument("--repeat", type=int, default=3, help="scrapes per mode (best CPU time kept)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = []
    for n in [int(x) for x in args.gpus.split(",") if x.strip()]:
        r = measure(n, modes, max(1, args.repeat), args.seed)
        figures = "; ".join(f"{m}: {v['scrape_cpu_s']:.3f} s CPU, {v['series']:,} series, {v['bytes'] / 1e6:.1f} MB"
                            for m, v in r["modes"].items())
        print(f"{n:>7} GPUs ({r['flagged_gpus']} flagged): {figures}", flush=True)
        results.append(r)
    print(json.dumps({"bench": "scrape_cost", "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
