"""Limit constraints outside any board (a 1,000,000 W maximum, above the hello's 100 kW bound) on a
real agent: that GPU is held at its limit and flagged UNSUPPORTED_CONSTRAINTS, the node's hello is
accepted and its other GPU is capped; the held GPU counts at its limit, not at the garbage maximum."""

from __future__ import annotations

import pytest

from tests.conftest import require
from tests.coordinator.conftest import wait_for

pytestmark = pytest.mark.integration


def test_constraints_beyond_any_board_hold_one_gpu_not_the_node(tmp_path):
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from capctl import capstates
    from coordinator.client import AdminClient

    def garbage(sims):  # what the agent reads when it opens the GPUs
        sims["n1"].inject(1, "bad_constraints", 200.0, max_w=1e6)

    budget = 1000.0
    with Cluster(tmp_path, {"n1": 2}, budget_w=budget, interval_s=0.25, lease_s=2.0, before_agents=garbage) as cl:
        sim = cl.sims["n1"]
        for i in range(2):
            sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 1 and not c.status().nodes[0].stale, 20, "n1 accepted")
            assert cl.agent("n1").client().job_start("J", ["0", "1"]).ok

            def settled():
                g = {x.index: x for x in c.status().nodes[0].gpus}
                return capstates.of(g[1]) == capstates.UNSUPPORTED_CONSTRAINTS and sim.read(0)["limit_w"] < 350
            wait_for(settled, 20, "GPU 1 held and flagged, GPU 0 capped")
            st = c.status()
            g = {x.index: x for x in st.nodes[0].gpus}
            assert "max 1e+06 W" in g[1].detail and "capctl bug" not in g[1].detail
            assert g[1].enforced_w == pytest.approx(700.0)  # counted at its limit
            assert st.enforced_w <= budget + 1e-6
            assert sim.read(1)["set_count"] == 0  # never written
