"""capctl-agent as a real process on a simulated node, against an in-test AgentLink server.

Covers: hello contents (GPUs read from NVML, bindings, last plan seq), telemetry, plans applied and
acknowledged with the enforced read-back, lease expiry -> min(current, safe cap), reconnect with a
fresh hello, boot safe cap before ready, bindings kept across agent restarts, clean SIGTERM.
"""

from __future__ import annotations

import signal
import time

import pytest

from capctl.capstates import of as cap_state_of
from tests.agent.fakecoord import FakeCoordinator
from tests.support.processes import sim_node, start_agent, wait_until, write_policy

pytestmark = pytest.mark.integration


@pytest.fixture
def rig(tmp_path):
    """A 4-GPU simulated node, a fake coordinator, and a function starting the agent."""
    node = sim_node(tmp_path / "sim", 4, seed=3)
    fc = FakeCoordinator(f"unix:{tmp_path}/fc.sock", interval_s=0.2, lease_s=30.0).start()
    started = []

    def agent(policy=None, interval_s=0.2, address=None):
        a = start_agent(tmp_path, "n1", address or fc.address, sim_env=node.env(), policy=policy,
                        interval_s=interval_s, reconnect_max_s=0.5)
        started.append(a)
        return a

    yield node, fc, agent
    for a in started:
        a.stop()
    fc.stop()
    node.close()


def test_packed_readings_only_to_a_coordinator_that_asks(tmp_path):
    """Welcomed with ``packed_readings``, the agent sends its GPUs' readings as one GpuReadings in
    its telemetry and acks (capctl.readings), decoding to the devices' values; welcomed without it
    (the rig's coordinator above, an older one), as GpuTelemetry messages. It reads packed plan
    caps (capctl.plancaps) and says so in its hello."""
    from capctl import plancaps, readings
    from capctl.security import limits

    node = sim_node(tmp_path / "sim", 4, seed=5)
    fc = FakeCoordinator(f"unix:{tmp_path}/fc.sock", interval_s=0.2, lease_s=30.0, packed_readings=True).start()
    a = start_agent(tmp_path, "n1", fc.address, sim_env=node.env(), interval_s=0.2, reconnect_max_s=0.5)
    try:
        a.wait_ready(20, connected=True)
        wait_until(lambda: len(fc.telemetry) >= 2, 5, what="two telemetry messages")
        t = fc.telemetry[-1]
        assert len(t.gpus) == 0 and t.HasField("readings")
        rows, problem = limits.telemetry_rows(t, "n1")
        assert problem == "" and [r[readings.R_INDEX] for r in rows] == [0, 1, 2, 3]
        assert rows[1][readings.R_ENFORCED] == node.read(1)["enforced_w"]
        assert rows[2][readings.R_TEMP] > 0 and rows[2][readings.R_STATE] == "OK"
        seq = fc.push_plan("n1", {0: 420.0, 2: 333.5})
        ack = wait_until(lambda: fc.ack_for(seq), 5, what="ack")
        rows, problem = limits.ack_rows(ack)
        assert ack.ok and problem == "" and len(ack.gpus) == 0
        assert {r[readings.R_INDEX]: r[readings.R_ENFORCED] for r in rows} == {0: 420.0, 2: 333.5}
        # packed plans (capctl.plancaps): the agent says it reads them, applies them, and refuses
        # undecodable rows whole (an ack saying why, no cap changed)
        assert fc.hellos[0].packed_plans
        seq = fc.push_plan("n1", {}, caps_rows=plancaps.pack({1: 310.0, 3: 280.0}), safe_caps={1: 250.0})
        ack = wait_until(lambda: fc.ack_for(seq), 5, what="packed plan ack")
        assert ack.ok and {r[readings.R_INDEX] for r in limits.ack_rows(ack)[0]} == {1, 3}
        assert node.read(1)["limit_w"] == 310.0 and node.read(3)["limit_w"] == 280.0
        seq = fc.push_plan("n1", {}, caps_rows=plancaps.pack({1: 500.0})[:-3])
        ack = wait_until(lambda: fc.ack_for(seq), 5, what="bad packed plan ack")
        assert not ack.ok and "CapPlan.caps_rows: 9 bytes" in ack.error and node.read(1)["limit_w"] == 310.0
    finally:
        a.stop()
        fc.stop()
        node.close()


def test_hello_telemetry_plan_ack(rig):
    node, fc, agent = rig
    a = agent()
    a.wait_ready(20, connected=True)
    hello = wait_until(lambda: fc.hellos and fc.hellos[0], 5, what="hello")
    assert hello.protocol_version == "capctl.v1" and hello.node == "n1" and hello.simulated
    assert [g.index for g in hello.gpus] == [0, 1, 2, 3]
    g0 = node.read(0)
    assert hello.gpus[0].min_cap_w == g0["min_limit_w"] and hello.gpus[0].max_cap_w == g0["max_limit_w"]
    assert hello.gpus[0].slowdown_temp_c == g0["slowdown_temp_c"]
    assert len({g.uuid for g in hello.gpus}) == 4 and all(g.uuid.startswith("GPU-") for g in hello.gpus)
    wait_until(lambda: len(fc.telemetry) >= 2, 5, what="two telemetry messages")
    t = fc.telemetry[-1]
    assert t.node == "n1" and len(t.gpus) == 4 and t.gpus[1].enforced_w == node.read(1)["enforced_w"]
    assert not t.HasField("readings")  # a coordinator that did not ask for packed readings

    seq = fc.push_plan("n1", {0: 420.0, 1: 333.5, 3: 9999.0})  # 9999 W: clamped to the device maximum
    ack = wait_until(lambda: fc.ack_for(seq), 5, what="ack")
    assert ack.ok, ack.error
    got = {g.index: g for g in ack.gpus}
    assert got[0].enforced_w == 420.0 and got[1].enforced_w == 333.5 and got[3].cap_w == g0["max_limit_w"]
    assert cap_state_of(got[0]) == "OK"
    assert node.read(0)["enforced_w"] == 420.0 and node.read(1)["limit_w"] == 333.5
    # a plan naming a GPU the node does not have: refused in the ack, the others applied
    seq = fc.push_plan("n1", {0: 410.0, 7: 300.0})
    ack = wait_until(lambda: fc.ack_for(seq), 5, what="ack 2")
    assert not ack.ok and "GPU 7" in ack.error and node.read(0)["limit_w"] == 410.0
    # dry-run plans change nothing
    seq = fc.push_plan("n1", {0: 250.0}, dry_run=True)
    wait_until(lambda: fc.ack_for(seq), 5, what="dry-run ack")
    assert node.read(0)["limit_w"] == 410.0

    # SIGTERM: clean exit 0, caps left in place
    a.signal(signal.SIGTERM)
    assert a.popen.wait(10) == 0
    assert node.read(0)["limit_w"] == 410.0


def test_lease_expiry_moves_to_safe_caps_never_up(rig):
    node, fc, agent = rig
    a = agent()
    a.wait_ready(20, connected=True)
    with a.client() as c:
        c.job_start("7", ["0", "1", "2"])  # minor numbers
    seq = fc.push_plan("n1", {0: 500.0, 1: 260.0, 2: 450.0}, lease_s=1.0, phase="increase",  # raises: phase 2
                       safe_caps={0: 300.0, 1: 350.0, 2: 450.0})
    wait_until(lambda: fc.ack_for(seq), 5, what="ack")
    assert node.read(0)["limit_w"] == 500.0
    # no more plans: the lease runs out after 1 s
    wait_until(lambda: node.read(0)["limit_w"] == 300.0, 5, what="GPU 0 at its safe cap")
    time.sleep(0.5)
    assert node.read(1)["limit_w"] == 260.0  # safe cap 350 > last assignment 260: never raised
    assert node.read(2)["limit_w"] == 450.0  # already at the safe cap
    assert node.read(0)["limit_w"] != node.read(0)["default_limit_w"]
    st = a.status()
    states = {g.index: cap_state_of(g) for g in st.gpus}
    assert states[0] == "SAFE_CAP" and states[1] == "SAFE_CAP"
    assert states[3] == "OK"  # not managed: untouched
    assert node.read(3)["limit_w"] == node.read(3)["default_limit_w"]
    # the drift reconcile must not fight the safe cap
    time.sleep(0.6)
    assert node.read(0)["limit_w"] == 300.0
    # a new plan renews the lease and leaves the failsafe
    seq = fc.push_plan("n1", {0: 480.0}, lease_s=30.0, phase="increase")
    wait_until(lambda: fc.ack_for(seq), 5, what="ack after expiry")
    assert node.read(0)["limit_w"] == 480.0
    wait_until(lambda: {g.index: cap_state_of(g) for g in a.status().gpus}[0] == "OK", 5, what="state OK again")


def test_reconnect_resync_and_restart_keeps_bindings(rig, tmp_path):
    node, fc, agent = rig
    a = agent()
    a.wait_ready(20, connected=True)
    uuid2 = wait_until(lambda: fc.hellos and fc.hellos[0].gpus[2].uuid, 5, what="hello")
    with a.client() as c:
        r = c.job_start("100", [uuid2], 1, user="alice", partition="gpu", account="proj")  # GPU_ID_UUID
        assert r.ok and [g.index for g in r.gpus] == [2]
        r = c.job_start("101", ["0000:2a:00.0"], 2)  # GPU_ID_PCI_BUS_ID, short domain form -> GPU 1
        assert r.ok and [g.index for g in r.gpus] == [1]
    ev = wait_until(lambda: [e for e in fc.events if e.WhichOneof("body") == "job_started"], 5, what="JobStarted")
    assert ev[0].job_started.binding.job_id == "100" and list(ev[0].job_started.binding.gpu_indices) == [2]
    assert ev[0].job_started.binding.user == "alice"
    seq = fc.push_plan("n1", {2: 380.0}, phase="increase")  # above the start cap: a phase-2 raise
    wait_until(lambda: fc.ack_for(seq), 5, what="ack")

    # coordinator restart on the same address: the agent reconnects and resyncs with a new hello
    fc.stop()
    fc2 = FakeCoordinator(fc.address, interval_s=0.2).start()
    try:
        hello = wait_until(lambda: fc2.hellos and fc2.hellos[0], 10, what="hello to the new coordinator")
        assert {j.job_id: list(j.gpu_indices) for j in hello.jobs} == {"100": [2], "101": [1]}
        assert hello.last_plan_seq == seq
    finally:
        fc2.stop()

    # agent restart (SIGTERM, start again): bindings and caps kept, nothing reset
    a.stop()
    assert node.read(2)["limit_w"] == 380.0
    b = agent(address=f"unix:{tmp_path}/nobody.sock")  # coordinator unreachable this time
    st = b.wait_ready(20)
    assert not st.coordinator_connected
    assert {j.job_id: (list(j.gpu_indices), j.user) for j in st.jobs} == {"100": ([2], "alice"), "101": ([1], "")}
    assert node.read(2)["limit_w"] == 380.0
    with b.client() as c:
        r = c.job_end("100")
    assert r.ok and [(g.index, g.cap_w) for g in r.gpus] == [(2, node.read(2)["default_limit_w"])]


def test_boot_applies_safe_cap_before_ready(rig, tmp_path):
    node, fc, agent = rig
    node.set_param(1, "pre_job_limit_w", 500.0)  # a site limit below the default: left alone
    policy = write_policy(tmp_path / "p.yaml", nodes=["n1"], budget_w=2000, safe_cap_w=400.0, start_cap_w=450.0,
                          interval_s=0.5, lease_s=3.0)
    a = agent(policy=policy, address=f"unix:{tmp_path}/nobody.sock")
    st = a.wait_ready(20)
    assert st.ready
    limits = [node.read(i)["limit_w"] for i in range(4)]
    assert limits == [400.0, 500.0, 400.0, 400.0]  # GPU 1 was not at its default limit
    # no coordinator: a job's start cap is bounded by the safe cap
    with a.client() as c:
        r = c.job_start("9", ["3"])
    assert r.ok and not r.coordinator_connected and r.gpus[0].cap_w == 400.0


def test_other_major_protocol_version_refused(tmp_path):
    node = sim_node(tmp_path / "sim", 1)
    fc = FakeCoordinator(f"unix:{tmp_path}/v2.sock", protocol_version="capctl.v2").start()
    a = start_agent(tmp_path, "n1", fc.address, sim_env=node.env(), interval_s=0.2, reconnect_max_s=0.5)
    try:
        st = a.wait_ready(20)
        wait_until(lambda: len(fc.hellos) >= 2, 10, what="agent retrying")
        assert not a.status().coordinator_connected and not st.coordinator_connected
        log = a.log_path.read_text()
        assert "coordinator speaks 'capctl.v2'" in log and "Traceback" not in log
        assert fc.telemetry == []  # nothing sent on a refused stream
    finally:
        a.stop()
        fc.stop()
        node.close()


def test_agent_link_over_mtls(tmp_path):
    """--tls-ca/--tls-cert/--tls-key: the agent verifies the coordinator and presents its node certificate;
    a server from another CA is not trusted; partial TLS flags are a one-line error."""
    from capctl.security import tls
    from tests.support.certs import make_pki
    from tests.support.processes import free_port

    pki = make_pki(tmp_path)
    node = sim_node(tmp_path / "sim", 1)
    good = FakeCoordinator(f"127.0.0.1:{free_port()}").start(
        tls.server_credentials(tls.TlsConfig(pki.ca_path, pki.server.cert_path, pki.server.key_path)))
    bad = FakeCoordinator(f"127.0.0.1:{free_port()}").start(
        tls.server_credentials(tls.TlsConfig(pki.other_ca.cert_path, pki.wrong_ca_server.cert_path,
                                             pki.wrong_ca_server.key_path)))
    issued = pki.agent("n1")
    a = start_agent(tmp_path / "a", "n1", good.address, sim_env=node.env(), interval_s=0.2, reconnect_max_s=0.5,
                    extra_args=pki.tls_args(issued) + ["--tls-server-name", "localhost"])
    b = start_agent(tmp_path / "b", "n1", bad.address, sim_env=node.env(), interval_s=0.2, reconnect_max_s=0.5,
                    extra_args=pki.tls_args(issued) + ["--tls-server-name", "localhost"])
    try:
        a.wait_ready(20, connected=True)
        assert wait_until(lambda: good.hellos, 5, what="hello over mTLS")[0].node == "n1"
        b.wait_ready(20)
        time.sleep(1.5)
        assert not b.status().coordinator_connected and bad.hellos == []  # the other CA's server is not trusted
    finally:
        a.stop()
        b.stop()
        good.stop()
        bad.stop()
    from tests.agent.test_agent_flags import run_agent

    out = run_agent(["--node", "n1", "--coordinator", good.address, "--socket", str(tmp_path / "c.sock"),
                     "--state-dir", str(tmp_path / "c"), "--tls-ca", str(pki.ca_path)])
    assert out.returncode == 1 and "TLS needs --tls-ca, --tls-cert and --tls-key together" in out.stderr
    assert "Traceback" not in out.stderr
    node.close()


def test_driver_reload_then_restart_applies_pushed_safe_caps_before_ready(rig, tmp_path):
    node, fc, agent = rig
    a = agent()
    a.wait_ready(20, connected=True)
    with a.client() as c:
        assert c.job_start("5", ["0", "1"]).ok
    seq = fc.push_plan("n1", {0: 450.0, 1: 500.0}, safe_caps={0: 350.0, 1: 380.0})
    wait_until(lambda: fc.ack_for(seq), 5, what="ack")
    a.stop()
    node.driver_reload()  # reboot / driver reload: every limit back to the 700 W default
    assert [node.read(i)["limit_w"] for i in range(4)] == [700.0] * 4
    b = agent(address=f"unix:{tmp_path}/nobody.sock")
    st = b.wait_ready(20)
    assert st.ready and not st.coordinator_connected
    # the safe caps the coordinator last pushed (kept in the state dir) are in force before ready
    assert [node.read(i)["limit_w"] for i in range(4)] == [350.0, 380.0, 700.0, 700.0]
    assert {j.job_id: list(j.gpu_indices) for j in st.jobs} == {"5": [0, 1]}


def test_job_end_never_restores_above_the_start_cap_the_coordinator_has_seen(rig):
    """Regression (found by the enforced-limit journal: 3209.4 W over a 3200 W budget at a job's
    end): a job started and ended before the coordinator assigned its GPUs any cap. The start cap
    lowered them and the coordinator, reading that, could budget the freed watts elsewhere; the
    job's end then restored the 700 W pre-job limit at once, above the coordinator's accounting.
    Now the start cap is the allowance: the restore is held there until a plan raises it."""
    from capctl.simgpu.journal import check_nodes

    node, fc, agent = rig
    policy = write_policy(node.path.parent / "p.yaml", nodes=["n1"], budget_w=2800, start_cap_w=300.0)
    a = agent(policy=policy)
    a.wait_ready(20, connected=True)
    wait_until(lambda: fc.telemetry, 5, what="telemetry")  # the coordinator reads the node
    since = time.monotonic_ns()
    with a.client() as c:
        assert c.job_start("7", ["2", "3"]).ok
        wait_until(lambda: any(g.index == 2 and g.enforced_w == 300.0 for t in fc.telemetry[-2:] for g in t.gpus),
                   5, what="the start cap reported")
        c.job_end("7")
    time.sleep(0.6)  # three agent intervals: a restore that were not held would be done by now
    held = check_nodes({"n1": node.path}, None, gpus={"n1": [2, 3]}, since_ns=since)
    assert held.max_sum_w == 700.0 + 700.0 and held.initial_sum_w == 1400.0  # before the job: 700 W each
    assert [node.read(i)["enforced_w"] for i in (2, 3)] == [300.0, 300.0]  # held at the start cap
    fc.push_plan("n1", {2: 700.0, 3: 700.0}, phase="increase")  # the coordinator hands the watts back
    wait_until(lambda: [node.read(i)["enforced_w"] for i in (2, 3)] == [700.0, 700.0], 5,
               what="restore completed by the coordinator's plan")


def test_a_decrease_plan_never_raises_a_gpu(rig):
    """Regression (found by the enforced-limit journal: 3,300 W over a 3,200 W budget): the
    coordinator, whose accounting still had a GPU at 700 W, sent 600 W in phase 1 to a GPU the
    agent had already lowered to its 300 W start cap. Phase 1 only lowers: the cap is kept and
    acked at 300 W; a phase-2 plan raises it."""
    node, fc, agent = rig
    policy = write_policy(node.path.parent / "p.yaml", nodes=["n1"], budget_w=2800, start_cap_w=300.0)
    a = agent(policy=policy)
    a.wait_ready(20, connected=True)
    with a.client() as c:
        assert c.job_start("9", ["0", "1"]).ok
    seq = fc.push_plan("n1", {0: 600.0, 1: 250.0, 2: 650.0}, phase="decrease")
    ack = wait_until(lambda: fc.ack_for(seq), 5, what="ack")
    got = {g.index: g.enforced_w for g in ack.gpus}
    assert got == {0: 300.0, 1: 250.0, 2: 650.0}  # 0 held at its start cap, 1 and 2 lowered
    seq = fc.push_plan("n1", {0: 600.0}, phase="increase")
    ack = wait_until(lambda: fc.ack_for(seq), 5, what="ack")
    assert {g.index: g.enforced_w for g in ack.gpus} == {0: 600.0}
