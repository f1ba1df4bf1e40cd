"""From observed state to the allocator's problem, and back (the coordinator's side of the solve).

:func:`build_inputs` (event-loop thread, reads the registry) snapshots everything the solve needs
into plain data: :class:`SolveInputs`, its GPUs as columns (:class:`InputColumns`, arrays [G]; the
per-GPU :class:`GpuInput` rows are made only when read: explain, tests, the pace loop's jobs). :func:`solve` (worker thread, pure) builds the allocator's
:class:`~capctl.allocator.problem.AllocationProblem` and solves it with the fast path
(:func:`capctl.allocator.fast.solve`).

Problem construction (issue 4, "Control loop"):

* domains: the policy's tree (root limit = the budget in force) plus one node domain per node
  under the domain listing it (the policy's own ``kind: node`` domain when it lists exactly that
  node: its ``limit_w`` is the node limit; otherwise ``node:<name>`` without a limit);
* GPUs of live nodes: limit constraints from NVML (raised to the policy's ``min_cap_w``), rate
  curve from the online model, thermal ceiling from the thermal model
  (:func:`capctl.allocator.thermal.thermal_ceiling_w` with the policy's ``thermal.margin_c`` and
  the device's slowdown temperature), previous cap = observed enforced cap (slew limit);
* GPUs of stale nodes, and GPUs without a reading yet, are *fixed* at their accounted cap
  (``min = max = accounted``): held and counted as spent, never as free budget;
* idle GPUs (no job bound) get the policy's ``idle_cap_w``; when it is null they go back to the
  pre-job limit the agent still has to restore (``GpuTelemetry.pre_job_cap_w``), else keep their
  current cap (counted as spent), as the default policy documents;
* jobs: the bindings the agents hold; weight from the policy (qos > account > partition >
  default).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import operator
import time

import numpy as np

from capctl import capstates, devicedata
from capctl.allocator.problem import domain_tree
from capctl.allocator.thermal import THERMAL_PRIOR, thermal_ceiling_w
from coordinator.registry import OOB_TOLERANCE_W, gpu_jobs  # noqa: F401 (OOB_TOLERANCE_W: re-exported)

GpuKey = tuple[str, int]

FIXED_EPS_W = 1e-3
OOB_HOLD_S = 30.0
"""How long (s) a GPU stays planned within an out-of-band limit after a reading last showed it
(the request brought down to it hides it); then one raise probes whether it is still there."""

UNCONTROLLABLE_STATES = capstates.UNCONTROLLABLE  # held at their accounted cap (capctl.capstates)
"""Agent cap states of a GPU whose limit capctl cannot set now: it is fixed at its accounted
cap (spent), like a stale node's GPUs, so a refused decrease is never counted as freed watts."""


@dataclasses.dataclass(slots=True)
class GpuInput:
    """One GPU of the problem (W, degC)."""

    key: GpuKey
    domain: str
    min_cap_w: float
    max_cap_w: float
    fixed: bool
    accounted_w: float
    observed_w: float
    job: str | None
    curve: object
    thermal_ceiling_w: float
    idle_cap_w: float
    idle_target_w: float = 0.0  # an idle GPU's pre-job limit to come back from headroom (W; 0: none)
    pace: float = math.nan  # measured SM clock / max SM clock of its latest sample (coordinator.paceloop;
    # NaN: none; a fixed GPU has one only from a live reading: _pace_columns)
    pace_at_w: float = 0.0  # the enforced limit that sample was taken at (W)
    paced: bool = False  # a fresh busy sample whose clock the power cap set (SW_POWER_CAP)
    straggler: str = ""  # why its pace does not respond to power ("" = it does)
    speed: float = 1.0  # pace of a straggler relative to its curve at its cap (allocator ``speed``)
    draw_w: float = 0.0  # measured power of that sample (W; 0: unknown) (coordinator.pacealign)
    pace_step: float = 0.0  # one SM clock step as a fraction of the max clock (0: unknown)
    pace_slope_w: float = math.nan  # measured dP/d(pace) (W per unit pace; NaN: none) (coordinator.paceslope)


@dataclasses.dataclass
class InputColumns:
    """The GPUs of a :class:`SolveInputs` as arrays [G] (the fields of :class:`GpuInput`, W, °C;
    ``job`` a position in ``job_names``, -1: idle; ``domain`` a position in ``domain_names``;
    ``straggler``: position -> reason, only stragglers; ``curves``:
    :class:`coordinator.models.CurveColumns` or a list of curve objects)."""

    keys: tuple
    domain: np.ndarray
    domain_names: list
    job: np.ndarray
    job_names: list
    min_cap_w: np.ndarray
    max_cap_w: np.ndarray
    fixed: np.ndarray
    accounted_w: np.ndarray
    observed_w: np.ndarray
    thermal_ceiling_w: np.ndarray
    idle_cap_w: np.ndarray
    idle_target_w: np.ndarray
    pace: np.ndarray
    pace_at_w: np.ndarray
    paced: np.ndarray
    speed: np.ndarray
    straggler: dict
    draw_w: np.ndarray
    pace_step: np.ndarray
    curve_a: np.ndarray
    curve_k_w: np.ndarray
    curve_sat_w: np.ndarray
    curve_min_w: np.ndarray
    curves: object
    pace_slope_w: np.ndarray | None = None  # measured slope (W per unit pace, NaN: none); None: none at all
    oob_w: np.ndarray | None = None  # enforced limit (W) an out-of-band limit holds it to, NaN: none; None: unknown
    idle_recent_w: np.ndarray | None = None  # lowest idle grant of the last intervals (W; coordinator.idlegrants), inf: none

    def curve(self, i: int):
        c = self.curves
        return c[i] if isinstance(c, list) else c.curve(i)

    def row(self, i: int) -> GpuInput:
        """GPU ``i`` as a :class:`GpuInput`."""
        return self.rows_at([i])[0]

    def rows_at(self, positions, with_curves: bool = True) -> list[GpuInput]:
        """The GPUs at ``positions`` as :class:`GpuInput` rows (one conversion per column);
        ``with_curves=False`` leaves ``curve`` None (a reader that uses no curve: 2 us a row less)."""
        pos = np.asarray(positions, np.int64)
        cols = [np.asarray(a)[pos].tolist() for a in (
            self.min_cap_w, self.max_cap_w, self.fixed, self.accounted_w, self.observed_w, self.thermal_ceiling_w,
            self.idle_cap_w, self.idle_target_w, self.pace, self.pace_at_w, self.paced, self.speed,
            self.draw_w, self.pace_step, self._slopes())]
        keys, dnames, jnames, strag = self.keys, self.domain_names, self.job_names, self.straggler
        c = self.curves
        if not with_curves:
            curves = [None] * len(pos)
        else:
            curves = [c[i] for i in pos.tolist()] if isinstance(c, list) else c.curves_at(pos)
        out = []
        for p, d, j, cv, lo, hi, fx, acc, obs, ceil, idle, tgt, pace, at, paced, speed, draw, step, sl in zip(
                pos.tolist(), self.domain[pos].tolist(), self.job[pos].tolist(), curves, *cols):
            out.append(GpuInput(keys[p], dnames[d], lo, hi, fx, acc, obs, jnames[j] if j >= 0 else None,
                                cv, ceil, idle, tgt, pace, at, paced, strag.get(p, ""), speed, draw, step, sl))
        return out

    def _slopes(self) -> np.ndarray:
        """``pace_slope_w`` [G] (NaN where none was measured or the column is absent)."""
        s = self.pace_slope_w
        return np.full(len(self.keys), math.nan) if s is None else s

    def rows(self) -> list[GpuInput]:
        """Every GPU as a :class:`GpuInput` (cold paths: explain, tests)."""
        return self.rows_at(range(len(self.keys)))


class GpuRows(collections.abc.Sequence):
    """``SolveInputs.gpus`` of inputs built as columns: a read-only sequence of :class:`GpuInput`
    made from the columns on first use (the hot paths read ``columns`` instead)."""

    def __init__(self, columns: InputColumns) -> None:
        self.columns = columns
        self._rows: list | None = None

    def _all(self) -> list:
        if self._rows is None:
            self._rows = self.columns.rows()
        return self._rows

    def __len__(self) -> int:
        return len(self.columns.keys)

    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self):
        return iter(self._all())


def columns_of(inputs: "SolveInputs") -> InputColumns:
    """The :class:`InputColumns` of ``inputs`` (built once from a list of :class:`GpuInput`)."""
    gpus = inputs.gpus
    if isinstance(gpus, GpuRows):
        return gpus.columns
    if inputs._columns is None or inputs._columns[0] is not gpus or inputs._columns[1] != len(gpus):
        inputs._columns = (gpus, len(gpus), _columns_from_rows(list(gpus)))
    return inputs._columns[2]


def _columns_from_rows(gpus: list[GpuInput]) -> InputColumns:
    G = len(gpus)
    f = np.float64
    job_names = list(dict.fromkeys(g.job for g in gpus if g.job is not None))
    jpos = {n: i for i, n in enumerate(job_names)}
    domain_names = list(dict.fromkeys(g.domain for g in gpus))
    dpos = {n: i for i, n in enumerate(domain_names)}
    curves = _curves(gpus)

    def col(name, dt=f):
        return np.fromiter((getattr(g, name) for g in gpus), dt, G)

    return InputColumns(
        keys=tuple(g.key for g in gpus), domain=np.fromiter((dpos[g.domain] for g in gpus), np.int64, G),
        domain_names=domain_names, job=np.fromiter((jpos[g.job] if g.job is not None else -1 for g in gpus), np.int64, G),
        job_names=job_names, min_cap_w=col("min_cap_w"), max_cap_w=col("max_cap_w"), fixed=col("fixed", bool),
        accounted_w=col("accounted_w"), observed_w=col("observed_w"), thermal_ceiling_w=col("thermal_ceiling_w"),
        idle_cap_w=col("idle_cap_w"), idle_target_w=col("idle_target_w"), pace=col("pace"), pace_at_w=col("pace_at_w"),
        paced=col("paced", bool), speed=col("speed"), straggler={i: g.straggler for i, g in enumerate(gpus) if g.straggler},
        draw_w=col("draw_w"), pace_step=col("pace_step"),
        curve_a=np.fromiter((c.a for c in curves), f, G), curve_k_w=np.fromiter((c.k_w for c in curves), f, G),
        curve_sat_w=np.fromiter((c.sat_w for c in curves), f, G),
        curve_min_w=np.fromiter((c.valid_min_w for c in curves), f, G), curves=[g.curve for g in gpus],
        pace_slope_w=col("pace_slope_w"))


@dataclasses.dataclass
class SolveInputs:
    """Everything one solve needs (plain data; safe to hand to a worker thread). ``gpus``: a list
    of :class:`GpuInput`, or the :class:`GpuRows` of columns (:func:`build_inputs`); the hot paths
    read :func:`columns_of`."""

    gpus: list[GpuInput]
    jobs: dict[str, float]
    domains: list[dict]
    objective: str
    slew_w: float | None
    node_domain: dict[str, str]
    domain_members: dict[str, set]  # domain name -> GPU keys below it (all levels)
    limited: tuple | None = None  # (limited domains, levels): see domain_levels (None: not computed yet)
    limited_pos: list | None = None  # per limited domain: positions of its GPUs in ``gpus`` (sorted)
    spread_spare: bool = False  # the policy's spread_spare_watts (:func:`spread_spare`)
    reserved_w: dict = dataclasses.field(default_factory=dict)  # unreported policy node -> W counted (unreported_reserve)
    claims: dict = dataclasses.field(default_factory=dict)  # node -> why a second agent claiming it was refused
    ghosts: dict = dataclasses.field(default_factory=dict)  # node -> (W, UUIDs) of GPUs its agent no longer lists
    _columns: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)


def limited_positions(inputs: SolveInputs) -> list[tuple[float, np.ndarray]]:
    """``(limit W, positions of its GPUs in inputs.gpus, sorted)`` of every domain with a finite
    limit, in domain order: :func:`coordinator.planner.domain_index` of ``inputs`` (cached)."""
    if inputs.limited_pos is None:
        limited, levels = domain_levels(inputs)
        inputs.limited_pos = [(lim, np.nonzero((levels == j).any(axis=1))[0]) for j, (_n, lim) in enumerate(limited)]
    return inputs.limited_pos


def _limited_domains(domains: list[dict]) -> list[tuple[str, float]]:
    return [(d["name"], float(d["limit_w"])) for d in domains
            if d["limit_w"] is not None and math.isfinite(d["limit_w"])]


def _levels(limited: list[tuple[str, float]], members: dict, pos_of) -> np.ndarray:
    """[G, depth] int: the positions in ``limited`` of the domains above each GPU, -1 padded
    (``pos_of``: GPU key -> its position, G = len(pos_of))."""
    G = len(pos_of)
    count = np.zeros(G, np.int64)
    cols = []
    for j, (name, _lim) in enumerate(limited):
        idx = np.fromiter((pos_of[k] for k in members.get(name, ()) if k in pos_of), np.int64)
        cols.append((j, idx, count[idx].copy()))
        count[idx] += 1
    levels = np.full((G, int(count.max()) if G and cols else 0), -1, np.int64)
    for j, idx, col in cols:
        levels[idx, col] = j
    return levels


def domain_levels(inputs: SolveInputs) -> tuple[list[tuple[str, float]], np.ndarray]:
    """``(limited, levels)`` of ``inputs``: the domains with a finite limit as ``(name, limit W)``
    and, per GPU of ``inputs.gpus`` (in order), the positions in ``limited`` of the domains above
    it ([G, depth] int, -1 padded). Cached on ``inputs`` (from the domain structure when
    :func:`build_inputs` made it)."""
    if inputs.limited is None:
        limited = _limited_domains(inputs.domains)
        inputs.limited = (limited, _levels(limited, inputs.domain_members,
                                           {k: i for i, k in enumerate(columns_of(inputs).keys)}))
    return inputs.limited


def _domain_sums(levels: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """[n]: the sum of ``values`` [G] (W) over each limited domain's GPUs."""
    if not levels.size:
        return np.zeros(n)
    m = levels >= 0
    return np.bincount(levels[m], weights=np.broadcast_to(values[:, None], levels.shape)[m], minlength=n)


@dataclasses.dataclass
class SolveOutput:
    """The allocator's answer mapped back to GPU keys and job ids."""

    desired_w: dict[GpuKey, float]
    job_rate: dict[str, float]
    job_binding: dict[str, str]
    job_slowest: dict[str, GpuKey | None]
    domain_price: dict[str, float]
    domain_deficit_w: dict[str, float]
    domain_load_w: dict[str, float]
    feasible: bool
    alerts: list[str]
    solve_s: float
    solver: str
    idle_grant_w: dict = dataclasses.field(default_factory=dict)  # GPU key -> raw idle grant (W), coordinator.idlegrants
    desired_at: np.ndarray | None = None
    """``desired_w`` as an array [G] (W) in the order of the inputs' GPUs (None: not kept): the
    ``at`` of the steps after the solve (:func:`paced_split`, :func:`step_margin`,
    :func:`idle_from_headroom`, :func:`spread_spare`), equal to ``desired`` (every GPU has a value)
    and updated with it, so each step reads the array instead of the dict (:func:`values_at`: a
    hash of every GPU key per read, 0.04 us a GPU at 8,000, best of 21, 7 Dec 2026; five reads an
    interval before)."""


def ceiling_w(temp_c, thermal, interval_s, slowdown_temp_c, margin_c) -> float:
    """Thermal ceiling (W) of one GPU, +inf when the slowdown temperature or model is unknown."""
    if not thermal or slowdown_temp_c <= 0 or not math.isfinite(temp_c):
        return math.inf
    r, tau, inlet = thermal
    try:
        value = float(thermal_ceiling_w(temp_c, inlet, r, tau, interval_s, slowdown_temp_c, margin_c))
    except ValueError:
        return math.inf
    return value if not math.isnan(value) else math.inf


def build_domains(policy, node_names) -> tuple[list[dict], dict[str, str]]:
    """Allocator domain dicts (tree + node domains) and node -> its node-domain name."""
    out = []
    seen = set()
    for d, parent in _walk_with_parent(policy.domains, None):
        limit = policy.budget_w if parent is None else d.limit_w
        out.append({"name": d.name, "parent": parent, "limit_w": limit, "kind": d.kind})
        seen.add(d.name)
    node_domain = {}
    for node in node_names:
        path = policy.domain_path(node)
        leaf = path[-1]
        if leaf.kind == "node" and tuple(leaf.nodes) == (node,) and not leaf.children:
            node_domain[node] = leaf.name
            continue
        name = f"node:{node}"
        if name in seen:
            name = f"node:{node}#"
        out.append({"name": name, "parent": leaf.name, "limit_w": None, "kind": "node"})
        seen.add(name)
        node_domain[node] = name
    return out, node_domain


def _walk_with_parent(domain, parent):
    yield domain, parent
    for child in domain.children:
        yield from _walk_with_parent(child, domain.name)


_STRUCTURE_CACHE: dict = {}
"""(policy, topology) -> (domains, node_domain, members): rebuilt only when the policy object or
the set of nodes and GPU indices changes (a few entries; see :func:`_structure`)."""
_STRUCTURE_CACHE_MAX = 4


def _structure(policy, topology: tuple) -> tuple[list[dict], dict[str, str], dict[str, frozenset], tuple, list]:
    """Domains, node -> node-domain, domain -> GPU keys below it, the limited domains with their
    levels (:func:`domain_levels`) and positions (:func:`limited_positions`; GPUs in topology
    order, the order of :func:`build_inputs`' list) for ``topology`` (a tuple of
    ``(node name, (gpu indices...))`` sorted by name), cached. The returned objects are shared
    between intervals: callers must not mutate them."""
    key = (id(policy), topology)
    hit = _STRUCTURE_CACHE.get(key)
    if hit is not None and hit[0] is policy:
        return hit[1]
    domains, node_domain = build_domains(policy, [name for name, _ in topology])
    parent = {d["name"]: d["parent"] for d in domains}
    members: dict[str, set] = {d["name"]: set() for d in domains}
    for name, indices in topology:
        keys = [(name, idx) for idx in indices]
        d = node_domain[name]
        while d is not None:
            members[d].update(keys)
            d = parent[d]
    frozen = {k: frozenset(v) for k, v in members.items()}
    limited = _limited_domains(domains)
    pos_of = {(name, idx): None for name, indices in topology for idx in indices}
    pos_of = {k: i for i, k in enumerate(pos_of)}  # the order of build_inputs' GPU list
    levels = _levels(limited, frozen, pos_of)
    positions = [(lim, np.nonzero((levels == j).any(axis=1))[0]) for j, (_n, lim) in enumerate(limited)]
    value = (domains, node_domain, frozen, (limited, levels), positions)
    if len(_STRUCTURE_CACHE) >= _STRUCTURE_CACHE_MAX:
        _STRUCTURE_CACHE.clear()
    _STRUCTURE_CACHE[key] = (policy, value)  # the policy is kept alive so that its id stays unique
    return value


def build_inputs(registry, models, policy, now_mono: float, lease_s: float, ack_memory_s: float) -> SolveInputs:
    """Snapshot the registry and models into :class:`SolveInputs` (see module docstring).

    ``now_mono``: the registry clock (s); ``lease_s``: a node without a report for longer is stale
    (s); ``ack_memory_s``: how long an acknowledged read-back counts (s). Built as columns: the
    registry's fields of every GPU in one gather (:mod:`coordinator.gpucolumns`), the rules on
    arrays (:func:`_input_columns`), the curves and thermal parameters of all GPUs as arrays from
    ``models``, every thermal ceiling from one vectorized
    :func:`~capctl.allocator.thermal.thermal_ceiling_w` call (same values as :func:`ceiling_w`
    per GPU); the domain tree and its members are cached per policy and topology.
    """
    from coordinator import gpucolumns

    table = registry.gpu_table()
    topology = table.topology
    domains, node_domain, members, limited, positions = _structure(policy, topology)
    jobs, job_names, job = _jobs_of(table, policy)
    stale = np.fromiter((node.stale(now_mono, lease_s) for node in table.nodes), bool, len(topology))
    c = gpucolumns.gather(table.keys, table.gpus, static=table.static)
    cols = _input_columns(c, table, policy, models, now_mono, ack_memory_s, stale[table.node_of] if len(stale) else
                          np.zeros(0, bool))
    dom_names = [node_domain[name] for name, _ in topology]
    cols.domain, cols.domain_names, cols.job, cols.job_names = table.node_of, dom_names, job, job_names
    cols.idle_target_w = np.where(job >= 0, 0.0, cols.idle_target_w)
    claims = registry.claims_refused(now_mono, CLAIM_HOLD_S)
    reserved = unreported_reserve(policy, topology, table.node_of, c["max_cap_w"], claims)
    ghosts = registry.ghost_reserve(now_mono, GHOST_HOLD_S)
    for name, (watts, _) in ghosts.items():  # GPUs a node's agent no longer lists: still counted
        reserved[name] = reserved.get(name, 0.0) + watts
    if reserved:  # the limits less what the silent nodes may draw (rare: the cached structure is not used)
        domains, limited, positions = with_reserve(domains, policy, reserved), None, None
    return SolveInputs(gpus=GpuRows(cols), jobs=jobs, domains=domains, objective=policy.objective,
                       slew_w=policy.slew_w, node_domain=node_domain, domain_members=members, limited=limited,
                       limited_pos=positions, spread_spare=bool(getattr(policy, "spread_spare_watts", False)),
                       reserved_w=reserved, claims=claims, ghosts=ghosts)


GHOST_HOLD_S = 86400.0
"""A GPU a node's agent no longer lists (``Registry.ghost_reserve``) is counted at its last caps
for this long (s; as a silent node outside the policy, ``registry.NODE_FORGET_S``) unless a hello
lists it again: a GPU swapped out costs its watts for a day; one whose node name another agent
took while the node's own was dead is real and at the caps that agent set."""
CLAIM_HOLD_S = 360.0
"""A node a second agent claimed (its hello refused: another agent serves that name with other
GPUs) is counted once more at the most it may draw until this long (s) after the last refused
hello: that agent's GPUs are real and at caps no plan sets. Longer than the agent's largest
reconnect backoff (``capctl-agent --reconnect-max-s``, at most 300 s), so a retrying agent keeps it."""


def unreported_reserve(policy, topology: tuple, node_of: np.ndarray, max_cap_w: np.ndarray,
                       claimed=()) -> dict[str, float]:
    """Node -> W of every node the policy lists that the registry has no GPU of (its agent never
    said hello to this coordinator and no node ledger named it): what it may draw at most, the
    larger of :func:`declared_draw_w` (the policy's ``gpus_per_node`` x its ``gpu_model``'s
    maximum limit, or x the highest maximum limit of the known GPUs when it names no model capctl
    knows) and the largest maximum draw of any known node (the sum of its GPUs' maximum
    limits ``max_cap_w`` [G] W, ``node_of`` [G] its position in ``topology``; at most
    :data:`capctl.devicedata.MAX_SANE_LIMIT_W` a GPU). {} when every policy node is known; a node
    with neither figure (no known node, nothing declared) is left out (nothing to allocate then).
    The nodes ``claimed`` (a second agent's hello refused for them, :data:`CLAIM_HOLD_S`) are
    counted so too, on top of their known GPUs (the refused agent's GPUs: 4,730 W on a 4,000 W
    budget when it was not, found by a try-out).

    Why: such a node may be running at any cap: an agent killed with -9 leaves its GPUs at the
    caps it last set, and a coordinator whose state was lost (a new ``--state-dir``, etcd rebuilt)
    has no ledger of them. Counted as free, they were handed out again (found by a try-out: the
    cluster at 3,942 W on a 3,600 W budget in the simulated driver's journal, for as long as the
    agent stayed down); counted at the largest known node alone, an 8-GPU node beside 2-GPU ones
    was undercounted (7,000 W on a 6,200 W budget, a second try-out). Removing a node that is gone
    for good from the policy releases its watts."""
    known = {name for name, indices in topology if indices}  # (an agent that reports no GPU: none known, as decide says)
    # ``claimed``: nodes a second agent claims (Registry.claims_refused): its GPUs too, on top
    missing = sorted({name for name in policy.domains.all_nodes() if name not in known} | set(claimed))
    if not missing:
        return {}
    largest_w = gpu_w = 0.0
    if len(node_of):
        per_gpu = np.maximum(np.minimum(np.nan_to_num(np.asarray(max_cap_w, float), nan=0.0, posinf=0.0),
                                        devicedata.MAX_SANE_LIMIT_W), 0.0)
        largest_w = float(np.bincount(node_of, weights=per_gpu, minlength=len(topology)).max())
        gpu_w = float(per_gpu.max())
    out = {name: max(largest_w, declared_draw_w(policy, name, gpu_w)) for name in missing}
    return {name: w for name, w in out.items() if w > 0}


def declared_draw_w(policy, node: str, known_gpu_w: float = 0.0) -> float:
    """The most ``node`` may draw by what the policy declares of it (W): its domain's
    ``gpus_per_node`` x the maximum limit of its ``gpu_model``
    (:data:`capctl.policy.devices.KNOWN_DEVICE_LIMITS_W`); with no known model (none declared, or
    a name capctl does not know) ``gpus_per_node`` x ``known_gpu_w``, the highest maximum limit of
    any GPU that reported (W). A policy saying 8 GPUs a node beside a reporting node of 4 was
    counted at that node's 4 GPUs (found by a try-out). 0 when ``gpus_per_node`` is not declared."""
    from capctl.policy.devices import device_limits_w

    leaf = policy.domain_path(node)[-1]
    if not leaf.gpus_per_node:
        return 0.0
    high = device_limits_w(leaf.gpu_model)[1] if leaf.gpu_model else None
    return float(leaf.gpus_per_node) * float(high if high else known_gpu_w)


def with_reserve(domains: list[dict], policy, reserved: dict[str, float]) -> list[dict]:
    """``domains`` (allocator domain dicts, not mutated) with each finite limit lowered by the
    watts ``reserved`` (node -> W) of the nodes below it (the policy's domain path of each node,
    the cluster budget included), never below 0 W; a changed domain keeps what was taken off as
    ``reserved_w`` (W)."""
    cut: dict[str, float] = {}
    for node, watts in reserved.items():
        for d in policy.domain_path(node):
            cut[d.name] = cut.get(d.name, 0.0) + watts
    out = []
    for d in domains:
        r, lim = cut.get(d["name"], 0.0), d["limit_w"]
        if r > 0 and lim is not None and math.isfinite(lim):
            d = {**d, "limit_w": max(0.0, lim - r), "reserved_w": min(r, lim)}
        out.append(d)
    return out


def _input_columns(c, table, policy, models, now_mono: float, ack_memory_s: float, stale: np.ndarray) -> InputColumns:
    """The rules of :func:`build_inputs` on the gathered columns ``c`` (W, °C): GPUs fixed at
    their accounted cap (stale node, no reading, no limits, uncontrollable or unusable
    constraints), the policy's minimum, stragglers and out-of-band limits, the idle rule,
    thermal ceilings and measured pace. ``stale`` [G]: the GPU's node is stale."""
    from coordinator import gpucolumns

    G = len(table.keys)
    have = c["have_reading"]
    lo_c, hi_c = c["min_cap_w"], c["max_cap_w"]
    problem = gpucolumns.constraints_unusable(lo_c, hi_c)
    acc = gpucolumns.accounted_w(c, now_mono, ack_memory_s, problem)
    states = state_codes(c["cap_state"])
    unc = (states & UNCONTROLLABLE_BIT) != 0
    fixed = stale | ~have | (hi_c <= 0) | unc | problem
    policy_min = policy.min_cap_w
    lo = lo_c if policy_min is None else np.maximum(lo_c, np.minimum(policy_min, hi_c))
    lo = np.maximum(lo, FIXED_EPS_W)
    hi = hi_c.copy()
    fresh = (now_mono - c["sample_mono"]) <= PACE_FRESH_S
    strag_pos = np.nonzero(~fixed & (c["slowdown_run"] >= STRAGGLER_SAMPLES) & fresh)[0].tolist()
    if strag_pos:  # held where extra watts buy nothing (its draw, +5 % and 5 W for noise)
        sp = np.asarray(strag_pos, np.int64)
        hi[sp] = np.maximum(lo[sp], np.minimum(np.minimum(hi[sp], c["sample_enforced_w"][sp]),
                                               STRAGGLER_MARGIN * c["power_w"][sp] + 5.0))
    enforced = c["enforced_w"]
    oob_now = ((states & OOB_BIT) != 0) & (enforced < c["cap_w"] - OOB_TOLERANCE_W)
    # observed state first: another limit binds below the request (out-of-band): the GPU is
    # planned (and its request brought down) within its enforced limit; once the request is down
    # the device no longer shows that limit, so it is kept for OOB_HOLD_S after it was last seen
    # (then one raise probes it: counted at its request, coordinator.registry.GpuObs.accounted_w)
    held = ~oob_now & ((now_mono - c["oob_mono"]) <= OOB_HOLD_S) & np.isfinite(c["oob_w"])
    oob_ceiling = np.where(oob_now, enforced, c["oob_w"])
    oob = oob_now | held
    hi = np.where(oob, np.maximum(lo, np.minimum(hi, oob_ceiling)), hi)
    idle, target = _idle_rule(policy, c["pre_job_cap_w"], acc, lo, hi)
    v = np.maximum(acc, FIXED_EPS_W)
    lo, hi, idle = np.where(fixed, v, lo), np.where(fixed, v, hi), np.where(fixed, v, idle)
    target = np.where(fixed, 0.0, target)
    ceiling, r_c_per_w = _ceilings(c, table, models, policy, fixed, stale)
    ceiling = thermal_damping(ceiling, c, acc, lo, hi_c, policy.thermal.margin_c, r_c_per_w)
    codes = reason_codes(c["reasons"])
    ceiling = np.where(fixed, ceiling, thermal_guard(ceiling, c, acc, lo, hi_c, policy.thermal.margin_c, codes))
    curves = models.curve_arrays(table.keys)
    # a straggler's pace (and so its speed and flag) needs its maximum clock
    strag_pos = [i for i in strag_pos if c["max_sm_clock_mhz"][i] > 0]
    straggler = {i: straggler_reason(table.gpus[i], now_mono) for i in strag_pos}
    strag_pos += _oob_below_minimum(c, lo, oob_now & ~fixed & fresh, straggler)
    pace, pace_at, paced, draw, step = _pace_columns(c, fixed, fresh, straggler, codes, stale)
    # each GPU's measured slope of power over pace (coordinator.paceslope; its state is the models')
    tracker = getattr(models, "pace_slopes", None)
    slope = None
    if tracker is not None:
        from coordinator import pacealign

        slope = tracker.observe(table.keys, pace_at, pace, paced, step, pacealign.STATIC_FRACTION * hi)
    speed = np.ones(G)
    for i in strag_pos + np.flatnonzero(fixed & np.isfinite(pace)).tolist():  # (held GPUs with a pace too)
        cv = curves.curve(i)
        cv = cv if cv is not None and not isinstance(cv, dict) else _default_curve()
        model = float(cv.rate(max(hi[i], lo[i])))  # at the cap it is held at
        speed[i] = min(1.0, max(0.05, pace[i] / model)) if model > 0 else 1.0
    return InputColumns(
        keys=table.keys, domain=None, domain_names=[], job=None, job_names=[], min_cap_w=lo, max_cap_w=hi,
        fixed=fixed, accounted_w=acc, observed_w=np.where(have, enforced, acc), thermal_ceiling_w=ceiling,
        idle_cap_w=idle, idle_target_w=target, pace=pace, pace_at_w=pace_at, paced=paced, speed=speed,
        straggler=straggler, draw_w=draw, pace_step=step, curve_a=curves.a, curve_k_w=curves.k_w, curve_sat_w=curves.sat_w,
        curve_min_w=curves.valid_min_w, curves=curves, pace_slope_w=slope,
        oob_w=np.where(oob & ~fixed, oob_ceiling, np.nan),
        idle_recent_w=grants.recent(table.keys) if (grants := getattr(models, "idle_grants", None)) else None)


def _idle_rule(policy, pre_job_cap_w: np.ndarray, acc: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple:
    """``(idle cap, idle target)`` [G] (W) of every GPU by the policy's idle rule (see the module
    docstring): ``idle_cap_w`` within the limits; null and reserved: the pre-job limit (else the
    accounted cap) now; null: the minimum in the solve, the pre-job limit as the target."""
    back = np.minimum(np.maximum(np.where(pre_job_cap_w > 0, pre_job_cap_w, acc), lo), hi)
    if policy.idle_cap_w is not None:
        return np.minimum(np.maximum(float(policy.idle_cap_w), lo), hi), np.zeros(len(lo))
    if bool(getattr(policy, "reserve_pre_job_limits", False)):
        return back, np.zeros(len(lo))
    return lo, back


def _default_curve():
    from capctl.allocator.curves import DEFAULT_CURVES

    return DEFAULT_CURVES["H100"]


def _ceilings(c, table, models, policy, fixed: np.ndarray, stale: np.ndarray) -> tuple:
    """``(ceilings, R)`` [G]: thermal ceilings (W; +inf where none: fixed GPU, stale node, no
    model, no slowdown temperature or no finite temperature) and each GPU's thermal resistance
    (°C/W, its node's thermal model; NaN: none)."""
    node_stale = np.zeros(len(table.topology), bool)
    if len(stale):
        node_stale[table.node_of] = stale
    r, tau, inlet = models.thermal_arrays(table.topology, skip=node_stale)
    temp, slowdown = c["temp_c"], c["slowdown_temp_c"]
    want = ~fixed & ~np.isnan(r) & (slowdown > 0) & np.isfinite(temp)
    out = np.full(len(fixed), math.inf)
    if want.any():
        w = np.nonzero(want)[0]
        out[w] = ceilings_w(np.stack([temp[w], r[w], tau[w], inlet[w], slowdown[w]], axis=1), policy.interval_s,
                            policy.thermal.margin_c)
    return out, r


HOLD_MARGIN_FRACTION = 0.5
""":func:`thermal_guard` holds a GPU (no raise) from this fraction of the policy's thermal margin
below its slowdown temperature (margin 5 °C: from 2.5 °C below): halfway between the target the
model holds GPUs at and the slowdown temperature, so a reading at the target (NVML's whole
degrees) does not stop the model's own raises."""
HOT_STEP_FRACTION = 0.1
"""How far below its accounted cap :func:`thermal_guard` puts the ceiling of a GPU in thermal
slowdown, per interval: this fraction of its limit range (V100 150-300 W: 15 W; H100 200-700 W: 50 W)."""


def thermal_guard(ceiling: np.ndarray, c, acc_w: np.ndarray, lo_w: np.ndarray, hi_w: np.ndarray,
                  margin_c: float, codes: np.ndarray | None = None) -> np.ndarray:
    """[G] thermal ceilings (W) bounded by what each device reports, whatever its thermal model
    says: a GPU at or above its target temperature (its slowdown temperature minus ``margin_c``,
    °C; from :data:`HOLD_MARGIN_FRACTION` of the margin) or with a thermal clocks event reason is
    never raised (ceiling <= its accounted cap ``acc_w``); one whose reading is at or above its
    slowdown temperature (``HW_THERMAL_SLOWDOWN`` when it reports no temperature) comes down by
    :data:`HOT_STEP_FRACTION` of its range
    ``[lo_w, hi_w]`` (the policy's minimum, the device's maximum: not a straggler's or an
    out-of-band limit's lower bound) below the lower of its accounted cap and its power reading
    each interval, to its minimum cap ``lo_w`` at most (the allocation holds a GPU whose ceiling is below its minimum at the
    minimum). A thermal reason alone does not step it down: ``SW_THERMAL_SLOWDOWN`` is set at the
    driver's maximum operating temperature (NVML_TEMPERATURE_THRESHOLD_GPU_MAX), near the target the
    model holds GPUs at (stepping down there made caps cycle by 50 W in 38 % of the intervals,
    bench/thermal_ceiling.py, one-pole plant, 1,024 GPUs), and a slowdown's reason stays set
    through its hysteresis, after the temperature fell below the threshold (stepping on it cost
    3 % of throughput in a ``capctl sim`` A100 scenario, seed 11: 0.918 -> 0.891 of the oracle).

    Why: a thermal fit learned while the GPU was in slowdown (its power held by the throttle, its
    temperature flat) can say R ~20x too low: ``capctl sim``, a V100 at 0.69 °C/W, 32.7 °C inlet,
    interval 5 s: ceilings of 486-1,261 W at 87 °C, its cap raised 150 -> 185 W while in slowdown,
    thermal shutdown at 90 °C 76 s in (the oracle held it at 150 W: alive; found by a try-out).
    NaN or unknown temperatures and slowdown temperatures leave the ceiling as it is. ``codes``:
    :func:`reason_codes` of ``c["reasons"]`` (None: computed here)."""
    temp, slowdown = c["temp_c"], c["slowdown_temp_c"]
    known = np.isfinite(temp) & (slowdown > 0)
    codes = (reason_codes(c["reasons"]) if codes is None else codes) & THERMAL_BITS  # 1 SW/HW, 2 HW
    with np.errstate(invalid="ignore"):
        hot = (known & (temp >= slowdown - HOLD_MARGIN_FRACTION * margin_c)) | (codes > 0)
        slowed = (known & (temp >= slowdown)) | (~known & (codes == 2))
    if not hot.any() and not slowed.any():
        return ceiling
    out = np.where(hot, np.minimum(ceiling, acc_w), ceiling)
    power = np.where(np.isfinite(c["power_w"]) & (c["power_w"] > 0), c["power_w"], acc_w)
    down = np.minimum(acc_w, power) - HOT_STEP_FRACTION * np.maximum(hi_w - lo_w, 0.0)
    return np.where(slowed, np.minimum(out, np.maximum(down, lo_w)), out)


NEAR_BAND_FRACTION = 1.0
""":func:`thermal_damping`'s band starts this fraction of the policy's thermal margin below the
target (margin 5 °C, target 84 °C: from 79 °C) and ends where :func:`thermal_guard` holds."""
NEAR_STEP_FRACTION = 0.02
"""Largest raise of a thermal ceiling in the band per interval, from the GPU's accounted cap: this
fraction of its limit range (H100 200-700 W: 10 W; V100 150-300 W: 3 W)."""
DROP_STEPS_PER_C = 2.0
"""In the band, a ceiling may come down by one step plus this many steps per °C above the target
(H100: 10 W at the target, 30 W one degree above it, 60 W at the hold 2.5 °C above it)."""


def thermal_damping(ceiling: np.ndarray, c, acc_w: np.ndarray, lo_w: np.ndarray, hi_w: np.ndarray,
                    margin_c: float, r_c_per_w: np.ndarray) -> np.ndarray:
    """[G] thermal ceilings (W) moved gradually near the target (slowdown temperature
    ``c["slowdown_temp_c"]`` minus ``margin_c``, °C), from each GPU's accounted cap ``acc_w`` (W):

    * in the band, from :data:`NEAR_BAND_FRACTION` of the margin below the target up to
      :func:`thermal_guard`'s hold: up by at most a step (:data:`NEAR_STEP_FRACTION` of the range
      ``[lo_w, hi_w]``, W), down by at most ``step x (1 + DROP_STEPS_PER_C x degrees above the
      target)``;
    * below the band: up by at most ``max(step, (target - T) / R)``, the raise that heats the GPU
      to the target in steady state by its thermal model's resistance ``r_c_per_w`` (°C/W; NaN
      or <= 0: no bound), at most the prior's (:data:`capctl.allocator.thermal.THERMAL_PRIOR`,
      0.1 °C/W): a fit early in its learning can say several times the true R, and a bound from
      it held a GPU's first raise back so that its cap turned twice
      (tests/coordinator/test_pace_fake_plants.py);
    * from the hold up, or NaN / unknown temperatures, infinite ceilings: the model's ceiling
      (the guard then holds or steps the GPU down).

    Why: the model's ceiling aims at the target at the end of the interval, so near the target it
    moves by ``e / ((1 - e) R)`` W per °C of reading (``e = exp(-interval / tau)``): 460 W per °C
    for R 0.085 °C/W and tau 40 s, 56 W for a fit of 0.072 °C/W and 4.6 s. NVML's whole-degree
    readings, sensor noise, or a single-pole fit of a die on a heat sink then made the caps of
    hot GPUs, and of their job-mates (who follow their pace), cycle by ~100 W every 2-5 intervals
    near the target (bench/thermal_ceiling.py, two-pole plant, whole degrees: 11.6 % of the
    GPU-intervals moved by more than 50 W; with the fit held at the prior 25.8 %). A single GPU
    capped at its ceiling (die 2 s / 0.035 °C/W on a sink 40 s / 0.05 °C/W, 7 fits x 2 inlets x
    3 kinds of reading x 3 seeds, intervals 150-300: bench/thermal_ceiling.py --single-gpu):
    moves > 50 W in 111 of 126 runs before (up
    to every interval), in none after; the hottest temperature 85.8 -> 83.6 °C (target 82 °C,
    slowdown 87 °C)."""
    temp, slowdown = c["temp_c"], c["slowdown_temp_c"]
    with np.errstate(invalid="ignore"):
        target = slowdown - margin_c
        known = (slowdown > 0) & np.isfinite(ceiling) & np.isfinite(temp)
        band = known & (temp >= target - NEAR_BAND_FRACTION * margin_c) & (temp < slowdown - HOLD_MARGIN_FRACTION * margin_c)
        below = known & (temp < target - NEAR_BAND_FRACTION * margin_c) & (r_c_per_w > 0)
    if not band.any() and not below.any():
        return ceiling
    step = NEAR_STEP_FRACTION * np.maximum(hi_w - lo_w, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        drop = step * (1.0 + DROP_STEPS_PER_C * np.maximum(temp - target, 0.0))
        r_raise = np.minimum(np.where(below, r_c_per_w, 1.0), THERMAL_PRIOR["r_c_per_w"][0])
        rise = np.maximum(step, (target - temp) / r_raise)
    out = np.where(band, np.minimum(np.maximum(ceiling, acc_w - drop), acc_w + step), ceiling)
    return np.where(below, np.minimum(out, acc_w + rise), out)


_REASON_BITS: dict = {}
"""Clocks-event-reason set (tuple) -> :func:`_reason_bits` (memo; bounded by :data:`_MEMO_MAX`)."""
_STATE_BITS: dict = {}
"""Cap state -> :func:`_state_bits` (memo; bounded by :data:`_MEMO_MAX`)."""
_MEMO_MAX = 4096
THERMAL_BITS = 3
"""``reason_codes(...) & THERMAL_BITS``: 2 ``HW_THERMAL_SLOWDOWN``, 1 another thermal slowdown, 0 none."""
PACE_SLOWDOWN_BIT = 4
"""A reason naming a slowdown (any ``*SLOWDOWN*``: the clock is not the cap's)."""
PACE_POWER_CAP_BIT = 8
"""A reason naming the power cap (any ``*POWER_CAP*``: the cap sets the clock)."""
UNCONTROLLABLE_BIT = 1
"""``state_codes``: a state of :data:`UNCONTROLLABLE_STATES`."""
OOB_BIT = 2
"""``state_codes``: ``OOB_LIMITED``."""


def _reason_bits(key: tuple) -> int:
    """The flags of one reason set (memoized, bounded): its thermal code (2 when it holds
    ``HW_THERMAL_SLOWDOWN``, 1 for another thermal slowdown, :func:`capctl.reasons.is_thermal`:
    ``SW_THERMAL_SLOWDOWN``; else 0) | :data:`PACE_SLOWDOWN_BIT` (a name containing ``SLOWDOWN``,
    any case) | :data:`PACE_POWER_CAP_BIT` (one containing ``POWER_CAP``)."""
    hit = _REASON_BITS.get(key)
    if hit is None:
        from capctl.reasons import is_thermal

        hit = 2 if "HW_THERMAL_SLOWDOWN" in key else 1 if is_thermal(key) else 0
        up = [r.upper() for r in key]
        if any("SLOWDOWN" in r for r in up):
            hit |= PACE_SLOWDOWN_BIT
        if any("POWER_CAP" in r for r in up):
            hit |= PACE_POWER_CAP_BIT
        if len(_REASON_BITS) >= _MEMO_MAX:
            _REASON_BITS.clear()
        _REASON_BITS[key] = hit
    return hit


def reason_codes(reasons) -> np.ndarray:
    """[G] int64: :func:`_reason_bits` of each GPU's reason set (``reasons``: a sequence of tuples or
    lists of names). One C-level pass over the memo when every set is known (the usual case: a
    fleet shows a few distinct sets), else one call per GPU that fills it. Measured (7 Dec 2026,
    bench/interval_cost.py's fleet, 8,000 GPUs, best of 21 in one process): the cap states' two
    generator passes and the reasons' two per-GPU memo calls (``thermal_guard``, ``_pace_columns``,
    a list of pairs) 0.56 -> 0.06 us a GPU with :func:`state_codes`."""
    n = len(reasons)
    try:
        return np.fromiter(map(_REASON_BITS.__getitem__, reasons), np.int64, n)
    except (KeyError, TypeError):  # a set not seen yet (or not a tuple): filled one by one
        return np.fromiter((_reason_bits(r if isinstance(r, tuple) else tuple(r)) for r in reasons), np.int64, n)


def _state_bits(state) -> int:
    """:data:`UNCONTROLLABLE_BIT` | :data:`OOB_BIT` of one cap state (memoized, bounded)."""
    hit = _STATE_BITS.get(state)
    if hit is None:
        hit = (UNCONTROLLABLE_BIT if state in UNCONTROLLABLE_STATES else 0) | (OOB_BIT if state == capstates.OOB_LIMITED else 0)
        if len(_STATE_BITS) >= _MEMO_MAX:
            _STATE_BITS.clear()
        _STATE_BITS[state] = hit
    return hit


def state_codes(states) -> np.ndarray:
    """[G] int64: :func:`_state_bits` of each GPU's cap state; one C-level pass over the memo (as
    :func:`reason_codes`)."""
    n = len(states)
    try:
        return np.fromiter(map(_STATE_BITS.__getitem__, states), np.int64, n)
    except (KeyError, TypeError):
        return np.fromiter(map(_state_bits, states), np.int64, n)


def _pace_columns(c, fixed: np.ndarray, fresh: np.ndarray, straggler: dict, codes: np.ndarray | None = None,
                  stale: np.ndarray | None = None) -> tuple:
    """``(pace, pace_at_w, paced, draw_w, pace_step)`` [G] of every GPU (see :class:`GpuInput` and
    :func:`_pace`): measured from a fresh sample of a GPU with a known maximum clock (else NaN, 0,
    False, 0, 0) that is not fixed, or is fixed with a live reading (``c["reading_live"]``, its node
    not ``stale`` [G]; None: no GPU fixed has one) of a busy GPU: held at its accounted cap
    (UNSUPPORTED_CONSTRAINTS, FOREIGN_WRITER, ...) it still runs at a measured pace, which bounds its
    job-mates' (:func:`coordinator.paceloop.pace_bound`; never ``paced``: no cap of the
    coordinator's moves it). Without a live reading (LOST, STALLED, a stale node) its pace is
    unknown: NaN. ``codes``: :func:`reason_codes` of ``c["reasons"]`` (None: computed)."""
    G = len(fixed)
    mx = c["max_sm_clock_mhz"]
    held = np.zeros(G, bool) if stale is None else (fixed & ~stale & c["have_reading"] & c["reading_live"]
                                                    & (c["utilization_pct"] >= 20.0) & (c["sm_clock_mhz"] > 0))
    has = (~fixed | held) & (mx > 0) & fresh
    with np.errstate(divide="ignore", invalid="ignore"):
        pace = np.where(has, np.clip(c["sm_clock_mhz"] / np.where(mx > 0, mx, 1.0), 0.0, 1.0), math.nan)
    pace_at = np.where(has, c["sample_enforced_w"], 0.0)
    pw = c["power_w"]
    draw = np.where(has & np.isfinite(pw) & (pw > 0), pw, 0.0)
    step = np.where(has, CLOCK_STEP_MHZ / np.where(mx > 0, mx, 1.0), 0.0)
    if codes is None:
        codes = reason_codes(c["reasons"])
    slowdown, power_cap = (codes & PACE_SLOWDOWN_BIT) != 0, (codes & PACE_POWER_CAP_BIT) != 0
    strag = np.zeros(G, bool)
    if straggler:
        strag[np.fromiter(straggler, np.int64, len(straggler))] = True
    # paced: the cap sets its clock (SW_POWER_CAP), or it runs at its maximum clock below its cap
    paced = (has & ~fixed & ~strag & (c["utilization_pct"] >= 20.0) & ~slowdown & (power_cap | (pace >= 0.99))
             & (pace > 0) & (pace_at > 0))
    return pace, pace_at, paced, draw, step


_JOBS_CACHE: list = [None, None, None, None]
"""[policy, topology, the nodes' bindings, (jobs, job names, job [G])] of the last :func:`_jobs_of`."""


def _jobs_of(table, policy) -> tuple[dict, list, np.ndarray]:
    """``(jobs, job_names, job)`` of the registry's GPU slots ``table`` (``GpuTable``): job id ->
    its policy weight, of the jobs bound to some GPU of ``table`` (a job whose GPUs are all unknown
    to the registry cannot be allocated); job ids in order of first GPU; [G] int each GPU's position
    in ``job_names`` (-1: idle). Fresh objects each call; computed again only when the policy, the
    topology or a node's bindings (compared by value) changed since the last call. Why: the
    per-GPU lookup of every node's jobs, every interval, for bindings that change at job start
    and end: measured (7 Dec 2026, bench/interval_cost.py's fleet, 8,000 GPUs, best of 21 in one
    process) 0.40 us a GPU computed, 0.02 when the bindings held."""
    sig = tuple([tuple(node.bindings.values()) for node in table.nodes])
    hit = _JOBS_CACHE
    if hit[0] is policy and hit[1] == table.topology and hit[2] == sig:
        jobs, names, job = hit[3]
        return dict(jobs), list(names), job.copy()
    jobs: dict[str, float] = {}
    weights: dict[tuple, float] = {}
    job_names: list[str] = []
    job_pos: dict[str, int] = {}
    job = np.full(len(table.keys), -1, np.int64)
    start = 0
    for (name, indices), node in zip(table.topology, table.nodes):
        job_of = _node_jobs(node, policy, jobs, weights)
        if job_of:
            for p, idx in enumerate(indices):
                jid = job_of.get(idx)
                if jid is not None:
                    q = job_pos.get(jid)
                    if q is None:
                        q = job_pos[jid] = len(job_names)
                        job_names.append(jid)
                    job[start + p] = q
        start += len(indices)
    # jobs whose GPUs are all unknown to the registry cannot be allocated
    jobs = {jid: w for jid, w in jobs.items() if jid in job_pos}
    _JOBS_CACHE[:] = [policy, table.topology, sig, (dict(jobs), list(job_names), job.copy())]
    return jobs, job_names, job


def _node_jobs(node, policy, jobs: dict[str, float], weights: dict[tuple, float]) -> dict[int, str]:
    """GPU index -> job id of ``node``'s bindings (:func:`coordinator.registry.gpu_jobs`: a GPU
    bound to several jobs is the first binding's); adds each new job's policy weight to ``jobs``
    (``weights`` caches them per (partition, account, qos))."""
    for b in node.bindings.values():
        if b.job_id not in jobs:
            wkey = (b.partition, b.account, b.qos)
            w = weights.get(wkey)
            if w is None:
                w = weights[wkey] = float(policy.job_weight(partition=b.partition or None, account=b.account or None,
                                                            qos=b.qos or None))
            jobs[b.job_id] = w
    return gpu_jobs(node.bindings.values())


CLOCK_STEP_MHZ = 15.0
"""SM clock step (MHz) of the pace measurements (coordinator.pacealign.CLOCK_STEP_MHZ: A100/H100
graphics clocks are 15 MHz apart)."""
PACE_FRESH_S = 10.0
"""A telemetry sample older than this (s) is not a pace measurement (several intervals at 1-5 s)."""
STRAGGLER_MARGIN = 1.05
"""A straggler's cap: its draw times this (+5 W): what it uses at its stuck clock, with room for noise."""
STRAGGLER_SAMPLES = 2
"""Consecutive busy samples in a hardware slowdown before a GPU is a straggler (one is a blip)."""


def straggler_reason(g, now_mono: float) -> str:
    """Why GPU ``g`` (:class:`coordinator.registry.GpuObs`) is a straggler, "" when it is not: its
    clock is held by a hardware slowdown no power cap lifts (:func:`coordinator.registry.stuck_slowdown`)
    in its last :data:`STRAGGLER_SAMPLES` fresh samples."""
    if g.slowdown_run < STRAGGLER_SAMPLES or now_mono - g.sample_mono > PACE_FRESH_S:
        return ""
    return (f"HW slowdown: SM clock held at {g.sm_clock_mhz} of {g.max_sm_clock_mhz} MHz at any cap "
            f"({', '.join(g.reasons)})")


def _oob_below_minimum(c, lo: np.ndarray, oob_now: np.ndarray, straggler: dict) -> list:
    """The GPUs an out-of-band limit holds below their minimum cap ``lo`` [G] (W; ``oob_now`` [G]:
    such a limit binds now, fresh sample): no cap the coordinator may plan moves their pace, so
    they are stragglers (added to ``straggler``, position -> reason; returned), held there, their
    job-mates paced to them. Planned at their minimum they were taken to reach the pace of 200 W
    while 5 W held them at 345 MHz: a job-mate stayed at 700 W and 1,980 MHz (found by a try-out)."""
    enforced = c["enforced_w"]
    out = []
    for i in np.nonzero(oob_now & (enforced < lo - OOB_TOLERANCE_W) & (c["max_sm_clock_mhz"] > 0))[0].tolist():
        if not straggler.get(i):
            straggler[i] = (f"out-of-band limit: enforced {enforced[i]:.0f} W, below its minimum cap {lo[i]:.0f} W "
                            f"(SM clock {c['sm_clock_mhz'][i]:.0f} of {c['max_sm_clock_mhz'][i]:.0f} MHz): no cap moves "
                            f"its pace")
            out.append(i)
    return out


def ceilings_w(rows, interval_s: float, margin_c: float) -> list[float]:
    """Thermal ceilings (W) of many GPUs in one vectorized call; ``rows`` are
    ``(temp_c, r_c_per_w, tau_s, inlet_c, slowdown_temp_c)``. Element-wise equal to
    :func:`ceiling_w`: +inf where the model is unusable (R, tau or the interval not positive, or
    a NaN result)."""
    a = np.asarray(rows, dtype=float).reshape(-1, 5)
    temp, r, tau, inlet, slowdown = a.T
    ok = (r > 0) & (tau > 0) & (float(interval_s) > 0)
    out = np.full(a.shape[0], math.inf)
    if ok.any():
        with np.errstate(all="ignore"):
            v = thermal_ceiling_w(temp[ok], inlet[ok], r[ok], tau[ok], interval_s, slowdown[ok], margin_c)
        out[ok] = np.where(np.isnan(v), math.inf, v)
    return out.tolist()


def solve(inputs: SolveInputs) -> SolveOutput:
    """Build the :class:`AllocationProblem` and solve it with the allocator's fast path.

    Raises ValueError (from the allocator) when the problem is malformed.
    """
    from capctl.allocator.fast import solve as fast_solve

    t0 = time.perf_counter()
    if not inputs.gpus:
        return SolveOutput({}, {}, {}, {}, {d["name"]: 0.0 for d in inputs.domains},
                           {d["name"]: 0.0 for d in inputs.domains}, {d["name"]: 0.0 for d in inputs.domains},
                           True, [], time.perf_counter() - t0, "none")
    problem = build_problem(inputs)
    result = fast_solve(problem)
    solve_s = time.perf_counter() - t0
    c = columns_of(inputs)
    keys = c.keys
    caps = np.where(c.fixed, c.accounted_w, np.asarray(result.cap_w, dtype=float))
    desired = dict(zip(keys, caps.tolist()))
    at = caps  # ``desired`` as an array [G], kept equal to it by the steps below (no dict read back each)
    aligned = paced_split(inputs, desired, at)
    step_margin(inputs, desired, aligned, at)
    grants = idle_from_headroom(inputs, desired, at)
    if inputs.spread_spare:
        spread_spare(inputs, desired, at)
    names = list(problem.job_names)
    job_rate = {n: float(result.job_rate[j]) for j, n in enumerate(names)}
    job_binding = {n: str(result.job_binding[j]) for j, n in enumerate(names)}
    slowest = {}
    for j, n in enumerate(names):
        s = int(result.slowest_gpu[j])
        slowest[n] = keys[s] if 0 <= s < len(keys) else None
        if 0 <= s < len(keys):
            job_binding[n] = observed_binding(job_binding[n], c, s)
    dnames = list(problem.domain_names)
    price = {n: float(result.domain_price[d]) for d, n in enumerate(dnames)}
    deficit = {n: float(result.domain_deficit_w[d]) for d, n in enumerate(dnames)}
    load = {n: float(result.domain_load_w[d]) for d, n in enumerate(dnames)}
    return SolveOutput(desired, job_rate, job_binding, slowest, price, deficit, load, bool(result.feasible),
                       _held_named(_reserve_named(_straggler_explained([str(a) for a in result.alerts], problem, c),
                                                  inputs.domains), inputs, c), solve_s,
                       getattr(result, "solver", "fast"), grants, at)


def _held_named(alerts: list[str], inputs: SolveInputs, c: InputColumns) -> list[str]:
    """``alerts`` with each domain deficit ("... below the sum of minimum caps ...") saying how much
    of those minimums are GPUs the coordinator holds at their accounted caps (``c.fixed``: a stale
    node's, no reading, an uncontrollable state): after a restart a stopped agent's node counted at
    its saved caps read as "minimum caps" it could not have (found by a try-out)."""
    if not any("below the sum of minimum caps" in a for a in alerts):
        return alerts
    pos = {k: i for i, k in enumerate(c.keys)}
    out = []
    for a in alerts:
        name = _alert_domain(a)
        if "below the sum of minimum caps" in a and name in inputs.domain_members:
            rows = [pos[k] for k in inputs.domain_members[name] if k in pos]
            held = [i for i in rows if c.fixed[i]]
            if held:
                held_w = float(np.sum(np.asarray(c.accounted_w, float)[held]))
                a += (f"; {held_w:.1f} W of them are {len(held)} GPU(s) held at their accounted caps (a stale node's, "
                      "no reading, a state the coordinator cannot move)")
        out.append(a)
    return out


def _alert_domain(alert: str) -> str:
    """The domain an allocator alert ``domain NAME: ...`` is about ("" for another alert)."""
    return alert[len("domain "):].split(":", 1)[0] if alert.startswith("domain ") else ""


NO_RATE_ALERT = ": a GPU's ceiling allows no positive predicted rate"
"""The allocator's alert of a job whose GPU's upper bound gives no positive rate on its curve
(capctl.allocator._core._rate_ranges): ``job <name>`` then this."""


def _straggler_explained(alerts: list[str], problem, c: InputColumns) -> list[str]:
    """``alerts`` without the :data:`NO_RATE_ALERT` of a job each of whose GPUs with no positive
    rate at its upper bound is a straggler (``c.straggler``): one held at its minimum cap because
    it draws less (a HW slowdown at 0.5 of its clock drew 153 W of a 200 W minimum), its flag the
    explanation; the alert read as a fault of its own (found by a try-out). Other jobs keep it."""
    if not c.straggler or not any(NO_RATE_ALERT in a for a in alerts):
        return alerts
    from capctl.allocator.curves import rate_unclamped

    hi = np.maximum(problem.min_cap_w, np.minimum(problem.max_cap_w, problem.thermal_ceiling_w))
    dark = rate_unclamped(hi, problem.curve_a, problem.curve_k_w, problem.curve_sat_w) <= 1e-9
    names = list(problem.job_names)
    explained = set()
    for j in set(problem.job_of_gpu[dark & (problem.job_of_gpu >= 0)].tolist()):
        culprits = np.nonzero(dark & (problem.job_of_gpu == j))[0].tolist()
        if all(c.straggler.get(i) for i in culprits):
            explained.add(f"job {names[j]}{NO_RATE_ALERT}")
    return [a for a in alerts if not any(a.startswith(e) for e in explained)]


def _reserve_named(alerts: list[str], domains: list[dict]) -> list[str]:
    """``alerts`` with a domain's limit, where watts of it are held for policy nodes that have
    not reported (:func:`with_reserve`: ``reserved_w``), written as the policy's limit less those:
    the allocator sees the lowered limit and said ``limit 0.0 W below the sum of minimum caps`` of
    a 2,400 W PDU (found by a try-out)."""
    held = {d["name"]: d for d in domains if d.get("reserved_w")}
    if not held:
        return alerts
    out = []
    for a in alerts:
        name = _alert_domain(a)
        d = held.get(name)
        if d is not None and f"domain {name}: limit " in a:
            r = float(d["reserved_w"])
            lim = float(d["limit_w"])
            a = a.replace(f"domain {name}: limit {lim:.1f} W",
                          f"domain {name}: limit {lim + r:.1f} W less {r:.1f} W held for policy nodes that have "
                          f"not reported = {lim:.1f} W", 1)
        out.append(a)
    return out


OOB_LIMIT = "oob_limit"
"""Binding of a job whose slowest GPU is held below its cap by another limiter (out-of-band)."""
HELD = "held"
"""Binding of a job whose slowest GPU the coordinator holds at its accounted cap (LOST, STALLED,
unusable constraints, a stale node, ...: :data:`UNCONTROLLABLE_STATES`)."""


def observed_binding(binding: str, c: InputColumns, s: int) -> str:
    """The binding of a job as the devices show it: the allocator names the upper bound of the
    job's slowest GPU ``s`` (a position in ``c``) "device_max" / "device_min", but where that bound
    is an out-of-band limit (``c.oob_w``) it is :data:`OOB_LIMIT`, and where the coordinator holds
    the GPU at its accounted cap (``c.fixed``) :data:`HELD`; any other binding is returned as is."""
    if binding not in ("device_max", "device_min"):
        return binding
    if bool(c.fixed[s]):
        return HELD
    if c.oob_w is not None and math.isfinite(float(c.oob_w[s])):
        return OOB_LIMIT
    return binding




def values_at(values: dict, keys, default: float = 0.0) -> np.ndarray:
    """[G] float: ``values[k]`` (W) of each key of ``keys`` (a GPU without one: ``default``). One
    C-level pass when every key has a value (the solve's ``desired`` covers every GPU of its
    inputs: measured 0.15 -> 0.04 us a GPU at 100,000), else a lookup with the default."""
    n = len(keys)
    try:
        return np.fromiter(map(values.__getitem__, keys), float, n)
    except KeyError:
        return np.fromiter((values.get(k, default) for k in keys), float, n)


def paced_split(inputs: SolveInputs, desired: dict, at: np.ndarray | None = None) -> set:
    """Apply the pace loop (:func:`coordinator.paceloop.job_caps`, what
    :func:`coordinator.paceloop.correct` does per job) to ``desired`` (GPU key -> W) in place, job
    by job, keeping a job's correction only when every limited domain stays within its limit
    (domain sums on arrays: :func:`domain_levels`). Returns the jobs put on one clock step whose
    caps were kept (for :func:`step_margin`). ``at``: ``desired`` as an array [G] of the inputs'
    GPUs (:attr:`SolveOutput.desired_at`), changed with it; None: read from it. On the columns, per job (no row
    per GPU): measured on bench/interval_cost.py's fleet at 8,000 GPUs (7 Dec 2026), see
    :func:`_pace_jobs`."""
    from coordinator import paceloop

    limited, levels = domain_levels(inputs)
    c = columns_of(inputs)
    n = len(limited)
    lims = np.array([lim for _, lim in limited], float)
    d = values_at(desired, c.keys) if at is None else at
    load = _domain_sums(levels, d, n)
    head = lims - load - LIMIT_SLACK_W
    aligned: list = []
    moved: list = []
    for name, p, a in _pace_jobs(c, _pace_candidates(c, inputs.jobs).tolist()):
        # every GPU's clock is set by its cap (measured): the job can use the headroom the solve
        # left in all its limited domains; granted job by job, so no domain is counted twice; then
        # its grant is taken back and what it really moves is booked per domain, so the watts it
        # leaves go to the jobs after it
        mine, grant = _grant_w(head, levels[p]) if n else (None, 0.0)
        caps, on_step = paceloop.job_caps(a, sum(d[p].tolist()), grant)
        if on_step:
            aligned.append(name)
        if mine is not None:
            head[mine] += grant
        if caps is not None:
            if n:
                head[:] -= _domain_sums(levels[p], caps - d[p], n)
            order = np.r_[np.flatnonzero(a.straggler), np.flatnonzero(~a.straggler)]  # the caps' order
            order = order[~c.fixed[p[order]]]  # a held GPU keeps its accounted cap: the loop sends it nothing
            moved.append((name, p[order], caps[order]))
    if not moved:
        return set()
    for name, p, caps in moved:
        delta = _domain_sums(levels[p], caps - d[p], n) if n else np.zeros(0)
        if bool(np.all(load + delta <= lims + 1e-6)):
            desired.update(zip(map(c.keys.__getitem__, p.tolist()), caps.tolist()))
            if at is not None:
                at[p] = caps
            load += delta
        else:
            aligned = [j for j in aligned if j != name]
    return set(aligned)


def _grant_w(head: np.ndarray, levels: np.ndarray) -> tuple:
    """The headroom (W) one job may add: the least of ``head`` [n] (W left per limited domain) over
    its GPUs' domains (``levels`` [m, depth], :func:`domain_levels` rows), never below 0, taken
    from ``head`` in place. Returns ``(its domains, grant)``: ``(None, 0.0)`` in none."""
    mine = np.unique(levels)
    mine = mine[mine >= 0]
    if not mine.size:
        return None, 0.0
    grant = max(0.0, float(head[mine].min()))
    head[mine] -= grant
    return mine, grant


def _pace_jobs(c: InputColumns, cand: list) -> list:
    """``(job name, positions [n], paceloop.JobGpus)`` of each job the pace loop moves, of the
    candidate GPUs ``cand`` (positions, ascending; :func:`_pace_candidates`), in the order
    :func:`coordinator.paceloop.correct` takes them (by their first GPU; GPUs ascending), from
    column slices (:func:`paceloop.job_arrays` per job, no per-GPU attribute reads). A job is kept
    on ``correct``'s condition (two GPUs or more, all paced or stragglers and not fixed, or fixed
    with a measured pace, one paced).
    Why not rows (:class:`GpuInput`, :func:`coordinator.paceloop.correct`) per GPU: measured (7 Dec
    2026, bench/interval_cost.py's fleet, 8,000 GPUs, 2,300-2,600 of them candidates; with the
    clock-step alignment on arrays, :func:`coordinator.pacealign.align_caps`) the pace stage 2.6 ->
    1.1 us a GPU of the fleet (median of 3 runs each, one host; 3.5 -> 1.2 while it was loaded)."""
    from coordinator import paceloop

    if not cand:
        return []
    pos = np.asarray(cand, np.int64)
    job = c.job[pos]
    order = np.argsort(job, kind="stable")
    pos = pos[order]
    strag = np.zeros(len(c.job), bool)
    strag[[p for p, why in c.straggler.items() if why]] = True  # a reason: ``GpuInput.straggler`` is true
    strag = strag[pos]
    cols = [np.asarray(a, float)[pos] for a in (c.pace, c.pace_at_w, c.observed_w, c.draw_w, c.pace_step,
                                                c.min_cap_w, c.max_cap_w, c._slopes(), c.thermal_ceiling_w)]
    f, at_w, obs, draw, step, lo, mx, meas, thermal = cols
    paced, fixed = np.asarray(c.paced, bool)[pos], np.asarray(c.fixed, bool)[pos]
    bound = paceloop.pace_bound(strag, fixed, f)  # stragglers and held GPUs with a pace: ``JobGpus.straggler``
    starts = np.flatnonzero(np.r_[True, np.diff(job[order]) != 0]).tolist() + [len(pos)]
    out = []
    for a, b in zip(starts, starts[1:]):
        g = slice(a, b)
        if b - a < 2 or not np.all(((paced[g] | strag[g]) & ~fixed[g]) | (bound[g] & fixed[g])) or not paced[g].any():
            continue
        j = paceloop.job_arrays(f[g], at_w[g], draw[g], meas[g], lo[g], mx[g], thermal[g])
        out.append((int(pos[a]), c.job_names[int(job[order[a]])], pos[g],
                    paceloop.JobGpus(f[g], at_w[g], obs[g], draw[g], step[g], lo[g], mx[g], bound[g], j)))
    out.sort(key=operator.itemgetter(0))
    return [x[1:] for x in out]


def _pace_candidates(c: InputColumns, jobs) -> np.ndarray:
    """Positions of the GPUs of the jobs :func:`coordinator.paceloop.correct` may move: a job of
    ``jobs`` with two GPUs or more, all not fixed and paced or stragglers, or fixed with a measured
    pace (:func:`coordinator.paceloop.pace_bound`), one at least paced (the condition ``correct``
    skips every other job by; the rows handed to it are only these)."""
    j = c.job
    if not len(j) or not len(c.job_names):
        return np.zeros(0, np.int64)
    from coordinator import paceloop

    m = len(c.job_names)
    strag = np.zeros(len(j), bool)
    if c.straggler:
        strag[np.fromiter(c.straggler, np.int64, len(c.straggler))] = True
    held = paceloop.pace_bound(np.zeros(len(j), bool), c.fixed, c.pace)  # (fixed: the stragglers are not)
    busy = j >= 0
    jb = j[busy]
    count = np.bincount(jb, minlength=m)
    good = np.bincount(jb, weights=(((c.paced | strag) & ~c.fixed) | held)[busy], minlength=m)
    paced = np.bincount(jb, weights=c.paced[busy], minlength=m)
    listed = np.fromiter((name in jobs for name in c.job_names), bool, m)
    ok = listed & (count >= 2) & (good == count) & (paced > 0)
    return np.nonzero(busy & ok[np.maximum(j, 0)])[0]


def idle_from_headroom(inputs: SolveInputs, desired: dict, at: np.ndarray | None = None) -> dict:
    """Raise idle GPUs toward their pre-job limit (``GpuInput.idle_target_w``, W) out of the
    headroom the solve left, in place on ``desired`` (GPU key -> W). Returns the raw grants (GPU
    key -> W) of the idle GPUs it could raise; each GPU's cap is the lower of its raw grant and
    its grants of the last intervals (``InputColumns.idle_recent_w``, :mod:`coordinator.idlegrants`:
    a raise waits until the headroom held), never below the solve's cap.

    The rule (docs/policy.md, "Idle GPUs"): with ``idle_cap_w: null`` the solve sees an idle GPU at
    its minimum cap, so running jobs under the same domains get every watt they can use; what is
    left in a domain (``limit_w - sum(desired)`` of its members) no running job can use, and only
    that goes back to its idle GPUs, in proportion to what each still lacks, with the grant of a GPU
    the smallest of its domains' ratios, so no domain ever exceeds its limit. Passes repeat
    (water-filling, at most :data:`IDLE_PASSES`) over the GPUs still short and not under a full
    domain, so what one domain cannot take goes to idle GPUs under the others (found by a try-out:
    100 W of a 3,600 W budget left unallocated beside a PDU with room, one pass). With headroom
    enough (as at a job's end under a budget that allows it) every pre-job limit comes back fully.
    Domain sums on arrays (:func:`domain_levels`). ``at``: ``desired`` as an array (:attr:`SolveOutput.desired_at`)."""
    c = columns_of(inputs)
    keys = c.keys
    G = len(keys)
    d = values_at(desired, keys) if at is None else at.copy()
    # within its thermal ceiling (thermal_guard: a hot idle GPU is not raised; found by a review)
    t = np.where(c.idle_target_w > 0, np.minimum(c.idle_target_w, np.maximum(c.min_cap_w, c.thermal_ceiling_w)), 0.0)
    rows = np.nonzero((t > 0) & ~c.fixed & (c.job < 0) & (t > d + 1e-6))[0]
    if not rows.size:
        return {}
    candidates = rows  # (the passes below narrow ``rows``)
    limited, levels = domain_levels(inputs)
    n = len(limited)
    start = d.copy()
    if n:
        lims = np.array([lim for _, lim in limited])
        for _ in range(IDLE_PASSES):  # water-filling: what a full domain's GPUs cannot take goes on
            want_w = (t - d)[rows]
            w = np.zeros(G)
            w[rows] = want_w
            wanted = _domain_sums(levels, w, n)
            head = lims - _domain_sums(levels, d, n)
            # all of it when it fits (a budget equal to the pre-job limits' sum restores them
            # exactly), else in proportion, LIMIT_SLACK_W below the limit (float rounding)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(head >= wanted - 1e-9, 1.0,
                                 np.minimum(1.0, np.maximum(0.0, (head - LIMIT_SLACK_W) / wanted)))
            ratio = np.append(np.where(wanted > 0, ratio, 1.0), 1.0)  # index -1 (padding): no limit
            factor = ratio[levels[rows]].min(axis=1) if levels.shape[1] else np.ones(len(rows))
            factor = np.minimum(factor, 1.0)
            d[rows] += want_w * factor
            # a GPU under a full domain (factor 0) or given all it lacked drops out of the next pass
            rows = rows[(factor > 0) & (factor < 1.0)]
            if not rows.size or float((want_w * factor).sum()) < IDLE_PASS_MIN_W:
                break
    else:
        d[rows] = t[rows]
    grants = dict(zip([keys[i] for i in candidates.tolist()], d[candidates].tolist()))
    if c.idle_recent_w is not None:  # a raise only with headroom that held (coordinator.idlegrants)
        d = np.maximum(start, np.minimum(d, c.idle_recent_w))
    moved = np.nonzero(d != start)[0]
    for i, v in zip(moved.tolist(), d[moved].tolist()):
        desired[keys[i]] = v
    if at is not None:
        at[moved] = d[moved]
    return grants


IDLE_PASSES = 8
"""Most water-filling passes of :func:`idle_from_headroom` (each within every domain's limit)."""
IDLE_PASS_MIN_W = 0.01
"""A pass that grants less than this in all (W) ends the water-filling."""


LIMIT_SLACK_W = 0.01
"""Watts kept unallocated in each domain by :func:`idle_from_headroom` (float rounding)."""


def step_margin(inputs: SolveInputs, desired: dict, aligned, at: np.ndarray | None = None) -> None:
    """Hand the headroom left after the pace loop to the GPUs of the ``aligned`` jobs (put on one
    clock step by :func:`paced_split`) as margin within their step, in place on ``desired`` (GPU
    key -> W); before :func:`idle_from_headroom` (running jobs first, the policy's idle rule).

    The alignment gives a job the watts of the highest whole clock step it can afford and no more
    (:mod:`coordinator.pacealign`); what is left once every job has taken its step buys no job a
    step (each was offered it), so it would sit unallocated (or go to idle GPUs while a job is
    capped): up to one step's power per GPU of the last job (measured: 15 W of a 2,400 W budget
    over 8 GPUs, tests/coordinator/test_real_agents.py). Here it raises each aligned GPU's cap toward
    :func:`coordinator.pacealign.step_top_w` (7/8 of its step: no GPU reaches the next step), in
    proportion to that room, one pass with each GPU's grant the smallest of its limited domains'
    ratios (as :func:`idle_from_headroom`): no domain exceeds its limit, and the clocks (so draw
    and pace) stay where the alignment put them, with more margin against draw noise. ``at``:
    ``desired`` as an array (:attr:`SolveOutput.desired_at`)."""
    from coordinator import pacealign

    limited, levels = domain_levels(inputs)
    n = len(limited)
    if not aligned or not n or not levels.shape[1]:
        return
    c = columns_of(inputs)
    keys = c.keys
    jobs = np.array([name in aligned for name in c.job_names] + [False])
    strag = np.zeros(len(keys), bool)
    if c.straggler:
        strag[np.fromiter(c.straggler, np.int64, len(c.straggler))] = True
    rows = np.nonzero(jobs[c.job] & ~c.fixed & ~strag & c.paced)[0]
    if not rows.size:
        return
    d = values_at(desired, keys) if at is None else at.copy()
    hi = np.maximum(c.min_cap_w, np.minimum(c.max_cap_w, np.where(np.isfinite(c.thermal_ceiling_w),
                                                                 c.thermal_ceiling_w, np.inf)))[rows]
    top = pacealign.step_top_w(c.pace[rows], c.pace_step[rows], c.draw_w[rows], c.pace_at_w[rows],
                               pacealign.STATIC_FRACTION * c.max_cap_w[rows], d[rows])
    room = np.zeros(len(keys))
    room[rows] = np.maximum(np.minimum(top, hi) - d[rows], 0.0)
    wanted = _domain_sums(levels, room, n)
    head = np.array([lim for _, lim in limited]) - _domain_sums(levels, d, n) - LIMIT_SLACK_W
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(wanted > 0, np.clip(head / wanted, 0.0, 1.0), 1.0)
    factor = np.append(ratio, 1.0)[levels[rows]].min(axis=1)  # index -1 (padding): no limit
    for i, r, f in zip(rows.tolist(), room[rows].tolist(), factor.tolist()):
        if r * f > 0.0:
            desired[keys[i]] += r * f
            if at is not None:
                at[i] = desired[keys[i]]


SPARE_PASSES = 3
"""Water-filling passes of :func:`spread_spare` (each within every domain's limit)."""


def spread_spare(inputs: SolveInputs, desired: dict, at: np.ndarray | None = None) -> None:
    """Hand the headroom every limited domain still has after the solve, the pace loop,
    :func:`step_margin` and the idle rule (:func:`idle_from_headroom`: pre-job limits come back
    first, from headroom no running job's pace can use) to the running jobs' GPUs, up to their
    ceilings, in place on ``desired`` (GPU key -> W); the policy's ``spread_spare_watts``.

    Why: the solve and the pace loop leave watts unallocated where the models say no job's pace can
    use them: every job paced by a GPU held at its ceiling (thermal, device maximum), or on the flat
    part of its curve. Those predictions rest on what NVML shows (SM clock, power); a GPU slower at
    the same clock (what NVML does not show: ``capctl sim``'s ``gpus.speed``, a curve the model has
    wrong) is then held below what the budget allows while the watts sit unused (small-4x8, seed 9:
    capctl 0.985 of uniform, 1.042 with the watts spread; docs/policy.md "Spare watts"). Raising the GPUs that are not at
    their ceiling costs no job anything (a GPU's rate never falls with its cap) and no domain goes
    over its limit. Left out: fixed GPUs, stragglers and their job-mates (their pace is measured
    and does not respond to power: the watts would buy nothing), the job-mates of fixed GPUs with
    a measured pace (:func:`coordinator.paceloop.pace_bound`, the same), GPUs at their ceiling (the
    thermal ceiling is a safety bound). Each pass grants every eligible GPU its room
    (``ceiling - cap``, the ceiling also bounded by the policy's ``slew_w`` above the GPU's cap now;
    none under a domain already full) times the smallest ratio
    ``headroom / wanted`` of its limited domains (as :func:`step_margin`), so no domain exceeds its
    limit; the next passes hand out what a domain bounded by a fuller one left (up to
    :data:`SPARE_PASSES`, fewer when a pass grants less than :data:`IDLE_PASS_MIN_W`). Cost: a few
    array operations over the running GPUs per pass. ``at``: ``desired`` as an array (:attr:`SolveOutput.desired_at`)."""
    from coordinator import paceloop

    limited, levels = domain_levels(inputs)
    n = len(limited)
    if not n or not levels.shape[1]:
        return
    c = columns_of(inputs)
    keys = c.keys
    strag_jobs = {int(c.job[i]) for i in c.straggler} if c.straggler else set()
    strag_jobs.update(c.job[paceloop.pace_bound(np.zeros(len(keys), bool), c.fixed, c.pace)].tolist())  # held
    ok = (c.job >= 0) & ~c.fixed
    if strag_jobs:
        ok &= ~np.isin(c.job, np.fromiter(strag_jobs, np.int64, len(strag_jobs)))
    rows = np.nonzero(ok)[0]
    if not rows.size:
        return
    d = values_at(desired, keys) if at is None else at.copy()
    ceiling = np.where(np.isnan(c.thermal_ceiling_w), np.inf, c.thermal_ceiling_w)  # (-inf: too hot, none)
    hi = np.maximum(c.min_cap_w, np.minimum(c.max_cap_w, ceiling))[rows]
    if inputs.slew_w is not None:  # the policy's largest change per interval, from the cap now
        hi = np.minimum(hi, np.asarray(c.observed_w, float)[rows] + float(inputs.slew_w))
    lims = np.array([lim for _, lim in limited])
    lv = levels[rows]
    before = d[rows].copy()
    for _ in range(SPARE_PASSES):
        head = lims - _domain_sums(levels, d, n) - LIMIT_SLACK_W
        open_ = np.append(head > 0.0, True)[lv].all(axis=1)  # a GPU under a full domain wants nothing
        room = np.zeros(len(keys))
        room[rows] = np.where(open_, np.maximum(hi - d[rows], 0.0), 0.0)
        wanted = _domain_sums(levels, room, n)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(wanted > 0, np.clip(head / wanted, 0.0, 1.0), 1.0)
        grant = room[rows] * np.append(ratio, 1.0)[lv].min(axis=1)
        if float(grant.sum()) < IDLE_PASS_MIN_W:
            break
        d[rows] += grant
    for i, old, new in zip(rows.tolist(), before.tolist(), d[rows].tolist()):
        if new > old:
            desired[keys[i]] = new
            if at is not None:
                at[i] = new


def build_problem(inputs: SolveInputs):
    """The :class:`~capctl.allocator.problem.AllocationProblem` of ``inputs``, built from its
    columns (:func:`columns_of`; the same arrays :meth:`AllocationProblem.build` would make from
    one spec dict per GPU: curve None -> the H100 default, no ceiling -> +inf, fixed GPUs without a
    previous cap). Raises ValueError for an unknown job or domain, or a malformed value."""
    from capctl.allocator.problem import AllocationProblem

    c = columns_of(inputs)
    keys = c.keys
    job_items = [(str(k), float(v)) for k, v in inputs.jobs.items()]
    job_index = {n: i for i, (n, _) in enumerate(job_items)}
    dom_index, parent, limit = domain_tree(inputs.domains)
    job_of, dom_of = _gpu_indices(c, job_index, dom_index)
    ceiling = c.thermal_ceiling_w
    return AllocationProblem(
        min_cap_w=c.min_cap_w.astype(float), max_cap_w=c.max_cap_w.astype(float),
        thermal_ceiling_w=np.where(np.isfinite(ceiling), ceiling, math.inf),
        curve_a=c.curve_a, curve_k_w=c.curve_k_w, curve_sat_w=c.curve_sat_w, curve_min_w=c.curve_min_w,
        speed=c.speed.astype(float), job_of_gpu=job_of,
        prev_cap_w=np.where(c.fixed, math.nan, c.observed_w), idle_cap_w=c.idle_cap_w.astype(float),
        domain_of_gpu=dom_of,
        job_weight=np.array([w for _, w in job_items], float),
        domain_parent=np.array(parent, dtype=np.int64), domain_limit_w=np.array(limit, float),
        objective=inputs.objective, slew_w=None if inputs.slew_w is None else float(inputs.slew_w),
        gpu_names=_GpuNames(keys), job_names=tuple(n for n, _ in job_items),
        domain_names=tuple(str(d["name"]) for d in inputs.domains),
        domain_kinds=tuple(str(d.get("kind", "")) for d in inputs.domains),
    ).validate()


class _GpuNames(collections.abc.Sequence):
    """``AllocationProblem.gpu_names`` of GPU keys: ``"node/index"``, made when read (alerts,
    explain) instead of one string per GPU per interval."""

    def __init__(self, keys: tuple) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(f"{n}/{x}" for n, x in self._keys[i])
        n, x = self._keys[i]
        return f"{n}/{x}"

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))


def _curves(gpus: list[GpuInput]) -> list:
    """The rate curve of every GPU: its model's, the H100 default when None, or built from a dict
    (``a``, ``k_w``, ``sat_w``, optional ``valid_min_w``; W). Raises KeyError/ValueError for a
    malformed dict."""
    from capctl.allocator.curves import DEFAULT_CURVES, CurveParams

    default_curve = DEFAULT_CURVES["H100"]
    curves = []
    for g in gpus:
        c = g.curve
        if c is None:
            c = default_curve
        elif isinstance(c, dict):
            c = CurveParams(float(c["a"]), float(c["k_w"]), float(c["sat_w"]), float(c.get("valid_min_w", g.min_cap_w)))
        curves.append(c)
    return curves


def _gpu_indices(c: InputColumns, job_index: dict, dom_index: dict) -> tuple[np.ndarray, np.ndarray]:
    """Job position (-1: idle) and domain position of every GPU of the columns ``c``. Raises
    ValueError naming the first GPU with an unknown job or domain."""
    jmap = np.array([job_index.get(str(n), -2) for n in c.job_names] + [-1], np.int64)
    job_of = jmap[c.job]  # -1 (idle) indexes the appended -1
    if (job_of == -2).any():
        i = int(np.nonzero(job_of == -2)[0][0])
        raise ValueError(f"gpus[{c.keys[i][0]}/{c.keys[i][1]}].job: unknown job {c.job_names[int(c.job[i])]!r}")
    dmap = np.array([dom_index.get(n, -1) for n in c.domain_names] or [0], np.int64)
    dom_of = dmap[c.domain] if len(c.domain) else np.zeros(0, np.int64)
    if (dom_of < 0).any():
        i = int(np.nonzero(dom_of < 0)[0][0])
        raise ValueError(f"gpus[{c.keys[i][0]}/{c.keys[i][1]}].domain: unknown domain "
                         f"{c.domain_names[int(c.domain[i])]!r}")
    return job_of, dom_of


def maximum_draw_w(inputs: SolveInputs) -> float:
    """Watts the cluster may draw at most (W): live GPUs at their maximum limit, fixed ones at their
    accounted cap, and what is counted for policy nodes that have not reported
    (``reserved_w``, :func:`unreported_reserve`); 0 with no GPU known."""
    if not len(inputs.gpus):
        return 0.0
    c = columns_of(inputs)
    return float(np.sum(np.where(c.fixed, c.accounted_w, c.max_cap_w))) + float(sum(inputs.reserved_w.values()))


def minimum_needed_w(inputs: SolveInputs) -> float:
    """Watts the cluster needs at least: live GPUs at their minimum cap, fixed ones at their
    accounted cap (what a budget below would leave in deficit)."""
    if not len(inputs.gpus):
        return 0.0
    c = columns_of(inputs)
    return float(np.sum(np.where(c.fixed, c.accounted_w, c.min_cap_w)))
