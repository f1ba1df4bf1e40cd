"""Input bounds: validators accept real-looking messages and name the field of a bad one."""

from __future__ import annotations

import math

import pytest

from capctl import readings
from capctl.security import limits
from capctl.v1 import capctl_pb2 as pb


def _gpu(i, **kw):
    base = dict(index=i, uuid=f"GPU-{i:08d}", name="NVIDIA H100 80GB HBM3", min_cap_w=200, max_cap_w=700,
                default_cap_w=700, slowdown_temp_c=87, shutdown_temp_c=92, pci_bus_id=f"00000000:{i + 16:02x}:00.0")
    base.update(kw)
    return pb.GpuInfo(**base)


def _hello(**kw):
    base = dict(protocol_version="capctl.v1", node="gpu-a01", agent_version="0.1.0", driver_version="550.54",
                gpus=[_gpu(i) for i in range(8)],
                jobs=[pb.JobBinding(job_id="1234_5", node="gpu-a01", gpu_indices=[0, 1], user="ann", partition="p")])
    base.update(kw)
    return pb.AgentHello(**base)


def test_good_messages_pass():
    assert limits.validate_hello(_hello()) == ""
    tel = pb.NodeTelemetry(node="gpu-a01", gpus=[pb.GpuTelemetry(index=i, cap_state="OK", job_id="1,2",
                                                                  clocks_event_reasons=["SW_POWER_CAP"])
                                                 for i in range(8)])
    assert limits.validate_telemetry(tel, "gpu-a01") == ""
    assert limits.validate_ack(pb.CapAck(seq=3, gpus=list(tel.gpus), error="GPU 3: lost\nretrying")) == ""
    assert limits.validate_job_start(pb.JobStartRequest(job_id="42+1", gpu_ids=["0", "1"], user="u")) == ""
    assert limits.validate_budget(25_000.0) == ""
    assert limits.validate_policy_path("/etc/capctl/policy.yaml") == ""


@pytest.mark.parametrize("change, expect", [
    (dict(node=""), "AgentHello.node ''"),
    (dict(node="a b"), "AgentHello.node 'a b'"),
    (dict(node="../etc"), "AgentHello.node"),
    (dict(node="n" * 254), "1..253 characters"),
    (dict(gpus=[_gpu(i) for i in range(65)]), "65 GPUs, at most 64"),
    (dict(gpus=[_gpu(0), _gpu(0)]), "index 0 twice"),
    (dict(gpus=[_gpu(70)]), "index 70, at most 63"),
    (dict(gpus=[_gpu(0, min_cap_w=math.nan)]), "gpus[0]: limit constraints min_cap_w=nan"),
    (dict(gpus=[_gpu(0, default_cap_w=math.inf)]), "need finite numbers"),
    (dict(gpus=[_gpu(0, max_cap_w=math.nan)]), "max_cap_w=nan"),
    (dict(gpus=[_gpu(0, uuid="x" * 500)]), "uuid: 500 characters, at most 128"),
    (dict(jobs=[pb.JobBinding(job_id="j", node="gpu-a01")] * 257), "257 jobs, at most 256"),
    (dict(jobs=[pb.JobBinding(job_id="1; rm -rf /", node="gpu-a01")]), "job_id '1; rm -rf /'"),
    (dict(jobs=[pb.JobBinding(job_id="7", node="other")]), "must name it"),
    (dict(jobs=[pb.JobBinding(job_id="7", gpu_indices=list(range(65)))]), "65 GPUs"),
    (dict(jobs=[pb.JobBinding(job_id="7", user="a\x1b[31m")]), "control characters"),
    (dict(protocol_version="v" * 1000), "protocol_version: 1000 characters"),
])
def test_bad_hello_names_the_field(change, expect):
    problem = limits.validate_hello(_hello(**change))
    assert expect in problem
    assert len(problem) < 400  # one line, values truncated


def test_bad_limit_constraints_are_device_data_not_a_bad_hello():
    # min > max and (0, 0): the GPU is held (UNSUPPORTED_CONSTRAINTS), the node is accepted
    assert limits.validate_hello(_hello(gpus=[_gpu(0, min_cap_w=800), _gpu(1, min_cap_w=0, max_cap_w=0)])) == ""
    # outside any board (above 100 kW, below 0): held the same way, not the whole node refused
    assert limits.validate_hello(_hello(gpus=[_gpu(0, max_cap_w=1e12), _gpu(1, min_cap_w=-5.0)])) == ""


def test_bad_telemetry_ack_and_requests():
    assert "on the stream of 'n1'" in limits.validate_telemetry(pb.NodeTelemetry(node="n2"), "n1")
    many = pb.NodeTelemetry(gpus=[pb.GpuTelemetry(index=0)] * 65)
    assert "65 GPUs" in limits.validate_telemetry(many)
    reasons = pb.NodeTelemetry(gpus=[pb.GpuTelemetry(index=0, clocks_event_reasons=["X"] * 33)])
    assert "clocks_event_reasons: 33" in limits.validate_telemetry(reasons)
    long_err = pb.CapAck(gpus=[pb.GpuTelemetry(index=1, error="e" * 2000)])
    assert "CapAck.gpus GPU 1: error: 2000 characters" in limits.validate_ack(long_err)
    assert "at most 64 allowed" in limits.validate_job_start(pb.JobStartRequest(job_id="1", gpu_ids=["0"] * 65))
    assert "job_id ''" in limits.validate_job_start(pb.JobStartRequest(job_id=" "))
    for bad in (0.0, -5.0, math.inf, math.nan, 2e9):
        assert "budget_w" in limits.validate_budget(bad)
    assert "at most 4096" in limits.validate_policy_path("/" * 5000)
    assert "NUL" in limits.validate_policy_path("/etc/x\x00y")


def test_clip_and_options():
    assert limits.clip("x" * 5000) == "x" * 1021 + "..."
    assert limits.clip("short") == "short"
    opts = dict(limits.server_options())
    assert opts["grpc.max_receive_message_length"] == limits.MAX_MESSAGE_BYTES == 4 << 20


def test_gpu_telemetry_memo_gives_the_full_checks_verdict():
    """rows_problem's memo of acceptable labels and reason sets returns exactly what the full
    checks (row_problem) return, on random readings mixing good and bad values (repeats hit the
    memo)."""
    import random

    rng = random.Random(7)
    states = ["OK", "CLAMPED", "x" * 129, "bad\x07", ""]
    jobs = ["", "42", "1,2", "j" * 1025, "7\n"]
    reason_sets = [[], ["SW_POWER_CAP"], ["SW_THERMAL_SLOWDOWN", "SW_POWER_CAP"], ["r"] * 33, ["x" * 129]]
    seen = set()
    for _ in range(3000):
        g = pb.GpuTelemetry(index=rng.choice([0, 7, 63, 64, 100]), cap_state_name=rng.choice(states),
                            job_id=rng.choice(jobs), clocks_event_reasons=rng.choice(reason_sets),
                            error=rng.choice(["", "lost", "e" * 1025]))
        row = readings.rows_of(pb.CapAck(gpus=[g]))[0]
        expect = limits.row_problem(row, "gpus")
        assert limits.rows_problem([row], "gpus") == expect
        seen.add(bool(expect))
    assert seen == {True, False}
    assert limits._CLEAN_LABELS and limits._CLEAN_REASONS  # the memo was used


def _packed_telemetry(gpus, row_bytes=None):
    t = pb.NodeTelemetry(node="gpu-a01")
    readings.pack(gpus, t.readings)
    if row_bytes is not None:
        t.readings.row_bytes = row_bytes
    return t


def _row(index, reasons=0, job=1, error=0) -> bytes:
    return readings.ROW.pack(index, 300.0, 300.0, 300.0, 50.0, 1500, 90.0, math.nan, 1e5, 0.0, 1, reasons, job, error)


def _with_rows(t, data: bytes) -> pb.NodeTelemetry:
    out = pb.NodeTelemetry()
    out.CopyFrom(t)
    out.readings.rows = data
    return out


def test_packed_readings_decode_to_the_rows_of_the_same_gpus():
    gpus = [pb.GpuTelemetry(index=i, power_w=300.5 + i, cap_w=500, enforced_w=480, temp_c=61.25, sm_clock_mhz=1755,
                            utilization_pct=99.0, energy_j=1e6 + i, pre_job_cap_w=700, cap_state=2, job_id=f"{i % 2}",
                            error="nvml: timeout" if i == 3 else "",
                            clocks_event_reasons=["SW_POWER_CAP"] if i % 2 else ["SW_POWER_CAP", "HW_SLOWDOWN"])
            for i in range(8)]
    for i in (1, 5):
        gpus[i].utilization_rates.memory_pct = 12.0
    plain = pb.NodeTelemetry(node="gpu-a01", gpus=gpus)
    packed = _packed_telemetry(gpus)
    got, problem = limits.telemetry_rows(packed, "gpu-a01")
    want, problem_plain = limits.telemetry_rows(plain, "gpu-a01")
    assert problem == problem_plain == ""
    def facts(rows):  # (the packed string positions aside; NaN memory_pct compared as text)
        return [repr(r[:readings.R_WIRE_REASONS] + r[readings.R_STATE:]) for r in rows]
    assert facts(got) == facts(want)
    assert got[1][readings.R_STATE] == "OOB_LIMITED" and got[3][readings.R_ERROR] == "nvml: timeout"
    assert got[0][readings.R_REASONS] == ("SW_POWER_CAP", "HW_SLOWDOWN") and got[1][readings.R_REASONS] == ("SW_POWER_CAP",)
    assert math.isnan(got[0][readings.R_MEM]) and got[1][readings.R_MEM] == 12.0
    # each distinct string once: "", two reason sets, two job ids, one error
    assert sorted(packed.readings.strings) == sorted(["", "SW_POWER_CAP\x1fHW_SLOWDOWN", "SW_POWER_CAP", "0", "1",
                                                      "nvml: timeout"])
    assert limits.validate_ack(pb.CapAck(seq=1, readings=packed.readings)) == ""


def test_bad_packed_readings_name_the_field():
    good = _packed_telemetry([pb.GpuTelemetry(index=i, enforced_w=300, job_id="7") for i in range(2)])
    data = good.readings.rows
    cases = [
        (_packed_telemetry([], row_bytes=3), "NodeTelemetry.readings.row_bytes 3: need 88 to 1024"),
        (_with_rows(good, data[:-1]), "175 bytes, not a whole number of 88-byte rows"),
        (_with_rows(good, data * 33), "66 GPUs, at most 64 allowed"),
        (_with_rows(good, _row(70) + data[88:]), "NodeTelemetry.readings: GPU index 70, at most 63"),
        (_with_rows(good, data[:88] + _row(1, reasons=5)),
         "readings.rows[1].clocks_event_reasons: string 5, need a position in strings (0 to 1)"),
        (_with_rows(good, data[:88] + _row(1, job=2)), "readings.rows[1].job_id: string 2, need a position"),
        (_with_rows(good, _row(0, error=9) + data[88:]), "readings.rows[0].error: string 9"),
    ]
    first = pb.NodeTelemetry()
    first.CopyFrom(good)
    first.readings.strings[0] = "x"
    cases.append((first, "readings.strings: 2 strings, the first 'x'; need 1 to 193, \"\" first"))
    many = pb.NodeTelemetry()
    many.CopyFrom(good)
    many.readings.strings.extend(str(k) for k in range(200))
    cases.append((many, "readings.strings: 202 strings"))
    both = pb.NodeTelemetry()
    both.CopyFrom(good)
    both.gpus.add(index=0)
    cases.append((both, "both gpus and readings"))
    ctl = pb.NodeTelemetry()
    ctl.CopyFrom(good)
    ctl.readings.strings[1] = "7\x1b[2J"
    cases.append((ctl, "NodeTelemetry.readings GPU 0: job_id"))
    for msg, expect in cases:
        problem = limits.validate_telemetry(msg, "gpu-a01")
        assert expect in problem, (expect, problem)
        assert limits.telemetry_rows(msg, "gpu-a01")[0] == []
    assert limits.validate_telemetry(good, "gpu-a01") == ""


def test_packed_rows_of_a_newer_agent_are_read_by_their_known_fields():
    """Rows longer than capctl.readings.ROW (fields a newer agent appended) decode to their first
    88 bytes; the extra bytes are skipped."""
    gpus = [pb.GpuTelemetry(index=i, power_w=100.0 + i, enforced_w=300, cap_state=1, job_id="7") for i in range(3)]
    t = _packed_telemetry(gpus)
    data = t.readings.rows
    t.readings.row_bytes = 104
    t.readings.rows = b"".join(data[k * 88:(k + 1) * 88] + b"\xff" * 16 for k in range(3))
    rows, problem = limits.telemetry_rows(t)
    assert problem == "" and [(r[readings.R_INDEX], r[readings.R_POWER]) for r in rows] == [(0, 100.0), (1, 101.0),
                                                                                            (2, 102.0)]


def test_refused_messages_leave_nothing_in_the_decoders_memos():
    """The decoders' memos (reason sets, cap-state names) are asked before the bound checks: a
    message refused for a huge reason string or state name must leave nothing held (a review found
    ~38 MB kept per refused 4 MiB message)."""
    from capctl import capstates

    before_sets, before_names = len(readings._REASON_SETS), len(capstates.WIRE_NAMES)
    for k in range(20):
        t = pb.NodeTelemetry(node="n1")
        t.readings.row_bytes = readings.ROW.size
        t.readings.rows = _row(0, reasons=1, job=0)
        t.readings.strings.extend(["", "\x1f" * 20_000 + str(k)])
        assert "clocks_event_reasons: 20001, at most 32" in limits.validate_telemetry(t, "n1")
        plain = pb.NodeTelemetry(node="n1", gpus=[pb.GpuTelemetry(index=0, cap_state_name="S" * 5000 + str(k))])
        assert "cap_state_name" in limits.validate_telemetry(plain, "n1")
        # within the memo's length bound but thousands of (empty) names: refused, not kept either
        short = pb.NodeTelemetry(node="n1")
        short.readings.row_bytes = readings.ROW.size
        short.readings.rows = _row(0, reasons=1, job=0)
        short.readings.strings.extend(["", str(k) + "\x1f" * (readings.MAX_CACHED_REASONS_CHARS - 3)])
        assert "at most 32" in limits.validate_telemetry(short, "n1")
    assert len(readings._REASON_SETS) == before_sets and len(capstates.WIRE_NAMES) == before_names
    assert all(len(j) <= readings.MAX_CACHED_REASONS_CHARS for j in readings._REASON_SETS)
    assert readings.MAX_CACHED_REASON_NAMES == limits.MAX_CLOCK_REASONS


@pytest.mark.parametrize("packed", [False, True])
def test_a_gpu_twice_and_control_characters_in_reasons_are_refused_in_both_forms(packed):
    """A report naming one GPU twice (its energy counters alternating were charged as deltas,
    found by a review) and a reason name with control characters are refused, packed or not,
    with the field and the value named."""
    def msg(gpus):
        return _packed_telemetry(gpus) if packed else pb.NodeTelemetry(gpus=gpus)

    twice = msg([pb.GpuTelemetry(index=0, enforced_w=300), pb.GpuTelemetry(index=1, enforced_w=300),
                 pb.GpuTelemetry(index=0, enforced_w=300)])
    problem = limits.validate_telemetry(twice, "gpu-a01")
    assert "GPU index 0 twice" in problem and limits.telemetry_rows(twice, "gpu-a01")[0] == []
    ctl = msg([pb.GpuTelemetry(index=3, enforced_w=300, clocks_event_reasons=["SW_POWER_CAP", "A\nB"])])
    assert "GPU 3: clocks_event_reasons 'A\\nB': control characters" in limits.validate_telemetry(ctl, "gpu-a01")
    ok = msg([pb.GpuTelemetry(index=i, enforced_w=300) for i in range(8)])
    assert limits.validate_telemetry(ok, "gpu-a01") == ""


@pytest.mark.parametrize("packed", [False, True])
def test_control_characters_in_a_gpu_error_are_escaped_not_refused(packed):
    """A GPU's error text is the agent's free text: a control character in it does not refuse
    the node's report (its other GPUs' readings count), it is written as its escape, so log
    lines and alerts stay one line."""
    gpus = [pb.GpuTelemetry(index=0, enforced_w=300, error="e\n\x1b[31mred\tx"), pb.GpuTelemetry(index=1, enforced_w=300)]
    t = _packed_telemetry(gpus) if packed else pb.NodeTelemetry(gpus=gpus)
    rows, problem = limits.telemetry_rows(t, "gpu-a01")
    assert problem == "" and [r[readings.R_ERROR] for r in rows] == ["e\\n\\x1b[31mred\\tx", ""]
    assert limits.printable("plain text") == "plain text"
    assert limits.printable("\x00\x7f") == "\\x00\\x7f"
