"""The coordinator's decision step: observations -> desired caps -> two-phase plans (pure).

A reconcile interval splits into a decision and its I/O, the way a controller-runtime
``Reconcile`` does. This module is the decision: plain functions of immutable values, no
registry, stream, store, logger or clock. :mod:`coordinator.observe` takes the snapshot on the
event loop; :meth:`coordinator.loop.Coordinator.tick` sends what is decided here.

Stages (the loop runs the first in a worker thread, then re-reads the fleet's state, as the
acknowledgements that arrived during the solve change what is accounted):

1. :func:`solve` (:class:`Problem` -> :class:`Solution`): the allocation
   (:func:`coordinator.allocation.solve`: problem built from the snapshot, solved with the fast
   path); desired caps (W) per GPU; every cap held at its accounted value when the solve fails;
   configuration alerts (:func:`watch_alerts`).
2. :func:`plan` (:class:`Solution`, :class:`Observations` -> :class:`Decision`): failsafe caps
   (:func:`coordinator.planner.safe_caps_arrays` from ``min(desired, accounted)``), the phase-1
   decreases (:func:`coordinator.planner.plan_decreases_arrays`), the nodes that may get an
   increase, the holds and why.
3. :func:`plan_increases` (:class:`Decision`, :class:`FleetState` read after the phase-1
   acknowledgements -> caps): phase 2, increases within each domain's headroom as accounted then.

:func:`decide` runs stages 1 and 2 on one snapshot. Same observations, same decision (the solve is
deterministic); with the fleet at its desired caps (within :data:`coordinator.planner.DEADBAND_W`)
the decision holds only. Units: watts (W), seconds (s) on the registry's monotonic clock.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping

import numpy as np

from coordinator import allocation, planner

GpuKey = tuple[str, int]

APPLY = "apply"
"""Decision mode: phase-1 decreases now, phase-2 increases after the acknowledgements."""
HOLD = "hold"
"""Decision mode: every live node gets a hold plan (lease renewal, safe caps), no cap."""
DRY_RUN = "dry-run"
"""Decision mode: every live node gets a ``dry_run`` hold plan: no cap, no safe cap."""

REPLACED_WINDOW_S = 60.0
REPLACED_MAX = 3
"""More than ``REPLACED_MAX`` replacements of a node's open stream within ``REPLACED_WINDOW_S``
seconds raise the "two agents claim node X?" alert (an agent restart replaces it once)."""
CLOCK_AHEAD_ALERT_FRACTION = 0.5
"""A node whose agent's clock is ahead of the coordinator's lease clock by this fraction of the
lease or more is named in an alert (:func:`watch_alerts`): at a whole lease every plan arrives after
its expiry (nodeagent.lease.late_s); half leaves room for transit and jitter before that."""
LATE_FRACTION = 0.9
"""A node whose clock is this fraction of the lease ahead or more is said to take every plan late
(:func:`_clock_alerts`): the lead is measured on reports, whose transit shortens it a little."""


# -- observations ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NodeState:
    """One node as the registry knows it at one instant (s on the registry's monotonic clock)."""

    name: str
    gpus: int  # GPUs its agent registered
    connected: bool  # an AgentLink stream is open
    stale: bool  # no report within the lease, or no stream
    any_reading: bool  # some GPU has a valid read-back
    connected_s: float  # when the open stream said hello

    @property
    def live(self) -> bool:
        """Connected and reporting within the lease: the node gets plans."""
        return self.connected and not self.stale


@dataclasses.dataclass(frozen=True)
class FleetState:
    """The registry's accounting at ``now`` (s), for planning.

    ``gpus``: every GPU of the problem still known, in problem order, as read-only
    :class:`~coordinator.planner.PlanArrays` (W) whose ``desired_w`` is a placeholder (the
    accounted cap); ``live`` = node live and GPU not fixed. ``pos[i]``: position of ``gpus.keys[i]``
    in the problem's GPU list. ``nodes``: every node, sorted by name (empty in a state read for
    :func:`plan_increases`, which reads only the GPUs).
    """

    now: float
    nodes: tuple[NodeState, ...]
    gpus: planner.PlanArrays = dataclasses.field(compare=False)
    pos: np.ndarray = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class Problem:
    """What the solve reads, taken at one instant: the policy, the allocator's inputs (accounted
    caps, limit constraints, the models' rate curves and thermal ceilings, W) and the facts of the
    configuration alerts (node -> GPU count; node -> stream replacements within
    :data:`REPLACED_WINDOW_S`). Nothing here may be mutated."""

    policy: object
    inputs: allocation.SolveInputs = dataclasses.field(compare=False)
    node_gpus: Mapping[str, int] = dataclasses.field(default_factory=dict)
    replacements: Mapping[str, int] = dataclasses.field(default_factory=dict)
    clock_ahead: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """Node -> (s its agent's clock is ahead of the coordinator's lease clock, the lease s), the
    nodes at or above :data:`CLOCK_AHEAD_ALERT_FRACTION` of the lease (coordinator.observe.clocks_ahead)."""
    own_clock: tuple[float, float] | None = None
    """(s the coordinator's lease clock is behind its host's wall clock, the lease s), or None."""


@dataclasses.dataclass(frozen=True)
class Observations:
    """Everything one decision reads: the problem, the fleet's state and the settings in force
    (lease and interval in s; ``start_s``: the coordinator's start on the registry clock, which
    opens the startup hold)."""

    problem: Problem
    state: FleetState
    dry_run: bool
    lease_s: float
    interval_s: float
    start_s: float
    limits_changed: bool = False  # the policy (its limits) changed in the last few intervals, or a domain
    # was counted above its limit in the last planner.OVER_AGAIN_TICKS intervals: exact decreases

    @property
    def now(self) -> float:
        """The instant of the fleet's state (s, registry clock)."""
        return self.state.now

    @property
    def policy(self):
        return self.problem.policy


# -- results -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Solution:
    """Stage 1: desired caps (W) per GPU key of the problem and the alerts so far.

    ``out`` is None when the solve failed (``error`` says why; ``desired_w`` is then every GPU's
    accounted cap). ``watch``: the configuration alerts as ``((kind, node), text)`` pairs.
    ``desired_at``: ``desired_w`` aligned with the problem's GPU list (NaN where none).
    """

    desired_w: Mapping[GpuKey, float]
    alerts: tuple[str, ...]
    watch: tuple[tuple[tuple[str, str], str], ...]
    error: str = ""
    out: allocation.SolveOutput | None = dataclasses.field(default=None, compare=False)
    desired_at: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one interval does (W; node names; GPU indices).

    * ``mode``: :data:`APPLY`, :data:`HOLD` (solve failed, or a node waits for its first
      telemetry) or :data:`DRY_RUN`; ``hold_reasons`` says why caps or increases are held.
    * ``desired_w``: the desired cap of every GPU of the fleet's state (the solve's, else its
      accounted cap); stale nodes' and uncontrollable GPUs' are their accounted caps.
    * ``safe_caps``: live node -> GPU index -> failsafe cap, sent with every plan to that node.
    * ``decreases``: phase 1, node -> GPU index -> lower cap (nodes sorted; empty unless APPLY).
    * ``increase_candidates``: nodes with a GPU whose desired cap is above its read-back by more
      than the deadband (phase 2 may raise it); empty under the startup hold.
    * ``early_holds``: live nodes with neither a decrease nor a candidate GPU (APPLY only): held
      before the phase-1 wait.
    * ``live_nodes``: the nodes that get a plan (sorted); ``waiting``: connected nodes without a
      first reading; ``hold_increases``: the startup hold is on.
    """

    now: float
    mode: str
    desired_w: Mapping  # GPU key -> W (a KeyedValues)
    safe_caps: dict
    decreases: dict
    increase_candidates: frozenset
    early_holds: tuple
    live_nodes: tuple
    waiting: tuple
    hold_increases: bool
    hold_reasons: tuple
    alerts: tuple
    solution: Solution = dataclasses.field(compare=False, repr=False)
    gpus: planner.PlanArrays = dataclasses.field(compare=False, repr=False)
    domains: tuple = dataclasses.field(compare=False, repr=False)
    doms: list = dataclasses.field(compare=False, repr=False)
    counted_over: bool = False  # some domain counted above its limit (planner.counted_over), APPLY only

    def safe_for(self, node: str) -> dict[int, float]:
        """The failsafe caps (W) sent to ``node`` (empty when it has no live GPU)."""
        return self.safe_caps.get(node, {})


# -- stage 1 -----------------------------------------------------------------------------------
def watch_alerts(policy, node_gpus: Mapping[str, int], replacements: Mapping[str, int],
                 clock_ahead: Mapping[str, tuple[float, float]] | None = None,
                 own_clock: tuple[float, float] | None = None) -> dict:
    """Configuration alerts, ``(kind, node[, form]) -> text``, in a stable order:

    * a node with GPUs that the policy's domain tree does not list: placed under the root
      (``Policy.domain_path``), it counts against the cluster budget only, outside every
      PDU/rack limit it may really be under;
    * a node whose open stream was replaced more than :data:`REPLACED_MAX` times within
      :data:`REPLACED_WINDOW_S` seconds: two agents (two hosts, or a copied ``--node``) claiming
      the same node take its stream in turns;
    * the clocks (:func:`_clock_alerts`): a node whose agent's clock is ahead of the coordinator's
      lease clock by half the lease or more (``clock_ahead``: node -> (s ahead, lease s)), and the
      coordinator's own lease clock behind its host's wall clock by as much (``own_clock``: (s
      behind, lease s)).
    """
    found = _config_alerts(policy, node_gpus, replacements)
    found.update(_clock_alerts(clock_ahead or {}, own_clock))
    return found


def _clock_alerts(clock_ahead: Mapping[str, tuple[float, float]], own_clock: tuple[float, float] | None) -> dict:
    """The clock alerts of :func:`watch_alerts`. A plan's lease expiry is a Unix time of the
    coordinator's lease clock (its host's wall clock at its start, advanced by its monotonic
    clock), so a node whose clock is a lease ahead (:data:`LATE_FRACTION` of it: a report's transit
    makes the lead look a little shorter) takes every plan as late, only where it lowers a GPU
    (docs/protocol.md, "Leases and failsafe"): its GPUs stay at their failsafe caps. The key names
    the form (every plan late, or only a delayed one), so a change of form is logged again. When
    the coordinator's lease clock is itself behind its host's clock (the host's clock was set
    after the coordinator started, or the host was suspended), every node looks ahead and the fix
    is a coordinator restart, not the nodes' clocks (found by a try-out: the alert kept asking to
    synchronize clocks that agreed)."""
    found: dict = {}
    behind_s, own_lease_s = own_clock if own_clock is not None else (0.0, math.inf)
    own_off = behind_s >= CLOCK_AHEAD_ALERT_FRACTION * own_lease_s
    if own_off:
        found[("clock", "coordinator")] = (
            f"the coordinator's lease clock is {behind_s:.1f} s behind its host's clock (lease {own_lease_s:g} s): its "
            "host's clock was set after it started, or the host was suspended; every node's clock then looks ahead "
            "and its plans reach the agents late (only decreases applied) — restart the coordinator")
    for name, (ahead_s, lease_s) in sorted(clock_ahead.items()):
        late = ahead_s >= LATE_FRACTION * lease_s
        fix = ("restart the coordinator (its lease clock is behind, above), then check this node's clock" if own_off
               else "synchronize the clocks of the coordinator's host and the node (NTP)")
        found[("clock", name, "late" if late else "delayed")] = (
            f"node {name}: its clock is {ahead_s:.1f} s ahead of the coordinator's (lease {lease_s:g} s): "
            + ("every plan reaches its agent after its lease expiry: only decreases are applied and its GPUs stay "
               "at their failsafe caps" if late else
               f"a plan delayed by more than {lease_s - ahead_s:.1f} s reaches its agent after its lease expiry "
               "(only its decreases applied)")
            + f" — {fix}")
    return found


def _config_alerts(policy, node_gpus: Mapping[str, int], replacements: Mapping[str, int]) -> dict:
    """The unlisted-node and replaced-stream alerts of :func:`watch_alerts`."""
    listed = set(policy.domains.all_nodes())
    found: dict = {}
    for name in sorted(node_gpus):
        if name not in listed and node_gpus[name]:
            found[("unlisted", name)] = (
                f"node {name} is not in the policy: counted only against the cluster budget, outside every "
                "PDU/rack limit — fix the policy or the agent's --node")
    for name, n in sorted(replacements.items()):
        if n > REPLACED_MAX:
            found[("replaced", name)] = (f"two agents claim node {name}? its stream was replaced {n} times in "
                                         f"{REPLACED_WINDOW_S:.0f} s")
    return found


def solve(problem: Problem) -> Solution:
    """Stage 1: solve ``problem`` (any thread). A malformed problem (ValueError, ArithmeticError
    from the allocator) is not raised: the solution then holds every GPU at its accounted cap
    (W) and says why in ``error`` and ``alerts``."""
    watch = tuple(watch_alerts(problem.policy, problem.node_gpus, problem.replacements, problem.clock_ahead,
                               problem.own_clock).items())
    alerts = [text for _, text in watch]
    inputs = problem.inputs
    try:
        out = allocation.solve(inputs)
    except (ValueError, ArithmeticError) as exc:
        alerts.append(f"solve failed: {exc}; caps held")
        c = allocation.columns_of(inputs)
        desired = dict(zip(c.keys, c.accounted_w.tolist()))
        return Solution(desired, tuple(alerts), watch, error=str(exc), out=None,
                        desired_at=np.asarray(c.accounted_w, float).copy())
    alerts.extend(out.alerts)
    desired = out.desired_w
    keys = allocation.columns_of(inputs).keys
    kept = out.desired_at
    at = kept.copy() if kept is not None and len(kept) == len(keys) else allocation.values_at(desired, keys, math.nan)
    return Solution(desired, tuple(alerts), watch, out=out, desired_at=at)


# -- stage 2 -----------------------------------------------------------------------------------
_SPECS: list = [None, None, ()]
"""[domains, members, their specs] of the last :func:`domain_specs` (the objects kept: compared by identity)."""


def domain_specs(inputs: allocation.SolveInputs) -> tuple[planner.DomainSpec, ...]:
    """The planner's domains of ``inputs`` (a limit that is None or not finite: none). The same
    (immutable) specs again while ``inputs`` holds the same domain and member objects as the last
    call (:func:`coordinator.allocation.build_inputs` shares them between intervals while the
    policy and topology hold: one spec per node domain, every interval, before: 0.09 -> 0.00 us a
    GPU at 8,000, 7 Dec 2026, best of 21 in one process)."""
    members = inputs.domain_members
    if _SPECS[0] is inputs.domains and _SPECS[1] is members:
        return _SPECS[2]
    out = []
    for d in inputs.domains:
        lim = d["limit_w"]
        out.append(planner.DomainSpec(d["name"], d.get("kind", ""),
                                      None if lim is None or not math.isfinite(lim) else float(lim),
                                      frozenset(members.get(d["name"], ()))))
    _SPECS[:] = [inputs.domains, members, tuple(out)]
    return _SPECS[2]


def with_desired(solution: Solution, state: FleetState) -> planner.PlanArrays:
    """``state.gpus`` with the solution's desired caps (W); a GPU without one keeps its accounted cap."""
    pa = state.gpus
    if solution.desired_at is not None and len(solution.desired_at):
        d = solution.desired_at[state.pos]
        desired = np.where(np.isnan(d), pa.accounted_w, d)
    else:
        desired = np.array([solution.desired_w.get(k, a) for k, a in zip(pa.keys, pa.accounted_w.tolist())], float)
    return dataclasses.replace(pa, desired_w=desired)


def unreported_nodes(policy, nodes: tuple[NodeState, ...]) -> list[str]:
    """Nodes the policy lists that have no GPU in the registry (no hello, no ledger entry), sorted."""
    known = {n.name for n in nodes if n.gpus}
    return sorted(name for name in policy.domains.all_nodes() if name not in known)


def _holds(obs: Observations, solution: Solution, unreported: list | None = None) -> tuple[str, tuple, bool, list[str]]:
    """``(mode, waiting nodes, startup hold on, hold reasons)`` of ``obs`` (``unreported``: its
    :func:`unreported_nodes`, None: read here).

    A node that just said hello has not reported its caps yet (counted at its maximum limit): every
    cap is held until its first telemetry (at most one interval) instead of squeezing the others for
    a moment. Startup hold: policy nodes whose agents have not reported may be enforcing anything up
    to their maximum limit; until they report, or one lease after the start, no cap is raised."""
    now = obs.now
    waiting = tuple(n.name for n in obs.state.nodes
                    if n.connected and n.gpus and not n.any_reading and now - n.connected_s < obs.interval_s)
    if unreported is None:
        unreported = unreported_nodes(obs.policy, obs.state.nodes)
    hold_increases = bool(unreported) and now - obs.start_s < obs.lease_s
    reasons = []
    if obs.dry_run:
        reasons.append("dry run: nothing is applied")
    if solution.out is None:
        reasons.append(f"solve failed: {solution.error}")
    if waiting:
        reasons.append(f"waiting for the first telemetry of {', '.join(waiting)}")
    if hold_increases:
        reasons.append(f"startup hold: {len(unreported)} policy node(s) have not reported")
    mode = DRY_RUN if obs.dry_run else HOLD if (solution.out is None or waiting) else APPLY
    return mode, waiting, hold_increases, reasons


def _unreported_alert(unreported: list[str], hold_increases: bool, reserved_w: dict) -> list[str]:
    """The alert of the policy nodes ``unreported`` (names), ``reserved_w`` (node -> W counted for
    it, :func:`coordinator.allocation.unreported_reserve`)."""
    if not unreported:
        return []
    head = (f"{len(unreported)} policy node(s) have not reported ({', '.join(unreported[:5])}"
            f"{', ...' if len(unreported) > 5 else ''}): ")
    counted = sorted({round(reserved_w[n]) for n in unreported if n in reserved_w})
    if counted:
        watts = f"{counted[0]} W" if len(counted) == 1 else f"{counted[0]}-{counted[-1]} W"
        tail = (f"each counted at {watts} (the most it may draw: the policy's gpus_per_node at the maximum limit "
                "of its gpu_model, or of the known GPUs when it names none capctl knows; at least the largest "
                "known node's draw) until it reports or is removed from the policy")
    else:
        tail = "not counted: no node has reported its limits yet and the policy declares none"
    return [head + ("no cap is raised until they report or one lease has passed; " if hold_increases else "") + tail]


def _deficit_alerts(out, alerts=()) -> list[str]:
    """One alert per domain whose minimum caps exceed its limit, unless ``alerts`` (the solver's)
    already name that domain's deficit (the allocator's "limit ... below the sum of minimum caps")."""
    if out is None:
        return []
    said = {a.split(":", 1)[0] for a in alerts if "below the sum of minimum caps" in a}
    return [f"domain {name}: minimum caps exceed its limit by {deficit:.0f} W"
            for name, deficit in out.domain_deficit_w.items() if deficit > 0 and f"domain {name}" not in said]


class KeyedValues(Mapping):
    """A read-only mapping GPU key -> value of ``keys`` [G] and ``values`` [G] (an array, not
    copied: the caller's read-only or no longer changed), made a ``dict`` on first use: a
    decision's desired caps, read by tests and tools, not by the interval (a dict of every GPU
    per interval before: 0.06 us a GPU at 8,000, 7 Dec 2026, best of 21 in one process)."""

    def __init__(self, keys, values) -> None:
        self._keys, self._values, self._dict = keys, values, None

    def _d(self) -> dict:
        if self._dict is None:
            self._dict = dict(zip(self._keys, np.asarray(self._values, float).tolist()))
        return self._dict

    def __getitem__(self, key):
        return self._d()[key]

    def __iter__(self):
        return iter(self._d())

    def __len__(self) -> int:
        return len(self._d())

    def __repr__(self) -> str:
        return repr(self._d())


def by_node(keys, positions, values) -> dict[str, dict[int, float]]:
    """``{node: {index: value}}`` of ``keys[p]`` for ``p`` in ``positions`` (in that order). (Built
    per run of a node's positions with numpy it measured slower: 0.10 -> 0.19 us a GPU at 8,000,
    7 Dec 2026.)"""
    out: dict[str, dict[int, float]] = {}
    for i, v in zip(positions, values):
        n, x = keys[i]
        out.setdefault(n, {})[x] = v
    return out


def _candidate_nodes(pa: planner.PlanArrays) -> frozenset:
    """Nodes with a live GPU whose clamped desired cap is above its read-back by more than the
    deadband: the candidate rule of :func:`coordinator.planner.plan_increases_arrays`."""
    target = np.minimum(np.maximum(pa.desired_w, pa.min_cap_w), np.where(pa.max_cap_w > 0, pa.max_cap_w, np.inf))
    cand = np.nonzero(pa.live & ~(target <= pa.observed_w + planner.DEADBAND_W))[0].tolist()
    return frozenset(map(_FIRST, map(pa.keys.__getitem__, cand)))


_FIRST = operator.itemgetter(0)


def _domain_index(inputs: allocation.SolveInputs, domains, state: FleetState) -> list:
    """:func:`coordinator.planner.domain_index` of the fleet state's GPUs: the problem's cached
    positions when the state holds every GPU of the problem (none left since), else rebuilt."""
    pos = state.pos
    if len(pos) == len(inputs.gpus) and (not len(pos) or (pos[0] == 0 and pos[-1] == len(pos) - 1)):
        return allocation.limited_positions(inputs)  # pos is strictly increasing: the identity
    return planner.domain_index(domains, state.gpus.keys)


def plan(solution: Solution, obs: Observations) -> Decision:
    """Stage 2: the decision of ``solution`` on the fleet's state ``obs`` (see :class:`Decision`).

    Phase 1 lowers every live GPU whose desired cap is below its accounted cap by more than the
    deadband; failsafe caps keep every domain within its limit if every agent falls back at once.
    Stale nodes get nothing (their GPUs are fixed at their accounted caps in the problem)."""
    pa = with_desired(solution, obs.state)
    keys = pa.keys
    inputs = obs.problem.inputs
    domains = domain_specs(inputs)
    doms = _domain_index(inputs, domains, obs.state)
    live_pos = np.nonzero(pa.live)[0]
    safe = planner.safe_caps_arrays(np.minimum(pa.desired_w, pa.accounted_w), pa, doms,
                                    obs.policy.failsafe.safe_cap_w)
    safe_caps = by_node(keys, live_pos.tolist(), np.asarray(safe)[live_pos].tolist())  # (one list, no generator)
    unreported = unreported_nodes(obs.policy, obs.state.nodes)
    mode, waiting, hold_increases, reasons = _holds(obs, solution, unreported)
    live_nodes = tuple(n.name for n in obs.state.nodes if n.live)
    decreases: dict = {}
    candidates: frozenset = frozenset()
    early: tuple = ()
    over = False
    if mode == APPLY:
        over = planner.counted_over(pa, doms)
        sel, caps_w = planner.plan_decreases_arrays(pa, doms=doms, exact_over=obs.limits_changed)
        decreases = dict(sorted(by_node(keys, sel.tolist(), caps_w.tolist()).items()))
        candidates = frozenset() if hold_increases else _candidate_nodes(pa)
        early = tuple(n for n in live_nodes if n not in decreases and n not in candidates)
    alerts = (list(solution.alerts)
              + _unreported_alert(unreported, hold_increases, inputs.reserved_w)
              + [f"two agents claim node {n}: {why}; the refused agent's GPUs counted at "
                 f"{inputs.reserved_w.get(n, 0.0):.0f} W more until it stops trying" for n, why in sorted(inputs.claims.items())]
              + [f"node {n}: {len(u)} GPU(s) its agent no longer lists ({', '.join(u[:2])}{', ...' if len(u) > 2 else ''}; "
                 f"swapped out, or another agent took the name while its own was down): counted at their last "
                 f"caps, {w:.0f} W, until a hello lists them again or for 24 h" for n, (w, u) in sorted(inputs.ghosts.items())]
              + _deficit_alerts(solution.out, solution.alerts))
    return Decision(
        now=obs.now, mode=mode, desired_w=KeyedValues(keys, pa.desired_w), safe_caps=safe_caps,
        decreases=decreases, increase_candidates=candidates, early_holds=early, live_nodes=live_nodes,
        waiting=waiting, hold_increases=hold_increases, hold_reasons=tuple(reasons), alerts=tuple(alerts),
        solution=solution, gpus=pa, domains=domains, doms=doms, counted_over=over,
    )


def decide(obs: Observations) -> Decision:
    """Stages 1 and 2 on one snapshot: ``plan(solve(obs.problem), obs)`` (pure; idempotent)."""
    return plan(solve(obs.problem), obs)


# -- stage 3 -----------------------------------------------------------------------------------
def plan_increases(decision: Decision, state: FleetState) -> dict[GpuKey, float]:
    """Phase 2: the caps (W) to raise, key -> cap, on ``state`` read after the phase-1
    acknowledgements; granted within every domain's headroom ``limit_w - sum(accounted_w)``
    (an unacknowledged decrease still counts at its higher value). Empty unless the decision is
    :data:`APPLY` without the startup hold."""
    if decision.mode != APPLY or decision.hold_increases:
        return {}
    pa = with_desired(decision.solution, state)
    doms = decision.doms if pa.keys == decision.gpus.keys else planner.domain_index(decision.domains, pa.keys)
    sel, caps_w = planner.plan_increases_arrays(pa, doms)
    return dict(zip(map(pa.keys.__getitem__, sel.tolist()), caps_w.tolist()))


def increases_by_node(increases: Mapping[GpuKey, float]) -> dict[str, dict[int, float]]:
    """``{node: {index: cap W}}`` of :func:`plan_increases`' result."""
    out: dict[str, dict[int, float]] = {}
    for (n, i), c in increases.items():
        caps = out.get(n)
        if caps is None:
            caps = out[n] = {}
        caps[i] = c
    return out
