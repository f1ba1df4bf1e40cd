"""A GPU that matches no built-in model, on real agents: a 200-1,000 W "NVIDIA B200" from a device
profile (capctl-simgpu's custom profiles). The agent reports it, the coordinator caps it from its own
limit constraints (never outside them, never 0 W: the journal holds every enforced limit), status and
explain show ``curve: generic``, and ``learned`` once its samples span enough distinct caps
(coordinator/models.py: FULL_FIT_MIN_CAPS caps over FULL_FIT_MIN_SPAN_W)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import require
from tests.coordinator.conftest import wait_for

pytestmark = pytest.mark.integration


def _gpus(client, node: str) -> list:
    """The GpuStatus of ``node`` ([] before its hello)."""
    return next((list(n.gpus) for n in client.status().nodes if n.name == node), [])


def test_unknown_model_is_capped_from_its_constraints_generic_then_learned(tmp_path):
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from capctl.simgpu import profiles
    from capctl.simgpu.journal import read_journal
    from coordinator.client import AdminClient

    b200 = profiles.parse_option("name=B200,min_limit_w=200,max_limit_w=1000,default_limit_w=1000,"
                                 "idle_w=120,max_sm_clock_mhz=1965,architecture=blackwell")
    assert profiles.builtin_index(b200) == -1
    with Cluster(tmp_path, {"b1": 2}, budget_w=1500.0, interval_s=0.25, lease_s=2.0,
                 sim_kwargs={"b1": {"profile": b200, "thermal_resistance_c_per_w": 0.03}}) as cl:
        sim = cl.sims["b1"]
        for i in range(2):
            sim.set_load(i, 950.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(_gpus(c, "b1")) == 2, 20, "agent's hello")
            gpus = _gpus(c, "b1")
            assert [(g.min_cap_w, g.max_cap_w) for g in gpus] == [(200.0, 1000.0)] * 2  # its own constraints
            assert cl.agent("b1").client().job_start("J", ["0", "1"]).ok
            wait_for(lambda: any(j.job_id == "J" for j in c.status().jobs)
                     and all(g.curve == "generic" and g.enforced_w < 800 for g in _gpus(c, "b1")), 20,
                     "the job capped on a generic curve")
            assert all(g.curve == "generic" for g in c.explain("J").gpus)
            t0 = time.monotonic()
            # three budgets 150 W apart per GPU: the curve sees distinct caps over more than 50 W
            for budget in (1100.0, 1400.0, 1700.0):
                c.set_budget(budget)
                wait_for(lambda b=budget: abs(sum(g.enforced_w for g in _gpus(c, "b1")) - b) < 30
                         or all(g.curve == "learned" for g in _gpus(c, "b1")), 20, f"caps at {budget} W")
            wait_for(lambda: all(g.curve == "learned" for g in _gpus(c, "b1")), 30, "learned")
            learned_s = time.monotonic() - t0
            assert all(g.curve == "learned" for g in c.explain("J").gpus)
            print(f"generic -> learned in {learned_s:.1f} s at a 0.25 s interval")
        journal = read_journal(sim.journal_path)
    values = journal.records["enforced_w"]  # every enforced limit the GPUs ever had, from creation on
    assert len(values) and values.min() >= 200.0 and values.max() <= 1000.0  # never outside, never 0 W
    assert len({round(float(v)) for v in values}) >= 3  # the coordinator really moved them
