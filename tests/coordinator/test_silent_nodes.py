"""A node of the policy whose agent is dead is never free budget (real coordinator and agents on
simulated nodes; the budget checked on the simulated driver's journal of enforced limits)."""

from __future__ import annotations

import time

import pytest

from tests.coordinator.conftest import wait_for

pytestmark = pytest.mark.integration


def test_a_dead_agents_node_is_counted_by_a_coordinator_that_lost_its_state(tmp_path):
    """n2's agent is killed with -9 while its job runs: its GPUs keep the caps it last set (no
    agent, no lease, no failsafe). The coordinator is then restarted on a fresh state directory
    (no node ledger): n2 is a policy node it knows nothing of. Before, once its startup hold ended
    it counted n2 as free and raised n1's job into those watts (a try-out: 3,942 W on a 3,600 W
    budget, for as long as n2's agent stayed down). Now n2 is counted at the most it may draw (4
    declared H100s x 700 W) and the sum of enforced limits stays within the budget at every
    instant."""
    from capctl.demo.processes import start_coordinator
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient
    from tests.support.processes import Cluster

    budget_w = 4000.0
    with Cluster(tmp_path, {"n1": 4, "n2": 4}, budget_w=budget_w, interval_s=0.5, lease_s=3.0) as cl:
        for name in ("n1", "n2"):
            for i in range(4):
                cl.sims[name].set_load(i, 650.0)
        assert cl.agent("n2").client().job_start("J2", ["0", "1", "2", "3"]).ok
        wait_for(lambda: sum(cl.sims["n2"].read(i)["limit_w"] for i in range(4)) > 1500.0, 20, "n2's job capped")
        cl.agent("n2").kill()
        n2_w = sum(cl.sims["n2"].read(i)["limit_w"] for i in range(4))
        address = cl.coordinator.address
        cl.coordinator.stop()
        since_ns = time.monotonic_ns()
        fresh = cl.group.add(start_coordinator(tmp_path / "fresh", cl.policy_path, listen=address))
        fresh.wait_serving(30.0)
        assert cl.agent("n1").client().job_start("J1", ["0", "1", "2", "3"]).ok
        with AdminClient(fresh.admin_address) as c:
            def counted():
                st = c.status()
                return any("(n2): each counted at 2800 W" in a for a in st.alerts) and len(st.nodes) == 2
            wait_for(counted, 20, "n2 counted at the most it may draw")
            time.sleep(3.0 + 2.0)  # past the startup hold (one lease): n1's job is planned around n2
            n1_w = sum(cl.sims["n1"].read(i)["limit_w"] for i in range(4))
            assert n1_w <= budget_w - 2800.0 + 1e-3
        assert sum(cl.sims["n2"].read(i)["limit_w"] for i in range(4)) == pytest.approx(n2_w)  # nobody touched it
        check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget_w + 1e-6, None, since_ns, None)
        assert check.ok, check.describe()
