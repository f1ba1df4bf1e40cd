"""A node of the policy whose agent is dead is never free budget (real coordinator and agents on
simulated nodes; the budget checked on the simulated driver's journal of enforced limits)."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from tests.coordinator.conftest import wait_for

pytestmark = pytest.mark.integration


def _busy(cl) -> None:
    """Every GPU of ``cl``'s nodes n1 and n2 at a 650 W demand."""
    for name in ("n1", "n2"):
        for i in range(4):
            cl.sims[name].set_load(i, 650.0)


@pytest.fixture
def cleanup():
    """Directories to remove at the end of the test."""
    dirs: list = []
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def test_a_dead_agents_node_is_counted_by_a_coordinator_that_lost_its_state(tmp_path, cleanup):
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
        _busy(cl)
        assert cl.agent("n2").client().job_start("J2", ["0", "1", "2", "3"]).ok
        wait_for(lambda: sum(cl.sims["n2"].read(i)["limit_w"] for i in range(4)) > 1500.0, 20, "n2's job capped")
        cl.agent("n2").kill()
        n2_w = sum(cl.sims["n2"].read(i)["limit_w"] for i in range(4))
        address = cl.coordinator.address
        cl.coordinator.stop()
        since_ns = time.monotonic_ns()
        # (a short directory: under pytest's and xdist's the admin socket's path passed 100 bytes)
        fresh_dir = Path(tempfile.mkdtemp(prefix="capctl-fresh-"))
        cleanup.append(fresh_dir)
        fresh = cl.group.add(start_coordinator(fresh_dir, cl.policy_path, listen=address))
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


def test_a_second_agent_under_a_node_name_in_use_is_refused_and_the_budget_holds(tmp_path):
    """A second agent started as n2 on n1's GPUs (a copied ``--node``) while n2's own agent
    reports: before, each hello replaced the other's stream, the impostor applied n2's plans to
    n1's GPUs (counted under n1 at their old caps) and the journal showed 4,641 W on a 4,000 W
    budget for 2 s (found by a try-out). Now the newcomer is refused, says why, and n2 stays
    served by its own agent; the sum of enforced limits stays within the budget at every instant."""
    from capctl.demo.processes import start_agent
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient
    from tests.support.processes import Cluster

    budget_w = 4000.0
    with Cluster(tmp_path, {"n1": 4, "n2": 4}, budget_w=budget_w, interval_s=0.5, lease_s=3.0) as cl:
        _busy(cl)
        assert cl.agent("n1").client().job_start("J1", ["0", "1"]).ok
        assert cl.agent("n2").client().job_start("J2", ["0", "1", "2", "3"]).ok
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: c.status().allocated_w > 0.9 * budget_w, 20, "the budget in use")
            uuids = {g.uuid for n in c.status().nodes if n.name == "n2" for g in n.gpus}
            since_ns = time.monotonic_ns()
            impostor = cl.group.add(start_agent(tmp_path / "impostor", "n2", cl.coordinator.address,
                                                sim_env=cl.sims["n1"].env(), policy=cl.policy_path,
                                                reconnect_max_s=1.0))
            wait_for(lambda: "two agents on one node's GPUs" in impostor.log_tail(400), 20, "the impostor refused")
            time.sleep(3.0)  # it retries: refused each time
            st = c.status()
            n2 = next(n for n in st.nodes if n.name == "n2")
            assert not n2.stale and {g.uuid for g in n2.gpus} == uuids
            assert not [a for a in st.alerts if "stream was replaced" in a], list(st.alerts)  # no stream replaced
            # the refused agent's GPUs counted once more: at the most n2 may draw
            assert [a for a in st.alerts if a.startswith("two agents claim node n2:") and "2800 W more" in a], \
                list(st.alerts)
            assert "ALREADY_EXISTS" in impostor.log_tail(400) and "Traceback" not in impostor.log_tail(400)
            # n1's agent stopped past its lease: n1's GPUs are no reporting node's, and the impostor
            # is refused still by the name's rule (n2's own agent reports)
            cl.agent("n1").signal(signal.SIGSTOP)
            try:
                time.sleep(3.0 + 1.0)
                assert "two agents claim one node name" in impostor.log_tail(400)
                assert not next(n for n in c.status().nodes if n.name == "n2").stale
            finally:
                cl.agent("n1").signal(signal.SIGCONT)
        impostor.stop()
        check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget_w + 1e-6, None, since_ns, None)
        assert check.ok, check.describe()


def test_an_agent_taking_a_dead_agents_node_name_leaves_its_gpus_counted(tmp_path):
    """n2's agent killed with -9 while its job runs (its GPUs keep their caps); another host's agent
    (n3's simulated GPUs) is started as n2, a copied --node. Before, its hello's records replaced
    n2's by index and n2's real GPUs left the books: 4,756 W on a 4,000 W budget for as long as it
    lasted (found by a try-out). n2's GPUs are now counted at their last caps until a hello lists
    them again, and the journal of the policy's own hardware stays within the budget."""
    from capctl.demo.processes import start_agent
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient
    from tests.support.processes import Cluster, sim_node

    budget_w = 4000.0
    with Cluster(tmp_path, {"n1": 4, "n2": 4}, budget_w=budget_w, interval_s=0.5, lease_s=3.0) as cl:
        _busy(cl)
        assert cl.agent("n1").client().job_start("J1", ["0", "1", "2", "3"]).ok
        assert cl.agent("n2").client().job_start("J2", ["0", "1", "2", "3"]).ok
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: c.status().allocated_w > 0.95 * budget_w, 20, "the budget in use")
            cl.agent("n2").kill()
            since_ns = time.monotonic_ns()
            n3 = sim_node(tmp_path / "sim-n3", 4, seed=300)
            other = cl.group.add(start_agent(tmp_path / "other", "n2", cl.coordinator.address, sim_env=n3.env(),
                                             policy=cl.policy_path, reconnect_max_s=1.0))
            wait_for(lambda: any(a.startswith("node n2: 4 GPU(s) its agent no longer lists") for a in c.status().alerts),
                     20, "n2's real GPUs still counted")
            time.sleep(4.0)  # intervals with the other agent as n2
        other.stop()
        close = getattr(n3, "close", None)
        if close:
            close()
        check = check_nodes({n: s.path for n, s in cl.sims.items()}, budget_w + 1e-6, None, since_ns, None)
        assert check.ok, check.describe()
