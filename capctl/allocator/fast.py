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
"""

from __future__ import annotations

import time

import numpy as np
import scipy.linalg
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from ._core import LIMIT_MARGIN_W, finalize, prepare
from .problem import AllocationProblem, AllocationResult

__all__ = ["solve"]
DENSE_MAX = 50  # free prices up to this count: dense Cholesky, else sparse LU
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
        kinked = np.zeros(self.nv, bool)  # optimum exactly at a kink: locally price-insensitive
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
        s = np.where(open_, 0.5 * (lo + hi) if s0 is None else np.clip(s0, lo, hi), s)
        s = np.where(open_ & ((s <= lo) | (s >= hi)), 0.5 * (lo + hi), s)
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
        _, dF = self._F(s, pi_g)
        interior = ~(at_hi | at_lo | kinked) & (s < self.s_max) & (s > self.s_lo)
        h = np.where(interior, -dF, 0.0)  # jobs at a bound do not respond to prices locally
        self.h_bound = -dF  # their curvature if they were free (surrogate Hessian, see solve)
        return s, h

    def caps(self, s):
        sg = s[self.job]
        r = np.minimum(sg / self.sig, 1.0)
        phi = self.sat - self.k * np.log1p((1.0 - r) / self.a)
        return np.clip(phi, self.lo, self.hi), np.where(sg > self.t, self.k / (self.c - sg), 0.0)


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
        jobs = _Jobs(pb, prep, var_jobs)
        # (candidate, var-gpu) pairs
        cand_idx = np.full(prep.D, -1, np.int64)
        cand_idx[cand] = np.arange(cand.size)
        gpu_var = np.full(prep.G, -1, np.int64)
        gpu_var[jobs.gpus] = np.arange(jobs.gpus.size)
        sel = (cand_idx[prep.pair_dom] >= 0) & (gpu_var[prep.pair_gpu] >= 0)
        pc = cand_idx[prep.pair_dom[sel]]
        pg = gpu_var[prep.pair_gpu[sel]]
        m = cand.size
        # load of everything that does not move: idle GPUs and fixed-rate jobs
        fixed_caps = np.zeros(prep.G)
        fixed_caps[~prep.in_job] = prep.lo[~prep.in_job]
        fj = np.nonzero(prep.in_job)[0]
        fj = fj[gpu_var[fj] < 0]
        if fj.size:
            from ._core import cap_at_rate
            fixed_caps[fj] = np.clip(cap_at_rate(pb, fj, prep.sigma[fj], s[pb.job_of_gpu[fj]]),
                                     prep.lo[fj], prep.hi[fj])
        fixed_load = np.bincount(prep.pair_dom, fixed_caps[prep.pair_gpu], minlength=prep.D)[cand]
        budget = prep.limit[cand] - fixed_load - LIMIT_MARGIN_W
        scale_w = np.maximum(np.abs(prep.limit[cand]), 1.0)
        U = (lambda x: jobs.w * np.log(x)) if jobs.prop else (lambda x: jobs.w * x)

        def evaluate(lam, s0):
            pi = np.bincount(pg, lam[pc], minlength=jobs.gpus.size)
            sv, h = jobs.rates(pi, s0)
            caps, dphi = jobs.caps(sv)
            # marginal watts of jobs at their upper bound, from the left (dphi is 0 there when a
            # GPU's kink sits exactly at s_max): used only by the surrogate Hessian
            _, dphi_b = jobs.caps(np.maximum(sv * (1.0 - 1e-9), jobs.s_lo))
            dphi_b = np.where(dphi > 0, dphi, dphi_b)
            load = np.bincount(pc, caps[pg], minlength=m)
            grad = budget - load
            dual = float(U(sv).sum() + lam @ grad)
            return sv, (h, jobs.h_bound.copy(), dphi_b), dphi, grad, dual

        lam = np.zeros(m)
        sv, h, dphi, grad, dual = evaluate(lam, None)
        # initial prices for violated domains: the marginal utility per watt of their jobs
        if np.any(grad < 0):
            mu_j = (jobs.w / sv if jobs.prop else jobs.w) / np.maximum(
                np.bincount(jobs.job, dphi, minlength=jobs.nv), 1e-12)
            guess = np.zeros(m)
            np.maximum.at(guess, pc, mu_j[jobs.job[pg]])
            lam = np.where(grad < 0, 0.5 * guess, 0.0)
            sv, h, dphi, grad, dual = evaluate(lam, sv)
        damp = 1e-2
        for it in range(1, max_iter + 1):
            tol_w = tol_rel * scale_w + 1e-6
            kkt = np.where(lam > 0, np.abs(grad), np.maximum(-grad, 0.0))
            if _TRACE is not None:
                _TRACE.append((it, float(kkt.max()), float(dual), damp, int(((lam > 0) | (grad < 0)).sum())))
            if np.all(kkt <= tol_w):
                break
            free = (lam > 0) | (grad < 0)
            fidx = np.nonzero(free)[0]
            h_i, h_b, dphi_b = h
            inv_h = np.where(h_i > 0, 1.0 / np.where(h_i > 0, h_i, 1.0), 0.0)
            Mv = dphi[pg] * inv_h[jobs.job[pg]]
            rows = pc
            M = sp.csr_matrix((dphi[pg], (rows, jobs.job[pg])), shape=(m, jobs.nv))
            Mw = sp.csr_matrix((Mv, (rows, jobs.job[pg])), shape=(m, jobs.nv))
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
            reg_floor = diag.max() if diag.size and diag.max() > 0 else 1.0
            gF = grad[fidx]
            try:
                # Marquardt damping: proportional to each diagonal entry (scale-free), with a floor
                dreg = damp * (diag + 1e-6 * reg_floor) + 1e-300
                if fidx.size <= DENSE_MAX:
                    Hd = H.toarray()
                    Hd[np.diag_indices_from(Hd)] += dreg
                    d = scipy.linalg.solve(Hd, -gF, assume_a="pos", check_finite=False)
                else:
                    Hs = (H + sp.diags(dreg)).tocsc()
                    d = spla.spsolve(Hs, -gF)
            except (np.linalg.LinAlgError, scipy.linalg.LinAlgError, RuntimeError):
                d = -gF / np.maximum(diag, 1e-6 * reg_floor)
            d_full = np.zeros(m)
            d_full[fidx] = d  # Newton step on D: -H^{-1} grad, H = d2D/dlam2 = M diag(1/h) M^T
            step = 1.0
            accepted = False
            for _ls in range(4):
                lam_new = np.maximum(lam + step * d_full, 0.0)
                pred = float(grad @ (lam_new - lam))
                if pred >= 0:  # projection spoiled the Newton direction: damp more
                    break
                sv2, h2, dphi2, grad2, dual2 = evaluate(lam_new, sv)
                if dual2 <= dual + 1e-4 * pred:
                    accepted = True
                    break
                if -pred <= 1e-13 * max(1.0, abs(dual)):
                    # the decrease is below the resolution of the dual value: accept if the KKT
                    # residual (what we actually drive to zero) shrinks
                    kkt2 = np.where(lam_new > 0, np.abs(grad2), np.maximum(-grad2, 0.0))
                    if kkt2.max() < kkt.max():
                        accepted = True
                        break
                step *= 0.25
            if not accepted:
                # Levenberg-Marquardt: more damping turns the step toward scaled steepest descent
                damp = min(damp * 10.0, 1e12)
                if damp >= 1e12:
                    break
                continue
            if surrogate and step == 1.0:
                # the surrogate rows assume the jobs respond at once; where they sit at a kink or
                # bound over a range of prices the dual is linear there and the step too short:
                # extend it while the dual keeps decreasing (a few evaluations, only then)
                for _ex in range(30):
                    lam_x = np.maximum(lam + 4.0 * (lam_new - lam), 0.0)
                    ev = evaluate(lam_x, sv2)
                    if not ev[4] < dual2:
                        break
                    lam_new, (sv2, h2, dphi2, grad2, dual2) = lam_x, ev
            damp = max(damp * 0.1, 1e-9)
            lam, sv, h, dphi, grad, dual = lam_new, sv2, h2, dphi2, grad2, dual2
        kkt = np.where(lam > 0, np.abs(grad), np.maximum(-grad, 0.0))
        if np.any(kkt > 1e-6 * scale_w + 1e-3):
            alerts.append(f"fast allocator stopped after {it} iterations with KKT residual "
                          f"{float(kkt.max()):.3g} W; caps are feasible but may be suboptimal")
        s[var_jobs] = sv
        price[cand] = lam
    elif var_jobs.size:
        s[var_jobs] = prep.s_max[var_jobs]
    return finalize(pb, prep, s, price, solver="fast", t0=t0, iterations=it, alerts=alerts)
