"""Starting prices for the fast allocator: a primal-dual interior-point method (internal).

The exact dual method of :mod:`capctl.allocator.fast` converges only linearly when many jobs sit
on a kink (a rate where one of their GPUs leaves its minimum cap): the dual is then piecewise
smooth with many pieces and each Newton step crosses few of them. The interior-point method does
not see kinks — a kink is the point where two smooth inequalities of the same GPU are both active
— and converges in a number of iterations nearly independent of their count. Its prices start
the exact method, which then certifies optimality (KKT on the exact problem) in a step or two.

Program (powers in kW inside, for scaling), over the movable jobs' rates s_j and the caps P_g of
their GPUs that sit under a candidate domain and whose cap box is not a point::

    minimize    -sum_j w_j U(s_j)                    U = log ("proportional") or identity
    subject to  phi_g(s_j) - P_g + y1_g = 0,  y1 >= 0    GPU g keeps the pace of its job j
                P_g >= lo_g                             (P_g <= hi_g is implied: s_j <= s_max_j)
                (A P)_d - b_d + y4_d = 0,  y4 >= 0     candidate domain d (A: 0/1 incidence)
                s_lo_j <= s_j <= s_max_j

with ``phi_g(s) = sat_g - k_g log((c_g - s) / (sigma_g a_g))``, ``c_g = sigma_g (1 + a_g)``
(the inverse rate curve, :mod:`capctl.allocator.curves`). Mehrotra's predictor-corrector
(Mehrotra 1992, "On the implementation of a primal-dual interior point method"; Nocedal & Wright,
"Numerical Optimization", 2nd ed., §14.2 and §19.3) on the perturbed KKT conditions. Every
per-GPU unknown is eliminated in closed form, leaving one symmetric positive definite system
over the m candidate prices per iteration, factored once (sparse LU, deepest domains first).

The domains form a tree, so the candidate ancestors of a GPU are the candidate chain of its
deepest candidate domain (its *class*): ``A = C E`` with C [m, m] the chain incidence (domain d
is in the chain of class e) and E [m, n] the GPU's class. With the GPUs sorted by (job, class),
every product with A is one contiguous reduction over the GPUs (``np.add.reduceat``) and a small
product with C. Returns None (the caller starts without) where there is no interior point.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla

__all__ = ["interior_prices"]

KW = 1e3             # watts per kW: the program works in kW
TO_BOUNDARY = 0.995  # fraction of the step to the boundary of the positive orthant (Nocedal & Wright §14.2)
START_RATE = 0.5     # starting rates: this far from s_lo to s_max
START_HEADROOM = 0.2  # starting caps: this far from what keeps pace up to hi
SIGMA_MIN = 0.1      # least centering (Mehrotra's sigma): without it, 100k single-GPU jobs stall


def _dot(x, y, out=None) -> float:
    """x . y without BLAS (a multithreaded BLAS on a loaded machine is slower than numpy);
    ``out``: a buffer of x's shape for the products, or None."""
    return float(np.multiply(x, y, out=out).sum())


def _classes(pc, pg, depth_c, parent_c, m, ngv):
    """(deep [ngv] deepest candidate above each var GPU (-1 none), C [m, m] chain incidence).

    ``pc``/``pg`` [P']: (candidate, var-GPU) pairs; ``depth_c`` [m]: domain depth;
    ``parent_c`` [m]: nearest candidate ancestor of each candidate (-1 none)."""
    best = np.full(ngv, -1, np.int64)
    if pc.size == 0:
        return best, sp.csr_matrix((m, m))
    np.maximum.at(best, pg, depth_c[pc])
    top = depth_c[pc] == best[pg]
    deep = np.full(ngv, -1, np.int64)
    deep[pg[top]] = pc[top]
    rows, cols = [np.arange(m)], [np.arange(m)]
    cur = parent_c.copy()
    e = np.arange(m)
    while cur.size:
        live = cur >= 0
        cur, e = cur[live], e[live]
        rows.append(cur)
        cols.append(e)
        cur = parent_c[cur]
    r, c = np.concatenate(rows), np.concatenate(cols)
    return deep, sp.csr_matrix((np.ones(r.size), (r, c)), shape=(m, m))


class _Program:
    """The reduced program's data (see module docstring), built from the fast path's job data.

    ``jobs``: :class:`capctl.allocator.fast._Jobs`; ``pc``/``pg`` [P']: (candidate, var-GPU)
    pairs; ``budget`` [m] in W; ``depth_c``, ``parent_c`` [m]: see :func:`_classes`. Attribute
    ``ok`` is False when some candidate domain has no strict interior (its GPUs' minimums already
    fill its budget) or no GPU can move: the caller then starts without these prices."""

    def __init__(self, jobs, pc, pg, budget, depth_c, parent_c):
        m, ngv = budget.size, jobs.gpus.size
        deep, self.C = _classes(pc, pg, depth_c, parent_c, m, ngv)
        self.Ct = self.C.T.tocsr()
        movable = jobs.hi > jobs.lo
        sel = (deep >= 0) & movable
        fixed = (deep >= 0) & ~movable
        g = np.nonzero(sel)[0]
        # GPUs sorted by (job, class): every per-job and per-class sum is then a contiguous
        # reduction (np.add.reduceat), much cheaper than a weighted bincount over the GPUs
        key = jobs.job[g] * m + deep[g]
        perm = np.argsort(key, kind="stable")
        g, key = g[perm], key[perm]
        self.n, self.m, self.J = g.size, m, jobs.nv
        self.deep, self.job = deep[g], jobs.job[g]
        # (job, class) groups: V [m, J] holds the per-group sums of alpha (B_alpha = C V)
        self.cj_start = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]])) if g.size else np.zeros(0, np.int64)
        self.cj_job, self.cj_class = self.job[self.cj_start], self.deep[self.cj_start]
        self.cj_size = np.diff(np.append(self.cj_start, g.size))
        # job groups (contiguous too): first GPU of each job that has GPUs here
        first = np.concatenate([[True], self.job[1:] != self.job[:-1]]) if g.size else np.zeros(0, bool)
        self.job_start = np.flatnonzero(first)
        self.job_present = self.job[self.job_start]
        self.all_jobs = self.job_present.size == jobs.nv
        rowmajor = np.lexsort((self.cj_job, self.cj_class))  # CSR order of V's entries
        self.cj_csr = rowmajor
        self.cj_csr_job = self.cj_job[rowmajor]
        self.cj_indptr = np.concatenate([[0], np.cumsum(np.bincount(self.cj_class, minlength=m))])
        self.b = budget / KW - self.C @ np.bincount(deep[fixed], jobs.lo[fixed] / KW, minlength=m)
        self.k = jobs.k[g] / KW
        self.c = jobs.c[g]
        self.base = jobs.sat[g] / KW + self.k * np.log(jobs.sig_a[g])   # phi = base - k log(c - s)
        self.lo, self.hi = jobs.lo[g] / KW, jobs.hi[g] / KW
        self.s_lo, self.s_max = jobs.s_lo, jobs.s_max
        self.w, self.prop = jobs.w, jobs.prop
        self.ok = self.n > 0
        if not self.ok:
            return
        # a row without movable GPUs cannot move; one without room has no interior point
        self.row = (self.C @ np.bincount(self.deep, minlength=m)) > 0
        room = self.b - self.A_dot(self.lo)
        self.ok = bool(np.all(room[self.row] > 1e-9 * np.maximum(1.0, np.abs(self.b[self.row]))))
        self.npairs = 2 * self.n + int(self.row.sum()) + 2 * self.J
        # eliminate deep domains first: the tree part then fills nothing; C_o = C with its rows
        # in that order, so that the Schur complement C_o X C_o^T comes out permuted
        self.order = np.argsort(-depth_c, kind="stable")
        self.C_o = self.C[self.order].tocsr()
        self.C_oT = self.C_o.T.tocsr()
        self.work = _Work(self.n)

    def by_group(self, x):
        """Sum of x [n] over each (job, class) group: [groups]."""
        return np.add.reduceat(x, self.cj_start)

    def A_dot(self, x):
        """(A x) [m] for x [n]."""
        return self.C @ np.bincount(self.cj_class, self.by_group(x), minlength=self.m)

    def At_dot(self, y):
        """(A^T y) [n] for y [m]."""
        return self.per_class(self.Ct @ y)

    def per_class(self, x):
        """x [m] (per class) repeated over each GPU of the class: [n]."""
        return np.repeat(x[self.cj_class], self.cj_size)

    def per_job(self, x):
        """x [J] (per job) repeated over each GPU of the job: [n]."""
        return np.repeat(x[self.cj_job], self.cj_size)

    def by_job(self, x):
        """Sum of x [n] over each job's GPUs: [J]."""
        sums = np.add.reduceat(x, self.job_start)
        if self.all_jobs:
            return sums
        out = np.zeros(self.J)
        out[self.job_present] = sums
        return out

    def by_class(self, x):
        """Sum of x [n] over each class's GPUs: [m]."""
        return np.bincount(self.cj_class, self.by_group(x), minlength=self.m)


class _State:
    """Iterate: rates s [J], caps P [n] kW, slacks y1 [n], y4 [m], multipliers z1, z2 (P >= lo)
    [n], lam [m] (per kW), zl, zu [J] (rate bounds).

    Start (an infeasible start is fine for the method): rates at START_RATE of their range, caps
    START_HEADROOM of the way above what keeps pace, slacks at least a fraction of their range,
    every multiplier at mu0 / its slack (on the central path's complementarity)."""

    def __init__(self, pr: _Program):
        s = pr.s_lo + START_RATE * (pr.s_max - pr.s_lo)
        phi = pr.base - pr.k * np.log(pr.c - s[pr.job])
        m_g = np.maximum(phi, pr.lo)
        width = pr.hi - pr.lo
        P = np.clip(m_g + START_HEADROOM * (pr.hi - m_g), pr.lo + 1e-3 * width, pr.hi - 1e-3 * width)
        self.s, self.P = s, P
        self.y1 = np.maximum(P - phi, 1e-2 * width)
        self.y4 = np.where(pr.row, np.maximum(pr.b - pr.A_dot(P), 0.1 * pr.A_dot(width)), 1.0)
        mu0 = max(float(pr.w.sum()), 1.0) / pr.npairs  # duality gap ~ the objective's scale
        self.z1 = mu0 / self.y1
        self.z2 = mu0 / (P - pr.lo)
        self.lam = np.where(pr.row, mu0 / self.y4, 0.0)
        self.zl = mu0 / (s - pr.s_lo)
        self.zu = mu0 / (pr.s_max - s)


def _objective_derivatives(pr, s):
    """(f', f'') [J] of f(s) = -sum w U(s)."""
    if pr.prop:
        return -pr.w / s, pr.w / (s * s)
    return -pr.w, np.zeros_like(s)


class _Work:
    """Preallocated [n] buffers, reused every iteration: at 100k GPUs a fresh temporary per
    operation costs more than the arithmetic (page faults of memory the allocator returned)."""

    NAMES = ("u", "phi", "dphi", "d2", "z1dphi", "r1", "inv_y1", "D1", "y1z1", "inv_d2", "zd2",
             "invQ", "alpha", "z1phiP", "e0", "tmp", "tmp2")

    def __init__(self, n):
        for name in self.NAMES:
            setattr(self, name, np.empty(n))
        # two direction sets (predictor and corrector are alive together) and the targets
        self.dirs = [{k: np.empty(n) for k in ("c1", "e", "dP", "dz1", "dz2", "dy1")} for _ in range(2)]
        self.t1, self.t2 = np.empty(n), np.empty(n)


class _Newton:
    """One linearization of the perturbed KKT system at a state: residuals, the eliminated
    per-GPU blocks and the factored [m, m] Schur complement over the prices. Its [n] arrays
    live in the program's :class:`_Work` buffers (valid until the next linearization)."""

    def __init__(self, pr: _Program, st: _State):
        self.pr, self.st = pr, st
        w = pr.work
        u = np.subtract(pr.c, pr.per_job(st.s), out=w.u)
        self.phi = np.log(u, out=w.phi)
        self.phi *= pr.k
        np.subtract(pr.base, self.phi, out=self.phi)
        self.dphi = np.divide(pr.k, u, out=w.dphi)
        self.d2 = np.subtract(st.P, pr.lo, out=w.d2)
        self.dl, self.du = st.s - pr.s_lo, pr.s_max - st.s
        fp, fpp = _objective_derivatives(pr, st.s)
        self.rP = pr.At_dot(st.lam)
        self.rP -= st.z1
        self.rP -= st.z2
        z1dphi = np.multiply(st.z1, self.dphi, out=w.z1dphi)
        self.rs = fp + pr.by_job(z1dphi) - st.zl + st.zu
        self.r1 = np.subtract(self.phi, st.P, out=w.r1)
        self.r1 += st.y1
        self.r4 = np.where(pr.row, pr.A_dot(st.P) - pr.b + st.y4, 0.0)
        self.inv_y1 = np.divide(1.0, st.y1, out=w.inv_y1)
        self.D1 = np.multiply(st.z1, self.inv_y1, out=w.D1)
        self.y1z1 = np.divide(st.y1, st.z1, out=w.y1z1)
        self.inv_d2 = np.divide(1.0, self.d2, out=w.inv_d2)
        self.zd2 = np.multiply(st.z2, self.inv_d2, out=w.zd2)
        self.invQ = np.add(self.D1, self.zd2, out=w.invQ)
        np.divide(1.0, self.invQ, out=self.invQ)
        self.alpha = np.multiply(self.D1, self.dphi, out=w.alpha)
        self.alpha *= self.invQ
        self.zdl, self.zdu = st.zl / self.dl, st.zu / self.du
        # curvature: f'' + sum z1 phi'' + sum alpha phi' zd2 (phi'' = phi' / u)
        h = np.divide(z1dphi, u, out=w.tmp)
        h2 = np.multiply(self.alpha, self.dphi, out=w.tmp2)
        h2 *= self.zd2
        h += h2
        self.Ht = fpp + pr.by_job(h) + self.zdl + self.zdu
        self.z1phiP = np.subtract(self.phi, st.P, out=w.z1phiP)
        self.z1phiP *= st.z1
        self.e0 = np.add(self.rP, st.z2, out=w.e0)   # -(e without the targets' terms)
        np.negative(self.e0, out=self.e0)
        self.lam1 = np.where(pr.row, st.lam, 1.0)
        self._factor()

    def _factor(self):
        pr, st = self.pr, self.st
        v_vals = pr.by_group(self.alpha)[pr.cj_csr]
        self.V = sp.csr_matrix((v_vals, pr.cj_csr_job, pr.cj_indptr), shape=(pr.m, pr.J))
        W = sp.csr_matrix((v_vals / self.Ht[pr.cj_csr_job], pr.cj_csr_job, pr.cj_indptr), shape=(pr.m, pr.J))
        q = pr.by_class(self.invQ)
        inner = sp.diags(q) + W @ self.V.T
        ydiag = np.where(pr.row, st.y4 / self.lam1, 1.0)
        S = pr.C_o @ inner @ pr.C_oT + sp.diags(ydiag[pr.order])
        lu = spla.splu(S.tocsc(), permc_spec="NATURAL", diag_pivot_thresh=0.0,
                       options={"SymmetricMode": True})
        o = pr.order
        out = np.empty(pr.m)

        def solve_s(r):
            out[o] = lu.solve(r[o])
            return out.copy()
        self.solve_s = solve_s

    def mu(self):
        st, row, tmp = self.st, self.pr.row, self.pr.work.tmp
        tot = (_dot(st.z1, st.y1, tmp) + _dot(st.z2, self.d2, tmp) + _dot(st.lam[row], st.y4[row])
               + _dot(st.zl, self.dl) + _dot(st.zu, self.du))
        return tot / self.pr.npairs

    def direction(self, tau=None, slot=0):
        """Newton direction for complementarity targets ``tau`` = (t1, t2, t4, tl, tu) (arrays
        or scalars), or for zero targets (the affine-scaling predictor) when None. Its [n]
        parts live in direction buffer ``slot`` (0 or 1)."""
        pr, st, w = self.pr, self.st, self.pr.work
        b = w.dirs[slot]
        tmp = w.tmp
        c1 = b["c1"]
        if tau is None:
            np.multiply(self.z1phiP, self.inv_y1, out=c1)
            e = np.add(c1, self.e0, out=b["e"])
        else:
            t1, t2, t4, tl, tu = tau
            np.add(t1, self.z1phiP, out=c1)
            c1 *= self.inv_y1
            e = np.add(c1, self.e0, out=b["e"])
            e += np.multiply(t2, self.inv_d2, out=tmp)
        g = np.multiply(self.alpha, e, out=tmp)
        g -= np.multiply(self.dphi, c1, out=w.tmp2)
        if tau is None:
            gt = pr.by_job(g) - self.rs - st.zl + st.zu
            ht = np.where(pr.row, st.y4 - self.r4, 0.0)
        else:
            gt = pr.by_job(g) - self.rs + (tl / self.dl - st.zl) - (tu / self.du - st.zu)
            ht = np.where(pr.row, st.y4 - self.r4 - t4 / self.lam1, 0.0)
        rhs = pr.C @ (self.V @ (gt / self.Ht) + pr.by_class(np.multiply(e, self.invQ, out=tmp))) - ht
        dlam = np.where(pr.row, self.solve_s(rhs), 0.0)
        ctl = pr.Ct @ dlam
        ds = (gt - self.V.T @ ctl) / self.Ht
        dsg = pr.per_job(ds)
        dP = np.subtract(e, pr.per_class(ctl), out=b["dP"])
        dP *= self.invQ
        dP += np.multiply(self.alpha, dsg, out=tmp)
        dz1 = np.multiply(self.dphi, dsg, out=b["dz1"])
        dz1 -= dP
        dz1 *= self.D1
        dz1 += c1
        dz2 = np.multiply(self.zd2, dP, out=b["dz2"])
        dy1 = np.multiply(self.y1z1, dz1, out=b["dy1"])
        if tau is None:
            dz2 += st.z2
            np.negative(dz2, out=dz2)
            dy1 += st.y1
            np.negative(dy1, out=dy1)
            dy4 = np.where(pr.row, -st.y4 - (st.y4 / self.lam1) * dlam, 0.0)
            dzl = -st.zl - self.zdl * ds
            dzu = self.zdu * ds - st.zu
        else:
            np.subtract(np.multiply(t2, self.inv_d2, out=tmp), dz2, out=dz2)
            dz2 -= st.z2
            np.subtract(np.divide(t1, st.z1, out=tmp), dy1, out=dy1)
            dy1 -= st.y1
            dy4 = np.where(pr.row, t4 / self.lam1 - st.y4 - (st.y4 / self.lam1) * dlam, 0.0)
            dzl = tl / self.dl - st.zl - self.zdl * ds
            dzu = tu / self.du - st.zu + self.zdu * ds
        return ds, dP, dy1, dy4, dz1, dz2, dlam, dzl, dzu

    def max_step(self, d):
        """Largest primal and dual steps in (0, 1] keeping every slack and multiplier positive."""
        ds, dP, dy1, dy4, dz1, dz2, dlam, dzl, dzu = d
        st, tmp = self.st, self.pr.work.tmp
        primal = ((self.dl, ds, 1.0), (self.du, ds, -1.0), (self.d2, dP, 1.0), (st.y1, dy1, 1.0), (st.y4, dy4, 1.0))
        dual = ((st.z1, dz1, 1.0), (st.z2, dz2, 1.0), (st.lam, dlam, 1.0), (st.zl, dzl, 1.0), (st.zu, dzu, 1.0))
        return _ratio(primal, tmp), _ratio(dual, tmp)

    def mu_after(self, d, steps):
        """Average complementarity after primal and dual steps ``steps`` along ``d``."""
        ds, dP, dy1, dy4, dz1, dz2, dlam, dzl, dzu = d
        st, row, w = self.st, self.pr.row, self.pr.work
        a, b = steps
        tot = (_dot_after(st.z1, dz1, b, st.y1, dy1, a, w) + _dot_after(st.z2, dz2, b, self.d2, dP, a, w)
               + _dot((st.lam + b * dlam)[row], (st.y4 + a * dy4)[row])
               + _dot(st.zl + b * dzl, self.dl + a * ds) + _dot(st.zu + b * dzu, self.du - a * ds))
        return tot / self.pr.npairs

    def converged(self, mu, tol):
        """Central enough and feasible: mu and the residuals within ``tol`` of their scales."""
        pr, st = self.pr, self.st
        price = max(float(np.max(st.lam, initial=0.0)), 1e-12)
        bmax = max(1.0, float(np.max(np.abs(pr.b[pr.row]), initial=1.0)))
        return (mu * pr.npairs <= tol * max(float(pr.w.sum()), 1.0)
                and float(np.max(np.abs(self.r1), initial=0.0)) <= 1e-9
                and float(np.max(np.abs(self.r4), initial=0.0)) <= 1e-9 * bmax
                and float(np.max(np.abs(self.rP), initial=0.0)) <= 1e-7 * price)


def _ratio(pairs, tmp):
    """Largest step in (0, 1] keeping x + step * sign * dx > 0 for every (x, dx, sign) in
    ``pairs`` (x > 0); ``tmp`` an [n] buffer for the [n] pairs."""
    worst = 1.0
    for x, dx, sign in pairs:
        r = np.divide(dx, x, out=tmp) if dx.shape == tmp.shape else dx / x
        worst = max(worst, float(-sign * (r.min(initial=0.0) if sign > 0 else r.max(initial=0.0))))
    return 1.0 / worst


def _dot_after(z, dz, b, y, dy, a, w) -> float:
    """(z + b dz) . (y + a dy) for [n] arrays, in the work buffers."""
    zz = np.multiply(dz, b, out=w.tmp)
    zz += z
    yy = np.multiply(dy, a, out=w.tmp2)
    yy += y
    return _dot(zz, yy, zz)


def _update(st, d, steps, tmp):
    """Primal step ``steps[0]`` and dual step ``steps[1]`` along ``d`` (in place)."""
    ds, dP, dy1, dy4, dz1, dz2, dlam, dzl, dzu = d
    a, b = steps
    st.s = st.s + a * ds
    st.y4 = st.y4 + a * dy4
    st.lam = st.lam + b * dlam
    st.zl = st.zl + b * dzl
    st.zu = st.zu + b * dzu
    for x, dx, step in ((st.P, dP, a), (st.y1, dy1, a), (st.z1, dz1, b), (st.z2, dz2, b)):
        x += np.multiply(dx, step, out=tmp)


def _corrector_targets(aff, target, work):
    """Mehrotra's corrector targets: the centering target minus the affine step's second-order
    terms (the [n] ones in ``work``'s target buffers)."""
    ds, dP, dy1, dy4, dz1, dz2, dlam, dzl, dzu = aff
    t1 = np.multiply(dy1, dz1, out=work.t1)
    np.subtract(target, t1, out=t1)
    t2 = np.multiply(dP, dz2, out=work.t2)
    np.subtract(target, t2, out=t2)
    return (t1, t2, target - dy4 * dlam, target - ds * dzl, target + ds * dzu)


def interior_prices(jobs, pc, pg, budget, depth_c, parent_c, *, max_iter=60, tol=1e-7, trace=None):
    """Near-optimal domain prices for the fast path's dual (see module docstring).

    ``jobs``: the fast path's job data (:class:`capctl.allocator.fast._Jobs`); ``pc``/``pg``
    [P']: (candidate index, var-GPU index) pairs; ``budget`` [m] W; ``depth_c`` [m] depth of each
    candidate domain, ``parent_c`` [m] its nearest candidate ancestor (-1 none).
    Returns (lam [m] per W, s [nv] rates, iterations) or None when the program has no interior
    or the method breaks down (a singular system, a non-finite iterate): the caller then starts
    from its own initial prices. ``trace``: a list collecting (iteration, mu, step) or None."""
    pr = _Program(jobs, pc, pg, budget, depth_c, parent_c)
    if not pr.ok:
        return None
    st = _State(pr)
    it = 0
    try:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for it in range(1, max_iter + 1):
                nt = _Newton(pr, st)
                mu = nt.mu()
                if nt.converged(mu, tol):
                    break
                aff = nt.direction()
                sigma = max(SIGMA_MIN, (nt.mu_after(aff, nt.max_step(aff)) / mu) ** 3)
                tau = _corrector_targets(aff, sigma * mu, pr.work)
                d = nt.direction(tau, slot=1)
                steps = tuple(min(1.0, TO_BOUNDARY * a) for a in nt.max_step(d))
                if trace is not None:
                    trace.append((it, mu, steps))
                if not all(a > 0 and np.isfinite(a) for a in steps):
                    return None
                _update(st, d, steps, pr.work.tmp)
    except (np.linalg.LinAlgError, RuntimeError, ValueError):  # SuperLU: singular factor
        return None
    if not (np.all(np.isfinite(st.lam)) and np.all(np.isfinite(st.s))):
        return None
    # a domain with slack keeps a positive multiplier ~ mu / slack inside: report it as 0 (the
    # exact method counts every positive price as binding)
    binding = pr.row & (st.y4 < st.lam)
    return np.where(binding, st.lam, 0.0) / KW, st.s, it
