"""The pace loop (coordinator.paceloop with coordinator.pacealign and the measured slopes of
coordinator.paceslope, fed as the solver inputs feed them) closed on plants, pure logic:

- *quantized*: the simulated driver's law (csrc/simnvml/physics.c): ``P = P_s + k D_dyn f^3``, the
  SM clock the largest 15 MHz step whose power fits under the cap, the draw that step's power;
- *continuous*: tests/coordinator/fakeagent.py's GPU: the clock ``max * rho(cap)`` in whole MHz with
  rho the allocator's H100 curve (not the cube law the alignment assumes) at the cap a nominal part
  would need for the same dynamic power, the draw the cap.

- *power law*: clock ~ ((P - P_s) / D)^k for k from 1/4 (flatter than the cube law's 1/3) to 1
  (steeper: the clock rises with power as fast as at a voltage floor), continuous or in 15 MHz steps.

On each, after a load step each cap changes direction at most once and settles within 5 intervals
to within 1 % of its range (issue 12 item 2), and a settled state moves no cap (a reconcile).
"""

from __future__ import annotations

import math

import pytest

from capctl.allocator.curves import DEFAULT_CURVES
from coordinator import pacealign, paceloop
from coordinator.allocation import GpuInput
from coordinator.paceslope import PaceSlopes

MAX_MHZ = 1980.0
STEP_MHZ = 15.0
STATIC_W = 75.0
LO_W, HI_W = 200.0, 700.0


def _quantized(cap_w: float, dyn_w: float) -> tuple[float, float]:
    """(clock MHz, draw W) of the simulated driver's law under ``cap_w``."""
    if cap_w >= STATIC_W + dyn_w:
        return MAX_MHZ, STATIC_W + dyn_w
    f = MAX_MHZ * ((cap_w - STATIC_W) / dyn_w) ** (1.0 / 3.0)
    f = math.floor(f / STEP_MHZ + 1e-9) * STEP_MHZ
    return f, STATIC_W + dyn_w * (f / MAX_MHZ) ** 3


def _continuous(cap_w: float, dyn_w: float) -> tuple[float, float]:
    """(clock MHz, draw W) of a part whose clock moves continuously with its cap (whole MHz, as
    NVML reports it), by the cube law with a static power (120 W) the alignment does not assume."""
    static_w = 120.0
    dyn_w = dyn_w + STATIC_W - static_w  # the same demand at max clock
    if cap_w >= static_w + dyn_w:
        return MAX_MHZ, static_w + dyn_w
    return float(int(MAX_MHZ * ((cap_w - static_w) / dyn_w) ** (1.0 / 3.0))), cap_w


def _fake_agent(cap_w: float, dyn_w: float) -> tuple[float, float]:
    """(clock MHz, draw W) of tests/coordinator/fakeagent.py's GPU: ``max * rho`` in whole MHz with
    rho the allocator's H100 curve (not the cube law), at the cap a nominal part (600 W dynamic)
    would need for the same dynamic power; the draw the cap."""
    demand = STATIC_W + dyn_w
    if cap_w >= demand:
        return MAX_MHZ, demand
    nominal_w = STATIC_W + (cap_w - STATIC_W) * 600.0 / dyn_w
    return float(int(MAX_MHZ * min(1.0, float(DEFAULT_CURVES["H100"].rate(nominal_w))))), cap_w


def power_law(k: float, quantized: bool = False):
    """A plant whose clock is ``max * ((P - P_s) / D)^k`` under the cap ``P`` (``D`` the GPU's
    dynamic power at its max clock): continuous (whole MHz, the draw the cap) or in 15 MHz steps
    (the draw that step's power, as the simulated driver)."""
    def plant(cap_w: float, dyn_w: float) -> tuple[float, float]:
        if cap_w >= STATIC_W + dyn_w:
            return MAX_MHZ, STATIC_W + dyn_w
        f = MAX_MHZ * ((cap_w - STATIC_W) / dyn_w) ** k
        if not quantized:
            return float(int(f)), cap_w
        f = math.floor(f / STEP_MHZ + 1e-9) * STEP_MHZ
        return f, STATIC_W + dyn_w * (f / MAX_MHZ) ** (1.0 / k)

    plant.__name__ = f"_k{k:g}{'-steps' if quantized else ''}"
    return plant


def _gpus(plant, caps, dyn, sampled=None):
    """The loop's rows: enforced limits ``caps``, each GPU's sample taken at ``sampled`` (W; the
    caps of an earlier interval: a report from before the last change) or at ``caps``."""
    out = []
    for i, (c, d) in enumerate(zip(caps, dyn)):
        at = c if sampled is None else sampled[i]
        clk, draw = plant(at, d)
        g = GpuInput((f"n{i // 4}", i % 4), "cluster", LO_W, HI_W, False, c, c, "J", DEFAULT_CURVES["H100"],
                     math.inf, LO_W)
        g.pace, g.pace_at_w, g.paced = clk / MAX_MHZ, at, True
        g.draw_w, g.pace_step = draw, STEP_MHZ / MAX_MHZ
        out.append(g)
    return out


def _run(plant, caps, dyn, total_w, steps=10, lag=0, measured=True):
    """The loop closed on ``plant`` for ``steps`` intervals; with ``lag`` 1 every report is taken
    before the last interval's change (an agent that acks and reports late). ``measured``: each
    GPU's measured slope fed as ``allocation.build_inputs`` feeds it (False: the model's slope
    alone, main's loop before the measurement)."""
    hist = [list(caps)]
    slopes = PaceSlopes()
    for _ in range(steps):
        gpus = _gpus(plant, caps, dyn, hist[-1 - lag] if len(hist) > lag else None)
        if measured:
            got = slopes.observe(tuple(g.key for g in gpus), [g.pace_at_w for g in gpus], [g.pace for g in gpus],
                                 [g.paced for g in gpus], [g.pace_step for g in gpus],
                                 [pacealign.STATIC_FRACTION * g.max_cap_w for g in gpus])
            for g, s in zip(gpus, got.tolist()):
                g.pace_slope_w = s
        moved = paceloop.correct(gpus, {g.key: total_w / len(gpus) for g in gpus}, {"J": 1.0})
        caps = [moved.get(g.key, c) for g, c in zip(gpus, caps)]
        hist.append(caps)
    return hist


DYN = [520.0, 600.0, 455.0, 680.0, 560.0, 610.0, 500.0, 640.0]  # power factors ~0.75-1.15


STEPS = [(_quantized, 300.0, 470.0), (_quantized, 470.0, 330.0), (_continuous, 300.0, 470.0),
         (_continuous, 470.0, 330.0), (_fake_agent, 420.0, 520.0), (_fake_agent, 540.0, 430.0)]


@pytest.mark.parametrize("plant, before_w, after_w", STEPS,
                         ids=[f"{p.__name__[1:]}-{'up' if b < a else 'down'}" for p, b, a in STEPS])
@pytest.mark.parametrize("lag", [0, 1], ids=["fresh", "late"])
def test_after_a_load_step_caps_turn_at_most_once_and_settle_within_5_intervals(plant, before_w, after_w, lag):
    # the job before the step: every GPU at the old share (the state the loop left it in)
    hist = _run(plant, [before_w] * len(DYN), DYN, after_w * len(DYN), steps=12, lag=lag)
    band = 0.01 * (HI_W - LO_W)
    settled = 5 if not lag else 9  # a report one interval late: every correction takes two
    for i in range(len(DYN)):
        seq = [h[i] for h in hist]
        moves = [b - a for a, b in zip(seq, seq[1:]) if abs(b - a) > 0.5]
        turns = sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))
        assert turns <= 1, (i, [round(c, 1) for c in seq])
        assert all(abs(c - seq[-1]) <= band for c in seq[settled:]), (i, [round(c, 1) for c in seq])
    assert hist[-1] == pytest.approx(hist[-2], abs=0.5)  # settled: nothing moves
    assert sum(hist[-1]) <= after_w * len(DYN) + 1e-6
    clocks = [plant(c, d)[0] for c, d in zip(hist[-1], DYN)]
    if plant is _quantized:  # every GPU on one 15 MHz step (the alignment)
        assert len(set(clocks)) == 1, clocks
    else:  # equal pace within the deadband, the job's watts spent (no alignment on this plant)
        assert (max(clocks) - min(clocks)) / MAX_MHZ <= paceloop.PACE_DEADBAND
        assert sum(hist[-1]) >= after_w * len(DYN) - 1.0


def test_the_grid_is_read_from_the_clocks():
    step = STEP_MHZ / MAX_MHZ
    on = [c / MAX_MHZ for c in (1605.0, 1620.0, 1980.0)]
    assert pacealign.on_grid(on, [step] * 3)
    assert not pacealign.on_grid([1605.0 / MAX_MHZ, 1618.0 / MAX_MHZ], [step] * 2)  # 1618 is off it
    assert not pacealign.on_grid([1.0, 1.0], [step] * 2)  # every GPU at its max clock: nothing to tell
    assert not pacealign.on_grid([0.8], [0.0])  # no step known
    assert not pacealign.on_grid([], [])
    # on the continuous plant a job's clocks are off the grid at nearly every operating point
    hits = sum(pacealign.on_grid([_continuous(c, 600.0)[0] / MAX_MHZ, _continuous(c + 7.0, 540.0)[0] / MAX_MHZ],
                                 [step] * 2) for c in range(250, 600, 5))
    assert hits <= 2


def test_a_gpu_at_its_max_clock_below_its_cap_steps_from_its_draw():
    # GPU 0 draws 400 W at its max clock under a 600 W cap; GPU 1 is capped and much slower:
    # the step must take GPU 0 down from its draw (400 W), not from its cap (600 W)
    gpus = _gpus(_continuous, [600.0, 300.0], [325.0, 600.0])
    assert gpus[0].pace == 1.0 and gpus[0].draw_w == pytest.approx(400.0)
    moved = paceloop.correct(gpus, {g.key: 350.0 for g in gpus}, {"J": 1.0})
    s = paceloop.GAIN * paceloop._slope(gpus[0])
    assert s == pytest.approx(paceloop.GAIN * paceloop.slope_w(400.0, 1.0))
    assert moved[gpus[0].key] < 400.0  # from the cap it would have stayed above its draw
    assert moved[gpus[0].key] == pytest.approx(400.0 + s * (moved_target(gpus, moved) - 1.0), rel=1e-6)
    assert moved[gpus[1].key] > 300.0


def moved_target(gpus, moved) -> float:
    """The pace target of a two-GPU Newton step, read back from GPU 1's cap."""
    g = gpus[1]
    return g.pace + (moved[g.key] - g.pace_at_w) / (paceloop.GAIN * paceloop._slope(g))


def test_only_the_pace_setting_gpu_at_a_ceiling_is_held():
    # GPUs 0 and 1 both at their ceilings; GPU 0 reaches the lower pace there, so it sets the
    # pace; GPU 1 would be faster at its ceiling and is bounded to GPU 0's pace like GPU 2
    dyn = [600.0, 450.0, 600.0]
    caps = [420.0, 430.0, 560.0]
    gpus = _gpus(_continuous, caps, dyn)
    gpus[0].thermal_ceiling_w, gpus[1].thermal_ceiling_w = 420.0, 430.0
    moved = paceloop.correct(gpus, {g.key: 600.0 for g in gpus}, {"J": 1.0})
    assert moved[gpus[0].key] == pytest.approx(420.0)  # held at its ceiling
    reach = gpus[0].pace
    for g in gpus[1:]:  # nobody planned faster than GPU 0 gets at its ceiling
        s = paceloop.GAIN * paceloop._slope(g)
        assert moved[g.key] <= max(g.min_cap_w, g.pace_at_w + s * (reach - g.pace)) + 1e-6
    assert moved[gpus[1].key] < 430.0 - 1.0  # not held at its ceiling


def _turns_and_settled(seq: list, band_w: float) -> tuple[int, int]:
    """(direction changes, the first interval from which the cap stays within ``band_w`` of its
    last value) of one GPU's caps, moves under ``band_w`` not counted (bench/load_step.py's rule)."""
    moves = [b - a for a, b in zip(seq, seq[1:]) if abs(b - a) >= band_w]
    turns = sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))
    k = len(seq)
    while k > 0 and abs(seq[k - 1] - seq[-1]) <= band_w:
        k -= 1
    return turns, k


K_PLANTS = [power_law(k) for k in (0.25, 0.5, 0.75, 1.0)] + [power_law(k, True) for k in (0.5, 1.0)]
SLOPE_STEPS = ([(p, b, a) for p in K_PLANTS for b, a in ((300.0, 470.0), (470.0, 330.0), (250.0, 300.0))]
               # the fake agent's curve (the allocator's H100 prior) where it is steepest: at 300 W
               # its slope is a fifth of the cube law's bound, at 210 W a twentieth
               + [(_fake_agent, 300.0, 470.0), (_fake_agent, 470.0, 330.0), (_fake_agent, 300.0, 250.0)])


@pytest.mark.parametrize("plant, before_w, after_w", SLOPE_STEPS,
                         ids=[f"{p.__name__[1:]}-{b:g}-{a:g}" for p, b, a in SLOPE_STEPS])
@pytest.mark.parametrize("lag", [0, 1], ids=["fresh", "late"])
def test_on_plants_steeper_and_flatter_than_the_cube_law_caps_turn_at_most_once_and_settle(plant, before_w, after_w,
                                                                                            lag):
    hist = _run(plant, [before_w] * len(DYN), DYN, after_w * len(DYN), steps=14, lag=lag)
    band = 0.01 * (HI_W - LO_W)
    for i in range(len(DYN)):
        seq = [h[i] for h in hist]
        turns, settled = _turns_and_settled(seq, band)
        assert turns <= 1, (i, [round(c, 1) for c in seq])
        assert settled <= (5 if not lag else 9), (i, [round(c, 1) for c in seq])  # late: two intervals a step
    assert hist[-1] == pytest.approx(hist[-2], abs=band)  # settled
    assert sum(hist[-1]) <= after_w * len(DYN) + 1e-6
    clocks = [plant(c, d)[0] for c, d in zip(hist[-1], DYN)]
    assert (max(clocks) - min(clocks)) / MAX_MHZ <= paceloop.PACE_DEADBAND + STEP_MHZ / MAX_MHZ / 2  # equal pace


@pytest.mark.parametrize("plant, before_w, after_w", [(power_law(1.0), 300.0, 470.0), (power_law(0.75), 470.0, 330.0),
                                                      (_fake_agent, 470.0, 330.0)], ids=["k1", "k0.75", "fake-agent"])
def test_the_model_slope_alone_oscillates_on_a_steep_plant(plant, before_w, after_w):
    # main's loop (no measured slope): the step by the cube law's slope overshoots a plant whose
    # true slope is a third of it or less, every interval: the caps swing for good, or until GPUs
    # pin at their limits at unequal pace
    hist = _run(plant, [before_w] * len(DYN), DYN, after_w * len(DYN), steps=14, measured=False)
    band = 0.01 * (HI_W - LO_W)
    worst = max(_turns_and_settled([h[i] for h in hist], band)[0] for i in range(len(DYN)))
    assert worst >= 4
    swing_w = max(abs(a - b) for a, b in zip(hist[-1], hist[-2]))
    clocks = [plant(c, d)[0] for c, d in zip(hist[-1], DYN)]
    assert swing_w > 10 * band or (max(clocks) - min(clocks)) / MAX_MHZ > 10 * paceloop.PACE_DEADBAND
