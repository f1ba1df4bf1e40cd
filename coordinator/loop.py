"""The coordinator's reconcile loop: observed state -> desired caps -> two-phase apply.

Every ``interval_s`` (policy) :meth:`Coordinator.tick`:

1. feeds the telemetry received since the last interval to the online models
   (:mod:`coordinator.models`);
2. snapshots the registry into the allocator's problem and solves it with the fast path in a
   worker thread (:mod:`coordinator.allocation`); stale nodes are fixed at their accounted
   caps (spent, never free);
3. computes failsafe caps (:func:`coordinator.planner.safe_caps`) from
   ``min(desired, accounted)`` so that every domain holds even if all agents fell back at once;
4. phase 1: sends every decrease and waits (at most :meth:`Coordinator.ack_wait_s`, < one interval)
   for the ``CapAck`` read-backs;
5. phase 2: grants increases out of each domain's headroom computed from the accounted caps after
   phase 1 (:func:`coordinator.planner.plan_increases`); every other live node gets a
   "hold" plan (lease renewal). With nothing changed, only holds are sent (idempotent).

Dry run (``--dry-run`` or policy ``dry_run: true``): steps 1-3 run and are reported and exported;
agents get only "hold" plans with ``dry_run = true``, no caps and no safe caps, so nothing changes on
the devices (the lease is still renewed so that agents do not fall back while we watch).

What is decided (steps 2-5: desired caps, safe caps, the decreases, the increases within headroom,
the holds) is computed by the pure functions of :mod:`coordinator.decide` from a snapshot taken by
:mod:`coordinator.observe`; :meth:`Coordinator.tick` does the I/O around them (models, plans,
acknowledgements, ledger, view).

Admin operations (:meth:`Coordinator.set_budget`, :meth:`Coordinator.reload_policy`) run on the
same event loop; the budget persists in the state directory (:mod:`coordinator.store`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import gc
import logging
import operator
import os
import math
import statistics
import time
import uuid

import numpy as np

from capctl import capstates
from capctl.errors import UserInputError
from capctl.security import limits
from capctl.v1 import capctl_pb2 as pb
from capctl.wattunits import format_watts
from coordinator import (ackwait, allocation, decide, gpucolumns, membound, observe, observed, planmsg, planner, throttle,
                         tickphase)
from coordinator.decide import REPLACED_MAX, REPLACED_WINDOW_S  # noqa: F401 (re-exported)
from coordinator.finished import MemoryFinishedJobs, explain_finished
from coordinator.jobenergy import JobEnergyBook
from coordinator.models import Models
from coordinator.registry import NODE_FORGET_S, Registry  # noqa: F401 (NODE_FORGET_S re-exported)
from coordinator.store import StoreError
from coordinator.storeio import StoreIO, blocking
from coordinator.view import GpuExtra, JobExtra, LazyView, View, empty_view, finite

log = logging.getLogger("capctl.coordinator.loop")

SENT_MEMORY_S = 120.0
"""Plans older than this (s) stop waiting for their acknowledgement (bounded memory)."""

MAX_PENDING_PER_GPU = 32
LEDGER_PERIOD_S = 30.0
"""The node ledger (store.py) is rewritten at least this often (s), and before every increase."""
_DATA_LOST = ("etcd lost its data? agent {node} had seen coordinator term {seen}, above this leader's {term}: "
              "an admin's budget override, the finished-job records and the node ledger kept in etcd may be gone; "
              "the budget in force is {budget:g} W (set it again, or reload the policy, to clear this alert)")
"""The persistent alert of a leader that learns from an agent's hello that etcd lost its data (a
budget an admin had lowered then reverts to the policy file's without a word; found by a try-out)."""
OVERLOAD_TICKS = 3
"""Regular reconciles in a row longer than the interval before the "coordinator overloaded" alert
(:meth:`Coordinator._note_busy`): one slow interval (a refit burst, a full garbage collection) is
no overload."""
ACK_WARN_EVERY_S = 60.0
"""At most one log line per node per this many seconds for acknowledgements that say their plan
was not fully applied (:meth:`Coordinator._warn_ack`)."""
GC_THRESHOLDS = (20000, 10, 100)
"""Garbage collector thresholds (gen0, gen1, gen2) while the loop runs (see Coordinator.run)."""
MIN_TICK_SPACING = 0.2
"""An early tick (job event, budget change) comes at least this fraction of an interval after the
previous one."""
INLINE_SOLVE_FRACTION = 0.1
"""A solve runs on the event loop when the last one took at most this fraction of an interval of
CPU (s/s), else in a worker thread (:meth:`Coordinator._solve`)."""
REPORT_GRACE = 0.1
"""At a grid tick the snapshot waits at most this fraction of an interval (s/s) for the live
streams that have not reported since the last snapshot: reports timed to land before the tick
(coordinator.tickphase) but not yet read by a busy event loop are then in the decision rather than
one interval late. The grid itself does not move."""


class Coordinator:
    """State and behaviour of one coordinator incarnation (see module docstring).

    Args:
        policy: the validated policy from the file (:class:`capctl.policy.Policy`).
        policy_path: the file it came from ("" for an embedded policy).
        store: an opened or failed :class:`~coordinator.store.Store`, or None (no persistence).
        dry_run: ``--dry-run`` flag (ORed with the policy's ``dry_run``).
        store_error: the error met while opening the store, reported as an alert.
        finished: the :class:`~coordinator.finished.FinishedJobStore` of finished jobs (default:
            in memory).
    """

    def __init__(self, policy, policy_path: str, store=None, dry_run: bool = False, store_error: str = "",
                 metrics=None, finished=None) -> None:
        self.coordinator_id = uuid.uuid4().hex
        # Wall-clock time derived from the monotonic clock (anchored once at start): lease expiries
        # sent to agents do not move when the head node's wall clock jumps (issue 7, clock jump).
        self._wall0_s = time.time()
        self._mono0_s = time.monotonic()
        self.registry = Registry()
        self._safe_caps_cache = planmsg.SafeCapsCache()  # each node's last failsafe caps, serialized (send_plan)
        self.energy_book = JobEnergyBook()  # running jobs' energy per node (coordinator.jobenergy)
        self.finished = finished if finished is not None else MemoryFinishedJobs()
        self.recent_finished: tuple = ()  # (job id, energy J, end Unix s), newest first: for the metrics thread
        self._finished_ids: collections.OrderedDict = collections.OrderedDict()  # known kept (bounded)
        self.models = Models()
        self.file_policy = policy
        self.policy_path = policy_path
        self.start_policy_path = policy_path  # the --policy file (policy_path: the file in force)
        self.store = store
        # etcd stores: their calls run in one worker thread, never on the event loop (coordinator.storeio)
        self.store_io = StoreIO() if blocking(store) or blocking(self.finished) else None
        self._finished_absent: collections.OrderedDict = collections.OrderedDict()  # looked up: not kept (bounded)
        self._finished_lookups: dict = {}  # job id -> [(node, NodeTelemetry of its records)] while looked up
        self.dry_run_flag = bool(dry_run)
        self.metrics = metrics
        self.persistent_alerts: dict[str, str] = {}
        if store_error:
            self.persistent_alerts["store"] = f"state database: {store_error}; running on in-memory state"
        self._fell_back = False  # the reloaded file in force did not load at start (_restore_reloaded)
        policy = self._restore_reloaded(policy)
        # (a coordinator sharing its store with others, HA, keeps an override its file disagrees
        # with: a standby starting with another file deleted the leader's override, found by a review)
        # (after a fallback to the start-up file the override was set under the reloaded one: kept,
        # the lower in force, as at a takeover; the start file's budget deleted it, found by a try-out)
        self.policy = self._apply_override(policy, takeover=bool(getattr(store, "shared", False)) or self._fell_back)
        self._ledger_mono = -math.inf
        self._ledger_nodes: frozenset = frozenset()
        self._ledger_w: dict = {}  # (node, GPU index) -> the W the saved ledger counts it at
        self._restore_ledger()
        self.view: View = empty_view(self.coordinator_id, self.policy, policy_path, self.dry_run)
        self._wake: asyncio.Event | None = None
        self._last_tick_mono = -math.inf
        self._next_tick_mono = math.nan  # the next regular tick (monotonic s; tickphase), once the loop runs
        self._snapshot_time_s = 0.0  # lease clock (Unix s) of the current interval's snapshot (CapPlan.snapshot_time_s)
        self._tick_policy = self.policy  # the policy the current interval started with (:meth:`_policy_changed`)
        self._ticks_since_policy = 0  # intervals planned since the policy last changed (planner.EXACT_DECREASE_TICKS)
        self._over_ticks = 0  # intervals in a row a domain was counted above its limit (planner.OVER_AGAIN_TICKS)
        self._busy_s = 0.0  # how long the last regular tick took (s): stretches the grid when > interval
        self._overruns = 0  # regular ticks in a row longer than the interval (_note_busy)
        self._reported: set = set()  # nodes whose telemetry arrived since the last snapshot
        self._expected_reports = 0  # how many the grid tick now due waits for (live streams)
        self._reports_in: asyncio.Event | None = None  # set when they are all in
        self.rtt_s: collections.deque = collections.deque(maxlen=4096)  # plan sent -> ack
        self.control_s: collections.deque = collections.deque(maxlen=4096)  # telemetry -> ack
        self.solve_s: collections.deque = collections.deque(maxlen=4096)
        self._solve_cpu_s = math.inf  # CPU seconds of the last solve (inf: none yet; see _solve)
        self.tick_count = 0
        self._start_clock = self.registry.clock()  # start of the startup hold (see _unreported_policy_nodes)
        self._warned: set = set()  # keys of the watch alerts already logged (see _watch_alerts)
        self._ack_warned: dict = {}  # node -> (last failed ack logged, registry clock s; not logged since) (_warn_ack)
        self.ha = None  # coordinator.election.Leadership when coordinators run in HA on etcd (daemon)
        self._fresh_streams: set = set()  # HA: nodes whose first telemetry on a new stream wakes the loop

    def _restore_ledger(self) -> None:
        """Count the nodes of the saved node ledger at their last known caps until their agents
        report (:meth:`Registry.restore_ledger`); a store error becomes a persistent alert."""
        if self.store is None or not self.store.ok:
            return
        try:
            n = self.registry.restore_ledger(self.store.load_nodes(), NODE_FORGET_S, keep=self.policy.node_names)
            if n:
                log.info("node ledger: %d node(s) counted at their last known caps until their agents report", n)
        except StoreError as exc:
            self.persistent_alerts["store"] = str(exc)
            log.error("%s", exc)

    def _restore_reloaded(self, policy):
        """The policy in force at start: the file an admin loaded with ``policy reload FILE``
        (persisted, :data:`RELOADED_KEY`) when it is not the start-up file ``policy``'s, else
        ``policy``. Before, a restart went back to the start-up file without a word, with its
        own domain limits (a PDU limit an admin had added was gone: its PDU 2,211 W on a
        1,000 W limit in the journal; found by a try-out). A reloaded file that no longer loads
        leaves the start-up file in force and a persistent alert naming both. Not in high
        availability (there each coordinator runs its own start file: another one is refused)."""
        store = self._reload_store()
        if store is None:
            return policy
        try:
            saved = store.get(RELOADED_KEY)
        except StoreError as exc:
            log.error("%s", exc)
            return policy
        path = saved.get("path") if isinstance(saved, dict) else None
        if not isinstance(path, str) or not path or _same_file(path, self.policy_path):
            return policy
        from capctl.policy import load_policy, parse_policy

        try:
            reloaded = load_policy(path)
        except Exception as exc:  # noqa: BLE001 (PolicyError, a file gone: never a crash at start)
            why = _first_line(exc)
            try:  # its version last loaded (saved with the path): the admin's limits stay in force
                reloaded = parse_policy(saved["text"], f"{path} (as last loaded)")
            except Exception:  # noqa: BLE001 (none saved: a record of an earlier release)
                self.persistent_alerts["policy"] = (
                    f"policy {path} (loaded by an admin with policy reload) does not load now: {why}; "
                    f"running the start-up file {self.policy_path or '(embedded default)'}, whose limits may be "
                    f"higher: fix it and reload it, or reload the start-up file to make it the one in force")
                log.error("%s", self.persistent_alerts["policy"])
                self._fell_back = True
                return policy
            self.persistent_alerts["policy"] = (
                f"policy {path} (loaded by an admin with policy reload) does not load now: {why}; its version "
                f"last loaded is in force: fix the file and reload it, or reload the start-up file "
                f"{self.policy_path or '(embedded default)'} to make it the one in force")
            log.error("%s", self.persistent_alerts["policy"])
        log.warning("policy %s in force, loaded by an admin with policy reload (not the start-up file %s); "
                    "capctl policy reload %s makes the start-up file the one in force again",
                    path, self.policy_path or "(embedded default)", self.policy_path or "FILE")
        self.file_policy, self.policy_path = reloaded, path
        return reloaded

    def _reload_store(self):
        """The store that keeps the policy file in force, or None: none, failed, or shared (high
        availability: each coordinator runs its own start file)."""
        store = self.store
        if store is None or not store.ok or getattr(store, "shared", False):
            return None
        return store

    def _remember_reloaded(self, path: str, text: str) -> str:
        """Persist ``path`` as the file in force, with ``text``, the version just loaded (see
        :meth:`_restore_reloaded`); "" or a warning for the reply when it could not be saved."""
        store = self._reload_store()
        if store is None:
            return ""
        # the start-up file reloaded: no record (it pinned its path, and a later --policy was ignored)
        value = None if _same_file(path, self.start_policy_path) else {"path": os.path.abspath(path),
                                                                         "time_s": time.time(), "text": text}
        try:
            store.put(RELOADED_KEY, value, "policy reload")
        except StoreError as exc:
            self.persistent_alerts["store"] = f"policy {path} in force but NOT persisted: {exc}"
            return f"; WARNING: not persisted ({exc}): a restart runs the start-up file"
        return ""

    # -- properties ---------------------------------------------------------------------------
    @property
    def dry_run(self) -> bool:
        """True when nothing is applied (flag or policy)."""
        return self.dry_run_flag or bool(self.policy.dry_run)

    @property
    def interval_s(self) -> float:
        return float(self.policy.interval_s)

    @property
    def term(self) -> int:
        """The leader's term carried in plans (0 without etcd; see coordinator/election.py)."""
        return self.ha.plan_term if self.ha is not None else 0

    def may_send(self) -> bool:
        """True unless this coordinator is an HA standby (or a leader whose etcd lease may be gone)."""
        return self.ha is None or self.ha.may_send()

    @property
    def lease_s(self) -> float:
        return float(self.policy.failsafe.lease_s)

    def lease_clock_s(self) -> float:
        """Unix time for lease expiries: the start's wall clock advanced by the monotonic clock, so
        a wall-clock jump on the head node neither shortens nor stretches a lease."""
        return self._wall0_s + (time.monotonic() - self._mono0_s)

    def ack_wait_s(self) -> float:
        """Bounded wait for phase-1 acknowledgements: half an interval, at most 10 s."""
        return min(0.5 * self.interval_s, 10.0)

    def ack_memory_s(self) -> float:
        """How long an acknowledged read-back keeps counting (see registry docstring)."""
        return self.interval_s

    # -- budget override ----------------------------------------------------------------------
    def _apply_override(self, policy, override=None, read: bool = True, takeover: bool = False):
        """``policy`` with the store's budget override applied; ``override``: the store's, read
        already (``read`` False: off the loop, :meth:`_read_override`), else read here.

        An override set under another budget than ``policy``'s file says: at a start or a reload
        here the file wins (the admin changed it since) and the override is cleared; at a
        ``takeover`` or the start of a coordinator whose store is shared (high availability: the
        file may be another head node's) see :meth:`_override_at_takeover`."""
        if self.store is None or not self.store.ok:
            return policy
        if read:
            override = self._read_override()
        if isinstance(override, StoreError):
            self.persistent_alerts["store"] = str(override)
            log.error("%s", override)
            return policy
        if override is None:
            return policy
        if abs(float(override.get("policy_budget_w", -1)) - policy.budget_w) > 1e-6:
            if takeover:
                return self._override_at_takeover(policy, override)
            log.info("policy %s changed its budget_w to %g W since `budget set %g`: the file wins",
                     policy.source, policy.budget_w, override["budget_w"])
            self.store_write(self.store.clear_budget_override, alert="store")
            return policy
        try:
            out = policy.with_budget(float(override["budget_w"]))
            log.info("budget %g W from %s (set by an admin; policy file says %g W)", out.budget_w,
                     self.store.path, policy.budget_w)
            return out
        except UserInputError as exc:
            log.error("persisted budget %s W ignored: %s", override.get("budget_w"), exc)
            return policy

    def _override_at_takeover(self, policy, override: dict):
        """``policy`` under an override that a leader set while its policy file said another
        budget than this coordinator's ``policy`` does: the head nodes' files differ, or the file
        changed without a reload. Before, the new leader took its file for the admin's newer word:
        it cleared the override from etcd and ran its file's budget, above the admin's (found by a
        review). Now the lower of the two is in force, the override is kept, and the alert
        ``budget`` says so until ``capctl budget set`` or ``capctl policy reload`` settles it."""
        from capctl.policy.minimums import minimum_w

        set_w = float(override["budget_w"])
        under_w = float(override.get("policy_budget_w", math.nan))
        under = f"{format_watts(under_w)} W" if math.isfinite(under_w) and under_w > 0 else "a budget not recorded"
        keep_w = min(set_w, policy.budget_w)
        floor_w = minimum_w(policy.domains, policy.min_cap_w)
        why = "the lower"
        if floor_w is not None and keep_w < floor_w:  # (the file's minimum caps need more: as close as they allow)
            keep_w, why = min(floor_w, policy.budget_w), "the sum of this file's minimum caps"
        try:
            out = policy.with_budget(keep_w)
        except UserInputError as exc:  # (not a budget this file allows at all: its own, with the reason)
            out, why = policy, f"the file's own ({exc})"
        text = (f"budget override {format_watts(set_w)} W was set while the policy file said "
                f"{under}, but {policy.source} here says {format_watts(policy.budget_w)} W "
                f"(the head nodes' policy files differ, or the file changed without a reload): {why}, "
                f"{format_watts(out.budget_w)} W, is in force and the override is kept; `capctl budget set W` or "
                f"`capctl policy reload` settles it")
        self.persistent_alerts["budget"] = text
        log.error("%s", text)
        return out

    def _read_override(self):
        """The store's budget override (dict or None), or the :class:`StoreError` reading it raised
        (blocks: call it off the loop for an etcd store)."""
        try:
            return self.store.budget_override()
        except StoreError as exc:
            return exc

    # -- store calls (coordinator.storeio) ---------------------------------------------------
    async def store_read(self, fn, *args):
        """``fn(*args)``: in the store worker for an etcd store (awaited; the loop goes on meanwhile),
        else here. Raises what ``fn`` raises."""
        if self.store_io is None:
            return fn(*args)
        return await self.store_io.call(fn, *args)

    def store_write(self, fn, *args, alert: str = "", done=None):
        """``fn(*args)`` without waiting on the loop (store worker; inline for SQLite); then
        ``done(result, error)`` on the loop. A :class:`StoreError` with no ``done`` becomes the
        persistent alert ``alert``. Returns the asyncio future (worker) or None (inline)."""
        def finish(result, exc) -> None:
            if done is not None:
                done(result, exc)
            elif isinstance(exc, StoreError):
                if alert:
                    self.persistent_alerts[alert] = str(exc)
                log.error("%s", exc)
            elif exc is not None:
                log.error("store call %s failed: %s: %s", getattr(fn, "__name__", fn), type(exc).__name__, exc)
        if self.store_io is not None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass  # not on the loop (start-up, tools): inline
            else:
                return self.store_io.submit(fn, *args, done=finish)
        try:
            result = fn(*args)
        except StoreError as exc:
            finish(None, exc)
        else:
            finish(result, None)
        return None

    def close_store_io(self) -> None:
        """Stop the store worker (daemon stop; idempotent)."""
        if self.store_io is not None:
            self.store_io.close()

    # -- agent sessions -----------------------------------------------------------------------
    def claim_problem(self, hello, session) -> str:
        """Why ``hello`` may not take its node's stream ("" when it may): another agent holds an
        open stream for that node name, reports (within the lease), and its GPUs have other UUIDs
        (a second agent started with the same ``--node``, e.g. a copied configuration). Before, each
        hello replaced the other's stream, and the newcomer applied that node's plans to its own
        GPUs, which the coordinator counted under their real node at their old caps: 4,641 W on a
        4,000 W budget for 2 s in the simulated driver's journal (found by a try-out). An agent that
        restarts has the same GPUs, and a node whose stream is silent past the lease (a dead peer)
        is taken over as before. Also refused: a hello whose GPUs another reporting node serves
        (an agent started with another node's name on them: a second try-out took a node whose
        agent was stopped past its lease). A refusal is kept in the registry
        (:meth:`~coordinator.registry.Registry.refuse_claim`): the refused agent's GPUs are real and
        are counted once more at the most the node may draw (:data:`coordinator.allocation.CLAIM_HOLD_S`),
        whichever agent said hello first (after a coordinator restart the wrong one may)."""
        problem = self._claim_clash(hello, session)
        if problem:
            self.registry.refuse_claim(hello.node, problem)
        return problem

    def _claim_clash(self, hello, session) -> str:
        """:meth:`claim_problem`'s rule: the hello's GPUs (UUIDs) against those of the agent that
        serves its node name and reports, and against every other reporting node's (GPUs already
        served under another name: an agent started with another node's name on them)."""
        reg = self.registry
        now = reg.clock()
        new = {g.uuid for g in hello.gpus if g.uuid}
        if not new:
            return ""
        # by the registry's UUID index: a pass over every node per hello was quadratic in the
        # nodes at a restart, when they all say hello (12,500 nodes: 1.6e8 set builds)
        owners = {reg.uuid_node.get(u) for u in new} - {None, hello.node}
        for name in sorted(owners):
            other = reg.nodes.get(name)
            if other is None or other.session is None or other.stale(now, self.lease_s):
                continue
            theirs = sorted(u for u in new if reg.uuid_node.get(u) == name)
            return (f"its GPUs ({', '.join(theirs[:2])}{', ...' if len(theirs) > 2 else ''}) are served "
                    f"as node {name} by the agent at {other.session.peer}: two agents on one node's GPUs "
                    f"(a copied --node?); this one is refused while the other reports")
        node = reg.nodes.get(hello.node)
        if node is None or node.session is None or node.session is session or node.stale(now, self.lease_s):
            return ""
        held = {g.uuid for g in node.gpus.values() if g.uuid}
        if not held or held == new:
            return ""
        return (f"node {hello.node} is already served by an agent at {node.session.peer} reporting other GPUs "
                f"({', '.join(sorted(held)[:2])}{', ...' if len(held) > 2 else ''}; this one has "
                f"{', '.join(sorted(new)[:2])}{', ...' if len(new) > 2 else ''}): two agents claim one node name "
                f"(a copied --node?); this one is refused while the other reports")

    def attach(self, hello, session) -> None:
        """A (re)connected agent said hello: replace any older stream of that node, rebuild state."""
        node = self.registry.nodes.get(hello.node)
        if node is not None and node.session is not None and node.session is not session:
            node.session.close(f"replaced by a new stream from {session.peer}")
        now = self.registry.clock()
        if node is not None:
            for g in node.gpus.values():
                if g.pending:  # plans of the old stream may have been applied: keep counting them
                    g.last_ack_w = max(g.enforced_w, max(g.pending.values()), g.last_ack_w)
                    g.last_ack_mono = now
        self.registry.on_hello(hello, session)
        if self.ha is not None:  # after a failover its caps are known from the ledger only: plan at its first report
            self._fresh_streams.add(hello.node)
            if hello.coordinator_term > self.term > 0 and self.ha.want_term_above(hello.coordinator_term):
                log.warning("agent %s has seen coordinator term %d, this leader's is %d: it refuses our plans; "
                            "raising the term (docs/ha.md, \"etcd data loss\")", hello.node,
                            hello.coordinator_term, self.term)
                self.persistent_alerts.setdefault("etcd-data", _DATA_LOST.format(
                    node=hello.node, seen=hello.coordinator_term, term=self.term, budget=self.policy.budget_w))
        log.info("agent %s connected from %s (%d GPUs, %d jobs, last plan %d)", hello.node, session.peer,
                 len(hello.gpus), len(hello.jobs), hello.last_plan_seq)
        # no early interval here: the node's GPUs count at their maximum limit until its first
        # telemetry, which wakes the loop (registry.on_telemetry)

    def detach(self, node: str, session) -> None:
        """An agent stream ended."""
        self.registry.on_disconnect(node, session)

    def welcome_for(self, node_name: str) -> pb.Welcome:
        """``Welcome`` for a node that just said hello: ids, timing and its current safe caps."""
        node = self.registry.nodes[node_name]
        safe = []
        if not self.dry_run:
            for idx, g in sorted(node.gpus.items()):
                if g.constraints_problem:
                    continue  # unusable limit constraints: no cap at all for it (never 0 W)
                s = g.safe_cap_w
                if s <= 0:
                    cap = self.policy.failsafe.safe_cap_w
                    s = g.enforced_w if g.have_reading else (cap if cap else g.min_cap_w)
                    if cap:
                        s = min(s, cap)
                s = planner.clamp(s, g.min_cap_w, g.max_cap_w)
                safe.append(pb.CapAssignment(index=idx, cap_w=s))
        return pb.Welcome(protocol_version="capctl.v1", coordinator_id=self.coordinator_id,
                          interval_s=self.interval_s, lease_s=self.lease_s, safe_caps=safe, term=self.term,
                          packed_readings=True)

    def on_ack(self, session, ack, rows: list | None = None) -> None:
        """A ``CapAck`` arrived on ``session`` (``rows``: its read-backs decoded and checked,
        :func:`capctl.security.limits.ack_rows`; None: decoded here)."""
        now = self.registry.clock()
        seq = ack.seq
        sent = session.sent.pop(seq, None)
        self.registry.on_ack(session.node, ack, sent[1] if sent else None, rows)
        if sent is not None:
            rtt_s = now - sent[0]
            self.rtt_s.append(rtt_s)
            control_s = now - sent[3] if sent[3] > -1e17 else None
            if control_s is not None:
                self.control_s.append(control_s)
            if self.metrics is not None:
                self.metrics.observe_ack(rtt_s, control_s)
        if not ack.ok:
            self._warn_ack(session.node, ack, now)
        fut = session.waiters.pop(seq, None)
        if fut is not None and not fut.done():
            fut.set_result(ack)

    def _warn_ack(self, node: str, ack, now: float) -> None:
        """Log a ``CapAck`` that says its plan was not fully applied: at most one line per node per
        :data:`ACK_WARN_EVERY_S` (s, registry clock), with how many were not logged since (a node
        whose every plan fails, e.g. plans arriving after their lease expiry on a skewed clock,
        wrote one line per interval for ever)."""
        last, quiet = self._ack_warned.get(node, (-math.inf, 0))
        if now - last < ACK_WARN_EVERY_S:
            self._ack_warned[node] = (last, quiet + 1)
            return
        self._ack_warned[node] = (now, 0)
        more = f" ({quiet} more such acknowledgement(s) of this node not logged since)" if quiet else ""
        log.warning("agent %s: plan %d not fully applied: %s%s", node, ack.seq,
                    limits.printable(ack.error) or "no reason given", more)

    def first_report(self, node: str) -> bool:
        """True once for a node's first telemetry on a new stream (HA only; see :meth:`attach`)."""
        if node in self._fresh_streams:
            self._fresh_streams.discard(node)
            return True
        return False

    def wake(self) -> None:
        """Run the next interval early (job events, admin changes)."""
        if self._wake is not None:
            self._wake.set()

    def send_plan(self, node_name: str, phase: str, caps: dict[int, float], safe: dict[int, float],
                  dry_run: bool = False, wait: ackwait.AckWait | None = None, safe_rows: bytes | None = None):
        """Queue one ``CapPlan`` to a node. Returns None when the node has no stream; else, for a
        "decrease" (phase 1 waits for it), a future resolved with its ``CapAck`` (or None if the
        stream closes) — with ``wait``, a waiter of it instead (:mod:`coordinator.ackwait`) — and
        True for the other phases (nothing waits on them: no future made, one less object per
        agent per interval). ``safe_rows``: ``safe`` checked and packed already
        (:func:`coordinator.planmsg.packed_rows`), or None.

        A plan to an agent that reads packed plans is made by :func:`coordinator.planmsg.packed_plan`
        (one constructor call); the plans older than :data:`SENT_MEMORY_S` are looked
        for only when the session's oldest one is (:meth:`_forget_sent`), not at every plan.
        Measured 7 Dec 2026 (bench/interval_cost.py, 8,000 GPUs, medians of 3 runs on the shared
        2-core host, +-15 % noise), with :mod:`coordinator.ackwait` and the failsafe caps packed
        at once (:meth:`_send`): stage ``send`` 6.8 -> 6.1 us per GPU."""
        node = self.registry.nodes.get(node_name)
        if node is None or node.session is None or not self.may_send():
            return None
        session = node.session
        seq = node.next_seq
        node.next_seq += 1
        now = self.registry.clock()
        lease_s = self.lease_s
        try:
            if node.packed_plans:
                msg = planmsg.packed_plan(node_name, caps, safe, seq, phase, self.lease_clock_s() + lease_s, lease_s,
                                          dry_run, self.term, self._snapshot_time_s, safe_rows)
            else:
                msg = planmsg.cap_plan(
                    self._safe_caps_cache, node_name, caps, safe, seq=seq, phase=phase,
                    lease_expiry_s=self.lease_clock_s() + lease_s, lease_s=lease_s, dry_run=dry_run, term=self.term,
                    snapshot_time_s=self._snapshot_time_s)
        except ValueError as exc:  # a cap that is no number of watts: this node's plan only, never sent
            log.error("capctl bug: plan %d for node %s not sent: %s", seq, node_name, exc)
            return None
        gpus = node.gpus
        for i, c in caps.items():
            g = gpus.get(i)
            if g is None:
                continue
            pending = g.pending
            pending[seq] = c
            if len(pending) > MAX_PENDING_PER_GPU:
                v = pending.pop(min(pending))
                nxt = min(pending)
                pending[nxt] = max(pending[nxt], v)
        for i, s in safe.items():
            g = gpus.get(i)
            if g is not None:
                g.safe_cap_w = s
        sent = session.sent
        if caps:  # a hold is not acknowledged (docs/protocol.md): nothing to match an ack with
            sent[seq] = (now, dict(caps), phase, node.last_telemetry_mono)
        if sent and now - next(iter(sent.values()))[0] > SENT_MEMORY_S:
            self._forget_sent(session, now)
        if not session.send(msg):
            return None
        fut = True
        if phase == "decrease":  # (after the send: a plan not queued is not waited for)
            fut = asyncio.get_running_loop().create_future() if wait is None else wait.waiter()
            session.waiters[seq] = fut
        if self.metrics is not None:
            self.metrics.plan_sent(phase)
        return fut

    @staticmethod
    def _forget_sent(session, now: float) -> None:
        """Stop waiting for the acknowledgements of ``session``'s plans sent more than
        :data:`SENT_MEMORY_S` before ``now`` (s, registry clock); their waiters get None. Called
        when the oldest plan kept (the first in ``session.sent``: plans are kept in the order
        sent, on the registry's monotonic clock) is that old."""
        for old in [s for s, v in session.sent.items() if now - v[0] > SENT_MEMORY_S]:
            session.sent.pop(old, None)
            w = session.waiters.pop(old, None)
            if w is not None and not w.done():
                w.set_result(None)

    # -- the loop -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Tick every interval until ``stop`` is set; an early :meth:`wake` ticks sooner.

        While it runs, the cyclic garbage collector's young-generation threshold is raised to
        :data:`GC_THRESHOLDS` (restored on return): an interval over thousands of GPUs allocates
        ~10^5 short-lived objects (telemetry samples, plan messages), and with the default (700)
        the collector's passes cost more than the interval's own work (measured: ~100 ms of a
        ~350 ms interval at 8,000 GPUs, bench/control_loop.py). The oldest generation's threshold
        is raised too (a full collection after 100 young-middle ones instead of 10): a full pass
        over the daemon's heap holds the event loop for its whole length, measured 0.36 s of CPU
        (gc.callbacks, thread CPU) at 1,000 agents / 8,000 GPUs, once every ~20 intervals with
        the default, i.e. one interval in 20 late by that much. Cyclic garbage lives up to ~10x
        longer (RSS: bench/control_loop.py reports it)."""
        old_gc = gc.get_threshold()
        gc.set_threshold(*(max(a, b) for a, b in zip(GC_THRESHOLDS, old_gc)))
        try:
            await self._run(stop)
        finally:
            gc.set_threshold(*old_gc)

    async def _run(self, stop: asyncio.Event) -> None:
        """Regular ticks on a fixed grid (:mod:`coordinator.tickphase`: the agents time their reports
        to land just before them); an early :meth:`wake` ticks in between without moving the grid."""
        self._wake = asyncio.Event()
        self._next_tick_mono = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            regular = now >= self._next_tick_mono - 1e-3
            if regular:  # the grid moves on one interval (more when the last one took longer)
                self._next_tick_mono = tickphase.next_grid_tick(self._next_tick_mono, now, self.interval_s,
                                                                self._busy_s)
                await self._await_reports(now + REPORT_GRACE * self.interval_s)
            self._last_tick_mono = time.monotonic()
            self._wake.clear()  # before the tick: a wake-up during it (a node's first report) is not lost
            self._reported.clear()  # reports from now on count for the next snapshot
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 (the loop must survive any one interval)
                log.exception("reconcile interval failed")
                self.persistent_alerts["tick"] = f"reconcile interval failed: {type(exc).__name__}: {exc}"
            else:
                self.persistent_alerts.pop("tick", None)
            if regular:
                self._busy_s = time.monotonic() - self._last_tick_mono
                self._note_busy(self._busy_s)
            await self._wait_tick(stop)

    def _note_busy(self, busy_s: float) -> None:
        """The last regular reconcile took ``busy_s`` (s): after :data:`OVERLOAD_TICKS` in a row
        longer than the interval (the grid then stretches, :func:`coordinator.tickphase.next_grid_tick`:
        caps follow loads later than the policy says) a persistent alert says so and what to do,
        logged once; it clears at the first reconcile within the interval."""
        interval = self.interval_s
        self._overruns = self._overruns + 1 if busy_s > interval else 0
        if self._overruns < OVERLOAD_TICKS:
            if self.persistent_alerts.pop("overload", None) is not None:
                log.info("coordinator no longer overloaded: the last reconcile took %.2f s of %g s", busy_s, interval)
            return
        gpus = sum(len(n.gpus) for n in self.registry.nodes.values())
        text = (f"coordinator overloaded: the last {self._overruns} reconciles took longer than the {interval:g} s "
                f"interval (the last {busy_s:.2f} s, {gpus} GPUs), so every interval stretches to "
                f"~{busy_s * (1 + tickphase.BUSY_MARGIN):.2f} s and caps follow loads that much later: raise "
                f"interval_s to {math.ceil(2 * busy_s):g} s or more, or give the coordinator a faster core "
                "(docs/coordinator.md, \"Cost per GPU\")")
        if "overload" not in self.persistent_alerts:
            log.warning("%s", text)
        self.persistent_alerts["overload"] = text

    async def _wait_tick(self, stop: asyncio.Event) -> None:
        """Wait for the next grid tick, an early :meth:`wake` (at least :data:`MIN_TICK_SPACING` of an
        interval after the last tick) or ``stop``. (Deferring a wake-up that comes just before a
        grid tick to that tick slowed the straggler test's convergence: test_observed_state.)"""
        while not stop.is_set():
            interval = self.interval_s
            remaining = self._next_tick_mono - time.monotonic()
            if remaining > interval:  # the policy shortened the interval: never wait longer than one
                self._next_tick_mono = time.monotonic() + interval
                continue
            if remaining <= 0:  # (after an overrun: at once; the reports advised for this point are in)
                return
            waiter = asyncio.ensure_future(self._wake.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
            if self._wake.is_set():
                early = self._last_tick_mono + MIN_TICK_SPACING * interval
                if time.monotonic() < early:
                    await asyncio.sleep(early - time.monotonic())
                return

    async def _await_reports(self, deadline_mono: float) -> None:
        """Wait (until ``deadline_mono``, monotonic s, at the latest) for a report from every live
        stream since the last snapshot (see :data:`REPORT_GRACE`)."""
        expected = sum(1 for n in self.registry.nodes.values() if n.session is not None)
        if len(self._reported) >= expected or time.monotonic() >= deadline_mono:
            return
        self._expected_reports = expected
        self._reports_in = asyncio.Event()
        try:
            await asyncio.wait_for(self._reports_in.wait(), deadline_mono - time.monotonic())
        except asyncio.TimeoutError:
            pass
        finally:
            self._reports_in = None

    def note_clock(self, node: str, timestamp_s: float) -> None:
        """A valid ``NodeTelemetry`` of ``node`` sent at ``timestamp_s`` (its agent's wall clock,
        Unix s; 0 or not finite: not known) arrived: how far that clock is ahead of the lease clock
        (``NodeObs.clock_ahead_s``, the clock alert of :func:`coordinator.decide.watch_alerts`)."""
        n = self.registry.nodes.get(node)
        if n is not None:
            ok = math.isfinite(timestamp_s) and timestamp_s > 0
            n.clock_ahead_s = timestamp_s - self.lease_clock_s() if ok else math.nan

    def note_report(self, node: str) -> None:
        """A valid ``NodeTelemetry`` of ``node`` arrived (server.py): counted for the next snapshot."""
        self._reported.add(node)
        if self._reports_in is not None and len(self._reported) >= self._expected_reports:
            self._reports_in.set()

    def report_in_s(self, node: str) -> float:
        """``CapPlan.report_in_s`` for ``node`` now (s; 0.0 before the loop runs): when its next
        report should be sent to land before the next grid tick (:func:`coordinator.tickphase.report_in_s`)."""
        return tickphase.report_in_s(self._next_tick_mono, time.monotonic(), node, self.interval_s)

    # -- one interval: snapshot -> decide -> send ----------------------------------------------
    async def tick(self) -> None:
        """One reconcile interval (see module docstring): I/O around :mod:`coordinator.decide`.

        Feeds the models, snapshots the problem, solves it in a worker thread, re-reads the fleet's
        accounting (acknowledgements arrive during the solve), decides, sends phase 1, waits for its
        acknowledgements (at most :meth:`ack_wait_s`), sends phase 2, then publishes the view."""
        if not self.may_send():
            return  # an HA standby: the leader decides (coordinator/election.py)
        t0 = time.monotonic()
        self._snapshot_time_s = self.lease_clock_s()
        if self.policy is not self._tick_policy:
            self._ticks_since_policy = 0
        self._tick_policy = self.policy
        problem = self._observe_problem()
        solution = await self._solve(problem)
        self._record_solution(solution)
        decision = decide.plan(solution, self._observations(problem))
        self._over_ticks = self._over_ticks + 1 if decision.counted_over else 0
        if decision.waiting:
            log.debug("holding caps until %s report(s)", ", ".join(sorted(decision.waiting)))
        plans_sent = await self._send(decision, problem.inputs)
        self._ticks_since_policy += 1
        await asyncio.sleep(0)  # the stream writers start this interval's last plans before the bookkeeping below
        self._after_plans(decision)
        self.tick_count += 1
        self._publish(problem.inputs, solution.out, solution.desired_w, list(decision.alerts), time.monotonic() - t0,
                      plans_sent)

    async def _solve(self, problem: decide.Problem) -> decide.Solution:
        """:func:`coordinator.decide.solve` of ``problem``: on the event loop when the last solve took
        at most :data:`INLINE_SOLVE_FRACTION` of an interval of CPU, else in a worker thread (the
        first one too), so that a large fleet's solve does not hold the loop. The solve's CPU
        seconds (its thread's ``time.thread_time``) decide the next one's place.

        Why not always the thread: the solve is many short numpy calls that release and retake the
        GIL, and while the loop is busy with the streams each retake waits up to the interpreter's
        switch interval (5 ms), so the thread's wall time is many times its CPU time. Measured at
        1,000 agents (8,000 GPUs) on a loaded 2-core host: 0.07-0.83 s wall per solve for ~0.1 s of
        CPU (the worker thread's 0.05-0.06 cores over 1.3-1.8 s reconciles), all of it in the report
        -> plan path."""
        if self._solve_cpu_s <= INLINE_SOLVE_FRACTION * self.interval_s:
            return self._timed_solve(problem)
        return await asyncio.to_thread(self._timed_solve, problem)

    def _timed_solve(self, problem: decide.Problem) -> decide.Solution:
        """:func:`coordinator.decide.solve`, recording its CPU seconds in ``_solve_cpu_s`` (any thread)."""
        t0 = time.thread_time()
        try:
            return decide.solve(problem)
        finally:
            self._solve_cpu_s = time.thread_time() - t0

    def _observe_problem(self) -> decide.Problem:
        """Feed the telemetry received since the last interval to the models, then snapshot the problem."""
        policy = self.policy
        reg = self.registry
        self.models.memory_bound_share = getattr(getattr(policy, "models", None), "memory_bound_share", "estimate")
        self.models.update(reg, policy.interval_s)
        self.models.forget_missing(reg)
        problem = observe.problem(reg, self.models, policy, reg.clock(), self.lease_s, self.ack_memory_s())
        return dataclasses.replace(problem, own_clock=self.own_clock())

    def own_clock(self) -> tuple[float, float]:
        """(s the lease clock is behind this host's wall clock now, the lease s): the coordinator's
        clock alert (:func:`coordinator.decide.watch_alerts`)."""
        return time.time() - self.lease_clock_s(), self.lease_s

    def _observations(self, problem: decide.Problem) -> decide.Observations:
        """``problem`` with the fleet's accounting and the settings in force now."""
        return observe.observations(self.registry, problem, self.registry.clock(), dry_run=self.dry_run,
                                    lease_s=self.lease_s, interval_s=self.interval_s,
                                    ack_memory_s=self.ack_memory_s(), start_s=self._start_clock,
                                    limits_changed=(self._ticks_since_policy < planner.EXACT_DECREASE_TICKS
                                                    or self._over_ticks >= planner.OVER_AGAIN_TICKS))

    def _record_solution(self, solution: decide.Solution) -> None:
        """Log the watch alerts (once) and a failed solve; record the solve's duration (s)."""
        self._note_watch(dict(solution.watch))
        out = solution.out
        if out is None:
            log.error("solve failed: %s; holding every cap", solution.error)
            self.models.idle_grants.clear()  # (no grant this interval: the history would be stale)
            return
        self.models.idle_grants.record(out.idle_grant_w)  # (coordinator.idlegrants: the next solve's input)
        self.solve_s.append(out.solve_s)
        if self.metrics is not None:
            self.metrics.observe_solve(out.solve_s)

    async def _send(self, decision: decide.Decision, inputs) -> int:
        """Send ``decision``'s plans (``inputs``: its problem's); returns how many were sent. Holds
        only unless the decision is APPLY."""
        if decision.mode != decide.APPLY:
            dry = decision.mode == decide.DRY_RUN
            for n in decision.live_nodes:
                self.send_plan(n, "hold", {}, {} if dry else decision.safe_for(n), dry_run=dry)
            return len(decision.live_nodes)
        rows = planmsg.packed_rows(decision.safe_caps).get  # every node's failsafe caps packed at once
        sent, held_early = await self._send_phase1(decision, rows)
        inc = {} if decision.hold_increases or self._policy_changed() else \
            decide.plan_increases(decision, self._fleet_state(inputs))
        if inc and self._ledger_below(inc):  # write-ahead: a restart must count these caps even for nodes not back yet
            inc = await self._write_ahead(inc)
        inc_by_node = decide.increases_by_node(inc)
        for n in decision.live_nodes:
            if n in inc_by_node:
                self.send_plan(n, "increase", inc_by_node[n], decision.safe_for(n), safe_rows=rows(n))
                sent += 1
            elif n not in decision.decreases and n not in held_early:
                self.send_plan(n, "hold", {}, decision.safe_for(n), safe_rows=rows(n))
                sent += 1
        return sent

    async def _write_ahead(self, inc: dict) -> dict:
        """Write the node ledger ahead of the increases ``inc`` ((node, index) -> cap W) and return
        those that may be sent: the ones the saved ledger now counts at or above their cap. When
        the write fails (etcd without a quorum, a locked database: :class:`StoreError`, alert
        "node ledger not saved"), an increase above the ledger saved last is held; the next
        interval plans and writes it again.

        Why: a successor (a failover, a restart) restores the ledger and counts each node at its
        caps there, from the agent's hello until its first telemetry (a ledger record is a
        reading: :meth:`Registry.restore_ledger`); a cap sent above it is enforced but not
        counted, and the successor's first plans raise other GPUs into those watts. Found with
        the journal of tests/ha/test_failover.py (etcd quorum lost): the leader's write-ahead
        timed out and its increases went out anyway (seen: n2's GPUs 2-3 sent 403.74 W, enforced
        402.76 W, the ledger kept 401.28 W), so the new leader counted them below their enforced
        limits and raised other GPUs: 2,801.9 W on the 2,800 W cluster for 273 ms in one run.
        Without a usable store (none, or it failed to open) no ledger is restored: every increase
        is sent."""
        if self.store is None or not self.store.ok:
            return inc
        pending = self._save_ledger(inc, high_water=True)
        if pending is not None:  # etcd: in the store worker; reports are handled meanwhile
            await asyncio.wait([pending])
        # _ledger_w is what the store holds: set by _ledger_saved on success only (inline, or a
        # done callback of ``pending`` run before this wait returns; were it not, the increases
        # would only be held once more)
        saved = self._ledger_w
        held = [k for k, cap_w in inc.items() if cap_w > saved.get(k, -math.inf)]
        if not held:
            return inc
        log.warning("node ledger not saved: %d increase(s) held until it is (%s)", len(held),
                    ", ".join(f"{n}/{i}" for n, i in sorted(held)[:4]) + (", ..." if len(held) > 4 else ""))
        return {k: cap_w for k, cap_w in inc.items() if cap_w <= saved.get(k, -math.inf)}

    def _policy_changed(self) -> bool:
        """True when the policy in force is not the one this interval started with (``budget set``
        or a reload landed during its solve or its phase-1 wait): its increases were planned under
        the old limits, so none is sent (the change woke the loop: the next interval plans them
        under the new ones). Found by a test: a budget cut acknowledged to the admin, then an
        increase under the old budget 12 W over the new one for 85 ms (the devices' journal)."""
        if self.policy is self._tick_policy:
            return False
        log.info("policy changed during the interval: its increases are left to the next one")
        return True

    async def _send_phase1(self, decision: decide.Decision, rows) -> tuple[int, frozenset]:
        """Send the decreases; while any is in flight, hold the nodes with nothing to raise now
        (same plan, same safe caps, sooner: should one become a candidate during the wait, it also
        gets its increase plan) and wait for the acknowledgements (at most :meth:`ack_wait_s`, s).
        ``rows``: node -> its failsafe caps packed, or None (:func:`coordinator.planmsg.packed_rows`).
        Returns (plans sent, nodes held early)."""
        wait = ackwait.AckWait()
        safe_for = decision.safe_for
        for n, caps in decision.decreases.items():
            self.send_plan(n, "decrease", caps, safe_for(n), wait=wait, safe_rows=rows(n))
        sent = len(decision.decreases)
        if not wait.made:
            return sent, frozenset()
        for n in decision.early_holds:
            self.send_plan(n, "hold", {}, safe_for(n), safe_rows=rows(n))
        await asyncio.wait([wait.all_done], timeout=self.ack_wait_s())
        return sent + len(decision.early_holds), frozenset(decision.early_holds)

    def _fleet_state(self, inputs) -> decide.FleetState:
        """The fleet's accounting now, for the GPUs of ``inputs`` (the interval's problem)."""
        return observe.fleet_state(self.registry, inputs, self.registry.clock(), self.lease_s,
                                   self.ack_memory_s(), with_nodes=False)

    def _after_plans(self, decision: decide.Decision) -> None:
        """Rewrite the node ledger when due, forget long-silent nodes."""
        reg = self.registry
        nodes = reg.nodes
        have = _HAVE_READING
        reporting = frozenset([n for n, node in nodes.items() if any(map(have, node.gpus.values()))])
        if time.monotonic() - self._ledger_mono > LEDGER_PERIOD_S or reporting != self._ledger_nodes:
            self._save_ledger({})
            self._ledger_nodes = reporting
        for name in reg.forget_silent(NODE_FORGET_S, keep=self.policy.node_names):
            self._safe_caps_cache.forget(name)
            log.warning("node %s forgotten: no agent contact for %.0f s", name, NODE_FORGET_S)

    def _watch_alerts(self, now: float) -> list[str]:
        """The configuration alerts of the registry at ``now`` (s) (:func:`coordinator.decide.watch_alerts`),
        each logged at WARNING once (again only after it cleared and came back)."""
        reg = self.registry
        found = decide.watch_alerts(self.policy, observe.node_gpus(reg), reg.replacements(REPLACED_WINDOW_S, now),
                                    observe.clocks_ahead(reg, now, self.lease_s), self.own_clock())
        self._note_watch(found)
        return list(found.values())

    def _note_watch(self, found: dict) -> None:
        """Log the alerts of ``found`` (key -> text) not already logged; forget the cleared ones."""
        for key, text in found.items():
            if key not in self._warned:
                log.warning("%s", text)
        self._warned = set(found)
    def _ledger_below(self, planned: dict) -> bool:
        """True when the saved ledger counts some GPU of ``planned`` ((node, index) -> W) below its
        planned cap, i.e. the write-ahead before these increases is needed."""
        saved = self._ledger_w
        return any(cap_w > saved.get(key, -math.inf) for key, cap_w in planned.items())

    def _save_ledger(self, planned: dict, high_water: bool = False):
        """Persist the node ledger: each GPU at max(accounted, ``planned`` cap) (W).

        ``high_water`` (the write-ahead before increases): each GPU also keeps at least the value
        the ledger saved for it since the last full rewrite (at most :data:`LEDGER_PERIOD_S` ago),
        so a cap that goes down and back up within that time needs no new write (measured at
        1,000 agents with loads moving every few intervals: a write of ~8,000 GPUs in most intervals
        before). Counting a GPU higher after a restart only holds back watts until its agent
        reports (spent, never free: docs/protocol.md).

        An etcd store writes in the store worker (:mod:`coordinator.storeio`): returns its asyncio
        future (None when written inline or skipped); a periodic rewrite is skipped while a store
        call is still pending (the next interval retries), so a stalled etcd queues none.

        A full rewrite lowers what the saved ledger is taken to count (``_ledger_w``) to the lower
        of the old and the new values as it is submitted: in the store worker it can land after an
        increase that was checked against the old ledger (no write-ahead: the old value covered it)
        and replace that value with a lower one (a GPU accounted lower at the rewrite than the cap
        then sent); a successor restoring it counted that GPU below its enforced limit (found by a
        review of the write-ahead, tests/coordinator/test_ledger_write_ahead.py)."""
        if self.store is None or not self.store.ok:
            return None
        if not high_water and self.store_io is not None and self.store_io.pending:
            return None
        ledger, saved = ledger_rows(self.registry, self.registry.clock(), self.ack_memory_s(), planned,
                                    self._ledger_w if high_water else {})
        if not high_water:  # in flight, this rewrite may land after increases checked against the older ledger
            self._ledger_w = {k: min(w, saved[k]) for k, w in self._ledger_w.items() if k in saved}
        return self.store_write(self.store.save_nodes, ledger,
                                done=lambda _r, exc: self._ledger_saved(saved, high_water, exc))

    def _ledger_saved(self, saved: dict, high_water: bool, exc) -> None:
        """The node ledger write of ``saved`` ((node, index) -> W) ended (``exc``: its error, or None)."""
        if exc is None:
            self._ledger_w = saved
            if not high_water:
                self._ledger_mono = time.monotonic()
            if self.persistent_alerts.get("store", "").startswith("node ledger"):
                self.persistent_alerts.pop("store", None)
            return
        self.persistent_alerts["store"] = (f"node ledger not saved ({exc}): after a restart, nodes not yet reconnected "
                                           "are not counted; no cap is raised above the ledger saved last until it is saved")
        log.error("%s", exc)

    # -- views ----------------------------------------------------------------------------------
    def _publish(self, inputs, out, desired, alerts, tick_s, plans_sent) -> None:
        """Swap in this interval's view: a snapshot of what it shows is taken now (cheap: one tuple
        per GPU); the status reply and metric extras are built from it when first read
        (:class:`~coordinator.view.LazyView`, :func:`build_view`)."""
        reg = self.registry
        now = reg.clock()
        ack_mem = self.ack_memory_s()
        lease = self.lease_s
        nodes = []
        # one pass over each GPU's record (its fields and accounted cap while it is in cache: a
        # gather of the accounting columns, one pass per field, cost more at 100,000 GPUs; read as
        # columns, gpucolumns' one-pass gather with the row tuples made when the view is built,
        # stage "after" measured 2.82 -> 3.13 us per GPU at 8,000, 7 Dec 2026, and the stages after
        # it slower too); the throttling lanes are kept per node and counted per GPU when the view is read
        for name in sorted(reg.nodes):
            node = reg.nodes[name]
            gpus = node.gpus
            rows = [(_GPU_FIELDS(g), g.accounted_w(now, ack_mem)) for g in map(gpus.__getitem__, sorted(gpus))]
            nodes.append((name, node.stale(now, lease), node.last_report_mono, node.simulated,
                          tuple(node.bindings.values()), rows, node.throttle.counts(now)))
        snap = _Snapshot(
            policy=self.policy, dry_run=self.dry_run, policy_path=self.policy_path, coordinator_id=self.coordinator_id,
            now=now, time_s=time.time(), nodes=nodes, job_energy_j={**reg.job_energy_j, **self.energy_book.energy_j()},
            persistent_alerts=list(self.persistent_alerts.values()), alerts=list(alerts), inputs=inputs, out=out,
            desired=desired, tick_s=tick_s, plans_sent=plans_sent,
            curve_kind=self.models.curve_kinds(desired),
            memory_bound=self.models.memory_bounds(),
        )
        self.view = LazyView(functools.partial(build_view, snap), tick_s, plans_sent)

    def status_reply(self, view=None) -> pb.StatusReply:
        """The latest interval's status (a copy); ``view``: that of an interval's view taken
        before (the admin service builds it off the event loop, then asks for its reply)."""
        reply = pb.StatusReply()
        reply.CopyFrom((self.view if view is None else view).status)
        # settings changed by an admin since the interval show at once
        reply.budget_w = self.policy.budget_w
        reply.interval_s = self.policy.interval_s
        reply.dry_run = self.dry_run
        reply.policy_path = self.policy_path
        live = self.energy_book.energy_j()  # the agents' latest reports, not the interval's snapshot
        for job in reply.jobs:
            job.energy_j = live.get(job.job_id, job.energy_j)
        if self.ha is not None:
            ha = self.ha.describe()
            reply.ha_role, reply.leader, reply.term = ha["role"], ha["leader"], ha["term"]
            reply.standbys.extend(ha["standbys"])
        return reply

    def on_job_ended(self, node_name: str, ended) -> None:
        """A ``JobEnded`` from ``node_name``: unbind, and when no node holds the job any more, keep
        its :class:`~coordinator.finished.FinishedJob` (a store error becomes an alert)."""
        reg = self.registry
        job_id = ended.job_id
        self.energy_book.on_job_ended(node_name, ended)  # authoritative: sent once per end (a requeued job: its last run)
        bindings = reg.jobs().get(job_id, [])
        reg.on_job_ended(node_name, job_id)
        if any(job_id in n.bindings for n in reg.nodes.values()):
            return  # still running on other nodes
        if not bindings and job_id not in self.energy_book.jobs:
            return  # an unknown job, or a repeated JobEnded
        self._finish(job_id, bindings)

    def on_energy(self, node_name: str, tele) -> None:
        """The ``job_energy`` of a ``NodeTelemetry`` (coordinator.jobenergy); an ended job's record
        (repeated by its agent after a reconnect: its JobEnded was lost) finishes the job once no
        node holds it. A record that ended after the binding of that job on ``node_name`` began is
        that node's end of it (its JobEnded was dropped while the link came up, after the hello
        had bound it again: found by a test, the job stayed bound for ever); a requeued run bound
        since is left alone (its binding began after the record's end). A report without records
        (no job running there) returns at once (~1 us a report; measured 7 Dec 2026)."""
        if not tele.job_energy:
            return
        check = self._is_finished if self.store_io is None else functools.partial(self._is_finished_later, node_name, tele)
        for job_id in self.energy_book.on_telemetry(node_name, tele, check):
            node = self.registry.nodes.get(node_name)
            b = node.bindings.get(job_id) if node is not None else None
            end_s = max((je.end_time_s for je in tele.job_energy if je.job_id == job_id), default=0.0)
            if b is not None and end_s >= b.start_time_s:
                self.on_job_ended(node_name, pb.JobEnded(job_id=job_id, node=node_name))
            elif not any(job_id in n.bindings for n in self.registry.nodes.values()):
                self._finish(job_id, [])

    def _is_finished_later(self, node_name: str, tele, job_id: str) -> bool:
        """:meth:`_is_finished` for an etcd store, without a read on the loop: a job not known either
        way is looked up in the store worker and its records in ``tele`` are taken (or dropped,
        when it is kept) once the store answered; meanwhile they count as kept."""
        if job_id in self._finished_ids:
            return True
        if job_id in self._finished_absent:
            return False
        lookups = self._finished_lookups
        if job_id not in lookups:
            if len(lookups) >= 10_000:
                return False  # a stalled store and that many repeated ends: take them (as on a store error)
            lookups[job_id] = []
            self.store_write(self.finished.get, job_id, done=lambda rec, exc: self._looked_up(job_id, rec, exc))
        mine = [je for je in tele.job_energy if je.job_id == job_id and je.end_time_s > 0]
        lookups[job_id].append((node_name, pb.NodeTelemetry(node=node_name, job_energy=mine)))
        return True

    def _looked_up(self, job_id: str, rec, exc) -> None:
        """The store's answer for ``job_id`` (:meth:`_is_finished_later`): kept, or its records taken
        now (also after a store error, as :meth:`_is_finished` does)."""
        replay = self._finished_lookups.pop(job_id, [])
        if exc is None and rec is not None:
            self._remember_finished(job_id)
            return
        self._finished_absent[job_id] = None
        while len(self._finished_absent) > 100_000:
            self._finished_absent.popitem(last=False)
        for node_name, tele in replay:
            self.on_energy(node_name, tele)

    def _is_finished(self, job_id: str) -> bool:
        """True when ``job_id``'s finished record is kept (remembered: one store read per job)."""
        from coordinator.store import StoreError

        if job_id in self._finished_ids:
            return True
        try:
            kept = self.finished.get(job_id) is not None
        except StoreError:
            return False
        if kept:
            self._remember_finished(job_id)
        return kept

    def _remember_finished(self, job_id: str) -> None:
        self._finished_absent.pop(job_id, None)
        self._finished_ids[job_id] = None
        while len(self._finished_ids) > 100_000:
            self._finished_ids.popitem(last=False)

    def _finish(self, job_id: str, bindings: list) -> None:
        """Keep ``job_id``'s finished record (its bindings: user, partition, nodes, GPUs)."""
        from coordinator.store import StoreError

        record = self.energy_book.finish(job_id, bindings, time.time())
        self._remember_finished(job_id)

        def saved(_r, exc) -> None:
            if exc is None:
                self.persistent_alerts.pop("finished", None)
                return
            self.persistent_alerts["finished"] = f"finished job {job_id} not saved: {exc}"
            log.error("%s", exc)
        self.store_write(self.finished.put, record, done=saved)  # etcd: in the store worker
        from coordinator.metrics import FINISHED_EXPORT_MAX, FINISHED_EXPORT_S

        # a new tuple each time: the exporter thread reads whichever one is current
        keep = [r for r in self.recent_finished if r[2] >= record.end_time_s - FINISHED_EXPORT_S and r[0] != job_id]
        self.recent_finished = tuple([(job_id, record.energy_j, record.end_time_s), *keep][:FINISHED_EXPORT_MAX])
        log.info("job %s finished: %.1f J on %d GPU(s), %.1f GPU-s", job_id, record.energy_j, record.gpus,
                 record.gpu_s)

    def finished_jobs(self, request) -> pb.FinishedJobsReply:
        """Admin.FinishedJobs: the kept finished jobs (newest first; see ``FinishedJobsRequest``);
        reads the store on the caller's thread (the servicer: :meth:`finished_jobs_async`).

        Raises:
            coordinator.store.StoreError: the store cannot be read.
        """
        return self._finished_reply(request, self._finished_rows(request))

    async def finished_jobs_async(self, request) -> pb.FinishedJobsReply:
        """:meth:`finished_jobs` with the store read off the loop for an etcd store."""
        return self._finished_reply(request, await self.store_read(self._finished_rows, request))

    def _finished_rows(self, request) -> list:
        """The store's records for ``request`` (blocks on the store: thread-safe, reads no registry)."""
        from coordinator.finished import MAX_LIST

        limit = int(request.limit) or MAX_LIST
        if request.job_id:
            rec = self.finished.get(request.job_id)
            return [rec] if rec is not None and rec.end_time_s >= request.since_s else []
        return self.finished.since(request.since_s, limit)

    def _finished_reply(self, request, rows: list) -> pb.FinishedJobsReply:
        from coordinator.finished import MAX_LIST

        limit = int(request.limit) or MAX_LIST
        running = bool(request.job_id) and not rows and request.job_id in self.registry.jobs()
        return pb.FinishedJobsReply(jobs=[r.to_proto() for r in rows[:limit]], job_running=running)

    def explain(self, job_id: str) -> pb.ExplainReply | None:
        """Why ``job_id`` got its watts (or, once finished, what it used), or None when unknown."""
        view = self.view
        job = next((j for j in view.status.jobs if j.job_id == job_id), None)
        if job is None:
            return self._explain_finished(job_id)
        extra = view.jobs.get(job_id)
        reply = pb.ExplainReply(job=job, binding=job.binding)
        prices = {d.name: d for d in view.status.domains}
        gpus = []
        for n in view.status.nodes:
            for g in n.gpus:
                if g.job_id == job_id or job_id in g.job_ids:
                    gpus.append((n.name, g))
                    reply.gpus.add().CopyFrom(g)
        if extra is not None:
            for name in extra.domains:
                if name in prices:
                    reply.prices.add(domain=name, price_rate_per_w=prices[name].price_rate_per_w)
            if extra.slowest is not None:
                reply.slowest_node, reply.slowest_gpu_index = extra.slowest[0], extra.slowest[1]
        reply.text = explain_text(job, reply, gpus, view.status, extra.planned_slowest if extra is not None else None)
        return reply

    async def explain_async(self, job_id: str) -> pb.ExplainReply | None:
        """:meth:`explain`, with a finished job's record read off the loop for an etcd store."""
        if self.store_io is None or any(j.job_id == job_id for j in self.view.status.jobs):
            return self.explain(job_id)
        from coordinator.store import StoreError

        try:
            rec = await self.store_read(self.finished.get, job_id)
        except StoreError as exc:
            log.error("%s", exc)
            return None
        return self._explain_finished(job_id, rec)

    def _explain_finished(self, job_id: str, rec=False) -> pb.ExplainReply | None:
        """The ExplainReply of a finished job (None when not kept; a store error is logged);
        ``rec``: its record read already (None: not kept), else read here."""
        from coordinator.store import StoreError

        if rec is False:
            try:
                rec = self.finished.get(job_id)
            except StoreError as exc:
                log.error("%s", exc)
                return None
        if rec is None:
            return None
        job = pb.JobStatus(job_id=rec.job_id, nodes=list(rec.nodes), gpus=rec.gpus, energy_j=rec.energy_j,
                           user=rec.user, partition=rec.partition, account=rec.account)
        return pb.ExplainReply(job=job, finished=rec.to_proto(), text=explain_finished(rec))

    # -- admin -------------------------------------------------------------------------------
    async def set_budget(self, budget_w: float) -> pb.SetBudgetReply:
        """Set the cluster budget (W); persisted. Refused, with the deficit, below what the cluster
        needs at least (its GPUs' minimum caps), unless it raises a budget in force that is lower
        still (a reloaded facility limit, :meth:`_below_minimum_warning`): a move toward what the
        devices allow is not refused for being below it (the root limit and, under HA, a store that
        cannot save it still refuse), and is accepted with the same warning as such a reload."""
        need = self._minimum_needed_w()
        current = self.policy.budget_w
        if budget_w < need - NEED_TOLERANCE_W and budget_w < current:
            return pb.SetBudgetReply(
                ok=False, budget_w=current, deficit_w=need - budget_w,
                message=(f"refused: {format_watts(budget_w)} W is below the {format_watts(_up_w(need))} W the "
                         f"cluster needs at least (live GPUs at their minimum cap, stale nodes at their held caps); "
                         f"deficit {format_watts(max(0.01, _up_w(need - budget_w)))} W; budget stays {format_watts(current)} W"),
            )
        try:
            new_policy = self.file_policy.with_budget(budget_w)
        except UserInputError as exc:
            floor = _deficit_from_message(str(exc))
            return pb.SetBudgetReply(ok=False, budget_w=current, deficit_w=floor, message=f"refused: {exc}")
        msg = f"budget set to {format_watts(budget_w)} W (was {format_watts(current)} W)"
        if self.store is not None and self.store.ok:
            try:
                await self.store_read(self.store.set_budget_override, budget_w, self.file_policy.budget_w)
                self.persistent_alerts.pop("store", None)
                msg += f"; saved in {self.store.path}"
            except StoreError as exc:
                if self.ha is not None:  # HA: an admin change that is not in etcd would be lost on failover
                    return pb.SetBudgetReply(ok=False, budget_w=current, message=f"refused: not saved: {exc}")
                self.persistent_alerts["store"] = f"budget {format_watts(budget_w)} W in force but NOT persisted: {exc}"
                msg += f"; WARNING: not persisted ({exc}); a restart returns to {format_watts(self.file_policy.budget_w)} W"
        else:
            msg += "; WARNING: no state database, not persisted"
        self.policy = new_policy
        self.persistent_alerts.pop("budget", None)  # (an override in doubt at a takeover: settled)
        self.persistent_alerts.pop("etcd-data", None)  # (the admin set the budget again)
        msg += self._below_minimum_warning(need) + self._above_maximum_warning(budget_w)
        log.info("%s", msg)
        self.wake()
        return pb.SetBudgetReply(ok=True, budget_w=budget_w, deficit_w=max(0.0, need - budget_w), message=msg)

    def _above_maximum_warning(self, budget_w: float) -> str:
        """"; WARNING: ..." when ``budget_w`` (W) is more than the policy's nodes may draw at all
        (:func:`coordinator.allocation.maximum_draw_w`): a typo (40,000 W for 5,600 W of GPUs) was
        taken without a word (found by a try-out); "" otherwise or with no GPU known."""
        inputs = allocation.build_inputs(self.registry, self.models, self.policy, self.registry.clock(),
                                         self.lease_s, self.ack_memory_s())
        most = allocation.maximum_draw_w(inputs)
        if not most or budget_w <= most + 1e-6:
            return ""
        return (f"; WARNING: {format_watts(budget_w)} W is more than the {format_watts(_up_w(most))} W the policy's "
                f"nodes may draw at their maximum limits (its known GPUs, and the declared maximum of nodes that "
                f"have not reported): this budget limits nothing")

    async def reload_policy(self, path: str) -> pb.ReloadPolicyReply:
        """Load and validate a policy file; on success it replaces the policy, else nothing changes."""
        from capctl.policy import PolicyError

        target = path or self.policy_path
        if not target:
            return pb.ReloadPolicyReply(ok=False, errors=["no policy file: the coordinator runs the embedded default"],
                                        message="nothing to reload")
        if self.ha is not None and path and self.policy_path and os.path.abspath(path) != os.path.abspath(self.policy_path):
            # each coordinator reads its own start file at a takeover: another file, loaded here, was
            # lost on failover (a lowered rack limit went back up; found by a review)
            why = (f"{path}: in high availability every coordinator reads its start file "
                   f"({self.policy_path}) when it takes over; edit that file on every head node and reload "
                   f"without a FILE")
            return pb.ReloadPolicyReply(ok=False, errors=[why], message="policy not reloaded")
        try:
            new, text = await asyncio.to_thread(_load_with_text, target)
        except PolicyError as exc:
            return pb.ReloadPolicyReply(ok=False, errors=list(exc.errors)[:200],
                                        message=f"policy {target} rejected; the policy from {self.file_policy.source} stays")
        except Exception as exc:  # noqa: BLE001 (a user file must never crash the daemon)
            return pb.ReloadPolicyReply(ok=False, errors=[f"{target}: {type(exc).__name__}: {exc}"],
                                        message="policy rejected; the previous one stays")
        self.file_policy = new
        self.policy_path = target
        saved_note = self._remember_reloaded(target, text)
        self.persistent_alerts.pop("policy", None)  # (a file that failed to load at a takeover: it loads now)
        self.persistent_alerts.pop("budget", None)  # (an override in doubt at a takeover: the file's rule now)
        self.persistent_alerts.pop("etcd-data", None)  # (the admin chose the policy in force)
        override = await self.store_read(self._read_override) if self.store is not None and self.store.ok else None
        self.policy = self._apply_override(new, override, read=False)
        if self.ha is not None:
            from coordinator import ha

            ha.check_failover_time(self)
        msg = f"policy {target} loaded: budget {format_watts(self.policy.budget_w)} W, interval {self.policy.interval_s:g} s"
        if self.policy.budget_w != new.budget_w:
            msg += f" (budget set by an admin; the file says {format_watts(new.budget_w)} W)"
        msg += self._below_minimum_warning() + saved_note
        log.info("%s", msg)
        self.wake()
        return pb.ReloadPolicyReply(ok=True, message=msg)

    def _below_minimum_warning(self, need: float | None = None) -> str:
        """"; WARNING: ..." when the budget in force is below what the cluster needs at least
        (:func:`coordinator.allocation.minimum_needed_w`), else "". A reload is not refused for it
        (``budget set`` is): the file may lower the budget for a facility limit, and its caps are
        then the lowest the devices allow, which is closer to it than the old budget's. ``need``:
        :meth:`_minimum_needed_w` computed already (W), else computed here."""
        need = self._minimum_needed_w() if need is None else need
        budget = self.policy.budget_w
        if budget >= need:
            return ""
        return (f"; WARNING: budget {format_watts(budget)} W is below the {format_watts(need)} W the cluster needs "
                f"at least (live GPUs at their minimum cap, stale nodes at their held caps): every GPU goes to its "
                f"minimum cap and {format_watts(need - budget)} W stay over the budget until GPUs go idle or the "
                f"budget is raised")

    def _minimum_needed_w(self) -> float:
        """What the fleet needs at least now (W, :func:`coordinator.allocation.minimum_needed_w`)."""
        inputs = allocation.build_inputs(self.registry, self.models, self.policy, self.registry.clock(),
                                         self.lease_s, self.ack_memory_s())
        return allocation.minimum_needed_w(inputs)


_HAVE_READING = operator.attrgetter("have_reading")


def ledger_rows(registry, now: float, ack_memory_s: float, planned: dict, floor: dict) -> tuple[dict, dict]:
    """The node ledger of ``registry`` at ``now`` (s), as :meth:`coordinator.store.Store.save_nodes`
    takes it (``{node: {"gpus": {index: [counted W, min_cap_w, max_cap_w, safe_cap_w]}, "seen_s": s}}``),
    and ``{(node, index): counted W}``. Each GPU counts at max(accounted cap, ``planned`` cap,
    ``floor`` value) (W; dicts keyed by (node, index)). Read as columns (:mod:`coordinator.gpucolumns`:
    one gather for the fleet instead of a ``GpuObs.accounted_w`` call per GPU: at 8,000 GPUs on a loaded
    2-core host the per-GPU loop was 5 % of the event loop's py-spy samples over 12 s with a rewrite,
    the whole rewrite 9 %: one interval's plans late by ~1 s)."""
    table = registry.gpu_table()
    keys = table.keys
    c = gpucolumns.gather(keys, table.gpus, gpucolumns.ACCOUNTING, table.static)
    acc = gpucolumns.accounted_w(c, now, ack_memory_s, gpucolumns.constraints_unusable(c["min_cap_w"], c["max_cap_w"]))
    for extra in (planned, floor):
        if extra:
            acc = np.maximum(acc, np.fromiter((extra.get(k, 0.0) for k in keys), float, len(keys)))
    counted = acc.tolist()
    rows = zip(keys, counted, c["min_cap_w"].tolist(), c["max_cap_w"].tolist(), c["safe_cap_w"].tolist())
    ledger: dict = {}
    for (name, idx), acc_w, lo, hi, safe in rows:
        entry = ledger.get(name)
        if entry is None:
            entry = ledger[name] = {"gpus": {}, "seen_s": registry.nodes[name].seen_s}
        entry["gpus"][idx] = [acc_w, lo, hi, safe]
    return ledger, dict(zip(keys, counted))


_GPU_FIELDS = operator.attrgetter(
    "index", "uuid", "have_reading", "power_w", "enforced_w", "temp_c", "slowdown_temp_c", "sm_clock_mhz", "reasons",
    "min_cap_w", "max_cap_w", "cap_state", "max_sm_clock_mhz", "utilization_pct", "energy_j", "error", "reading_live",
)
"""The GpuObs fields a view shows, read in one call (order: see :func:`build_view`)."""


def _throttle_of(lanes: tuple[int, int, int], index: int) -> tuple[int, int, int]:
    """GPU ``index``'s ``(samples, thermal, power)`` counts of its node's lane-packed window
    counts ``lanes`` (:meth:`coordinator.throttle.NodeThrottle.counts`)."""
    count = throttle.count
    return count(lanes[0], index), count(lanes[1], index), count(lanes[2], index)


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """What one interval's view shows, copied at the end of the interval (immutable inputs only)."""

    policy: object
    dry_run: bool
    policy_path: str
    coordinator_id: str
    now: float
    time_s: float
    nodes: list  # (name, stale, last_report_mono, simulated, bindings, [(GPU fields, accounted W)], throttle lanes)
    job_energy_j: dict
    persistent_alerts: list
    alerts: list
    inputs: object
    out: object
    desired: dict
    tick_s: float
    plans_sent: int
    curve_kind: dict = dataclasses.field(default_factory=dict)  # GPU key -> "generic" | "learned"
    memory_bound: dict = dataclasses.field(default_factory=dict)  # GPU key -> memory-bound share (membound)


@dataclasses.dataclass
class _Tally:
    """What :func:`build_view` gathers over the nodes (W, s, degC), for its job and domain rows."""

    accounted: dict = dataclasses.field(default_factory=dict)  # GPU key -> accounted cap (W)
    draw: dict = dataclasses.field(default_factory=dict)  # GPU key -> power draw (W; 0 without a live reading)
    extras: list = dataclasses.field(default_factory=list)  # GpuExtra per GPU
    node_means: list = dataclasses.field(default_factory=list)  # mean GPU temperature of each live node (degC)
    stale_age: dict = dataclasses.field(default_factory=dict)  # node -> seconds since its last report (NaN: none yet)
    gpu_sets: dict = dataclasses.field(default_factory=dict)  # node -> its GPU indices
    jobs_by_id: dict = dataclasses.field(default_factory=dict)  # job id -> its bindings
    sharers: dict = dataclasses.field(default_factory=dict)  # GPU key -> how many jobs are bound to it
    alerts: list = dataclasses.field(default_factory=list)
    clock_fraction: dict = dataclasses.field(default_factory=dict)  # GPU key -> SM clock / max (busy GPUs)
    straggler: dict = dataclasses.field(default_factory=dict)  # GPU key -> why it is a straggler
    no_reading: dict = dataclasses.field(default_factory=dict)  # GPU key -> its state, for GPUs without a live reading
    flagged: dict = dataclasses.field(default_factory=dict)  # view flag -> ["node/index (reason)"] (observed.flag_alerts)
    oob: dict = dataclasses.field(default_factory=dict)  # GPU key -> out-of-band limit the allocation keeps it within (W)


def build_view(snap: _Snapshot) -> View:
    """The :class:`View` of one interval from its snapshot (pure; any thread)."""
    policy = snap.policy
    out = snap.out
    st = pb.StatusReply(
        budget_w=policy.budget_w, interval_s=policy.interval_s, dry_run=snap.dry_run,
        policy_path=snap.policy_path, coordinator_id=snap.coordinator_id,
        last_solve_s=out.solve_s if out else 0.0, last_solve_time_s=snap.time_s,
    )
    cols = allocation.columns_of(snap.inputs)
    tally = _Tally(alerts=list(snap.alerts), straggler={cols.keys[i]: r for i, r in cols.straggler.items() if r},
                   oob=_oob_limits(cols))
    ceil_of = dict(zip(cols.keys, cols.thermal_ceiling_w.tolist()))
    for node in snap.nodes:
        _add_node(st, tally, snap, node, ceil_of)
    tally.alerts.extend(observed.flag_alerts(tally.flagged))
    _add_unreported(st, snap)
    desired = snap.desired
    st.allocated_w = sum(desired.get(k, v) for k, v in tally.accounted.items())
    st.enforced_w = sum(tally.accounted.values())
    st.draw_w = _domain_draw_w(tally, tally.draw.keys())  # (NaN: no GPU has a live reading, as a domain's)
    jobs_extra, lost = _add_jobs(st, tally, snap)
    _add_domains(st, tally, snap)
    all_alerts = snap.persistent_alerts + tally.alerts
    seen: set = set()
    st.alerts.extend([a for a in all_alerts if not (a in seen or seen.add(a))][:200])
    means = tally.node_means
    return View(
        status=st, gpus=tuple(tally.extras), jobs=jobs_extra,
        temp_spread_c=(max(means) - min(means)) if len(means) >= 2 else 0.0,
        throughput_lost=lost, stale_age_s=tally.stale_age, tick_s=snap.tick_s, plans_sent=snap.plans_sent,
    )


def _oob_limits(cols) -> dict:
    """GPU key -> the out-of-band limit (W) the allocation keeps the GPU within (``InputColumns.oob_w``):
    shown as the flag ``OOB_LIMITED`` (once the request came down to it the device can no longer
    show the limit, and the GPU read ``OK`` in ``nodes`` and Prometheus; found by a review)."""
    if cols.oob_w is None:
        return {}
    where = np.flatnonzero(np.isfinite(np.asarray(cols.oob_w, float)))
    return {cols.keys[i]: float(cols.oob_w[i]) for i in where.tolist()}


def _gpu_flags(tally: _Tally, key, cap_state: str, cap_w: float = math.inf) -> tuple[list, str]:
    """``(flags, detail)`` of a GPU in the view: ``STRAGGLER`` (its reason), ``OOB_LIMITED`` while the
    allocation keeps it within an out-of-band limit its cap state does not show and that limit binds:
    its cap ``cap_w`` (W) within the planner's deadband of it (a cap the coordinator chose below the
    limit for another reason, e.g. a straggler job-mate, was flagged too: found by a try-out)."""
    flags, detail = [], tally.straggler.get(key, "")
    if key in tally.straggler:
        flags.append("STRAGGLER")
        tally.flagged.setdefault("STRAGGLER", []).append(f"{key[0]}/{key[1]} ({detail or 'slow at any cap'})")
    oob = tally.oob.get(key)
    if oob is not None and cap_state != capstates.OOB_LIMITED and cap_w >= oob - planner.DEADBAND_W:
        flags.append(capstates.OOB_LIMITED)
        detail = detail or f"another limiter held it at {oob:.0f} W (out-of-band limit): planned within it"
        tally.flagged.setdefault(capstates.OOB_LIMITED, []).append(f"{key[0]}/{key[1]} (held at {oob:.0f} W)")
    return flags, detail


def _add_unreported(st, snap: _Snapshot) -> None:
    """The nodes the policy lists whose agent never said hello to this coordinator, after the
    others (``never_reported``: stale, no GPUs, age NaN): before, ``capctl nodes`` left them out,
    so a node whose agent never started looked like a node that does not exist (found by a
    review). ``held_w``: the watts counted for it (the inputs' ``reserved_w``, the most it may
    draw), shown nowhere before but in an alert when a limit could not be met."""
    known = {node[0] for node in snap.nodes}
    held = snap.inputs.reserved_w  # (allocation.unreported_reserve: node -> W counted for it)
    for name in sorted(set(snap.policy.domains.all_nodes()) - known):
        st.nodes.add(name=name, stale=True, last_report_age_s=math.nan, never_reported=True,
                     held_w=finite(held.get(name, 0.0), 0.0))


def _add_node(st, tally: _Tally, snap: _Snapshot, node: tuple, ceil_of: dict) -> None:
    """One node of the snapshot: its status row and GPUs, its GPU extras, its alerts (cap states
    outside normal, stale). ``ceil_of``: GPU key -> thermal ceiling (W)."""
    name, stale, last_report_mono, simulated, bindings, rows, lanes = node
    desired = snap.desired
    # unknown (NaN, shown "-"): a node counted from the node ledger whose agent has not reported
    # to this coordinator (it showed -1.0 s; found by a try-out)
    age = max(0.0, snap.now - last_report_mono) if last_report_mono > -1e17 else math.nan
    tally.stale_age[name] = age
    ns = st.nodes.add(name=name, stale=stale, last_report_age_s=age, simulated=simulated)
    jobs_on = _jobs_on(tally, bindings)
    tally.gpu_sets[name] = {r[0][0] for r in rows}
    temps = []
    for fields, acc in rows:
        (idx, uuid_, have_reading, power_w, enforced_w, temp_c, slowdown_c, sm_clock, reasons, min_w, max_w,
         cap_state, max_sm_clock, util, energy_j, error, reading_live) = fields
        th_n, th_t, th_p = _throttle_of(lanes, idx)
        key = (name, idx)
        tally.accounted[key] = acc
        live = have_reading and reading_live and not stale  # its readings are facts of now
        # measured draw: live readings only, as the GPU rows show them (a LOST GPU or a stale
        # node's last draw is no fact of now; their caps keep counting in enforced_w)
        tally.draw[key] = power_w if live else 0.0
        if not live:
            tally.no_reading[key] = "node stale" if stale else (cap_state or capstates.NO_READING)
        on_gpu = jobs_on.get(idx, ())
        job = on_gpu[0] if on_gpu else ""
        tally.sharers[key] = len(on_gpu)
        flags, flag_detail = _gpu_flags(tally, key, cap_state, desired.get(key, acc))
        ns.gpus.add(job_ids=list(on_gpu),
            node=name, index=idx, uuid=uuid_, cap_w=desired.get(key, acc),
            enforced_w=enforced_w if have_reading else math.nan,
            slowdown_temp_c=slowdown_c, job_id=job, min_cap_w=min_w, max_cap_w=max_w,
            **_readings(live, power_w, temp_c, sm_clock, reasons),
            thermal_ceiling_w=_shown_ceiling_w(ceil_of.get(key, math.inf), min_w, max_w),
            max_sm_clock_mhz=max_sm_clock,
            detail=error if cap_state and cap_state not in capstates.NORMAL else flag_detail,
            flags=flags,
            curve=snap.curve_kind.get(key, "") if snap.curve_kind else "",
            memory_bound_fraction=snap.memory_bound.get(key),
            **capstates.wire_fields(cap_state or ("" if have_reading else capstates.NO_READING)),
        )
        busy = live and util >= 20.0 and max_sm_clock > 0
        if busy:
            frac = observed.clock_fraction(sm_clock, max_sm_clock)
            share = snap.memory_bound.get(key)  # the step rate at that clock (coordinator.membound)
            tally.clock_fraction[key] = membound.rate_of_clock(frac, share) if share and frac > 0 else frac
        tally.extras.append(GpuExtra(
            node=name, index=idx, uuid=uuid_, job_id=job,
            thermal_fraction=th_t / th_n if th_n else 0.0, power_fraction=th_p / th_n if th_n else 0.0,
            throttle_intensity=max(0.0, 1.0 - sm_clock / max_sm_clock) if busy else 0.0,
            hotspot_margin_c=(slowdown_c - temp_c) if (live and slowdown_c > 0) else math.nan,
            energy_j=energy_j,
        ))
        if live:
            temps.append(temp_c)
            tally.alerts.extend(near_slowdown_alert(name, idx, temp_c, slowdown_c, snap.policy.thermal.margin_c))
        if have_reading and cap_state and cap_state not in capstates.NORMAL:
            tally.alerts.append(f"{name} GPU {idx}: cap state {cap_state}{': ' + error if error else ''}")
    if temps and not stale:
        tally.node_means.append(statistics.fmean(temps))
    if stale and rows:
        since = f"no report for {age:.1f} s" if math.isfinite(age) else "no report to this coordinator yet"
        tally.alerts.append(f"node {name} stale ({since}): held at its caps")


def _jobs_on(tally: _Tally, bindings) -> dict:
    """GPU index -> every job bound to it (several on a shared/MIG GPU) of one node's
    ``bindings``; each binding is added to ``tally.jobs_by_id``."""
    jobs_on: dict = {}
    for b in bindings:
        tally.jobs_by_id.setdefault(b.job_id, []).append(b)
        for i in b.gpu_indices:
            jobs_on.setdefault(i, []).append(b.job_id)
    return jobs_on


def _readings(live: bool, power_w: float, temp_c: float, sm_clock_mhz: int, reasons) -> dict:
    """The readings of a ``GpuStatus`` (W, °C, MHz, clocks event reasons): without a live reading
    (``live`` False: LOST, STALLED, not read yet, a stale node) NaN / 0 / none, unknown rather
    than its last values, and ``no_live_reading`` set."""
    if live:
        return {"power_w": power_w, "temp_c": temp_c, "sm_clock_mhz": sm_clock_mhz,
                "clocks_event_reasons": list(reasons), "no_live_reading": False}
    return {"power_w": math.nan, "temp_c": math.nan, "sm_clock_mhz": 0, "clocks_event_reasons": [],
            "no_live_reading": True}


def near_slowdown_alert(node: str, index: int, temp_c: float, slowdown_c: float, margin_c: float) -> list[str]:
    """[an alert] when a GPU's measured temperature (°C) is closer to its slowdown temperature than
    half the policy's ``thermal.margin_c`` (the thermal ceilings aim at the full margin; half of it
    leaves room for the ~1 °C noise of the readings and for prediction error); else []."""
    if not (slowdown_c > 0 and margin_c > 0 and math.isfinite(temp_c)):
        return []
    left_c = slowdown_c - temp_c
    if left_c >= margin_c / 2:
        return []
    return [f"{node} GPU {index}: {temp_c:.1f} °C, {left_c:.1f} °C below its slowdown temperature "
            f"{slowdown_c:.0f} °C (the policy keeps {margin_c:g} °C: its thermal model is off, or a cooling problem)"]


def _gpu_owners(inputs) -> dict:
    """GPU key -> the job (name) the solve planned the GPU for; GPUs of no job are left out."""
    c = allocation.columns_of(inputs)
    names = c.job_names
    return {k: names[j] for k, j in zip(c.keys, c.job.tolist()) if j >= 0}


def _shared_job_rate(out, keys: list, owner: dict, rate: float, binding: str) -> tuple[float, str]:
    """(predicted rate, binding) of a job that is not in the solve because each of its GPUs
    ``keys`` is shared with another job, planned for that one: the slowest such job's rate and
    ``shared:<job>`` (found by a review: such a job showed rate 0 and no binding)."""
    owners = sorted({owner[k] for k in keys if k in owner and owner[k] in out.job_rate})
    if not owners:
        return rate, binding
    slowest = min(owners, key=lambda j: out.job_rate[j])
    return out.job_rate[slowest], f"shared:{slowest}"


def _add_jobs(st, tally: _Tally, snap: _Snapshot) -> tuple[dict, float]:
    """The job rows; returns (job id -> :class:`JobExtra`, GPU-weighted mean of 1 - predicted rate)."""
    policy, out, desired, inputs = snap.policy, snap.out, snap.desired, snap.inputs
    gpu_domains: dict = collections.defaultdict(list)
    for name, members in inputs.domain_members.items():
        for k in members:
            gpu_domains[k].append(name)
    jobs_extra = {}
    lost_num = lost_den = 0.0
    owner = None  # GPU key -> the job the solve planned it for (built once, for shared-GPU jobs only)
    for job_id, bindings in tally.jobs_by_id.items():
        keys = [(b.node, i) for b in bindings for i in b.gpu_indices if i in tally.gpu_sets.get(b.node, ())]
        first = bindings[0]
        weight = float(policy.job_weight(partition=first.partition or None, account=first.account or None,
                                         qos=first.qos or None))
        rate = out.job_rate.get(job_id, 0.0) if out else 0.0
        binding = out.job_binding.get(job_id, "") if out else ""
        if out and keys and job_id not in out.job_rate:
            # every GPU of it is shared with (planned for) another job (MIG): it runs at their pace
            owner = _gpu_owners(inputs) if owner is None else owner
            rate, binding = _shared_job_rate(out, keys, owner, rate, binding)
        shown = observed.predicted_rate(rate) if out and rate > 0 else finite(rate)
        shown, binding = observed.straggler_bound(shown, binding, keys, tally.straggler, tally.clock_fraction)
        slowest = planned = out.job_slowest.get(job_id) if out else None
        if binding in (allocation.HELD, allocation.OOB_LIMIT):  # a job-mate measurably slower sets the pace
            slowest, why = observed.measured_slowest(slowest, keys, tally.clock_fraction, tally.no_reading,
                                                     gpu_domains, out.domain_price)
            binding, planned = (why, planned) if why else (binding, None)
        else:
            planned = None
        rate = shown if math.isfinite(shown) else rate  # (the floor: at most this fast, for the lost share)
        energy = snap.job_energy_j.get(job_id, 0.0)
        st.jobs.add(
            job_id=job_id, nodes=sorted({b.node for b in bindings}), gpus=len(keys), weight=weight,
            predicted_step_rate=shown, binding=binding, allocated_w=_job_allocated_w(keys, desired, tally),
            energy_j=energy, user=first.user, partition=first.partition, account=first.account,
            measured_step_rate=observed.measured_step_rate(tally.clock_fraction, keys, tally.no_reading),
        )
        mine = {name for k in keys for name in gpu_domains.get(k, ())}
        doms = [d["name"] for d in inputs.domains if d["name"] in mine]
        jobs_extra[job_id] = JobExtra(slowest=slowest, domains=tuple(doms), energy_j=energy, weight=weight,
                                      planned_slowest=planned)
        if keys and out and job_id in out.job_rate:
            lost_num += len(keys) * max(0.0, 1.0 - rate)
            lost_den += len(keys)
    return jobs_extra, (lost_num / lost_den if lost_den else 0.0)


def _job_allocated_w(keys, desired: dict, tally: _Tally) -> float:
    """A job's allocated watts: each of its GPUs' allocated cap (the desired cap, else the accounted
    one: a GPU the last decision did not cover still holds its watts), a GPU shared by n jobs
    counting 1/n to each, so that the jobs' watts add up to the GPUs' (never counted twice)."""
    return sum(desired.get(k, tally.accounted.get(k, 0.0)) / max(1, tally.sharers.get(k, 1)) for k in keys)


def _add_domains(st, tally: _Tally, snap: _Snapshot) -> None:
    """The domain rows: limit, allocated, accounted and drawn watts, price, deficit (W)."""
    out, desired, accounted, draw = snap.out, snap.desired, tally.accounted, tally.draw
    for d in snap.inputs.domains:
        mem = snap.inputs.domain_members.get(d["name"], set())
        lim = d["limit_w"] if d["limit_w"] is None else d["limit_w"] + d.get("reserved_w", 0.0)  # the policy's
        st.domains.add(
            name=d["name"], kind=d.get("kind", ""), limit_w=finite(lim if lim is not None else math.inf, 0.0),
            allocated_w=sum(desired.get(k, accounted.get(k, 0.0)) for k in mem),
            enforced_w=sum(accounted.get(k, 0.0) for k in mem), draw_w=_domain_draw_w(tally, mem),
            price_rate_per_w=finite(out.domain_price.get(d["name"], 0.0)) if out else 0.0,
            deficit_w=finite(out.domain_deficit_w.get(d["name"], 0.0)) if out else 0.0,
        )


def _domain_draw_w(tally: _Tally, members) -> float:
    """The live power draw of a domain's GPUs ``members`` (W); NaN (shown "-", null in JSON, no
    Prometheus sample) when it has GPUs and none has a live reading: a stale node's draw is
    unknown, and its domain read 0 W (found by a try-out)."""
    draw, dead = tally.draw, tally.no_reading
    known = [k for k in members if k in draw]
    if known and all(k in dead for k in known):
        return math.nan
    return sum(draw.get(k, 0.0) for k in members)


RELOADED_KEY = "policy_reloaded"
"""State-store key of the policy file an admin made the one in force (``{"path", "time_s", "text"}``:
``text`` the version loaded, in force at a start where the file no longer loads)."""


def _load_with_text(path: str):
    """``(Policy, its YAML text)`` of the file ``path`` (read once). Raises as
    :func:`capctl.policy.load_policy`."""
    from capctl.policy import parse_policy
    from capctl.policy.validate import display_name, read_policy_text

    text = read_policy_text(path)
    return parse_policy(text, display_name(path)), text


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name the same file (the same absolute path; "" never)."""
    return bool(a) and bool(b) and os.path.abspath(a) == os.path.abspath(b)


def _first_line(exc: BaseException) -> str:
    """The first error of ``exc`` (a PolicyError lists several), one line."""
    errors = getattr(exc, "errors", None)
    text = str(errors[0]) if errors else str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


NEED_TOLERANCE_W = 1e-6
"""A budget this close below what the cluster needs at least (W) is not refused: the need is a sum
of caps, whose last digits are float noise."""


def _up_w(watts: float) -> float:
    """``watts`` rounded up to 0.01 W, for a message (a sum of caps read as 2243.0950000000003 W;
    found by a try-out); up, so that a need never reads as the budget it refuses."""
    return math.ceil(watts * 100.0 - 1e-6) / 100.0


def _deficit_from_message(text: str) -> float:
    import re

    m = re.search(r"deficit ([0-9.eE+-]+) W", text)
    return float(m.group(1)) if m else 0.0


def _shown_ceiling_w(ceiling_w: float, min_cap_w: float, max_cap_w: float) -> float:
    """A GPU's thermal ceiling as status shows it (W), clipped to the device's limit range: NaN
    (null in JSON) when there is no estimate (a GPU held, not read, ...: 0 W would be no fact);
    the device maximum when at or above it (no constraint: the RC model can give thousands of
    watts for a cool GPU); the minimum cap when below it (the GPU is held at its minimum: the
    model can give a negative ceiling for a GPU far too hot)."""
    if not math.isfinite(ceiling_w):
        return math.nan
    if max_cap_w > 0:
        ceiling_w = min(ceiling_w, max_cap_w)
    return float(max(ceiling_w, min_cap_w))


def _binding_ceiling_w(ceiling_w: float, max_cap_w: float) -> float:
    """A GPU's thermal ceiling for display (W): 0 when unknown or at/above the device maximum."""
    if not math.isfinite(ceiling_w) or (max_cap_w > 0 and ceiling_w >= max_cap_w):
        return 0.0
    return float(ceiling_w)


def _held_binding_text(binding: str, reply, gpus) -> str:
    """The explain line of a job bound by its slowest GPU's out-of-band limit or by the coordinator
    holding that GPU (``binding``: allocation.OOB_LIMIT / HELD; ``gpus``: (node, GpuStatus))."""
    g = next((g for n, g in gpus if n == reply.slowest_node and g.index == reply.slowest_gpu_index), None)
    where = f"GPU {reply.slowest_node}/{reply.slowest_gpu_index}"
    if binding == allocation.OOB_LIMIT:
        at = f" enforced at {g.enforced_w:.0f} W" if g is not None and g.enforced_w > 0 else ""
        return (f"Binding constraint: {binding} ({where}{at} by another limiter, below the cap capctl would give it) "
                "— its job-mates are paced to it and the watts it cannot use go to other jobs.")
    state = (capstates.of(g) or "held") if g is not None else "held"
    at = f" at {g.cap_w:.0f} W" if g is not None else ""
    return (f"Binding constraint: {binding} ({where} {state}: the coordinator holds it{at}, its last known cap, "
            "and counts it there) — the job runs no faster than that GPU.")


def explain_text(job, reply, gpus, status, planned_slowest=None) -> str:
    """Human explanation of one job's allocation (used by ``capctl explain``). ``planned_slowest``:
    the GPU key the solve named slowest where a measurably slower job-mate replaced it
    (:func:`coordinator.observed.measured_slowest`), else None."""
    lines = [
        f"job {job.job_id}: {job.gpus} GPUs on {', '.join(job.nodes)}, {job.allocated_w:.0f} W allocated, "
        + (f"predicted step rate {job.predicted_step_rate:.3f} of uncapped (weight {job.weight:g})."
           if math.isfinite(job.predicted_step_rate) else
           f"no predicted step rate: its slowest GPU is at a cap below its rate curve's range (weight {job.weight:g}).")
    ]
    b = job.binding
    if b.startswith("domain:"):
        lines.append(f"Binding constraint: the limit of power domain {b[7:]} — every watt there is in use.")
    elif b == "thermal":
        lines.append("Binding constraint: thermal — a GPU of this job is near its slowdown temperature; its "
                     "job-mates are capped to the same pace instead of waiting for it.")
    elif b == "saturated":
        lines.append("Not limited: the job runs at its uncapped rate.")
    elif b == "straggler":
        lines.append("Binding constraint: a straggler — a GPU of this job runs slow at any cap; its job-mates are "
                     "capped toward its pace (not below their minimum limit) and the watts freed go to other jobs.")
    elif b in (allocation.OOB_LIMIT, allocation.HELD):
        lines.append(_held_binding_text(b, reply, gpus))
    elif b:
        lines.append(f"Binding constraint: {b}.")
    if reply.slowest_node:
        g = next((g for n, g in gpus if n == reply.slowest_node and g.index == reply.slowest_gpu_index), None)
        by = ("the allocation's curves" if planned_slowest is None else
              f"measured: the lowest SM clock of the job; the allocation's curves named {planned_slowest[0]} GPU "
              f"{planned_slowest[1]}, held")
        if g is not None and g.no_live_reading:
            lines.append(f"Slowest GPU ({by}): {reply.slowest_node} GPU {g.index} — "
                         f"{observed.limit_text(g)}, no live reading ({observed.reading_state(g)}).")
        elif g is not None:
            limit = observed.limit_text(g)
            clock = f", {g.sm_clock_mhz} MHz" if planned_slowest is not None else ""
            lines.append(
                f"Slowest GPU ({by}): {reply.slowest_node} GPU {g.index} — {limit}{clock}, "
                f"{g.temp_c:.1f} °C ({g.slowdown_temp_c - g.temp_c:.1f} °C below slowdown), "
                f"thermal ceiling {g.thermal_ceiling_w:.0f} W." if _binding_ceiling_w(g.thermal_ceiling_w, g.max_cap_w) else
                f"Slowest GPU ({by}): {reply.slowest_node} GPU {g.index} — {limit}{clock}, "
                f"{g.temp_c:.1f} °C."
            )
    lines.extend(observed.explain_lines(job, reply, gpus))
    if reply.prices:
        parts = [f"{p.domain} {p.price_rate_per_w:.2e}" for p in reply.prices]
        lines.append("Price of one more watt (objective per W) in its domains: " + ", ".join(parts) + ".")
    if status.dry_run:
        lines.append("Dry run: these caps are computed, not applied.")
    return "\n".join(lines)
