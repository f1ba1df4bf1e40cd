"""Observed state of the cluster, as reported by the node agents (soft state).

Everything here is rebuilt from the agents after a coordinator restart: the GPUs and their limit
constraints come from ``AgentHello``, the job bindings from ``AgentHello.jobs`` plus
``JobStarted``/``JobEnded``, the readings from ``NodeTelemetry`` and the enforced read-backs from
``CapAck`` (see docs/protocol.md).

The registry is owned by the coordinator's asyncio event loop: only coroutines running on that loop
read or write it (no locks). Other threads (the Prometheus exporter) read the immutable views that
the reconcile loop publishes (:mod:`coordinator.view`).

Accounting rule (docs/protocol.md, "Two-phase apply"): a GPU counts against its power domains at
the highest cap it may be enforcing right now, :meth:`GpuObs.accounted_w`::

    max(latest enforced read-back, latest requested limit read back, caps sent but not yet
        acknowledged, the latest acknowledged read-back if younger than ``ack_memory_s``)

The last term covers a telemetry sample taken before an increase was applied but delivered after
its acknowledgement. The requested limit counts too: a GPU held below its request by an
out-of-band limit enforces the request the instant that limit lifts (found with the journal: a
340 W request booked at its 250 W enforced limit put a 3,600 W cluster at 3,690 W for 0.74 s when
the out-of-band limit was cleared). A GPU with no reading yet counts at its maximum limit (``max_cap_w``).

A GPU reported ``FOREIGN_WRITER`` counts at least at its maximum limit (or a higher limit read back
while in that state: ``foreign_w``, :func:`foreign_mark`), until its state has
been clear for :data:`FOREIGN_HOLD_S`: the agent re-writes such a GPU down to capctl's cap at most
once per its re-write period, and the other writer puts it back within its own period; counted at
the re-write, the freed watts went to other GPUs and the foreign writer's next write put the
cluster over its budget (found with the journal: 5,202.7 W on a 4,800 W budget for 1.06 s after
every re-write, 30 s apart).

Per interval the decision path reads the GPUs as columns, not record by record:
:meth:`Registry.gpu_table` gives the GPU slots (nodes by name, GPUs by index, cached per
topology) and :mod:`coordinator.gpucolumns` reads the fields of every slot into one array per
field (``GpuObs`` has slots: a field read is a pointer chase, not a dict lookup).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import operator
import time
import typing

import numpy as np

from capctl import capstates, devicedata, readings
from capctl.readings import R_INDEX
from capctl.reasons import classify as classify_reasons  # the one definition of the reason classes
from coordinator.gpucolumns import FOREIGN_HOLD_S
from coordinator.throttle import LANE_BITS, WINDOW_S, NodeThrottle

log = logging.getLogger("capctl.coordinator.registry")

THROTTLE_WINDOW_S = WINDOW_S
"""Window of the throttling time fractions, in seconds (:mod:`coordinator.throttle`)."""
NODE_FORGET_S = 86400.0
"""A node outside the policy whose agent has not been heard of for this long (s) is forgotten: no
longer counted (it counted only against the cluster budget). A node of the policy never is
(:meth:`coordinator.registry.Registry.forget_silent`): a dead agent's GPUs keep their caps."""
OOB_LIMITED = capstates.OOB_LIMITED
FOREIGN_WRITER = capstates.FOREIGN_WRITER
OOB_TOLERANCE_W = 1.0
"""An enforced limit this far or more below the requested one is another limit binding (W; the
agent's ``OOB_LIMITED`` tolerance, nodeagent.caps.ENFORCED_TOLERANCE_W); the registry's OOB memory
and the allocation (coordinator.allocation) share it."""


@dataclasses.dataclass
class Binding:
    """One job bound to GPUs on one node (from ``JobBinding``)."""

    job_id: str
    node: str
    gpu_indices: tuple[int, ...]
    user: str = ""
    partition: str = ""
    account: str = ""
    qos: str = ""
    start_time_s: float = 0.0

    @classmethod
    def from_proto(cls, msg, node: str | None = None) -> "Binding":
        """Build from a ``capctl.v1.JobBinding``; ``node`` overrides an empty ``msg.node``."""
        return cls(
            job_id=msg.job_id,
            node=msg.node or (node or ""),
            gpu_indices=tuple(sorted(set(int(i) for i in msg.gpu_indices))),
            user=msg.user,
            partition=msg.partition,
            account=msg.account,
            qos=msg.qos,
            start_time_s=msg.start_time_s,
        )


def gpu_jobs(bindings) -> dict[int, str]:
    """GPU index -> job id of one node's ``bindings`` (its :class:`Binding` objects in the order
    the registry holds them, ``NodeObs.bindings.values()``; a reversible collection: a dict's
    values, a list, a tuple). Idle GPUs are left out.

    A GPU bound to several jobs (a shared or MIG GPU, or overlapping reports) is the FIRST
    binding's: the coordinator's one rule of a GPU's job, for its energy
    (:meth:`Registry._record_gpus`), :meth:`Registry.job_of`, the solver inputs
    (``coordinator.allocation``) and the models' job of a GPU (``coordinator.models``)."""
    return {i: b.job_id for b in reversed(bindings) for i in b.gpu_indices}  # (the first one written last)


class Sample(typing.NamedTuple):
    """One telemetry sample of one GPU, kept for the online models (W, degC, MHz, s).

    ``GpuObs.new_samples`` holds a GPU's samples as tuples in this field order: a ``Sample``, or
    the plain tuple of its fields that :meth:`Registry._record_gpus` appends (the models read them
    by position, ``coordinator.models.S_*``). Why: a ``Sample`` built per GPU per report cost
    0.29 us, its plain tuple 0.06 us; the models read one interval's tuples as columns (measured
    7 Dec 2026, 2-core host)."""

    time_s: float
    power_w: float
    enforced_w: float
    temp_c: float
    sm_clock_mhz: float
    reasons: tuple[str, ...]
    utilization_pct: float
    memory_utilization_pct: float = math.nan  # NVML's memory utilization (%); NaN: not reported


@dataclasses.dataclass(slots=True)
class GpuObs:
    """Observed state of one GPU: static facts (``GpuInfo``) and the latest readings.

    Units: watts, degrees Celsius, MHz, joules, seconds (``*_mono`` are ``time.monotonic()``).
    """

    node: str
    index: int
    uuid: str = ""
    name: str = ""
    min_cap_w: float = 0.0
    max_cap_w: float = 0.0
    default_cap_w: float = 0.0
    slowdown_temp_c: float = 0.0
    shutdown_temp_c: float = 0.0
    max_sm_clock_mhz: int = 0
    pre_job_cap_w: float = 0.0
    # latest readings (telemetry or ack read-back, by order of arrival)
    have_reading: bool = False
    # the latest sample was a valid reading (False from a sample or read-back without one, e.g.
    # LOST / STALLED / ERROR, until the next valid sample): power, temperature, clock and reasons
    # are live; the caps keep counting at their last known values either way
    reading_live: bool = False
    power_w: float = 0.0
    cap_w: float = 0.0  # requested limit as read back
    enforced_w: float = 0.0  # enforced limit as read back
    temp_c: float = 0.0
    sm_clock_mhz: int = 0
    reasons: tuple[str, ...] = ()
    utilization_pct: float = 0.0
    memory_utilization_pct: float = math.nan  # nvmlUtilization_t.memory (%); NaN: not reported
    energy_j: float = 0.0
    job_id: str = ""
    cap_state: str = ""
    error: str = ""
    # accounting
    pending: dict[int, float] = dataclasses.field(default_factory=dict)  # plan seq -> cap sent (W)
    last_ack_w: float = 0.0
    last_ack_mono: float = -1e18
    safe_cap_w: float = 0.0  # the last safe cap sent (W)
    new_samples: list[Sample] = dataclasses.field(default_factory=list)
    # the latest telemetry sample's enforced limit (W) and time (mono s): the operating point its
    # SM clock was measured at (an ack may have changed ``enforced_w`` since)
    sample_enforced_w: float = 0.0
    sample_mono: float = -1e18
    slowdown_run: int = 0  # consecutive busy samples in a slowdown power cannot lift (HW, not thermal)
    # the last reading held below its request by an out-of-band limit: its enforced limit (W) and
    # when (mono s); the allocation keeps it within that limit for a while after the request came
    # down to it (then the device can no longer show the limit: enforced == requested)
    oob_w: float = math.nan
    oob_mono: float = -1e18
    # the foreign-writer mark (W): the maximum limit, or a higher limit read back, while the GPU was
    # FOREIGN_WRITER (NaN: none; foreign_mark), and since when (mono s) its state has been clear (inf: still FOREIGN_WRITER): counted
    # until FOREIGN_HOLD_S after that (accounted_w, foreign_mark)
    foreign_w: float = math.nan
    foreign_clear_mono: float = -1e18

    @property
    def key(self) -> tuple[str, int]:
        """``(node, index)``: the GPU's identity in the coordinator."""
        return (self.node, self.index)

    @property
    def constraints_problem(self) -> str:
        """What is wrong with the limit constraints its agent reported ("" when usable;
        :func:`capctl.devicedata.constraints_problem`): such a GPU is held at its limit."""
        return _constraints_problem(self.min_cap_w, self.max_cap_w)

    def accounted_w(self, now_mono: float, ack_memory_s: float) -> float:
        """The highest cap this GPU may be enforcing now (W); see the module docstring. Without a
        reading: its maximum limit (with unusable constraints: the highest value it reported)."""
        if not self.have_reading:
            if self.constraints_problem:  # no board takes more than MAX_SANE_LIMIT_W (a 1e12 W "max")
                return min(max(self.min_cap_w, self.max_cap_w, self.default_cap_w), devicedata.MAX_SANE_LIMIT_W)
            return self.max_cap_w
        value = self.enforced_w
        if self.cap_w > value:  # the request read back: enforced as soon as an out-of-band limit lifts
            value = self.cap_w
        pending = self.pending
        if pending:
            top = max(pending.values())
            if top > value:  # == max(value, top), without a call (hot: 8 per GPU per interval)
                value = top
        if now_mono - self.last_ack_mono <= ack_memory_s:
            ack = self.last_ack_w
            if ack > value:
                value = ack
        foreign = self.foreign_w  # (NaN: no mark; NaN > value is False)
        if foreign > value and now_mono - self.foreign_clear_mono <= FOREIGN_HOLD_S:
            value = foreign
        return value


@dataclasses.dataclass
class NodeObs:
    """Observed state of one node and its agent session."""

    name: str
    gpus: dict[int, GpuObs] = dataclasses.field(default_factory=dict)
    bindings: dict[str, Binding] = dataclasses.field(default_factory=dict)
    simulated: bool = False
    agent_version: str = ""
    packed_plans: bool = False  # its agent reads packed plan caps (AgentHello.packed_plans, capctl.plancaps)
    driver_version: str = ""
    last_report_mono: float = -1e18  # hello or telemetry
    last_telemetry_mono: float = -1e18
    last_telemetry_seq: int = 0
    session: object | None = None  # coordinator.server.AgentSession while connected
    connected_mono: float = -1e18
    next_seq: int = 1  # next plan seq to this node (per coordinator incarnation)
    seen_s: float = 0.0  # Unix time of the last message from its agent (or from the node ledger)
    seen_mono: float = 0.0  # the same on the registry's monotonic clock (immune to wall-clock jumps)
    ghosts: dict = dataclasses.field(default_factory=dict)
    """GPUs its agent no longer lists: UUID -> (W counted, since: mono s, index) (Registry._hello_gpus)."""
    throttle: NodeThrottle = dataclasses.field(default_factory=NodeThrottle)
    """Its GPUs' throttling over the last minute (:mod:`coordinator.throttle`; by GPU index)."""
    clock_ahead_s: float = math.nan
    """How far its agent's wall clock was ahead of the coordinator's lease clock at its latest
    report (s: the report's ``timestamp_s`` less the lease clock at receipt, transit included;
    negative: behind; NaN: not known). Set by the coordinator (:meth:`coordinator.loop.Coordinator.note_clock`)."""

    @property
    def connected(self) -> bool:
        """True while an AgentLink stream to this node's agent is open."""
        return self.session is not None

    def stale(self, now_mono: float, lease_s: float) -> bool:
        """True when the node sent no report within the lease or its stream is closed."""
        return self.session is None or (now_mono - self.last_report_mono) > lease_s


@functools.lru_cache(maxsize=1024)
def _constraints_problem(min_w: float, max_w: float) -> str:
    """:func:`capctl.devicedata.constraints_problem`, memoized (a pure function of two floats,
    asked for every GPU several times an interval; a cluster has a handful of distinct pairs)."""
    return devicedata.constraints_problem(min_w, max_w)


_MAX_W = devicedata.MAX_SANE_LIMIT_W
_INF = math.inf
_MIN_W = devicedata.MIN_SANE_LIMIT_W
"""Limit constraints with ``_MIN_W <= min <= max <= _MAX_W`` are usable for sure
(:func:`capctl.devicedata.constraints_problem`): the readings' loops ask the memo only for others
(its call, a tuple of two floats hashed, cost ~0.1 us a GPU a report; measured 7 Dec 2026)."""
_MAX_ENERGY_J = 1e18
"""Largest energy counter taken (J): NVML's counter is a uint64 of mJ (1.8e16 J); more is no counter."""
ENERGY_SLACK_S = 5.0
"""An energy counter may grow by at most ``MAX_SANE_LIMIT_W x (s since its last value + this)``
between two reports (s: the reports' receipt times jitter); a larger jump is a counter that
jumped (a reset to another base, bad device data): not charged to the job, the next delta is."""


def bad_limits_detail(index: int, enforced_w: float, cap_w: float) -> str:
    """Why a read-back of GPU ``index`` with limits ``enforced_w`` / ``cap_w`` (W) is not a
    reading: a limit no board enforces (not finite, negative, or above
    :data:`capctl.devicedata.MAX_SANE_LIMIT_W`); the GPU keeps counting at its last known caps."""
    return (f"GPU {index}: enforced limit {enforced_w!r} W, requested limit {cap_w!r} W read from the device: "
            f"need 0 < enforced <= {_MAX_W:g} W and 0 <= requested <= {_MAX_W:g} W; not taken as a reading "
            f"(counted at its last known limits)")


def foreign_mark(g: GpuObs, cap_w: float, enforced_w: float, now_mono: float) -> None:
    """Update ``g``'s foreign-writer mark from a valid reading (requested ``cap_w`` and enforced
    ``enforced_w`` limits, W) at ``now_mono`` (s), ``g.cap_state`` already set from it. Called
    while the GPU is ``FOREIGN_WRITER`` or its mark has no clear time yet (``foreign_clear_mono``
    inf). FOREIGN_WRITER: the mark is raised to the GPU's maximum limit (``g.max_cap_w``) or the
    reading's higher limit if above it (a mark expired :data:`FOREIGN_HOLD_S` after an earlier
    clear state starts again) and held; any other state: the mark's clear time starts now (it
    counts :data:`FOREIGN_HOLD_S` more).

    Why the maximum limit, not the highest value read: the other writer may set any limit up to
    it at any time, and its value is seldom seen at all, since the agent re-writes the GPU as
    it detects the writer, often before a report samples the foreign value (the mark then started
    at capctl's own re-write, the foreign 700 W was counted only at the writer's next write: 3,150 W
    on a 2,800 W cluster, tests/coordinator/test_foreign_writer_budget.py)."""
    if g.cap_state != FOREIGN_WRITER:
        g.foreign_clear_mono = now_mono
        return
    top = cap_w if cap_w > enforced_w else enforced_w
    if g.max_cap_w > top:
        top = g.max_cap_w
    mark = g.foreign_w
    if g.foreign_clear_mono != _INF and not now_mono - g.foreign_clear_mono <= FOREIGN_HOLD_S:
        mark = math.nan  # an earlier episode's mark, expired
    g.foreign_w = mark if mark >= top else top
    g.foreign_clear_mono = _INF


def held_detail(min_w: float, max_w: float, state: str, error: str) -> str:
    """The detail of a GPU the coordinator holds as ``UNSUPPORTED_CONSTRAINTS`` because its
    agent's hello reported unusable limit constraints ``(min_w, max_w)`` (W), whatever the agent
    reports now: its cap state ``state`` and why (``error``). The agent's own text when it reports
    the same state (it tells what it reads now); else the hello's constraints and the agent's
    current state, so that the detail follows the state (never the text of one it left)."""
    if state == capstates.UNSUPPORTED_CONSTRAINTS and error:
        return error
    problem = _constraints_problem(min_w, max_w).replace("read from the device", "reported by the agent at its start")
    now = f"; the agent reports {state}" + (f": {error}" if error else "") if state else ""
    return (f"{problem}: held and counted at its current limit until the agent is restarted and reads them "
            f"again{now}")


_REASON_FLAGS: dict[tuple, tuple[bool, bool, bool]] = {}
"""Reason tuple -> :func:`reason_flags` (never holds a false value: 3-tuples)."""
_REASON_FLAGS_MAX = 4096


def reason_flags(reasons: tuple) -> tuple[bool, bool, bool]:
    """``(thermal, power, stuck)`` of a clocks-event-reason tuple: :func:`capctl.reasons.classify`
    and :func:`stuck_slowdown`, memoized per tuple (a fleet reports a few distinct sets; bounded)."""
    hit = _REASON_FLAGS.get(reasons)
    if hit is None:
        thermal, power = classify_reasons(reasons)
        hit = (bool(thermal), bool(power), stuck_slowdown(reasons))
        if len(_REASON_FLAGS) >= _REASON_FLAGS_MAX:
            _REASON_FLAGS.clear()
        _REASON_FLAGS[reasons] = hit
    return hit


def stuck_slowdown(reasons) -> bool:
    """A clocks-event-reason set whose slowdown no power cap lifts: a hardware slowdown
    (``HW_SLOWDOWN``, e.g. an external power-brake or a failing part) without a thermal reason
    (a thermal slowdown is one power can fix by cooling the GPU) and without ``SW_POWER_CAP``
    (the power limit holds the clock too: more watts raise it, up to where the slowdown holds it;
    such a GPU was held at its cap as a straggler, at 1,455 MHz where ~494 W would have given its
    1,782 MHz, found by a try-out; NVML clocks event reasons)."""
    up = [r.upper() for r in reasons]
    return (any("HW_SLOWDOWN" in r for r in up) and not any("THERMAL" in r for r in up)
            and "SW_POWER_CAP" not in up)


@dataclasses.dataclass(frozen=True)
class GpuTable:
    """The GPU slots of one topology: ``topology`` ((node, (indices...)) sorted by name),
    ``keys`` [G] (node, index), ``node_of`` [G] int (position of the slot's node in ``nodes``),
    ``gpus`` [G] the records, ``nodes`` the NodeObs in name order."""

    topology: tuple
    keys: tuple
    node_of: np.ndarray
    gpus: list
    nodes: list
    static: dict | None = None
    """:data:`coordinator.gpucolumns.STATIC` field -> read-only array [G] of ``gpus`` (W, °C, MHz)."""


class Registry:
    """Nodes, GPUs, bindings and job energy, keyed by node name (see module docstring)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.nodes: dict[str, NodeObs] = {}
        self.clock = clock
        self.job_energy_j: dict[str, float] = collections.defaultdict(float)
        # node -> GPU index -> (last energy counter J, when: registry clock s)
        self._energy_seen: dict[str, dict[int, tuple[float, float]]] = {}
        self.events: collections.deque[str] = collections.deque(maxlen=256)
        # node -> monotonic times at which a hello replaced a still-open stream of that node
        self.replaced_mono: dict[str, collections.deque] = {}
        self._table_cache: tuple | None = None  # (topology, keys, node_of) of gpu_table()
        self._hellos = 0  # hellos so far: a hello rewrites its GPUs' static facts (gpu_table's static columns)
        self._static_cache: tuple | None = None  # (hellos, records, static columns) of gpu_table()
        self.refused_claims: dict[str, tuple[float, str]] = {}  # node -> (last refused hello, mono s; why)
        self.uuid_node: dict[str, str] = {}  # GPU UUID -> the node whose last hello listed it
        self.ghost_node: dict[str, str] = {}  # GPU UUID -> the node it is a ghost of (_hello_gpus)

    # -- agent messages ---------------------------------------------------------------------
    def on_hello(self, hello, session) -> NodeObs:
        """Register (or re-register) a node from its ``AgentHello``; replaces its bindings.

        GPU facts are replaced by the hello's; the latest readings and accounting of known GPUs are
        kept (the GPU did not change its cap by reconnecting). Returns the node.
        """
        now = self.clock()
        self._hellos += 1
        node = self.nodes.get(hello.node)
        if node is None:
            node = NodeObs(name=hello.node)
            self.nodes[hello.node] = node
        node.simulated = hello.simulated
        node.agent_version = hello.agent_version
        node.packed_plans = hello.packed_plans
        node.driver_version = hello.driver_version
        old = node.gpus
        node.gpus = self._hello_gpus(node, hello, now)
        if node.gpus.keys() != old.keys():  # other GPUs: their throttling lanes start empty
            node.throttle = NodeThrottle()
        if node.session is not None and node.session is not session:
            # a new stream while the old one is still open: an agent restart, or two agents
            # claiming the same node (each hello then replaces the other's stream)
            times = self.replaced_mono.setdefault(hello.node, collections.deque(maxlen=64))
            times.append(now)
        node.bindings = {}
        for b in hello.jobs:
            binding = Binding.from_proto(b, node=hello.node)
            node.bindings[binding.job_id] = binding
        node.session = session
        node.connected_mono = now
        node.last_report_mono = now
        node.seen_s = time.time()
        node.seen_mono = now
        self.events.append(f"hello {hello.node}: {len(node.gpus)} GPUs, {len(node.bindings)} jobs")
        return node

    def _hello_gpus(self, node: NodeObs, hello, now: float) -> dict[int, GpuObs]:
        """``node``'s GPU records after ``hello`` (index -> record): a known GPU (same index, same
        UUID or none known) keeps its readings and accounting; a GPU of another UUID at an index is
        a new record (counted at its maximum limit until it reports). A GPU the node had whose
        UUID the hello does not list becomes a ghost (:meth:`ghost_reserve`): a GPU swapped out,
        or, when another agent took the node's name while its own was dead, a real GPU still at
        the caps that agent set. Its records were reused by index: the real GPUs left the books
        and the cluster went to 4,756 W on a 4,000 W budget (found by a try-out)."""
        old = node.gpus
        listed = {info.uuid for info in hello.gpus if info.uuid}
        for g in old.values():  # (a GPU another node's hello listed since is that node's)
            if self.uuid_node.get(g.uuid) == node.name:
                del self.uuid_node[g.uuid]
            if g.uuid and g.uuid not in listed:
                node.ghosts[g.uuid] = (g.accounted_w(now, math.inf), now, g.index)
                self.ghost_node[g.uuid] = node.name
        gpus = {}
        for info in hello.gpus:
            if info.uuid:
                self.uuid_node[info.uuid] = node.name
                self._ghost_back(info.uuid)
            g = old.get(info.index)
            if g is None or (g.uuid and info.uuid and g.uuid != info.uuid):
                g = GpuObs(node=node.name, index=info.index)
            g.uuid = info.uuid
            g.name = info.name
            g.min_cap_w = info.min_cap_w
            g.max_cap_w = info.max_cap_w
            g.default_cap_w = info.default_cap_w
            g.slowdown_temp_c = info.slowdown_temp_c
            g.shutdown_temp_c = info.shutdown_temp_c
            g.max_sm_clock_mhz = info.max_sm_clock_mhz
            g.pre_job_cap_w = info.pre_job_cap_w
            g.pending.clear()  # plans of an older stream will never be acked
            problem = devicedata.unsupported_message(info.min_cap_w, info.max_cap_w)
            if problem:  # bad device data: held at its limit, flagged (its telemetry says the same)
                g.cap_state, g.error = capstates.UNSUPPORTED_CONSTRAINTS, f"GPU {info.index}: {problem}"
            gpus[info.index] = g
        return gpus

    def _ghost_back(self, uuid: str) -> None:
        """GPU ``uuid`` is listed by a hello again (its node's, or another's: it moved): no ghost."""
        name = self.ghost_node.pop(uuid, None)
        node = self.nodes.get(name) if name is not None else None
        if node is not None:
            node.ghosts.pop(uuid, None)

    def ghost_reserve(self, now_mono: float, forget_s: float) -> dict[str, tuple[float, list[str]]]:
        """Node -> (W, UUIDs) of the GPUs its agent no longer lists (:meth:`_hello_gpus`), each at
        the most it may have enforced when last known, until a hello lists it again or for
        ``forget_s`` seconds (then dropped: a GPU swapped out is not counted for good)."""
        out = {}
        for name in set(self.ghost_node.values()):  # (only the nodes with ghosts: read every interval)
            node = self.nodes.get(name)
            if node is None:  # (a node forgotten or dropped since: its ghosts went with it)
                for u in [u for u, n in self.ghost_node.items() if n == name]:
                    del self.ghost_node[u]
                continue
            for u in [u for u, (_, t, _) in node.ghosts.items() if now_mono - t > forget_s]:
                del node.ghosts[u]
                self.ghost_node.pop(u, None)
            if node.ghosts:
                out[name] = (sum(w for w, _, _ in node.ghosts.values()), sorted(node.ghosts))
        return out

    def on_disconnect(self, node_name: str, session) -> None:
        """Forget the session of ``node_name`` if it is still ``session`` (keeps the node: stale)."""
        node = self.nodes.get(node_name)
        if node is not None and node.session is session:
            node.session = None
            self.events.append(f"disconnect {node_name}")

    def on_telemetry(self, node_name: str, msg, rows: list | None = None) -> bool:
        """Record one ``NodeTelemetry``: readings, throttling history, model samples, job energy.
        ``rows``: its GPUs decoded and checked (:func:`capctl.security.limits.telemetry_rows`; the
        server's path); None decodes ``msg`` here (:func:`capctl.readings.rows_of`), packed or not.

        Returns True when it brought the first reading of some GPU (the node can now be allocated).

        Raises:
            ValueError: with ``rows`` None, packed readings that cannot be decoded (a caller that
                has not checked ``msg``: :func:`capctl.security.limits.telemetry_rows` does).
        """
        node = self.nodes.get(node_name)
        if node is None:
            return False
        now = self.clock()
        node.last_report_mono = now
        node.last_telemetry_mono = now
        node.seen_s = time.time()
        node.seen_mono = now
        node.last_telemetry_seq = msg.seq
        # some GPU had no reading before and all have one now: only a GPU given its first reading
        # here can make it so (a reading is never taken back), so the node's GPUs are looked at then only
        newly = self._record_gpus(node, readings.rows_of(msg) if rows is None else rows, now)
        return newly and all(g.have_reading for g in node.gpus.values())

    def _record_gpus(self, node: NodeObs, rows: list, now: float) -> bool:
        """The GPU rows (:mod:`capctl.readings`) of one ``NodeTelemetry`` (:meth:`on_telemetry`)
        at ``now`` (s). Returns True when it gave some GPU its first reading.

        Speed (the hot loop of every interval: every GPU, every report): the GPUs' first readings
        noted here, not in two passes over the node's GPUs; the reason classes read from their memo
        (:func:`reason_flags`'s) in the loop; usable constraints told by comparison (:data:`_MIN_W`);
        the bounds and the job energy as locals (:meth:`on_telemetry` 2.8 -> 2.4 us a GPU on
        bench/interval_cost.py's reports, 7 Dec 2026)."""
        gpus = node.gpus
        energy_seen = self._energy_seen.get(node.name)
        if energy_seen is None:
            energy_seen = self._energy_seen[node.name] = {}
        job_of = gpu_jobs(node.bindings.values())  # (a GPU bound to several jobs: the first binding's)
        job_energy = self.job_energy_j
        constraints_problem, flags_of = _constraints_problem, _REASON_FLAGS.get
        max_w, max_energy_j, slack_s, min_sane = _MAX_W, _MAX_ENERGY_J, ENERGY_SLACK_S, _MIN_W
        sampled = thermal_mask = power_mask = 0  # the report's throttling lanes (coordinator.throttle)
        newly = False
        for row in rows:
            (index, power_w, cap_w, enforced_w, temp_c, sm_clock, util, mem_pct, energy_j, pre_job_w, _w0, _w1, _w2,
             _w3, state, reasons, job_id, error) = row
            g = gpus.get(index)
            if g is None:
                continue
            if not (0.0 < enforced_w <= max_w and 0.0 <= cap_w <= max_w):
                # no valid reading (an agent that just started, NVML not answering yet: zeros; or
                # limits no board enforces: NaN, inf, 4,294,967 W): nothing of this sample is a
                # fact; the GPU keeps its last readings (or stays without one: fixed at its
                # accounted cap) and no model learns from it
                self._reading(g, row)
                continue
            # a valid reading (:meth:`_reading`, inlined: the hot loop of every interval)
            if not g.have_reading:
                newly = g.have_reading = True
            g.reading_live = True
            g.cap_w = cap_w
            g.enforced_w = enforced_w
            if not (min_sane <= g.min_cap_w <= g.max_cap_w <= max_w) and constraints_problem(g.min_cap_w, g.max_cap_w):
                g.cap_state, error = capstates.UNSUPPORTED_CONSTRAINTS, held_detail(g.min_cap_w, g.max_cap_w, state,
                                                                                     error)
            elif state:
                g.cap_state = state
            if state == OOB_LIMITED and enforced_w < cap_w - OOB_TOLERANCE_W:
                g.oob_w, g.oob_mono = enforced_w, now
            if g.cap_state == FOREIGN_WRITER or g.foreign_clear_mono == _INF:  # (a mark: rarely)
                foreign_mark(g, cap_w, enforced_w, now)
            g.pre_job_cap_w, g.power_w, g.temp_c, g.sm_clock_mhz, g.reasons = pre_job_w, power_w, temp_c, sm_clock, reasons
            g.utilization_pct, g.memory_utilization_pct, g.job_id, g.error = util, mem_pct, job_id, error
            thermal, power, stuck = flags_of(reasons) or reason_flags(reasons)
            bit = 1 << (index * LANE_BITS)  # its lane (coordinator.throttle.lane, inlined: the hot loop)
            sampled |= bit
            if thermal:
                thermal_mask |= bit
            if power:
                power_mask |= bit
            g.sample_enforced_w = enforced_w
            g.sample_mono = now
            g.slowdown_run = g.slowdown_run + 1 if (stuck and util >= 20.0) else 0
            if len(g.new_samples) < 1024:
                # a Sample's fields as a plain tuple (the Sample docstring says why)
                g.new_samples.append((now, power_w, enforced_w, temp_c, float(sm_clock), reasons, util, mem_pct))
            # energy: NVML total energy counter (J); deltas are charged to the bound job
            if not 0.0 <= energy_j <= max_energy_j:
                continue  # not a counter value (NaN, inf, negative): missing, nothing charged
            prev = energy_seen.get(index)
            energy_seen[index] = (energy_j, now)
            g.energy_j = energy_j
            if prev is not None and prev[0] <= energy_j <= prev[0] + max_w * (now - prev[1] + slack_s):
                job = job_of.get(index, "")
                if job:
                    job_energy[job] += energy_j - prev[0]
        if sampled:
            node.throttle.add(now, sampled, thermal_mask, power_mask)
        return newly

    def on_ack(self, node_name: str, ack, sent_caps: dict[int, float] | None, rows: list | None = None) -> None:
        """Record a ``CapAck``: its read-backs replace the readings; its plan is no longer pending.

        ``sent_caps`` are the caps of the acknowledged plan (index -> W); a GPU of the plan missing
        from the read-back stays counted at ``max(reading, cap sent)`` for ``ack_memory_s``.
        ``rows``: its read-backs decoded and checked (:func:`capctl.security.limits.ack_rows`);
        None decodes ``ack`` here (``ValueError`` for packed readings that cannot be decoded, as
        :meth:`on_telemetry`). The plan's GPUs are visited by index, without a list of pairs, and
        :meth:`_reading` unpacks its row once (0.81 -> 0.70 us a GPU read back, bench/interval_cost.py's
        acknowledgements, 7 Dec 2026).
        """
        node = self.nodes.get(node_name)
        if node is None:
            return
        now = self.clock()
        node.last_report_mono = now
        seen = set()
        gpus = node.gpus
        reading = self._reading
        for row in (readings.rows_of(ack) if rows is None else rows):
            index = row[R_INDEX]
            g = gpus.get(index)
            if g is not None and reading(g, row):  # (not read back: the cap sent keeps counting, below)
                seen.add(index)
                g.last_ack_w = g.enforced_w  # (the read-back's enforced limit, just recorded)
                g.last_ack_mono = now
        seq = ack.seq
        # a plan's caps are pending only on the GPUs it named (Coordinator.send_plan; merging old
        # entries keeps their seqs): those of ``sent_caps``; every GPU when it is not known
        for idx in (gpus if sent_caps is None else sent_caps):
            g = gpus.get(idx)
            if g is None:
                continue
            pending = g.pending
            if pending:  # (most GPUs of most plans: nothing sent, nothing to pop)
                sent = pending.pop(seq, None)
                if sent is not None and idx not in seen:
                    g.last_ack_w = max(g.enforced_w, sent)
                    g.last_ack_mono = now

    def _reading(self, g: GpuObs, row: tuple) -> bool:
        """Apply one read-back row (telemetry or ack, :mod:`capctl.readings`) to ``g``; False when
        it holds no valid reading.

        A read-back without a positive enforced limit is not a reading: NVML never enforces 0 W,
        so zeros mean the agent could not read the GPU (LOST/ERROR, or a sample taken before its
        first NVML read). The GPU then keeps counting at its last known caps (never as 0 W freed)
        and a GPU that never had a reading stays fixed at its accounted cap."""
        (_index, _power_w, cap_w, enforced_w, _temp_c, _sm_clock, _util, _mem_pct, _energy_j, pre_job_w, _w0, _w1, _w2,
         _w3, state, _reasons, _job_id, error) = row  # (one unpacking: cheaper than four reads by position)
        if not (0.0 < enforced_w <= _MAX_W and 0.0 <= cap_w <= _MAX_W):
            if state:
                g.cap_state = state
            if enforced_w or cap_w:  # (zeros: the agent read nothing; anything else is bad device data)
                error = bad_limits_detail(g.index, enforced_w, cap_w)
            g.error = error or g.error
            g.reading_live = False  # the last readings are no longer live (the caps keep counting)
            return False
        g.have_reading = True
        g.cap_w = cap_w
        g.enforced_w = enforced_w
        if not (_MIN_W <= g.min_cap_w <= g.max_cap_w <= _MAX_W) and _constraints_problem(g.min_cap_w, g.max_cap_w):
            # whatever an older agent says: bad device data holds the GPU
            g.cap_state = capstates.UNSUPPORTED_CONSTRAINTS
            error = held_detail(g.min_cap_w, g.max_cap_w, state, error)
        elif state:
            g.cap_state = state
        if state == OOB_LIMITED and enforced_w < cap_w - OOB_TOLERANCE_W:
            g.oob_w, g.oob_mono = enforced_w, self.clock()
        if g.cap_state == FOREIGN_WRITER or g.foreign_clear_mono == _INF:
            foreign_mark(g, cap_w, enforced_w, self.clock())
        g.pre_job_cap_w = pre_job_w
        if error:
            g.error = error
        return True

    def on_job_started(self, node_name: str, binding_msg) -> None:
        """Bind a job to GPUs of ``node_name`` (idempotent)."""
        node = self.nodes.get(node_name)
        if node is None:
            return
        b = Binding.from_proto(binding_msg, node=node_name)
        if b.node != node_name:
            log.warning("JobStarted for node %r received on the stream of %r; using %r", b.node, node_name, node_name)
            b.node = node_name
        node.bindings[b.job_id] = b
        self.events.append(f"job {b.job_id} started on {node_name} GPUs {list(b.gpu_indices)}")

    def on_job_ended(self, node_name: str, job_id: str) -> None:
        """Unbind a job from ``node_name`` (idempotent)."""
        node = self.nodes.get(node_name)
        if node is None:
            return
        if node.bindings.pop(job_id, None) is not None:
            self.events.append(f"job {job_id} ended on {node_name}")
        if not any(job_id in n.bindings for n in self.nodes.values()):
            self.job_energy_j.pop(job_id, None)

    def restore_ledger(self, ledger: dict[str, dict], forget_s: float, keep=frozenset()) -> int:
        """Register the nodes of a persisted node ledger (store.load_nodes) as stale, each GPU
        counted at its recorded cap; entries older than ``forget_s`` (s) are skipped unless their
        node is in ``keep`` (the policy's node names: see :meth:`forget_silent`). Returns the count."""
        now = time.time()
        n = 0
        for name, entry in ledger.items():
            if name in self.nodes or (now - entry.get("seen_s", 0.0) > forget_s and name not in keep):
                continue
            age_s = max(0.0, now - entry.get("seen_s", 0.0))
            node = NodeObs(name=name, seen_s=entry.get("seen_s", 0.0), seen_mono=self.clock() - age_s)
            for idx, (acc, lo, hi, safe) in entry["gpus"].items():
                node.gpus[idx] = GpuObs(node=name, index=idx, min_cap_w=lo, max_cap_w=hi, have_reading=True,
                                        cap_w=acc, enforced_w=acc, safe_cap_w=safe, cap_state=capstates.UNCONFIRMED)
            self.nodes[name] = node
            n += 1
        return n

    def forget_silent(self, forget_s: float, keep=frozenset()) -> list[str]:
        """Drop disconnected nodes not heard of for ``forget_s`` seconds, except those in ``keep``
        (the policy's node names, ``Policy.node_names``); returns their names.

        A node of the policy is never forgotten: its agent may be dead (killed, hung, its host
        half up) and its GPUs then keep the caps it last set, with no lease to bring them down, so
        forgetting it would hand those watts out twice (found by a try-out: an agent killed with
        -9, its node forgotten, the cluster 4,482 W on a 3,600 W budget in the simulated driver's
        journal). It stays counted at its last caps until its agent reports again or an admin
        removes it from the policy (docs/coordinator.md)."""
        now = self.clock()  # monotonic: a wall-clock jump never forgets a node early
        gone = [n for n, node in self.nodes.items()
                if node.session is None and now - node.seen_mono > forget_s and n not in keep]
        for name in gone:
            del self.nodes[name]
            self._energy_seen.pop(name, None)  # (a node back later: its counters start again, none charged)
            self.events.append(f"forgot {name}: silent for more than {forget_s:.0f} s")
        return gone

    def refuse_claim(self, node_name: str, why: str) -> None:
        """A hello for ``node_name`` was refused: another agent serves that name (see
        :meth:`coordinator.loop.Coordinator.claim_problem`); kept for :meth:`claims_refused`."""
        self.refused_claims[node_name] = (self.clock(), why)
        self.events.append(f"claim refused {node_name}")

    def claims_refused(self, now_mono: float, hold_s: float) -> dict[str, str]:
        """Node -> why, of the nodes a hello was refused for within the last ``hold_s`` seconds
        (older ones are dropped): the refused agent's GPUs are real, uncounted, at caps no plan sets."""
        for name in [n for n, (t, _) in self.refused_claims.items() if now_mono - t > hold_s]:
            del self.refused_claims[name]
        return {n: why for n, (_, why) in self.refused_claims.items()}

    # -- queries ------------------------------------------------------------------------------
    def replacements(self, window_s: float, now_mono: float | None = None) -> dict[str, int]:
        """Node -> how many times its open stream was replaced by a new hello within the last
        ``window_s`` seconds (nodes with none are left out; older entries are dropped)."""
        now = self.clock() if now_mono is None else now_mono
        out = {}
        for name in list(self.replaced_mono):
            times = self.replaced_mono[name]
            while times and now - times[0] > window_s:
                times.popleft()
            if times:
                out[name] = len(times)
            else:
                del self.replaced_mono[name]
        return out

    @staticmethod
    def job_of(node: NodeObs, index: int) -> str:
        """The job bound to GPU ``index`` of ``node`` ("" when idle); a GPU bound to several jobs
        is the first binding's (:func:`gpu_jobs`, the one rule)."""
        return gpu_jobs(node.bindings.values()).get(index, "")

    def jobs(self) -> dict[str, list[Binding]]:
        """Job id -> its bindings (one per node), sorted by node name."""
        out: dict[str, list[Binding]] = {}
        for name in sorted(self.nodes):
            for b in self.nodes[name].bindings.values():
                out.setdefault(b.job_id, []).append(b)
        return out

    def gpu_table(self) -> "GpuTable":
        """The GPU slots of the current topology (:class:`GpuTable`: nodes sorted by name, GPUs by
        index): the order of the solver inputs and of :mod:`coordinator.gpucolumns`. The slot
        structure is cached per topology; the records are re-read each call (a hello may replace one)."""
        nodes = self.nodes
        names = sorted(nodes)
        topology = tuple((name, tuple(sorted(nodes[name].gpus))) for name in names)
        cached = self._table_cache
        if cached is None or cached[0] != topology:
            keys = tuple((name, idx) for name, indices in topology for idx in indices)
            counts = np.fromiter((len(ix) for _, ix in topology), np.int64, len(topology))
            node_of = np.repeat(np.arange(len(topology), dtype=np.int64), counts)
            cached = self._table_cache = (topology, keys, node_of)
        topology, keys, node_of = cached
        gpus = [g for name, indices in topology for g in map(nodes[name].gpus.__getitem__, indices)]
        return GpuTable(topology=topology, keys=keys, node_of=node_of, gpus=gpus,
                        nodes=[nodes[name] for name in names], static=self._static_columns(gpus))

    def _static_columns(self, gpus: list) -> dict:
        """The :data:`coordinator.gpucolumns.STATIC` fields of the records ``gpus`` as read-only
        arrays, re-read when a record was replaced or a hello came since the last read (only a
        hello writes them; the records are kept so that a new one is never taken for an old one)."""
        from coordinator import gpucolumns

        cached = self._static_cache
        if (cached is not None and cached[0] == self._hellos and len(cached[1]) == len(gpus)
                and all(map(operator.is_, cached[1], gpus))):
            return cached[2]
        static = gpucolumns.gather((), gpus, gpucolumns.STATIC).col
        for arr in static.values():
            arr.setflags(write=False)
        self._static_cache = (self._hellos, gpus, static)
        return static

    def all_gpus(self) -> list[GpuObs]:
        """Every known GPU, ordered by (node, index)."""
        return [g for name in sorted(self.nodes) for _, g in sorted(self.nodes[name].gpus.items())]

    def take_samples(self) -> dict[tuple[str, int], list[Sample]]:
        """Return and clear the samples received since the last call, per GPU key, each a
        :class:`Sample` (the plain tuples :meth:`_record_gpus` keeps made ``Sample``)."""
        out = {}
        make = Sample._make
        for name, node in self.nodes.items():
            for idx, g in node.gpus.items():
                if g.new_samples:
                    out[(name, idx)] = [s if type(s) is Sample else make(s) for s in g.new_samples]
                    g.new_samples = []
        return out
