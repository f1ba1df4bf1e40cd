"""The coordinator's per-GPU series bound (policy ``metrics.per_gpu_series``, docs/metrics.md): which
GPUs a scrape exports in each mode, and that the aggregates count every GPU whatever the mode.
Real prometheus_client exposition of :class:`coordinator.metrics.Metrics`, parsed back."""

from __future__ import annotations

import dataclasses

import pytest

STATES = ["OK", "OK", "FOREIGN_WRITER", "OK", "SAFE_CAP", "", "UNSUPPORTED_CONSTRAINTS", "OK"]
"""Cap states of the 8 GPUs of the first node (the second node's 8 are OK; GPU n2/3 is a straggler)."""


class _Coord:
    """What the collectors read of a coordinator: its view and policy."""

    def __init__(self, status, policy) -> None:
        from coordinator.view import View

        self.view = View(status=status)
        self.policy = policy
        self.recent_finished = ()


def _status():
    from capctl import capstates
    from capctl.v1 import capctl_pb2 as pb

    nodes = []
    for name in ("n1", "n2"):
        gpus = []
        for i in range(8):
            state = STATES[i] if name == "n1" else "OK"
            gpus.append(pb.GpuStatus(index=i, uuid=f"GPU-{name}-{i}", cap_w=300.0 + i, enforced_w=300.0 + i,
                                     power_w=250.0, temp_c=60.0, sm_clock_mhz=1500, node=name,
                                     flags=["STRAGGLER"] if (name, i) == ("n2", 3) else [],
                                     **capstates.wire_fields(state)))
        nodes.append(pb.NodeStatus(name=name, gpus=gpus, last_report_age_s=0.5))
    return pb.StatusReply(budget_w=8000.0, nodes=nodes, jobs=[pb.JobStatus(job_id="J", gpus=16, allocated_w=5000.0)],
                          domains=[pb.DomainStatus(name="c", kind="cluster", limit_w=8000.0)])


def _scrape(status=None, **metrics):
    """Families of one scrape: name -> list of samples, under a policy with ``metrics`` set (of
    ``status``, default :func:`_status`)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from capctl.policy import DEFAULT_POLICY
    from coordinator.metrics import Metrics

    policy = dataclasses.replace(DEFAULT_POLICY, metrics=dataclasses.replace(DEFAULT_POLICY.metrics, **metrics))
    m = Metrics(_Coord(status if status is not None else _status(), policy))
    text = generate_latest(m.registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _uuids(fams, name):
    return sorted({s.labels["uuid"] for s in fams[name]})


FLAGGED = sorted(["GPU-n1-2", "GPU-n1-4", "GPU-n1-6", "GPU-n2-3"])
"""Non-OK cap state (FOREIGN_WRITER, SAFE_CAP, UNSUPPORTED_CONSTRAINTS; "" = none yet is not) or STRAGGLER."""


@pytest.mark.parametrize("mode, expected", [("all", None), ("flagged", FLAGGED), ("none", [])])
def test_each_mode_exports_its_gpus_and_every_aggregate(mode, expected):
    fams = _scrape(per_gpu_series=mode)
    every = sorted(f"GPU-{n}-{i}" for n in ("n1", "n2") for i in range(8))
    want = every if expected is None else expected
    for name in ("capctl_gpu_cap_watts", "capctl_gpu_power_watts", "capctl_gpu_cap_state"):
        assert _uuids(fams, name) == want, name
    cap = {s.labels["uuid"]: s.value for s in fams["capctl_gpu_cap_watts"]}
    assert all(cap[u] == 300.0 + int(u[-1]) for u in want)
    assert fams["capctl_metrics_gpus_exported"][0].value == len(want)
    by_state = {s.labels["state"]: s.value for s in fams["capctl_gpus_by_cap_state"]}
    assert by_state["OK"] == 12 and by_state["FOREIGN_WRITER"] == 1 and by_state["SAFE_CAP"] == 1
    assert by_state["UNSUPPORTED_CONSTRAINTS"] == 1 and by_state[""] == 1 and by_state["LOST"] == 0
    assert fams["capctl_stragglers"][0].value == 1
    assert _uuids(fams, "capctl_gpu_straggler") == (["GPU-n2-3"] if mode != "none" else [])
    assert _uuids(fams, "capctl_gpu_unsupported_constraints") == (["GPU-n1-6"] if mode != "none" else [])
    # aggregates whatever the mode
    assert fams["capctl_budget_watts"][0].value == 8000.0
    assert [s.labels["node"] for s in fams["capctl_agent_up"]] == ["n1", "n2"]
    assert [s.value for s in fams["capctl_job_allocated_watts"]] == [5000.0]
    assert [s.labels["domain"] for s in fams["capctl_domain_limit_watts"]] == ["c"]


def test_auto_exports_every_gpu_up_to_its_bound_then_the_flagged_ones():
    assert len(_uuids(_scrape(per_gpu_series="auto", all_up_to_gpus=16), "capctl_gpu_temperature_celsius")) == 16
    assert _uuids(_scrape(per_gpu_series="auto", all_up_to_gpus=15), "capctl_gpu_temperature_celsius") == FLAGGED


def test_policy_key_defaults_and_errors(tmp_path):
    from capctl.policy import PolicyError, load_policy, parse_policy

    base = "version: 1\nbudget_w: 1000\n"
    p = parse_policy(base)
    assert (p.metrics.per_gpu_series, p.metrics.all_up_to_gpus) == ("auto", 4096)
    assert p.metrics.mode(4096) == "all" and p.metrics.mode(4097) == "flagged"
    p = parse_policy(base + "metrics: {per_gpu_series: none}\n")
    assert p.metrics.mode(10) == "none" and parse_policy(yaml_dump(p.to_dict())) == p
    path = tmp_path / "p.yaml"
    path.write_text(base + "metrics:\n  per_gpu_series: flaged\n")
    with pytest.raises(PolicyError) as err:
        load_policy(str(path))
    msg = str(err.value)
    assert f"{path}:4:" in msg and "'flaged'" in msg and "'flagged'" in msg, msg


def yaml_dump(data) -> str:
    import yaml

    return yaml.safe_dump(data)


@pytest.mark.parametrize("mode, expected", [("all", {"GPU-n1-0": 0.25, "GPU-n1-2": 0.6}),
                                            ("flagged", {"GPU-n1-2": 0.6}), ("none", {})])
def test_memory_bound_share_gauge_follows_the_per_gpu_rule_and_only_where_estimated(mode, expected):
    st = _status()
    st.nodes[0].gpus[0].memory_bound_fraction = 0.25  # OK
    st.nodes[0].gpus[2].memory_bound_fraction = 0.6  # FOREIGN_WRITER: flagged
    fams = _scrape(st, per_gpu_series=mode)
    got = {s.labels["uuid"]: s.value for s in fams.get("capctl_gpu_memory_bound_ratio", [])}
    assert got == expected  # GPUs without an estimate have no series (not a 0)


def test_a_node_that_never_reported_is_down_with_no_staleness_series():
    from capctl.v1 import capctl_pb2 as pb

    st = _status()
    st.nodes.add(name="n3", stale=True, last_report_age_s=float("nan"), never_reported=True, held_w=2800.0)
    fams = _scrape(status=st)
    up = {s.labels["node"]: s.value for s in fams["capctl_agent_up"]}
    assert up == {"n1": 1.0, "n2": 1.0, "n3": 0.0}
    assert sorted(s.labels["node"] for s in fams["capctl_agent_staleness_seconds"]) == ["n1", "n2"]
    # the watts held for it (counted against its domains), a series only for such a node
    assert {s.labels["node"]: s.value for s in fams["capctl_node_held_watts"]} == {"n3": 2800.0}
    assert isinstance(st.nodes[2], pb.NodeStatus)
