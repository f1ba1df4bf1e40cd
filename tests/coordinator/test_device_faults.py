"""A stalled NVML call on real agents (simulated driver fault ``nvml_stall``): the agent's per-GPU
timeouts (nodeagent/callguard.py) keep the node's other GPUs reporting every interval, the stalled
GPU is reported ``STALLED`` without a reading and held (never written, never raised), the sum of the
enforced limits stays within the budget at every instant (journal), and the GPU recovers."""

from __future__ import annotations

import time

import pytest

from tests.conftest import require
from tests.coordinator.conftest import wait_for

pytestmark = pytest.mark.integration


def _node(client, name: str):
    return next(n for n in client.status().nodes if n.name == name)


def test_one_stalled_gpu_is_held_while_the_others_keep_reporting_and_it_recovers(tmp_path):
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient

    budget = 1500.0
    with Cluster(tmp_path, {"n1": 3}, budget_w=budget, interval_s=0.25, lease_s=2.0) as cl:
        for sim in cl.sims.values():
            for i in range(sim.gpu_count):
                sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "agent")
            assert cl.agent("n1").client().job_start("J", ["0", "1", "2"]).ok
            wait_for(lambda: all(sim.read(i)["limit_w"] < 600 for sim in cl.sims.values()
                                 for i in range(sim.gpu_count)), 20, "caps applied")
            since_ns = time.monotonic_ns()
            n1 = cl.sims["n1"]
            n1.inject(1, "nvml_stall", 1.0)  # every NVML call on GPU 1 hangs 1 s (the agent waits 0.5 s)
            wait_for(lambda: _node(c, "n1").gpus[1].cap_state_name == "STALLED", 10, "GPU 1 STALLED")
            held_w, sets = n1.read(1)["limit_w"], n1.read(1)["set_count"]
            n1.set_load(0, 300.0)  # the other GPUs still report fresh readings, every interval
            deadline = time.monotonic() + 1.0
            ages = []
            while time.monotonic() < deadline:
                node = _node(c, "n1")
                assert not node.stale and node.gpus[1].cap_state_name == "STALLED"
                ages.append(node.last_report_age_s)
                time.sleep(0.2)
            assert max(ages) < 1.0  # reports kept coming (interval 0.25 s, timeout 0.5 s)
            assert _node(c, "n1").gpus[0].power_w < 400  # GPU 0's new load was read during the stall
            assert (n1.read(1)["limit_w"], n1.read(1)["set_count"]) == (held_w, sets)  # never written
            n1.clear(1, "nvml_stall")
            wait_for(lambda: _node(c, "n1").gpus[1].cap_state_name not in ("STALLED", "ERROR"), 30, "GPU 1 back")
            check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget + 1e-6, None, since_ns, None)
            assert check.ok, check.describe()


def test_a_job_held_below_its_curves_range_shows_no_made_up_predicted_rate(tmp_path):
    """A job whose GPU is held (STALLED) at a cap below its rate curve's range has no predicted
    step rate: null in the reply, "-" in ``capctl jobs``, "no predicted step rate" in ``explain``.
    Here GPU 1 stalls while idle at the device minimum, 200 W, and is held there when the job
    starts; on an unknown product's generic curve (the A40 fit mapped onto 200-700 W) 200 W is
    below the cap of the curve's floor (202.1 W). It showed 0.050, that floor, while its job-mate
    got 262.5 W (462 W in all; the simulated GPU runs at 0.62-0.67 at 200 W; found by a try-out)."""
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    import math

    from capctl import statusview
    from capctl.simgpu import profiles
    from coordinator.client import AdminClient

    unknown = {"n1": {"profile": profiles.custom({"name": "X1000 unknown"}, base="H100-SXM")}}
    with Cluster(tmp_path, {"n1": 2}, budget_w=400.0, interval_s=0.25, lease_s=2.0, sim_kwargs=unknown) as cl:
        n1 = cl.sims["n1"]
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "agent")
            wait_for(lambda: n1.read(1)["limit_w"] == 200.0, 20, "GPU 1 at its minimum (budget 400 W)")
            n1.inject(1, "nvml_stall", 1.0)  # every NVML call on GPU 1 hangs 1 s (the agent waits 0.5 s)
            wait_for(lambda: _node(c, "n1").gpus[1].cap_state_name == "STALLED", 10, "GPU 1 STALLED")
            for i in range(2):
                n1.set_load(i, 650.0)
            cl.agent("n1").client().job_start("J", ["0", "1"])
            assert c.set_budget(1000.0).ok
            wait_for(lambda: c.status().jobs and c.status().jobs[0].binding == "held"
                     and c.status().jobs[0].allocated_w > 460, 10, "the job held, GPU 0 raised")
            st = c.status()
            job = st.jobs[0]
            assert [g.curve for g in st.nodes[0].gpus] == ["generic", "generic"]
            assert n1.read(1)["limit_w"] == 200.0 and job.allocated_w == pytest.approx(462.5, abs=0.1)
            assert math.isnan(job.predicted_step_rate), job.predicted_step_rate  # was 0.05
            row = statusview.render_jobs(statusview.status_dict(st)).splitlines()[1].split()
            assert row[:7] == ["J", "n1", "2", "1", "-", "-", "held"], row
            text = c.explain("J").text
            assert "no predicted step rate" in text and "0.050" not in text, text
            # the generic curve is named: a CURVE column in capctl nodes, a line of explain
            gpu_rows = statusview.render_gpus(statusview.status_dict(st)).splitlines()
            assert [r.split()[-2] for r in gpu_rows] == ["CURVE", "generic", "generic"], gpu_rows
            assert "n1 GPU 1: curve generic (no built-in model for this device" in text, text
            n1.clear(1, "nvml_stall")
