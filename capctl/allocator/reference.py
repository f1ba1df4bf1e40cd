"""Reference allocator: the same convex program in cvxpy (DCP and DPP), solved by Clarabel.

API::

    ReferenceSolver(problem)          # builds the cvxpy problem once for problem's *structure*
    ReferenceSolver.solve(problem)    # -> AllocationResult; re-solves with new parameter values
    solve_reference(problem)          # one-shot convenience

Structure (fixed per ReferenceSolver): job_of_gpu, domain_of_gpu, domain_parent, number of jobs,
objective. Everything else (caps, ceilings, curves, speeds, weights, limits, slew) is a
cp.Parameter, so interval-to-interval re-solves skip canonicalization (cvxpy DPP).

Formulation, per job GPU g with x_g = (sat_g - P_g) / k_g (so P_g = sat_g - k_g x_g is
parameter-affine in the variable, as DPP requires)::

    maximize   sum_j w_j log s_j            (or sum_j w_j s_j)
    subject to s_j <= sigma_g (1 + a_g) - sigma_g a_g exp(x_g)   for g in job j   (= sigma_g rho_g(P_g))
               s_j <= 1
               lo_g <= sat_g - k_g x_g <= hi_g
               sum_{g under d} (sat_g - k_g x_g) <= B_d - idle load under d        for every domain d
               s_lo_j <= s_j <= s_max_j          (implied; stated to help the interior-point method)

plus a least-power tie-break ``TIE_BREAK * sum(w) * (sum_g k_g x_g) / (sum of upper caps)`` (P in kW;
changes the objective by < 1e-7 relative) that makes the caps of GPUs faster than their job unique.

The caps reported are the minimal caps for the optimal rates (same post-processing as the fast
path: ``max(lo, phi_g(s_j))`` and exact milliwatt rounding), and the domain prices are the duals.
Raises ReferenceSolveError when Clarabel does not report an optimal solution; ValueError when
the problem's structure differs from the one the solver was built for.
"""

from __future__ import annotations

import time

import cvxpy as cp
import numpy as np
import scipy.sparse as sp

from ._core import LIMIT_MARGIN_W, finalize, prepare
from .problem import AllocationProblem, AllocationResult

__all__ = ["ReferenceSolver", "solve_reference", "ReferenceSolveError"]

#: weight of the least-power tie-break relative to the sum of job weights
TIE_BREAK = 1e-7


class ReferenceSolveError(RuntimeError):
    """Clarabel returned a status other than optimal / optimal_inaccurate."""


class ReferenceSolver:
    """cvxpy/Clarabel model built once per problem structure (see module docstring)."""

    def __init__(self, problem: AllocationProblem):
        pb = problem
        self._key = self._structure(pb)
        self.jg = np.nonzero(pb.job_of_gpu >= 0)[0]
        Ga = self.jg.size
        self.jobs_with_gpu = np.unique(pb.job_of_gpu[self.jg])
        Jh = self.jobs_with_gpu.size
        D = pb.n_domains
        A, S = _incidence(pb, self.jg, self.jobs_with_gpu)
        self._A = A
        self.p_sat = cp.Parameter(Ga)
        self.p_k = cp.Parameter(Ga, nonneg=True)
        self.p_c1 = cp.Parameter(Ga)
        self.p_ca = cp.Parameter(Ga, nonneg=True)
        self.p_lo = cp.Parameter(Ga)
        self.p_hi = cp.Parameter(Ga)
        self.p_B = cp.Parameter(D)
        self.p_w = cp.Parameter(Jh, nonneg=True)
        self.x = cp.Variable(Ga)
        self.s = cp.Variable(Jh)
        if Ga == 0:
            self.prob = None
            return
        P = self.p_sat - cp.multiply(self.p_k, self.x)
        # s_lo <= s <= s_max are implied (rates at all-minimum / all-maximum caps); stating them
        # keeps the log barrier away from 0 and helps Clarabel on large jobs
        self.p_slo = cp.Parameter(Jh)
        self.p_smax = cp.Parameter(Jh, nonneg=True)
        cons = [S @ self.s <= self.p_c1 - cp.multiply(self.p_ca, cp.exp(self.x)),
                self.s <= self.p_smax, self.s >= self.p_slo, P >= self.p_lo, P <= self.p_hi]
        self._dom_con = A @ P <= self.p_B
        cons.append(self._dom_con)
        # tie-break: a GPU faster than its job's pace has a whole interval of optimal caps, which
        # stalls the interior-point method; a tiny price on power (total <= TIE_BREAK * sum w,
        # with P in kW) picks the least-power one, as the fast path does
        self.p_tie = cp.Parameter(Ga, nonneg=True)
        tie = self.p_tie @ self.x  # p_tie = coefficient * k_g: sum of k_g x_g = const - total power
        if pb.objective == "proportional":
            obj = cp.Maximize(self.p_w @ cp.log(self.s) + tie)
        else:
            obj = cp.Maximize(self.p_w @ self.s + tie)
        self.prob = cp.Problem(obj, cons)
        assert self.prob.is_dcp(dpp=True), "reference formulation must be DPP"

    @staticmethod
    def _structure(pb):
        return (pb.n_jobs, pb.objective, pb.job_of_gpu.tobytes(), pb.domain_of_gpu.tobytes(),
                pb.domain_parent.tobytes())

    def solve(self, problem: AllocationProblem, **solver_opts) -> AllocationResult:
        """Solve ``problem`` (same structure as at construction). See module docstring."""
        t0 = time.perf_counter()
        pb = problem
        if self._structure(pb) != self._key:
            raise ValueError("problem structure (jobs, GPU placement, domain tree or objective) differs "
                             "from the one this ReferenceSolver was built for")
        prep = prepare(pb)
        s_full = np.ones(pb.n_jobs)
        price = np.zeros(pb.n_domains)
        if self.prob is not None:
            slo, smax = self._set_parameters(pb, prep)
            opts = {"solver": cp.CLARABEL}
            opts.update(solver_opts)
            self._solve_with_fallbacks(slo, smax, opts)
            s = np.clip(self.s.value, prep.s_lo[self.jobs_with_gpu], prep.s_max[self.jobs_with_gpu])
            s_full[self.jobs_with_gpu] = s
            dual = self._dom_con.dual_value
            if dual is not None:
                price = np.where(prep.in_deficit | prep.pinned | ~np.isfinite(prep.limit), 0.0, np.maximum(np.asarray(dual), 0.0) / 1e3)
        return finalize(pb, prep, s_full, price, solver="reference", t0=t0)

    def _set_parameters(self, pb: AllocationProblem, prep) -> tuple[np.ndarray, np.ndarray]:
        """Load ``pb``'s values (powers in kW) into the cp.Parameters, except the rate bounds.

        Returns (s_lo, s_max) [jobs with a GPU]: the implied rate bounds for
        :meth:`_solve_with_fallbacks` (s_lo widened by 1e-9 relative, both clipped to [0, 1])."""
        jg = self.jg
        # powers enter the model in kW (keeps Clarabel's equilibration happy at cluster sums)
        self.p_sat.value = pb.curve_sat_w[jg] / 1e3
        self.p_k.value = pb.curve_k_w[jg] / 1e3
        sig = prep.sigma[jg]
        self.p_c1.value = sig * (1 + pb.curve_a[jg])
        self.p_ca.value = sig * pb.curve_a[jg]
        self.p_lo.value = prep.lo[jg] / 1e3
        # a box of zero width (ceiling at the minimum, held GPUs) leaves no strict interior for
        # the interior-point method: widen it by 1 mW; caps are clipped back to [lo, hi] after
        self.p_hi.value = np.maximum(prep.hi[jg], prep.lo[jg] + 1e-3) / 1e3
        B = prep.limit - prep.fixed_load - LIMIT_MARGIN_W
        slack = self._A @ prep.hi[jg] + 1.0  # a bound that never binds, well scaled
        # (deficit and pinned domains: their GPUs are held at their minimums already, lo = hi)
        B = np.where(np.isfinite(B) & ~prep.in_deficit & ~prep.pinned, np.minimum(B, slack), slack)
        self.p_B.value = B / 1e3
        self.p_w.value = pb.job_weight[self.jobs_with_gpu]
        self.p_tie.value = (TIE_BREAK * float(pb.job_weight.sum()) / max(1.0, float(np.sum(prep.hi[jg])) / 1e3)
                            * pb.curve_k_w[jg] / 1e3)
        smax = np.minimum(prep.s_max[self.jobs_with_gpu], 1.0)
        slo = np.clip(prep.s_lo[self.jobs_with_gpu] * (1 - 1e-9), 0.0, smax)
        return slo, smax

    def _solve_with_fallbacks(self, slo: np.ndarray, smax: np.ndarray, opts: dict) -> None:
        """Run Clarabel with the rate bounds (slo, smax), then looser ones if it fails.

        Clarabel occasionally stalls (InsufficientProgress) on large jobs with a speed spread;
        the same program with / without the implied rate bounds usually goes through. Raises
        ReferenceSolveError with the last failure when no attempt reports an optimal solution."""
        last = None
        for lo_b, hi_b in ((slo, smax), (-np.ones_like(slo), np.ones_like(smax)),
                           (np.zeros_like(slo), np.ones_like(smax)), (slo, np.ones_like(smax))):
            self.p_slo.value, self.p_smax.value = lo_b, hi_b
            try:
                self.prob.solve(**opts)
            except cp.error.SolverError as exc:
                last = str(exc)
                continue
            if self.prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
                last = None
                break
            last = f"Clarabel status {self.prob.status}"
        if last is not None:
            raise ReferenceSolveError(last)


def _incidence(pb: AllocationProblem, jg: np.ndarray, jobs_with_gpu: np.ndarray):
    """Sparse 0/1 incidence matrices over the job GPUs ``jg`` [Ga]: A [D, Ga] (domain at or above
    the GPU) and S [Ga, Jh] (the GPU's job among ``jobs_with_gpu`` [Jh])."""
    from ._core import ancestors
    Ga = jg.size
    remap = np.full(pb.n_jobs, -1, np.int64)
    remap[jobs_with_gpu] = np.arange(jobs_with_gpu.size)
    pdom, pgpu = ancestors(pb)
    gpos = np.full(pb.n_gpus, -1, np.int64)
    gpos[jg] = np.arange(Ga)
    sel = gpos[pgpu] >= 0
    A = sp.csr_matrix((np.ones(int(sel.sum())), (pdom[sel], gpos[pgpu[sel]])), shape=(pb.n_domains, Ga))
    S = sp.csr_matrix((np.ones(Ga), (np.arange(Ga), remap[pb.job_of_gpu[jg]])), shape=(Ga, jobs_with_gpu.size))
    return A, S


def solve_reference(problem: AllocationProblem, **solver_opts) -> AllocationResult:
    """One-shot reference solve (builds a ReferenceSolver and solves once)."""
    return ReferenceSolver(problem).solve(problem, **solver_opts)
