"""Device data the built-in tables do not know, on real agents (one node, one cluster start):

* a GPU that matches no built-in model, a 200-1,000 W "NVIDIA B200" from a simulator device profile:
  the agent reports it, the coordinator caps it from its own limit constraints (never outside them,
  never 0 W: the journal holds every enforced limit), status and explain show ``curve: generic``,
  then ``learned`` once its samples span enough distinct caps (coordinator/models.py:
  FULL_FIT_MIN_CAPS caps over FULL_FIT_MIN_SPAN_W);
* a GPU whose limit constraints are outside any board (a 1,000,000 W maximum, above the hello's
  100 kW bound): held at its limit and flagged UNSUPPORTED_CONSTRAINTS, counted at its limit, never
  written; the node's hello is accepted and its other GPUs are controlled.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import require
from tests.coordinator.conftest import wait_for

pytestmark = pytest.mark.integration


def _gpus(client, node: str) -> list:
    """The GpuStatus of ``node`` ([] before its hello)."""
    return next((list(n.gpus) for n in client.status().nodes if n.name == node), [])


def test_unknown_model_generic_then_learned_and_constraints_beyond_any_board(tmp_path):
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from capctl import capstates
    from capctl.simgpu import profiles
    from capctl.simgpu.journal import read_journal
    from coordinator.client import AdminClient

    b200 = profiles.parse_option("name=B200,min_limit_w=200,max_limit_w=1000,default_limit_w=1000,"
                                 "idle_w=120,max_sm_clock_mhz=1965,architecture=blackwell")
    assert profiles.builtin_index(b200) == -1

    def garbage(sims):  # what the agent reads for GPU 2 when it opens the GPUs
        sims["b1"].inject(2, "bad_constraints", 200.0, max_w=1e6)

    with Cluster(tmp_path, {"b1": 3}, budget_w=2500.0, interval_s=0.25, lease_s=2.0, before_agents=garbage,
                 sim_kwargs={"b1": {"profile": b200, "thermal_resistance_c_per_w": 0.03}}) as cl:
        sim = cl.sims["b1"]
        for i in range(3):
            sim.set_load(i, 950.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(_gpus(c, "b1")) == 3, 20, "the node's hello accepted")
            gpus = _gpus(c, "b1")
            assert [(g.min_cap_w, g.max_cap_w) for g in gpus] == [(200.0, 1000.0)] * 2 + [(200.0, 1e6)]
            assert cl.agent("b1").client().job_start("J", ["0", "1"]).ok
            wait_for(lambda: any(j.job_id == "J" for j in c.status().jobs)
                     and all(g.curve == "generic" and g.enforced_w < 800 for g in _gpus(c, "b1")[:2]), 20,
                     "the job capped on a generic curve")
            assert [g.curve for g in c.explain("J").gpus] == ["generic", "generic"]
            held = _gpus(c, "b1")[2]
            assert capstates.of(held) == capstates.UNSUPPORTED_CONSTRAINTS and "max 1e+06 W" in held.detail
            assert held.enforced_w == pytest.approx(1000.0) and "capctl bug" not in held.detail
            t0 = time.monotonic()
            # the budget (GPU 2 holds 1,000 W of it) in three steps 150 W apart per GPU: the curve
            # sees distinct caps over more than 50 W
            for budget in (2100.0, 2400.0, 2700.0):
                c.set_budget(budget)
                wait_for(lambda b=budget: abs(sum(g.enforced_w for g in _gpus(c, "b1")) - b) < 30
                         or all(g.curve == "learned" for g in _gpus(c, "b1")[:2]), 20, f"caps at {budget} W")
            wait_for(lambda: all(g.curve == "learned" for g in _gpus(c, "b1")[:2]), 30, "learned")
            learned_s = time.monotonic() - t0
            assert [g.curve for g in c.explain("J").gpus] == ["learned", "learned"]
            assert c.status().enforced_w <= 2700.0 + 1e-6  # GPU 2 counted at its limit, not at 1 MW
            print(f"generic -> learned in {learned_s:.1f} s at a 0.25 s interval")
        journal = read_journal(sim.journal_path)
        assert sim.read(2)["set_count"] == 0  # the held GPU was never written
    rec = journal.records[journal.records["gpu"] < 2]  # every enforced limit GPUs 0-1 ever had
    assert len(rec) and rec["enforced_w"].min() >= 200.0 and rec["enforced_w"].max() <= 1000.0  # never 0 W
    assert len({round(float(v)) for v in rec["enforced_w"]}) >= 3  # the coordinator really moved them
