"""Fuzzed policy YAML always gives a valid Policy or a PolicyError with file:line:col lines,
never another exception (issue 7: "hypothesis-fuzzed policy YAML: always a clear error or a valid
policy, never a traceback")."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capctl.policy import Policy, PolicyError, parse_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "policies"
SOURCES = {
    name: (EXAMPLES / name).read_text() for name in ("lab-4node.yaml", "cluster-64node.yaml")
}
LINE = re.compile(r"^fuzz\.yaml(:\d+:\d+)?: \S")

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["20 kW", "5s", "fail_open", "fail-closed", "gpu[1-4]", "gpu[3-1]", "a[1-", "%n", "/run/x-%n.sock",
                     "H100-SXM", "A40", "rack", "node", "cluster", "proportional", "unix:/x", "h:1", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
KEYS = ["version", "budget_w", "interval_s", "objective", "thermal", "margin_c", "slew_w", "idle_cap_w", "start_cap_w",
        "min_cap_w", "failsafe", "lease_s", "safe_cap_w", "prolog", "on_unreachable", "timeout_s", "dry_run", "weights",
        "default", "partitions", "accounts", "qos", "domains", "name", "kind", "limit_w", "nodes", "children",
        "gpu_model", "gpus_per_node", "agent", "socket_path", "coordinator", "address", "admin_group", "budget"]


def check(text: str) -> None:
    try:
        policy = parse_policy(text, "fuzz.yaml")
    except PolicyError as err:
        assert err.errors, "a PolicyError must carry at least one error"
        for line in err.errors:
            assert LINE.match(line), line
            assert "Traceback" not in line
        return
    assert isinstance(policy, Policy)
    # A valid policy is internally consistent.
    nodes = policy.domains.all_nodes()
    assert len(nodes) == len(set(nodes))
    assert math.isfinite(policy.budget_w) and policy.budget_w > 0
    assert policy.failsafe.lease_s > policy.interval_s
    for node in nodes[:50]:
        assert policy.domain_path(node)[0] is policy.domains
    assert parse_policy(yaml.safe_dump(policy.to_dict())) == policy


def _containers(data, path=()):
    yield path, data
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _containers(value, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _containers(value, path + (i,))


@st.composite
def mutated_examples(draw):
    data = copy.deepcopy(yaml.safe_load(SOURCES[draw(st.sampled_from(sorted(SOURCES)))]))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        spots = [(p, c) for p, c in _containers(data) if isinstance(c, (dict, list)) and c]
        if not spots:
            break
        _, target = draw(st.sampled_from(spots))
        key = draw(st.sampled_from(sorted(target, key=str) if isinstance(target, dict) else list(range(len(target)))))
        action = draw(st.sampled_from(["replace", "delete", "rename", "duplicate", "insert"]))
        if action == "replace":
            target[key] = draw(values)
        elif action == "delete":
            del target[key]
        elif action == "rename" and isinstance(target, dict):
            target[draw(st.sampled_from(KEYS) | st.text(max_size=8))] = target.pop(key)
        elif action == "duplicate" and isinstance(target, list):
            target.append(copy.deepcopy(target[key]))
        elif action == "insert" and isinstance(target, dict):
            target[draw(st.sampled_from(KEYS))] = draw(values)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


@SETTINGS
@given(mutated_examples())
def test_mutated_examples(text: str) -> None:
    check(text)


@st.composite
def mutated_text(draw):
    text = SOURCES[draw(st.sampled_from(sorted(SOURCES)))]
    for _ in range(draw(st.integers(min_value=1, max_value=5))):
        i = draw(st.integers(min_value=0, max_value=len(text)))
        j = min(len(text), i + draw(st.integers(min_value=0, max_value=8)))
        insert = draw(st.text(alphabet=st.sampled_from(list(" :-[]{},'\"\n\t#&*!%|>?@0123456789kWsnax.")), max_size=6))
        text = text[:i] + insert + text[j:]
    return text


@SETTINGS
@given(mutated_text())
def test_mutated_text(text: str) -> None:
    check(text)


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=8))
def test_random_structures(data: dict) -> None:
    check(yaml.safe_dump(data, allow_unicode=True))


@SETTINGS
@given(st.text(max_size=200))
def test_random_text(text: str) -> None:
    check(text)


@st.composite
def domain_trees(draw, depth=0):
    domain = {"name": draw(st.sampled_from(["c", "row1", "row2", "r1", "r2", "r3", "p1", "p2", "n1", "gpu1"]))}
    if depth or draw(st.booleans()):
        domain["kind"] = draw(st.sampled_from(["cluster", "row", "rack", "pdu", "node"]))
    if draw(st.booleans()):
        domain["limit_w"] = draw(st.sampled_from([None, 500, 3000, 6000, 20000, 100000]))
    if draw(st.booleans()):
        domain["gpu_model"] = draw(st.sampled_from(["H100-SXM", "A40", "Z9"]))
    if draw(st.booleans()):
        domain["gpus_per_node"] = draw(st.integers(min_value=1, max_value=8))
    if draw(st.booleans()):
        exprs = draw(st.lists(st.sampled_from(["gpu[1-4]", "gpu[3-6]", "gpu[7-8]", "gpu9", "gpu[01-02]", "n1", "n[2-3]", "x[5-"]),
                              min_size=1, max_size=2))
        domain["nodes"] = exprs if draw(st.booleans()) else ",".join(exprs)
    if depth < 3 and draw(st.booleans()):
        domain["children"] = draw(st.lists(domain_trees(depth=depth + 1), max_size=3))
    return domain


@SETTINGS
@given(
    domain_trees(),
    st.sampled_from([1000, 9000, 50000]),
    st.sampled_from([None, 150, 250]),
)
def test_random_domain_trees(tree: dict, budget_w: int, min_cap_w) -> None:
    text = yaml.safe_dump({"version": 1, "budget_w": budget_w, "min_cap_w": min_cap_w, "domains": tree})
    check(text)
    try:
        policy = parse_policy(text, "fuzz.yaml")
    except PolicyError:
        return
    # Valid trees: no child limit above its nearest limited ancestor's; names unique.
    names = [d.name for d in policy.domains.walk()]
    assert len(names) == len(set(names))
    root_bound = policy.budget_ceiling_w or policy.budget_w

    def visit(domain, bound):
        for child in domain.children:
            if child.limit_w is not None:
                assert child.limit_w <= bound
            visit(child, child.limit_w if child.limit_w is not None else bound)

    visit(policy.domains, root_bound)
