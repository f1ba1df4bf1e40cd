"""Two-phase cap plans and failsafe caps: desired vs observed -> what to send (pure functions).

Rules (docs/protocol.md, "Two-phase apply"; DEVELOPERS.md rule 7):

* Phase 1 (:func:`plan_decreases`): every live GPU whose desired cap is below the highest cap it
  may be enforcing (``accounted_w``) by more than the deadband gets its desired cap; right after
  the limits changed, in a domain counted above its limit, every decrease of more than a
  milliwatt is sent (:func:`plan_decreases_arrays` ``exact_over``).
* Phase 2 (:func:`plan_increases`), after the phase-1 acknowledgements were recorded: increases are
  granted out of each power domain's headroom ``limit_w - sum(accounted_w)`` (accounted *after*
  phase 1: an unacknowledged decrease still counts at its higher value). When the wanted increases
  of a domain exceed its headroom they are scaled down proportionally (a few water-filling passes),
  so ``sum(accounted) + sum(grants) <= limit_w`` holds for every domain.
* Failsafe caps (:func:`safe_caps`): ``min(target, policy safe cap)`` per GPU, then lowered toward
  the minimum limits until every domain holds even if every agent fell back at once. Stale nodes
  keep the safe caps they were last sent (they cannot receive new ones).

Every cap returned is clamped to the device's limit constraints ``[min_cap_w, max_cap_w]``.
Units: watts. Keys: ``(node, gpu_index)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

GpuKey = tuple[str, int]

DEADBAND_W = 2.0
"""A cap differing from the observed one by no more than this (W) is not re-sent: it keeps the loop
idempotent when the online models move the optimum by a few tenths of a watt."""

HEADROOM_MARGIN_W = 0.0
"""Watts kept free in every domain when granting increases (0: limits are exact)."""


@dataclasses.dataclass(frozen=True)
class DomainSpec:
    """A power domain for planning: its GPUs and its limit (``None``: accounting only)."""

    name: str
    kind: str
    limit_w: float | None
    members: frozenset[GpuKey]


class GpuPlanInput(NamedTuple):
    """What the planner needs to know about one GPU (W).

    ``live``: its agent is connected and reporting (only live GPUs get caps). ``observed_w``: the
    latest enforced read-back. ``accounted_w``: the highest cap it may be enforcing now.
    ``desired_w``: the allocation. ``prev_safe_w``: the safe cap last sent (0 if none).
    (An immutable named tuple: the loop makes one per GPU twice an interval.)
    """

    key: GpuKey
    desired_w: float
    observed_w: float
    accounted_w: float
    min_cap_w: float
    max_cap_w: float
    live: bool
    prev_safe_w: float = 0.0


def clamp(value_w: float, lo_w: float, hi_w: float) -> float:
    """Clamp ``value_w`` into the device's limit constraints ``[lo_w, hi_w]`` (hi wins if lo > hi)."""
    return min(max(value_w, lo_w), hi_w) if hi_w > 0 else max(value_w, lo_w)


def plan_decreases(gpus: Iterable[GpuPlanInput], deadband_w: float = DEADBAND_W) -> dict[GpuKey, float]:
    """Phase 1: the caps to lower now (key -> new cap W); live GPUs only."""
    out = {}
    for g in gpus:
        if not g.live:
            continue
        want = clamp(g.desired_w, g.min_cap_w, g.max_cap_w)
        if want < g.accounted_w - deadband_w:
            out[g.key] = want
    return out


def plan_increases(
    gpus: Iterable[GpuPlanInput],
    domains: Iterable[DomainSpec],
    deadband_w: float = DEADBAND_W,
    margin_w: float = HEADROOM_MARGIN_W,
    passes: int = 4,
) -> dict[GpuKey, float]:
    """Phase 2: the caps to raise now (key -> new cap W), within every domain's headroom.

    ``gpus`` must carry ``accounted_w`` as recorded after the phase-1 acknowledgements. A live GPU
    whose desired cap is above its read-back but not above its accounted cap (e.g. an increase of
    an earlier interval not yet read back) is re-sent without using headroom. ``margin_w`` (W) is
    kept free in every domain; ``passes``: water-filling passes at most.
    """
    gpus = list(gpus)
    doms = [d for d in domains if d.limit_w is not None]
    member_of: dict[GpuKey, list[int]] = {}
    for i, d in enumerate(doms):
        for k in d.members:
            member_of.setdefault(k, []).append(i)
    used = [0.0] * len(doms)
    for g in gpus:
        for i in member_of.get(g.key, ()):
            used[i] += g.accounted_w
    headroom = [max(0.0, d.limit_w - margin_w - used[i]) for i, d in enumerate(doms)]
    out, want, base = _wanted_increases(gpus, deadband_w)
    grant = _water_fill(want, headroom, member_of, passes)
    gpu_by_key = {g.key: g for g in gpus}
    for k, gr in grant.items():
        g = gpu_by_key[k]
        cap = clamp(base[k] + gr, g.min_cap_w, g.max_cap_w)
        # floor to 1 mW so rounding never creates watts a domain does not have
        cap = int(cap * 1000) / 1000.0
        if cap > g.observed_w + deadband_w:
            out[k] = cap
    return out


def _wanted_increases(gpus: list[GpuPlanInput], deadband_w: float) -> tuple[dict, dict, dict]:
    """The increase candidates of :func:`plan_increases`: ``(re-sent caps, wanted watts above the
    accounted cap, accounted cap)``, each keyed by GPU (W)."""
    want: dict[GpuKey, float] = {}
    base: dict[GpuKey, float] = {}
    out: dict[GpuKey, float] = {}
    for g in gpus:
        if not g.live:
            continue
        target = clamp(g.desired_w, g.min_cap_w, g.max_cap_w)
        if target <= g.observed_w + deadband_w:
            continue
        if target <= g.accounted_w:
            out[g.key] = target  # already counted at this value or above
            continue
        want[g.key] = target - g.accounted_w
        base[g.key] = g.accounted_w
    return out, want, base


def _water_fill(want: dict, headroom: list[float], member_of: dict, passes: int) -> dict[GpuKey, float]:
    """Grants (W) of the ``want``-ed watts within ``headroom`` (W per domain, consumed in place):
    each pass scales every domain's demand down to its headroom; at most ``passes`` passes."""
    grant = dict.fromkeys(want, 0.0)
    n_doms = len(headroom)
    for _ in range(passes):
        # GPUs under a full domain cannot get more: leave them out of every domain's demand
        rest = {k: w - grant[k] for k, w in want.items()
                if w - grant[k] > 1e-9 and all(headroom[i] > 1e-9 for i in member_of.get(k, ()))}
        if not rest:
            break
        demand = [0.0] * n_doms
        for k, w in rest.items():
            for i in member_of.get(k, ()):
                demand[i] += w
        scale = [1.0 if demand[i] <= headroom[i] else headroom[i] / demand[i] for i in range(n_doms)]
        progress = 0.0
        for k, w in rest.items():
            s = min((scale[i] for i in member_of.get(k, ())), default=1.0)
            add = w * s
            if add <= 0:
                continue
            grant[k] += add
            progress += add
            for i in member_of.get(k, ()):
                headroom[i] = max(0.0, headroom[i] - add)
        if progress <= 1e-6:
            break
    return grant


def safe_caps(
    targets: Mapping[GpuKey, float],
    gpus: Iterable[GpuPlanInput],
    domains: Iterable[DomainSpec],
    policy_safe_cap_w: float | None,
    passes: int = 8,
) -> dict[GpuKey, float]:
    """Failsafe caps (key -> W) such that every domain holds if every agent falls back at once.

    ``targets``: the cap each GPU will have after this interval's plans (W). Live GPUs get
    ``min(target, policy_safe_cap_w)`` clamped to ``[min_cap_w, max_cap_w]``, then lowered toward
    ``min_cap_w`` in proportion wherever a domain's sum exceeds its limit. GPUs of stale nodes keep
    ``prev_safe_w`` (or their accounted cap when none was sent) and are not lowered: they cannot
    receive new safe caps. When even the minimum limits exceed a domain's limit the result is the
    minimum limits (the caller reports the deficit).
    """
    gpus = list(gpus)
    safe: dict[GpuKey, float] = {}
    floor: dict[GpuKey, float] = {}
    fixed: set[GpuKey] = set()
    for g in gpus:
        if g.live:
            t = targets.get(g.key, g.accounted_w)
            s = t if policy_safe_cap_w is None or policy_safe_cap_w <= 0 else min(t, policy_safe_cap_w)
            safe[g.key] = clamp(s, g.min_cap_w, min(g.max_cap_w, t) if t >= g.min_cap_w else g.max_cap_w)
            floor[g.key] = g.min_cap_w
        else:
            safe[g.key] = g.prev_safe_w if g.prev_safe_w > 0 else g.accounted_w
            fixed.add(g.key)
    doms = [d for d in domains if d.limit_w is not None]
    for _ in range(passes):
        changed = False
        for d in doms:
            keys = [k for k in d.members if k in safe]
            total = sum(safe[k] for k in keys)
            if total <= d.limit_w + 1e-9:
                continue
            movable = [k for k in keys if k not in fixed]
            room = sum(safe[k] - floor[k] for k in movable)
            if room <= 1e-9:
                continue
            excess = total - d.limit_w
            ratio = max(0.0, 1.0 - excess / room)
            for k in movable:
                safe[k] = floor[k] + (safe[k] - floor[k]) * ratio
                safe[k] = int(safe[k] * 1000) / 1000.0
            changed = True
        if not changed:
            break
    return safe


def domain_sums(values: Mapping[GpuKey, float], domains: Iterable[DomainSpec]) -> dict[str, float]:
    """Sum of ``values`` (W) over each domain's GPUs, by domain name."""
    return {d.name: sum(values.get(k, 0.0) for k in d.members) for d in domains}


# ---------------------------------------------------------------------------------------------
# The same rules on arrays (the coordinator's reconcile loop: thousands of GPUs every interval)


@dataclasses.dataclass(frozen=True)
class PlanArrays:
    """:class:`GpuPlanInput` fields of G GPUs as arrays of shape [G] (W; ``live`` bool), with
    ``keys[i]`` the ``(node, index)`` of GPU i."""

    keys: list
    desired_w: np.ndarray
    observed_w: np.ndarray
    accounted_w: np.ndarray
    min_cap_w: np.ndarray
    max_cap_w: np.ndarray
    live: np.ndarray
    prev_safe_w: np.ndarray


def domain_index(domains: Iterable[DomainSpec], keys: list) -> list[tuple[float, np.ndarray]]:
    """``(limit_w, positions of its GPUs in keys)`` for every domain with a limit, in order."""
    pos = {k: i for i, k in enumerate(keys)}
    out = []
    for d in domains:
        if d.limit_w is None:
            continue
        idx = np.fromiter((pos[k] for k in d.members if k in pos), dtype=np.int64)
        idx.sort()
        out.append((float(d.limit_w), idx))
    return out


def _clamp_arrays(value, lo, hi):
    return np.where(hi > 0, np.minimum(np.maximum(value, lo), hi), np.maximum(value, lo))


def _floor_mw(value):
    return np.trunc(value * 1000.0) / 1000.0


UNBLOCK_DEADBAND_W = 0.1
"""Deadband (W) of a decrease in a domain whose wanted increases exceed its headroom
(:func:`plan_decreases_arrays` with ``doms``): there the watts a sub-deadband decrease holds are
what blocks the increase, so it is sent; a tenth of a watt keeps float noise from being sent."""


def plan_decreases_arrays(p: PlanArrays, deadband_w: float = DEADBAND_W,
                          doms: list[tuple[float, np.ndarray]] | None = None,
                          exact_over: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plan_decreases` on arrays: ``(positions, new caps W)``.

    With ``doms`` (:func:`domain_index`): in a domain whose wanted increases (the candidates of
    :func:`plan_increases_arrays`, from the accounted caps after these decreases) exceed its
    headroom, decreases down to :data:`UNBLOCK_DEADBAND_W` are sent too. Without it, a fully
    allocated domain whose new split lowers some GPUs by less than the deadband and raises others
    by more never got there: phase 2 had no headroom and phase 1 sent nothing (seen with the real
    agent, tests/coordinator/test_real_agents.py: a 2 x 5 W raise held by 6 x 1.7 W decreases).
    With ``exact_over`` (the coordinator: the first intervals after the limits changed), every
    decrease of a domain counted above its limit is sent (:func:`_over_limit_decreases`)."""
    want = _clamp_arrays(p.desired_w, p.min_cap_w, p.max_cap_w)
    dec = p.live & (want < p.accounted_w - deadband_w)
    small = p.live & ~dec & (want < p.accounted_w - UNBLOCK_DEADBAND_W)
    if doms and (exact_over or small.any()):
        acc = np.where(dec, want, p.accounted_w)
        if exact_over:
            _over_limit_decreases(p, want, acc, dec, doms)
        if small.any():
            need = np.where(p.live & (want > p.observed_w + deadband_w) & (want > acc), want - acc, 0.0)
            for lim, idx in doms:
                if idx.size and float(need[idx].sum()) > max(0.0, lim - HEADROOM_MARGIN_W - float(acc[idx].sum())) + 1e-9:
                    dec[idx] |= small[idx]
    sel = np.nonzero(dec)[0]
    return sel, want[sel]


EXACT_DECREASE_TICKS = 3
"""Intervals after a start or a policy change (``budget set``, a reload) whose phase 1 sends every
decrease of a domain counted above its limit, however small (:func:`plan_decreases_arrays`
``exact_over``): a budget lowered by less than the 2 W deadband per GPU is then met. Three: one
to send, two more for a plan whose acknowledgement was lost or late."""


OVER_AGAIN_TICKS = 1
"""A domain counted above its limit in this many intervals in a row before the current one gets
its every decrease sent too (:func:`counted_over`, ``Coordinator._over_ticks``). One interval over
is often the readings' lag behind the acknowledgements (:func:`_over_limit_decreases`); two in a row
are watts the planner did not take back: the split of a cut whose last watts were sub-deadband
decreases (a GPU counted at its foreign writer's 700 W with the others at their minimum caps left
the cluster 3.58 W over its 2,800 W budget for 4 s, until an unrelated change;
tests/coordinator/test_foreign_writer_budget.py), or a budget lowered by a little per GPU."""


def counted_over(p: PlanArrays, doms: list[tuple[float, np.ndarray]]) -> bool:
    """Whether some domain of ``doms`` (:func:`domain_index`) is counted above its limit by the
    accounted caps of ``p`` (W; 1 nW of float noise allowed). One pass for all domains (their
    positions concatenated, one ``np.add.reduceat``)."""
    live = [(lim, idx) for lim, idx in doms if idx.size]
    if not live:
        return False
    sizes = np.fromiter((idx.size for _, idx in live), np.int64, len(live))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    sums = np.add.reduceat(p.accounted_w[np.concatenate([idx for _, idx in live])], starts)
    limits = np.fromiter((lim for lim, _ in live), float, len(live))
    return bool(np.any(sums > limits + 1e-9))


OVER_LIMIT_DEADBAND_W = 0.001
"""Deadband (W) of a decrease in a domain counted above its limit (:func:`_over_limit_decreases`):
one milliwatt, NVML's resolution (the agent writes a cap floored to it, nodeagent/nvml.py, so a
cap sent once reads back at or below the desired one and is not sent again)."""


def _over_limit_decreases(p: PlanArrays, want: np.ndarray, acc: np.ndarray, dec: np.ndarray,
                          doms: list[tuple[float, np.ndarray]]) -> None:
    """In every domain whose accounted caps ``acc`` [G] (W, after the decreases ``dec`` [G] bool)
    sum above its limit, mark every live decrease of more than :data:`OVER_LIMIT_DEADBAND_W` in
    ``dec`` (in place) and lower ``acc`` to match. Without it a budget lowered by less than the
    deadband per GPU (``capctl budget set`` 1.5 W x G lower) left the domain over its limit for
    good: every desired cap within :data:`DEADBAND_W` of its accounted one, nothing to raise, so
    neither phase sent anything (found by a try-out of ``capctl sim``: 1,536 W over a 612,864 W
    budget, indefinitely). Only on request (``exact_over``): in the live loop a domain is often
    counted above its limit for an interval by readings older than the acks (a report sampled
    before a plan was applied and read after its ack), and sending every such sub-deadband
    "decrease" made most plans decreases, each waited for (measured, bench/control_loop.py at
    1,000 agents: report -> ack p99 0.80 -> 2.5-3.5 s, 100 % -> 22-43 % within one interval)."""
    over_small = p.live & ~dec & (want < p.accounted_w - OVER_LIMIT_DEADBAND_W)
    if not over_small.any():
        return
    for lim, idx in doms:
        if idx.size and float(acc[idx].sum()) > lim + 1e-9:
            pick = idx[over_small[idx]]
            dec[pick] = True
            acc[pick] = want[pick]


def plan_increases_arrays(
    p: PlanArrays,
    doms: list[tuple[float, np.ndarray]],
    deadband_w: float = DEADBAND_W,
    margin_w: float = HEADROOM_MARGIN_W,
    passes: int = 4,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plan_increases` on arrays (``doms`` from :func:`domain_index`): ``(positions, caps W)``.

    Same rules and guarantee (``sum(accounted) + sum(grants) <= limit_w`` in every domain); sums
    are taken in another order, so values may differ from the list version by rounding (< 1 mW).
    """
    acc = p.accounted_w
    headroom = np.array([max(0.0, lim - margin_w - float(acc[idx].sum())) for lim, idx in doms])
    target = _clamp_arrays(p.desired_w, p.min_cap_w, p.max_cap_w)
    cand = p.live & ~(target <= p.observed_w + deadband_w)
    resend = cand & (target <= acc)
    wanting = cand & ~resend
    want = np.where(wanting, target - acc, 0.0)
    grant = np.zeros_like(want)
    for _ in range(passes):
        rest = want - grant
        open_ = wanting & (rest > 1e-9)
        for k, (_lim, idx) in enumerate(doms):
            if not headroom[k] > 1e-9:
                open_[idx] = False
        if not open_.any():
            break
        rest = np.where(open_, rest, 0.0)
        scale_g = np.ones_like(rest)
        for k, (_lim, idx) in enumerate(doms):
            demand = float(rest[idx].sum())
            scale = 1.0 if demand <= headroom[k] else headroom[k] / demand
            if scale < 1.0:
                scale_g[idx] = np.minimum(scale_g[idx], scale)
        add = np.where(open_ & (rest * scale_g > 0), rest * scale_g, 0.0)
        grant += add
        for k, (_lim, idx) in enumerate(doms):
            headroom[k] = max(0.0, headroom[k] - float(add[idx].sum()))
        if float(add.sum()) <= 1e-6:
            break
    caps = _floor_mw(_clamp_arrays(acc + grant, p.min_cap_w, p.max_cap_w))
    granted = wanting & (caps > p.observed_w + deadband_w)
    out = np.where(resend, target, caps)
    sel = np.nonzero(resend | granted)[0]
    return sel, out[sel]


def safe_caps_arrays(
    targets_w: np.ndarray,
    p: PlanArrays,
    doms: list[tuple[float, np.ndarray]],
    policy_safe_cap_w: float | None,
    passes: int = 8,
) -> np.ndarray:
    """:func:`safe_caps` on arrays (``targets_w`` aligned with ``p``): the failsafe caps [G] (W)."""
    t = targets_w
    s = t if policy_safe_cap_w is None or policy_safe_cap_w <= 0 else np.minimum(t, policy_safe_cap_w)
    hi = np.where(t >= p.min_cap_w, np.minimum(p.max_cap_w, t), p.max_cap_w)
    live_safe = _clamp_arrays(s, p.min_cap_w, hi)
    held = np.where(p.prev_safe_w > 0, p.prev_safe_w, p.accounted_w)
    safe = np.where(p.live, live_safe, held)
    floor = p.min_cap_w
    movable_all = p.live
    for _ in range(passes):
        changed = False
        for lim, idx in doms:
            total = float(safe[idx].sum())
            if total <= lim + 1e-9:
                continue
            mov = idx[movable_all[idx]]
            room = float((safe[mov] - floor[mov]).sum())
            if room <= 1e-9:
                continue
            ratio = max(0.0, 1.0 - (total - lim) / room)
            safe[mov] = _floor_mw(floor[mov] + (safe[mov] - floor[mov]) * ratio)
            changed = True
        if not changed:
            break
    return safe
