"""Observed-state scenarios of issue 12 on real agents (simulated driver), printed as figures.

Run: ``.venv/bin/python bench/observed_state.py`` (about a minute; 2 nodes x 4 simulated H100).

* ``oob``: budget 0.85 x TDP, all 8 GPUs in one job at 650 W demand; an out-of-band limit of 500 W on
  n1 GPU 0. Prints the coordinator's enforced total against the devices' (read from the simulated
  driver), the job-mates' caps and SM clocks, and what ``explain`` says of the slowest GPU.
* ``idle``: job A on n1 (4 GPUs), job B on n2 (4 GPUs), budget 0.7 x TDP; A ends: prints B's caps
  before and 3 s after, and the idle GPUs' limits.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.client import AdminClient  # noqa: E402
from tests.coordinator.conftest import wait_for  # noqa: E402
from tests.support.processes import Cluster  # noqa: E402

TDP_W = 700.0


def _devices(cl):
    return {(n, i): sim.read(i) for n, sim in cl.sims.items() for i in range(4)}


@contextlib.contextmanager
def _two_jobs(workdir: Path, budget_tdp: float, job_n1: str, job_n2: str):
    """2 nodes x 4 GPUs at 650 W demand under ``budget_tdp`` x TDP, job ``job_n1`` on n1's GPUs and
    ``job_n2`` on n2's (the same id: one job over both nodes), 8 s to settle; yields (cluster, admin
    client)."""
    with Cluster(workdir, {"n1": 4, "n2": 4}, budget_w=budget_tdp * TDP_W * 8, interval_s=1.0, lease_s=5.0) as cl:
        for sim in cl.sims.values():
            for i in range(4):
                sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 2 and all(not n.stale for n in c.status().nodes), 20, "agents")
            assert cl.agent("n1").client().job_start(job_n1, ["0", "1", "2", "3"]).ok
            assert cl.agent("n2").client().job_start(job_n2, ["0", "1", "2", "3"]).ok
            time.sleep(8)
            yield cl, c


def oob(workdir: Path) -> None:
    with _two_jobs(workdir, 0.85, "J", "J") as (cl, c):
        cl.sims["n1"].inject(0, "oob_limit", 500.0)
        time.sleep(10)
        st = c.status()
        dev = _devices(cl)
        coord_enf = sum(g.enforced_w for n in st.nodes for g in n.gpus)
        dev_enf = sum(d["enforced_w"] for d in dev.values())
        print(f"oob: coordinator enforced total {coord_enf:.0f} W, devices {dev_enf:.0f} W")
        mates = [(k, d["limit_w"], d["sm_clock_mhz"]) for k, d in dev.items() if k != ("n1", 0)]
        print("oob: n1/0 enforced %.0f W at %.0f MHz" % (dev[("n1", 0)]["enforced_w"], dev[("n1", 0)]["sm_clock_mhz"]))
        print("oob: job-mates limit W / MHz: " + ", ".join(f"{k[0]}/{k[1]} {w:.0f}/{m:.0f}" for k, w, m in mates))
        ex = c.explain("J")
        print("oob: explain:", ex.text.replace("\n", " | "))


def idle(workdir: Path) -> None:
    with _two_jobs(workdir, 0.7, "A", "B") as (cl, c):
        before = [cl.sims["n2"].read(i)["enforced_w"] for i in range(4)]
        assert cl.agent("n1").client().job_end("A").ok
        for i in range(4):
            cl.sims["n1"].set_load(i, 0.0)
        time.sleep(4)
        after = [cl.sims["n2"].read(i)["enforced_w"] for i in range(4)]
        idle_w = [cl.sims["n1"].read(i)["enforced_w"] for i in range(4)]
        print(f"idle: B's caps before A ends {before}, 4 s after {after}; A's idle GPUs {idle_w}")


def straggler(workdir: Path) -> None:
    with _two_jobs(workdir, 0.7, "J", "K") as (cl, c):
        cl.sims["n1"].inject(0, "stuck_slowdown", 0.42)
        time.sleep(10)
        dev = _devices(cl)
        st = c.status()
        jobs = {j.job_id: j for j in st.jobs}
        flags = {(n.name, g.index): list(getattr(g, "flags", [])) for n in st.nodes for g in n.gpus}
        print("straggler: n1/0 %.0f W at %.0f MHz, flags %s" % (dev[("n1", 0)]["limit_w"], dev[("n1", 0)]["sm_clock_mhz"],
                                                             flags[("n1", 0)]))
        print("straggler: J's job-mates W/MHz: " + ", ".join(f"n1/{i} {dev[('n1', i)]['limit_w']:.0f}/"
                                                            f"{dev[('n1', i)]['sm_clock_mhz']:.0f}" for i in (1, 2, 3)))
        print("straggler: K's caps W: " + ", ".join(f"{dev[('n2', i)]['limit_w']:.0f}" for i in range(4)))
        j = jobs["J"]
        print(f"straggler: J predicted {j.predicted_step_rate:.3f}, measured "
              f"{getattr(j, 'measured_step_rate', float('nan')):.3f}, true pace (slowest clock / max) "
              f"{min(dev[('n1', i)]['sm_clock_mhz'] for i in range(4)) / 1980:.3f}")
        print("straggler: explain:", c.explain("J").text.replace("\n", " | "))


if __name__ == "__main__":
    which = sys.argv[1:] or ["oob", "idle", "straggler"]
    with tempfile.TemporaryDirectory() as d:
        for name in which:
            (Path(d) / name).mkdir()
            globals()[name](Path(d) / name)
