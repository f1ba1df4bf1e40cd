"""A foreign writer on one GPU, on real agents (``capctl-agent`` on the simulated driver, real
pynvml, real gRPC): the agent re-writes the GPU down to capctl's cap at most once per its re-write
period (``--rewrite-interval-s``) and the other writer puts it back at 700 W within its own period.
The coordinator counts the GPU at the foreign writer's 700 W throughout (its foreign-writer mark,
coordinator.registry.GpuObs.foreign_w), so the watts of each re-write are never given to other
GPUs: the sum of the enforced limits stays within the budget at every instant (the driver's
journal) across several re-write cycles. Before, every re-write freed ~400 W that went to the other
GPUs and the foreign writer's next write put the cluster over its budget (a try-out: 5,202.7 W on
4,800 W for 1.06 s, every 30 s)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import require
from tests.coordinator.conftest import wait_for

pytestmark = pytest.mark.integration

BUDGET_W = 2800.0
"""8 GPUs at 650 W of demand: every watt of the budget is wanted (350 W a GPU on average)."""
REWRITE_S = 4.0
"""The agents' re-write period under a foreign writer (``--rewrite-interval-s``; 30 s by default)."""
FOREIGN_PERIOD_S = 2.0
"""The foreign writer sets 700 W now and every this many seconds (the try-out's period)."""
WINDOW_S = 11.0
"""Journal window: at least two of the agent's re-write cycles (each 4 to ~4.5 s)."""


def _rewrites(sim, index: int, since_ns: int, until_ns: int) -> list[float]:
    """The agent's re-writes of GPU ``index`` in the window: its enforced limit brought down from
    the foreign writer's 700 W (W, as the journal holds them)."""
    from capctl.simgpu.journal import read_journal

    recs = [r for r in read_journal(sim.path).records if int(r["gpu"]) == index]
    out, prev = [], None
    for r in recs:
        w = float(r["enforced_w"])
        if since_ns <= int(r["t_ns"]) <= until_ns and prev is not None and prev >= 699.0 and w < 650.0:
            out.append(w)
        prev = w
    return out


@pytest.mark.timeout(120)
def test_a_foreign_writers_gpu_counts_at_its_limit_across_the_agents_rewrites(tmp_path):
    try:
        from tests.support.processes import Cluster
    except ImportError as exc:
        require(False, f"tests.support.processes unavailable: {exc}")
    from capctl import capstates
    from capctl.simgpu.journal import check_nodes
    from coordinator.client import AdminClient

    with Cluster(tmp_path, {"n1": 4, "n2": 4}, budget_w=BUDGET_W, interval_s=0.5, lease_s=3.0,
                 agent_args=["--rewrite-interval-s", f"{REWRITE_S:g}"]) as cl:
        for sim in cl.sims.values():
            for i in range(sim.gpu_count):
                sim.set_load(i, 650.0)
        with AdminClient(cl.coordinator.admin_address) as c:
            wait_for(lambda: len(c.status().nodes) == 2 and not any(n.stale for n in c.status().nodes), 20, "agents")
            for n in ("n1", "n2"):
                assert cl.agent(n).client().job_start(f"J{n}", ["0", "1", "2", "3"]).ok
            wait_for(lambda: all(sim.read(i)["limit_w"] < 600 for sim in cl.sims.values() for i in range(4)),
                     20, "every GPU capped")
            n1 = cl.sims["n1"]
            n1.inject(0, "foreign_writer", 700.0, period_s=FOREIGN_PERIOD_S)

            def foreign():
                g = next(n for n in c.status().nodes if n.name == "n1").gpus
                return capstates.of(next(x for x in g if x.index == 0)) == capstates.FOREIGN_WRITER
            wait_for(foreign, 20, "n1 GPU 0 FOREIGN_WRITER")
            time.sleep(2.0)  # the coordinator has cut the others for the foreign writer's first writes
            since_ns = time.monotonic_ns()
            time.sleep(WINDOW_S)
            until_ns = time.monotonic_ns()
            rewrites = _rewrites(n1, 0, since_ns, until_ns)
            assert len(rewrites) >= 2 and all(200.0 <= w < 600.0 for w in rewrites), rewrites  # cycles happened
            assert foreign()  # the foreign writer is still there
            paths = {n: s.path for n, s in cl.sims.items()}
            check = check_nodes(paths, BUDGET_W + 1e-6, None, since_ns, until_ns)
            assert check.ok, check.describe()
            assert check.max_sum_w > BUDGET_W - 60.0  # the budget was in use (not trivially within)
