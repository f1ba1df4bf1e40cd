"""The allocation problem and its result (plain numpy containers; no I/O).

Shapes: G GPUs, J jobs, D power domains. All powers in watts, temperatures are already folded
into ``thermal_ceiling_w`` (see :mod:`capctl.allocator.thermal`).

Per GPU g (arrays of shape [G]):
  min_cap_w, max_cap_w     device limit constraints [W] (NVML nvmlDeviceGetPowerManagementLimitConstraints)
  thermal_ceiling_w        largest cap the thermal model allows this interval [W]; +inf if none
  curve_a, curve_k_w, curve_sat_w, curve_min_w
                           rate curve rho_g(P) (see :mod:`capctl.allocator.curves`); curve_min_w
                           is where the concave model starts to hold — the allocator does not go
                           below it unless the thermal ceiling forces it (never below min_cap_w)
  speed                    relative speed of the GPU (1 = nominal; Sinha et al. SC'22: ~8 % spread)
  job_of_gpu               int job index, -1 = idle
  prev_cap_w               cap in force now [W] (NaN = unknown), used by the slew limit
  idle_cap_w               cap for an idle GPU [W] (clipped to [min_cap_w, ceiling])
  domain_of_gpu            leaf domain index (ancestors implied by domain_parent)
Per job j ([J]): job_weight (> 0).
Per domain d ([D]): domain_parent (-1 = root; parents may appear in any order, no cycles),
  domain_limit_w [W], domain_names, domain_kinds (free text: "cluster", "row", "rack", "pdu", "node").
Scalars: objective ("proportional": max sum_j w_j log s_j; "throughput": max sum_j w_j s_j),
  slew_w (None = no slew limit; else |P_g - prev_cap_w_g| <= slew_w where prev is known, except
  that the thermal ceiling always wins: lowering is never blocked).

Job rate s_j is relative to the job's uncapped rate: GPU g in job j sustains
``sigma_g * rho_g(P_g)`` with ``sigma_g = speed_g / min(speed over j) >= 1``; the job runs at the
minimum over its GPUs (synchronous step), so faster GPUs need less power to keep pace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .curves import DEFAULT_CURVES, CurveParams

__all__ = ["AllocationProblem", "AllocationResult", "OBJECTIVES"]

OBJECTIVES = ("proportional", "throughput")


@dataclass(frozen=True, eq=False)
class AllocationProblem:
    """One interval's allocation problem (see module docstring for every field's shape and unit).

    Construct with :meth:`build` from plain Python data, or directly from arrays (then call
    :meth:`validate`). Raises ValueError (naming field, index and value) on bad input.
    """

    min_cap_w: np.ndarray
    max_cap_w: np.ndarray
    thermal_ceiling_w: np.ndarray
    curve_a: np.ndarray
    curve_k_w: np.ndarray
    curve_sat_w: np.ndarray
    curve_min_w: np.ndarray
    speed: np.ndarray
    job_of_gpu: np.ndarray
    prev_cap_w: np.ndarray
    idle_cap_w: np.ndarray
    domain_of_gpu: np.ndarray
    job_weight: np.ndarray
    domain_parent: np.ndarray
    domain_limit_w: np.ndarray
    objective: str = "proportional"
    slew_w: float | None = None
    gpu_names: tuple = ()
    job_names: tuple = ()
    domain_names: tuple = ()
    domain_kinds: tuple = ()

    @property
    def n_gpus(self) -> int:
        return int(self.min_cap_w.shape[0])

    @property
    def n_jobs(self) -> int:
        return int(self.job_weight.shape[0])

    @property
    def n_domains(self) -> int:
        return int(self.domain_limit_w.shape[0])

    def domain_name(self, d: int) -> str:
        return self.domain_names[d] if d < len(self.domain_names) else f"#{d}"

    def validate(self) -> "AllocationProblem":
        """Check shapes, ranges and the tree; returns self. Raises ValueError."""
        G, J, D = self.n_gpus, self.n_jobs, self.n_domains
        for name in ("max_cap_w", "thermal_ceiling_w", "curve_a", "curve_k_w", "curve_sat_w",
                     "curve_min_w", "speed", "job_of_gpu", "prev_cap_w", "idle_cap_w", "domain_of_gpu"):
            if getattr(self, name).shape != (G,):
                raise ValueError(f"{name}: shape {getattr(self, name).shape}, expected ({G},)")
        for name in ("domain_parent",):
            if getattr(self, name).shape != (D,):
                raise ValueError(f"{name}: shape {getattr(self, name).shape}, expected ({D},)")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: {self.objective!r}, allowed {OBJECTIVES}")
        if self.slew_w is not None and not (self.slew_w > 0):
            raise ValueError(f"slew_w: {self.slew_w!r}, must be > 0 or None")

        def bad(name, mask, what):
            i = int(np.nonzero(mask)[0][0])
            label = self.gpu_names[i] if name in _GPU_FIELDS and i < len(self.gpu_names) else i
            raise ValueError(f"{name}[{label}] = {getattr(self, name)[i]!r}: {what}")

        for name in ("min_cap_w", "max_cap_w", "curve_k_w", "curve_a", "speed"):
            m = ~(np.isfinite(getattr(self, name)) & (getattr(self, name) > 0))
            if m.any():
                bad(name, m, "must be finite and > 0")
        if (m := ~(self.max_cap_w >= self.min_cap_w)).any():
            bad("max_cap_w", m, "must be >= min_cap_w")
        if (m := np.isnan(self.thermal_ceiling_w)).any():
            bad("thermal_ceiling_w", m, "must not be NaN (use +inf for none)")
        if (m := ~np.isfinite(self.idle_cap_w)).any():
            bad("idle_cap_w", m, "must be finite")
        if (m := ~np.isfinite(self.domain_limit_w) & ~(self.domain_limit_w == np.inf)).any():
            i = int(np.nonzero(m)[0][0])
            raise ValueError(f"domain_limit_w[{self.domain_name(i)}] = {self.domain_limit_w[i]}: must be a number or +inf")
        if (m := (self.job_of_gpu < -1) | (self.job_of_gpu >= J)).any():
            bad("job_of_gpu", m, f"must be -1 (idle) or a job index < {J}")
        if (m := (self.domain_of_gpu < 0) | (self.domain_of_gpu >= D)).any():
            bad("domain_of_gpu", m, f"must be a domain index < {D}")
        if (m := ~(np.isfinite(self.job_weight) & (self.job_weight > 0))).any():
            i = int(np.nonzero(m)[0][0])
            raise ValueError(f"job_weight[{i}] = {self.job_weight[i]}: must be finite and > 0")
        if (m := (self.domain_parent < -1) | (self.domain_parent >= D)).any():
            i = int(np.nonzero(m)[0][0])
            raise ValueError(f"domain_parent[{self.domain_name(i)}] = {self.domain_parent[i]}: not a domain index")
        depth = domain_depth(self.domain_parent)  # raises on cycles
        del depth
        return self

    # ------------------------------------------------------------------------------ builder
    @classmethod
    def build(cls, *, gpus: Sequence[Mapping], jobs: Mapping[str, float] | Sequence[Mapping] = (),
              domains: Sequence[Mapping], objective: str = "proportional",
              slew_w: float | None = None, idle_cap_w: float | None = None) -> "AllocationProblem":
        """Build from plain data.

        gpus: list of dicts with keys
          ``name`` (str), ``domain`` (leaf domain name), ``min_cap_w``, ``max_cap_w`` [W];
          optional ``model`` (key of DEFAULT_CURVES, default "H100"), ``curve`` (CurveParams or dict
          with a, k_w, sat_w[, valid_min_w]) overriding the model curve, ``thermal_ceiling_w``
          (default +inf), ``speed`` (1.0), ``job`` (job name or None = idle), ``prev_cap_w``
          (None), ``idle_cap_w`` (default: the ``idle_cap_w`` argument, else min_cap_w).
        jobs: {name: weight} or list of dicts {"name", "weight"}; jobs named by GPUs must exist.
        domains: list of dicts {"name", "parent" (name or None for a root), "limit_w" (W or None
          = unlimited), optional "kind"}.
        Raises ValueError naming the offending item and field.
        """
        job_items = _job_items(jobs)
        job_index = {n: i for i, (n, _) in enumerate(job_items)}
        if len(job_index) != len(job_items):
            raise ValueError("jobs: duplicate job name")
        dom_index, parent, limit = domain_tree(domains)
        cols, job_of, dom_of, names = _gpu_columns(gpus, job_index, dom_index, idle_cap_w)
        return cls(
            **cols, job_of_gpu=job_of, domain_of_gpu=dom_of,
            job_weight=np.array([w for _, w in job_items], float),
            domain_parent=np.array(parent, dtype=np.int64), domain_limit_w=np.array(limit, float),
            objective=objective, slew_w=None if slew_w is None else float(slew_w),
            gpu_names=tuple(names), job_names=tuple(n for n, _ in job_items),
            domain_names=tuple(str(d["name"]) for d in domains),
            domain_kinds=tuple(str(d.get("kind", "")) for d in domains),
        ).validate()


_GPU_FIELDS = {"min_cap_w", "max_cap_w", "thermal_ceiling_w", "curve_a", "curve_k_w", "curve_sat_w",
               "curve_min_w", "speed", "job_of_gpu", "prev_cap_w", "idle_cap_w", "domain_of_gpu"}


def _job_items(jobs) -> list[tuple[str, float]]:
    """(name, weight) per job from ``{name: weight}`` or a list of ``{"name", "weight"}`` dicts
    (weight defaults to 1.0). Duplicates are left for the caller to reject."""
    if isinstance(jobs, Mapping):
        return [(str(k), float(v)) for k, v in jobs.items()]
    return [(str(j["name"]), float(j.get("weight", 1.0))) for j in jobs]


def domain_tree(domains: Sequence[Mapping]) -> tuple[dict, list[int], list[float]]:
    """(name -> index, parent index per domain (-1 root), limit [W] per domain (+inf none)).

    Raises ValueError for a duplicate domain name or an unknown parent."""
    dom_index = {}
    for i, d in enumerate(domains):
        if d["name"] in dom_index:
            raise ValueError(f"domains[{i}].name: duplicate domain {d['name']!r}")
        dom_index[d["name"]] = i
    parent = []
    for i, d in enumerate(domains):
        p = d.get("parent")
        if p is not None and p not in dom_index:
            raise ValueError(f"domains[{i}].parent: unknown domain {p!r}")
        parent.append(-1 if p is None else dom_index[p])
    limit = [math.inf if d.get("limit_w") is None else float(d["limit_w"]) for d in domains]
    return dom_index, parent, limit


def _gpu_columns(gpus: Sequence[Mapping], job_index: Mapping[str, int], dom_index: Mapping, idle_cap_w):
    """Per-GPU arrays from the ``gpus`` dicts (fields as in :meth:`AllocationProblem.build`).

    Returns (cols: field name -> float array [G] (watts for the *_w fields), job_of [G] (-1 idle),
    dom_of [G] leaf domain index, names [G]). Raises ValueError naming the GPU and the field
    (missing cap, unknown model, job or domain)."""
    G = len(gpus)
    cols = {k: np.empty(G) for k in ("min_cap_w", "max_cap_w", "thermal_ceiling_w", "curve_a",
                                      "curve_k_w", "curve_sat_w", "curve_min_w", "speed",
                                      "prev_cap_w", "idle_cap_w")}
    job_of = np.full(G, -1, dtype=np.int64)
    dom_of = np.zeros(G, dtype=np.int64)
    names = []
    for g, spec in enumerate(gpus):
        name = str(spec.get("name", g))
        names.append(name)
        try:
            mn, mx = float(spec["min_cap_w"]), float(spec["max_cap_w"])
        except KeyError as exc:
            raise ValueError(f"gpus[{name}]: missing field {exc.args[0]!r}") from None
        curve = _gpu_curve(spec, name, mn)
        cols["min_cap_w"][g], cols["max_cap_w"][g] = mn, mx
        tc = spec.get("thermal_ceiling_w")
        cols["thermal_ceiling_w"][g] = math.inf if tc is None else float(tc)
        cols["curve_a"][g], cols["curve_k_w"][g] = curve.a, curve.k_w
        cols["curve_sat_w"][g], cols["curve_min_w"][g] = curve.sat_w, curve.valid_min_w
        cols["speed"][g] = float(spec.get("speed", 1.0))
        pc = spec.get("prev_cap_w")
        cols["prev_cap_w"][g] = math.nan if pc is None else float(pc)
        ic = spec.get("idle_cap_w", idle_cap_w)
        cols["idle_cap_w"][g] = mn if ic is None else float(ic)
        job = spec.get("job")
        if job is not None:
            if str(job) not in job_index:
                raise ValueError(f"gpus[{name}].job: unknown job {job!r}")
            job_of[g] = job_index[str(job)]
        dom = spec.get("domain")
        if dom not in dom_index:
            raise ValueError(f"gpus[{name}].domain: unknown domain {dom!r}")
        dom_of[g] = dom_index[dom]
    return cols, job_of, dom_of, names


def _gpu_curve(spec: Mapping, name: str, mn: float) -> CurveParams:
    """The GPU's rate curve: ``spec["curve"]`` (CurveParams or a dict with a, k_w, sat_w[,
    valid_min_w], the latter defaulting to the minimum cap ``mn`` [W]), else its model's default.
    Raises ValueError for an unknown model."""
    curve = spec.get("curve")
    if curve is None:
        model = spec.get("model", "H100")
        if model not in DEFAULT_CURVES:
            raise ValueError(f"gpus[{name}].model: {model!r}, known {sorted(DEFAULT_CURVES)}")
        return DEFAULT_CURVES[model]
    if isinstance(curve, Mapping):
        return CurveParams(float(curve["a"]), float(curve["k_w"]), float(curve["sat_w"]),
                           float(curve.get("valid_min_w", mn)))
    return curve


def domain_depth(parent: np.ndarray) -> np.ndarray:
    """Depth of each domain in the forest (roots 0). Raises ValueError on a cycle."""
    D = parent.shape[0]
    depth = np.zeros(D, dtype=np.int64)
    cur = parent.copy()
    for _ in range(D + 1):
        live = cur >= 0
        if not live.any():
            return depth
        depth[live] += 1
        cur[live] = parent[cur[live]]
    raise ValueError("domain_parent: the domain tree has a cycle")


@dataclass
class AllocationResult:
    """Outcome of one solve (shapes: G GPUs, J jobs, D domains).

    cap_w[G]: caps [W], whole milliwatts; every domain's sum <= its limit and each cap in
      [min_cap_w, min(max_cap_w, thermal_ceiling_w)] — except a ceiling below the minimum (cap =
      minimum, alert) and domains in deficit (their GPUs held at minimum, feasible=False).
    job_rate[J]: predicted step rate relative to the job's uncapped rate, in [curves.RATE_MIN, 1]
      (the curve is clamped at RATE_MIN below its valid range: never zero or negative).
    job_binding[J]: why the job is not faster, at the rounded caps: "saturated" (runs uncapped),
      "domain:<name>" (the job's priced domain with the highest price), "thermal" / "device_max" /
      "slew" / "device_min" (the job runs at the most its limiting GPU's upper bound allows),
      "deficit:<name>", "no_gpus"; a job held at its minimums by a pinned domain: "domain:<name>".
    slowest_gpu[J]: GPU index setting the job's pace (-1 if the job has no GPU).
    domain_price[D]: marginal objective per watt of the domain limit (Lagrange multiplier; 0 on a
      domain with slack at the rounded caps — complementary slackness; NaN for a domain in deficit
      or pinned: a limit within ~1 mW per GPU of its GPUs' minimum caps, which holds them there).
    domain_load_w[D]: sum of caps under each domain [W].
    domain_deficit_w[D]: sum of minimum caps minus limit where positive, else 0 [W].
    objective_value: sum_j w_j log(job_rate_j) or sum_j w_j job_rate_j at the rounded caps.
    solver: "fast" or "reference"; iterations: outer (Newton) iterations of the fast path.
    """

    cap_w: np.ndarray
    job_rate: np.ndarray
    job_binding: list
    slowest_gpu: np.ndarray
    domain_price: np.ndarray
    domain_load_w: np.ndarray
    domain_deficit_w: np.ndarray
    feasible: bool
    alerts: list = field(default_factory=list)
    solve_time_s: float = 0.0
    objective_value: float = 0.0
    solver: str = ""
    iterations: int = 0
