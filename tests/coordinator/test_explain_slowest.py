"""``explain`` of a job the solve says is bound by a GPU it holds, when a job-mate runs measurably
slower under a priced domain: that job-mate is the slowest and the domain binds (the numbers of a
try-out: n2/2 held at 610 W and 1,875 MHz, n2/3 at 575 W and 1,830 MHz, the cluster priced); the
status alert lines of flagged GPUs (STRAGGLER, OOB_LIMITED)."""

from __future__ import annotations

from capctl.v1 import capctl_pb2 as pb
from coordinator import observed
from coordinator.loop import explain_text

MAX_MHZ = 1980
HELD, MATE = ("n2", 2), ("n2", 3)
DOMAINS = {HELD: ["cluster", "node:n2"], MATE: ["cluster", "node:n2"]}


def _fractions(held_mhz: int, mate_mhz: int) -> dict:
    return {HELD: held_mhz / MAX_MHZ, MATE: mate_mhz / MAX_MHZ}


def test_a_slower_job_mate_under_a_priced_domain_is_the_slowest():
    got = observed.measured_slowest(HELD, [HELD, MATE], _fractions(1875, 1830), {}, DOMAINS,
                                    {"cluster": 2.59e-3, "node:n2": 0.0})
    assert got == (MATE, "domain:cluster")


def test_the_held_gpu_stays_the_slowest_when_no_mate_is_slower_or_nothing_is_priced():
    fr = _fractions(1875, 1830)
    # within one clock step (15 MHz): one pace
    assert observed.measured_slowest(HELD, [HELD, MATE], _fractions(1875, 1866), {}, DOMAINS,
                                     {"cluster": 2.59e-3}) == (HELD, "")
    assert observed.measured_slowest(HELD, [HELD, MATE], fr, {}, DOMAINS, {"cluster": 0.0}) == (HELD, "")
    assert observed.measured_slowest(HELD, [HELD, MATE], fr, {MATE: "STALLED"}, DOMAINS,
                                     {"cluster": 2.59e-3}) == (HELD, "")


def test_explain_names_the_measured_slowest_gpu_and_the_domain():
    job = pb.JobStatus(job_id="400", nodes=["n2"], gpus=2, weight=1.0, predicted_step_rate=0.962,
                       binding="domain:cluster", allocated_w=1185.0, measured_step_rate=1830 / MAX_MHZ)
    gpus = [("n2", pb.GpuStatus(index=2, node="n2", cap_w=610.0, enforced_w=610.0, temp_c=55.0, sm_clock_mhz=1875,
                                max_sm_clock_mhz=MAX_MHZ, job_id="400", slowdown_temp_c=87.0)),
            ("n2", pb.GpuStatus(index=3, node="n2", cap_w=575.0, enforced_w=575.0, temp_c=54.0, sm_clock_mhz=1830,
                                max_sm_clock_mhz=MAX_MHZ, job_id="400", slowdown_temp_c=87.0))]
    reply = pb.ExplainReply(job=job, binding=job.binding, slowest_node="n2", slowest_gpu_index=3)
    text = explain_text(job, reply, gpus, pb.StatusReply(), planned_slowest=HELD)
    assert "Binding constraint: the limit of power domain cluster" in text, text
    assert ("Slowest GPU (measured: the lowest SM clock of the job; the allocation's curves named n2 GPU 2, held): "
            "n2 GPU 3 — cap 575 W, 1830 MHz, 54.0 °C.") in text, text
    assert "held" not in text.split("Binding constraint")[1].split(".")[0]


def test_flag_alerts_name_each_gpu_with_its_reason_capped_to_four():
    strag = [f"n{i}/3 (HW slowdown: SM clock held at 990 of 1980 MHz at any cap (HW_SLOWDOWN))" for i in range(6)]
    got = observed.flag_alerts({"STRAGGLER": strag, "OOB_LIMITED": ["n1/0 (held at 500 W)"]})
    assert got == [
        "STRAGGLER: " + ", ".join(strag[:4]) + " and 2 more — they run slow at any cap: held near their draw, "
        "their job-mates paced to them",
        "OOB_LIMITED: n1/0 (held at 500 W) — another limiter (out-of-band) holds them below their caps: planned "
        "within it"]
    assert observed.flag_alerts({}) == []
