"""capctl-agent command line: bad flags give one clear line (no traceback) and the right exit code;
the simulated driver is refused unless configured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.processes import AGENT_MAIN_FOR_TESTS, sim_node, simulated_library


def run_agent(args, env=None, timeout=30):
    import os

    e = dict(os.environ)
    e.pop("CAPCTL_SIMGPU_NODE", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", AGENT_MAIN_FOR_TESTS, *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


def _one_clean_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("capctl-agent:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


def test_missing_flag_is_usage_error(tmp_path):
    out = run_agent(["--node", "n1"])
    assert out.returncode == 2 and "the following arguments are required: --coordinator" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args, expect", [
    (["--nvml-library", "lib/libnvidia-ml.so.1"], "is not allowed; use 'system', 'simulated' or an absolute path"),
    (["--interval-s", "0"], "--interval-s 0.0: allowed 0.05..3600 seconds"),
    (["--rewrite-interval-s", "0.5"], "--rewrite-interval-s 0.5: allowed 1..3600 seconds"),
    (["--rewrite-interval-s", "nan"], "--rewrite-interval-s nan: allowed 1..3600 seconds"),
    (["--policy", "/nonexistent/policy.yaml"], "/nonexistent/policy.yaml"),
])
def test_bad_values_one_line(tmp_path, args, expect):
    base = ["--node", "n1", "--coordinator", "unix:/nonexistent.sock", "--socket", str(tmp_path / "a.sock"),
            "--state-dir", str(tmp_path / "state")]
    out = run_agent(base + args)
    assert out.returncode == 1, out.stderr
    assert expect in _one_clean_line(out)


def test_simulated_driver_refused_unless_configured(tmp_path):
    node = sim_node(tmp_path / "sim", 2)
    base = ["--node", "n1", "--coordinator", "unix:/nonexistent.sock", "--socket", str(tmp_path / "a.sock"),
            "--state-dir", str(tmp_path / "state")]
    # an absolute path to the simulated driver without --allow-simulated: refused, exit 5 (NVML error)
    out = run_agent(base + ["--nvml-library", str(simulated_library().resolve())], env=node.env())
    assert out.returncode == 5
    assert "refusing the simulated NVML driver" in _one_clean_line(out)
    # the system library pointed elsewhere by LD_PRELOAD cannot sneak the simulated driver in
    out = run_agent(base, env=dict(node.env(), LD_PRELOAD=str(simulated_library().resolve())))
    assert out.returncode == 5, out.stderr
    assert "simulated" in _one_clean_line(out)
    node.close()


def test_nvml_messages_name_the_flags(tmp_path):
    """NVML errors name --nvml-library / --allow-simulated (not a config key), and a missing simulated
    state file says so instead of suggesting 'modprobe nvidia'."""
    base = ["--node", "n1", "--coordinator", "unix:/nonexistent.sock", "--socket", str(tmp_path / "a.sock"),
            "--state-dir", str(tmp_path / "state")]
    missing = tmp_path / "nope.state"
    out = run_agent(base + ["--nvml-library", "simulated"], env={"CAPCTL_SIMGPU_NODE": str(missing)})
    assert out.returncode == 1, out.stderr  # a configuration error, not the hardware's (5; found by a try-out)
    line = _one_clean_line(out)
    assert f"CAPCTL_SIMGPU_NODE points at a missing file, {missing}" in line
    assert "capctl-simgpu init" in line and "modprobe" not in line
    out = run_agent(base + ["--nvml-library", "simulated"])  # (run_agent's environment has none)
    assert out.returncode == 1 and "CAPCTL_SIMGPU_NODE is not set" in _one_clean_line(out), out.stderr
    node = sim_node(tmp_path / "sim", 1)
    try:
        out = run_agent(base + ["--nvml-library", str(simulated_library().resolve())], env=node.env())
        line = _one_clean_line(out)
        assert out.returncode == 5 and "--allow-simulated" in line and "--nvml-library simulated" in line
        assert "it is the file --nvml-library names" in line and "LD_PRELOAD" not in line, line
        assert "library=" not in line and "nvml_library" not in line
    finally:
        node.close()
    out = run_agent(base + ["--nvml-library", "lib/libnvidia-ml.so.1"])
    assert out.returncode == 1 and _one_clean_line(out).startswith("capctl-agent: --nvml-library 'lib/libnvidia-ml.so.1'")
