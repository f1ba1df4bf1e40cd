"""``capctl sim``: the what-if simulator on the small scenario (real physics, real allocator).

The simulator runs the simulated driver's C physics in-process, so these tests need the compiled
library (``make build``); under CI a missing library fails them (tests.conftest.require).
Nothing here asserts a timing or a goal ratio (those are measured in bench/sim_compare.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from capctl.cli.main import main
from capctl.simgpu.build import library_path
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
SMALL_CLUSTER = ROOT / "examples" / "clusters" / "small-4x8.yaml"
SMALL_POLICY = ROOT / "examples" / "policies" / "small-4x8.yaml"
SHARED_CLUSTER = ROOT / "examples" / "clusters" / "shared-64x8.yaml"
SHARED_POLICY = ROOT / "examples" / "policies" / "shared-64x8.yaml"
DURATION_S = 300.0


@pytest.fixture(scope="module")
def scenario():
    require(library_path().is_file(), f"simulated NVML library not built at {library_path()} (run 'make build')")
    from capctl.policy import load_policy
    from capctl.sim.cluster import load_cluster
    from capctl.sim.engine import build_scenario

    spec = replace(load_cluster(SMALL_CLUSTER), duration_s=DURATION_S)
    return build_scenario(spec, load_policy(SMALL_POLICY))


@pytest.fixture(scope="module")
def runs(scenario):
    from capctl.sim.engine import run_policy
    from capctl.sim.policies import POLICY_NAMES

    return {n: run_policy(scenario, n) for n in POLICY_NAMES}


def test_small_scenario_has_jobs_and_hot_gpus(scenario):
    assert len(scenario.jobs) >= 2
    assert scenario.hot_gpus.size == round(0.125 * 32)
    for j in scenario.jobs:
        assert j.n_gpus % 8 == 0 and j.end_s > j.start_s


def test_deterministic_for_a_seed(scenario, runs):
    from capctl.sim.engine import run_policy

    for name in ("capctl", "balancer"):
        again = run_policy(scenario, name)
        assert again.throughput == runs[name].throughput
        assert again.job_rate == runs[name].job_rate
        np.testing.assert_array_equal(again.snap_cap_w, runs[name].snap_cap_w)


def test_another_seed_changes_the_workload(scenario):
    from capctl.sim.engine import build_scenario

    other = build_scenario(replace(scenario.spec, seed=scenario.spec.seed + 1), scenario.policy)
    a = [(j.n_gpus, j.start_s, j.end_s) for j in scenario.jobs]
    b = [(j.n_gpus, j.start_s, j.end_s) for j in other.jobs]
    assert a != b


def test_uniform_respects_budget_domains_and_constraints(scenario, runs):
    r = runs["uniform"]
    caps = r.snap_cap_w
    assert caps.size
    assert caps.min() >= 200.0 - 1e-6 and caps.max() <= 700.0 + 1e-6
    assert r.max_overshoot_w <= 1e-6
    for _name, limit, idx in scenario.topo.limited_domains():
        assert float(caps[:, idx].sum(axis=1).max()) <= limit + 0.01
    # the share is budget / GPUs (17,920 W / 32 = 560 W) as long as no domain binds
    assert np.allclose(caps, 560.0, atol=0.01)


@pytest.mark.parametrize("name", ["uniform", "utilization", "balancer", "capctl", "oracle"])
def test_no_policy_overshoots_the_budget(runs, scenario, name):
    r = runs[name]
    assert r.max_overshoot_w <= 1e-6, f"{name} overshoots by {r.max_overshoot_w} W"
    for _name, limit, idx in scenario.topo.limited_domains():
        assert float(r.snap_cap_w[:, idx].astype(float).sum(axis=1).max()) <= limit + 0.05


def test_oracle_at_least_as_good_as_uniform(runs):
    assert runs["oracle"].throughput >= runs["uniform"].throughput
    assert runs["oracle"].thermal_slowdown_fraction <= runs["uniform"].thermal_slowdown_fraction


def test_uniform_throttles_hot_gpus_and_the_oracle_does_not(runs):
    # the small scenario's hot GPUs (R 0.10-0.12 C/W, inlet up to 35 C) cross their slowdown
    # temperature at the uniform share; the thermal ceiling keeps the oracle below it
    assert runs["uniform"].thermal_slowdown_fraction > 0.0
    assert runs["oracle"].thermal_slowdown_fraction == 0.0


def test_cli_json_has_the_keys(capsys):
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(SMALL_CLUSTER), "--duration", "120",
               "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(obj["policies"]) == {"uniform", "utilization", "balancer", "capctl", "oracle"}
    for p in obj["policies"].values():
        for key in ("throughput", "thermal_slowdown_fraction", "max_overshoot_w", "energy_per_step_j", "jobs"):
            assert key in p
        assert p["throughput"] > 0
    assert set(obj["ratios"]) == {"capctl/oracle", "capctl/uniform", "capctl/balancer", "capctl/utilization"}
    assert obj["gpus"] == 32 and obj["duration_s"] == 120.0


def test_cli_plot_writes_pngs(tmp_path, capsys):
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    out = tmp_path / "plots"
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(SMALL_CLUSTER), "--duration", "60",
               "--policies", "uniform,oracle", "--plot", str(out)])
    assert rc == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["heatmap_oracle.png", "heatmap_uniform.png", "throttling.png", "throughput.png"]
    for p in out.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000
    text = capsys.readouterr().out
    assert "uniform" in text and " capctl/x " in text
    row = next(ln for ln in text.splitlines() if ln.startswith("uniform "))
    assert row.split()[5] == "-"  # overshoot: never over a limit (not "-0.0")


BAD_CLUSTERS = [
    ("racks:\n  - {name: r1, nodes: \"node[1-4]\", inlet_c: [30, 20]}\ngpu_model: H100-SXM\n", 2,
     "inlet_c"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nduraton_s: 60\n", 4,
     "did you mean 'duration_s'"),
    ("gpu_model: B300\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\n", 1, "allowed: H100-SXM"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nstep_s: -1\n", 4, "step_s"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4\"}\n", 3, "hostlist"),
    ("gpu_model: H100-SXM\nracks: [\n", 3, "malformed YAML"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-2]\"}\n  - {name: r1, nodes: \"node[3-4]\"}\n", 4,
     "racks[1].name: 'r1' is already the name of another rack"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\ngpus:\n  efficiency: {mean_loss: 0.3, max_loss: 0.1}\n",
     5, "gpus.efficiency.max_loss"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\ngpus:\n  efficiency: {mean_loss: 0.5, max_loss: 0.9}\n",
     5, "allowed: at most 5 x, max_loss <= 0.618"),  # (it failed later: "gpu 0: power_factor 185.591")
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nworkload:\n  demand_w: [700, 600]\n", 5,
     "workload.demand_w"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"n[1-4]\"}\nworkload:\n  fixed_jobs:\n"
     "    - {nodes: \"n[1-2]\", duration_s: 60}\n    - {nodes: \"n[2-3]\"}\n", 7,
     "workload.fixed_jobs[1]: missing key 'duration_s'"),  # (its own error too, beside the node clash)
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"n[1-4]\", inlet_c: [-30, 20]}\n", 3,
     "within [-20, 80]"),
    ("gpu_model: A100-SXM4\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nworkload:\n  demand_w: [20, 30]\n", 5,
     "allowed: above its idle power"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\ngpus:\n  speed: fast\n", 5,
     "gpus.speed: 'fast' is invalid; allowed: physics, none or a mapping with keys mean_loss, max_loss"),
    # found by a review: each of these below was taken without a word, said something else or raised
    ("gpu_model: H100-SXM\ngpus_per_node: 8.0\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\n", 2,
     "gpus_per_node: 8.0 is invalid; allowed: an integer >= 1 and <= 64 (written with a decimal point or an "
     "exponent; write 8)"),
    ("gpu_model: H100-SXM\nseed: 7e0\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\n", 2, "seed: 7.0 is invalid"),
    ("gpu_model: H100-SXM\nduration_s: 1_000\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\n", 2,
     "duration_s: 1_000 is not allowed: YAML 1.1 reads 1_000 as 1000, YAML 1.2 as text"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nworkload:\n  jobs:\n    sizes_gpus: [8.0, 16]\n",
     6, "a list of positive multiples of gpus_per_node (8) (8.0 is written with a decimal point or an exponent; "
        "write 8)"),
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nworkload:\n  jobs:\n    sizes_gpus: []\n"
     "    size_weights: [2, 1]\n", 6, "workload.jobs.sizes_gpus: [] names no job size; allowed: a non-empty list of "
                                    "positive multiples of gpus_per_node (8), e.g. [8]\n"),  # (no "6 numbers")
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nworkload:\n  jobs:\n    sizes_gpus: [8, 16]\n"
     "    size_weights: [1e308, 1e308]\n", 7, "workload.jobs.size_weights: [1e+308, 1e+308] is invalid; allowed: 2 "
                                           "numbers (one per size), each from 1e-06 to 1e+06"),  # (a traceback)
    ("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\nworkload:\n  jobs:\n", 5,
     "workload.jobs: null is invalid; allowed: a mapping"),  # (it said None)
    ("gpu_model: H100-SXM5\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\n", 1,
     "allowed: H100-SXM, H200, A100-SXM4, V100-SXM2, A40 (did you mean 'H100-SXM'?)"),
]


@pytest.mark.parametrize("text,line,needle", BAD_CLUSTERS)
def test_bad_cluster_file_gives_file_line_error(tmp_path, capsys, text, line, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(path), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback" not in err
    assert f"{path}:{line}:" in err, err
    assert needle in err, err


def test_cluster_and_policy_must_describe_the_same_nodes(tmp_path, capsys):
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    path = tmp_path / "other.yaml"
    path.write_text("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"gpu[1-4]\"}\n")
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(path), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and "'gpu1' (and 3 more) is in no domain of the policy" in err and "Traceback" not in err
    path.write_text("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-3],gpu1\"}\n")
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(path), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and "node 'gpu1' is in no domain" in err and "more)" not in err.split("no domain")[0], err


@pytest.mark.parametrize("policy_model, cluster_model", [
    ("h100_sxm", "H100-SXM"), ("H100-SXM", "h100 sxm"), ("NVIDIA H100 80GB HBM3", "nvidia h100 80gb hbm3"),
])
def test_a_gpu_model_is_read_alike_in_the_policy_and_the_cluster_file(tmp_path, capsys, policy_model, cluster_model):
    """The policy took ``h100_sxm`` (case and punctuation aside) while the cluster file refused it as
    unknown, and a policy's ``h100-sxm`` did "not match" the cluster file's ``H100-SXM`` (found by a
    review): both read a model's name, or its NVML name, alike."""
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    policy = tmp_path / "p.yaml"
    policy.write_text(SMALL_POLICY.read_text().replace("gpu_model: H100-SXM", f"gpu_model: '{policy_model}'"))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(SMALL_CLUSTER.read_text().replace("gpu_model: H100-SXM", f"gpu_model: '{cluster_model}'"))
    rc = main(["sim", "--policy", str(policy), "--cluster", str(cluster), "--duration", "5", "--policies", "uniform",
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "", err
    assert json.loads(out)["policies"]["uniform"]["throughput"] > 0


def test_a_bad_size_list_is_one_error_not_two(tmp_path, capsys):
    """sizes_gpus [1] on 2 GPUs per node is the error; its matching size_weights [1] is not."""
    path = tmp_path / "sizes.yaml"
    path.write_text("gpu_model: H100-SXM\ngpus_per_node: 2\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\n"
                    "workload:\n  jobs:\n    sizes_gpus: [1]\n    size_weights: [1]\n")
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(path), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and f"{path}:7:" in err and "positive multiples of gpus_per_node (2)" in err, err
    assert "size_weights" not in err, err


def test_shared_scenario_files_load_and_match():
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    from capctl.policy import load_policy
    from capctl.sim.cluster import load_cluster
    from capctl.sim.topology import build_topology

    spec = load_cluster(SHARED_CLUSTER)
    pol = load_policy(SHARED_POLICY)
    assert spec.n_gpus == 512 and len(spec.racks) == 2 and all(len(r.nodes) == 32 for r in spec.racks)
    assert pol.budget_w == pytest.approx(0.8 * 512 * 700.0)
    topo = build_topology(spec, pol, 200.0, 700.0)
    assert topo.n_gpus == 512
    lo = min(r.inlet_bottom_c for r in spec.racks) - spec.swing_amplitude_c
    hi = max(r.inlet_top_c for r in spec.racks) + spec.swing_amplitude_c
    assert lo == pytest.approx(18.0) and hi == pytest.approx(35.0)


def test_zeus_workloads_fit_the_physics():
    from capctl.allocator.curves import zeus_data_dir

    require((zeus_data_dir() / "summary_power_a40.csv").is_file(), "../shared/data/zeus-power-traces missing")
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    from capctl.sim.workload import zeus_profiles

    profs = zeus_profiles("H100-SXM", str(zeus_data_dir()))
    assert len(profs) >= 40
    for p in profs:
        assert 210.0 <= p.demand_w <= 700.0 and 0.0 <= p.memory_bound_fraction <= 0.9
    # V100 traces are close to the physics family; A40 traces are steeper than it can follow
    v100 = [p.fit_rmse for p in profs if p.name.startswith("v100:")]
    assert np.median(v100) < 0.05


def test_waterfill_splits_in_proportion_within_bounds():
    from capctl.sim.policies import waterfill

    lo = np.full(4, 200.0)
    hi = np.full(4, 700.0)
    caps = waterfill(1400.0, np.array([100.0, 100.0, 0.0, 50.0]), lo, hi)
    assert caps[2] == 200.0
    assert caps.sum() == pytest.approx(1400.0, abs=1e-6)
    assert caps[0] == pytest.approx(caps[1]) and caps[0] > caps[3] > 200.0
    assert np.array_equal(waterfill(5000.0, np.ones(4), lo, hi), hi)
    assert np.array_equal(waterfill(100.0, np.ones(4), lo, hi), lo)


def _obs(scenario, t_s, progress):
    from capctl.sim.policies import Observation

    job = scenario.jobs[0]
    two_nodes = replace(job, gpus=np.arange(16), nodes=scenario.topo.node_names[:2])
    tele = np.zeros(scenario.topo.n_gpus, dtype=[("progress", "<f8"), ("utilization_pct", "<f8")])
    tele["progress"] = progress
    job_of = np.full(scenario.topo.n_gpus, -1)
    job_of[:16] = 0
    return Observation(t_s, [two_nodes], job_of, tele, False)


def test_balancer_moves_watts_from_the_fast_node_to_the_slow_one(scenario):
    from capctl.sim.policies import BALANCER_STEP_W, Balancer, Context

    bal = Balancer()
    bal.reset(Context(scenario.topo, float(scenario.policy.budget_w), scenario.policy, scenario.profile, None))
    first = bal.decide(_obs(scenario, 0.0, np.zeros(32)))
    share = scenario.policy.budget_w / 32
    assert np.allclose(first, share)
    rate = np.ones(32)
    rate[3] = 0.8  # a slow GPU on node 0: node 0 is the job's slowest, node 1 is faster
    caps = bal.decide(_obs(scenario, 10.0, rate * 10.0))
    assert np.allclose(caps[8:16], share - BALANCER_STEP_W)
    assert np.allclose(caps[:8], share + BALANCER_STEP_W)
    assert caps[:16].sum() == pytest.approx(16 * share)  # the job's budget is kept
    assert np.allclose(caps[16:], share)


def test_efficiency_factors_follow_sinha_et_al():
    from capctl.sim.engine import efficiency_factors

    k = efficiency_factors((0.08, 0.22), 20_000, np.random.default_rng(5))
    assert np.median(k) == pytest.approx(1.0, abs=1e-3)
    loss = 1.0 - (k.min() / k) ** (1.0 / 3.0)  # clock loss at a binding cap vs the best part
    assert 0.06 <= loss.mean() <= 0.09 and 0.2 <= loss.max() <= 0.22 + 1e-9


def test_shared_scenario_uses_power_efficiency_variation_and_near_tdp_demand():
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    from capctl.sim.cluster import load_cluster

    spec = load_cluster(SHARED_CLUSTER)
    assert spec.efficiency == (0.08, 0.22) and spec.speed is None and not spec.driver_speed
    assert spec.demand_w is not None and 600.0 <= spec.demand_w[0] <= spec.demand_w[1] <= 700.0


@pytest.fixture(scope="module")
def efficient_runs(scenario):
    from capctl.sim.engine import build_scenario, run_policy

    spec = replace(scenario.spec, speed=None, driver_speed=False, efficiency=(0.08, 0.22), demand_w=(640.0, 700.0))
    scn = build_scenario(spec, scenario.policy)
    return scn, {n: run_policy(scn, n) for n in ("uniform", "capctl", "oracle")}


def test_power_efficiency_variation_is_learned_per_gpu_from_nvml(efficient_runs):
    scn, runs = efficient_runs
    assert np.all(scn.speed == 1.0) and scn.power_factor.std() > 0.05
    # the capctl policy sees only NVML telemetry; its per-GPU models' power scales must rank the
    # GPUs like the true (hidden) power factors of the busy ones
    extra = runs["capctl"].extra
    assert extra["power_scale_max"] > extra["power_scale_min"] * 1.2
    for name in ("capctl", "oracle"):
        assert runs[name].throughput > runs["uniform"].throughput
        assert runs[name].max_overshoot_w <= 1e-6


def test_capctl_models_scale_tracks_the_true_power_factor(efficient_runs):
    from capctl.sim.engine import run_policy
    from capctl.sim.policies import Capctl

    scn, _ = efficient_runs
    captured = {}
    orig = Capctl.learned_summary

    def grab(self):
        captured["models"] = self.models
        captured["keys"] = self.keys
        return orig(self)

    Capctl.learned_summary = grab
    try:
        run_policy(scn, "capctl")
    finally:
        Capctl.learned_summary = orig
    models, keys = captured["models"], captured["keys"]
    busy = [g for g, key in enumerate(keys) if key in models.gpus and models.gpus[key]._scale_wt > 5]
    assert len(busy) >= 8
    scale = np.array([models.gpus[keys[g]].scale for g in busy])
    truth = scn.power_factor[busy]
    assert np.corrcoef(scale, truth)[0, 1] > 0.8


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_cli_bad_plot_dir_is_refused_before_simulating(tmp_path, capsys, kind):
    afile = tmp_path / "afile"
    afile.write_text("x")
    target = afile if kind == "file" else afile / "plots"
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(SMALL_CLUSTER), "--duration", "60",
               "--policies", "uniform", "--plot", str(target)])
    out = capsys.readouterr()
    assert rc == 1 and "Traceback" not in out.err and out.out == ""
    expect = "exists and is not a directory" if kind == "file" else "cannot create it (not a directory)"
    assert out.err == f"capctl: --plot {target}: {expect}; give a directory for the PNG files (created if missing)\n"


def test_cluster_file_read_errors_are_worded(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"gpu_model: H100-SXM\nname: M\xfcnchen\n")
    for path, expect in ((bad, f"{bad}:2:8: not UTF-8 text (byte 0xfc); expected a cluster YAML file"),
                         (tmp_path, f"{tmp_path}: is a directory; expected a cluster YAML file"),
                         (tmp_path / "missing.yaml", f"{tmp_path / 'missing.yaml'}: cluster file not found")):
        rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(path), "--duration", "10"])
        err = capsys.readouterr().err
        assert rc == 1 and expect in err and "codec" not in err and "Errno" not in err, err


@pytest.mark.parametrize("args, says", [
    (["--duration", "0.5"], "--duration 0.5 is shorter than one simulation step"),
    (["--policies", ""], "names no policy"),
    (["--policies", " , "], "names no policy"),
    # taken without a word before (found by a try-out)
    (["--policies", "uniform,,capctl"], "an empty name between commas"),
    (["--policies", "uniform,uniform"], "'uniform' named twice"),
])
def test_cli_refuses_a_run_too_short_for_one_step_and_an_empty_policy_list(capsys, args, says):
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(SMALL_CLUSTER), *args, "--json"])
    out = capsys.readouterr()
    assert rc != 0 and says in out.err and "Traceback" not in out.err
    reply = json.loads(out.out)  # --json: the outcome as one JSON object on stdout, errors too
    assert reply["ok"] is False and says in reply["error"]



def test_missing_zeus_data_names_the_directory_and_capctl_data_dir(tmp_path):
    """Without the traces, ``curves: zeus`` says where it looked and how to point it elsewhere."""
    from capctl.errors import UserInputError
    from capctl.sim.workload import zeus_profiles

    with pytest.raises(UserInputError) as err:
        zeus_profiles("H100-SXM", str(tmp_path / "zeus-power-traces"))
    text = str(err.value)
    assert str(tmp_path / "zeus-power-traces") in text and "CAPCTL_DATA_DIR=DIR" in text and "curves: default" in text


_NO_MODEL = ("  gpu_model: H100-SXM\n  gpus_per_node: 8\n", "")
"""A policy that names no GPU model: its own checks cannot know the minimum caps."""


@pytest.mark.parametrize("edits, says", [
    ([_NO_MODEL, ("limit_w: 9600, nodes: \"node[1-2]\"", "limit_w: 1000, nodes: \"node[1-2]\"")],
     "domain 'pdu-a' limit_w 1000 W is below the minimum caps of its 16 GPUs (16 x 200 W = 3200 W, H100-SXM"),
    ([_NO_MODEL, ("budget_w: 17920", "budget_w: 6000"), ("limit_w: 9600", "limit_w: 3000")],
     "budget_w 6000 W is below the minimum caps of its 32 GPUs (32 x 200 W = 6400 W"),
    ([("gpus_per_node: 8", "gpus_per_node: 2")], "domain 'cluster' gpus_per_node 2 does not match the cluster file"),
    ([("gpu_model: H100-SXM", "gpu_model: A100-SXM4")],
     "domain 'cluster' gpu_model 'A100-SXM4' does not match the cluster file"),
])
def test_a_policy_the_simulated_cluster_cannot_meet_is_refused(tmp_path, capsys, edits, says):
    """Found by a try-out: a PDU limit below its GPUs' minimum caps in a policy naming no GPU model
    ran with exit 0 and every policy 2,200 W over it (the table said never over); a policy written
    for other GPUs ran unchecked. (A policy naming the model refuses such limits itself.)"""
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    text = SMALL_POLICY.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    rc = main(["sim", "--policy", str(path), "--cluster", str(SMALL_CLUSTER), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and f"{path}: " in err and says in err and "Traceback" not in err, err


def test_the_overshoot_is_the_worst_domain_not_only_the_budget():
    """``max_overshoot_w`` counts every domain with a limit (a PDU over while the total is under)."""
    from capctl.sim.engine import _overshoot_w

    enforced = np.array([500.0, 500.0, 100.0, 100.0])
    limited = [(1400.0, np.arange(4)), (900.0, np.array([0, 1])), (700.0, np.array([2, 3]))]
    assert _overshoot_w(enforced, limited) == pytest.approx(100.0)  # the PDU of GPUs 0-1; the total is under
    assert _overshoot_w(enforced, limited[:1]) == pytest.approx(-200.0)
    assert _overshoot_w(enforced, []) == -np.inf


def test_policy_warnings_dry_run_and_a_huge_seed_are_told(tmp_path, capsys):
    """Found by a try-out: the policy's validation warnings and ``dry_run: true`` (not simulated)
    were silent, and a seed the cluster file refuses was taken from the command line."""
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    path = tmp_path / "policy.yaml"
    path.write_text(SMALL_POLICY.read_text().replace("idle_cap_w: 200 ", "idle_cap_w: 900 ")
                    .replace("dry_run: false", "dry_run: true"))
    rc = main(["sim", "--policy", str(path), "--cluster", str(SMALL_CLUSTER), "--duration", "4", "--policies", "capctl"])
    err = capsys.readouterr().err
    assert rc == 0 and f"{path}:8:" in err and "idle_cap_w: 900 W is above the maximum cap 700 W" in err, err
    assert f"{path}: warning: dry_run: true is not simulated" in err, err
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(SMALL_CLUSTER), "--seed", str(2**63)])
    err = capsys.readouterr().err
    assert rc == 1 and f"--seed {2**63} is invalid; allowed: an integer >= 0 and <= {2**63 - 1}" in err, err


def test_gpus_lost_to_thermal_shutdown_are_named_in_the_table(tmp_path, capsys):
    """GPUs whose cooling cannot hold them below shutdown even at idle (1 degC/W, the documented
    maximum): the table names how many each policy lost (only --json did)."""
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    path = tmp_path / "hot.yaml"
    path.write_text(SMALL_CLUSTER.read_text().replace("hot_resistance_c_per_w: [0.10, 0.12]",
                                                       "hot_resistance_c_per_w: [1.0, 1.0]"))
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(path), "--duration", "30",
               "--policies", "uniform,capctl"])
    out = capsys.readouterr().out
    assert rc == 0 and "GPUs lost to thermal shutdown" in out and "uniform 4, capctl 4" in out, out


def test_swapped_policy_and_cluster_files_are_named_as_such(capsys):
    """``--policy CLUSTER --cluster POLICY`` said "unknown key 'gpu_model'; did you mean 'models'?"
    (found by a try-out): each loader's errors now end with what the file looks like."""
    rc = main(["sim", "--policy", str(SMALL_CLUSTER), "--cluster", str(SMALL_CLUSTER), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and f"{SMALL_CLUSTER}: this looks like a cluster file (racks, gpu_model, workload): give it with " \
        "--cluster, and a policy with --policy" in err and "Traceback" not in err, err
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(SMALL_POLICY), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and f"{SMALL_POLICY}: this looks like a policy file (budget_w, domains): give it with --policy" in err, err


def test_the_default_hot_resistance_follows_the_models_nominal_one():
    """A fixed 0.09-0.12 °C/W made the "hot" GPUs of an A100, V100 or A40 cooler than the others
    (found by a try-out); the default is 1.5-2x the model's nominal resistance."""
    from capctl.sim.cluster import parse_cluster
    from capctl.simgpu.profiles import get as get_profile

    for model in ("H100-SXM", "A100-SXM4", "V100-SXM2", "A40"):
        spec = parse_cluster(f"gpu_model: {model}\nracks:\n  - {{name: r1, nodes: \"n[1-2]\"}}\n")
        nominal = get_profile(model).thermal_resistance_c_per_w
        lo, hi = spec.hot_resistance_c_per_w
        assert (lo, hi) == pytest.approx((1.5 * nominal, 2.0 * nominal)) and lo > nominal
    spec = parse_cluster("gpu_model: A40\nracks:\n  - {name: r1, nodes: \"n[1-2]\"}\ngpus:\n  hot_resistance_c_per_w: [0.5, 0.6]\n")
    assert spec.hot_resistance_c_per_w == (0.5, 0.6)


def test_a_refused_loss_is_not_compared_by_its_default(tmp_path, capsys):
    """max_loss 0.99 is refused (at most 0.9); the error said next "max_loss: 0.22 is invalid",
    a value the file never held (its default; found by a try-out)."""
    path = tmp_path / "speed.yaml"
    path.write_text("gpu_model: H100-SXM\nracks:\n  - {name: r1, nodes: \"node[1-4]\"}\ngpus:\n"
                    "  speed: {mean_loss: 0.5, max_loss: 0.99}\n")
    rc = main(["sim", "--policy", str(SMALL_POLICY), "--cluster", str(path), "--duration", "10"])
    err = capsys.readouterr().err
    assert rc == 1 and "gpus.speed.max_loss: 0.99 is invalid" in err and "0.22" not in err, err


def test_a_hard_budget_solves_without_numeric_overflow(tmp_path):
    """0.3 x TDP on 32 H100 (6,720 W): the fast solver's step extension tried prices far enough out
    to overflow the jobs' rate derivatives, and numpy's overflow warnings reached ``capctl sim``'s
    output (found by a try-out). Run with every floating-point overflow and invalid operation
    raised: the solve stays finite."""
    import numpy as np

    from capctl.policy import load_policy
    from capctl.sim import cluster, engine

    (tmp_path / "c.yaml").write_text(
        "seed: 5\nduration_s: 150\ngpu_model: H100-SXM\ngpus_per_node: 8\nracks:\n"
        "  - {name: r1, nodes: \"n[1-2]\", inlet_c: [22, 34]}\n  - {name: r2, nodes: \"n[3-4]\", inlet_c: [25, 38]}\n"
        "gpus: {speed: none, efficiency: {mean_loss: 0.08, max_loss: 0.22}, hot_fraction: 0.1}\n"
        "workload:\n  curves: default\n"
        "  jobs: {sizes_gpus: [8, 16], size_weights: [1, 1], duration_s: [60, 200], occupancy: 1.0}\n")
    (tmp_path / "p.yaml").write_text("version: 1\nbudget_w: 6720\ninterval_s: 2\ndomains:\n  name: c\n"
                                     "  gpu_model: H100-SXM\n  gpus_per_node: 8\n  nodes: \"n[1-4]\"\n")
    spec = cluster.load_cluster(tmp_path / "c.yaml")
    policy = load_policy(str(tmp_path / "p.yaml"))
    with np.errstate(over="raise", invalid="raise"):
        for seed in (5, 1):
            from dataclasses import replace

            run = engine.run_policy(engine.build_scenario(replace(spec, seed=seed), policy), "capctl")
            assert run.throughput > 0 and run.max_overshoot_w <= 1e-6
