"""The registry's inlined hot loops equal their per-GPU definitions (issue 12, item 7).

The same messages packed (``GpuReadings``, :mod:`capctl.readings`) leave a third registry equal
to both: the packed path records exactly what the per-GPU messages say.

``Registry._record_gpus`` (telemetry) and ``Registry.on_ack`` inline :meth:`Registry._reading`
and :meth:`GpuObs.add_throttle`; ``gpucolumns.pending_top_w`` visits only non-empty pending
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
NAMES = ("", "OK", "OOB_LIMITED", "SAFE_CAP", "weird")


def _reference_record(reg: Registry, node: NodeObs, msg, now: float) -> None:
    """The per-GPU telemetry loop before it was inlined (through ``_reading`` and ``add_throttle``)."""
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
        g.add_throttle(now, thermal, power)
        g.sample_enforced_w, g.sample_mono = t.enforced_w, now
        g.slowdown_run = g.slowdown_run + 1 if (t.utilization_pct >= 20.0 and stuck) else 0
        if len(g.new_samples) < 1024:
            g.new_samples.append(Sample(now, t.power_w, t.enforced_w, t.temp_c, float(t.sm_clock_mhz), reasons,
                                        t.utilization_pct, mem_pct))
        prev = energy_seen.get(t.index)
        energy_seen[t.index] = t.energy_j
        g.energy_j = t.energy_j
        if prev is not None and t.energy_j >= prev:
            # Registry.job_of's loop before it read gpu_jobs: the first binding of the GPU
            job = next((b.job_id for b in node.bindings.values() if t.index in b.gpu_indices), "")
            if job:
                reg.job_energy_j[job] += t.energy_j - prev


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
    t = pb.GpuTelemetry(index=i, power_w=rng.uniform(0, 720), cap_w=rng.uniform(200, 700),
                        enforced_w=rng.choice([0.0, -1.0, rng.uniform(150, 700)]), temp_c=rng.uniform(30, 90),
                        sm_clock_mhz=rng.randrange(0, 1995), utilization_pct=rng.choice([0.0, 19.9, 20.0, 90.0]),
                        energy_j=rng.choice([rng.uniform(0, 1e6), rng.uniform(0, 1e3)]),
                        job_id=rng.choice(["", "j0a"]), cap_state_name=rng.choice(NAMES),
                        cap_state=rng.choice([0, 0, 1, 2, 5, 8]), error=rng.choice(["", "", "nvml: timeout"]),
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


def test_telemetry_and_acks_equal_the_per_gpu_definitions():
    rng = random.Random(20)
    clock = [100.0]
    fast = _registry(rng, nodes=12, per_node=8, clock=lambda: clock[0])
    ref = copy.deepcopy(fast)
    ref.clock = fast.clock
    packed, ref_p = copy.deepcopy(fast), copy.deepcopy(fast)  # packed messages, and their reference
    packed.clock = ref_p.clock = fast.clock
    valid = 0
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
            _reference_record(ref_p, ref_p.nodes[name], _packable(msg), clock[0])
            ref_node = ref.nodes[name]
            ref_node.last_report_mono = ref_node.last_telemetry_mono = clock[0]
            ref_node.last_telemetry_seq = msg.seq
            _reference_record(ref, ref_node, msg, clock[0])
            sent = rng.sample(range(8), 3)
            for reg in (fast, ref, packed, ref_p):  # caps sent, some acknowledged below
                for i in sent:
                    reg.nodes[name].gpus[i].pending[step] = 300.0 + 10 * i
            ack = pb.CapAck(seq=step, ok=True, gpus=[_gpu_message(rng, i) for i in rng.sample(range(9), 4)])
            fast.on_ack(name, ack, None)
            packed.on_ack(name, _packed(_packable(ack)), None)
            _reference_ack(ref, ref.nodes[name], ack, clock[0])
            _reference_ack(ref_p, ref_p.nodes[name], _packable(ack), clock[0])
        _assert_registries_equal(fast, ref)
        _assert_registries_equal(packed, ref_p)
    assert valid > 300 and any(fast.job_energy_j.values())  # the random data did exercise the paths
    assert any(g.cap_state == capstates.UNSUPPORTED_CONSTRAINTS for g in fast.all_gpus())
    assert any(g.slowdown_run > 0 for g in fast.all_gpus())


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
    """GpuObs.throttle_counts(now) is the count of the samples of the last THROTTLE_WINDOW_S before
    ``now`` (samples, thermal, power), queried at times after the latest sample as the view does
    (the view's snapshot comes after the interval's reports), and the samples that left the
    window are dropped, so the next query is O(1) (it was a pass over the history each time)."""
    from coordinator.registry import THROTTLE_WINDOW_S

    rng = random.Random(4)
    g = GpuObs(node="n1", index=0)
    samples = []
    t = now = 1000.0
    for _ in range(400):
        t = now + rng.choice([0.25, 1.0, 1.0, 7.0, 45.0])  # one monotonic clock (the registry's)
        thermal, power = rng.random() < 0.3, rng.random() < 0.6
        g.add_throttle(t, thermal, power)
        samples.append((t, thermal, power))
        now = t + rng.choice([0.0, 0.4, 0.9, 2.0])
        want = [s for s in samples if now - s[0] <= THROTTLE_WINDOW_S]
        assert g.throttle_counts(now) == (len(want), sum(s[1] for s in want), sum(s[2] for s in want))
        assert len(g.throttle_hist) == len(want)  # nothing older than the window is kept
        assert g.throttle_fractions(now) == ((sum(s[1] for s in want) / len(want), sum(s[2] for s in want) / len(want))
                                             if want else (0.0, 0.0))
    assert len(samples) > 300 and 0 < len(g.throttle_hist) < len(samples)
