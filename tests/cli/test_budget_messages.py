"""``capctl budget set`` prints one clean line (no repeated "budget set to", no "refused: refused:",
watts without exponents) and warns when the budget exceeds what the domain limits can hand out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from capctl.cli.status import budget_refused_line, budget_set_line
from capctl.wattunits import format_watts
from coordinator.server import allocatable_under_limits_w
from capctl.policy import load_policy
from tests.support.processes import require_coordinator, start_coordinator

REPO = Path(__file__).resolve().parents[2]

POLICY = """\
version: 1
budget_w: 8000
interval_s: 0.5
objective: proportional
thermal: {margin_c: 5}
start_cap_w: 300
failsafe: {lease_s: 3, safe_cap_w: null}
prolog: {on_unreachable: fail-open, timeout_s: 5}
domains:
  name: cluster
  kind: cluster
  limit_w: 30000
  gpu_model: H100-SXM
  gpus_per_node: 4
  children:
    - {name: pdu-a, kind: pdu, limit_w: 4500, nodes: "n1"}
    - {name: pdu-b, kind: pdu, limit_w: 4500, nodes: "n2"}
"""


def test_message_wording_units():
    assert format_watts(1e12) == "1000000000000" and format_watts(20000.0) == "20000" and format_watts(612.5) == "612.5"
    ok = SimpleNamespace(ok=True, budget_w=20000.0, deficit_w=0.0,
                         message="budget set to 20000 W (was 8000 W); saved in /x/coordinator.db")
    assert budget_set_line(ok) == "budget set to 20000 W (was 8000 W); saved in /x/coordinator.db"
    assert budget_set_line(SimpleNamespace(ok=True, budget_w=5e5, deficit_w=0, message="")) == "budget set to 500000 W"
    refused = SimpleNamespace(ok=False, budget_w=8000.0, deficit_w=300.0,
                              message="refused: 500 W is below the 800 W the cluster needs at least; deficit 300 W; "
                                      "budget stays 8000 W")
    line = budget_refused_line(500.0, refused)
    assert line == ("budget 500 W refused: 500 W is below the 800 W the cluster needs at least; deficit 300 W; "
                    "budget stays 8000 W")
    line = budget_refused_line(1e12, SimpleNamespace(ok=False, budget_w=8000.0, deficit_w=0.0,
                                                     message="refused: above the root domain limit"))
    assert line == "budget 1000000000000 W refused: above the root domain limit; budget in force 8000 W"


@pytest.mark.parametrize("watts, text", [(1e-300, "1e-300"), (1e9, "1000000000"), (3500.0000001, "3500.0000001"),
                                         (3500.0, "3500"), (1.0, "1"), (9999999.999999998, "9999999.999999998"),
                                         (1e7, "10000000"), (0.5, "0.5"), (0.0, "0"), (-5.0, "-5")])
def test_one_watts_formatter_plain_decimal_never_the_same_for_different_values(watts, text):
    assert format_watts(watts) == text and float(text) == watts


def test_format_watts_tells_neighbouring_values_apart_without_exponent_from_1_to_1e7():
    import math
    import random

    rng = random.Random(5)
    for _ in range(2000):
        w = 10 ** rng.uniform(0, 7)
        up = math.nextafter(w, math.inf)
        a, b = format_watts(w), format_watts(up)
        assert a != b and float(a) == w and float(b) == up and "e" not in a + b, (w, a, b)


def test_budget_refused_and_set_lines_carry_the_exact_watts():
    tiny = SimpleNamespace(ok=False, budget_w=1200.0, deficit_w=400.0,
                           message="refused: 1e-300 W is below the 400 W the cluster needs at least; deficit 400 W; "
                                   "budget stays 1200 W")
    assert budget_refused_line(1e-300, tiny).startswith("budget 1e-300 W refused: 1e-300 W is below")
    assert budget_set_line(SimpleNamespace(ok=True, budget_w=1e9, deficit_w=0, message="")) == "budget set to 1000000000 W"


def test_allocatable_under_limits(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(POLICY)
    assert allocatable_under_limits_w(load_policy(str(p)).domains) == 9000.0
    lab = load_policy(str(REPO / "examples" / "policies" / "lab-4node.yaml"))
    assert allocatable_under_limits_w(lab.domains) == 4400.0  # four node domains of 1,100 W


@pytest.mark.integration
def test_budget_above_domain_limits_warns_in_one_line(tmp_path):
    require_coordinator()
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    coord = start_coordinator(tmp_path, policy)
    try:
        coord.wait_serving()

        def cli(*args):
            return subprocess.run([sys.executable, "-m", "capctl.cli.main", "budget", "set", *args,
                                   "--coordinator", coord.admin_address], capture_output=True, text=True, timeout=60)

        r = cli("20kW")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 1 and lines[0].count("budget set to") == 1, r.stdout
        assert lines[0].startswith("budget set to 20000 W (was 8000 W)")
        assert "WARNING: only 9000 W can be allocated under the domain limits" in lines[0]
        r = cli("5000")  # within the domain limits: no warning
        assert r.returncode == 0 and "WARNING" not in r.stdout and "budget set to 5000 W (was 20000 W)" in r.stdout
        r = cli("5000.0000001")  # the coordinator's message tells the two budgets apart
        assert r.returncode == 0 and r.stdout.startswith("budget set to 5000.0000001 W (was 5000 W)"), r.stdout
        r = cli("1e-300")  # one number for one value, no "budget 0 W refused: 1e-300 W ..."
        assert r.returncode == 1 and r.stderr.startswith("capctl: budget 1e-300 W refused: "), r.stderr
        assert "1e-300 W is below the sum of minimum caps 1600 W" in r.stderr, r.stderr
        r = cli("1e12")  # checked before sending: one unit style in the line
        assert r.returncode == 1 and r.stderr == ("capctl: WATTS '1e12': 1000000000000 W is above the largest budget "
                                                  "allowed, 1000000000 W\n")
        r = cli("40000")  # above the root limit_w: refused by the coordinator, said once
        assert r.returncode == 1 and "refused: refused" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert "Traceback" not in r.stderr and r.stderr.startswith("capctl: budget 40000 W refused: "), r.stderr
    finally:
        coord.stop()


@pytest.mark.parametrize("text", ["-5W", "-.5kW"])
def test_a_negative_budget_is_refused_as_a_value_not_as_an_unknown_option(text):
    out = subprocess.run([sys.executable, "-m", "capctl.cli.main", "budget", "set", text,
                          "--coordinator", "unix:/nonexistent/capctl.sock"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == f"capctl: WATTS {text!r}: give a finite number of watts > 0"


def test_a_refused_budget_names_the_need_and_deficit_without_float_noise(tmp_path):
    """A need that is a sum of caps (2243.0950000000003 W, found by a try-out) is shown rounded
    up to 0.01 W, so it still reads above the refused budget, and the deficit is never 0 W."""
    import asyncio

    from coordinator import loop
    from tests.coordinator.conftest import write_policy

    path = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=3000.0)
    coord = loop.Coordinator(load_policy(str(path)), str(path))
    for need, budget, shown_need, shown_deficit in ((2243.0950000000003, 2243.09, "2243.1", "0.01"),
                                                    (2500.004, 2500.0, "2500.01", "0.01"),
                                                    (1600.0, 1000.0, "1600", "600")):
        coord._minimum_needed_w = lambda need=need: need
        reply = asyncio.run(coord.set_budget(budget))
        assert not reply.ok and reply.deficit_w == pytest.approx(need - budget)
        assert (f"is below the {shown_need} W the cluster needs at least" in reply.message
                and f"deficit {shown_deficit} W;" in reply.message), reply.message
        assert "0000" not in reply.message.replace("1000", "").replace("2000", "").replace("3000", "")
    coord._minimum_needed_w = lambda: 2500.0 + 1e-9  # float noise above a budget equal to the need
    assert asyncio.run(coord.set_budget(2500.0)).ok


def test_a_budget_above_what_the_nodes_may_draw_is_taken_with_a_warning(tmp_path):
    """``budget set 40000`` for GPUs that draw 5,600 W at most was taken without a word (a typo;
    found by a try-out): it is taken (a budget may be raised ahead of new nodes) and says it limits
    nothing; within what they may draw, no warning."""
    import asyncio

    from coordinator import allocation, loop
    from tests.coordinator.conftest import write_policy

    path = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=3000.0)
    coord = loop.Coordinator(load_policy(str(path)), str(path))
    coord._minimum_needed_w = lambda: 800.0
    real = allocation.maximum_draw_w
    try:
        allocation.maximum_draw_w = lambda inputs: 5600.0
        r = asyncio.run(coord.set_budget(40000.0))
        assert r.ok and "WARNING: 40000 W is more than the 5600 W the policy's nodes may draw" in r.message, r.message
        r = asyncio.run(coord.set_budget(5000.0))
        assert r.ok and "limits nothing" not in r.message, r.message
        allocation.maximum_draw_w = lambda inputs: 0.0  # no GPU known yet: nothing to say
        assert "limits nothing" not in asyncio.run(coord.set_budget(40000.0)).message
    finally:
        allocation.maximum_draw_w = real
