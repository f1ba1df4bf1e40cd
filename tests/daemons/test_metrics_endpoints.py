"""The operational metrics of both daemons, scraped over HTTP from real processes: build info, process
metrics, error counters, per-GPU cap state (one series per state), the agent's own endpoint, and a
finished job's series that stay exported after the job ends (so rate() sees its last increase)."""

from __future__ import annotations

import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from capctl import __version__
from capctl.capmetrics import CAP_STATES
from tests.support.processes import (ProcessGroup, require_coordinator, sim_node, start_agent, start_coordinator,
                                     wait_until, write_policy)

pytestmark = pytest.mark.integration


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def logged_port(proc, pattern: str) -> int:
    found = {}

    def port():
        m = re.search(pattern, proc.log_path.read_text())
        if m:
            found["port"] = int(m.group(1))
        return bool(m)

    wait_until(port, 20.0, 0.05, f"{proc.name} logging its metrics port", proc=proc)
    return found["port"]


def states_of(fams, node: str, gpu: str) -> dict[str, float]:
    return {s.labels["state"]: s.value for s in fams["capctl_gpu_cap_state"].samples
            if s.labels["node"] == node and s.labels["gpu"] == gpu}


def test_both_daemons_export_build_process_error_and_cap_state_metrics(tmp_path):
    require_coordinator()
    node = sim_node(tmp_path / "sim", 2)
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1400.0, gpus_per_node=2)
    with ProcessGroup() as group:
        coord = group.add(start_coordinator(tmp_path, policy, metrics_port=0))
        coord.wait_serving(30.0)
        agent = group.add(start_agent(tmp_path, "n1", coord.address, sim_env=node.env(), policy=policy,
                                      extra_args=["--metrics-listen", "127.0.0.1:0"]))
        agent.wait_ready(30.0, connected=True)
        coord_port = logged_port(coord, r"metrics 127\.0\.0\.1:(\d+)")
        agent_port = logged_port(agent, r"metrics on http://127\.0\.0\.1:(\d+)/metrics")
        agent.client().job_start("J1", ["0", "1"])
        wait_until(lambda: any(s.labels["job"] == "J1" for s in scrape(coord_port)["capctl_job_energy_joules"].samples),
                   20.0, 0.1, "J1 in the coordinator's metrics", proc=coord)
        for port in (coord_port, agent_port):
            fams = scrape(port)
            info = fams["capctl_build_info"].samples[0]
            assert info.labels["version"] == __version__ and info.value == 1.0
            assert fams["process_cpu_seconds"].samples[0].value > 0
            assert fams["process_resident_memory_bytes"].samples[0].value > 10e6
            wait_until(lambda p=port: states_of(scrape(p), "n1", "0").get("OK") == 1.0, 20.0, 0.1, "GPU 0 OK")
            states = states_of(scrape(port), "n1", "1")
            assert set(states) == set(CAP_STATES) and sum(states.values()) == 1.0 and states["OK"] == 1.0
        reloads = {s.labels["result"]: s.value for s in scrape(coord_port)["capctl_policy_reloads"].samples
                   if s.name.endswith("_total")}
        assert reloads == {"ok": 0.0, "error": 0.0}
        fams = scrape(agent_port)
        assert fams["capctl_agent_coordinator_connected"].samples[0].value == 1.0
        assert fams["capctl_agent_reconnects"].samples[0].value == 0.0
        assert fams["capctl_agent_nvml_stalls"].samples[0].value == 0.0  # no NVML call timed out
        caps = {s.labels["gpu"]: s.value for s in fams["capctl_gpu_enforced_cap_watts"].samples}
        assert set(caps) == {"0", "1"} and all(100.0 <= c <= 700.0 for c in caps.values())

        agent.client().job_end("J1")
        wait_until(lambda: not coord.status().jobs, 20.0, 0.1, "J1 gone from the coordinator's status", proc=coord)
        jobs = {s.labels["job"] for s in scrape(coord_port)["capctl_job_energy_joules"].samples}
        assert jobs == {"J1"}  # the finished job's series linger (JOB_SERIES_LINGER_S)
    node.close()


def test_job_series_linger_then_go():
    from coordinator.opsmetrics import JobLinger

    class Row:
        def __init__(self, job_id):
            self.job_id = job_id

    now = [0.0]
    linger = JobLinger(linger_s=300.0, clock=lambda: now[0])
    a, b = Row("A"), Row("B")
    assert [r.job_id for r in linger.rows([a, b])] == ["A", "B"]
    now[0] = 10.0
    assert [r.job_id for r in linger.rows([b])] == ["B", "A"]  # A ended: its last row stays
    now[0] = 309.0
    assert [r.job_id for r in linger.rows([b])] == ["B", "A"]
    now[0] = 311.0
    assert [r.job_id for r in linger.rows([b])] == ["B"]
    assert [r.job_id for r in linger.rows([])] == ["B"]  # B's linger starts now
