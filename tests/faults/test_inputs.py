"""Bad input against the running daemons: malformed and oversized gRPC messages, a wrong protocol
version, a broken policy reload, a budget below the minimum caps, fuzzed policies. The daemons
answer with a clear error and keep running on their last good state (invariants sampled)."""

from __future__ import annotations

import re
import subprocess
import sys

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc
from tests.faults.rig import NODES

pytestmark = pytest.mark.faults

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def _connect(address: str, messages: list, timeout_s: float = 5.0):
    """Open an AgentLink stream, send ``messages`` (protobufs or raw bytes), return (code, details)."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = ch.stream_stream("/capctl.v1.AgentLink/Connect",
                                request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                                response_deserializer=pb.CoordinatorMessage.FromString)
        try:
            replies = list(call(iter(messages), timeout=timeout_s))
        except grpc.RpcError as err:
            return err.code(), err.details()
    return grpc.StatusCode.OK, replies


def _hello(**kw):
    base = dict(protocol_version="capctl.v1", node="intruder", agent_version="t",
                gpus=[pb.GpuInfo(index=0, min_cap_w=200, max_cap_w=700, default_cap_w=700, slowdown_temp_c=87)])
    base.update(kw)
    return pb.AgentMessage(hello=pb.AgentHello(**base))


def _still_fine(rig):
    assert rig.coordinator.poll() is None and all(a.poll() is None for a in rig.agents.values())
    st = rig.status()
    assert sorted(n.name for n in st.nodes) == sorted(NODES)  # nothing registered by the bad peers
    assert all(not n.stale for n in st.nodes)
    assert rig.bindings_complete()


def test_malformed_and_oversized_grpc_messages(rig):
    addr = rig.coordinator.address
    code, details = _connect(addr, [b"\xff\xff\xff\xff not a protobuf"])
    assert code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN), (code, details)
    code, details = _connect(addr, [pb.AgentMessage(telemetry=pb.NodeTelemetry(node="n1"))])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "first message" in details
    code, details = _connect(addr, [_hello(agent_version="x" * (5 << 20))])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    code, details = _connect(addr, [_hello(gpus=[pb.GpuInfo(index=i, max_cap_w=700) for i in range(65)])])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "65 GPUs, at most 64" in details
    code, details = _connect(addr, [_hello(node="bad name")])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "AgentHello.node" in details
    code, details = _connect(addr, [_hello(gpus=[pb.GpuInfo(index=0, min_cap_w=float("nan"), max_cap_w=700)])])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit constraints" in details
    # Admin and the agents' local socket
    with grpc.insecure_channel(addr) as ch:
        raw = ch.unary_unary("/capctl.v1.Admin/Status", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\x0a\xff\xff\xff\xff\xff", timeout=5)
        assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)
    local = "unix:" + rig.agents["n1"].socket_path
    with grpc.insecure_channel(local, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.AgentLocalStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.JobStart(pb.JobStartRequest(job_id="9", gpu_ids=["0"], user="u" * (2 << 20)), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:
            stub.JobStart(pb.JobStartRequest(job_id="9", gpu_ids=["0"] * 100), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 64" in err.value.details()
        raw = ch.unary_unary("/capctl.v1.AgentLocal/JobStart", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError):
            raw(b"\x12\xff\xff\xff\xff", timeout=5)
    assert sorted(j.job_id for j in rig.agents["n1"].status().jobs) == ["100", "200"]
    _still_fine(rig)


def test_wrong_protocol_version_is_refused(rig):
    code, details = _connect(rig.coordinator.address, [_hello(protocol_version="capctl.v2")])
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'capctl.v2'" in details and "capctl.v1" in details
    code, details = _connect(rig.coordinator.address, [_hello(protocol_version="")])
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    _still_fine(rig)


def _capctl(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "capctl.cli.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_policy_reload_with_a_broken_policy_keeps_the_last_good_one(rig, tmp_path):
    before = rig.status()
    broken = tmp_path / "broken.yaml"
    broken.write_text(rig.policy_path.read_text().replace("budget_w: 2800", "budget_w: -5"))
    r = _capctl("policy", "reload", str(broken), "--coordinator", rig.coordinator.admin_address)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    line = next(i + 1 for i, t in enumerate(broken.read_text().splitlines()) if t.startswith("budget_w"))
    assert re.search(rf"{re.escape(str(broken))}:{line}:\d+: .*budget_w", r.stdout + r.stderr), r.stdout + r.stderr
    after = rig.status()
    assert after.budget_w == before.budget_w == 2800.0 and after.policy_path == before.policy_path
    unreadable = tmp_path / "missing.yaml"
    r = _capctl("policy", "reload", str(unreadable), "--coordinator", rig.coordinator.admin_address)
    assert r.returncode == 1 and "missing.yaml" in r.stdout + r.stderr and "Traceback" not in r.stderr
    _still_fine(rig)


def test_budget_below_the_sum_of_minimum_caps_is_refused_with_the_deficit(rig):
    # 8 GPUs x 200 W minimum limit = 1,600 W
    r = _capctl("budget", "set", "1000", "--coordinator", rig.coordinator.admin_address)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "600" in r.stdout + r.stderr and "deficit" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    reply = rig.admin("SetBudget", pb.SetBudgetRequest(budget_w=1000.0))
    assert not reply.ok and reply.deficit_w == pytest.approx(600.0) and reply.budget_w == 2800.0
    assert rig.status().budget_w == 2800.0
    # and nobody but an admin may even try: the TCP/unix listener refuses SetBudget without identity
    with grpc.insecure_channel(rig.coordinator.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.AdminStub(ch).SetBudget(pb.SetBudgetRequest(budget_w=2000.0), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    _still_fine(rig)


def test_fuzzed_policy_reloads_are_clear_errors_or_valid(rig, tmp_path):
    """hypothesis-mutated policies (the strategies of tests/policy/test_fuzz.py, on this rig's
    policy) sent to the running coordinator: each reload is a valid policy or file:line:col errors;
    the daemon survives; the rig's policy is reloaded afterwards."""
    from tests.policy import test_fuzz

    original = rig.policy_path.read_text()
    test_fuzz.SOURCES["rig.yaml"] = original
    target = tmp_path / "fuzz.yaml"
    outcomes = {"ok": 0, "error": 0}

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(test_fuzz.mutated_text())
    def reload_one(text):
        target.write_text(text)
        rig.sampler.excuse(5.0)  # an accepted mutation may legitimately move budgets and limits
        reply = rig.admin("ReloadPolicy", pb.ReloadPolicyRequest(path=str(target)))
        if reply.ok:
            outcomes["ok"] += 1
        else:
            outcomes["error"] += 1
            assert reply.errors, reply.message
            for e in reply.errors:
                assert e.startswith(str(target)) and "Traceback" not in e, e
        assert rig.coordinator.poll() is None

    try:
        reload_one()
    finally:
        test_fuzz.SOURCES.pop("rig.yaml", None)
        reply = rig.admin("ReloadPolicy", pb.ReloadPolicyRequest(path=str(rig.policy_path)))
        assert reply.ok, list(reply.errors)
    assert outcomes["error"] >= 1
    rig.wait_settled()
    rig.sampler.excuse(0.0)
