"""A stalled NVML call on real agents (simulated driver fault ``nvml_stall``): the node stops
reporting while it lasts, the coordinator holds it (stale, counted at its caps), the sum of the
enforced limits stays within the budget at every instant (journal), and the node comes back."""

from __future__ import annotations

import time

import pytest

from tests.conftest import require
from tests.coordinator.conftest import wait_for

pytestmark = pytest.mark.integration


def test_stalled_nvml_call_holds_the_node_within_the_budget_and_it_recovers(tmp_path):
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient

    budget = 1800.0
    with Cluster(tmp_path, {"n1": 2, "n2": 2}, budget_w=budget, interval_s=0.5, lease_s=2.0) as cl:
        for sim in cl.sims.values():
            for i in range(2):
                sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 2 and all(not n.stale for n in c.status().nodes), 20, "agents")
            assert cl.agent("n1").client().job_start("J", ["0", "1"]).ok
            assert cl.agent("n2").client().job_start("K", ["0", "1"]).ok
            wait_for(lambda: all(sim.read(i)["limit_w"] < 600 for sim in cl.sims.values() for i in range(2)), 20,
                     "caps applied")
            since_ns = time.monotonic_ns()
            cl.sims["n1"].inject(1, "nvml_stall", 1.0)
            wait_for(lambda: next(n for n in c.status().nodes if n.name == "n1").stale, 20, "n1 stale while stalled")
            held = [cl.sims["n1"].read(i)["limit_w"] for i in range(2)]
            time.sleep(1.0)
            assert [cl.sims["n1"].read(i)["limit_w"] for i in range(2)] == held  # held, nothing raised
            assert not next(n for n in c.status().nodes if n.name == "n2").stale  # the other node works
            cl.sims["n1"].clear(1, "nvml_stall")
            wait_for(lambda: not next(n for n in c.status().nodes if n.name == "n1").stale, 30, "n1 back")
            check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget + 1e-6, None, since_ns, None)
            assert check.ok, check.describe()
