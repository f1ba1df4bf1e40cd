"""Every scenario of examples/clusters validates against its policy and runs a few intervals under
all five policies (real physics, real allocator); the issue-12 scenarios are what their files say;
``workload.fixed_jobs`` and the gain capture. Needs the simulated driver (``make build``) and, for
``curves: zeus`` scenarios, the Zeus traces (../shared/data); under CI a missing one fails.
No goal ratio is asserted here (bench/sim_compare.py --matrix measures them)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from capctl.cli.main import main
from capctl.simgpu.build import library_path
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "examples" / "clusters"
POLICIES = ROOT / "examples" / "policies"
SCENARIO_POLICY = {  # cluster file -> the policy it runs under (named in the cluster file's header)
    "shared-64x8": "shared-64x8",
    "small-4x8": "small-4x8",
    "one-big-job-128x8": "one-big-job-128x8",
    "hard-budget-a100-32x8": "hard-budget-a100-32x8",
    "mix-one-large-64x8": "shared-64x8",
}


def _needs(spec):
    require(library_path().is_file(), f"simulated NVML library not built at {library_path()} (run 'make build')")
    if spec.curves == "zeus":
        from capctl.allocator.curves import zeus_data_dir

        require((zeus_data_dir() / "summary_power_a40.csv").is_file(), "../shared/data/zeus-power-traces missing")


def _scenario(stem: str, duration_s: float | None = None):
    from capctl.policy import load_policy
    from capctl.sim.cluster import load_cluster
    from capctl.sim.engine import build_scenario

    spec = load_cluster(CLUSTERS / f"{stem}.yaml")
    _needs(spec)
    if duration_s is not None:
        spec = replace(spec, duration_s=duration_s)
    policy = load_policy(POLICIES / f"{SCENARIO_POLICY[stem]}.yaml")
    return build_scenario(spec, policy)


def test_every_cluster_file_has_its_policy():
    assert sorted(p.stem for p in CLUSTERS.glob("*.yaml")) == sorted(SCENARIO_POLICY)
    for stem, pol in SCENARIO_POLICY.items():
        assert pol in (CLUSTERS / f"{stem}.yaml").read_text()  # the header names it


@pytest.mark.parametrize("stem", sorted(SCENARIO_POLICY))
def test_scenario_runs_a_few_intervals_under_every_policy(stem):
    from capctl.sim.engine import run_policy
    from capctl.sim.policies import POLICY_NAMES

    probe = _scenario(stem, 1.0)
    interval = float(probe.policy.interval_s)
    scn = _scenario(stem, 3 * interval)  # three decisions of capctl and the oracle
    lo, hi = scn.profile.min_limit_w, scn.profile.max_limit_w
    assert scn.jobs and scn.topo.n_gpus == len(scn.spec.node_names) * scn.spec.gpus_per_node
    for name in POLICY_NAMES:
        r = run_policy(scn, name)
        assert r.throughput > 0 and r.gpu_steps > 0, name
        assert r.max_overshoot_w <= 1e-6, f"{stem}/{name} over the budget by {r.max_overshoot_w} W"
        assert r.snap_cap_w.min() >= lo - 1e-6 and r.snap_cap_w.max() <= hi + 1e-6
        for _dom, limit, idx in scn.topo.limited_domains():
            assert float(r.snap_cap_w[:, idx].astype(float).sum(axis=1).max()) <= limit + 0.05


def test_issue12_scenarios_are_what_their_files_say():
    big = _scenario("one-big-job-128x8", 60.0)
    assert max(j.n_gpus for j in big.jobs) >= 1024 and 0 < big.hot_gpus.size <= 0.02 * big.topo.n_gpus
    a100 = _scenario("hard-budget-a100-32x8", 60.0)
    assert a100.profile.name == "A100-SXM4"
    assert a100.policy.budget_w <= 0.6 * a100.topo.n_gpus * a100.profile.max_limit_w
    mix = _scenario("mix-one-large-64x8", 600.0)
    large = [j for j in mix.jobs if j.n_gpus >= 256]
    assert len(large) == 1 and large[0].start_s == 0.0 and large[0].end_s >= 600.0
    assert large[0].nodes == tuple(f"gpu{i:03d}" for i in range(17, 49))  # both racks
    small = [j for j in mix.jobs if j.n_gpus <= 16]
    assert len(small) >= 20 and any(j.start_s > 0 for j in small)  # many, and they come and go
    assert not set(large[0].gpus.tolist()) & {g for j in small for g in j.gpus.tolist() if j.start_s < 600.0}


BAD_FIXED = [
    ("  fixed_jobs:\n    - {nodes: \"node[5-6]\", duration_s: 60}\n", 6, "node 'node5' is in no rack"),
    ("  fixed_jobs:\n    - {nodes: \"node[1-2]\", duration_s: 60}\n    - {nodes: \"node2\", duration_s: 60}\n", 7,
     "already in another fixed job"),
    ("  fixed_jobs:\n    - {nodes: \"node[1-2]\"}\n", 6, "missing key 'duration_s'"),
    ("  fixed_jobs:\n    - {nodes: \"node[1-2]\", duration_s: -5}\n", 6, "workload.fixed_jobs[0].duration_s"),
    ("  fixed_jobs: 3\n", 5, "workload.fixed_jobs: 3 is invalid"),
]


@pytest.mark.parametrize("tail,line,needle", BAD_FIXED)
def test_bad_fixed_jobs_name_file_line_and_value(tmp_path, capsys, tail, line, needle):
    path = tmp_path / "bad.yaml"
    path.write_text("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nworkload:\n" + tail)
    rc = main(["sim", "--policy", str(POLICIES / "small-4x8.yaml"), "--cluster", str(path), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert f"{path}:{line}:" in err and needle in err, err


def test_gain_capture_is_against_the_best_baseline():
    from capctl.sim.report import gain_capture

    runs = {n: SimpleNamespace(throughput=v) for n, v in
            (("uniform", 100.0), ("utilization", 104.0), ("balancer", 102.0), ("capctl", 109.0), ("oracle", 110.0))}
    gc = gain_capture(runs)
    assert gc["best_baseline"] == "utilization" and gc["gain_capture"] == pytest.approx(5.0 / 6.0, abs=1e-4)
    runs["oracle"] = SimpleNamespace(throughput=103.0)  # no gain over the best baseline: undefined
    assert gain_capture(runs) is None
    assert gain_capture({"capctl": runs["capctl"], "oracle": runs["oracle"]}) is None
    assert np.isfinite(gain_capture({**runs, "oracle": SimpleNamespace(throughput=120.0)})["gain_capture"])


@pytest.mark.parametrize("text, want", [
    ("idle_cap_w: null\n", [200.0, 200.0]),  # running jobs first: idle GPUs at their minimum
    ("idle_cap_w: null\nreserve_pre_job_limits: true\n", [650.0, 700.0]),  # their limits reserved
    ("idle_cap_w: 300\n", [300.0, 300.0]),
])
def test_the_oracle_sees_idle_gpus_as_the_coordinator_does(text, want):
    """With ``idle_cap_w: null`` the oracle kept idle GPUs at their pre-job limits ("reserve"), so
    it ran below capctl itself (capctl/oracle 1.158 on 96 V100, 16 idle GPUs at 0.6 x TDP; found by
    a review): idle GPUs are at their minimum unless the policy reserves pre-job limits."""
    from types import SimpleNamespace

    from capctl.policy import parse_policy
    from capctl.sim.policies import _AllocatorPolicy

    policy = parse_policy(f"version: 1\nbudget_w: 2000\n{text}")
    G = 4
    topo = SimpleNamespace(n_gpus=G, min_cap_w=np.full(G, 200.0), max_cap_w=np.full(G, 700.0),
                           domain_of_gpu=np.zeros(G, np.int64), domain_parent=np.array([-1]),
                           domain_limit_w=np.array([2000.0]), domains=[{"name": "c", "kind": "cluster"}])
    p = _AllocatorPolicy()
    p.reset(SimpleNamespace(topo=topo, policy=policy))
    obs = SimpleNamespace(tele={"enforced_w": np.array([400.0, 400.0, 650.0, 700.0])},
                          jobs=[SimpleNamespace(job_id="j")], job_of_gpu=np.array([0, 0, -1, -1]))
    ones = np.ones(G)
    problem = p._problem(obs, (ones, ones * 300.0, ones * 700.0, ones * 200.0), ones, np.full(G, np.inf))
    assert problem.idle_cap_w[2:].tolist() == want


@pytest.mark.parametrize("stem", ["small-4x8", "shared-64x8"])
def test_the_duration_does_not_change_which_gpus_are_hot_or_slow(stem):
    """The hot set and the per-GPU speed were drawn after the job timeline from one random stream,
    so ``capctl sim --duration`` simulated another cluster (small-4x8: GPUs 13, 14, 16, 28 hot over
    600 s, 8, 9, 22, 31 over 120 s; found by a review). Jobs may differ with the duration; the GPUs do not."""
    from capctl.policy import load_policy
    from capctl.sim import cluster, engine

    spec = cluster.load_cluster(ROOT / f"examples/clusters/{stem}.yaml")
    policy = load_policy(str(ROOT / f"examples/policies/{stem}.yaml"))
    runs = [engine.build_scenario(replace(spec, duration_s=d), policy) for d in (60.0, 120.0, spec.duration_s)]
    assert len({len(r.jobs) for r in runs}) > 1  # the case: the timelines differ
    for r in runs[:-1]:
        assert np.array_equal(r.hot_gpus, runs[-1].hot_gpus)
        assert (r.speed is None) == (runs[-1].speed is None)
        if r.speed is not None:
            assert np.array_equal(r.speed, runs[-1].speed)
