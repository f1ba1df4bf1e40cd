"""NvmlBackend against the compiled simulated driver through the real pynvml (issue 2, section 2)."""

from __future__ import annotations

import logging
import math
import shutil
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capctl.errors import HardwareError, UserInputError
from nodeagent import nvml
from nodeagent.nvml import (
    GpuLostError,
    NvmlBackend,
    NvmlLibraryError,
    NvmlNotSupportedError,
    NvmlPermissionError,
    NvmlUninitializedError,
    decode_clocks_event_reasons,
)
from tests.support.simnodes import child_env, library_path, run_python

pytestmark = pytest.mark.integration


# --- pure logic ---------------------------------------------------------------------------------


def test_clocks_event_reasons_decoded_with_nvml_bit_values():
    from capctl.simgpu.node import REASON_BITS  # the simulated driver's own table of nvml.h bits

    for bit, name in REASON_BITS.items():
        assert decode_clocks_event_reasons(bit) == (name.upper(),)
    assert decode_clocks_event_reasons(0) == ()
    assert decode_clocks_event_reasons(0x4 | 0x40) == ("SW_POWER_CAP", "HW_THERMAL_SLOWDOWN")
    assert decode_clocks_event_reasons(0x1 << 40) == (f"UNKNOWN_{1 << 40:#x}",)


def test_unopened_backend_raises_uninitialized():
    backend = NvmlBackend("simulated")
    with pytest.raises(NvmlUninitializedError, match="open"):
        backend.telemetry(0)
    with pytest.raises(UserInputError, match="relative/libnvidia-ml.so.1"):
        NvmlBackend("relative/libnvidia-ml.so.1")


# --- devices and telemetry ----------------------------------------------------------------------


def test_device_facts_and_thresholds_are_read_from_the_device(make_node, open_backend, caplog):
    slowdown = [89.0] * 7 + [83.0]
    node = make_node(gpus=8, slowdown_temp_c=slowdown, shutdown_temp_c=[92.0] * 7 + [95.0])
    with caplog.at_level(logging.INFO, logger="capctl.nodeagent.nvml"):
        backend = open_backend()
    assert backend.simulated is True
    assert backend.library_path == str(library_path().resolve())
    assert any(
        backend.library_path in r.getMessage() and backend.driver_version in r.getMessage()
        for r in caplog.records
    )
    devices = backend.devices()
    assert [d.index for d in devices] == list(range(8))
    assert len({d.uuid for d in devices}) == 8 and all(d.uuid.startswith("GPU-") for d in devices)
    for d in devices:
        truth = node.read(d.index)
        assert d.error is None
        assert (d.min_cap_w, d.max_cap_w, d.default_cap_w) == (
            truth["min_limit_w"], truth["max_limit_w"], truth["default_limit_w"])
        assert d.slowdown_temp_c == truth["slowdown_temp_c"] == slowdown[d.index]
        assert d.shutdown_temp_c == truth["shutdown_temp_c"]
        assert d.max_sm_clock_mhz == truth["max_sm_clock_mhz"]
    assert devices[7].slowdown_temp_c == 83.0 and devices[7].shutdown_temp_c == 95.0


def test_telemetry_in_watts_matches_the_device(make_node, open_backend):
    node = make_node(gpus=2)
    backend = open_backend()
    node.set_load(0, demand_w=650.0, utilization_pct=97.0)
    backend.set_cap_w(0, 300.0)
    node.advance(5.0)
    sample = backend.telemetry(0)
    truth = node.read(0)
    assert sample.ok
    assert sample.power_w == pytest.approx(truth["power_avg_w"], abs=0.002)
    assert sample.cap_w == 300.0 and sample.enforced_w == 300.0
    assert (sample.min_cap_w, sample.max_cap_w) == (200.0, 700.0)
    assert sample.temp_c == pytest.approx(truth["temp_c"], abs=1.0)
    assert sample.sm_clock_mhz == pytest.approx(truth["sm_clock_mhz"], abs=1.0)
    assert sample.sm_clock_mhz < sample.max_sm_clock_mhz == truth["max_sm_clock_mhz"]
    assert "SW_POWER_CAP" in sample.clocks_event_reasons
    assert sample.clocks_event_reasons == tuple(n.upper() for n in truth["reason_names"])
    assert sample.utilization_pct == 97.0
    assert sample.energy_j == pytest.approx(truth["energy_j"], abs=0.002)
    assert sample.slowdown_temp_c == truth["slowdown_temp_c"]
    idle = backend.telemetry(1)
    assert "SW_POWER_CAP" not in idle.clocks_event_reasons and idle.power_w < sample.power_w


def test_hot_gpu_shows_thermal_reasons_and_clock_drop_and_a_lower_cap_keeps_it_below(
    make_node, open_backend
):
    # GPU 1 has a high thermal resistance: 25 C + 0.14 C/W * ~650 W is far above 89 C.
    node = make_node(gpus=2, thermal_resistance_c_per_w=[0.06, 0.14])
    backend = open_backend()
    for i in (0, 1):
        node.set_load(i, demand_w=650.0)
    node.advance(600.0)
    cool, hot = backend.telemetry(0), backend.telemetry(1)
    assert cool.temp_c < cool.slowdown_temp_c and not any("THERMAL" in r for r in cool.clocks_event_reasons)
    assert hot.temp_c >= hot.slowdown_temp_c - 6.0  # at the threshold (hysteresis band)
    assert {"SW_THERMAL_SLOWDOWN", "HW_THERMAL_SLOWDOWN"} & set(hot.clocks_event_reasons)
    assert hot.sm_clock_mhz <= 0.8 * cool.sm_clock_mhz
    backend.set_cap_w(1, 350.0)
    node.advance(600.0)
    capped = backend.telemetry(1)
    assert capped.temp_c < capped.slowdown_temp_c - 5.0
    assert not any("THERMAL" in r for r in capped.clocks_event_reasons)
    assert "SW_POWER_CAP" in capped.clocks_event_reasons


def test_lost_gpu_is_an_error_marker_in_telemetry_all(make_node, open_backend):
    node = make_node(gpus=8)
    backend = open_backend()
    node.inject(5, "gpu_lost")
    samples = backend.telemetry_all()
    assert [s.index for s in samples] == list(range(8))
    assert [s.ok for s in samples] == [True] * 5 + [False] + [True] * 2
    assert samples[5].error_type == "GpuLostError" and math.isnan(samples[5].power_w)
    with pytest.raises(GpuLostError, match="GPU 5.*GPU_IS_LOST.*reset") as info:
        backend.telemetry(5)
    assert isinstance(info.value, HardwareError) and info.value.exit_code == 5
    node.clear(5, "gpu_lost")
    assert backend.telemetry(5).ok


# --- limits ---------------------------------------------------------------------------------------


def test_cap_below_device_minimum_is_never_requested(make_node, open_backend):
    node = make_node(gpus=2)
    backend = open_backend()
    before = node.read(0)["set_count"]
    result = backend.set_cap_w(0, 150.0)
    assert result.clamped and result.written_w == 200.0 and result.cap_w == 200.0
    assert node.read(0)["limit_w"] == 200.0
    assert node.read(0)["set_count"] == before + 1  # exactly one set, accepted by the driver
    assert backend.clamp_cap_mw(0, 10_000.0) == 700_000


def test_a_clamp_is_logged_once_per_gpu_and_value(make_node, open_backend, caplog):
    make_node(gpus=2)
    backend = open_backend()
    caplog.set_level("WARNING", logger="capctl")

    def clamp_lines():
        return [r.getMessage() for r in caplog.records if "outside the limit constraints" in r.getMessage()]

    backend.set_cap_w(0, 150.0)  # converted twice: by the caller's plan and by the write
    backend.set_cap_w(0, 150.0)
    assert clamp_lines() == ["GPU 0: cap 150.000 W outside the limit constraints 200.000..700.000 W, using 200.000 W"]
    backend.set_cap_w(1, 150.0)  # another GPU, another value: each logged
    backend.set_cap_w(0, 120.0)
    backend.set_cap_w(0, 300.0)  # inside: nothing
    backend.set_cap_w(0, 150.0)  # back to the first value after another: logged again
    assert [ln.split(":")[0] + " " + ln.split()[3] for ln in clamp_lines()] == [
        "GPU 0 150.000", "GPU 1 150.000", "GPU 0 120.000", "GPU 0 150.000"]


def test_policy_minimum_below_device_minimum_is_rejected(make_node, open_backend):
    node = make_node(gpus=2)
    backend = open_backend()
    before = node.read(0)["set_count"]
    with pytest.raises(UserInputError) as info:
        backend.clamp_cap_mw(0, 250.0, policy_min_w=150.0)
    message = str(info.value)
    assert "min_cap_w" in message and "150" in message and "200..700 W" in message
    with pytest.raises(UserInputError, match="max_cap_w: 800 W is above"):
        backend.validate_policy_limits_w(1, 200.0, 800.0, field="policy.gpu_models.H100")
    backend.validate_policy_limits_w(1, 200.0, 700.0)  # in range: no error
    assert backend.clamp_cap_mw(0, 250.0, policy_min_w=200.0) == 250_000
    assert node.read(0)["set_count"] == before


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "300", None, True])
def test_non_finite_caps_are_rejected(make_node, open_backend, bad):
    make_node(gpus=1)
    backend = open_backend()
    with pytest.raises(UserInputError, match="cap_w"):
        backend.set_cap_w(0, bad)


def test_rounding_keeps_caps_inside_a_100_w_minimum(make_node, open_backend):
    node = make_node(gpus=1, model="A100-SXM4")
    backend = open_backend()
    assert backend.clamp_cap_mw(0, 99.9999999999) == 100_000  # never 99 999 mW
    assert backend.clamp_cap_mw(0, 99.9994) == 100_000  # below the minimum: the minimum
    assert backend.clamp_cap_mw(0, 250.0004) == 250_000  # down to whole mW, never above the ask
    assert backend.clamp_cap_mw(0, 0.1 + 0.2 + 249.7) == 250_000  # float noise removed
    assert backend.set_cap_w(0, 99.9999999999).cap_w == 100.0
    assert node.read(0)["limit_w"] == 100.0


def test_clamped_caps_always_lie_inside_the_constraints(make_node, open_backend):
    make_node(gpus=1, model="A100-SXM4")
    backend = open_backend()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))
    def check(cap_w):
        value_mw = backend.clamp_cap_mw(0, cap_w)
        assert isinstance(value_mw, int) and 100_000 <= value_mw <= 400_000
        if 100.0 <= cap_w <= 400.0:
            assert value_mw <= cap_w * 1000.0 + 1e-3 and value_mw > cap_w * 1000.0 - 1.0

    check()


def test_set_reads_back_the_enforced_limit(make_node, open_backend):
    node = make_node(gpus=1)
    backend = open_backend()
    node.inject(0, "oob_limit", 500.0)
    result = backend.set_cap_w(0, 700.0)
    assert (result.cap_w, result.enforced_w) == (700.0, 500.0)
    assert (backend.get_cap_w(0), backend.get_enforced_w(0)) == (700.0, 500.0)


@pytest.mark.parametrize("euid", [1000, 0])
def test_no_permission_gives_a_clear_message_with_remedy(make_node, open_backend, monkeypatch, euid):
    from nodeagent import nvml

    monkeypatch.setattr(nvml.os, "geteuid", lambda: euid)
    node = make_node(gpus=4)
    backend = open_backend()
    node.inject(2, "set_no_permission")
    with pytest.raises(NvmlPermissionError) as info:
        backend.set_cap_w(2, 300.0)
    message = str(info.value)
    assert "GPU 2" in message and "NO_PERMISSION" in message
    if euid:  # not root: that is the remedy
        assert "root or CAP_SYS_ADMIN" in message
    else:  # root already (found by a try-out: "run capctl-agent as root" said to a root agent)
        assert "runs as root: the power limit may be locked" in message and "run capctl-agent as root" not in message
    assert info.value.exit_code == 5 and info.value.gpu_index == 2
    assert node.read(2)["limit_w"] == 700.0
    node.inject(3, "set_not_supported")
    with pytest.raises(NvmlNotSupportedError, match="GPU 3.*NOT_SUPPORTED.*does not allow power limits"):
        backend.set_cap_w(3, 300.0)
    assert backend.set_cap_w(1, 300.0).cap_w == 300.0  # other GPUs unaffected


# --- processes and libraries --------------------------------------------------------------------

CHILD_SET = textwrap.dedent(
    """
    import json
    from nodeagent.nvml import NvmlBackend
    with NvmlBackend("simulated") as b:
        seen = b.get_cap_w(2)
        for k in range(200):
            b.set_cap_w(1, 300.0 + (k % 50))
        b.set_cap_w(1, 321.5)
        print("RESULT " + json.dumps({"seen_2": seen, "cap_1": b.get_cap_w(1)}))
    """
)


def test_two_processes_share_one_node(make_node, open_backend):
    node = make_node(gpus=4)
    backend = open_backend()
    backend.set_cap_w(2, 333.0)
    rc, result, err = run_python(CHILD_SET, child_env(node))
    assert rc == 0, err
    assert result == {"seen_2": 333.0, "cap_1": 321.5}
    assert backend.get_cap_w(1) == 321.5 and node.read(1)["limit_w"] == 321.5
    assert backend.telemetry(1).cap_w == 321.5


CHILD_OPEN = textwrap.dedent(
    """
    import json, sys
    from nodeagent.nvml import NvmlBackend, NvmlLibraryError
    kwargs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    try:
        b = NvmlBackend(**kwargs).open()
    except NvmlLibraryError as err:
        print("RESULT " + json.dumps({"error": str(err), "exit_code": err.exit_code}))
    else:
        print("RESULT " + json.dumps({"opened": b.library_path, "simulated": b.simulated}))
    """
)


def _child_open(env, **kwargs):
    code = f"import sys; sys.argv = ['x', {repr(__import__('json').dumps(kwargs))}]\n" + CHILD_OPEN
    rc, result, err = run_python(code, env)
    assert rc == 0 and result is not None, err
    return result


def test_ld_library_path_cannot_point_the_system_backend_at_the_simulated_driver(make_node, tmp_path):
    node = make_node(gpus=2)
    sim = str(library_path().resolve())
    env = child_env(node, LD_LIBRARY_PATH=str(library_path().parent))
    result = _child_open(env, library="system")
    assert result["exit_code"] == 5
    assert "refusing the simulated NVML driver" in result["error"] and sim in result["error"]
    assert "LD_LIBRARY_PATH" in result["error"]
    # a copy of the simulated driver configured by absolute path is refused too, unless allowed
    copy = tmp_path / "lib" / "libnvidia-ml.so.1"
    copy.parent.mkdir()
    shutil.copy(sim, copy)
    assert "refusing the simulated" in _child_open(child_env(node), library=str(copy))["error"]
    opened = _child_open(child_env(node), library=str(copy), allow_simulated=True)
    assert opened == {"opened": str(copy), "simulated": True}


def test_missing_or_other_library_paths_are_refused(make_node, open_backend, tmp_path):
    node = make_node(gpus=2)
    missing = tmp_path / "nope" / "libnvidia-ml.so.1"
    with pytest.raises(NvmlLibraryError, match=f"{missing} does not exist"):
        NvmlBackend(str(missing), allow_simulated=True).open()
    # "simulated" pointed (via CAPCTL_SIMNVML_LIB) at a file that is not there
    result = _child_open(child_env(node, CAPCTL_SIMNVML_LIB=str(missing)), library="simulated")
    assert "does not exist" in result["error"] and "make build" in result["error"]
    # this process already holds the simulated driver: a different file cannot silently replace it
    open_backend()
    copy = tmp_path / "libnvidia-ml.so.1"
    shutil.copy(library_path(), copy)
    with pytest.raises(NvmlLibraryError, match="but .* is loaded .*already loaded earlier"):
        NvmlBackend(str(copy), allow_simulated=True).open()
    with pytest.raises(NvmlLibraryError, match="refusing the simulated NVML driver"):
        NvmlBackend("system").open()


def test_system_library_absent_gives_a_clear_error(make_node):
    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a real NVML library")  # not a missing real part
    node = make_node(gpus=1)
    env = child_env(node)
    env.pop("LD_LIBRARY_PATH", None)
    result = _child_open(env, library="system")
    assert "cannot load libnvidia-ml.so.1" in result["error"]
    assert "install the NVIDIA driver" in result["error"]


def test_simulated_marker_is_exported_by_the_simulated_driver():
    from tests.conftest import require
    from tests.support.simnodes import sim_library_built

    require(sim_library_built(), "simulated NVML library not built (make build)")
    # the refusal recognises the simulated driver by this prefix in its dynamic symbol table
    assert nvml.SIMULATED_SYMBOL_PREFIX + b"abi_version" in library_path().read_bytes()
    assert nvml._is_simulated_file(str(library_path()))
    assert not nvml._is_simulated_file(__file__.replace(".py", ".nonexistent"))


def test_gpu_lost_at_open_is_marked_and_read_again_later(make_node, open_backend):
    node = make_node(gpus=3)
    node.inject(1, "gpu_lost")
    backend = open_backend()
    devices = backend.devices()
    assert devices[0].error is None and devices[2].error is None
    assert "GPU_IS_LOST" in devices[1].error and math.isnan(devices[1].min_cap_w)
    # per GPU too, as the agent's call guard reads them: the lost GPU carries its error (it raised
    # GpuLostError from its handle, and the agent exited at start: found by a review)
    from nodeagent.callguard import GuardedBackend

    assert "GPU_IS_LOST" in backend.device(1).error
    guarded = GuardedBackend(backend, 2.0)
    try:
        listed = guarded.devices()
        assert [d.index for d in listed] == [0, 1, 2] and "GPU_IS_LOST" in listed[1].error and listed[0].error is None
    finally:
        for worker in guarded._workers.values():  # (its workers only: the backend is used below)
            worker.stop()
    node.clear(1, "gpu_lost")
    again = backend.devices()[1]
    assert again.error is None and again.min_cap_w == 200.0 and again.uuid.startswith("GPU-")
    assert backend.telemetry(1).slowdown_temp_c == again.slowdown_temp_c


# --- utilization rates (issue 12, item 8: the memory-bound share) -------------------------------


def test_memory_utilization_is_the_memory_busy_share_of_the_step_at_its_clock(make_node, open_backend):
    from capctl.sim.policies import nvml_memory_utilization_pct

    node = make_node(gpus=3)
    backend = open_backend()
    node.set_load(0, demand_w=650.0, utilization_pct=100.0, memory_bound_fraction=0.4)
    node.set_load(1, demand_w=650.0, utilization_pct=80.0, memory_bound_fraction=0.0)
    backend.set_cap_w(0, 300.0)
    node.advance(5.0)
    s0, s1, idle = (backend.telemetry(i) for i in range(3))
    r = node.read(0)["sm_clock_mhz"] / node.read(0)["max_sm_clock_mhz"]
    assert r < 0.9  # capped: the clock is low, so the memory-busy share is below m
    assert s0.memory_utilization_pct == round(100.0 * 0.4 / (0.4 + 0.6 / r)) < 40
    assert (s1.utilization_pct, s1.memory_utilization_pct) == (80.0, 0.0)
    assert idle.memory_utilization_pct == 0.0
    # the what-if simulator's Capctl policy computes what this driver returns
    state = node.state()
    sim = nvml_memory_utilization_pct(state, float(state["max_sm_clock_mhz"][0]))
    assert sim.tolist() == [s0.memory_utilization_pct, s1.memory_utilization_pct, idle.memory_utilization_pct]


def test_utilization_not_supported_or_out_of_range_is_left_out_never_a_failed_sample(
        make_node, open_backend, monkeypatch, caplog):
    import pynvml

    from nodeagent.messages import gpu_telemetry

    make_node(gpus=2)
    backend = open_backend()
    real = pynvml.nvmlDeviceGetUtilizationRates
    answers = {}

    def fake(handle):
        a = answers.get(pynvml.nvmlDeviceGetIndex(handle))
        if isinstance(a, Exception):
            raise a
        return a if a is not None else real(handle)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", fake)
    answers[0] = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    answers[1] = pynvml.c_nvmlUtilization_t(gpu=90, memory=250)
    with caplog.at_level(logging.WARNING, logger="capctl.nodeagent.nvml"):
        for _ in range(3):
            unsupported, bad = backend.telemetry(0), backend.telemetry(1)
    assert unsupported.ok and bad.ok and unsupported.power_w >= 0 and bad.enforced_w > 0
    assert math.isnan(unsupported.utilization_pct) and math.isnan(unsupported.memory_utilization_pct)
    assert bad.utilization_pct == 90.0 and math.isnan(bad.memory_utilization_pct)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one line per GPU and problem, not one per sample
    assert "GPU 0" in lines[0] and "NVML_ERROR_NOT_SUPPORTED" in lines[0] and "capctl bug" not in lines[0]
    assert "GPU 1" in lines[1] and "memory utilization 250" in lines[1] and "0-100" in lines[1]
    for s in (unsupported, bad):  # the report leaves the field out
        t = gpu_telemetry(s, state="OK", job_ids=(), error="", pre_job_cap_w=0.0)
        assert not t.HasField("utilization_rates") and t.enforced_w > 0
    answers.clear()  # the device answers again: the value is back
    good = backend.telemetry(1)
    t = gpu_telemetry(good, state="OK", job_ids=(), error="", pre_job_cap_w=0.0)
    assert t.HasField("utilization_rates") and t.utilization_rates.memory_pct == good.memory_utilization_pct


def test_a_limit_outside_usable_constraints_is_bad_device_data():
    # a limit within 1 W of the constraints agrees with them; further out it contradicts them (the
    # GPU is held); constraints that are unusable anyway ((0, 0), min > max) are judged elsewhere
    from nodeagent.nvml import _limit_outside

    assert _limit_outside(1, 200_000, 700_000, 604_000) == ""
    assert _limit_outside(1, 200_000, 700_000, 199_001) == "" and _limit_outside(1, 200_000, 700_000, 700_999) == ""
    held = _limit_outside(1, 650_000, 700_000, 604_264)
    assert held.startswith("power limit 604.264 W read from the device is outside its limit constraints "
                           "650..700 W (bad device data)") and "capctl bug" not in held
    assert _limit_outside(1, 200_000, 700_000, 701_001) != ""
    assert _limit_outside(1, 0, 0, 700_000) == "" and _limit_outside(1, 700_000, 200_000, 400_000) == ""
