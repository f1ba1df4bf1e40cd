"""Fast exact allocator: dual decomposition over domain prices, solved by projected Newton.

API: ``solve(problem: AllocationProblem) -> AllocationResult`` (see :mod:`capctl.allocator.problem`).

Method (details and the proof sketch in docs/allocation.md):

* With job rate s_j the cheapest caps are ``P_g = max(lo_g, phi_g(s_j))`` where ``phi_g`` is the
  inverse rate curve (convex, increasing); so the problem is ``max sum_j w_j U(s_j)`` subject to
  ``sum_j c_jd(s_j) <= B_d`` for every domain d, with convex increasing c_jd — a convex program in
  the J job rates.
* Lagrangian relaxation with one price lambda_d >= 0 per domain that can bind: for given prices
  every job solves a 1-D concave problem ``max w U(s) - sum_g pi_g max(lo_g, phi_g(s))`` on
  [s_lo, s_max] (pi_g = sum of prices of the GPU's domains) — vectorized binary search over the
  job's sorted kinks (where a GPU leaves its minimum cap), then safeguarded Newton.
* The dual ``min_{lambda >= 0} D(lambda)`` is convex and differentiable (unique job optimum);
  gradient = B - load, Hessian = M diag(1/h) M^T. Projected Newton with an Armijo line search
  (Bertsekas 1982, "Projected Newton methods for optimization problems with simple constraints")
  with Levenberg-Marquardt damping (redundant domain constraints make the Hessian singular) and
  Armijo backtracking (rows whose jobs all sit at a bound or a kink get the curvature the jobs
  would have if free, and an accepted full step there is extended while the dual decreases), until the KKT conditions hold to ~1e-10 relative; strong duality (Slater) makes the primal
  optimal. Rounding to milliwatts with an exact integer repair gives feasibility.
* Starting prices from a primal-dual interior-point method on the same program with the caps as
  variables (:mod:`capctl.allocator.interior`): it does not see the kinks, where the dual Newton
  converges only linearly, so the exact method starts next to the optimum and certifies it in a
  few steps (issue 12: 176 -> 2-3 Newton iterations on the 42 % instance at 100k GPUs).
"""

from __future__ import annotations

import time

import numpy as np
import scipy.linalg
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from ._core import LIMIT_MARGIN_W, finalize, prepare
from .interior import interior_prices
from .problem import AllocationProblem, AllocationResult

__all__ = ["solve"]
DENSE_MAX = 50  # free prices up to this count: dense Cholesky, else sparse LU
#: start the dual from the interior-point method's prices (capctl.allocator.interior); False:
#: from the marginal-utility guess alone (the method before issue 12; bench/solver_scale.py
#: --no-interior measures it)
USE_INTERIOR = True
_IPM_TRACE = None  # debugging hook: a list collects the interior-point method's (iteration, mu, steps)
_TRACE = None  # debugging hook: a list collects (iteration, KKT residual W, dual, damping, free)


class _Jobs:
    """Vectorized 1-D job subproblems for the jobs whose rate can move (s_lo < s_max)."""

    def __init__(self, pb, prep, var_jobs):
        self.pb = pb
        self.nv = var_jobs.size
        remap = np.full(prep.J, -1, np.int64)
        remap[var_jobs] = np.arange(self.nv)
        jg = np.nonzero(prep.in_job)[0]
        jg = jg[remap[pb.job_of_gpu[jg]] >= 0]
        self.gpus = jg
        self.job = remap[pb.job_of_gpu[jg]]
        sig = prep.sigma[jg]
        a = pb.curve_a[jg]
        self.k = pb.curve_k_w[jg]
        self.sat = pb.curve_sat_w[jg]
        self.a = a
        self.c = sig * (1.0 + a)          # phi'(s) = k / (c - s)
        self.sig_a = sig * a
        self.sig = sig
        self.lo = prep.lo[jg]
        self.hi = prep.hi[jg]
        from .curves import rate_unclamped
        self.t = sig * rate_unclamped(self.lo, a, self.k, self.sat)  # rate above which g needs > lo
        self.w = pb.job_weight[var_jobs]
        self.s_lo = prep.s_lo[var_jobs]
        self.s_max = prep.s_max[var_jobs]
        self.prop = pb.objective == "proportional"

        # kinks: rates t_g at which GPU g leaves its lower bound, sorted per job
        order = np.lexsort((self.t, self.job))
        self.kink_t = self.t[order]
        self.kink_job = self.job[order]
        self._M = float(np.max(self.t, initial=0.0)) + 2.0
        self.kink_key = self.kink_job * self._M + self.kink_t

    def _F(self, s, pi_g, strict=True):
        sg = s[self.job]
        act = (sg > self.t) if strict else (sg >= self.t)
        d = np.where(act, 1.0 / (self.c - sg), 0.0)
        f1 = np.bincount(self.job, pi_g * self.k * d, minlength=self.nv)
        f2 = np.bincount(self.job, pi_g * self.k * d * d, minlength=self.nv)
        if self.prop:
            return self.w / s - f1, -self.w / (s * s) - f2
        return self.w - f1, -f2

    def _F_both(self, s, pi_g):
        """(F just below s, F just above s): the cost derivative jumps at kinks."""
        sg = s[self.job]
        inv = 1.0 / (self.c - sg)
        base = pi_g * self.k * inv
        f_left = np.bincount(self.job, np.where(sg > self.t, base, 0.0), minlength=self.nv)
        f_right = np.bincount(self.job, np.where(sg >= self.t, base, 0.0), minlength=self.nv)
        u = self.w / s if self.prop else self.w
        return u - f_left, u - f_right

    def _probe_kink(self, probe, cand, open_, pi_g, lo, hi, lo_i, hi_i, s):
        """One bracketing step over sorted kinks: for jobs in ``probe``, evaluate F at kink ``cand``.

        Returns the new (lo, hi, lo_i, hi_i, s, at_kink): the bracket shrinks to the side of the
        kink that holds the root; a job whose root is the kink itself gets ``s`` = that kink."""
        tm = np.where(probe, self.kink_t[np.clip(cand, 0, max(self.kink_t.size - 1, 0))],
                      np.where(open_, 0.5 * (lo + hi), s))
        fl, fr = self._F_both(tm, pi_g)
        at_kink = probe & (fl >= 0) & (fr <= 0)
        up = probe & (fr > 0)
        down = probe & (fl < 0)
        return (np.where(up, tm, lo), np.where(down, tm, hi), np.where(up, cand, lo_i),
                np.where(down, cand, hi_i), np.where(at_kink, tm, s), at_kink)

    def rates(self, pi_g, s0=None, tol=1e-13, max_iter=60):
        """Optimal s[nv] for GPU prices pi_g; also h = -dF/ds (0 where at a bound).

        Binary search over the job's sorted kinks finds the kink-free interval (or the kink) that
        holds the root of the monotone F; safeguarded Newton finishes inside it."""
        lo, hi = self.s_lo.copy(), self.s_max.copy()
        F_hi, _ = self._F(hi, pi_g)
        at_hi = F_hi >= 0
        F_lo, _ = self._F(lo, pi_g, strict=False)
        at_lo = (F_lo <= 0) & ~at_hi
        open_ = ~(at_hi | at_lo)
        s = np.where(at_hi, hi, lo)
        lo, hi, s, kinked = self._bracket(pi_g, s0, lo, hi, s, open_)
        s = np.where(open_, 0.5 * (lo + hi) if s0 is None else np.clip(s0, lo, hi), s)
        s = np.where(open_ & ((s <= lo) | (s >= hi)), 0.5 * (lo + hi), s)
        s = self._polish(pi_g, s, lo, hi, open_, tol, max_iter)
        _, dF = self._F(s, pi_g)
        interior = ~(at_hi | at_lo | kinked) & (s < self.s_max) & (s > self.s_lo)
        h = np.where(interior, -dF, 0.0)  # jobs at a bound do not respond to prices locally
        self.h_bound = -dF  # their curvature if they were free (surrogate Hessian, see _Dual.hessian)
        return s, h

    def _bracket(self, pi_g, s0, lo, hi, s, open_):
        """Shrink each open job's rate bracket [lo, hi] (arrays [nv]) to one kink-free interval.

        Binary search over the job's sorted kinks, after a warm-start probe of the two kinks
        around the previous rates ``s0`` [nv] (or None). Clears ``open_`` [nv bool] in place for
        jobs whose root is a kink. Returns (lo, hi, s, kinked): ``s`` holds those kinks, ``kinked``
        [nv bool] marks them (optimum exactly at a kink: locally price-insensitive)."""
        kinked = np.zeros(self.nv, bool)
        jobs = np.arange(self.nv)
        lo_i = np.searchsorted(self.kink_key, jobs * self._M + lo, side="right") - 1
        hi_i = np.searchsorted(self.kink_key, jobs * self._M + hi, side="left")
        if s0 is not None and open_.any() and self.kink_t.size:
            # warm start: test the two kinks around the previous rate (one pass each)
            k_hi = np.searchsorted(self.kink_key, jobs * self._M + s0, side="right")
            for side in (0, 1):
                cand = k_hi - 1 + side
                usable = open_ & (cand > lo_i) & (cand < hi_i)
                if not usable.any():
                    continue
                lo, hi, lo_i, hi_i, s, at_kink = self._probe_kink(usable, cand, open_, pi_g, lo, hi, lo_i, hi_i, s)
                kinked |= at_kink
                open_ &= ~at_kink
        for _ in range(64):
            srch = open_ & (hi_i - lo_i > 1)
            if not srch.any():
                break
            mid = (lo_i + hi_i) // 2
            lo, hi, lo_i, hi_i, s, at_kink = self._probe_kink(srch, mid, open_, pi_g, lo, hi, lo_i, hi_i, s)
            kinked |= at_kink
            open_ &= ~at_kink
        return lo, hi, s, kinked

    def _polish(self, pi_g, s, lo, hi, open_, tol, max_iter):
        """Safeguarded Newton on F(s) = 0 for the ``open_`` jobs inside their kink-free brackets.

        ``s``, ``lo``, ``hi`` [nv] rates (``s`` strictly inside [lo, hi] where open), ``open_``
        [nv bool] (not modified); a Newton step leaving the bracket is replaced by bisection.
        Stops per job at relative width/step ``tol`` or after ``max_iter`` rounds. Returns s [nv]."""
        open_ = open_.copy()
        for _ in range(max_iter):
            if not open_.any():
                break
            F, dF = self._F(s, pi_g)
            pos = F > 0
            lo = np.where(open_ & pos, s, lo)
            hi = np.where(open_ & ~pos, s, hi)
            with np.errstate(divide="ignore", invalid="ignore"):
                nxt = s - F / dF
            small = np.abs(nxt - s) <= tol * s  # Newton converged (from one side of the bracket)
            bad = ~np.isfinite(nxt) | (nxt <= lo) | (nxt >= hi)
            nxt = np.where(bad, 0.5 * (lo + hi), nxt)
            done = (hi - lo <= tol * np.maximum(hi, 1e-300)) | small | (F == 0)
            s = np.where(open_ & ~done, nxt, s)
            open_ &= ~done
        return s

    def caps(self, s):
        sg = s[self.job]
        r = np.minimum(sg / self.sig, 1.0)
        phi = self.sat - self.k * np.log1p((1.0 - r) / self.a)
        return np.clip(phi, self.lo, self.hi), np.where(sg > self.t, self.k / (self.c - sg), 0.0)


def _kkt(lam, grad):
    """KKT residual [W] per price: |B - load| where the price is positive, else the overrun."""
    return np.where(lam > 0, np.abs(grad), np.maximum(-grad, 0.0))


class _Dual:
    """The dual function D(lambda) over the m candidate domains' prices, for the movable jobs.

    Holds the (candidate, var-GPU) pairs ``pc``/``pg`` [P'], the budgets ``budget`` [m] (limit
    minus the load of idle GPUs and fixed-rate jobs minus LIMIT_MARGIN_W, in watts) and
    ``scale_w`` [m] (|limit|, at least 1 W) that sets the KKT tolerance.
    """

    def __init__(self, pb, prep, var_jobs, s):
        """``var_jobs`` [nv]: jobs whose rate can move; ``s`` [J]: rates of the others."""
        cand = prep.candidates
        self.jobs = jobs = _Jobs(pb, prep, var_jobs)
        cand_idx = np.full(prep.D, -1, np.int64)
        cand_idx[cand] = np.arange(cand.size)
        gpu_var = np.full(prep.G, -1, np.int64)
        gpu_var[jobs.gpus] = np.arange(jobs.gpus.size)
        sel = (cand_idx[prep.pair_dom] >= 0) & (gpu_var[prep.pair_gpu] >= 0)
        self.pc = cand_idx[prep.pair_dom[sel]]
        self.pg = gpu_var[prep.pair_gpu[sel]]
        self.m = cand.size
        self.budget = prep.limit[cand] - _fixed_load(pb, prep, s, gpu_var)[cand] - LIMIT_MARGIN_W
        self.scale_w = np.maximum(np.abs(prep.limit[cand]), 1.0)
        self.depth_c = prep.depth[cand]
        self.parent_c = _candidate_parents(pb.domain_parent, cand_idx, cand)
        self.U = (lambda x: jobs.w * np.log(x)) if jobs.prop else (lambda x: jobs.w * x)

    def evaluate(self, lam, s0):
        """D at prices ``lam`` [m] (warm start: rates ``s0`` [nv] or None).

        Returns (sv [nv] job rates, (h, h_bound, dphi_b) curvature data for :meth:`newton_step`,
        dphi [GPUs of var jobs] marginal watts per rate, grad [m] = budget - load [W], dual value)."""
        jobs, pc, pg = self.jobs, self.pc, self.pg
        pi = np.bincount(pg, lam[pc], minlength=jobs.gpus.size)
        sv, h = jobs.rates(pi, s0)
        caps, dphi = jobs.caps(sv)
        # marginal watts of jobs at their upper bound, from the left (dphi is 0 there when a
        # GPU's kink sits exactly at s_max): used only by the surrogate Hessian
        _, dphi_b = jobs.caps(np.maximum(sv * (1.0 - 1e-9), jobs.s_lo))
        dphi_b = np.where(dphi > 0, dphi, dphi_b)
        load = np.bincount(pc, caps[pg], minlength=self.m)
        grad = self.budget - load
        dual = float(self.U(sv).sum() + lam @ grad)
        return sv, (h, jobs.h_bound.copy(), dphi_b), dphi, grad, dual

    def initial_prices(self, sv, dphi, grad):
        """Starting prices [m]: half the marginal utility per watt of their jobs on violated domains."""
        jobs, pc, pg = self.jobs, self.pc, self.pg
        mu_j = (jobs.w / sv if jobs.prop else jobs.w) / np.maximum(
            np.bincount(jobs.job, dphi, minlength=jobs.nv), 1e-12)
        guess = np.zeros(self.m)
        np.maximum.at(guess, pc, mu_j[jobs.job[pg]])
        return np.where(grad < 0, 0.5 * guess, 0.0)

    def hessian(self, lam, grad, h, dphi):
        """d2D/dlam2 = M diag(1/h) M^T restricted to the free prices (lam > 0 or violated).

        Returns (fidx [f] free price indices, H [f, f] sparse, its diagonal [f], surrogate: whether
        rows of jobs all at a bound got the curvature those jobs would have if free)."""
        jobs, pc, pg, m = self.jobs, self.pc, self.pg, self.m
        fidx = np.nonzero((lam > 0) | (grad < 0))[0]
        h_i, h_b, dphi_b = h
        inv_h = np.where(h_i > 0, 1.0 / np.where(h_i > 0, h_i, 1.0), 0.0)
        Mv = dphi[pg] * inv_h[jobs.job[pg]]
        M = sp.csr_matrix((dphi[pg], (pc, jobs.job[pg])), shape=(m, jobs.nv))
        Mw = sp.csr_matrix((Mv, (pc, jobs.job[pg])), shape=(m, jobs.nv))
        del Mv
        H = (Mw @ M.T)[fidx][:, fidx]
        diag = H.diagonal()
        # A free price whose jobs all sit at a bound has a zero row: the dual is linear there
        # (a domain over its limit with every job at s_max, e.g. at the start) and the
        # damped step would be scaled by an arbitrary floor. Give such rows the curvature the
        # jobs would have if they were free (their response once the price moves them off the
        # bound); the line search keeps the step safe.
        empty = ~(diag > 0)
        surrogate = bool(empty.any())
        if surrogate:
            inv_b = np.where(h_b > 0, 1.0 / np.where(h_b > 0, h_b, 1.0), 0.0)
            diag_b = np.bincount(pc, dphi_b[pg] ** 2 * inv_b[jobs.job[pg]], minlength=m)[fidx]
            add = np.where(empty, diag_b, 0.0)
            if np.any(add > 0):
                H = H + sp.diags(add)
                diag = H.diagonal()
        return fidx, H, diag, surrogate

    def newton_step(self, lam, grad, h, dphi, damp):
        """Damped Newton direction on D [m] (zero on fixed prices) and the surrogate flag."""
        fidx, H, diag, surrogate = self.hessian(lam, grad, h, dphi)
        d_full = np.zeros(self.m)
        d_full[fidx] = _damped_solve(H, diag, grad[fidx], damp)  # -H^{-1} grad
        return d_full, surrogate

    def line_search(self, lam, d_full, grad, dual, kkt, sv):
        """Projected Armijo backtracking along ``d_full`` from ``lam`` (dual value ``dual``, KKT
        residual ``kkt`` [m] W, rates ``sv``). Returns (step, lam_new, evaluation) or
        (step, None, None) when no step is accepted (then damp more)."""
        step = 1.0
        for _ls in range(4):
            lam_new = np.maximum(lam + step * d_full, 0.0)
            pred = float(grad @ (lam_new - lam))
            if pred >= 0:  # projection spoiled the Newton direction: damp more
                break
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # (see extend: not accepted)
                ev = self.evaluate(lam_new, sv)
            if ev[4] <= dual + 1e-4 * pred:  # (False for a NaN dual)
                return step, lam_new, ev
            if -pred <= 1e-13 * max(1.0, abs(dual)):
                # the decrease is below the resolution of the dual value: accept if the KKT
                # residual (what we actually drive to zero) shrinks
                if _kkt(lam_new, ev[3]).max() < kkt.max():
                    return step, lam_new, ev
            step *= 0.25
        return step, None, None

    def extend(self, lam, lam_new, ev):
        """Extend an accepted full step (x4 at a time, up to 30 times) while the dual decreases.

        The surrogate rows assume the jobs respond at once; where they sit at a kink or bound over
        a range of prices the dual is linear there and the step too short. Returns (lam, ev)."""
        for _ex in range(30):
            lam_x = np.maximum(lam + 4.0 * (lam_new - lam), 0.0)
            # far out (x4 per try) prices overflow the jobs' rate derivatives: such a point is
            # not a decrease (inf or NaN dual), the extension ends, quietly (numpy's overflow
            # warnings reached capctl sim's output at 0.3 x TDP; found by a try-out)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                ev_x = self.evaluate(lam_x, ev[0])
            if not (np.isfinite(ev_x[4]) and ev_x[4] < ev[4]):
                break
            lam_new, ev = lam_x, ev_x
        return lam_new, ev


def _candidate_parents(parent, cand_idx, cand):
    """Nearest candidate ancestor [m] (candidate index, -1 none) of each candidate ``cand`` [m];
    ``parent`` [D] the domain tree, ``cand_idx`` [D] candidate index of each domain (-1 none)."""
    out = np.full(cand.size, -1, np.int64)
    cur = parent[cand]
    todo = np.arange(cand.size)
    while todo.size:
        live = cur >= 0
        todo, cur = todo[live], cur[live]
        hit = cand_idx[cur] >= 0
        out[todo[hit]] = cand_idx[cur[hit]]
        todo, cur = todo[~hit], parent[cur[~hit]]
    return out


def _fixed_load(pb, prep, s, gpu_var):
    """Load [D] in watts of everything that does not move: idle GPUs (at lo) and GPUs of
    fixed-rate jobs (``gpu_var`` [G] < 0; at their cap for rate ``s`` [J])."""
    fixed_caps = np.zeros(prep.G)
    fixed_caps[~prep.in_job] = prep.lo[~prep.in_job]
    fj = np.nonzero(prep.in_job)[0]
    fj = fj[gpu_var[fj] < 0]
    if fj.size:
        from ._core import cap_at_rate
        fixed_caps[fj] = np.clip(cap_at_rate(pb, fj, prep.sigma[fj], s[pb.job_of_gpu[fj]]),
                                 prep.lo[fj], prep.hi[fj])
    return np.bincount(prep.pair_dom, fixed_caps[prep.pair_gpu], minlength=prep.D)


def _damped_solve(H, diag, gF, damp):
    """Solve (H + Marquardt damping) d = -gF for the free prices (H sparse [f, f], diag [f]).

    Damping is ``damp`` times each diagonal entry (scale-free) with a floor; dense Cholesky up to
    DENSE_MAX prices, else sparse LU; a singular system falls back to a diagonally scaled step."""
    reg_floor = diag.max() if diag.size and diag.max() > 0 else 1.0
    try:
        dreg = damp * (diag + 1e-6 * reg_floor) + 1e-300
        if gF.size <= DENSE_MAX:
            Hd = H.toarray()
            Hd[np.diag_indices_from(Hd)] += dreg
            return scipy.linalg.solve(Hd, -gF, assume_a="pos", check_finite=False)
        Hs = (H + sp.diags(dreg)).tocsc()
        return spla.spsolve(Hs, -gF)
    except (np.linalg.LinAlgError, scipy.linalg.LinAlgError, RuntimeError):
        return -gF / np.maximum(diag, 1e-6 * reg_floor)


def _projected_newton(dual, max_iter, tol_rel, alerts):
    """Minimize the dual over lam >= 0 (projected Newton, Levenberg-Marquardt damping, Armijo).

    Stops when every KKT residual is within ``tol_rel`` x |limit| + 1e-6 W, after ``max_iter``
    iterations or when damping saturates; appends an alert when it stopped short. Returns
    (lam [m] prices, sv [nv] job rates, iterations)."""
    it = 0
    lam = np.zeros(dual.m)
    sv, h, dphi, grad, value = dual.evaluate(lam, None)
    if np.any(grad < 0):  # initial prices for violated domains
        start = interior_prices(dual.jobs, dual.pc, dual.pg, dual.budget, dual.depth_c, dual.parent_c,
                                trace=_IPM_TRACE) if USE_INTERIOR else None
        if start is not None:
            lam = start[0]
            sv, h, dphi, grad, value = dual.evaluate(lam, start[1])
        else:
            lam = dual.initial_prices(sv, dphi, grad)
            sv, h, dphi, grad, value = dual.evaluate(lam, sv)
    damp = 1e-2
    for it in range(1, max_iter + 1):
        tol_w = tol_rel * dual.scale_w + 1e-6
        kkt = _kkt(lam, grad)
        if _TRACE is not None:
            _TRACE.append((it, float(kkt.max()), float(value), damp, int(((lam > 0) | (grad < 0)).sum())))
        if np.all(kkt <= tol_w):
            break
        d_full, surrogate = dual.newton_step(lam, grad, h, dphi, damp)
        step, lam_new, ev = dual.line_search(lam, d_full, grad, value, kkt, sv)
        if lam_new is None:
            # Levenberg-Marquardt: more damping turns the step toward scaled steepest descent
            damp = min(damp * 10.0, 1e12)
            if damp >= 1e12:
                break
            continue
        if surrogate and step == 1.0:
            lam_new, ev = dual.extend(lam, lam_new, ev)
        damp = max(damp * 0.1, 1e-9)
        lam, (sv, h, dphi, grad, value) = lam_new, ev
    kkt = _kkt(lam, grad)
    if np.any(kkt > 1e-6 * dual.scale_w + 1e-3):
        alerts.append(f"fast allocator stopped after {it} iterations with KKT residual "
                      f"{float(kkt.max()):.3g} W; caps are feasible but may be suboptimal")
    return lam, sv, it


def solve(problem: AllocationProblem, *, max_iter: int = 200, tol_rel: float = 1e-9) -> AllocationResult:
    """Exact allocation (see module docstring). Shapes/units: :class:`AllocationResult`.

    Raises ValueError for an invalid problem (via ``problem.validate()`` at build time). Never
    raises for infeasible budgets: those yield ``feasible=False`` with deficits and alerts.
    """
    t0 = time.perf_counter()
    pb = problem
    prep = prepare(pb)
    s = prep.s_max.copy()
    price = np.zeros(prep.D)
    var_jobs = np.nonzero(prep.has_gpu & (prep.s_max > prep.s_lo))[0]
    cand = prep.candidates
    it = 0
    alerts = []
    if var_jobs.size and cand.size:
        lam, sv, it = _projected_newton(_Dual(pb, prep, var_jobs, s), max_iter, tol_rel, alerts)
        s[var_jobs] = sv
        price[cand] = lam
    elif var_jobs.size:
        s[var_jobs] = prep.s_max[var_jobs]
    return finalize(pb, prep, s, price, solver="fast", t0=t0, iterations=it, alerts=alerts)
