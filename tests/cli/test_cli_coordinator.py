"""capctl status/nodes/jobs/explain/budget against a running coordinator with real agents on
simulated GPUs; ``status --json`` validated against docs/status-schema.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest

from capctl.cli.main import main
from tests.support.processes import Cluster, wait_until

pytestmark = pytest.mark.integration

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "status-schema.json").read_text())


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_against_running_coordinator(tmp_path, capsys):
    # node2's GPUs stay idle at their pre-job (default) limit, 700 W each, counted as spent; node3 is
    # in the policy, but no agent ever says hello for it
    with Cluster(tmp_path, {"node1": 2, "node2": 2}, budget_w=2600.0, interval_s=0.3, policy_only=("node3",)) as cl:
        addr = cl.coordinator.address
        with cl.agent("node1").client() as c:
            assert c.job_start("77", ["0", "1"], user="dave", partition="gpu").ok
        for i in range(2):
            cl.sims["node1"].set_load(i, 650.0, 100.0)

        def status():
            code, out, err = run(capsys, "status", "--json", "--coordinator", addr)
            assert code == 0, err
            return json.loads(out)

        # (before JobStart every GPU sat at its 700 W default: wait for telemetry after the start cap)
        # (every GPU read: a GPU without a reading has no enforced limit to sum, and node2's first
        # report may come after node1's capped one)
        d = wait_until(lambda: (x := status())["jobs"] and len(x["nodes"]) == 3 and x["enforced_w"] <= 2600 and all(
            g["enforced_w"] is not None for n in x["nodes"] for g in n["gpus"]) and x, 15,
                       what="job 77, both nodes read and the budget held in capctl status")
        jsonschema.validate(d, SCHEMA)
        assert d["budget_w"] == 2600.0 and d["interval_s"] == 0.3
        assert [n["name"] for n in d["nodes"]] == ["node1", "node2", "node3"]  # (the never-reported last)
        assert [n["never_reported"] for n in d["nodes"]] == [False, False, True]
        n3 = d["nodes"][2]  # before: absent, as if the policy did not list it
        assert n3["stale"] and n3["gpus"] == [] and n3["last_report_age_s"] is None
        # the watts held for it, before shown nowhere: 2 declared H100s x 700 W; none for a known node
        assert n3["held_w"] == 1400.0 and [n["held_w"] for n in d["nodes"][:2]] == [0.0, 0.0]
        assert [j["job_id"] for j in d["jobs"]] == ["77"] and d["jobs"][0]["nodes"] == ["node1"]
        assert d["jobs"][0]["gpus"] == 2 and d["jobs"][0]["user"] == "dave"
        n1 = next(n for n in d["nodes"] if n["name"] == "node1")
        assert [g["job_id"] for g in n1["gpus"]] == ["77", "77"] and n1["gpus"][0]["slowdown_temp_c"] == 89.0
        assert sum(g["enforced_w"] for n in d["nodes"] for g in n["gpus"]) <= d["budget_w"] + 1e-6

        code, out, _ = run(capsys, "status", "--coordinator", addr)
        assert code == 0 and "budget 2600 W" in out and "77" in out and "node2" in out
        assert ("no agent: node3 (1 node of the policy never reported; 1400 W held for it, each counted at the most "
                "it may draw until it reports)") in out
        # node3 may be running at any cap: counted at 2 declared H100s x 700 W (docs/protocol.md)
        assert any("have not reported (node3)" in a and "each counted at 1400 W" in a for a in d["alerts"]), d["alerts"]
        assert d["allocated_w"] <= 2600.0 - 1400.0 + 1e-6
        assert "stale node" not in out  # (node3 has no readings, but it is no stale node)
        code, out, _ = run(capsys, "nodes", "--coordinator", addr)
        assert code == 0 and out.count("node1") >= 3
        row = next(ln for ln in out.splitlines() if ln.startswith("node3"))
        # (its accounted watts: the 1,400 W held for it; nothing else of it is known)
        assert row.split()[:3] == ["node3", "NO", "AGENT"] and row.split()[6] == "1400", row
        assert set(row.split()[3:6] + row.split()[7:]) == {"-"}, row
        code, out, _ = run(capsys, "jobs", "--json", "--coordinator", addr)
        assert code == 0 and [j["job_id"] for j in json.loads(out)["jobs"]] == ["77"]
        code, out, _ = run(capsys, "explain", "77", "--coordinator", addr)
        assert code == 0 and out.startswith("job 77: 2 GPU(s) on node1")
        code, out, err = run(capsys, "explain", "78", "--coordinator", addr)
        assert code == 6 and "job '78': no running job is bound to GPUs under that id and no finished one is kept" in err

        # budget: admin only on the admin socket; refused below the minimum caps
        code, _, err = run(capsys, "budget", "set", "2400", "--coordinator", addr)
        assert code == 4, err
        code, out, _ = run(capsys, "budget", "set", "2400", "--json", "--coordinator", cl.coordinator.admin_address)
        assert code == 0 and json.loads(out)["budget_w"] == 2400.0
        # the audit line names the caller (SO_PEERCRED through the admin socket's splice): this process
        audit = wait_until(lambda: next((ln for ln in cl.coordinator.log_tail(300).splitlines()
                                         if "budget set by" in ln), None), 10, what="the budget set audit line")
        assert f"uid {os.getuid()} " in audit and f"pid {os.getpid()}" in audit, audit
        code, out, err = run(capsys, "budget", "set", "700", "--coordinator", cl.coordinator.admin_address)
        assert code == 1 and "deficit" in err and "700" in err
        code, out, err = run(capsys, "budget", "set", "1e-300", "--coordinator", cl.coordinator.admin_address)
        assert code == 1 and err.startswith("capctl: budget 1e-300 W refused: 1e-300 W is below the "), err
        # an agent's socket is no coordinator: said so, with the unreachable exit status
        code, out, err = run(capsys, "--coordinator", f"unix:{cl.agent('node1').socket_path}", "status")
        assert (code, out) == (3, "") and err == (f"capctl: unix:{cl.agent('node1').socket_path} answers but serves "
                                                  "no capctl coordinator (an agent's socket?)\n")
        assert status()["budget_w"] == 2400.0
