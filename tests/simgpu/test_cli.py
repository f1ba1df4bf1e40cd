"""``capctl-simgpu``: init/load/show/fault/advance and clear errors for bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from capctl.simgpu.cli import main
from capctl.simgpu.node import SimNode


def test_init_prints_exports_that_point_pynvml_at_the_node(tmp_path, simlib):
    d = tmp_path / "n1"
    res = subprocess.run(
        [sys.executable, "-m", "capctl.simgpu.cli", "init", str(d), "--gpus", "2", "--model",
         "A40", "--inlet-c", "25,40", "--manual-clock"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stderr
    env = dict(os.environ)
    for line in res.stdout.splitlines():
        assert line.startswith("export ")
        key, _, value = line[len("export "):].partition("=")
        env[key] = value
    assert env["CAPCTL_SIMGPU_NODE"] == str(d / "node.state")
    assert os.path.samefile(env["CAPCTL_SIMNVML_LIB"], simlib)
    env["LD_LIBRARY_PATH"] = os.path.dirname(env["CAPCTL_SIMNVML_LIB"])
    code = ("import pynvml as N; N.nvmlInit(); h = N.nvmlDeviceGetHandleByIndex(1); "
            "print(N.nvmlDeviceGetName(h), N.nvmlDeviceGetCount(), "
            "N.nvmlDeviceGetTemperature(h, 0))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    name, count, temp = out.stdout.rsplit(" ", 2)
    assert (name, int(count)) == ("NVIDIA A40", 2)
    assert int(temp) >= 40  # GPU 1 has a 40 C inlet


def test_load_fault_advance_show(tmp_path, simlib, capsys):
    d = str(tmp_path / "n")
    assert main(["init", d, "--gpus", "3", "--model", "H100-SXM", "--manual-clock"]) == 0
    assert main(["load", d, "--gpu", "all", "--demand-w", "600", "--util", "90"]) == 0
    assert main(["fault", d, "oob_limit", "--gpu", "1", "--value", "400"]) == 0
    assert main(["fault", d, "gpu_lost", "--gpu", "2"]) == 0
    assert main(["advance", d, "12.5"]) == 0
    capsys.readouterr()
    assert main(["show", d]) == 0
    out = capsys.readouterr().out
    assert "t=12.500 s" in out and "FAULT:oob_limit" in out and "FAULT:gpu_lost" in out
    with SimNode.open(os.path.join(d, "node.state")) as node:
        assert node.read(0)["demand_w"] == 600.0 and node.read(0)["utilization_pct"] == 90.0
        assert node.read(1)["enforced_w"] == 400.0
        assert node.read(2)["lost"]
    assert main(["fault", d, "gpu_lost", "--gpu", "2", "--clear"]) == 0
    assert main(["reload", d]) == 0
    with SimNode.open(os.path.join(d, "node.state")) as node:
        assert not node.read(2)["lost"] and node.driver_generation == 1


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["init", "{d}", "--gpus", "2", "--model", "B300"], "model 'B300' is unknown; allowed: H100-SXM"),
        (["init", "{d}", "--gpus", "0"], "--gpus 0 is out of range"),
        (["init", "{d}", "--gpus", "2", "--inlet-c", "hot"], "--inlet-c 'hot' is invalid"),
        (["init", "{d}", "--gpus", "2", "--inlet-c", "20,30,40"], "inlet_c has 3 values"),
        (["load", "{d}", "--gpu", "5", "--demand-w", "100"], "--gpu 5 is out of range"),
        (["load", "{d}", "--gpu", "0", "--demand-w", "-3"], "demand_w -3 is invalid"),
        (["fault", "{d}", "foreign_writer", "--gpu", "0", "--value", "900"], "outside the limit constraints"),
        (["advance", "{d}", "-1"], "dt_s -1 is invalid"),
        (["show", "{d}/nothing"], "holds no simulated node"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_1(tmp_path, simlib, argv, needle):
    d = tmp_path / "n"
    if argv[0] != "init":
        assert main(["init", str(d), "--gpus", "2", "--manual-clock"]) == 0
    args = [a.replace("{d}", str(d)) for a in argv]
    res = subprocess.run([sys.executable, "-m", "capctl.simgpu.cli", *args], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 1
    assert needle in res.stderr and "Traceback" not in res.stderr


def test_advance_on_a_real_clock_node_is_refused(tmp_path, simlib, capsys):
    d = str(tmp_path / "n")
    assert main(["init", d, "--gpus", "1"]) == 0
    assert main(["advance", d, "1"]) == 1
    assert "follows the real clock" in capsys.readouterr().err


def test_init_in_a_directory_that_cannot_be_made_is_one_line(tmp_path, capsys):
    """``init`` under a file or in /proc printed mkdir's traceback (found by a try-out)."""
    (tmp_path / "f").write_text("")
    for bad in (tmp_path / "f" / "sub", "/proc/capctl-no-such/x"):
        assert main(["init", str(bad), "--gpus", "2"]) == 1
        err = capsys.readouterr().err
        assert f"DIR '{bad}': cannot create it (" in err and "allowed: a writable directory" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
