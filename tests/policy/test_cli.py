"""`capctl policy validate` / `capctl policy reload` as a person runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def capctl(*args: str, timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "capctl.cli.main", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _admin_group_warning(path: Path) -> str:
    """The host-dependent warning validate prints when the file's admin_group is unknown here."""
    import grp

    import yaml

    group = (yaml.safe_load(path.read_text()).get("coordinator") or {}).get("admin_group")
    try:
        if not group or grp.getgrnam(group):
            return ""
    except KeyError:
        pass
    # its value's line:col, as PyYAML's own node marks say (1-based)
    root = yaml.compose(path.read_text())
    coord = next(v for k, v in root.value if k.value == "coordinator")
    mark = next(v for k, v in coord.value if k.value == "admin_group").start_mark
    return (f"{path}:{mark.line + 1}:{mark.column + 1}: warning: coordinator.admin_group: group {group!r} does not "
            "exist on this host; create it (groupadd) where the coordinator runs, or the admin socket stays root-only\n")


def test_validate_examples_exit_0() -> None:
    for path in sorted((ROOT / "examples" / "policies").glob("*.yaml")):
        result = capctl("policy", "validate", str(path))
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout == f"{path}: ok\n"
        assert result.stderr == _admin_group_warning(path)


def test_validate_warns_of_an_admin_group_missing_on_this_host(tmp_path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nbudget_w: 9000\ncoordinator: {admin_group: no-such-group-capctl}\n")
    result = capctl("policy", "validate", str(path))
    assert result.returncode == 0 and result.stdout == f"{path}: ok\n"
    assert result.stderr == _admin_group_warning(path) and "no-such-group-capctl" in result.stderr
    path.write_text("version: 1\nbudget_w: 9000\ncoordinator: {admin_group: root}\n")
    assert capctl("policy", "validate", str(path)).stderr == ""


def test_validate_errors_exit_1(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nbudget: 20kW\nprolog: {on_unreachable: fail_open}\n")
    result = capctl("policy", "validate", str(path))
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines == [
        f"{path}:2:1: unknown key 'budget'; did you mean 'budget_w' (watts)? write the number in watts without a unit: budget_w: 20000",
        f"{path}:3:26: prolog.on_unreachable: 'fail_open' is not allowed; allowed: 'fail-open', 'fail-closed' (did you mean 'fail-open'?)",
    ]
    assert "Traceback" not in result.stderr


def test_validate_json(tmp_path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nbudget_w: 9000\ninterval_s: 20\nfailsafe: {lease_s: 30}\n")
    result = capctl("policy", "validate", "--json", str(path))
    assert result.returncode == 0
    out = json.loads(result.stdout)
    assert out["ok"] is True and out["errors"] == [] and out["file"] == str(path)
    assert out["warnings"] == [f"{path}:4:21: warning: failsafe.lease_s: lease_s 30 s is less than two intervals (40 s): one late plan makes agents fall back"]

    path.write_text("version: 1\nbudget_w: -3\n")
    result = capctl("policy", "validate", "--json", str(path))
    assert result.returncode == 1
    out = json.loads(result.stdout)
    assert out["errors"] == [f"{path}:2:11: budget_w: -3 W is not allowed; must be > 0 W"]
    assert out["error"] == out["errors"][0] and out["exit_code"] == 1  # the --json error contract (docs/cli.md)

    path.write_text("version: 1\nbudget_w: -3\ninterval_s: -1\n")
    out = json.loads(capctl("policy", "validate", "--json", str(path)).stdout)
    assert len(out["errors"]) == 2 and out["error"] == out["errors"][0] + ' (and 1 more error; see "errors")'


@pytest.mark.parametrize(
    "content,expected",
    [
        (None, "cannot read the policy file: No such file or directory"),
        (b"version: 1\nbudget_w: [\n", "malformed YAML"),
        (b"\xff\xfe\x00", "not UTF-8 text"),
    ],
    ids=["missing", "malformed", "binary"],
)
def test_validate_bad_files_one_clean_line(tmp_path, content, expected) -> None:
    path = tmp_path / "p.yaml"
    if content is not None:
        path.write_bytes(content)
    result = capctl("policy", "validate", str(path))
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    if content is None:  # no file to report on: a user error like any other, `capctl: ...` on stderr
        assert result.stdout == "" and result.stderr == f"capctl: {path}: {expected}\n"
        return
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and expected in result.stderr
    assert result.stderr.startswith(str(path))


def test_validate_refuses_a_fifo_without_waiting(tmp_path) -> None:
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    result = capctl("policy", "validate", str(fifo), timeout=30)  # hung forever before
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == f"capctl: {fifo}: cannot read the policy file: not a regular file (a FIFO)\n"


def test_validate_device_min_cap_flag(tmp_path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nbudget_w: 9000\nmin_cap_w: 120\ndomains: {name: c, gpu_model: L40S, nodes: a1}\n")
    assert capctl("policy", "validate", str(path)).returncode == 0
    result = capctl("policy", "validate", "--device-min-cap", "L40S=150", str(path))
    assert result.returncode == 1
    assert "min_cap_w: 120 W is below the minimum cap 150 W of L40S" in result.stderr
    bad = capctl("policy", "validate", "--device-min-cap", "L40S", str(path))
    assert bad.returncode == 1 and "expected MODEL=WATTS" in bad.stderr and "Traceback" not in bad.stderr


def test_validate_usage_error_exit_2() -> None:
    result = capctl("policy", "validate")
    assert result.returncode == 2


def test_reload_unreachable_coordinator_exit_3(tmp_path) -> None:
    result = capctl("policy", "reload", "--coordinator", f"unix:{tmp_path}/none.sock", str(ROOT / "examples/policies/lab-4node.yaml"))
    assert result.returncode == 3, result.stderr
    assert "unreachable" in result.stderr and "Traceback" not in result.stderr


class _ReloadServicer:
    """Admin servicer answering only ReloadPolicy: validates with the real loader, like the
    coordinator does, and records the paths it was asked for."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def ReloadPolicy(self, request, context):  # noqa: N802 - gRPC method name
        from capctl.policy import PolicyError, load_policy
        from capctl.v1 import capctl_pb2

        self.paths.append(request.path)
        try:
            policy = load_policy(request.path)
        except PolicyError as err:
            return capctl_pb2.ReloadPolicyReply(ok=False, errors=err.errors, message="the last good policy stays")
        return capctl_pb2.ReloadPolicyReply(ok=True, message=f"policy {request.path} loaded: budget {policy.budget_w:g} W")


@pytest.fixture
def admin_server(tmp_path):
    import grpc
    from concurrent import futures

    from capctl.v1 import capctl_pb2_grpc

    servicer = _ReloadServicer()
    handlers = {"ReloadPolicy": grpc.unary_unary_rpc_method_handler(
        servicer.ReloadPolicy,
        request_deserializer=__import__("capctl.v1.capctl_pb2", fromlist=["x"]).ReloadPolicyRequest.FromString,
        response_serializer=lambda reply: reply.SerializeToString(),
    )}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("capctl.v1.Admin", handlers),))
    address = f"unix:{tmp_path}/admin.sock"
    server.add_insecure_port(address)
    server.start()
    assert capctl_pb2_grpc.AdminStub  # the generated stubs exist
    try:
        yield address, servicer
    finally:
        server.stop(grace=None)


def test_reload_ok_and_refused(admin_server, tmp_path) -> None:
    address, servicer = admin_server
    good = ROOT / "examples" / "policies" / "lab-4node.yaml"
    result = capctl("policy", "reload", "--coordinator", address, str(good))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"policy {good} loaded: budget 4000 W"

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nbudget_w: 4000\nfailsafe: {lease_s: 1}\n")
    result = capctl("policy", "reload", "--coordinator", address, "bad.yaml", cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    first = (f"{bad}:3:21: failsafe.lease_s: lease_s 1 s must be longer than interval_s 5 s (agents would fall back to "
             f"their safe cap between two plans)")
    assert lines == [f"capctl: policy not reloaded: {first}; the coordinator keeps its last good policy"]  # one line
    assert "Traceback" not in result.stderr
    assert servicer.paths == [str(good), str(bad)]  # relative FILE sent as an absolute path

    result = capctl("policy", "reload", "--json", "--coordinator", address, str(bad))
    assert result.returncode == 1
    out = json.loads(result.stdout)
    assert out["errors"] == [first]
    assert out["ok"] is False and out["error"] == first and out["exit_code"] == 1  # the --json error contract

    # several errors, a path holding a newline: still one line, the newline escaped, the rest counted
    odd = tmp_path / "two\nerrors.yaml"
    odd.write_text("version: 1\nbudget_w: -5\nfoo: 1\n")
    result = capctl("policy", "reload", "--coordinator", address, str(odd))
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "two\\nerrors.yaml" in result.stderr and "more error" in result.stderr, result.stderr

    result = capctl("policy", "reload", "--json", "--coordinator", address, str(good))
    out = json.loads(result.stdout)
    assert result.returncode == 0 and out["ok"] is True and "error" not in out and "exit_code" not in out


def test_device_min_cap_of_a_model_no_domain_uses_or_above_its_maximum_is_warned(tmp_path, capsys):
    """``--device-min-cap FOO=5`` (a model no domain uses) and ``H100-SXM=1000`` (above its 700 W
    maximum) were taken without a word (found by a review)."""
    from capctl.cli.main import main

    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nbudget_w: 20000\ndomains: {name: c, gpu_model: H100-SXM, gpus_per_node: 8, "
                    "nodes: 'a[1-2]'}\n")
    assert main(["policy", "validate", str(path), "--device-min-cap", "FOO=5"]) == 0
    err = capsys.readouterr().err
    assert "--device-min-cap FOO=5: no domain of the policy uses GPU model 'FOO' (it uses H100-SXM)" in err
    assert main(["policy", "validate", str(path), "--device-min-cap", "h100_sxm=1000"]) == 1
    err = capsys.readouterr().err
    assert "--device-min-cap h100_sxm=1000: above the maximum cap 700 W of h100_sxm" in err
    assert "no domain of the policy uses" not in err
