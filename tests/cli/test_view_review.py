"""What ``capctl status``, ``nodes``, ``jobs`` and ``explain`` say of a stale node, an out-of-band
limit, a GPU waiting for its increase and a domain without a limit (found by a review of the
admin outputs, 5 Dec 2026): built from ``StatusReply`` messages as the coordinator sends them."""

from __future__ import annotations

import math
import types

import numpy as np

from capctl import capstates, statusview
from capctl.v1 import capctl_pb2 as pb
from coordinator import observed


def _reply() -> pb.StatusReply:
    st = pb.StatusReply(budget_w=6000.0, interval_s=1.0, allocated_w=5000.0, enforced_w=5000.0, draw_w=2000.0)
    live = st.nodes.add(name="n1", stale=False, last_report_age_s=0.2)
    for i in range(2):
        live.gpus.add(index=i, node="n1", cap_w=500.0, enforced_w=500.0, power_w=480.0, temp_c=60.0, job_id="42",
                      min_cap_w=200.0, max_cap_w=700.0, max_sm_clock_mhz=1980, sm_clock_mhz=1800,
                      **capstates.wire_fields(capstates.OK))
    gone = st.nodes.add(name="n3", stale=True, last_report_age_s=8.2)
    for i in range(2):  # a stale node: its readings are not facts of now (NaN), its caps still count
        gone.gpus.add(index=i, node="n3", cap_w=540.0, enforced_w=540.0, power_w=math.nan, temp_c=math.nan,
                      no_live_reading=True, min_cap_w=200.0, max_cap_w=700.0, **capstates.wire_fields(capstates.OK))
    st.domains.add(name="node:n1", kind="node", limit_w=0.0, allocated_w=1000.0, enforced_w=1000.0, draw_w=960.0)
    st.domains.add(name="pdu-a", kind="pdu", limit_w=3400.0, allocated_w=1000.0, enforced_w=1000.0, draw_w=960.0)
    st.jobs.add(job_id="42", nodes=["n1"], gpus=2, weight=1.0, predicted_step_rate=0.907, measured_step_rate=0.705)
    return st


def test_a_stale_nodes_power_is_unknown_and_its_gpus_say_so():
    d = statusview.status_dict(_reply())
    summary = statusview.render_nodes_summary(d).splitlines()
    n3 = next(line for line in summary if line.startswith("n3")).split()
    assert n3[1] == "STALE" and n3[6] == "-", n3  # POWER W: unknown, not 0 W
    assert "THERM GPUS" in summary[0] and "PWRCAP GPUS" in summary[0]
    rows = [line.split() for line in statusview.render_gpus(d).splitlines()[1:]]
    assert {r[-1] for r in rows if r[0] == "n3"} == {"OK+NODE_STALE"} and {r[-1] for r in rows if r[0] == "n1"} == {"OK"}
    text = statusview.render_status(d)
    assert "draw 2000 W (33%) (live readings only: 1 stale node not in it)" in text


def test_a_domain_without_a_limit_is_null_and_jobs_show_both_rates():
    d = statusview.status_dict(_reply())
    assert [x["limit_w"] for x in d["domains"]] == [None, 3400.0]
    jobs = statusview.render_jobs(d).splitlines()
    assert jobs[0].split()[:7] == ["JOB", "NODES", "GPUS", "WEIGHT", "PRED", "RATE", "MEAS"]
    assert jobs[1].split()[4:6] == ["0.907", "0.705"]


def test_another_limit_is_claimed_only_for_an_out_of_band_limit():
    g = pb.GpuStatus(index=0, cap_w=380.0, enforced_w=378.0, **capstates.wire_fields(capstates.OK))
    assert observed.limit_text(g) == "cap 380 W"  # within the planner's 2 W deadband
    g = pb.GpuStatus(index=1, cap_w=480.0, enforced_w=302.0, **capstates.wire_fields(capstates.OK))
    assert observed.limit_text(g) == "enforced 302 W (below its cap 480 W: its increase not applied yet)"
    g.flags.append(capstates.OOB_LIMITED)
    assert observed.limit_text(g) == "enforced 302 W (below its cap 480 W: another limit binds)"
    g = pb.GpuStatus(index=2, cap_w=592.0, enforced_w=500.0, **capstates.wire_fields(capstates.OOB_LIMITED))
    assert observed.limit_text(g) == "enforced 500 W (below its cap 592 W: another limit binds)"


def test_an_out_of_band_limit_the_allocation_keeps_is_a_flag():
    """Once its request came down to the out-of-band limit the GPU reads ``OK`` (the device cannot
    show the limit any more): the view flags it ``OOB_LIMITED`` from the allocation's memory, with
    the limit in its detail; a GPU whose state already says so is not flagged twice."""
    from coordinator import loop

    cols = types.SimpleNamespace(keys=(("n2", 0), ("n2", 1)), oob_w=np.array([300.0, math.nan]))
    oob = loop._oob_limits(cols)
    assert oob == {("n2", 0): 300.0}
    tally = loop._Tally(oob=oob, straggler={("n2", 1): "held in HW slowdown"})
    assert loop._gpu_flags(tally, ("n2", 0), capstates.OK) == (
        [capstates.OOB_LIMITED], "another limiter held it at 300 W (out-of-band limit): planned within it")
    assert loop._gpu_flags(tally, ("n2", 0), capstates.OOB_LIMITED)[0] == []
    assert loop._gpu_flags(tally, ("n2", 0), capstates.OK, 299.0)[0] == [capstates.OOB_LIMITED]  # at it: binds
    assert loop._gpu_flags(tally, ("n2", 0), capstates.OK, 262.0) == ([], "")  # planned below it: not the limit
    assert loop._gpu_flags(tally, ("n2", 1), capstates.OK) == (["STRAGGLER"], "held in HW slowdown")
    assert loop._oob_limits(types.SimpleNamespace(keys=(), oob_w=None)) == {}


def test_prometheus_flags_an_out_of_band_limit_and_exports_every_cap_state():
    from capctl import capmetrics
    from coordinator import metrics

    st = _reply()
    st.nodes[0].gpus[0].flags.append(capstates.OOB_LIMITED)
    families = {f.name: f for f in metrics._observed_families(st)}
    assert [(s.labels["node"], s.labels["gpu"], s.value) for s in families["capctl_gpu_oob_limited"].samples] == [
        ("n1", "0", 1.0)]
    fam = capmetrics.cap_state_family([("n1", 0, "u", capstates.OK)])
    states = {s.labels["state"]: s.value for s in fam.samples}
    assert capstates.UNSUPPORTED_CONSTRAINTS in states and sum(states.values()) == 1.0 and len(states) == 12


def test_the_finished_jobs_table_names_its_units():
    """``CAPPED_S`` / ``THERMAL_S`` are GPU-seconds (read as wall time they said a job was capped
    four times longer than it ran on 4 GPUs), mean and peak power are the job's over its GPUs, and
    the energy is in kWh as in ``capctl jobs`` (found by a review)."""
    from capctl.cli.finished import render_finished

    row = {"job_id": "7", "complete": True, "user": "ann", "start_time_s": 1000.0, "end_time_s": 1404.1, "gpus": 4,
           "energy_j": 720572.8, "gpu_s": 1616.4, "mean_power_w": 1783.0, "peak_power_w": 2582.0, "capped_s": 1616.4,
           "thermal_s": 0.0}
    head, line = render_finished([row]).splitlines()
    for name in ("WALL S", "ENERGY kWh", "JOB MEAN W", "JOB PEAK W", "CAPPED GPU S", "THERMAL GPU S"):
        assert name in head, head
    assert "0.200" in line.split() and "404.1" in line.split()


def test_a_domain_of_stale_nodes_only_has_no_draw_not_zero_watts():
    """A PDU whose nodes are all stale showed ``DRAW W 0`` (found by a try-out): its draw is unknown.
    The coordinator's domain rows (``loop._domain_draw_w``) give NaN, status shows "-", JSON null and
    Prometheus no sample; a domain with a live GPU sums its live readings."""
    from coordinator import loop, metrics

    tally = loop._Tally(draw={("n1", 0): 480.0, ("n3", 0): 0.0, ("n3", 1): 0.0},
                        no_reading={("n3", 0): "node stale", ("n3", 1): "node stale"})
    assert math.isnan(loop._domain_draw_w(tally, {("n3", 0), ("n3", 1)}))
    assert loop._domain_draw_w(tally, {("n1", 0), ("n3", 0), ("n3", 1)}) == 480.0
    assert loop._domain_draw_w(tally, set()) == 0.0
    st = _reply()
    st.domains.add(name="pdu-b", kind="pdu", limit_w=3400.0, allocated_w=1080.0, enforced_w=1080.0, draw_w=math.nan)
    d = statusview.status_dict(st)
    assert [x["draw_w"] for x in d["domains"]] == [960.0, 960.0, None]
    row = next(line for line in statusview.render_status(d).splitlines() if line.startswith("pdu-b")).split()
    assert row[5] == "-", row  # DRAW W
    samples = {s.labels["domain"]: s.value for m in metrics._domain_families(st) if m.name == "capctl_domain_draw_watts"
               for s in m.samples}
    assert samples == {"node:n1": 960.0, "pdu-a": 960.0}


def test_the_cluster_draw_is_unknown_when_no_gpu_has_a_live_reading():
    """With every node stale the domains showed no draw but the cluster's read 0 W (found by a
    review): both follow one rule, and Prometheus gets no sample for an unknown draw."""
    from coordinator import loop, metrics

    tally = loop._Tally(draw={("n3", 0): 0.0}, no_reading={("n3", 0): "node stale"})
    assert math.isnan(loop._domain_draw_w(tally, tally.draw.keys()))
    st = _reply()
    st.draw_w = math.nan
    d = statusview.status_dict(st)
    assert d["draw_w"] is None and "draw - W" in statusview.render_status(d)
    fams = {m.name: m for m in metrics._cluster_families(types.SimpleNamespace(status=st, tick_s=0.1))}
    assert fams["capctl_draw_watts"].samples == [] and fams["capctl_budget_watts"].samples[0].value == 6000.0


def test_nodes_text_shows_each_gpus_rate_curve():
    """``capctl nodes`` (and the GPU table of ``explain``) show the curve in use, as --json did only
    (a try-out): generic until learned; "-" when the coordinator has none yet."""
    st = _reply()
    st.nodes[0].gpus[0].curve = "generic"
    st.nodes[0].gpus[1].curve = "learned"
    lines = statusview.render_gpus(statusview.status_dict(st)).splitlines()
    assert lines[0].split()[-2:] == ["CURVE", "STATE"]
    assert [line.split()[-2] for line in lines[1:]] == ["generic", "learned", "-", "-"]
