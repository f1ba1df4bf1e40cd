"""The simulated libnvidia-ml.so.1 through the real pynvml: units, values, return codes, faults."""

from __future__ import annotations

import ctypes
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.simgpu.conftest import run_pynvml

pytestmark = pytest.mark.integration


def test_every_call_returns_sane_values_in_nvml_units(make_node, nvml):
    node = make_node(gpus=2, model="H100-SXM", seed=3)
    node.set_load(0, 650.0, utilization_pct=97.0)
    node.advance(30.0)
    N = nvml.attach(node)
    assert N.nvmlDeviceGetCount() == 2
    assert N.nvmlSystemGetDriverVersion().count(".") == 2
    h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
    true0, true1 = node.read(0), node.read(1)
    assert N.nvmlDeviceGetName(h0) == "NVIDIA H100 80GB HBM3"
    uuid0, uuid1 = N.nvmlDeviceGetUUID(h0), N.nvmlDeviceGetUUID(h1)
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}", uuid0) and uuid0 != uuid1
    assert N.nvmlDeviceGetMinorNumber(h1) == 1
    pci = N.nvmlDeviceGetPciInfo(h0)
    assert pci.pciDeviceId == 0x233010DE and re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:00\.0", pci.busId)
    # power in mW: 650 W steady (average over the last second equals it)
    assert N.nvmlDeviceGetPowerUsage(h0) == round(true0["power_avg_w"] * 1000) == 650_000
    assert N.nvmlDeviceGetPowerUsage(h1) == 75_000  # idle
    assert N.nvmlDeviceGetPowerManagementLimit(h0) == 700_000
    assert N.nvmlDeviceGetPowerManagementDefaultLimit(h0) == 700_000
    assert N.nvmlDeviceGetEnforcedPowerLimit(h0) == 700_000
    assert N.nvmlDeviceGetPowerManagementLimitConstraints(h0) == [200_000, 700_000]
    temp = N.nvmlDeviceGetTemperature(h0, N.NVML_TEMPERATURE_GPU)
    assert temp == math.floor(true0["temp_c"]) and 30 < temp < 89
    assert N.nvmlDeviceGetTemperatureV(h0, N.NVML_TEMPERATURE_GPU) == temp
    assert N.nvmlDeviceGetTemperatureThreshold(h0, N.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN) == 89
    assert N.nvmlDeviceGetTemperatureThreshold(h0, N.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN) == 92
    assert N.nvmlDeviceGetClockInfo(h0, N.NVML_CLOCK_SM) == 1980
    assert N.nvmlDeviceGetClockInfo(h1, N.NVML_CLOCK_SM) == true1["sm_clock_mhz"] < 1980
    assert N.nvmlDeviceGetMaxClockInfo(h1, N.NVML_CLOCK_SM) == 1980
    assert N.nvmlDeviceGetCurrentClocksEventReasons(h0) == 0
    assert N.nvmlDeviceGetCurrentClocksEventReasons(h1) == N.nvmlClocksEventReasonGpuIdle
    # energy in mJ: 30 s at 650 W (+ nothing before: idle starts at t=0 with load set at t=0)
    assert N.nvmlDeviceGetTotalEnergyConsumption(h0) == 650 * 30 * 1000
    util = N.nvmlDeviceGetUtilizationRates(h0)
    assert util.gpu == 97 and 0 <= util.memory <= 100
    assert N.nvmlDeviceGetUtilizationRates(h1).gpu == 0


def test_power_cap_binds_and_reads_back_in_mw(make_node, nvml):
    node = make_node(gpus=1, model="A100-SXM4")
    node.set_load(0, 390.0)
    N = nvml.attach(node)
    h = N.nvmlDeviceGetHandleByIndex(0)
    N.nvmlDeviceSetPowerManagementLimit(h, 250_000)
    node.advance(5.0)
    assert N.nvmlDeviceGetPowerManagementLimit(h) == 250_000
    assert N.nvmlDeviceGetEnforcedPowerLimit(h) == 250_000
    power_mw = N.nvmlDeviceGetPowerUsage(h)
    assert 200_000 < power_mw <= 250_000  # largest 15 MHz step under the cap
    assert N.nvmlDeviceGetCurrentClocksEventReasons(h) & N.nvmlClocksEventReasonSwPowerCap
    assert N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM) % 15 == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limit_mw=st.integers(min_value=0, max_value=2_000_000))
def test_set_outside_constraints_is_invalid_argument(make_node, nvml, limit_mw):
    node = make_node(gpus=1, model="V100-SXM2", name=f"n{limit_mw}.state")
    N = nvml.attach(node)
    try:
        h = N.nvmlDeviceGetHandleByIndex(0)
        lo, hi = N.nvmlDeviceGetPowerManagementLimitConstraints(h)
        assert (lo, hi) == (150_000, 300_000)
        before = N.nvmlDeviceGetPowerManagementLimit(h)
        if lo <= limit_mw <= hi:
            N.nvmlDeviceSetPowerManagementLimit(h, limit_mw)
            assert N.nvmlDeviceGetPowerManagementLimit(h) == limit_mw
            assert node.read(0)["limit_w"] == limit_mw / 1000
        else:
            with pytest.raises(N.NVMLError_InvalidArgument):
                N.nvmlDeviceSetPowerManagementLimit(h, limit_mw)
            assert N.nvmlDeviceGetPowerManagementLimit(h) == before == 300_000
            assert node.read(0)["limit_w"] == 300.0
    finally:
        N.detach()


def test_uninitialized_refcount_and_invalid_arguments(make_node, simlib, monkeypatch):
    node = make_node(gpus=2)
    for k, v in node.env().items():
        monkeypatch.setenv(k, v)
    lib = ctypes.CDLL(simlib)
    count = ctypes.c_uint()
    handle = ctypes.c_void_p()
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 1  # UNINITIALIZED
    assert lib.nvmlShutdown() == 1
    assert lib.nvmlInitWithFlags(0) == 0
    assert lib.nvmlInit_v2() == 0  # refcount 2
    assert lib.nvmlShutdown() == 0  # refcount 1: still usable
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 and count.value == 2
    assert lib.nvmlDeviceGetHandleByIndex_v2(2, ctypes.byref(handle)) == 2  # out of range
    assert lib.nvmlDeviceGetCount_v2(None) == 2
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
    name = ctypes.create_string_buffer(4)
    assert lib.nvmlDeviceGetName(handle, name, 4) == 7  # INSUFFICIENT_SIZE
    temp = ctypes.c_uint()
    assert lib.nvmlDeviceGetTemperature(handle, 5, ctypes.byref(temp)) == 2  # bad sensor
    assert lib.nvmlDeviceGetPowerUsage(ctypes.c_void_p(12345), ctypes.byref(temp)) == 2
    assert lib.nvmlDeviceGetPowerUsage(None, ctypes.byref(temp)) == 2
    assert lib.nvmlDeviceGetTemperatureThreshold(handle, 4, ctypes.byref(temp)) == 3  # acoustic
    lib.nvmlErrorString.restype = ctypes.c_char_p
    assert lib.nvmlErrorString(15) == b"GPU is lost"
    assert lib.nvmlShutdown() == 0
    assert lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(temp)) == 1  # after last shutdown


def test_set_faults_give_real_error_codes(make_node, nvml):
    node = make_node(gpus=3)
    node.inject(0, "set_no_permission")
    node.inject(1, "set_not_supported")
    N = nvml.attach(node)
    h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
    with pytest.raises(N.NVMLError_NoPermission):
        N.nvmlDeviceSetPowerManagementLimit(h[0], 500_000)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceSetPowerManagementLimit(h[1], 500_000)
    N.nvmlDeviceSetPowerManagementLimit(h[2], 500_000)
    assert [N.nvmlDeviceGetPowerManagementLimit(x) for x in h] == [700_000, 700_000, 500_000]
    node.clear(0, "set_no_permission")
    N.nvmlDeviceSetPowerManagementLimit(h[0], 500_000)
    assert N.nvmlDeviceGetPowerManagementLimit(h[0]) == 500_000


def test_gpu_lost_fails_every_call_for_that_gpu_only(make_node, nvml):
    node = make_node(gpus=2)
    N = nvml.attach(node)
    h0 = N.nvmlDeviceGetHandleByIndex(0)
    node.inject(0, "gpu_lost")
    calls = [
        lambda: N.nvmlDeviceGetHandleByIndex(0),
        lambda: N.nvmlDeviceGetName(h0),
        lambda: N.nvmlDeviceGetUUID(h0),
        lambda: N.nvmlDeviceGetPciInfo(h0),
        lambda: N.nvmlDeviceGetPowerUsage(h0),
        lambda: N.nvmlDeviceGetPowerManagementLimit(h0),
        lambda: N.nvmlDeviceGetPowerManagementLimitConstraints(h0),
        lambda: N.nvmlDeviceGetPowerManagementDefaultLimit(h0),
        lambda: N.nvmlDeviceGetEnforcedPowerLimit(h0),
        lambda: N.nvmlDeviceSetPowerManagementLimit(h0, 500_000),
        lambda: N.nvmlDeviceGetTemperature(h0, 0),
        lambda: N.nvmlDeviceGetTemperatureThreshold(h0, 1),
        lambda: N.nvmlDeviceGetClockInfo(h0, 1),
        lambda: N.nvmlDeviceGetMaxClockInfo(h0, 1),
        lambda: N.nvmlDeviceGetCurrentClocksEventReasons(h0),
        lambda: N.nvmlDeviceGetTotalEnergyConsumption(h0),
        lambda: N.nvmlDeviceGetUtilizationRates(h0),
        lambda: N.nvmlDeviceGetMinorNumber(h0),
    ]
    for call in calls:
        with pytest.raises(N.NVMLError_GpuIsLost):
            call()
    h1 = N.nvmlDeviceGetHandleByIndex(1)
    assert N.nvmlDeviceGetPowerManagementLimit(h1) == 700_000
    node.clear(0, "gpu_lost")
    assert N.nvmlDeviceGetPowerManagementLimit(h0) == 700_000


def test_oob_limit_makes_enforced_lower_than_requested(make_node, nvml):
    node = make_node(gpus=1)
    node.set_load(0, 690.0)
    node.inject(0, "oob_limit", 500.0)
    node.advance(3.0)
    N = nvml.attach(node)
    h = N.nvmlDeviceGetHandleByIndex(0)
    assert N.nvmlDeviceGetPowerManagementLimit(h) == 700_000
    assert N.nvmlDeviceGetEnforcedPowerLimit(h) == 500_000
    assert N.nvmlDeviceGetPowerUsage(h) <= 500_000
    assert N.nvmlDeviceGetCurrentClocksEventReasons(h) & N.nvmlClocksEventReasonSwPowerCap
    node.clear(0, "oob_limit")
    assert N.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000


def test_foreign_writer_keeps_resetting_its_limit(make_node, nvml):
    node = make_node(gpus=1)
    N = nvml.attach(node)
    h = N.nvmlDeviceGetHandleByIndex(0)
    node.inject(0, "foreign_writer", 300.0, period_s=5.0)
    assert N.nvmlDeviceGetPowerManagementLimit(h) == 300_000
    N.nvmlDeviceSetPowerManagementLimit(h, 600_000)
    node.advance(4.9)
    assert N.nvmlDeviceGetPowerManagementLimit(h) == 600_000
    node.advance(0.2)
    assert N.nvmlDeviceGetPowerManagementLimit(h) == 300_000
    node.clear(0, "foreign_writer")
    N.nvmlDeviceSetPowerManagementLimit(h, 600_000)
    node.advance(60.0)
    assert N.nvmlDeviceGetPowerManagementLimit(h) == 600_000


def test_driver_reload_restores_default_limits_and_resets_energy(make_node, nvml):
    node = make_node(gpus=2, pre_job_limit_w=[250.0, 300.0], default_limit_w=480.0)
    node.set_load(0, 400.0)
    N = nvml.attach(node)
    h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    assert [N.nvmlDeviceGetPowerManagementLimit(x) for x in h] == [250_000, 300_000]
    assert N.nvmlDeviceGetPowerManagementDefaultLimit(h[0]) == 480_000
    N.nvmlDeviceSetPowerManagementLimit(h[0], 200_000)
    node.advance(10.0)
    assert N.nvmlDeviceGetTotalEnergyConsumption(h[0]) > 1_000_000
    node.driver_reload()
    assert [N.nvmlDeviceGetPowerManagementLimit(x) for x in h] == [480_000, 480_000]
    assert N.nvmlDeviceGetTotalEnergyConsumption(h[0]) == 0
    node.advance(1.0)
    assert N.nvmlDeviceGetTotalEnergyConsumption(h[0]) == 400_000
    assert node.driver_generation == 1


def test_bad_state_file_is_a_clear_init_error(tmp_path, simlib, monkeypatch):
    from capctl.simgpu.node import NODE_ENV, SimNode

    monkeypatch.delenv(NODE_ENV, raising=False)
    bad = tmp_path / "garbage.state"
    bad.write_bytes(b"x" * 4096)
    good = tmp_path / "good.state"
    SimNode.create(good, gpus=1).close()
    raw = bytearray(good.read_bytes())
    raw[8] = 99  # ABI version
    (tmp_path / "old.state").write_bytes(bytes(raw))
    body = "import json, pynvml as N\ntry:\n    N.nvmlInit(); print('ok')\nexcept N.NVMLError as e:\n    print(type(e).__name__)\n"
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != NODE_ENV}
    env["LD_LIBRARY_PATH"] = os.path.dirname(simlib)
    results = {}
    for case, path in (("unset", None), ("missing", tmp_path / "nope.state"), ("garbage", bad),
                       ("version", tmp_path / "old.state")):
        e = dict(env)
        if path is not None:
            e[NODE_ENV] = str(path)
        r = subprocess.run([sys.executable, "-c", body], env=e, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        results[case] = (r.stdout.strip(), r.stderr)
    assert results["unset"][0] == "NVMLError_DriverNotLoaded" and "CAPCTL_SIMGPU_NODE" in results["unset"][1]
    assert results["missing"][0] == "NVMLError_DriverNotLoaded" and "nope.state" in results["missing"][1]
    assert results["garbage"][0] == "NVMLError_CorruptedInforom" and "bad magic" in results["garbage"][1]
    assert results["version"][0] == "NVMLError_LibRmVersionMismatch"


def test_two_processes_share_one_node(make_node):
    node = make_node(gpus=4, manual_clock=False)
    out = run_pynvml(node, """
        h = N.nvmlDeviceGetHandleByIndex(2)
        N.nvmlDeviceSetPowerManagementLimit(h, 450_000)
        out["limit"] = N.nvmlDeviceGetPowerManagementLimit(h)
    """)
    assert out["limit"] == 450_000
    assert node.read(2)["limit_w"] == 450.0  # this process sees the other's set
    node.set_load(2, 650.0)
    out = run_pynvml(node, """
        h = N.nvmlDeviceGetHandleByIndex(2)
        out["limit"] = N.nvmlDeviceGetPowerManagementLimit(h)
        out["enforced"] = N.nvmlDeviceGetEnforcedPowerLimit(h)
        out["util"] = N.nvmlDeviceGetUtilizationRates(h).gpu
        out["reasons"] = N.nvmlDeviceGetCurrentClocksEventReasons(h)
    """)
    assert out == {"limit": 450_000, "enforced": 450_000, "util": 100, "reasons": 0x4}
