"""``capctl jobs --finished --since T``: the accepted forms of T and the error for others."""

from __future__ import annotations

import pytest

from capctl.cli.finished import parse_since, render_finished
from capctl.errors import UserInputError


def test_since_takes_unix_times_iso_times_and_ages():
    now = 1_800_000_000.0
    assert parse_since("1700000000.5", now) == 1700000000.5
    assert parse_since("90m", now) == now - 5400.0 and parse_since("2h", now) == now - 7200.0
    assert parse_since("1d", now) == now - 86400.0 and parse_since("30s", now) == now - 30.0
    assert parse_since("2026-12-01T14:00", now) == parse_since("2026-12-01T14:00:00+00:00", now)
    assert parse_since("2026-12-01T15:00+01:00", now) == parse_since("2026-12-01T14:00", now)


@pytest.mark.parametrize("bad", ["", "yesterday", "-5", "nan", "5 weeks", "2026-13-01"])
def test_since_refuses_other_forms_naming_the_value_and_the_allowed_ones(bad):
    with pytest.raises(UserInputError, match="--since .*Unix time.*ISO 8601.*age"):
        parse_since(bad, 0.0)


def test_the_table_marks_incomplete_jobs():
    row = {"job_id": "7", "user": "", "start_time_s": 100.0, "end_time_s": 160.0, "gpus": 2, "energy_j": 1.5e4,
           "gpu_s": 120.0, "mean_power_w": 250.0, "peak_power_w": 400.0, "capped_s": 10.0, "thermal_s": 0.0,
           "complete": False}
    text = render_finished([row])
    assert "7*" in text and "0.004" in text and "60.0" in text and "incomplete" in text  # 15,000 J = 0.004 kWh
    assert render_finished([]) == "no finished jobs kept in that time"


@pytest.mark.parametrize("text", ["99999d", "1970-01-01T00:00:01+01:00", "1960-05-01"])
def test_since_before_1970_is_refused_on_the_client_naming_it(text):
    with pytest.raises(UserInputError) as info:
        parse_since(text, 1_800_000_000.0)
    assert str(info.value).startswith(f"--since {text} is before 1970-01-01; give a later time")
    assert parse_since("20833d", 1_800_000_000.0) == 1_800_000_000.0 - 20833 * 86400.0  # 1970-01-02: allowed


def test_the_servers_message_names_only_the_field_that_is_wrong():
    from capctl.v1 import capctl_pb2 as pb
    from coordinator.server import finished_request_problem

    assert finished_request_problem(pb.FinishedJobsRequest(since_s=-5.0)) == (
        "FinishedJobs: since_s -5.0 is not allowed; give a Unix time >= 0 (s), 0 for all")
    assert finished_request_problem(pb.FinishedJobsRequest(since_s=float("nan"))).startswith("FinishedJobs: since_s nan")
    long_id = pb.FinishedJobsRequest(job_id="7" * 129)
    assert finished_request_problem(long_id) == "FinishedJobs: job_id of 129 characters is not allowed; at most 128"
    assert finished_request_problem(pb.FinishedJobsRequest(since_s=1.7e9, job_id="7" * 128)) == ""
