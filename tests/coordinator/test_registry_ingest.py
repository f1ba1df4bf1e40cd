"""The registry's inlined hot loops equal their per-GPU definitions (issue 12, item 7).

The same messages packed (``GpuReadings``, :mod:`capctl.readings`) leave a third registry equal
to both: the packed path records exactly what the per-GPU messages say.

``Registry._record_gpus`` (telemetry) and ``Registry.on_ack`` inline :meth:`Registry._reading`
and the throttling history (per GPU then, per node now: :mod:`coordinator.throttle`'s lanes,
compared with per-GPU sample lists); ``gpucolumns.pending_top_w`` visits only non-empty pending
dicts. Each is compared here with the per-GPU code it replaced (kept below as the reference,
verbatim from the previous version) on seeded random messages: zero read-backs, unusable
constraints, reason sets, missing utilization rates, energy counters that reset, GPUs bound to
one job or to two; every ``GpuObs`` field, sample and job energy equal (floats within 1e-9).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np

from capctl import capstates, readings
from capctl.v1 import capctl_pb2 as pb
from coordinator import gpucolumns
from coordinator import registry as R
from coordinator.registry import Binding, GpuObs, NodeObs, Registry, Sample

REASONS = ((), ("SW_POWER_CAP",), ("SW_THERMAL_SLOWDOWN",), ("HW_SLOWDOWN",), ("SW_POWER_CAP", "HW_SLOWDOWN"),
           ("HW_SLOWDOWN", "HW_THERMAL_SLOWDOWN"))
NAMES = ("", "OK", "OOB_LIMITED", "SAFE_CAP", "FOREIGN_WRITER", "weird")


def _reference_record(reg: Registry, node: NodeObs, msg, now: float, hist: dict) -> None:
    """The per-GPU telemetry loop before it was inlined (through ``_reading``); the throttling
    samples of each GPU go to ``hist`` ((node, index) -> [(time, thermal, power)])."""
    energy_seen = reg._energy_seen.setdefault(node.name, {})
    for t in msg.gpus:
        g = node.gpus.get(t.index)
        if g is None:
            continue
        if not reg._reading(g, _row(t)):
            continue
        reasons = tuple(t.clocks_event_reasons)
        g.power_w, g.temp_c, g.sm_clock_mhz, g.reasons = t.power_w, t.temp_c, t.sm_clock_mhz, reasons
        g.utilization_pct = t.utilization_pct
        mem_pct = t.utilization_rates.memory_pct if t.HasField("utilization_rates") else math.nan
        g.memory_utilization_pct = mem_pct
        g.job_id, g.error = t.job_id, t.error
        g.reading_live = True
        if g.constraints_problem:  # held for the hello's constraints: the detail says so and what the agent reports
            g.error = R.held_detail(g.min_cap_w, g.max_cap_w, capstates.name_of_wire(t.cap_state, t.cap_state_name),
                                    t.error)
        thermal, power, stuck = R.reason_flags(reasons)
        hist.setdefault((node.name, t.index), []).append((now, thermal, power))
        g.sample_enforced_w, g.sample_mono = t.enforced_w, now
        g.slowdown_run = g.slowdown_run + 1 if (t.utilization_pct >= 20.0 and stuck) else 0
        if len(g.new_samples) < 1024:
            g.new_samples.append(Sample(now, t.power_w, t.enforced_w, t.temp_c, float(t.sm_clock_mhz), reasons,
                                        t.utilization_pct, mem_pct))
        if not 0.0 <= t.energy_j <= 1e18:
            continue  # no counter value: nothing charged (the rule since a review found inf charged)
        prev = energy_seen.get(t.index)
        energy_seen[t.index] = (t.energy_j, now)
        g.energy_j = t.energy_j
        # a jump beyond what the largest board draws since the last value is not charged
        if prev is not None and prev[0] <= t.energy_j <= prev[0] + 5000.0 * (now - prev[1] + R.ENERGY_SLACK_S):
            # Registry.job_of's loop before it read gpu_jobs: the first binding of the GPU
            job = next((b.job_id for b in node.bindings.values() if t.index in b.gpu_indices), "")
            if job:
                reg.job_energy_j[job] += t.energy_j - prev[0]


def _reference_ack(reg: Registry, node: NodeObs, ack, now: float) -> None:
    """``Registry.on_ack``'s GPU loop before it was inlined."""
    seen = set()
    for t in ack.gpus:
        g = node.gpus.get(t.index)
        if g is None or not reg._reading(g, _row(t)):
            continue
        seen.add(t.index)
        g.last_ack_w, g.last_ack_mono = g.enforced_w, now
    for idx, g in node.gpus.items():
        if g.pending:
            sent = g.pending.pop(ack.seq, None)
            if sent is not None and idx not in seen:
                g.last_ack_w, g.last_ack_mono = max(g.enforced_w, sent), now


def _row(t: pb.GpuTelemetry) -> tuple:
    """The decoded row of one ``GpuTelemetry`` (what ``Registry._reading`` takes)."""
    return readings.rows_of(pb.CapAck(gpus=[t]))[0]


def _packable(msg):
    """``msg`` as an agent that packs would say it: a cap state only as a ``CapState`` value (a
    name the protocol does not define, which only a hand-made message carries, is unspecified)."""
    out = type(msg)()
    out.CopyFrom(msg)
    for t in out.gpus:
        if not t.cap_state:
            t.cap_state = capstates.wire_of_name(t.cap_state_name)
        t.cap_state_name = ""
    return out


def _packed(msg):
    """``msg`` (a ``NodeTelemetry`` or ``CapAck``) with its GPUs packed instead (``GpuReadings``)."""
    out = type(msg)()
    out.CopyFrom(msg)
    del out.gpus[:]
    readings.pack(msg.gpus, out.readings)
    return out


def _registry(rng: random.Random, nodes: int, per_node: int, clock) -> Registry:
    reg = Registry(clock=clock)
    for k in range(nodes):
        node = NodeObs(name=f"n{k:02d}")
        for i in range(per_node):
            lo, hi = rng.choice([(200.0, 700.0), (200.0, 700.0), (0.0, 0.0), (500.0, 300.0)])
            node.gpus[i] = GpuObs(node=node.name, index=i, min_cap_w=lo, max_cap_w=hi, max_sm_clock_mhz=1980)
        jobs = [f"j{k}a", f"j{k}b"]
        node.bindings[jobs[0]] = Binding(jobs[0], node.name, tuple(range(0, per_node // 2)))
        # some nodes bind a GPU to both jobs (job_of: the first binding's)
        start = per_node // 2 - (1 if k % 3 == 0 else 0)
        node.bindings[jobs[1]] = Binding(jobs[1], node.name, tuple(range(start, per_node - 1)))
        reg.nodes[node.name] = node
    return reg


def _gpu_message(rng: random.Random, i: int) -> pb.GpuTelemetry:
    t = pb.GpuTelemetry(index=i, power_w=rng.uniform(0, 720),
                        cap_w=rng.choice([rng.uniform(200, 700)] * 6 + [math.inf, 1e7]),
                        enforced_w=rng.choice([0.0, -1.0, rng.uniform(150, 700), rng.uniform(150, 700), math.inf,
                                               math.nan, 4294967.295]), temp_c=rng.uniform(30, 90),
                        sm_clock_mhz=rng.randrange(0, 1995), utilization_pct=rng.choice([0.0, 19.9, 20.0, 90.0]),
                        energy_j=rng.choice([rng.uniform(0, 1e6), rng.uniform(0, 1e3), rng.uniform(0, 1e3),
                                             math.inf, math.nan, -1e300, 1e300]),
                        job_id=rng.choice(["", "j0a"]), cap_state_name=rng.choice(NAMES),
                        cap_state=rng.choice([0, 0, 1, 2, 3, 5, 8]), error=rng.choice(["", "", "nvml: timeout"]),
                        pre_job_cap_w=rng.choice([0.0, 450.0]))
    t.clocks_event_reasons.extend(rng.choice(REASONS))
    if rng.random() < 0.7:
        t.utilization_rates.memory_pct = rng.uniform(0, 100)
    return t


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and _same(dataclasses.astuple(a), dataclasses.astuple(b))
    return a == b


def _assert_registries_equal(fast: Registry, ref: Registry) -> None:
    for name, node in fast.nodes.items():
        for idx, g in node.gpus.items():
            h = ref.nodes[name].gpus[idx]
            for f in dataclasses.fields(GpuObs):
                a, b = getattr(g, f.name), getattr(h, f.name)
                a, b = (list(a), list(b)) if f.name == "throttle_hist" else (a, b)
                assert _same(a, b), (name, idx, f.name, a, b)
    assert set(fast.job_energy_j) == set(ref.job_energy_j)
    for job, e in fast.job_energy_j.items():
        assert math.isclose(e, ref.job_energy_j[job], rel_tol=1e-9), job


def _assert_throttle_equal(reg: Registry, hist: dict, now: float) -> None:
    """Each GPU's window counts (its node's lanes) equal a count of its samples in the window."""
    from coordinator.registry import THROTTLE_WINDOW_S

    for name, node in reg.nodes.items():
        for idx in node.gpus:
            want = [s for s in hist.get((name, idx), []) if now - s[0] <= THROTTLE_WINDOW_S]
            assert node.throttle.gpu_counts(now, idx) == (len(want), sum(s[1] for s in want),
                                                          sum(s[2] for s in want)), (name, idx)


def test_telemetry_and_acks_equal_the_per_gpu_definitions():
    rng = random.Random(20)
    clock = [100.0]
    fast = _registry(rng, nodes=12, per_node=8, clock=lambda: clock[0])
    ref = copy.deepcopy(fast)
    ref.clock = fast.clock
    packed, ref_p = copy.deepcopy(fast), copy.deepcopy(fast)  # packed messages, and their reference
    packed.clock = ref_p.clock = fast.clock
    valid = 0
    hist, hist_p = {}, {}  # the reference's throttling samples per GPU (plain, packed messages)
    for step in range(40):
        clock[0] += rng.choice([0.5, 1.0, 31.0, 60.25])  # some steps age the throttle window out
        for name in fast.nodes:
            gpus = [_gpu_message(rng, i) for i in rng.sample(range(9), rng.randrange(0, 9))]  # index 8: unknown
            valid += sum(t.enforced_w > 0 and t.index < 8 for t in gpus)
            msg = pb.NodeTelemetry(node=name, seq=step, gpus=gpus)
            fast.on_telemetry(name, msg)
            packed.on_telemetry(name, _packed(_packable(msg)))
            ref_p.nodes[name].last_report_mono = ref_p.nodes[name].last_telemetry_mono = clock[0]
            ref_p.nodes[name].last_telemetry_seq = msg.seq
            _reference_record(ref_p, ref_p.nodes[name], _packable(msg), clock[0], hist_p)
            ref_node = ref.nodes[name]
            ref_node.last_report_mono = ref_node.last_telemetry_mono = clock[0]
            ref_node.last_telemetry_seq = msg.seq
            _reference_record(ref, ref_node, msg, clock[0], hist)
            sent = rng.sample(range(8), 3)
            for reg in (fast, ref, packed, ref_p):  # caps sent, some acknowledged below
                for i in sent:
                    reg.nodes[name].gpus[i].pending[step] = 300.0 + 10 * i
            ack = pb.CapAck(seq=step, ok=True, gpus=[_gpu_message(rng, i) for i in rng.sample(range(9), 4)])
            # the plan's caps as the coordinator knows them (only those GPUs visited), and unknown
            fast.on_ack(name, ack, {i: 300.0 + 10 * i for i in sent})
            packed.on_ack(name, _packed(_packable(ack)), None)
            _reference_ack(ref, ref.nodes[name], ack, clock[0])
            _reference_ack(ref_p, ref_p.nodes[name], _packable(ack), clock[0])
        _assert_registries_equal(fast, ref)
        _assert_registries_equal(packed, ref_p)
        _assert_throttle_equal(fast, hist, clock[0])
        _assert_throttle_equal(packed, hist_p, clock[0])
    assert valid > 300 and any(fast.job_energy_j.values())  # the random data did exercise the paths
    assert any(g.cap_state == capstates.UNSUPPORTED_CONSTRAINTS for g in fast.all_gpus())
    assert any(g.slowdown_run > 0 for g in fast.all_gpus())
    assert any(math.isfinite(g.foreign_w) for g in fast.all_gpus())  # foreign-writer marks were kept


def test_pending_top_equals_the_per_gpu_max():
    rng = random.Random(7)
    pending = [{} if rng.random() < 0.7 else {s: rng.uniform(100, 700) for s in range(rng.randrange(1, 4))}
               for _ in range(500)]
    want = [max(p.values()) if p else -math.inf for p in pending]
    got = gpucolumns.pending_top_w(pending)
    assert got.shape == (500,) and np.array_equal(got, np.array(want))
    assert gpucolumns.pending_top_w([]).shape == (0,)
    assert np.array_equal(gpucolumns.pending_top_w(({}, {}, {1: 5.0})), [-math.inf, -math.inf, 5.0])


def test_throttle_counts_equal_a_count_over_the_window_and_drop_what_left_it():
    """A node's throttling window (:class:`coordinator.throttle.NodeThrottle`) counts, per GPU, the
    samples of the last WINDOW_S before ``now`` (samples, thermal, power), queried at times after
    the latest report as the view does; reports that left the window are dropped (O(1) queries).
    GPU indices 0-63 (every lane, the highest too) and lanes that never carry into each other."""
    from coordinator import throttle

    rng = random.Random(4)
    w = throttle.NodeThrottle()
    samples: dict = {}
    t = now = 1000.0
    reports = 0
    for _ in range(400):
        t = now + rng.choice([0.25, 1.0, 1.0, 7.0, 45.0])  # one monotonic clock (the registry's)
        masks = [0, 0, 0]
        for i in set(rng.sample(range(64), rng.randrange(1, 9))) | {63}:
            thermal, power = rng.random() < 0.3, rng.random() < 0.6
            samples.setdefault(i, []).append((t, thermal, power))
            for m, flag in enumerate((True, thermal, power)):
                masks[m] |= throttle.lane(i) if flag else 0
        w.add(t, *masks)
        reports += 1
        now = t + rng.choice([0.0, 0.4, 0.9, 2.0])
        for i in range(64):
            want = [s for s in samples.get(i, []) if now - s[0] <= throttle.WINDOW_S]
            counts = (len(want), sum(s[1] for s in want), sum(s[2] for s in want))
            assert w.gpu_counts(now, i) == counts, i
            assert w.fractions(now, i) == ((counts[1] / counts[0], counts[2] / counts[0]) if counts[0] else (0.0, 0.0))
        assert len(w.hist) == len({s[0] for s in samples[63] if now - s[0] <= throttle.WINDOW_S})
    assert reports > 300 and 0 < len(w.hist) < reports


def test_throttle_window_keeps_at_most_max_reports_and_no_lane_carries():
    """More than MAX_REPORTS reports within the window: the oldest go, each lane counts exactly
    MAX_REPORTS (all ones: 2 ** 12 < 2 ** 16), its neighbours nothing they did not get."""
    from coordinator import throttle

    w = throttle.NodeThrottle()
    every = throttle.lane(0) | throttle.lane(1) | throttle.lane(63)
    for k in range(throttle.MAX_REPORTS + 500):
        w.add(10.0 + k * 1e-3, every, every, throttle.lane(1))
    assert len(w.hist) == throttle.MAX_REPORTS
    assert w.gpu_counts(10.0 + 4.6, 0) == (throttle.MAX_REPORTS, throttle.MAX_REPORTS, 0)
    assert w.gpu_counts(10.0 + 4.6, 1) == (throttle.MAX_REPORTS,) * 3
    assert w.gpu_counts(10.0 + 4.6, 2) == (0, 0, 0)
    assert w.gpu_counts(10.0 + 4.6, 63) == (throttle.MAX_REPORTS, throttle.MAX_REPORTS, 0)
    assert w.gpu_counts(10.0 + 4.6 + throttle.WINDOW_S, 0) == (0, 0, 0)  # all left the window
    assert not w.hist and w.sums == [0, 0, 0]
