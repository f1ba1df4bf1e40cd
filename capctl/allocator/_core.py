"""Shared preprocessing and result assembly for both solvers (internal).

Reduces an :class:`AllocationProblem` to: per job-GPU box [lo_g, hi_g], fixed loads (idle GPUs),
the set of domains whose constraint is active-able, per-job rate range [s_lo_j, s_max_j]; and
turns job rates back into milliwatt-rounded, exactly feasible caps with explanations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .curves import RATE_MIN
from .curves import rate as curve_rate
from .curves import rate_unclamped as raw_rate
from .problem import AllocationProblem, AllocationResult, domain_depth

# reasons an upper bound binds
HI_DEVICE_MAX, HI_THERMAL, HI_SLEW, HI_MIN = 0, 1, 2, 3
_HI_NAMES = {HI_DEVICE_MAX: "device_max", HI_THERMAL: "thermal", HI_SLEW: "slew", HI_MIN: "device_min"}
#: watts kept free under each binding domain limit before milliwatt rounding
LIMIT_MARGIN_W = 0.002
#: lowest relative rate the allocator plans with (the curve is extrapolated below its fit range;
#: reported rates are clamped to the same floor, curves.RATE_MIN)
RATE_FLOOR = RATE_MIN


@dataclass
class Prep:
    G: int
    J: int
    D: int
    lo: np.ndarray          # [G] lower bound of the cap [W] (idle: fixed cap)
    hi: np.ndarray          # [G] upper bound [W]
    hi_reason: np.ndarray   # [G] HI_* code
    sigma: np.ndarray       # [G] speed relative to the slowest GPU of its job (>= 1)
    in_job: np.ndarray      # [G] bool
    pair_dom: np.ndarray    # [P] domain of each (domain, gpu) ancestor pair
    pair_gpu: np.ndarray    # [P]
    depth: np.ndarray       # [D]
    limit: np.ndarray       # [D] limit [W] (+inf none)
    deficit_w: np.ndarray   # [D]
    in_deficit: np.ndarray  # [D] bool
    held_by: np.ndarray     # [G] deficit or pinned domain holding the GPU at its minimum, -1 none
    fixed_load: np.ndarray  # [D] idle caps under each domain [W]
    s_lo: np.ndarray        # [J] job rate with every GPU at lo
    s_max: np.ndarray       # [J] highest job rate reachable (<= 1)
    s_max_gpu: np.ndarray   # [J] GPU that limits s_max (-1 none)
    has_gpu: np.ndarray     # [J] bool
    candidates: np.ndarray  # [C] domains whose constraint can bind
    alerts: list
    pinned: np.ndarray      # [D] bool: limit within PIN_SLACK of its GPUs' minimum caps (held there)


def _seg_min(values, seg, n):
    """Per-segment minimum and argmin (global index; the first on ties); +inf / -1 for empty
    segments. ``values``, ``seg`` [k] (segment of each value, in [0, n)); returns two [n] arrays.
    Unsorted reductions (no O(k log k) sort: this runs several times per solve at 100k GPUs)."""
    out = np.full(n, np.inf)
    arg = np.full(n, -1, dtype=np.int64)
    if values.size == 0:
        return out, arg
    np.fmin.at(out, seg, values)
    hit = np.nonzero(values == out[seg])[0]
    first = np.full(n, values.size, dtype=np.int64)
    np.minimum.at(first, seg[hit], hit)
    arg = np.where(first < values.size, first, -1)
    return out, arg


def ancestors(problem: AllocationProblem):
    """(pair_dom[P], pair_gpu[P]): every (domain, gpu) with the domain at or above the GPU's leaf."""
    dom = problem.domain_of_gpu.astype(np.int64)
    gpu = np.arange(problem.n_gpus, dtype=np.int64)
    doms, gpus = [], []
    cur = dom.copy()
    live = np.ones(cur.shape[0], bool)
    while live.any():
        doms.append(cur[live])
        gpus.append(gpu[live])
        nxt = problem.domain_parent[cur[live]]
        cur = nxt
        gpu = gpu[live]
        live = cur >= 0
    if not doms:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(doms), np.concatenate(gpus)


def prepare(pb: AllocationProblem) -> Prep:
    """Reduce ``pb`` to per-GPU cap boxes, deficits, job rate ranges and candidate domains.

    Shapes and units: :class:`Prep` (watts). Never raises for infeasible limits: deficits are
    recorded (GPUs held at their minimum) with alerts in ``Prep.alerts``. Raises ValueError only
    for a cyclic domain tree (which ``AllocationProblem.validate`` already rejects)."""
    G, J, D = pb.n_gpus, pb.n_jobs, pb.n_domains
    alerts: list[str] = []
    in_job = pb.job_of_gpu >= 0
    lo, hi, hi_reason, mn, floor_cap = _cap_bounds(pb, in_job, alerts)
    pair_dom, pair_gpu = ancestors(pb)
    depth = domain_depth(pb.domain_parent)
    limit = pb.domain_limit_w.astype(float)
    lo, hi, min_load, dev_min_load = _relax_minimums(pb, lo, hi, mn, floor_cap, in_job, pair_dom, pair_gpu, limit)
    in_deficit = (min_load > limit) & (dev_min_load > limit)
    still_short = (min_load > limit) & ~in_deficit
    if still_short.any():  # even the rate floor does not fit: plan down to the device minimum
        g_short = np.zeros(G, bool)
        g_short[pair_gpu[still_short[pair_dom]]] = True
        lo = np.where(g_short & in_job, mn, lo)
    deficit = np.where(in_deficit, dev_min_load - limit, 0.0)
    held_by = np.full(G, -1, np.int64)
    pinned = _pinned(pair_dom, limit, dev_min_load, in_deficit, D)
    if in_deficit.any() or pinned.any():
        lo, hi, hi_reason = _hold_deficits(pb, lo, hi, hi_reason, mn, in_job, in_deficit, held_by,
                                           pair_dom, pair_gpu, depth)
        if pinned.any():  # a GPU under a deficit keeps that (more serious) reason: pinned ones after
            by_pin = np.full(G, -1, np.int64)
            lo, hi, hi_reason = _hold_deficits(pb, lo, hi, hi_reason, mn, in_job, pinned, by_pin,
                                               pair_dom, pair_gpu, depth)
            held_by[:] = np.where(held_by >= 0, held_by, by_pin)
        for d in np.nonzero(in_deficit)[0][:20]:
            alerts.append(f"domain {pb.domain_name(d)}: limit {limit[d]:.1f} W below the sum of minimum "
                          f"caps {dev_min_load[d]:.1f} W (deficit {deficit[d]:.1f} W); holding the minimums")
    hi_reason = np.where((hi <= lo) & (hi_reason == HI_DEVICE_MAX), HI_MIN, hi_reason)

    jg = np.nonzero(in_job)[0]
    sigma, s_lo, s_max, s_max_gpu, has_gpu = _rate_ranges(pb, lo, hi, jg, alerts)

    fixed_load = np.bincount(pair_dom, np.where(in_job, 0.0, lo)[pair_gpu], minlength=D)
    # the most each GPU can usefully draw: power at its job's s_max
    use_max = lo.copy()
    if jg.size:
        use_max[jg] = np.clip(cap_at_rate(pb, jg, sigma[jg], s_max[pb.job_of_gpu[jg]]), lo[jg], hi[jg])
    max_load = np.bincount(pair_dom, use_max[pair_gpu], minlength=D)
    candidates = np.nonzero((max_load > limit - LIMIT_MARGIN_W) & ~in_deficit & ~pinned & np.isfinite(limit))[0]
    return Prep(G, J, D, lo, hi, hi_reason, sigma, in_job, pair_dom, pair_gpu, depth, limit,
                deficit, in_deficit, held_by, fixed_load, s_lo, s_max, s_max_gpu, has_gpu,
                candidates, alerts, pinned)


PIN_SLACK_MW_PER_GPU = 1.0
"""A domain whose limit leaves less than :data:`LIMIT_MARGIN_W` plus this many milliwatts per GPU
below it above their minimum caps is *pinned*: its GPUs are held at their minimums (what milliwatt
rounding could give them above is less than 1 mW each). Solving it instead drove the domain's
price to ~1e28 and the fast path to its iteration limit (found by a try-out: a rack limit equal to
4 x 200 W, the device minimum)."""


def _pinned(pair_dom, limit, dev_min_load, in_deficit, D) -> np.ndarray:
    """[D] bool: domains with a finite limit, not in deficit, within the pin slack of the sum of
    their GPUs' device minimums ``dev_min_load`` [D] (W)."""
    n_under = np.bincount(pair_dom, minlength=D)
    slack = LIMIT_MARGIN_W + 1e-3 * PIN_SLACK_MW_PER_GPU * n_under
    with np.errstate(invalid="ignore"):
        return np.isfinite(limit) & ~in_deficit & (n_under > 0) & (limit - dev_min_load < slack)


def _cap_bounds(pb: AllocationProblem, in_job: np.ndarray, alerts: list):
    """Per-GPU cap box before the domain limits, in whole milliwatts.

    Applies the device range, the thermal ceiling (one below the minimum holds the minimum, with
    an alert), the curve's valid range and rate floor, the slew limit and the idle cap. Returns
    (lo, hi, hi_reason, mn, floor_cap), each [G]: bounds [W], HI_* code, the device minimum [W]
    and the cap where the curve predicts RATE_FLOOR [W]."""
    name = (lambda g: pb.gpu_names[g] if g < len(pb.gpu_names) else f"#{g}")
    mn, mx, ceil = pb.min_cap_w, pb.max_cap_w, pb.thermal_ceiling_w
    # a ceiling at or above the device maximum is no constraint; one below the minimum (the model
    # may give any real number, negative when the GPU is far too hot) holds the minimum
    hi = np.minimum(mx, ceil)
    hi_reason = np.where(ceil < mx, HI_THERMAL, HI_DEVICE_MAX)
    low_ceiling = hi < mn
    for g in np.nonzero(low_ceiling)[0][:20]:
        alerts.append(f"gpu {name(g)} is too hot to keep below slowdown−margin even at its minimum cap "
                      f"({mn[g]:.0f} W): held at its minimum")
    if low_ceiling.sum() > 20:
        alerts.append(f"{int(low_ceiling.sum()) - 20} more GPUs too hot to keep below slowdown−margin even at "
                      "their minimum cap: held at their minimum")
    hi = np.maximum(hi, mn)
    lo = np.maximum(mn, np.minimum(pb.curve_min_w, hi))
    # never plan below the cap where the curve predicts RATE_FLOOR (extrapolated curves can reach 0)
    floor_cap = pb.curve_sat_w - pb.curve_k_w * np.log1p((1.0 - RATE_FLOOR) / pb.curve_a)
    lo = np.maximum(lo, np.minimum(floor_cap, hi))
    if pb.slew_w is not None:
        prev = pb.prev_cap_w
        known = np.isfinite(prev) & in_job
        lo = np.where(known, np.maximum(lo, np.minimum(prev - pb.slew_w, hi)), lo)
        up = np.where(known, np.maximum(prev + pb.slew_w, lo), np.inf)
        hi_reason = np.where(up < hi, HI_SLEW, hi_reason)
        hi = np.minimum(hi, up)
    idle_cap = np.clip(pb.idle_cap_w, mn, hi)
    lo = np.where(in_job, lo, idle_cap)
    hi = np.where(in_job, hi, idle_cap)

    # whole milliwatts from here on: finalize rounds caps to mW, and a bound that is not a whole mW
    # would be rounded up at a GPU's lower bound and overrun a limit the solver planned to within
    # LIMIT_MARGIN_W (the cause of most rounding repairs)
    hi = _mw_floor(hi)
    mn = np.minimum(_mw_ceil(mn), hi)
    floor_cap = _mw_ceil(floor_cap)
    lo = np.minimum(_mw_ceil(lo), hi)
    return lo, hi, hi_reason, mn, floor_cap


def _relax_minimums(pb, lo, hi, mn, floor_cap, in_job, pair_dom, pair_gpu, limit):
    """Relax soft lower bounds (curve range, slew) to the rate floor under domains that cannot
    hold them (idle GPUs there go to the device minimum).

    Arrays [G] in watts, ``limit`` [D]. Returns (lo, hi, min_load, dev_min_load): the new bounds
    and, per domain [D], the sum of lower bounds and the sum with job GPUs at the device minimum."""
    D = pb.n_domains
    min_load = np.bincount(pair_dom, lo[pair_gpu], minlength=D)
    short = min_load > limit
    if short.any():
        g_short = np.zeros(pb.n_gpus, bool)
        g_short[pair_gpu[short[pair_dom]]] = True
        lo = np.where(g_short, np.where(in_job, np.maximum(mn, np.minimum(floor_cap, hi)), mn), lo)
        hi = np.where(g_short & ~in_job, mn, hi)
        min_load = np.bincount(pair_dom, lo[pair_gpu], minlength=D)
    dev_min_load = np.bincount(pair_dom, np.where(in_job, mn, lo)[pair_gpu], minlength=D)
    return lo, hi, min_load, dev_min_load


def _hold_deficits(pb, lo, hi, hi_reason, mn, in_job, in_deficit, held_by, pair_dom, pair_gpu, depth):
    """Hold every GPU under a domain of ``in_deficit`` [D] (in deficit, or pinned: :func:`_pinned`)
    at its device minimum.

    Fills ``held_by`` [G] in place with the highest such domain above each held GPU. Returns
    the new (lo, hi, hi_reason) [G] (bounds in watts; hi = lo and HI_MIN where held)."""
    sel = in_deficit[pair_dom]
    # the highest deficit domain above each held GPU (smallest depth wins: written last)
    order = np.argsort(-depth[pair_dom[sel]], kind="stable")
    held_by[pair_gpu[sel][order]] = pair_dom[sel][order]
    held = held_by >= 0
    lo = np.where(held & in_job, mn, lo)
    hi = np.where(held, lo, hi)
    hi_reason = np.where(held, HI_MIN, hi_reason)
    return lo, hi, hi_reason


def _rate_ranges(pb, lo, hi, jg, alerts):
    """Job speed normalization and rate ranges for the cap boxes [lo, hi] [G] (watts).

    ``jg``: indices of the GPUs in a job. Returns (sigma [G] speed relative to the job's slowest
    GPU, s_lo [J] rate with every GPU at lo, s_max [J] highest reachable rate (<= 1), s_max_gpu
    [J] GPU that limits s_max (-1 none), has_gpu [J] bool); a job whose ceiling allows no positive
    rate is held at its minimum caps, with an alert. Jobs without GPUs get rate 1."""
    J = pb.n_jobs
    job = pb.job_of_gpu[jg]
    slow_speed, _ = _seg_min(pb.speed[jg], job, J)
    sigma = np.ones(pb.n_gpus)
    sigma[jg] = pb.speed[jg] / slow_speed[job]
    # the unclamped family here: the solver's cost max(lo, phi(s)) must stay continuous
    rho_lo = raw_rate(lo[jg], pb.curve_a[jg], pb.curve_k_w[jg], pb.curve_sat_w[jg])
    rho_hi = raw_rate(hi[jg], pb.curve_a[jg], pb.curve_k_w[jg], pb.curve_sat_w[jg])
    s_max, arg = _seg_min(sigma[jg] * rho_hi, job, J)
    s_max_gpu = np.where(arg >= 0, jg[np.maximum(arg, 0)], -1)
    s_max = np.minimum(s_max, 1.0)
    s_lo, _ = _seg_min(sigma[jg] * rho_lo, job, J)
    s_lo = np.maximum(s_lo, 1e-9)  # extrapolated curves may reach 0 at the device minimum
    s_lo = np.minimum(s_lo, s_max)
    stalled = (s_max <= 1e-9) & (s_lo < 1e300)
    if stalled.any():
        for j in np.nonzero(stalled)[0][:20]:
            alerts.append(f"job {pb.job_names[j] if j < len(pb.job_names) else j}: a GPU's ceiling "
                          "allows no positive predicted rate; the job is held at its minimum caps")
        s_max = np.where(stalled, 1e-9, s_max)
        s_lo = np.minimum(s_lo, s_max)
    has_gpu = np.zeros(J, bool)
    has_gpu[job] = True
    s_max[~has_gpu] = 1.0
    s_lo[~has_gpu] = 1.0
    return sigma, s_lo, s_max, s_max_gpu, has_gpu


def _mw_ceil(x):
    """Smallest whole milliwatt >= x [W] (inf stays inf)."""
    x = np.asarray(x, float)
    with np.errstate(invalid="ignore"):
        v = np.ceil(x * 1000.0 - 1e-6) / 1000.0
        v = np.where(v < x, v + 0.001, v)
    return np.where(np.isfinite(x), v, x)


def _mw_floor(x):
    """Largest whole milliwatt <= x [W] (inf stays inf)."""
    x = np.asarray(x, float)
    with np.errstate(invalid="ignore"):
        v = np.floor(x * 1000.0 + 1e-6) / 1000.0
        v = np.where(v > x, v - 0.001, v)
    return np.where(np.isfinite(x), v, x)


def cap_at_rate(pb, gpus, sigma, s):
    """phi_g(s): smallest cap [W] at which GPU g (in a job of rate s) keeps pace. Arrays over gpus."""
    r = np.minimum(s / sigma, 1.0)
    return pb.curve_sat_w[gpus] - pb.curve_k_w[gpus] * np.log1p((1.0 - r) / pb.curve_a[gpus])


def job_objective(pb, s):
    w = pb.job_weight
    if pb.objective == "proportional":
        # rates are >= the curve floor (curves.RATE_MIN) by construction; never take the log of
        # a non-positive number even if a caller passes one
        return float(np.sum(w * np.log(np.maximum(np.asarray(s, float), 1e-12))))
    return float(np.sum(w * s))


def finalize(pb: AllocationProblem, prep: Prep, s: np.ndarray, price: np.ndarray, *, solver: str,
             t0: float, iterations: int = 0, alerts=()) -> AllocationResult:
    """Caps from job rates s[J] (minimal power keeping pace), milliwatt rounding with exact domain
    feasibility, rates/bindings/prices. ``price``[D] are the domain multipliers."""
    D = prep.D
    alerts = list(prep.alerts) + list(alerts)
    lo, hi = prep.lo, prep.hi
    cap = lo.copy()
    jg = np.nonzero(prep.in_job)[0]
    if jg.size:
        cap[jg] = np.clip(cap_at_rate(pb, jg, prep.sigma[jg], s[pb.job_of_gpu[jg]]), lo[jg], hi[jg])
    cap_mw, cut_gpu = _round_caps_mw(pb, prep, cap, alerts)
    cap_w = cap_mw / 1000.0
    load_w = np.bincount(prep.pair_dom, cap_w[prep.pair_gpu], minlength=D)

    # ---- rates from the rounded caps
    job = pb.job_of_gpu[jg]
    rho = curve_rate(cap_w[jg], pb.curve_a[jg], pb.curve_k_w[jg], pb.curve_sat_w[jg]) * prep.sigma[jg]
    job_rate, arg = _seg_min(rho, job, prep.J)
    job_rate = np.where(prep.has_gpu, np.minimum(job_rate, 1.0), 1.0)
    slowest = np.where(arg >= 0, jg[np.maximum(arg, 0)], -1)

    price = _slack_prices(prep, price, load_w)
    # ---- binding reasons, from the rates the rounded caps give (a repair may have cut a job
    # below the solver's rate: then what binds is the domain that was repaired, not its s_max)
    s_eff = np.asarray(s, float).copy()
    if cut_gpu.any():
        cut_jobs = np.unique(pb.job_of_gpu[cut_gpu & prep.in_job])
        s_eff[cut_jobs] = np.minimum(s_eff[cut_jobs], job_rate[cut_jobs])
    binding = _bindings(pb, prep, s_eff, _strongest_domain(pb, prep, price, jg))
    slowest = _pace_setter(prep, s_eff, slowest, jg, rho, job_rate)
    feasible = not bool(prep.in_deficit.any())
    return AllocationResult(
        cap_w=cap_w, job_rate=job_rate, job_binding=binding, slowest_gpu=slowest,
        domain_price=price, domain_load_w=load_w, domain_deficit_w=prep.deficit_w,
        feasible=feasible, alerts=alerts, solve_time_s=time.perf_counter() - t0,
        objective_value=job_objective(pb, job_rate), solver=solver, iterations=iterations)


PACE_SETTER_RTOL = 1e-5
"""Relative rate tolerance within which the GPU whose upper bound sets a job's highest reachable
rate is named its slowest. Milliwatt rounding leaves the job-mates paced to it a hair slower: about
1 mW below, measured 1.1e-6 of the rate on the H100 default curve at 500 W (a test); steeper curves
at low caps lose a few times more. One clock step (15 MHz of ~2 GHz) is ~7e-3: far above it."""


def _pace_setter(prep: Prep, s_eff: np.ndarray, slowest: np.ndarray, jg: np.ndarray, rho: np.ndarray,
                 job_rate: np.ndarray) -> np.ndarray:
    """``slowest`` [J] (GPU index per job) with a job that runs at its highest reachable rate named
    after the GPU whose upper bound sets that rate (``prep.s_max_gpu``: the one its binding reason
    is about, e.g. a GPU held at a fixed cap) when that GPU's rate is within
    :data:`PACE_SETTER_RTOL` of the job's; ``rho`` [len(jg)]: the rates of the GPUs ``jg``."""
    cand = prep.s_max_gpu
    at_max = prep.has_gpu & (cand >= 0) & (s_eff >= prep.s_max - 1e-7 * np.maximum(1.0, prep.s_max))
    if not at_max.any():
        return slowest
    rate_g = np.full(prep.G, np.inf)
    rate_g[jg] = rho
    near = rate_g[np.maximum(cand, 0)] <= np.minimum(job_rate, 1.0) * (1.0 + PACE_SETTER_RTOL) + 1e-12
    return np.where(at_max & near, cand, slowest)


def _round_caps_mw(pb: AllocationProblem, prep: Prep, cap: np.ndarray, alerts: list):
    """Round caps [G] in watts down to whole milliwatts within [lo, hi], then repair every domain
    (not in deficit, not pinned) left over its limit minus 1 mW, deepest first.

    Returns (cap_mw [G] integral milliwatts as floats, cut_gpu [G] bool: GPUs the repair lowered,
    whose job's rate is then below the solver's). Appends an alert when a repair was needed."""
    lo, hi = prep.lo, prep.hi
    # ---- milliwatt rounding, exact: integers, floor, then repair any domain over its limit
    lo_mw = np.ceil(lo * 1000.0 - 1e-6)  # lo, hi are whole mW (prepare): no spurious round-up
    lo_mw += (lo_mw / 1000.0 < lo)
    hi_mw = np.floor(hi * 1000.0 + 1e-6)
    hi_mw -= (hi_mw / 1000.0 > hi)
    lo_mw = np.minimum(lo_mw, hi_mw)
    cap_mw = np.clip(np.floor(cap * 1000.0), lo_mw, hi_mw)
    lim_mw = np.where(np.isfinite(prep.limit), np.floor(np.nan_to_num(prep.limit, posinf=0) * 1000.0) - 1, np.inf)
    load_mw = np.bincount(prep.pair_dom, cap_mw[prep.pair_gpu], minlength=prep.D)
    # (a pinned domain's GPUs are at their minimums already: at most its limit, never over it)
    over = np.nonzero((load_mw > lim_mw) & ~prep.in_deficit & ~prep.pinned)[0]
    cut_gpu = np.zeros(prep.G, bool)  # GPUs the repair lowered (their job's rate is below s)
    if over.size:
        order = np.argsort(-prep.depth[over], kind="stable")
        members = {}
        for d in over[order]:
            if d not in members:
                members[d] = prep.pair_gpu[prep.pair_dom == d]
            _repair_domain(pb, int(d), members[d], cap_mw, lo_mw, lim_mw, cut_gpu, alerts)
        if len(members):
            alerts.append(f"rounding repair lowered caps under {len(members)} domain(s)")
    return cap_mw, cut_gpu


def _repair_domain(pb, d, gs, cap_mw, lo_mw, lim_mw, cut_gpu, alerts) -> None:
    """Lower the caps of domain ``d``'s GPUs ``gs`` until their sum fits ``lim_mw[d]`` [mW].

    The cut is proportional to each GPU's room above ``lo_mw`` (rounded up, the remainder given
    greedily). Updates ``cap_mw`` and ``cut_gpu`` [G] in place; alerts if the room is too small."""
    excess = float(cap_mw[gs].sum() - lim_mw[d])
    if excess <= 0:
        return
    room = cap_mw[gs] - lo_mw[gs]
    total = room.sum()
    if total < excess:  # cannot happen unless the limit is within 1 mW of the minimums
        cap_mw[gs] = lo_mw[gs]
        alerts.append(f"domain {pb.domain_name(d)}: rounding left {excess - total:.0f} mW over")
        return
    cut = np.minimum(room, np.ceil(room * (excess / total)))
    # fix overshoot/undershoot of the proportional cut greedily
    extra = excess - cut.sum()
    if extra > 0:
        idx = np.argsort(-(room - cut))
        take = np.minimum(room[idx] - cut[idx], extra)
        take = np.where(np.cumsum(take) - take < extra, take, 0)
        cut[idx] += take
    cap_mw[gs] -= cut
    cut_gpu[gs[cut > 0]] = True


def _slack_prices(prep: Prep, price: np.ndarray, load_w: np.ndarray) -> np.ndarray:
    """Domain prices [D] after complementary slackness at the rounded loads ``load_w`` [D] (W).

    A domain with slack (beyond the < 1 mW per GPU that flooring loses) or no limit has price 0
    (a solver stopped early may leave a positive multiplier on a slack domain); NaN in deficit."""
    price = np.nan_to_num(np.asarray(price, float))
    lim = prep.limit
    n_under = np.bincount(prep.pair_dom, minlength=prep.D)  # milliwatt flooring loses < 1 mW per GPU
    slack_tol = 1.0 + 1e-3 * n_under + 1e-6 * np.where(np.isfinite(lim), np.abs(np.nan_to_num(lim, posinf=0.0)), 0.0)
    slack = np.isfinite(lim) & (load_w < lim - slack_tol)
    price = np.where(slack | ~np.isfinite(lim), 0.0, price)
    return np.where(prep.in_deficit | prep.pinned, np.nan, price)


def _strongest_domain(pb: AllocationProblem, prep: Prep, price: np.ndarray, jg: np.ndarray) -> np.ndarray:
    """Per job [J]: the priced domain (price [D] > 0) above any of its GPUs with the highest
    price, -1 for none. ``jg``: indices of the GPUs in a job."""
    J = prep.J
    best_dom = np.full(J, -1, np.int64)
    if jg.size and np.any(np.nan_to_num(price) > 0):
        pj = pb.job_of_gpu[prep.pair_gpu]
        sel = (pj >= 0) & (np.nan_to_num(price)[prep.pair_dom] > 0)
        if sel.any():
            val = np.nan_to_num(price)[prep.pair_dom[sel]]
            _, a = _seg_min(-val, pj[sel], J)
            ok = a >= 0
            best_dom[ok] = prep.pair_dom[sel][a[ok]]
    return best_dom


def _bindings(pb: AllocationProblem, prep: Prep, s_eff: np.ndarray, best_dom: np.ndarray) -> list:
    """Why each job is not faster (``AllocationResult.job_binding``, one string per job).

    ``s_eff`` [J]: the rates the rounded caps give; ``best_dom`` [J]: from :func:`_strongest_domain`.
    Vectorized over jobs (100k single-GPU jobs are a benchmark case)."""
    tol = 1e-7
    J = prep.J
    out = np.full(J, "device_min", dtype=object)
    gl = np.maximum(prep.s_max_gpu, 0)
    held = np.where(prep.has_gpu, prep.held_by[gl], -1)
    at_max = s_eff >= prep.s_max - tol * np.maximum(1.0, prep.s_max)
    # assigned from the weakest reason to the strongest, so the strongest one wins
    dom = (best_dom >= 0) & ~at_max
    if dom.any():
        out[dom] = _labels(pb, "domain:", best_dom[dom])
    hi_names = np.array([_HI_NAMES[k] for k in range(len(_HI_NAMES))], dtype=object)
    out[at_max] = hi_names[prep.hi_reason[gl[at_max]]]
    deficit = (held >= 0) & prep.in_deficit[np.maximum(held, 0)]
    if deficit.any():
        out[deficit] = _labels(pb, "deficit:", held[deficit])
    pinned = (held >= 0) & ~deficit
    if pinned.any():  # held at the minimums by a limit with no room above them: that domain binds
        out[pinned] = _labels(pb, "domain:", held[pinned])
    out[s_eff >= 1.0 - tol] = "saturated"
    out[~prep.has_gpu] = "no_gpus"
    return out.tolist()


def _labels(pb: AllocationProblem, prefix: str, doms: np.ndarray) -> np.ndarray:
    """``prefix + domain name`` for each domain index in ``doms`` (object array, same shape)."""
    uniq, inv = np.unique(doms, return_inverse=True)
    return np.array([prefix + pb.domain_name(int(d)) for d in uniq], dtype=object)[inv]


__all__ = ["prepare", "finalize", "Prep", "cap_at_rate", "job_objective", "ancestors", "LIMIT_MARGIN_W", "RATE_FLOOR"]
