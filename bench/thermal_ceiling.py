#!/usr/bin/env python3
"""Cap churn and job pace under thermal ceilings, by thermal plant (docs/coordinator.md, "Limitations").

    .venv/bin/python bench/thermal_ceiling.py [--gpus 2000] [--intervals 120] [--skip 40]
        [--plant one-pole|two-pole] [--hold-prior] [--whole-degrees]
    .venv/bin/python bench/thermal_ceiling.py --single-gpu

The daemon's own coordinator on bench/interval_cost.py's fleet (its :class:`IntervalBench`: N GPUs,
8 per node, H100-class 200-700 W, racks, budget 0.7 x TDP, a job mix on 90 % of the GPUs, 1 % of
the GPUs running hot; stand-in agents with real messages, a simulated clock of 1 s per interval) at
constant loads (each job stays in the phase its random offset puts it in: heavy, 650 W demand, or
light, 320 W), with the GPUs' temperature from one of two plants:

* ``one-pole``: interval_cost.py's own, ``T += 0.3 (T_ss - T)`` per 1 s interval (tau ~2.8 s),
  ``T_ss = 28 + 0.07 P`` (hot: ``45 + 0.07 P``), +-0.5 degC uniform noise;
* ``two-pole``: a die (tau 2 s, 0.035 degC/W) on a heat sink (tau 40 s, 0.05 degC/W), inlet 25
  degC (hot: 40 degC), no noise: a single-pole thermal fit (capctl.allocator.thermal) cannot
  represent it.

``--whole-degrees``: the GPUs report their temperature floored to whole degrees, as NVML does
(``nvmlDeviceGetTemperature`` returns an unsigned int). ``--hold-prior``: the coordinator's
thermal fit never learns (``ThermalBank.add`` does nothing), so every ceiling uses the prior
(R 0.1 degC/W, tau 30 s, inlet 25 degC): a model slower than the plant, as on a node's first
samples.

Measured over intervals ``skip`` .. ``intervals`` (the devices' side: the caps they enforce, their
temperatures and clocks):

* ``moving_50w``: share of GPU-intervals whose cap moved by more than 50 W (``hot_moving_50w``:
  of the hot GPUs; ``idle_moving_50w`` / ``busy_moving_50w``: of the GPUs of nodes without / with
  a job); ``mean_move_w``: mean |cap change| per GPU per interval (W; ``idle_mean_move_w``: of the
  idle GPUs, ``idle_mean_cap_w`` their mean cap, coordinator/idlegrants.py);
* ``hot_at_target``: share of the hot GPUs' samples at or above the ceiling's target (slowdown
  89 degC - margin 5 degC = 84 degC), ``hot_at_slowdown``: at or above 89 degC, ``hot_max_c``;
* ``pace_mhz``: mean over intervals and jobs of the job's slowest GPU's SM clock (a synchronous
  job's pace).

Control quality only (no timing): CPU load does not change the figures, but the refit budget runs
on real time, so pace differs run to run by up to ~10 MHz. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import interval_cost as ic  # noqa: E402

TARGET_C, SLOWDOWN_C = 84.0, 89.0  # the fleet's slowdown temperature and the policy's 5 degC margin
CONSTANT_LOADS = 10 ** 9
"""``phase_intervals`` of the fleet: no job changes its load within a run (each stays in the phase
its offset puts it in, heavy 650 W or light 320 W)."""


class TwoPoleFleet(ic.Fleet):
    """interval_cost.py's fleet with a die on a heat sink (see module docstring)."""

    DIE = (2.0, 0.035)  # tau s, degC/W
    SINK = (40.0, 0.05)

    def step(self, t: int) -> None:
        if not hasattr(self, "sink_c"):
            self.sink_c = self.temp.copy()
            self.die_c = np.zeros_like(self.temp)
        super().step(t)  # loads, power, clocks, energy (its temperature is replaced below)
        inlet = np.where(self.hot, 40.0, 25.0)
        self.sink_c += (1 - np.exp(-ic.INTERVAL_S / self.SINK[0])) * (inlet + self.SINK[1] * self.power - self.sink_c)
        self.die_c += (1 - np.exp(-ic.INTERVAL_S / self.DIE[0])) * (self.DIE[1] * self.power - self.die_c)
        self.temp = self.sink_c + self.die_c


def whole_degrees(fleet_cls):
    """``fleet_cls`` whose telemetry reports temperatures floored to whole degrees (NVML)."""

    class Whole(fleet_cls):
        def gpu_rows(self, k):
            rows = super().gpu_rows(k)
            for r in rows:
                r.temp_c = float(int(r.temp_c))
            return rows

    return Whole


def run(gpus: int, intervals: int, skip: int, plant: str, hold_prior: bool, whole: bool, seed: int = 0) -> dict:
    """One run (see module docstring); returns the figures."""
    from coordinator import models

    fleet_cls = TwoPoleFleet if plant == "two-pole" else ic.Fleet
    if whole:
        fleet_cls = whole_degrees(fleet_cls)
    saved_add = models.ThermalBank.add
    if hold_prior:
        models.ThermalBank.add = lambda self, rows, time_s, power_w, temp_c: None
    try:
        bench = ic.IntervalBench(gpus, seed, fleet_cls, phase_intervals=CONSTANT_LOADS)
        caps, temps, clocks = asyncio.run(_intervals(bench, intervals))
    finally:
        models.ThermalBank.add = saved_add
    fleet = bench.fleet
    caps, temps, clocks = caps[skip:], temps[skip:], clocks[skip:]
    move = np.abs(np.diff(caps, axis=0))
    hot = fleet.hot
    job = fleet.job_of_node
    pace = [[c[job == j].min() for j in range(len(fleet.jobs))] for c in clocks]
    idle = np.broadcast_to((job < 0)[:, None], hot.shape)  # GPUs of nodes without a job
    return {"gpus": gpus, "plant": plant, "hold_prior": hold_prior, "whole_degrees": whole,
            "intervals": [skip, intervals], "moving_50w": round(float((move > 50).mean()), 4),
            "hot_moving_50w": round(float((move[:, hot] > 50).mean()), 4),
            "mean_move_w": round(float(move.mean()), 2),
            "idle_moving_50w": round(float((move[:, idle] > 50).mean()), 4) if idle.any() else 0.0,
            "busy_moving_50w": round(float((move[:, ~idle] > 50).mean()), 4),
            "idle_mean_move_w": round(float(move[:, idle].mean()), 2) if idle.any() else 0.0,
            "idle_mean_cap_w": round(float(caps[:, idle].mean()), 1) if idle.any() else 0.0,
            "hot_at_target": round(float((temps[:, hot] >= TARGET_C).mean()), 4),
            "hot_at_slowdown": round(float((temps[:, hot] >= SLOWDOWN_C).mean()), 4),
            "hot_max_c": round(float(temps[:, hot].max()), 1), "pace_mhz": round(float(np.mean(pace)), 1)}


async def _intervals(bench, intervals: int):
    caps, temps, clocks = [], [], []
    for it in range(intervals):
        bench.fleet.step(it)
        bench.ingest([bench.fleet.telemetry_bytes(k) for k in range(bench.n_nodes)])
        await bench.one_interval()
        bench.now_s += ic.INTERVAL_S
        caps.append(bench.fleet.enforced.copy())
        temps.append(bench.fleet.temp.copy())
        clocks.append(bench.fleet.clock.copy())
    return np.array(caps), np.array(temps), np.array(clocks)


SINGLE_FITS = ((0.1, 30.0, 25.0), (0.085, 40.0, 40.0), (0.085, 40.0, 25.0), (0.072, 4.6, 44.0), (0.06, 3.7, 51.0),
               (0.15, 12.0, 21.0), (0.05, 60.0, 40.0))
"""``--single-gpu``'s thermal models (R degC/W, tau s, inlet degC): the prior, the plant's steady
state at both inlets, fits the coordinator made of such a plant, and models off both ways."""
SINGLE_READINGS = ((True, 0.0), (True, 0.3), (False, 0.5))
"""``--single-gpu``'s readings: (whole degrees, +- uniform noise degC)."""


def single_gpu(fit, inlet_c: float, whole: bool, noise_c: float, seed: int, damped: bool,
               intervals: int = 300) -> tuple[float, float]:
    """One GPU capped at its thermal ceiling alone (no budget, no job): a die (2 s, 0.035 degC/W)
    on a heat sink (40 s, 0.05 degC/W) at ``inlet_c``, read as ``whole`` degrees with +-``noise_c``
    uniform noise (seed ``seed``), the ceiling from ``fit`` (R, tau, inlet) at a 1 s interval,
    slowdown 87 degC, margin 5 degC, 200-700 W, through ``allocation.thermal_damping`` when
    ``damped`` and ``thermal_guard``. Returns (share of the intervals of the second half whose cap
    moved by more than 50 W, the hottest temperature of that half, degC)."""
    import math

    from capctl.allocator.thermal import thermal_ceiling_w
    from coordinator import allocation

    rng = np.random.default_rng(seed)
    r, tau, inlet = fit
    sink, die, cap, caps, temps = 60.0, 0.0, 300.0, [], []
    lo, hi = np.array([200.0]), np.array([700.0])
    for _ in range(intervals):
        sink += (1 - math.exp(-1 / TwoPoleFleet.SINK[0])) * (inlet_c + TwoPoleFleet.SINK[1] * cap - sink)
        die += (1 - math.exp(-1 / TwoPoleFleet.DIE[0])) * (TwoPoleFleet.DIE[1] * cap - die)
        t = sink + die + rng.uniform(-noise_c, noise_c)
        c = {"temp_c": np.array([float(int(t)) if whole else t]), "slowdown_temp_c": np.array([87.0]),
             "reasons": ((),), "power_w": np.array([cap])}
        acc = np.array([cap])
        ceiling = np.minimum(thermal_ceiling_w(c["temp_c"], inlet, r, tau, 1.0, 87.0, 5.0), 700.0)
        if damped:
            ceiling = allocation.thermal_damping(ceiling, c, acc, lo, hi, 5.0, np.array([r]))
        cap = float(np.clip(allocation.thermal_guard(ceiling, c, acc, lo, hi, 5.0)[0], 200.0, 700.0))
        caps.append(cap)
        temps.append(sink + die)
    half = intervals // 2
    return float((np.abs(np.diff(caps[half:])) > 50.0).mean()), float(max(temps[half:]))


def single_gpu_study(seeds=(1, 2, 3)) -> dict:
    """:func:`single_gpu` over :data:`SINGLE_FITS` x inlets 40 / 25 degC x :data:`SINGLE_READINGS`
    x ``seeds``, without and with the damping: runs with a move of more than 50 W, the hottest."""
    out = {}
    for damped in (False, True):
        runs = [single_gpu(fit, inlet, whole, noise, seed, damped) for fit in SINGLE_FITS for inlet in (40.0, 25.0)
                for whole, noise in SINGLE_READINGS for seed in seeds]
        out["damped" if damped else "undamped"] = {
            "runs": len(runs), "runs_moving_50w": sum(1 for share, _ in runs if share > 0),
            "max_moving_50w": round(max(share for share, _ in runs), 4),
            "hottest_c": round(max(hot for _, hot in runs), 2)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=2000)
    ap.add_argument("--intervals", type=int, default=120)
    ap.add_argument("--skip", type=int, default=40, help="intervals left out of the figures (warm-up)")
    ap.add_argument("--plant", choices=("one-pole", "two-pole"), default="two-pole")
    ap.add_argument("--hold-prior", action="store_true")
    ap.add_argument("--whole-degrees", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--single-gpu", action="store_true",
                    help="the single-GPU study of allocation.thermal_damping instead (see single_gpu)")
    args = ap.parse_args(argv)
    if args.single_gpu:
        r = single_gpu_study()
        for k, v in r.items():
            print(f"{k}: {v['runs_moving_50w']} of {v['runs']} runs with caps moving by more than 50 W (worst "
                  f"{100 * v['max_moving_50w']:.0f} % of the intervals), hottest {v['hottest_c']:.1f} degC")
        print(json.dumps({"bench": "thermal_ceiling_single_gpu", **r}))
        return 0
    if not 0 <= args.skip < args.intervals - 1:
        ap.error(f"--skip {args.skip}: need 0 <= skip < intervals - 1 ({args.intervals - 1})")
    r = run(args.gpus, args.intervals, args.skip, args.plant, args.hold_prior, args.whole_degrees, args.seed)
    print(f"{r['gpus']} GPUs, {r['plant']} plant{', fit held at the prior' if r['hold_prior'] else ''}"
          f"{', whole degrees' if r['whole_degrees'] else ''}: caps moving > 50 W {100 * r['moving_50w']:.1f} % "
          f"(hot GPUs {100 * r['hot_moving_50w']:.1f} %), mean move {r['mean_move_w']:.1f} W; hot GPUs at the "
          f"target {100 * r['hot_at_target']:.1f} %, at slowdown {100 * r['hot_at_slowdown']:.2f} %, "
          f"max {r['hot_max_c']:.1f} degC; pace {r['pace_mhz']:.0f} MHz")
    print(json.dumps({"bench": "thermal_ceiling", **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
