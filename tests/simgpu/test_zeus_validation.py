"""The DVFS + step-time model against measured time-vs-power-limit curves (Zeus, Apache-2.0).

Data: ../shared/data/zeus-power-traces/summary_power_v100.csv (Zeus project, You et al.,
"Zeus: Understanding and Optimizing GPU Energy Consumption of DNN Training", NSDI'23): epoch time
of many (dataset, network, batch size, optimizer) workloads on V100 at power limits 100-250 W.
For each workload we fit demand D, memory-bound fraction m and a time scale to the simulator's own
steady-state curve (capsim_steady_state) and check how well the model shape reproduces the
measurements.
"""

from __future__ import annotations

import collections
import csv

import numpy as np
import pytest
from scipy.optimize import least_squares

from capctl.simgpu.build import REPO_ROOT
from capctl.simgpu.node import steady_state
from tests.conftest import require

DATA = REPO_ROOT.parent / "shared" / "data" / "zeus-power-traces" / "summary_power_v100.csv"


def _groups(path):
    rows = list(csv.DictReader(path.open()))
    groups = collections.defaultdict(list)
    for r in rows:
        key = (r["dataset"], r["network"], r["batch_size"], r["optimizer"])
        groups[key].append((float(r["power_limit"]), float(r["time_per_epoch"])))
    return {k: sorted(v) for k, v in groups.items() if len(v) >= 5}


def _fit(caps_w, time_s):
    def resid(x):
        log_k, demand_w, m = x
        rate, _, _ = steady_state("V100-SXM2", caps_w, demand_w=demand_w, memory_bound_fraction=m,
                                  speed=1.0, thermal=False, quantized=False)
        return log_k - np.log(rate) - np.log(time_s)

    best = None
    for d0 in (0.8, 1.0, 1.3):
        r = least_squares(resid, [np.log(time_s.min()), caps_w.max() * d0, 0.3],
                          bounds=([-10.0, 50.0, 0.0], [20.0, 1000.0, 0.99]))
        if best is None or r.cost < best.cost:
            best = r
    return best.x, np.abs(np.expm1(resid(best.x)))


@pytest.mark.integration
def test_model_reproduces_zeus_v100_time_vs_power_limit(simlib):
    require(DATA.is_file(), f"Zeus power traces not found at {DATA}")
    groups = _groups(DATA)
    assert len(groups) >= 30
    worst = []
    for pts in groups.values():
        caps = np.array([p[0] for p in pts])
        times = np.array([p[1] for p in pts])
        _, err = _fit(caps, times)
        worst.append(err.max())
    worst = np.array(worst)
    # typical workload: every point within ~5%; measurement noise makes a few outliers
    assert np.median(worst) < 0.08
    assert np.mean(worst < 0.15) > 0.75
