"""The example policies, the default policy, and the Policy helpers other components use."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import hostlist
import jsonschema
import pytest
import yaml

from capctl.errors import UserInputError
from capctl.policy import (
    DEFAULT_POLICY,
    DEFAULT_POLICY_YAML,
    PolicyError,
    load_policy,
    load_schema,
    parse_policy,
    validate_file,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "policies"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def test_three_examples_exist() -> None:
    assert {"cluster-1000node.yaml", "cluster-64node.yaml", "lab-4node.yaml"} <= {p.name for p in EXAMPLE_FILES}


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_validates_without_warnings(path: Path) -> None:
    assert validate_file(path) == []
    policy = load_policy(path)
    assert policy.warnings == ()
    assert policy.source == str(path)
    # The plain JSON Schema accepts it too (the schema alone is usable by other tools).
    jsonschema.Draft202012Validator(load_schema()).validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_round_trips_through_to_dict(path: Path) -> None:
    policy = load_policy(path)
    again = parse_policy(yaml.safe_dump(policy.to_dict()))
    assert again == policy
    json.dumps(policy.to_dict())  # JSON-serializable


def test_example_sizes_and_paths() -> None:
    lab = load_policy(EXAMPLES / "lab-4node.yaml")
    assert lab.domains.all_nodes() == ("lab1", "lab2", "lab3", "lab4")
    assert [(d.name, d.kind, d.limit_w) for d in lab.domain_path("lab3")] == [("lab", "cluster", 4000.0), ("lab3", "node", 1100.0)]
    assert lab.idle_cap_w == 100.0 and lab.slew_w == 50.0 and lab.prolog.fail_open

    mid = load_policy(EXAMPLES / "cluster-64node.yaml")
    assert len(mid.domains.all_nodes()) == 64
    assert [d.name for d in mid.domain_path("a100-030")] == ["dc1", "rack02", "rack02-pdu-b"]
    assert mid.budget_w == 160000.0 and mid.budget_ceiling_w == 170000.0
    assert mid.domains.limit_w == mid.budget_w
    assert {d.kind for d in mid.domains.walk()} == {"cluster", "rack", "pdu"}

    big = load_policy(EXAMPLES / "cluster-1000node.yaml")
    nodes = big.domains.all_nodes()
    assert len(nodes) == len(set(nodes)) == 1000
    assert nodes == tuple(hostlist.expand_hostlist("gpu[0001-1000]"))
    assert [d.name for d in big.domain_path("gpu0777")] == ["site", "row08", "row08-rack20"]
    assert big.objective == "throughput" and not big.prolog.fail_open
    assert sum(1 for d in big.domains.walk() if d.kind == "row") == 10


def test_default_policy_is_the_demo_cluster() -> None:
    policy = DEFAULT_POLICY
    assert policy == parse_policy(DEFAULT_POLICY_YAML)
    assert len(policy.domains.all_nodes()) == 4
    gpus = sum(len(d.nodes) * d.gpus_per_node for d in policy.domains.walk() if d.nodes)
    assert gpus == 32
    assert policy.budget_w == pytest.approx(0.8 * gpus * 700)
    assert {d.gpu_model for d in policy.domains.walk()} == {"H100-SXM"}
    assert policy.warnings == ()
    assert policy.failsafe.lease_s > policy.interval_s


def test_job_weight_precedence() -> None:
    policy = load_policy(EXAMPLES / "cluster-64node.yaml")
    assert policy.job_weight() == 1.0
    assert policy.job_weight(partition="debug") == 0.5
    assert policy.job_weight(partition="debug", account="climate") == 1.5
    assert policy.job_weight(partition="debug", account="climate", qos="scavenger") == 0.25
    assert policy.job_weight(partition="nope", account="nope", qos="nope") == 1.0


def test_socket_path_per_node() -> None:
    policy = parse_policy("version: 1\nbudget_w: 1000\nagent: {socket_path: '/tmp/capctl/%n/agent-%%n-%n.sock'}\n")
    assert policy.socket_path("n1") == "/tmp/capctl/n1/agent-%n-n1.sock"
    assert DEFAULT_POLICY.socket_path("node2") == "/run/capctl/agent-node2.sock"
    assert parse_policy("version: 1\nbudget_w: 1000\n").socket_path("n1") == "/run/capctl/agent.sock"


def test_unknown_node_goes_under_the_root() -> None:
    policy = DEFAULT_POLICY
    assert not policy.has_node("stranger")
    assert policy.domain_path("stranger") == [policy.domains]
    assert policy.has_node("node1")


def test_nodes_as_list_and_nodes_on_inner_levels() -> None:
    policy = parse_policy(
        "version: 1\nbudget_w: 9000\ndomains:\n  name: c\n  nodes: [login1, 'gpu[1-2]']\n"
        "  children:\n    - {name: r, kind: rack, limit_w: 5000, nodes: 'gpu[3-4]'}\n"
    )
    assert policy.domains.nodes == ("login1", "gpu1", "gpu2")
    assert [d.name for d in policy.domain_path("gpu1")] == ["c"]
    assert [d.name for d in policy.domain_path("gpu4")] == ["c", "r"]
    assert policy.domains.all_nodes() == ("login1", "gpu1", "gpu2", "gpu3", "gpu4")


def test_with_budget() -> None:
    policy = load_policy(EXAMPLES / "cluster-64node.yaml")
    lower = policy.with_budget(120000)
    assert lower.budget_w == lower.domains.limit_w == 120000.0
    assert policy.budget_w == 160000.0  # frozen: the original is unchanged
    assert lower.domains.children == policy.domains.children
    with pytest.raises(UserInputError, match="above the root domain limit_w 170000 W"):
        policy.with_budget(170001)
    with pytest.raises(UserInputError, match="budget_w: 170000.5 W is above the root domain limit_w 170000 W"):
        policy.with_budget(170000.5)  # every digit that tells the two apart (":g" printed 170000 for both)
    # 512 GPUs x max(min_cap_w 150 W, A100 minimum 100 W) = 76,800 W
    with pytest.raises(UserInputError, match="below the sum of minimum caps 76800 W \\(deficit 800 W\\)"):
        policy.with_budget(76000)
    for bad in (0, -1, float("nan"), float("inf"), True, "100"):
        with pytest.raises(UserInputError):
            policy.with_budget(bad)


def test_policy_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_POLICY.budget_w = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        DEFAULT_POLICY.weights.qos["x"] = 2.0  # type: ignore[index]


def test_defaults_filled_in() -> None:
    policy = parse_policy("version: 1\nbudget_w: 1000\n")
    assert (policy.interval_s, policy.objective, policy.thermal.margin_c) == (5.0, "proportional", 5.0)
    assert (policy.start_cap_w, policy.idle_cap_w, policy.slew_w, policy.min_cap_w) == (300.0, None, None, None)
    assert (policy.failsafe.lease_s, policy.failsafe.safe_cap_w) == (30.0, None)
    assert (policy.prolog.on_unreachable, policy.prolog.timeout_s, policy.dry_run) == ("fail-open", 5.0, False)
    assert (policy.domains.name, policy.domains.kind, policy.domains.limit_w) == ("cluster", "cluster", 1000.0)
    assert policy.coordinator.address == "unix:/run/capctl/coordinator.sock"


def test_budget_from_root_limit() -> None:
    policy = parse_policy("version: 1\ndomains: {name: c, limit_w: 7000}\n")
    assert policy.budget_w == 7000.0 and policy.budget_ceiling_w == 7000.0


def test_load_policy_errors_are_policy_errors(tmp_path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "nope.yaml")
    assert info.value.errors == [f"{tmp_path / 'nope.yaml'}: cannot read the policy file: No such file or directory"]
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nbudget_w: 10\nslew_w: 0\n")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.errors == [f"{path}:3:9: slew_w: 0 W is not allowed; must be > 0 W"]


def test_schema_is_packaged_and_documents_every_key() -> None:
    from importlib import resources

    schema = json.loads(resources.files("capctl.policy").joinpath("schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"

    def walk(node):
        for key, sub in node.get("properties", {}).items():
            assert "description" in sub or "$ref" in sub, key
            if key.endswith("_w"):
                assert sub.get("x-unit") == "W", key
            yield key
            yield from walk(sub)

    keys = set(walk(schema)) | set(walk(schema["$defs"]["domain"]))
    docs = (Path(__file__).resolve().parents[2] / "docs" / "policy.md").read_text()
    missing = sorted(k for k in keys if f"`{k}`" not in docs)
    assert missing == [], f"keys not documented in docs/policy.md: {missing}"
