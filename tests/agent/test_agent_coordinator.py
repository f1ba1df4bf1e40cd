"""Real agents against the real coordinator (processes, unix sockets): registration, plans applied
and acknowledged (enforced caps within the budget), bindings reported and forwarded."""

from __future__ import annotations

import pytest

from tests.support.processes import Cluster, wait_until

pytestmark = pytest.mark.integration


def test_agents_register_bind_and_apply_plans(tmp_path):
    with Cluster(tmp_path, {"n1": 2, "n2": 2}, budget_w=1400.0, interval_s=0.3, lease_s=3.0) as cl:
        # (the policy's nodes are listed from the start, never_reported until their agent says hello)
        st = wait_until(lambda: (s := cl.coordinator.status()) and len(s.nodes) == 2
                        and not any(n.never_reported for n in s.nodes) and s, 10,
                        what="both nodes' agents in the coordinator's status")
        assert sorted(n.name for n in st.nodes) == ["n1", "n2"]
        assert all(len(n.gpus) == 2 and not n.stale for n in st.nodes)
        for name in ("n1", "n2"):
            with cl.agent(name).client() as c:
                r = c.job_start("4242", ["0", "1"], user="carol")
                assert r.ok and r.coordinator_connected
            for i in range(2):
                cl.sims[name].set_load(i, 700.0, 100.0)

        def job_seen():
            s = cl.coordinator.status()
            jobs = {j.job_id: j for j in s.jobs}
            return jobs.get("4242")

        job = wait_until(lambda: (j := job_seen()) is not None and len(j.nodes) == 2 and j, 15,
                         what="job 4242 on both nodes at the coordinator")
        assert sorted(job.nodes) == ["n1", "n2"] and job.gpus == 4

        # the coordinator's plans reach the devices: caps move off the start cap and stay in budget
        def settled():
            caps = [cl.sims[n].read(i)["enforced_w"] for n in ("n1", "n2") for i in range(2)]
            return caps if abs(sum(caps) - 1400.0) <= 1400.0 * 0.05 and sum(caps) <= 1400.0 + 1e-6 else None

        caps = wait_until(settled, 20, what="caps using the budget")
        assert all(200.0 <= c <= 700.0 for c in caps)
        # the coordinator's view follows the devices (telemetry and acks carry the enforced read-back)
        def view_matches():
            s = cl.coordinator.status()
            g = {(n.name, x.index): x for n in s.nodes for x in n.gpus}
            return all(abs(g[(n, i)].enforced_w - cl.sims[n].read(i)["enforced_w"]) < 1.0
                       for n in ("n1", "n2") for i in range(2)) and g[("n1", 0)].job_id == "4242"

        wait_until(view_matches, 10, what="coordinator view = device enforced limits")

        # JobEnd on one node: forwarded; the job then spans only n2
        with cl.agent("n1").client() as c:
            assert c.job_end("4242").ok
        wait_until(lambda: (j := job_seen()) is not None and list(j.nodes) == ["n2"], 10,
                   what="job 4242 only on n2")
