"""Custom device profiles: ``capctl-simgpu init --profile / --profile-file`` (docs/simulated-gpus.md).

A device that matches no built-in model is created from a profile and seen through the real pynvml
exactly as the profile says; every bad field is one line naming the option or file:line.
"""

from __future__ import annotations

import json

import pytest

from capctl.simgpu import profiles
from capctl.simgpu.cli import main
from capctl.simgpu.node import SimNode

B200_YAML = """\
# a Blackwell board no built-in profile holds
base: H200
name: B200
nvml_name: NVIDIA B200
min_limit_w: 200
max_limit_w: 1000
default_limit_w: 1000
idle_w: 120
max_sm_clock_mhz: 1965
slowdown_temp_c: 87
shutdown_temp_c: 92
architecture: blackwell
pci_device_id: 0x290110DE
"""


def test_profile_file_makes_a_device_pynvml_sees(tmp_path, nvml):
    f = tmp_path / "b200.yaml"
    f.write_text(B200_YAML)
    d = tmp_path / "n"
    # the command line overrides the file (here: the shutdown threshold)
    assert main(["init", str(d), "--gpus", "2", "--manual-clock", "--profile-file", str(f),
                 "--profile", "shutdown_temp_c=93"]) == 0
    with SimNode.open(d / "node.state") as node:
        assert node.model == "B200" and node.profile.index == -1
        N = nvml.attach(node)
        h = N.nvmlDeviceGetHandleByIndex(1)
        assert N.nvmlDeviceGetName(h) == "NVIDIA B200"
        assert N.nvmlDeviceGetPowerManagementLimitConstraints(h) == [200_000, 1_000_000]
        assert N.nvmlDeviceGetPowerManagementDefaultLimit(h) == 1_000_000
        assert N.nvmlDeviceGetMaxClockInfo(h, N.NVML_CLOCK_SM) == 1965
        assert N.nvmlDeviceGetTemperatureThreshold(h, N.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN) == 87
        assert N.nvmlDeviceGetTemperatureThreshold(h, N.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN) == 93
        assert N.nvmlDeviceGetArchitecture(h) == 10
        assert N.nvmlDeviceGetPciInfo(h).pciDeviceId == 0x290110DE
        assert N.nvmlDeviceGetPowerUsage(h) == 120_000  # idle power of the profile
        with pytest.raises(N.NVMLError):  # outside the profile's constraints
            N.nvmlDeviceSetPowerManagementLimit(h, 150_000)
        node.set_load(1, demand_w=950.0)
        N.nvmlDeviceSetPowerManagementLimit(h, 600_000)
        node.advance(3.0)
        # DVFS on the profile's own constants: capped at 600 W below its 1965 MHz maximum
        assert N.nvmlDeviceGetPowerUsage(h) <= 600_000
        clock = N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM)
        assert 1000 < clock < 1965
        rate, power_w, clock_mhz = node.steady_state(1, 600.0, thermal=False)
        assert power_w <= 600.0 and clock_mhz == clock
        N.detach()


def test_profile_option_and_json_file_and_builtin_base(tmp_path):
    opt = profiles.parse_option("name=B200,min_limit_w=200,max_limit_w=1000,default_limit_w=1000")
    assert (opt.nvml_name, opt.min_limit_w, opt.max_limit_w, opt.index) == ("NVIDIA B200", 200.0, 1000.0, -1)
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"base": "A100-SXM4", "max_limit_w": 450, "default_limit_w": 450}))
    p = profiles.load_file(j)
    assert (p.name, p.max_limit_w, p.idle_w, p.index) == ("A100-SXM4", 450.0, profiles.get("A100-SXM4").idle_w, -1)
    same = profiles.custom({"base": "V100-SXM2", "max_limit_w": 300})  # equal to the built-in one
    assert same == profiles.get("V100-SXM2")
    with SimNode.create(None, gpus=1, profile=p) as node:
        assert node.read(0)["max_limit_w"] == 450.0 and node.profile == p


@pytest.mark.parametrize("args,file_text,expected", [
    (["--profile", "name=B200,min_limit_w=2000"], None, "--profile min_limit_w: min_limit_w 2000.0 is invalid"),
    (["--profile", "min_limit_w=0"], None, "allowed: 1..5000"),
    (["--profile", "idle_w=300"], None, "idle_w 300.0 is invalid; allowed: below min_limit_w (200 W)"),
    (["--profile", "nme=B200"], None, "field 'nme' is unknown"),
    (["--profile", "max_limit_w"], None, "is not KEY=VALUE"),
    (["--profile", "architecture=pascalx"], None, "architecture 'pascalx' is invalid"),
    (["--profile", "max_sm_clock_mhz=nan"], None, "max_sm_clock_mhz 'nan' is invalid"),
    ([], "base: H100-SXM\nmax_limit_w: 1000\nslowdown_temp_c: 95\n",
     "p.yaml:3: slowdown_temp_c 95.0 is invalid; allowed: at least 0.5 C below shutdown_temp_c (92 C)"),
    ([], "name: B200\nname2: x\n", "p.yaml:2: field 'name2' is unknown"),
    ([], "base: Z100\n", "p.yaml:1: base 'Z100' is unknown"),
    ([], "- 1\n- 2\n", "p.yaml:1: a device profile must be a mapping"),
    ([], "name: [\n", "p.yaml:2:1: malformed YAML"),
    ([], "", "p.yaml:1: a device profile must be a mapping of fields"),
    ([], "# only a comment\n", "got an empty file"),
    ([], "name: " + "a" * 10_000 + "\n", "p.yaml:1: name 'aaaa"),  # cut: see the length check below
    ([], "base: H100-SXM\nmin_limit_w: 200\n", None),  # with --profile max_limit_w=150 (below)
    ([], "averaged_power: 2\n", "averaged_power 2 is invalid; allowed: true or false, also 1/0 or yes/no"),
])
def test_bad_profile_is_one_line_naming_where(tmp_path, capsys, args, file_text, expected):
    if file_text is not None:
        (tmp_path / "p.yaml").write_text(file_text)
        args = args + ["--profile-file", str(tmp_path / "p.yaml")]
    if expected is None:  # a cross-field rule broken by an override: both origins named
        args, expected = args + ["--profile", "max_limit_w=150"], "p.yaml:2 and --profile max_limit_w: min_limit_w"
    assert main(["init", str(tmp_path / "n"), "--gpus", "1", *args]) == 1
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err and len(err) < 1000, err[:300]
    assert not (tmp_path / "n" / "node.state").exists()


def test_profile_file_not_utf8_names_the_place_and_1_0_mean_true_false(tmp_path, capsys):
    (tmp_path / "p.yaml").write_bytes(b"name: B200\nidle_w: \xff\n")
    assert main(["init", str(tmp_path / "n"), "--gpus", "1", "--profile-file", str(tmp_path / "p.yaml")]) == 1
    assert capsys.readouterr().err.strip().endswith(f"{tmp_path / 'p.yaml'}:2:9: not UTF-8 text (byte 0xff)")
    assert profiles.custom({"averaged_power": 0}).averaged_power is False  # as on the command line
    assert profiles.parse_option("averaged_power=1").averaged_power is True


def test_a_custom_device_with_a_builtin_name_is_marked_custom(tmp_path, capsys):
    d = tmp_path / "n"
    assert main(["init", str(d), "--gpus", "1", "--manual-clock", "--profile", "name=H200"]) == 0  # H100 base
    with SimNode.open(d / "node.state") as node:
        assert node.model == "H200" and node.custom and node.profile.index == -1 and node.read(0)["custom"]
    capsys.readouterr()
    assert main(["show", str(d)]) == 0
    assert "model H200 (custom profile)" in capsys.readouterr().out
    plain = tmp_path / "p"
    assert main(["init", str(plain), "--gpus", "1", "--manual-clock", "--model", "H200"]) == 0
    with SimNode.open(plain / "node.state") as node:
        assert not node.custom and not node.read(0)["custom"] and node.profile.index >= 0


def test_a_profile_file_above_the_size_limit_is_refused_unread(tmp_path, capsys):
    from capctl.simgpu.profiles import MAX_FILE_BYTES

    f = tmp_path / "big.yaml"
    f.write_text("name: B200\n" + "# padding\n" * (MAX_FILE_BYTES // 10))
    assert f.stat().st_size > MAX_FILE_BYTES
    assert main(["init", str(tmp_path / "n"), "--gpus", "1", "--profile-file", str(f)]) != 0
    err = capsys.readouterr().err
    assert f"{f.stat().st_size:,} bytes" in err and f"at most {MAX_FILE_BYTES:,} bytes" in err and "Traceback" not in err
    assert not (tmp_path / "n" / "node.state").exists()
