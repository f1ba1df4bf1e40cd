"""The rules behind status and explain under device faults (tests/coordinator/test_fault_truth.py
checks them on real agents): no live reading -> no readings shown, no measured pace; an out-of-band
or held slowest GPU names the binding; a held GPU's detail follows its current state."""

from __future__ import annotations

import math
import types

import numpy as np

from capctl import capstates
from capctl.statusview import gpu_dict, render_gpus
from capctl.v1 import capctl_pb2 as pb
from coordinator import allocation, observed
from coordinator.registry import held_detail


def _gpu(index, *, live=True, temp_c=60.0, state=capstates.OK):
    return pb.GpuStatus(index=index, cap_w=300.0, enforced_w=300.0, power_w=290.0 if live else math.nan,
                        temp_c=temp_c if live else math.nan, slowdown_temp_c=87.0, sm_clock_mhz=1500 if live else 0,
                        clocks_event_reasons=["SW_POWER_CAP"] if live else [], no_live_reading=not live,
                        **capstates.wire_fields(state))


def test_a_gpu_without_a_live_reading_has_null_readings_and_is_not_ranked():
    lost = gpu_dict(_gpu(3, live=False, state=capstates.LOST))
    assert (lost["power_w"], lost["temp_c"], lost["sm_clock_mhz"], lost["clocks_event_reasons"]) == (None, None, None, [])
    assert lost["enforced_w"] == 300.0 and lost["cap_w"] == 300.0  # its last known caps
    # a peer from before the field (no_live_reading unset) keeps its readings
    assert gpu_dict(_gpu(0))["sm_clock_mhz"] == 1500 and gpu_dict(_gpu(0))["temp_c"] == 60.0
    d = {"nodes": [{"name": "n1", "gpus": [gpu_dict(_gpu(0, temp_c=80.0)), lost, gpu_dict(_gpu(1, temp_c=50.0))]}]}
    hottest = render_gpus(d, limit=5).splitlines()
    assert [r.split()[1] for r in hottest[1:]] == ["0", "1"]  # by margin; the lost GPU not ranked
    row = next(r for r in render_gpus(d).splitlines() if r.rstrip().endswith("LOST")).split()
    assert row[5:9] == ["-", "-", "-", "-"]


def test_no_measured_pace_while_one_of_the_jobs_gpus_has_no_live_reading():
    frac = {("n1", 0): 0.9, ("n1", 1): 0.7}
    keys = [("n1", 0), ("n1", 1), ("n1", 2)]
    assert observed.measured_step_rate(frac, keys) == 0.7
    assert observed.measured_step_rate(frac, keys, {("n1", 2): capstates.LOST}) == 0.0
    assert observed.measured_step_rate(frac, keys, {("n2", 0): capstates.LOST}) == 0.7  # not its GPU
    job = pb.JobStatus(job_id="J", measured_step_rate=0.0, predicted_step_rate=0.8)
    g = _gpu(2, live=False, state=capstates.STALLED)
    g.job_id = "J"
    lines = observed.explain_lines(job, None, [("n1", g)])
    assert lines[0].startswith("Measured step rate: no reading — n1 GPU 2 (STALLED)")
    g2 = _gpu(3, live=False)  # not read yet: no state to name
    g2.job_id = "J"
    assert "n1 GPU 3 (no reading)" in observed.explain_lines(job, None, [("n1", g2)])[0]


def test_the_binding_names_an_out_of_band_limit_or_a_held_gpu():
    c = types.SimpleNamespace(fixed=np.array([False, False, True]), oob_w=np.array([250.0, np.nan, np.nan]))
    assert allocation.observed_binding("device_min", c, 0) == allocation.OOB_LIMIT
    assert allocation.observed_binding("device_max", c, 0) == allocation.OOB_LIMIT
    assert allocation.observed_binding("device_max", c, 1) == "device_max"
    assert allocation.observed_binding("device_min", c, 2) == allocation.HELD
    for other in ("domain:cluster", "thermal", "saturated", "slew"):
        assert allocation.observed_binding(other, c, 0) == other
    c.oob_w = None  # columns built without the rule (from GpuInput rows)
    assert allocation.observed_binding("device_min", c, 0) == "device_min"


def test_a_held_gpus_detail_follows_the_state_the_agent_reports():
    agent = "GPU 1: setting the power limit to 1 W failed: NVML_ERROR_INVALID_ARGUMENT"
    text = held_detail(0.0, 0.0, capstates.SET_FAILED, agent)
    assert text.startswith("limit constraints reported by the agent at its start: min 0 W, max 0 W")
    assert text.endswith(f"the agent reports SET_FAILED: {agent}") and "read from the device" not in text
    own = "GPU 1: limit constraints read from the device: min 1 W, max 2 W; ..."
    assert held_detail(0.0, 0.0, capstates.UNSUPPORTED_CONSTRAINTS, own) == own
    assert "the agent reports" not in held_detail(0.0, 0.0, "", "")


def test_a_gpu_closer_to_slowdown_than_half_the_policy_margin_raises_an_alert():
    from coordinator.loop import near_slowdown_alert

    (alert,) = near_slowdown_alert("n2", 1, 87.0, 89.0, 5.0)  # the demo's hot GPU: 2 degC left of 5
    assert alert.startswith("n2 GPU 1: 87.0 °C, 2.0 °C below its slowdown temperature 89 °C") and "keeps 5 °C" in alert
    assert near_slowdown_alert("n2", 1, 86.5, 89.0, 5.0) == []  # 2.5 degC left: within the noise of the target
    assert near_slowdown_alert("n2", 1, 87.0, 0.0, 5.0) == []  # no slowdown temperature read
    assert near_slowdown_alert("n2", 1, float("nan"), 89.0, 5.0) == []
