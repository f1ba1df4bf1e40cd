"""Status and explain tell the truth under device faults, on real agents (``capctl-agent`` on the
simulated driver, real pynvml): a GPU without a live reading (LOST, STALLED) shows no readings
(null in JSON, "-" in the tables, not ranked by temperature, no measured pace) while it keeps
counting at its last known caps; no 0 W thermal ceiling is shown where there is no estimate; a
job held by an out-of-band limit names it as its binding; a held GPU's detail follows its
current state."""

from __future__ import annotations

import time
import types

import pytest

from tests.coordinator.conftest import gpus_by_index, one_node_cluster, wait_for

pytestmark = pytest.mark.integration


_cluster = one_node_cluster
_gpus = gpus_by_index


def _started(cl, c, sim, load_w=650.0):
    for i in range(4):
        sim.set_load(i, load_w)
    wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 reporting")
    assert cl.agent("n1").client().job_start("J", ["0", "1", "2", "3"]).ok
    wait_for(lambda: all(sim.read(i)["limit_w"] < 650 for i in range(4)), 20, "every GPU capped")
    wait_for(lambda: _gpus(c.status())[3].power_w > 100, 10, "GPU 3 read")  # a reading to go stale


def test_a_lost_gpu_shows_no_live_reading_and_keeps_counting_at_its_last_caps(tmp_path):
    from capctl import capstates
    from capctl.statusview import explain_dict, render_gpus, render_status, status_dict
    from coordinator.client import AdminClient
    from coordinator.metrics import _gpu_families

    with _cluster(tmp_path, budget_w=1000.0) as cl:  # tight: the lost GPU is the job's slowest
        sim = cl.sims["n1"]
        with AdminClient(cl.coordinator.admin_address) as c:
            _started(cl, c, sim)
            sim.inject(3, "gpu_lost")
            wait_for(lambda: capstates.of(_gpus(c.status())[3]) == capstates.LOST, 20, "GPU 3 LOST")
            time.sleep(1.0)  # two intervals with the GPU lost
            st = c.status()
            g = _gpus(st)[3]
            # still counted at its last known caps (never as 0 W freed)
            assert g.enforced_w > 200.0 and g.cap_w == pytest.approx(g.enforced_w, abs=1.0)
            assert st.enforced_w == pytest.approx(sum(x.enforced_w for x in _gpus(st).values()), abs=1e-3)
            assert st.enforced_w <= 1000.0 + 1e-6
            # the measured draw: the live readings only (the lost GPU's last draw is no fact of now)
            live_w = [x.power_w for i, x in _gpus(st).items() if i != 3]
            assert st.draw_w == pytest.approx(sum(live_w), abs=1e-3) and min(live_w) > 100.0
            assert st.domains[0].draw_w == pytest.approx(st.draw_w, abs=1e-3)
            d = status_dict(st)
            lost = next(x for x in d["nodes"][0]["gpus"] if x["index"] == 3)
            assert (lost["power_w"], lost["temp_c"], lost["sm_clock_mhz"], lost["thermal_ceiling_w"]) == (None,) * 4
            assert lost["clocks_event_reasons"] == [] and lost["enforced_w"] == pytest.approx(g.enforced_w)
            live = next(x for x in d["nodes"][0]["gpus"] if x["index"] == 0)
            assert live["power_w"] > 100 and live["temp_c"] > 20 and live["sm_clock_mhz"] > 0
            assert g.no_live_reading and not _gpus(st)[0].no_live_reading
            # not ranked among the hottest GPUs; the full table shows its readings as "-"
            hottest = render_gpus(d, limit=5)
            assert "LOST" not in hottest and len(hottest.splitlines()) == 4  # header + GPUs 0-2
            row = next(r for r in render_gpus(d).splitlines() if r.rstrip().endswith("LOST"))
            assert row.split()[5:9] == ["-", "-", "-", "-"]  # power, temp, margin, SM clock
            assert "LOST" in render_status(d)  # (its alert)
            # explain: no measured pace from its last clock
            e = c.explain("J")
            job = next(j for j in st.jobs if j.job_id == "J")
            assert job.measured_step_rate == 0.0 and e.job.measured_step_rate == 0.0
            assert "Measured step rate: no reading — n1 GPU 3 (LOST)" in e.text
            assert "Measured step rate 0." not in e.text
            # the job's pace-setting GPU (the solver picks among equal caps): where it is the lost one,
            # it is named as held, without a temperature
            if (e.slowest_node, e.slowest_gpu_index) == ("n1", 3):
                assert "Slowest GPU (the allocation's curves): n1 GPU 3 — cap" in e.text and "no live reading (LOST)" in e.text
                assert e.job.binding == "held" and "GPU n1/3 LOST" in e.text and "°C" not in e.text
            assert next(x for x in explain_dict(e)["gpus"] if x["index"] == 3)["temp_c"] is None
            # metrics: no power / temperature / clock sample from a stale reading
            fams = {f.name: f for f in _gpu_families(types.SimpleNamespace(gpus=()),
                                                     [("n1", x, "") for x in _gpus(st).values()])}
            for name in ("capctl_gpu_power_watts", "capctl_gpu_temperature_celsius", "capctl_gpu_sm_clock_hertz"):
                assert sorted(s.labels["gpu"] for s in fams[name].samples) == ["0", "1", "2"], name
            assert "3" in [s.labels["gpu"] for s in fams["capctl_gpu_enforced_cap_watts"].samples]


def test_stalled_and_foreign_writer_gpus_show_no_zero_watt_ceiling(tmp_path):
    from capctl import capstates
    from capctl.statusview import status_dict
    from coordinator.client import AdminClient

    with _cluster(tmp_path, budget_w=2000.0) as cl:
        sim = cl.sims["n1"]
        with AdminClient(cl.coordinator.admin_address) as c:
            _started(cl, c, sim)
            sim.inject(1, "foreign_writer", 300.0, period_s=1.0)
            sim.inject(2, "nvml_stall", 5.0)

            def faulted():
                g = _gpus(c.status())
                return (capstates.of(g[1]) == capstates.FOREIGN_WRITER
                        and capstates.of(g[2]) == capstates.STALLED)
            wait_for(faulted, 20, "GPU 1 FOREIGN_WRITER, GPU 2 STALLED")
            st = c.status()
            d = {x["index"]: x for x in status_dict(st)["nodes"][0]["gpus"]}
            assert d[1]["thermal_ceiling_w"] is None and d[2]["thermal_ceiling_w"] is None
            assert all(x["thermal_ceiling_w"] != 0.0 for x in d.values())
            assert d[0]["thermal_ceiling_w"] is not None and d[0]["thermal_ceiling_w"] > 200.0
            # the stalled GPU has no reading; the foreign writer's GPU reads fine
            assert d[2]["power_w"] is None and d[2]["temp_c"] is None and d[2]["sm_clock_mhz"] is None
            assert d[2]["enforced_w"] is not None and d[2]["enforced_w"] > 200.0  # counted at its last limit
            assert d[1]["power_w"] is not None and d[1]["temp_c"] is not None
            assert "thermal ceiling 0 W" not in c.explain("J").text


def test_a_job_held_by_an_out_of_band_limit_names_it_as_its_binding(tmp_path):
    from coordinator.client import AdminClient

    with _cluster(tmp_path, budget_w=2000.0) as cl:  # 200-700 W GPUs: the budget is not what binds
        sim = cl.sims["n1"]
        with AdminClient(cl.coordinator.admin_address) as c:
            _started(cl, c, sim)
            sim.inject(0, "oob_limit", 250.0)

            def paced():
                st = c.status()
                job = next((j for j in st.jobs if j.job_id == "J"), None)  # (the coordinator may not list it yet)
                return (st if job is not None and job.binding == "oob_limit" and all(sim.read(i)["limit_w"] < 300 for i in (1, 2, 3))
                        else None)
            st = wait_for(paced, 20, "J bound by GPU 0's out-of-band limit, its job-mates paced to it")
            assert st.enforced_w < 1200.0  # the budget is not what binds
            e = c.explain("J")
            assert e.job.binding == "oob_limit" and "device_min" not in e.text and "device_max" not in e.text
            assert "Binding constraint: oob_limit (GPU n1/0 enforced at 250 W by another limiter" in e.text


def test_a_held_gpus_detail_follows_its_current_state(tmp_path):
    """Bad limit constraints (0, 0) at the agent's start, cleared, then (1, 2): the GPU stays held
    (the coordinator plans with the constraints of the hello) and its detail tells what the agent
    reports now, never the (0, 0) "read from the device" of a state it left."""
    from capctl import capstates
    from coordinator.client import AdminClient

    def garbage(sims):
        sims["n1"].inject(1, "bad_constraints", 0.0, max_w=0.0)

    with _cluster(tmp_path, budget_w=2000.0, before_agents=garbage) as cl:
        sim = cl.sims["n1"]
        for i in range(4):
            sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 reporting")
            reply = cl.agent("n1").client().job_start("J", ["0", "1", "2", "3"])
            assert "min 0 W, max 0 W" in {g.index: g for g in reply.gpus}[1].error
            wait_for(lambda: "min 0 W, max 0 W" in _gpus(c.status())[1].detail, 20, "GPU 1 held for (0, 0)")
            sim.clear(1, "bad_constraints")
            time.sleep(1.5)
            sim.inject(1, "bad_constraints", 1.0, max_w=2.0)

            def current():
                g = _gpus(c.status())[1]
                return g if "read from the device: min 0 W, max 0 W" not in g.detail and "1 W" in g.detail else None
            g = wait_for(current, 10, "GPU 1's detail about what the agent reports now")
            assert capstates.of(g) == capstates.UNSUPPORTED_CONSTRAINTS
            assert "now min 1 W, max 2 W" in g.detail or "reported by the agent at its start" in g.detail
            state = capstates.of(cl.agent("n1").status().gpus[1])
            assert state == capstates.UNSUPPORTED_CONSTRAINTS or f"the agent reports {state}" in g.detail
            # held since the hello: never written, not after the fault cleared nor with (1, 2) read
            assert sim.read(1)["set_count"] == 0
