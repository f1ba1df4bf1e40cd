"""The ingest's whole-report shortcuts give the record-by-record verdicts (issue 12, item 7).

* A packed report judged on its distinct string parts and a memo of index tuples
  (``limits._packed_errors``) is refused, with the same text, exactly when the per-row checks
  (``limits.rows_problem`` on freshly emptied memos) refuse it; its rows are those decoded.
* ``Registry.on_telemetry``'s "first readings" answer equals its definition (some GPU without a
  reading before, every GPU with one after), on reports with missing and bad read-backs.
* ``jobenergy.problem``'s shortcut (all numbers >= 0 with a finite sum) equals the per-field loop,
  and ``NodeEnergy.from_proto`` keeps every field and label rule.
"""

from __future__ import annotations

import math
import random

import pytest

from capctl import readings
from capctl.security import limits
from capctl.v1 import capctl_pb2 as pb
from coordinator import jobenergy
from coordinator.registry import GpuObs, NodeObs, Registry

JOBS = ["", "42", "1234_5", "j" * 1025, "7\n", "7\x1fx"]
REASONS = [[], ["SW_POWER_CAP"], ["SW_POWER_CAP", "SW_THERMAL_SLOWDOWN"], ["r"] * 33, ["x" * 129], ["A\nB"]]
ERRORS = ["", "", "lost", "e\nx", "e" * 1025]  # (the first four acceptable)


MEMOS = (limits._CLEAN_LABELS, limits._CLEAN_REASONS, limits._CLEAN_INDICES)


def _clear_memos() -> None:
    for memo in MEMOS:
        memo.clear()


def _full_checks(rows: list, field: str) -> str:
    """``limits.rows_problem`` on empty memos (every row through ``row_problem``); the memos are
    left as they were."""
    saved = [set(memo) for memo in MEMOS]
    _clear_memos()
    try:
        return limits.rows_problem(rows, field)
    finally:
        for memo, old in zip(MEMOS, saved):
            memo.clear()
            memo.update(old)


def _random_report(rng: random.Random) -> pb.NodeTelemetry:
    n = rng.choice([0, 1, 3, 8, 8, 8])
    indices = rng.sample(range(8), n) if rng.random() < 0.8 else [rng.choice([0, 5, 63, 64, 70]) for _ in range(n)]
    gpus = []
    for i in indices:
        good = rng.random() < 0.8  # mostly clean, as a fleet reports
        gpus.append(pb.GpuTelemetry(index=i, enforced_w=300.0, cap_w=300.0, cap_state=rng.choice([0, 1, 2, 5]),
                                    job_id=rng.choice(JOBS[:3] if good else JOBS),
                                    clocks_event_reasons=rng.choice(REASONS[:3] if good else REASONS),
                                    error=rng.choice(ERRORS[:4] if good else ERRORS)))
    t = pb.NodeTelemetry(node="n1")
    readings.pack(gpus, t.readings)
    return t


def test_packed_reports_are_judged_as_the_per_row_checks_judge_them():
    rng = random.Random(11)
    verdicts = set()
    warm = 0
    for _ in range(1500):
        t = _random_report(rng)
        warm += bool(limits._CLEAN_INDICES)
        got_rows, got = limits.telemetry_rows(t, "n1")  # memos as they are: warm, from earlier reports
        rows, p = readings.packed_rows(t.readings, "NodeTelemetry.readings", limits.MAX_GPUS_PER_NODE)
        assert p == ""
        want = _full_checks(rows, "NodeTelemetry.readings")
        assert got == want, (got, want)
        if not want:
            want_rows = [r[:readings.R_ERROR] + (limits.printable(r[readings.R_ERROR]),) + r[readings.R_ERROR + 1:]
                         for r in rows]
            assert repr(got_rows) == repr(want_rows)  # (NaN memory_pct: compared as text)
        verdicts.add(bool(want))
        if rng.random() < 0.3:
            _clear_memos()  # some reports meet empty memos (the full checks) and fill them
    assert verdicts == {True, False}
    assert warm > 500  # most reports met warm memos (the shortcut's case)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_first_readings_answer_equals_its_definition(seed):
    rng = random.Random(seed)
    clock = [100.0]
    reg = Registry(clock=lambda: clock[0])
    for step in range(60):
        clock[0] += 1.0
        if step % 15 == 0:  # a node with GPUs that have no reading yet
            reg.nodes["n1"] = NodeObs(name="n1", gpus={i: GpuObs(node="n1", index=i, min_cap_w=200.0, max_cap_w=700.0)
                                                       for i in range(4)})
        node = reg.nodes["n1"]
        before = any(not g.have_reading for g in node.gpus.values())
        gpus = [pb.GpuTelemetry(index=i, enforced_w=rng.choice([0.0, 300.0, math.inf]), cap_w=300.0)
                for i in rng.sample(range(5), rng.randrange(0, 6))]  # index 4: not a GPU of the node
        got = reg.on_telemetry("n1", pb.NodeTelemetry(node="n1", gpus=gpus))
        assert got == (before and all(g.have_reading for g in node.gpus.values())), step


def _loop_problem(je) -> str:
    """``jobenergy.problem`` before its shortcut (the per-field loop)."""
    if not 0 < len(je.job_id) <= jobenergy.MAX_JOB_ID_CHARS:
        return f"job_id {je.job_id[:40]!r}: 1-{jobenergy.MAX_JOB_ID_CHARS} characters allowed"
    for f in jobenergy.FIELDS:
        v = getattr(je, f)
        if not (math.isfinite(v) and v >= 0):
            return f"job {je.job_id}: {f} {v!r}: a finite number >= 0 allowed"
    return ""


def test_energy_record_checks_equal_the_per_field_loop():
    rng = random.Random(5)
    odd = [0.0, 1.0, 1e308, -0.0, -1.0, -1e-300, math.inf, -math.inf, math.nan]
    verdicts = set()
    for _ in range(3000):
        values = {f: (rng.choice(odd) if rng.random() < 0.15 else rng.uniform(0, 1e6))
                  for f in jobenergy.FIELDS if f not in ("resets", "gpus")}
        je = pb.JobEnergy(job_id=rng.choice(["J1", "", "x" * 129]), resets=rng.randrange(3), gpus=8, user="ann",
                          partition=rng.choice(["p", "a\x1b"]), account="x" * rng.choice([3, 129]), **values)
        want = _loop_problem(je)
        assert jobenergy.problem(je) == want
        verdicts.add(bool(want))
        rec = jobenergy.NodeEnergy.from_proto(je)
        assert all(getattr(rec, f) == getattr(je, f) or math.isnan(getattr(je, f)) for f in jobenergy.FIELDS)
        assert (rec.user, rec.partition, rec.account) == tuple(limits.label_or_empty(getattr(je, f))
                                                               for f in limits.JOB_LABELS)
        assert rec.final is False and jobenergy.NodeEnergy.from_proto(je, final=True).final is True
    assert verdicts == {True, False}
