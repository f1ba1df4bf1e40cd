"""capctl status/nodes/jobs/explain/budget against an in-test Admin gRPC server (real gRPC on a unix
socket): rendering, the documented JSON schema, and exit codes. The same commands run against the
real coordinator in test_cli_coordinator.py."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import jsonschema
import pytest

from capctl.cli.main import main
from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "status-schema.json").read_text())


def sample_reply() -> pb.StatusReply:
    def gpu(i, temp, reasons, job, node="node1"):
        return pb.GpuStatus(node=node, index=i, uuid=f"GPU-{i:04d}", cap_w=500 + i, enforced_w=500 + i, power_w=480 + i,
                            temp_c=temp, slowdown_temp_c=89, sm_clock_mhz=1700 - 10 * i, max_sm_clock_mhz=1980,
                            clocks_event_reasons=reasons, job_id=job, min_cap_w=200, max_cap_w=700,
                            thermal_ceiling_w=650, cap_state="OK")

    return pb.StatusReply(
        budget_w=4480, allocated_w=4012, enforced_w=4012, draw_w=3900.5, interval_s=2, last_solve_s=0.0123,
        last_solve_time_s=1.7e9, policy_path="/etc/capctl/policy.yaml", coordinator_id="c0ffee",
        nodes=[pb.NodeStatus(name="node1", stale=False, last_report_age_s=0.4,
                             gpus=[gpu(0, 70.5, ["SW_POWER_CAP"], "11"), gpu(1, 86.0, ["HW_THERMAL_SLOWDOWN"], "11")]),
               pb.NodeStatus(name="node2", stale=True, last_report_age_s=31.0,
                             gpus=[gpu(0, 60.0, [], "", "node2"), gpu(1, 62.0, [], "12,13", "node2")])],
        jobs=[pb.JobStatus(job_id="11", nodes=["node1"], gpus=2, weight=1.0, predicted_step_rate=0.9312,
                           measured_step_rate=0.9015, binding="domain:pdu-a", allocated_w=1001, energy_j=7.2e6, user="alice")],
        domains=[pb.DomainStatus(name="cluster", kind="cluster", limit_w=4480, allocated_w=4012, enforced_w=4012,
                                 draw_w=3900.5, price_rate_per_w=0.0021)],
        alerts=["node2 stale: no telemetry for 31 s"])


class FakeAdmin(pb_grpc.AdminServicer):
    def __init__(self):
        self.budget_w = 4480.0
        self.calls = []

    def Status(self, request, context):  # noqa: N802
        self.calls.append("Status")
        r = sample_reply()
        r.budget_w = self.budget_w
        return r

    Nodes = Status
    Jobs = Status

    def Explain(self, request, context):  # noqa: N802
        if request.job_id != "11":
            context.abort(grpc.StatusCode.NOT_FOUND, f"job {request.job_id!r} is not bound to any GPU")
        r = sample_reply()
        return pb.ExplainReply(job=r.jobs[0], binding="domain:pdu-a", slowest_node="node1", slowest_gpu_index=1,
                               prices=[pb.DomainPrice(domain="pdu-a", price_rate_per_w=0.003)],
                               gpus=list(r.nodes[0].gpus), text="GPU 1 on node1 is the straggler.")

    def SetBudget(self, request, context):  # noqa: N802
        if request.budget_w > 1e6:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "budget set: admin only")
        if request.budget_w < 800:
            return pb.SetBudgetReply(ok=False, budget_w=self.budget_w, deficit_w=800 - request.budget_w,
                                     message="below the sum of minimum caps")
        self.budget_w = request.budget_w
        return pb.SetBudgetReply(ok=True, budget_w=self.budget_w)


@pytest.fixture
def admin(tmp_path):
    fake = FakeAdmin()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AdminServicer_to_server(fake, server)
    address = f"unix:{tmp_path}/admin.sock"
    server.add_insecure_port(address)
    server.start()
    yield fake, address
    server.stop(0.2).wait(2)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_status_json_matches_schema_and_values(admin, capsys):
    fake, address = admin
    code, out, err = run(capsys, "status", "--json", "--coordinator", address)
    assert code == 0 and err == ""
    d = json.loads(out)
    jsonschema.validate(d, SCHEMA)
    assert d["budget_w"] == 4480 and d["draw_w"] == 3900.5 and d["last_solve_s"] == 0.0123
    assert d["nodes"][1]["stale"] is True and d["nodes"][1]["gpus"][1]["job_id"] == "12,13"
    assert d["nodes"][0]["gpus"][1]["clocks_event_reasons"] == ["HW_THERMAL_SLOWDOWN"]
    assert d["jobs"][0] == {"job_id": "11", "nodes": ["node1"], "gpus": 2, "weight": 1.0, "predicted_step_rate": 0.9312,
                            "measured_step_rate": 0.9015, "binding": "domain:pdu-a", "allocated_w": 1001.0, "energy_j": 7200000.0, "user": "alice",
                            "partition": "", "account": ""}
    # a broken document is rejected by the schema (the test can fail)
    bad = dict(d, nodes=[{"name": "x", "stale": "no", "gpus": []}])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_status_table_for_people(admin, capsys):
    _, address = admin
    code, out, _ = run(capsys, "status", "--coordinator", address)
    assert code == 0
    assert "budget 4480 W   allocated 4012 W (90%)   accounted " in out  # accounted, not the devices' enforced
    assert " ACCT W " in out.split("DOMAIN", 1)[1].splitlines()[0]
    assert "domain:pdu-a" in out and "0.931" in out
    assert "STALE" in out and "! node2 stale" in out
    hottest = out.split("hottest GPUs")[1].splitlines()[2]
    assert hottest.split()[:2] == ["node1", "1"] and "+3.0" in hottest and "HW-THERM" in hottest


def test_nodes_jobs_explain(admin, capsys):
    _, address = admin
    code, out, _ = run(capsys, "nodes", "--json", "--coordinator", address)
    nodes = json.loads(out)["nodes"]
    assert code == 0 and [n["name"] for n in nodes] == ["node1", "node2"]
    jsonschema.validate({**json.loads(run(capsys, "status", "--json", "--coordinator", address)[1]), "nodes": nodes},
                        SCHEMA)
    code, out, _ = run(capsys, "nodes", "--coordinator", address)
    assert code == 0 and "node1" in out and "GPU" in out and "12,13" in out
    code, out, _ = run(capsys, "jobs", "--coordinator", address)
    assert code == 0 and out.splitlines()[0].split()[:3] == ["JOB", "NODES", "GPUS"] and "alice" in out
    code, out, _ = run(capsys, "explain", "11", "--json", "--coordinator", address)
    d = json.loads(out)
    assert code == 0 and d["slowest_node"] == "node1" and d["slowest_gpu_index"] == 1
    assert d["prices"] == [{"domain": "pdu-a", "price_rate_per_w": 0.003}]
    code, out, _ = run(capsys, "explain", "11", "--coordinator", address)
    assert "binding constraint: domain:pdu-a" in out and "straggler" in out
    assert out.splitlines()[-1].split()[:3] == ["node1", "1", "11"]  # GPU table names each GPU's node
    code, out, err = run(capsys, "explain", "99", "--coordinator", address)
    assert code == 6 and "job '99' is not bound" in err
    code, out, err = run(capsys, "explain", "x;y", "--coordinator", address)  # no job can have that id
    assert (code, out) == (1, "") and "JOB_ID 'x;y': need a Slurm job id" in err


def test_budget_set_ok_refused_denied(admin, capsys):
    fake, address = admin
    code, out, _ = run(capsys, "budget", "set", "4.2kW", "--coordinator", address)
    assert code == 0 and "budget set to 4200 W" in out and fake.budget_w == 4200
    code, out, err = run(capsys, "budget", "set", "500", "--json", "--coordinator", address)
    assert code == 1 and json.loads(out)["deficit_w"] == 300 and "deficit 300 W" in err
    assert fake.budget_w == 4200
    code, _, err = run(capsys, "budget", "set", "2000000", "--coordinator", address)
    assert code == 4 and "admin only" in err
    code, _, err = run(capsys, "budget", "set", "lots", "--coordinator", address)
    assert code == 1 and "WATTS 'lots'" in err


def test_watch_refreshes(admin, capsys):
    fake, address = admin
    code, out, _ = run(capsys, "status", "--watch", "--watch-interval-s", "0.2", "--count", "3", "--coordinator",
                       address)
    assert code == 0 and out.count("capctl status") == 3 and fake.calls.count("Status") == 3


def test_unreachable_exit_3_clean_message(tmp_path):
    for args in (["status"], ["nodes", "--json"], ["budget", "set", "1000"]):
        out = subprocess.run([sys.executable, "-m", "capctl.cli.main", *args, "--coordinator",
                              f"unix:{tmp_path}/none.sock"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 3, (args, out.stderr)
        assert out.stderr.startswith("capctl: coordinator at unix:") and "unreachable" in out.stderr
        assert "Traceback" not in out.stderr
        if "--json" in args:  # one JSON object with the same error (docs/cli.md)
            d = json.loads(out.stdout)
            assert d["ok"] is False and d["exit_code"] == 3 and out.stderr == f"capctl: {d['error']}\n"
        else:
            assert out.stdout == ""


def test_json_commands_print_one_json_object_for_every_outcome(admin, tmp_path, capsys):
    fake, address = admin
    cases = [  # (argv, exit code, the error's start)
        (["budget", "set", "abc"], 1, "WATTS 'abc': give a number of watts"),
        (["budget", "set", "2000000"], 4, "budget set: admin only"),
        (["explain", "99"], 6, "job '99' is not bound"),
        (["status", "--hottest", "-1"], 1, "--hottest -1: give a count >= 0"),
        (["jobs", "--finished", "--since", "yesterday"], 1, "--since 'yesterday': give a Unix time"),
        (["nodes"], 3, f"coordinator at unix:{tmp_path}/none.sock unreachable"),
    ]
    for argv, code, error in cases:
        target = f"unix:{tmp_path}/none.sock" if argv == ["nodes"] else address
        plain = run(capsys, *argv, "--coordinator", target)
        got, out, err = run(capsys, *argv, "--json", "--coordinator", target)
        assert (got, plain[0]) == (code, code), (argv, err)
        assert err == plain[2] and err.startswith(f"capctl: {error}"), (argv, err)  # the same line for people
        assert out.count("\n") == 1 and plain[1] == "", (argv, out)
        d = json.loads(out)
        assert d["ok"] is False and d["exit_code"] == code and d["error"].startswith(error), (argv, d)
    # a refused budget: the documented keys, and the error
    code, out, _ = run(capsys, "budget", "set", "500", "--json", "--coordinator", address)
    d = json.loads(out)
    assert code == 1 and d["ok"] is False and d["requested_w"] == 500.0 and d["budget_w"] == 4480.0
    assert d["deficit_w"] == 300.0 and d["message"] == "below the sum of minimum caps"
    assert d["error"] == "budget 500 W refused: below the sum of minimum caps (deficit 300 W); budget in force 4480 W"
    code, out, _ = run(capsys, "budget", "set", "4.2kW", "--json", "--coordinator", address)
    assert code == 0 and json.loads(out) == {"ok": True, "requested_w": 4200.0, "budget_w": 4200.0, "deficit_w": 0.0,
                                             "message": ""}


def test_usage_errors_with_json_are_one_json_object_too(capsys):
    """argparse's usage errors (exit 2): the usage and the error line on stderr as always; with
    ``--json`` (before or after the subcommand, never after ``--``) also one JSON object on stdout."""
    cases = [  # (argv, the error's end)
        (["status", "--json", "--bogus"], "unrecognized arguments: --bogus"),
        (["--json", "nodes", "--socket", "/x"], "unrecognized arguments: --socket /x"),
        (["--json", "budget", "set"], "the following arguments are required: WATTS"),
        (["--json", "frobnicate"], "invalid choice: 'frobnicate'"),
    ]
    for argv, error in cases:
        code, out, err = run(capsys, *argv)
        d = json.loads(out)
        assert code == 2 and out.count("\n") == 1, (argv, out)
        assert d["ok"] is False and d["exit_code"] == 2 and error in d["error"], (argv, d)
        assert err.splitlines()[0].startswith("usage: capctl") and d["error"] in err, (argv, err)
    code, out, err = run(capsys, "status", "--bogus")  # without --json: argparse's text only
    assert (code, out) == (2, "") and "unrecognized arguments: --bogus" in err
    from capctl.cli.main import wants_json

    assert wants_json(["--json", "x"]) and wants_json(["status", "--json"])
    assert not wants_json(["explain", "--", "--json"]) and not wants_json(["status", "--jsonx"])


def test_a_command_line_without_its_command_or_action_with_json_is_one_json_object(capsys):
    """``capctl --json`` printed the help (exit 2), ``capctl policy --json`` and ``capctl budget
    --json`` said ``unrecognized arguments: --json`` (found by a review): one JSON object each, and
    the help as before without --json."""
    for argv, error in ((["--json"], "capctl: COMMAND is required"),
                        (["policy", "--json"], "capctl policy: ACTION is required"),
                        (["budget", "--json"], "capctl budget: ACTION is required")):
        code, out, _err = run(capsys, *argv)
        d = json.loads(out)
        assert code == 2 and out.count("\n") == 1 and d["ok"] is False and d["error"].startswith(error), (argv, out)
    code, out, _err = run(capsys, "policy")
    assert code == 2 and out.startswith("usage: capctl policy")


def test_watch_json_retry_lines_are_json(tmp_path, capsys, monkeypatch):
    from capctl.cli import status as status_cli
    from capctl.errors import UnreachableError

    calls = []

    def fetch(address, method="Status"):
        calls.append(address)
        if len(calls) == 2:
            raise UnreachableError("coordinator at unix:/x unreachable (UNAVAILABLE): gone")
        return {"schema_version": 1, "budget_w": 100.0}

    monkeypatch.setattr(status_cli, "fetch_status", fetch)
    code, out, _ = run(capsys, "status", "--watch", "--json", "--watch-interval-s", "0.2", "--count", "3",
                       "--coordinator", "unix:/x")
    lines = [json.loads(ln) for ln in out.splitlines()]
    assert code == 0 and len(lines) == 3 and lines[0] == lines[2] == {"schema_version": 1, "budget_w": 100.0}
    assert lines[1] == {"ok": False, "error": "coordinator at unix:/x unreachable (UNAVAILABLE): gone", "exit_code": 3,
                        "retrying": True}


class NotAdmin(pb_grpc.AgentLocalServicer):
    """An agent's local service only (as on an agent's socket)."""


def test_an_address_without_the_admin_service_is_unreachable_naming_it(tmp_path, capsys):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AgentLocalServicer_to_server(NotAdmin(), server)
    address = f"unix:{tmp_path}/agent.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        for argv in (["status"], ["jobs", "--finished"], ["budget", "set", "1000"]):
            code, out, err = run(capsys, "--coordinator", address, *argv)
            assert (code, out) == (3, ""), (argv, err)
            assert err == f"capctl: {address} answers but serves no capctl coordinator (an agent's socket?)\n", argv
    finally:
        server.stop(0.2).wait(2)


def test_a_coordinator_without_a_newer_method_is_named_as_such(admin, capsys):
    _, address = admin  # FakeAdmin has no FinishedJobs, as a coordinator older than it
    code, out, err = run(capsys, "jobs", "--finished", "--coordinator", address)
    assert (code, out) == (1, "")
    assert err == f"capctl: coordinator at {address} does not implement FinishedJobs (an older capctl-coordinator?)\n"


def test_an_http1_server_given_as_the_coordinator_is_named_as_such(capsys):
    """The coordinator's metrics port (HTTP/1) given as --coordinator: said as such, not as a raw
    "Failed parsing HTTP/2" (found by a try-out)."""
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # (not on the CLI's stderr under test)
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    address = f"127.0.0.1:{srv.server_port}"
    try:
        code, out, err = run(capsys, "--coordinator", address, "status")
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)
    assert (code, out) == (3, ""), err
    assert err.startswith(f"capctl: {address} answers but is no gRPC server (an HTTP/1 endpoint"), err
