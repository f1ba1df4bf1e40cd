"""Physics of the simulated GPUs (csrc/simnvml/physics.c) through the control API and pynvml."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capctl.simgpu.node import SimInputError, SimNode, steady_state
from capctl.simgpu.profiles import all_profiles, get

pytestmark = pytest.mark.integration

HOT = dict(thermal_resistance_c_per_w=0.1, tau_s=10.0, speed=1.0)  # 25 C + 0.1 C/W * 700 W = 95 C


def _run_until(node, index, pred, dt_s=0.05, limit_s=600.0):
    """Advance in small steps until pred(read) holds; return (previous read, read)."""
    prev = node.read(index)
    t = 0.0
    while t < limit_s:
        node.advance(dt_s)
        t += dt_s
        cur = node.read(index)
        if pred(cur):
            return prev, cur
        prev = cur
    raise AssertionError(f"condition not reached within {limit_s} s; last {prev}")


def test_hot_gpu_crosses_slowdown_with_thermal_bits_and_clock_drop(make_node, nvml):
    node = make_node(gpus=2, **HOT)
    node.set_load(0, 700.0)
    before, after = _run_until(node, 0, lambda r: r["throttled"])
    assert before["temp_c"] < 89.0 and abs(after["temp_c"] - 89.0) < 0.5
    assert before["sm_clock_mhz"] == 1980.0
    drop = 1.0 - after["sm_clock_mhz"] / before["sm_clock_mhz"]
    assert 0.25 <= drop <= 0.35
    assert {"hw_thermal_slowdown", "sw_thermal_slowdown"} <= set(after["reason_names"])
    assert after["rate"] < before["rate"]
    N = nvml.attach(node)
    h = N.nvmlDeviceGetHandleByIndex(0)
    reasons = N.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert reasons & N.nvmlClocksThrottleReasonHwThermalSlowdown
    assert reasons & N.nvmlClocksEventReasonSwThermalSlowdown
    assert N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM) == after["sm_clock_mhz"]
    slowdown = N.nvmlDeviceGetTemperatureThreshold(h, N.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    assert N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU) >= slowdown - 5
    # hysteresis: it cools, recovers the full clock below slowdown - 5 C, then heats again
    _, recovered = _run_until(node, 0, lambda r: not r["throttled"])
    assert recovered["temp_c"] <= 84.0 + 0.1 and recovered["sm_clock_mhz"] == 1980.0


def test_lower_cap_keeps_the_hot_gpu_below_slowdown(make_node):
    node = make_node(gpus=1, **HOT)
    node.set_limits_w([550.0])  # 25 + 0.1 * 550 = 80 C steady
    node.set_load(0, 700.0)
    temps, reasons = [], 0
    for _ in range(300):
        node.advance(1.0)
        r = node.read(0)
        temps.append(r["temp_c"])
        reasons |= r["reasons"]
    assert max(temps) < 89.0 and temps[-1] > 75.0
    assert reasons & 0x60 == 0 and reasons & 0x4  # never thermal, cap binds


def test_progress_matches_steady_state_curve_including_thermal_cycle(make_node):
    node = make_node(gpus=2, **HOT)
    node.set_limits_w([700.0, 450.0])
    for i in range(2):
        node.set_load(i, 700.0, memory_bound_fraction=0.25)
    node.advance(300.0)  # settle into the limit cycle / steady state
    p0 = [node.read(i)["progress"] for i in range(2)]
    node.advance(1200.0)
    for i, cap in enumerate((700.0, 450.0)):
        r = node.read(i)
        measured = (r["progress"] - p0[i]) / 1200.0
        rate, power, _ = steady_state(r, cap)
        assert measured == pytest.approx(rate, rel=0.01)
    assert steady_state(node.read(0), 700.0, thermal=False)[0] > steady_state(node.read(0), 700.0)[0]


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from([p.name for p in all_profiles()]),
    demand_frac=st.floats(0.6, 1.2),
    m=st.floats(0.0, 0.9),
    speed=st.floats(0.78, 1.0),
)
def test_steady_state_rate_is_increasing_and_concave_in_cap(simlib, model, demand_frac, m, speed):
    prof = get(model)
    demand = prof.max_limit_w * demand_frac
    caps = np.linspace(prof.min_limit_w, prof.max_limit_w, 101)
    kw = dict(demand_w=demand, memory_bound_fraction=m, speed=speed, thermal=False)
    rate, power, clock = steady_state(model, caps, quantized=False, **kw)
    assert np.all(np.diff(rate) >= -1e-12)
    assert np.all(np.diff(rate, 2) <= 1e-9)  # concave
    assert np.all(power <= np.maximum(caps, prof.idle_w) + 1e-9)
    assert np.all(clock <= prof.max_sm_clock_mhz)
    # the simulator's 15 MHz grid stays within one step below the continuous curve
    rq, pq, cq = steady_state(model, caps, quantized=True, **kw)
    assert np.all(cq % 15 == 0) and np.all(np.diff(rq) >= -1e-12)
    assert np.all((clock - cq >= -1e-9) & (clock - cq < 15.0 + 1e-9))
    assert np.all(pq <= caps + 1e-9)


def test_simulated_operating_point_equals_steady_state(make_node):
    node = make_node(gpus=1, thermal_resistance_c_per_w=0.05)
    node.set_load(0, 600.0, memory_bound_fraction=0.4)
    for cap in (200.0, 333.3, 480.0, 700.0):
        node.set_limits_w([cap])
        node.advance(2.0)
        r = node.read(0)
        rate, power, clock = steady_state(r, cap)
        assert (r["rate"], r["power_w"], r["sm_clock_mhz"]) == pytest.approx((rate, power, clock))


def test_power_reading_is_a_one_second_average_on_hopper(make_node):
    node = make_node(gpus=1, model="H100-SXM")
    node.set_load(0, 650.0)
    node.advance(5.0)
    node.set_limits_w([300.0])
    p_new = node.read(0)["power_w"]
    assert p_new < 300.0
    node.advance(0.25)
    r = node.read(0)
    assert r["power_avg_w"] == pytest.approx(0.75 * 650.0 + 0.25 * p_new)
    node.advance(0.5)
    assert node.read(0)["power_avg_w"] == pytest.approx(0.25 * 650.0 + 0.75 * p_new)
    node.advance(0.25)
    assert node.read(0)["power_avg_w"] == pytest.approx(p_new)


def test_power_reading_is_instantaneous_on_ga100(make_node):
    node = make_node(gpus=1, model="A100-SXM4")
    node.set_load(0, 380.0)
    node.advance(5.0)
    node.set_limits_w([200.0])
    node.advance(0.1)
    r = node.read(0)
    assert r["power_avg_w"] == r["power_w"] < 200.0


def test_energy_counter_is_the_integral_of_power(make_node):
    node = make_node(gpus=1, thermal_resistance_c_per_w=0.05)
    node.set_load(0, 500.0)
    e0 = node.read(0)["energy_j"]
    node.advance(10.0)
    node.set_limits_w([300.0])
    p = node.read(0)["power_w"]
    node.advance(4.0)
    assert node.read(0)["energy_j"] - e0 == pytest.approx(500.0 * 10.0 + p * 4.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.floats(0.001, 1.0), min_size=1, max_size=40))
def test_integration_is_exact_for_any_step_split(simlib, cuts):
    total_s = 120.0
    a = SimNode.create(None, gpus=1, manual_clock=True, **HOT)
    b = SimNode.create(None, gpus=1, manual_clock=True, **HOT)
    try:
        for n in (a, b):
            n.set_load(0, 700.0)
        a.advance(total_s)
        w = np.array(cuts) / sum(cuts) * total_s
        for dt in w:
            b.advance(float(dt))
        ra, rb = a.read(0), b.read(0)
        for key in ("temp_c", "energy_j", "progress"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), key
        assert ra["throttled"] == rb["throttled"]
    finally:
        a.close()
        b.close()


def test_gpu_variation_matches_sinha_et_al(simlib):
    with SimNode.create(None, gpus=4000, seed=7, manual_clock=True) as node:
        s = node.state()
        slow = 1.0 - s["speed"]
        assert 0.07 <= slow.mean() <= 0.09
        assert slow.max() <= 0.22 + 1e-12 and slow.max() > 0.2
        r = s["thermal_resistance_c_per_w"]
        assert r.std() > 0 and r.min() > 0


def test_large_in_memory_node_steps_vectorized(simlib):
    with SimNode.create(None, gpus=100_000, seed=1, manual_clock=True) as node:
        node.set_limits_w(np.full(100_000, 500.0))
        node.set_loads(np.full(50_000, 650.0), indices=np.arange(0, 100_000, 2))
        s = node.state()
        assert s.shape == (100_000,) and np.all(s["limit_w"] == 500.0)
        node.advance(1.0)
        s = node.state(sync=False)
        assert np.all(s["t_s"] == 1.0)
        assert np.all(s["energy_j"][1::2] == 75.0)  # idle
        assert np.all((s["energy_j"][::2] > 400.0) & (s["energy_j"][::2] <= 500.0))  # capped
        with pytest.raises(SimInputError, match="demand_w -1"):
            node.set_loads([100.0, -1.0])
        assert node.read(0)["demand_w"] == 650.0  # nothing changed


def test_real_clock_advances_lazily(make_node):
    node = make_node(gpus=1, manual_clock=False)
    node.set_load(0, 400.0)
    t0 = node.now_s()
    e0 = node.read(0)["energy_j"]
    time.sleep(0.2)
    e1 = node.read(0)["energy_j"]
    t1 = node.now_s()
    assert 400.0 * 0.15 < e1 - e0 <= 400.0 * (t1 - t0) + 1e-6
    with pytest.raises(Exception, match="manual clock"):
        node.advance(1.0)


def test_thermal_shutdown_loses_the_gpu(make_node):
    node = make_node(gpus=1, thermal_resistance_c_per_w=0.35, tau_s=5.0)  # throttled: 126 C > 92 C
    node.set_load(0, 700.0)
    node.advance(120.0)
    r = node.read(0)
    assert r["lost"] and r["thermal_shutdown"] and r["power_w"] == 0.0


def test_concurrent_threads_keep_state_consistent(make_node):
    node = make_node(gpus=4)
    errors = []

    def worker(k):
        try:
            for j in range(200):
                node.set_limits_w([200.0 + (k * 37 + j) % 500], [k])
                r = node.read(k)
                assert 200.0 <= r["limit_w"] <= 700.0
        except Exception as err:  # noqa: BLE001 - collected for the assertion below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [node.read(k)["set_count"] for k in range(4)] == [200] * 4


_OPS = st.one_of(
    st.tuples(st.just("limit"), st.floats(200.0, 700.0)),
    st.tuples(st.just("load"), st.floats(0.0, 900.0)),
    st.tuples(st.just("oob"), st.floats(100.0, 800.0)),
    st.tuples(st.just("clear_oob"), st.just(0.0)),
    st.tuples(st.just("inlet"), st.floats(15.0, 45.0)),
    st.tuples(st.just("advance"), st.floats(0.0, 60.0)),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_OPS, min_size=1, max_size=30), r=st.floats(0.03, 0.12))
def test_invariants_hold_for_any_operation_sequence(simlib, ops, r):
    with SimNode.create(None, gpus=1, manual_clock=True, thermal_resistance_c_per_w=r,
                        tau_s=8.0, shutdown_temp_c=150.0) as node:
        oob = None
        prev = node.read(0)
        max_power_w = 75.0
        for op, v in ops:
            if op == "limit":
                node.set_limits_w([v])
            elif op == "load":
                node.set_load(0, v)
            elif op == "oob":
                node.inject(0, "oob_limit", v)
                oob = v
            elif op == "clear_oob":
                node.clear(0, "oob_limit")
                oob = None
            elif op == "inlet":
                node.set_inlet(0, v)
            else:
                node.advance(v)
            g = node.read(0)
            max_power_w = max(max_power_w, g["demand_w"])
            assert g["enforced_w"] == (min(g["limit_w"], oob) if oob else g["limit_w"])
            assert g["sm_clock_mhz"] % 15 == 0 and g["sm_clock_mhz"] <= 1980
            if g["demand_w"] > 0 and g["sm_clock_mhz"] > 345:
                assert g["power_w"] <= max(g["enforced_w"], 75.0) + 1e-9
            assert bool(g["reasons"] & 0x4) == (g["demand_w"] > max(g["enforced_w"], 75.0))
            assert bool(g["reasons"] & 0x40) == g["throttled"]
            assert g["energy_j"] >= prev["energy_j"] and g["progress"] >= prev["progress"]
            assert 0.0 <= g["power_avg_w"] <= max_power_w + 1e-6
            prev = g


def test_set_loads_scalar_applies_to_every_gpu(tmp_path):
    """A scalar demand in set_loads sets every GPU (regression: only GPU 0 was set)."""
    from capctl.simgpu.node import SimNode

    with SimNode.create(tmp_path / "n.state", gpus=4, manual_clock=True) as node:
        node.set_loads(650.0, utilization_pct=80.0)
        assert [node.read(i)["demand_w"] for i in range(4)] == [650.0] * 4
        assert [node.read(i)["utilization_pct"] for i in range(4)] == [80.0] * 4
        node.set_loads(300.0, indices=[1, 3])
        assert [node.read(i)["demand_w"] for i in range(4)] == [650.0, 300.0, 650.0, 300.0]


def test_power_factor_lowers_the_clock_under_a_cap_and_raises_uncapped_power(simlib):
    # Sinha et al. SC'22: same-SKU GPUs need different power for the same clock; under one cap the
    # less efficient part runs a lower SM clock (what NVML shows), uncapped it draws more
    factors = [1.0, 1.3, 1.8]
    with SimNode.create(None, gpus=3, manual_clock=True, speed=1.0, power_factor=factors) as node:
        node.set_loads(np.full(3, 600.0))
        node.advance(5.0)
        s = node.state()
        idle = get("H100-SXM").idle_w
        uncapped = idle + np.array(factors) * (600.0 - idle)
        # 700 W limit: the nominal part runs uncapped at max clock, the others hit the limit
        assert s["sm_clock_mhz"][0] == get("H100-SXM").max_sm_clock_mhz
        assert s["power_w"][0] == pytest.approx(uncapped[0])
        assert s["power_w"][1] == pytest.approx(min(uncapped[1], 700.0), abs=20.0)
        node.set_limits_w(np.full(3, 450.0))
        node.advance(5.0)
        s = node.state()
        clk = s["sm_clock_mhz"]
        assert clk[0] > clk[1] > clk[2]
        assert np.all(s["power_w"] <= 450.0 + 1e-9) and np.all(s["power_w"] > 430.0)
        assert s["rate"][0] > s["rate"][1] > s["rate"][2]
        # cube law: clock ratio ~ (1 / k)^(1/3) (15 MHz grid)
        assert clk[2] / clk[0] == pytest.approx((1.0 / 1.8) ** (1.0 / 3.0), abs=0.02)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.floats(0.6, 2.2), cap=st.floats(200.0, 700.0), demand=st.floats(300.0, 700.0))
def test_power_factor_is_a_rescaling_of_the_dynamic_power(simlib, k, cap, demand):
    # a part with factor k at cap P runs exactly as a nominal part at P_static + (P - P_static) / k
    idle = get("H100-SXM").idle_w
    kw = dict(demand_w=demand, memory_bound_fraction=0.3, speed=1.0, thermal=False, quantized=False)
    r_k, _, f_k = steady_state("H100-SXM", cap, power_factor=k, **kw)
    r_1, _, f_1 = steady_state("H100-SXM", idle + (cap - idle) / k, power_factor=1.0, **kw)
    assert r_k == pytest.approx(r_1, rel=1e-9) and f_k == pytest.approx(f_1, rel=1e-9)


def test_power_factor_out_of_range_is_refused(simlib):
    with SimNode.create(None, gpus=1, manual_clock=True) as node:
        with pytest.raises(SimInputError, match="power_factor"):
            node.set_param(0, "power_factor", 9.0)
        assert node.read(0)["power_factor"] == 1.0


def test_continuous_clock_follows_the_cap_off_the_15_mhz_grid(simlib):
    """The ``continuous_clock`` plant (the pace loop's tests): the SM clock is the cube law's,
    not quantized; cleared, the 15 MHz steps are back."""
    with SimNode.create(None, gpus=1, manual_clock=True) as node:
        node.set_load(0, 650.0)
        clocks = []
        for cap in (400.0, 401.0, 402.5, 431.0):
            node.set_limits_w([cap])
            node.advance(0.5)
            clocks.append(node.read(0)["sm_clock_mhz"])
        assert all(c % 15 == 0 for c in clocks) and len(set(clocks)) <= 2  # steps: 400-402.5 W one step
        node.inject(0, "continuous_clock")
        assert "continuous_clock" in node.read(0)["faults"]
        seen = []
        for cap in (400.0, 401.0, 402.5, 431.0):
            node.set_limits_w([cap])
            node.advance(0.5)
            g = node.read(0)
            seen.append(g["sm_clock_mhz"])
            assert g["power_w"] == pytest.approx(cap, abs=1e-6)  # the clock whose power is the cap
        assert seen == sorted(seen) and len(set(seen)) == 4 and any(c % 15 for c in seen)
        node.clear(0, "continuous_clock")
        node.advance(0.5)
        assert node.read(0)["sm_clock_mhz"] % 15 == 0 and "continuous_clock" not in node.read(0)["faults"]


@pytest.mark.parametrize("kwargs", [dict(gpus=True), dict(gpus=2, seed=True), dict(gpus=2, seed=2 ** 64)])
def test_create_refuses_booleans_and_seeds_that_would_wrap(simlib, kwargs):
    """``gpus=True`` made one GPU, ``seed=True`` seed 1 and seeds from 2**64 up wrapped to others
    (found by a review)."""
    with pytest.raises(SimInputError, match="gpus True is not an integer|seed .* is invalid"):
        SimNode.create(None, manual_clock=True, **kwargs)
