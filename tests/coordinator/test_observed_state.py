"""Observed state first, on real agents (``capctl-agent`` on the simulated driver, real pynvml):
bad limit constraints hold one GPU and leave the node working; an out-of-band limit is planned
around (job-mates pace to it, status and explain show the enforced limit); the measured step rate
sits beside the predicted one."""

from __future__ import annotations

import time

import pytest

from tests.conftest import require
from tests.coordinator.conftest import gpus_by_index, one_node_cluster, wait_for

pytestmark = pytest.mark.integration


_cluster = one_node_cluster
_gpus = gpus_by_index


def _job_at(cl, c, lo_w: float, hi_w: float) -> None:
    """Job J on n1's four GPUs at 650 W demand; wait until every cap is in (lo_w, hi_w) W."""
    sim = cl.sims["n1"]
    for i in range(4):
        sim.set_load(i, 650.0)
    wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 reporting")
    assert cl.agent("n1").client().job_start("J", ["0", "1", "2", "3"]).ok
    wait_for(lambda: all(lo_w < sim.read(i)["limit_w"] < hi_w for i in range(4)), 20, f"caps in {lo_w}-{hi_w} W")


def test_bad_limit_constraints_hold_one_gpu_and_the_rest_of_the_node_works(tmp_path):
    from capctl import capstates
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient

    def garbage(sims):  # found by the agent when it opens the GPUs
        sims["n1"].inject(1, "bad_constraints", 0.0, max_w=0.0)
        sims["n1"].inject(2, "bad_constraints", 700.0, max_w=200.0)

    with _cluster(tmp_path, budget_w=2240.0, before_agents=garbage) as cl:
        sim = cl.sims["n1"]
        for i in range(4):
            sim.set_load(i, 650.0)
        held = [sim.read(i)["limit_w"] for i in (1, 2)]
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 reporting")
            reply = cl.agent("n1").client().job_start("J", ["0", "1", "2", "3"])
            assert reply.ok, reply.message  # the healthy GPUs got their start cap
            res = {g.index: g for g in reply.gpus}
            for i in (1, 2):
                assert not res[i].ok and "limit constraints read from the device" in res[i].error
                assert "capctl bug" not in res[i].error
                assert res[i].cap_w == pytest.approx(held[i - 1])  # its limit, never 0 W

            def settled():
                g = _gpus(c.status())
                return (all(capstates.of(g[i]) == capstates.UNSUPPORTED_CONSTRAINTS for i in (1, 2))
                        and all(sim.read(i)["limit_w"] < 600 for i in (0, 3)))
            wait_for(settled, 20, "bad GPUs flagged, healthy ones capped")
            since_ns = time.monotonic_ns()
            time.sleep(1.5)  # three intervals at the settled caps
            st = c.status()
            g = _gpus(st)
            assert "min 0 W, max 0 W" in g[1].detail and "min > max" in g[2].detail
            # held and counted at their current limit: the healthy GPUs share what is left
            assert g[1].enforced_w == pytest.approx(held[0]) and g[2].enforced_w == pytest.approx(held[1])
            assert st.enforced_w <= 2240.0 + 1e-6
            assert sim.read(0)["limit_w"] + sim.read(3)["limit_w"] <= 2240.0 - sum(held) + 1e-3
            assert [sim.read(i)["limit_w"] for i in (1, 2)] == held  # never written
            assert all(sim.read(i)["set_count"] == 0 for i in (1, 2))
            # never above the budget at any instant once settled (the journal of enforced limits)
            check = check_nodes({n: s.path for n, s in cl.sims.items()}, 2240.0 + 1e-6, None, since_ns, None)
            assert check.ok, check.describe()


def test_out_of_band_limit_is_planned_around_and_shown(tmp_path):
    from capctl import capstates
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient

    with _cluster(tmp_path, budget_w=0.85 * 700.0 * 4) as cl:
        sim = cl.sims["n1"]
        with AdminClient(cl.coordinator.admin_address) as c:
            _job_at(cl, c, 570, 620)
            mate_clock = sim.read(1)["sm_clock_mhz"]
            sim.inject(0, "oob_limit", 500.0)

            def paced():
                g = _gpus(c.status())
                return (g[0].cap_w <= 501.0 and capstates.of(g[0]) in (capstates.OK, capstates.OOB_LIMITED)
                        and all(sim.read(i)["limit_w"] < 560 for i in (1, 2, 3)))
            wait_for(paced, 20, "GPU 0 planned at its enforced limit, its job-mates paced to it")
            st = c.status()
            devices = sum(sim.read(i)["enforced_w"] for i in range(4))
            assert st.enforced_w == pytest.approx(devices, abs=4.0)  # booked as the devices enforce
            assert all(sim.read(i)["sm_clock_mhz"] < mate_clock for i in (1, 2, 3))
            job = next(j for j in st.jobs if j.job_id == "J")
            assert 0.0 < job.measured_step_rate <= 1.0 and 0.0 < job.predicted_step_rate <= 1.0

            def measured_is_the_devices_pace():  # status is one report behind the devices: settle first
                st = c.status()
                rate = next(j for j in st.jobs if j.job_id == "J").measured_step_rate
                slowest = min(sim.read(i)["sm_clock_mhz"] for i in range(4)) / sim.read(0)["max_sm_clock_mhz"]
                # the driver's default load is 0.3 memory-bound: the clock fraction through the share
                # the coordinator estimated from NVML's memory utilization (coordinator.membound)
                m = min(g.memory_bound_fraction for g in _gpus(st).values())
                assert all(abs(g.memory_bound_fraction - 0.3) <= 0.02 for g in _gpus(st).values())
                return abs(rate - 1.0 / (m + (1.0 - m) / slowest)) <= 0.02 or None
            wait_for(measured_is_the_devices_pace, 10, "the measured step rate is the slowest GPU's step rate")
            text = c.explain("J").text
            assert "Measured step rate" in text and "cap 59" not in text
            # the request stays down while the out-of-band limit may still be there, and the
            # limit lifting never takes the budget over (it was: a request above the enforced
            # limit, booked at the enforced one, enforced at once when the limit lifted)
            time.sleep(2.0)
            assert sim.read(0)["limit_w"] <= 501.0, sim.read(0)
            since_ns = time.monotonic_ns()
            sim.clear(0, "oob_limit")
            time.sleep(2.0)
            budget = 0.85 * 700.0 * 4
            check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget + 1e-6, None, since_ns, None)
            assert check.ok, check.describe()
            assert sim.read(0)["enforced_w"] <= 501.0  # planned within the limit it had until OOB_HOLD_S


def test_straggler_is_held_flagged_and_its_job_mates_paced_to_it(tmp_path):
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from coordinator.client import AdminClient
    from coordinator.metrics import _observed_families

    budget = 0.7 * 700.0 * 6
    with Cluster(tmp_path, {"n1": 4, "n2": 2}, budget_w=budget, interval_s=0.5, lease_s=3.0) as cl:
        for name, sim in cl.sims.items():
            for i in range(sim.gpu_count):
                sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 2 and all(not n.stale for n in c.status().nodes), 20, "agents")
            assert cl.agent("n1").client().job_start("J", ["0", "1", "2", "3"]).ok
            assert cl.agent("n2").client().job_start("K", ["0", "1"]).ok
            n1, n2 = cl.sims["n1"], cl.sims["n2"]
            wait_for(lambda: all(n.read(i)["limit_w"] < 600 for n in (n1, n2) for i in range(n.gpu_count)), 20,
                     "every GPU capped")
            time.sleep(2.0)
            k_before = [n2.read(i)["limit_w"] for i in range(2)]
            n1.inject(0, "stuck_slowdown", 0.7)  # 1,386 MHz of 1,980 at any cap

            def flagged():
                g = {(n.name, x.index): x for n in c.status().nodes for x in n.gpus}
                return "STRAGGLER" in g[("n1", 0)].flags and all(n1.read(i)["limit_w"] < 400 for i in (1, 2, 3))
            wait_for(flagged, 20, "straggler flagged and its job-mates brought down")
            stuck = n1.read(0)["sm_clock_mhz"]
            # K's caps may already be near 600 W: +100 W, or up to 680 W of its 700 W maximum
            wait_for(lambda: all(n2.read(i)["limit_w"] > min(k_before[i] + 100, 680.0) for i in range(2)), 20,
                     "the freed watts went to job K")
            # held near its draw (1 s-averaged: it takes a few reports to come down), not at its 490 W
            def held():
                s = c.status()
                cap_w = next(x.cap_w for n in s.nodes for x in n.gpus if (n.name, x.index) == ("n1", 0))
                return s if cap_w < 0.5 * 700 else None
            st = wait_for(held, 10, "the straggler held near its draw")
            g = {(n.name, x.index): x for n in st.nodes for x in n.gpus}
            assert "HW slowdown" in g[("n1", 0)].detail
            # job-mates at its pace: within the loop's deadband (two 15 MHz clock steps) and a step
            # (waited for: the freed watts reach job K in the interval they are freed, so the checks
            # above can pass while the job-mates' last step is still on its way; 10 intervals)
            def paced_to_it():
                return all(n1.read(i)["sm_clock_mhz"] <= stuck + 45 for i in (1, 2, 3)) or None
            wait_for(paced_to_it, 5.0, f"job-mates within 45 MHz of the straggler's {stuck} MHz")
            text = c.explain("J").text
            assert "STRAGGLER" in text and "HW slowdown" in text
            # a "!" line of its own in capctl status, naming it and why (it had none: a try-out)
            line = [a for a in st.alerts if a.startswith("STRAGGLER: ")]
            assert line and line[0].startswith("STRAGGLER: n1/0 (HW slowdown: SM clock held at "), st.alerts
            assert line[0].endswith("— they run slow at any cap: held near their draw, their job-mates paced to them")
            fams = {f.name: f for f in _observed_families(st)}
            assert [s.labels["gpu"] for s in fams["capctl_gpu_straggler"].samples] == ["0"]
            assert st.enforced_w <= budget + 1e-6


def test_a_gpu_held_for_bad_limit_constraints_paces_its_job_mate_down_to_it(tmp_path):
    """A GPU held at its limit for limit constraints no cap can be planned in (UNSUPPORTED_CONSTRAINTS,
    readings live) bounds its job-mate's pace as a straggler does: the mate comes down to its
    measured pace, the held GPU is never written, the watts go to the other job, the budget holds
    at every instant. Its job-mate stayed at 262 W, 1,320 MHz beside it at 200 W, 1,155 MHz for
    minutes while a watt had a positive price (found by a try-out: the pace loop skipped any job
    with a GPU the coordinator holds)."""
    from capctl import capstates
    from capctl.simgpu.journal import CAUSE_CHANGED, check_nodes, read_journal
    from coordinator.client import AdminClient

    budget_w = 0.6 * 700.0 * 4  # ~420 W a GPU of 650 W demand: a watt has a positive price
    with _cluster(tmp_path, budget_w=budget_w) as cl:
        sim = cl.sims["n1"]
        for i in range(4):
            sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 reporting")
            assert cl.agent("n1").client().job_start("K", ["0", "1"]).ok
            assert cl.agent("n1").client().job_start("600", ["2", "3"]).ok
            wait_for(lambda: all(sim.read(i)["limit_w"] < 480 for i in range(4)), 20, "every GPU capped")
            time.sleep(2.0)
            sim.inject(3, "bad_constraints", 100.0, max_w=100000.0)
            wait_for(lambda: capstates.of(_gpus(c.status())[3]) == capstates.UNSUPPORTED_CONSTRAINTS, 20,
                     "n1/3 held for its limit constraints")
            held_w, since_ns = sim.read(3)["limit_w"], time.monotonic_ns()
            mate_w, k_w = sim.read(2)["limit_w"], sim.read(0)["limit_w"] + sim.read(1)["limit_w"]
            mate_mhz = sim.read(2)["sm_clock_mhz"]
            sim.set_param(3, "power_factor", 2.0)  # its work draws more a clock step: slower at the same limit
            held_mhz = sim.read(3)["sm_clock_mhz"]
            assert held_mhz < mate_mhz - 200, (held_mhz, mate_mhz)  # the mate far faster, at its cap then

            def paced_to_it():  # within the loop's deadband (two 15 MHz steps) and a step
                return abs(sim.read(2)["sm_clock_mhz"] - sim.read(3)["sm_clock_mhz"]) <= 45 or None
            wait_for(paced_to_it, 20, f"the job-mate n1/2 within 45 MHz of the held GPU's {held_mhz} MHz")
            time.sleep(2.0)  # settled: it stays there
            mate, held = sim.read(2), sim.read(3)
            assert abs(mate["sm_clock_mhz"] - held["sm_clock_mhz"]) <= 45, (mate, held)  # ~2 % of 1,980 MHz
            assert mate["limit_w"] < mate_w - 40.0, (mate_w, mate)
            # the watts it freed went to job K (K's pace-setter was below its ceiling)
            assert sim.read(0)["limit_w"] + sim.read(1)["limit_w"] > k_w + 30.0
            # the held GPU: never written after the fault (the driver's journal), at its limit
            assert held["limit_w"] == pytest.approx(held_w)
            recs = read_journal(sim.path).records
            writes = recs[(recs["gpu"] == 3) & (recs["cause"] == CAUSE_CHANGED) & (recs["t_ns"] >= since_ns)]
            assert len(writes) == 0, writes
            check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget_w + 1e-6, None, since_ns, None)
            assert check.ok, check.describe()


def test_memory_utilization_reaches_the_coordinator_as_each_gpus_memory_bound_share(tmp_path):
    """Issue 12, item 8: the agent reads nvmlDeviceGetUtilizationRates through the real pynvml on
    the simulated driver; the coordinator estimates each busy GPU's memory-bound share from it
    (coordinator.membound) and status / explain show it; an idle GPU has none."""
    from capctl.statusview import explain_dict
    from coordinator.client import AdminClient

    shares = {0: 0.5, 1: 0.0, 2: 0.3}
    with _cluster(tmp_path, budget_w=0.55 * 700.0 * 4) as cl:
        sim = cl.sims["n1"]
        for i, m in shares.items():
            sim.set_load(i, 650.0, memory_bound_fraction=m)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 reporting")
            assert cl.agent("n1").client().job_start("J", ["0", "1", "2"]).ok

            def estimated():
                g = _gpus(c.status())
                return (all(g[i].HasField("memory_bound_fraction")
                            and abs(g[i].memory_bound_fraction - m) <= 0.03 for i, m in shares.items())
                        and sim.read(0)["sm_clock_mhz"] < 0.9 * sim.read(0)["max_sm_clock_mhz"]) or None
            # bound first: a GPU's models (its estimate too) start again with a new job
            wait_for(lambda: any(j.job_id == "J" for j in c.status().jobs), 20, "J bound")
            wait_for(estimated, 20, "each busy GPU's memory-bound share estimated at a capped clock")
            assert not _gpus(c.status())[3].HasField("memory_bound_fraction")  # idle: no estimate
            d = explain_dict(c.explain("J"))
            got = {g["index"]: g["memory_bound_fraction"] for g in d["gpus"]}
            assert all(abs(got[i] - m) <= 0.03 for i, m in shares.items())
            assert "Memory-bound share of a step" in d["text"] and "over 3 GPU(s)" in d["text"]
            assert "through its memory-bound share" in d["text"]


def test_limit_constraints_that_change_mid_job_hold_the_gpu_and_never_raise_it(tmp_path):
    """A device that starts reporting other limit constraints (a minimum of 650 W on a GPU the
    coordinator gives ~560 W, as planned from the 200-700 W of the hello): the agent writes nothing
    to it (clamping into them would raise it ~90 W over its share of the budget), flags it and the
    budget holds at every instant (the journal of enforced limits)."""
    from capctl import capstates
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient

    budget_w = 2240.0
    with _cluster(tmp_path, budget_w=budget_w) as cl:
        sim = cl.sims["n1"]
        with AdminClient(cl.coordinator.admin_address) as c:
            _job_at(cl, c, 520, 600)
            held_w = sim.read(3)["limit_w"]
            since_ns = time.monotonic_ns()
            sim.inject(3, "bad_constraints", 650.0, max_w=700.0)
            for i in range(4):  # the loads move: the coordinator sends GPU 3 new caps
                sim.set_load(i, 600.0 if i != 3 else 690.0)

            def flagged():
                g = _gpus(c.status())[3]
                return capstates.of(g) == capstates.UNSUPPORTED_CONSTRAINTS and "changed" in g.detail
            wait_for(flagged, 20, "GPU 3 flagged for its changed constraints")
            time.sleep(1.5)
            assert sim.read(3)["limit_w"] == pytest.approx(held_w)  # never clamped up to 650 W
            g = _gpus(c.status())[3]
            assert "min 650 W" in g.detail and "capctl bug" not in g.detail
            assert all(sim.read(i)["limit_w"] >= 200.0 for i in range(4))
            check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget_w + 1e-6, None, since_ns, None)
            assert check.ok, check.describe()


def test_an_agent_restarted_with_held_restores_raises_no_gpu_above_its_allowance(tmp_path):
    """Job J ends under a budget too small for the four 700 W pre-job limits: the restores are held at
    the coordinator's allowance. The agent is restarted (it keeps no allowance across a restart): it
    must not finish the held restores at 700 W before the coordinator speaks again (it did: the
    journal showed the sum over the budget). Checked exactly on the driver's journal."""
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient

    budget_w = 2000.0
    with _cluster(tmp_path, budget_w=budget_w) as cl:
        sim = cl.sims["n1"]
        with AdminClient(cl.coordinator.admin_address) as c:
            _job_at(cl, c, 400, 600)
            assert cl.agent("n1").client().job_end("J").ok
            for i in range(4):
                sim.set_load(i, 100.0)
            time.sleep(2.0)  # the held restores at the idle allowance
            held = [sim.read(i)["limit_w"] for i in range(4)]
            assert sum(held) <= budget_w + 1e-3 and max(held) < 699.0
            since_ns = time.monotonic_ns()
            cl.agent("n1").stop()
            cl.start_agent("n1").wait_ready(30.0, connected=True)
            time.sleep(2.0)  # the restarted agent's retries and the coordinator's next plans
            check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget_w + 1e-6, None, since_ns, None)
            assert check.ok, check.describe()
            assert all(sim.read(i)["limit_w"] <= held[i] + 1e-3 for i in range(4))  # the budget has no room left


def test_an_agent_restarted_on_constraints_that_contradict_the_limit_raises_nothing(tmp_path):
    """The device starts reporting a minimum above the limit it enforces (650-700 W on a job GPU
    given ~560 W) and its agent is restarted. It read
    them as usable and clamped its start cap into them: 650 W and 680 W written on its own, the
    budget over for as long as the fault lasted (found by a try-out, the journal). Now a limit
    outside the constraints read with them holds the GPU (UNSUPPORTED_CONSTRAINTS, bad device
    data): nothing written, the budget holds at every instant (the driver's journal)."""
    from capctl import capstates
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient

    budget_w = 2240.0
    with _cluster(tmp_path, budget_w=budget_w) as cl:
        sim = cl.sims["n1"]
        with AdminClient(cl.coordinator.admin_address) as c:
            _job_at(cl, c, 520, 600)
            held = [sim.read(i)["limit_w"] for i in range(4)]
            since_ns = time.monotonic_ns()
            cl.agent("n1").stop()
            sim.inject(3, "bad_constraints", 650.0, max_w=700.0)
            cl.start_agent("n1").wait_ready(30.0, connected=True)

            def flagged():
                g = _gpus(c.status())
                return (not c.status().nodes[0].stale and capstates.of(g[3]) == capstates.UNSUPPORTED_CONSTRAINTS
                        and "outside its limit constraints" in g[3].detail)
            wait_for(flagged, 20, "GPU 3 flagged: its limit is outside the constraints it reports")
            time.sleep(1.5)  # the coordinator's plans to the restarted agent
            assert sim.read(3)["limit_w"] == pytest.approx(held[3])  # never clamped up to 650 W
            assert "capctl bug" not in _gpus(c.status())[3].detail
            check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget_w + 1e-6, None, since_ns, None)
            assert check.ok, check.describe()


def test_a_gpu_held_by_its_cap_and_a_hw_slowdown_is_raised_to_where_the_slowdown_holds_it(tmp_path):
    """A GPU whose hardware slowdown holds its clock at 0.9 of its maximum (1,782 MHz) while its cap
    holds it lower (reasons SW_POWER_CAP and HW_SLOWDOWN): more watts raise its clock, so it is no
    straggler (found by a try-out: it was flagged and held at its 312 W cap and 1,455 MHz, its job
    at that pace, while the budget was raised and watts went unallocated). Once raised to where the
    slowdown holds it (the cap no longer binds) it is one, held near its draw, its job-mates at
    its pace."""
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from coordinator.client import AdminClient

    with Cluster(tmp_path, {"n1": 4}, budget_w=4 * 312.0, interval_s=0.5, lease_s=3.0) as cl:
        sim = cl.sims["n1"]
        for i in range(4):
            sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 reporting")
            assert cl.agent("n1").client().job_start("J", ["0", "1", "2", "3"]).ok
            wait_for(lambda: all(sim.read(i)["limit_w"] < 330 for i in range(4)), 20, "every GPU capped")
            sim.inject(0, "stuck_slowdown", 0.9)
            max_mhz = sim.read(0)["max_sm_clock_mhz"]
            time.sleep(3.0)
            g0 = _gpus(c.status())[0]
            assert "SW_POWER_CAP" in g0.clocks_event_reasons and "HW_SLOWDOWN" in g0.clocks_event_reasons, g0
            assert "STRAGGLER" not in g0.flags, g0  # the cap holds it: power helps
            assert c.set_budget(4 * 700.0).ok

            def at_the_slowdown():  # every GPU at the stuck clock, GPU 0 raised well above its 312 W
                clocks = [sim.read(i)["sm_clock_mhz"] for i in range(4)]
                return (min(clocks) >= 0.9 * max_mhz - 45 and sim.read(0)["limit_w"] > 450.0) or None
            wait_for(at_the_slowdown, 20, f"the job at GPU 0's slowdown clock ({0.9 * max_mhz:.0f} MHz)")

            def held():
                g = _gpus(c.status())[0]
                return g if "STRAGGLER" in g.flags and "HW slowdown" in g.detail else None
            wait_for(held, 20, "GPU 0 a straggler once the cap no longer binds")
            clocks = [sim.read(i)["sm_clock_mhz"] for i in range(4)]
            assert max(clocks) <= sim.read(0)["sm_clock_mhz"] + 45, clocks  # job-mates at its pace


@pytest.mark.parametrize("oob_w", [5.0, 150.0])
def test_an_out_of_band_limit_below_the_minimum_cap_makes_a_straggler_its_job_mates_pace_to(tmp_path, oob_w):
    """An out-of-band limit below the GPU's minimum cap (200 W): no cap the coordinator may plan
    moves its pace. It was planned at its minimum as if that set its pace, and its job-mate stayed
    at 700 W and 1,980 MHz while it ran at 345 MHz, ``explain`` saying the mates were paced to it
    (found by a try-out). Now it is a STRAGGLER with the reason and its job-mate comes down to its
    pace."""
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from coordinator.client import AdminClient

    with Cluster(tmp_path, {"n1": 4}, budget_w=0.85 * 700.0 * 4, interval_s=0.5, lease_s=3.0) as cl:
        sim = cl.sims["n1"]
        for i in range(4):
            sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 reporting")
            assert cl.agent("n1").client().job_start("J", ["1", "2"]).ok
            time.sleep(2.0)
            sim.inject(1, "oob_limit", oob_w)

            def paced():  # the mate at the straggler's pace, or as near as its minimum cap allows
                g = _gpus(c.status())
                slow = sim.read(1)["sm_clock_mhz"]
                mate = sim.read(2)
                return (g if "STRAGGLER" in g[1].flags and "out-of-band" in g[1].detail
                        and (mate["sm_clock_mhz"] <= slow + 45 or mate["limit_w"] <= 200.0 + 0.5) else None)
            wait_for(paced, 20, "GPU 1 a straggler, its job-mate at its pace (or its minimum cap)")
            text = c.explain("J").text
            assert "STRAGGLER" in text and "out-of-band limit" in text
