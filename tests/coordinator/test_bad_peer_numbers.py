"""Bad numbers and states from an agent, over a real AgentLink stream (issue 12, item 5; found by
a review of the packed readings): the coordinator keeps running on its last good state.

* a report naming one GPU twice is refused, and refused reports are logged once a minute per
  stream with a count (they were dropped without a line: the node just looked stale);
* a GPU in a cap state the protocol does not define (a newer agent's value 200) does not break
  ``capctl status`` (every status, explain and metrics read raised) and shows as ``UNKNOWN_200``;
* limits no board enforces (an infinite request, 4,294,967 W enforced) are not taken as a
  reading: the GPU counts at its last known limits, every other GPU is still allocated, the
  GPU's error says why, and no cap outside the devices' limit constraints is ever planned;
* an infinite energy counter is not charged to the job.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

from capctl import lifeline
from tests.coordinator.conftest import REPO, wait_for, write_policy

AGENT = r"""
import json, sys, time
import grpc
from capctl.v1 import capctl_pb2 as pb, capctl_pb2_grpc

node, address, mode = sys.argv[1], sys.argv[2], sys.argv[3]
gpus = [pb.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H100 80GB HBM3", min_cap_w=200, max_cap_w=700,
                   default_cap_w=700, slowdown_temp_c=89, shutdown_temp_c=92, max_sm_clock_mhz=1980) for i in range(4)]

def gpu(i, seq, **kw):
    f = dict(index=i, power_w=500, cap_w=600, enforced_w=600, temp_c=60, sm_clock_mhz=1800, utilization_pct=100,
             clocks_event_reasons=["SW_POWER_CAP"], job_id="job-" + node, cap_state=1, energy_j=1000.0 * seq)
    f.update(kw)
    return pb.GpuTelemetry(**f)

def requests():
    yield pb.AgentMessage(hello=pb.AgentHello(protocol_version="capctl.v1", node=node, gpus=gpus, jobs=[
        pb.JobBinding(job_id="job-" + node, node=node, gpu_indices=[0, 1, 2, 3])]))
    for seq in range(1, 400):
        rows = [gpu(i, seq) for i in range(4)]
        if mode == "twice":
            rows.append(gpu(0, seq, energy_j=7e6 * seq))
        elif mode == "bad" and seq > 3:  # three good reports first: then GPU 0 bad, GPU 1 unknown state
            rows[0] = gpu(0, seq, cap_w=float("inf"), enforced_w=4294967.295, cap_state=7, energy_j=float("inf"))
            rows[1] = gpu(1, seq, cap_state=200)
        yield pb.AgentMessage(telemetry=pb.NodeTelemetry(node=node, seq=seq, gpus=rows))
        time.sleep(0.1)

channel = grpc.insecure_channel(address)
for msg in capctl_pb2_grpc.AgentLinkStub(channel).Connect(requests()):
    if msg.WhichOneof("body") == "plan":
        p = msg.plan
        caps = [(c.index, c.cap_w) for c in p.caps]
        print(json.dumps({"caps": caps, "safe": [(c.index, c.cap_w) for c in p.safe_caps]}), flush=True)
"""


def _gpus(status, node: str) -> dict:
    """GPU index -> ``GpuStatus`` of ``node`` in a ``StatusReply`` (empty when not shown)."""
    return {g.index: g for n in status.nodes if n.name == node for g in n.gpus}


def _agent(node: str, address: str, mode: str):
    return lifeline.Popen([sys.executable, "-c", AGENT, node, address, mode], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)


def test_bad_numbers_and_states_from_an_agent_leave_the_coordinator_running(tmp_path, start_coordinator):
    nodes = ["n1", "n2", "n3"]
    policy = write_policy(tmp_path / "policy.yaml", nodes=nodes, budget_w=3 * 4 * 500.0, interval_s=0.25)
    coord = start_coordinator(policy)
    procs = [_agent("n1", coord.address, "twice"), _agent("n2", coord.address, "bad"),
             _agent("n3", coord.address, "good")]
    try:
        client = coord.client()

        def seen():
            n2 = _gpus(client.status(), "n2")
            return 1 in n2 and n2[1].cap_state_name == "UNKNOWN_200"

        wait_for(seen, 20, "n2's GPU 1 shown in cap state UNKNOWN_200")
        time.sleep(1.5)  # a few more intervals with the bad data
        st = client.status()
        n2 = _gpus(st, "n2")
        # GPU 0: its limits are no reading: counted at the last good one (600 W), the error says why
        assert "enforced limit 4294967.295 W" in n2[0].detail and "not taken as a reading" in n2[0].detail, n2[0]
        assert n2[0].enforced_w == 600.0
        # n1's reports were all refused: no reading (shown as such); every other GPU has finite
        # limits within its constraints; the jobs' energy is finite
        assert {g.cap_state_name for g in st.nodes[0].gpus} == {"NO_READING"}
        for node in st.nodes[1:]:
            for g in node.gpus:
                assert math.isfinite(g.enforced_w) and 200.0 <= g.enforced_w <= 700.0, (node.name, g)
        for job in st.jobs:
            assert math.isfinite(job.energy_j), job
        log = coord.log()
        refused = [ln for ln in log.splitlines() if "NodeTelemetry refused" in ln]
        assert refused and all("agent n1" in ln and "GPU index 0 twice" in ln for ln in refused), refused
        assert len(refused) == 1, refused  # once a minute per stream, not once per report
        assert "Traceback" not in log and "capctl bug" not in log, log[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait(5)
    # every cap planned to n2 and n3 within the devices' constraints (never inf, never 0 W)
    for p in procs[1:]:
        out = p.stdout.read()
        p.stdout.close()
        plans = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
        assert plans, "the agent got plans"
        for plan in plans:
            for _i, cap in plan["caps"] + plan["safe"]:
                assert 200.0 <= cap <= 700.0, plan
    procs[0].stdout.close()
    assert coord.stop() == 0
