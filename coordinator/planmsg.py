"""The ``CapPlan`` messages the coordinator sends (capctl.v1), built cheaply per node.

Every live node gets one plan per interval, most of them holds whose failsafe caps
(``safe_caps``, W) are the same as in the last interval. Building a plan's repeated
``CapAssignment`` fields from Python objects costs ~1 us per GPU (measured, upb protobuf 7.x,
2026-12-03 on the 2-core CI host: 10 us for a hold with 8 safe caps built directly); so the
serialized ``safe_caps`` part of each node's last plan is kept (:class:`SafeCapsCache`, one entry
per node, keyed by its ``(index, cap W)`` pairs) and a plan is parsed from it (one C call) before
its other fields are set: 4 us a hold with its scalar fields and the caps' check, 9 us a plan with
8 caps (same host). When a node's safe caps changed (most plans while loads move: 864 of 1,002 in
an interval of bench/interval_cost.py), the message is built directly and only its serialized
form kept: 9 us against 17 us built, serialized and parsed back (4 Dec 2026). The message is
field for field the one built directly (tests/coordinator/test_planmsg.py).

Agents that read packed plans (every agent since 5 Dec 2026) get :func:`packed_plan`: the plan
made by protobuf's constructor with every field as a keyword (one C call), 1.6 us a hold against
5.3 us with its fields set one by one (micro, 7 Dec 2026, 2-core host; the plan's wire bytes
written by hand and parsed measured 1.9 us: not kept); the failsafe caps of all nodes are checked
and packed in one pass of arrays per interval (:func:`packed_rows`).

Every cap is checked before anything is serialized (:func:`check_caps`): protobuf itself takes
``None`` as 0 W and ``True`` as 1 W, and a NaN, an infinity or a cap <= 0 W is never a limit to
request. The check of a plan's caps costs one type lookup and two comparisons per cap.
"""

from __future__ import annotations

import itertools
import math
import numbers
import sys

import numpy as np

from capctl import plancaps
from capctl.v1 import capctl_pb2 as pb

_CAP_TYPES = frozenset({float, int, np.float64, np.int64, np.int32})
"""The number types of the caps' fast check (:func:`check_caps`; ``bool`` is not among them):
other real number types (subclasses, ``np.float32`` whose compare with :data:`_MAX_W` overflows,
the other numpy ones) take the slow one."""
_MAX_W = sys.float_info.max
"""The largest finite double: a cap above it (an infinity, a huge int) is refused."""


class SafeCapsCache:
    """Node name -> ``(safe caps key, serialized CoordinatorMessage holding only them)``; at most
    ``max_nodes`` entries (the oldest dropped first)."""

    def __init__(self, max_nodes: int = 65536) -> None:
        self._by_node: dict[str, tuple[tuple, bytes]] = {}
        self.max_nodes = max_nodes

    def blank(self, node: str, safe: dict[int, float]) -> pb.CoordinatorMessage:
        """A new ``CoordinatorMessage`` whose plan holds ``safe`` (index -> W) as ``safe_caps``
        (sorted by index) and nothing else."""
        key = tuple(safe.items())
        hit = self._by_node.get(node)
        if hit is not None and hit[0] == key:
            return pb.CoordinatorMessage.FromString(hit[1])
        # a miss (new safe caps): built directly, its serialized form kept for the next plans
        # (measured: 8 us built + ~1.5 serialized, against 17 us built, serialized and parsed back)
        msg = pb.CoordinatorMessage()
        msg.plan.SetInParent()  # a plan even without safe caps
        add = msg.plan.safe_caps.add
        for i, c in sorted(safe.items()):
            add(index=i, cap_w=c)
        by_node = self._by_node
        if hit is None and len(by_node) >= self.max_nodes:
            del by_node[next(iter(by_node))]
        by_node[node] = (key, msg.SerializeToString())
        return msg

    def forget(self, node: str) -> None:
        """Drop ``node``'s entry (a forgotten node)."""
        self._by_node.pop(node, None)


def check_caps(node: str, field: str, caps: dict) -> None:
    """Raise ``ValueError`` unless every cap of ``caps`` (GPU index -> W) of the plan to ``node``
    is a real number of watts, finite and > 0: ``int``, ``float`` or a numpy integer/floating
    scalar (any ``numbers.Real``), never a ``bool``, ``None``, a string, NaN, an infinity or a
    cap <= 0 W. The message names the node, ``field`` ("caps", "safe_caps"), the GPU index and
    the value. Costs one type lookup and two comparisons per cap (8 floats: ~0.5 us)."""
    for c in caps.values():
        if not (type(c) in _CAP_TYPES and 0.0 < c <= _MAX_W):  # (NaN fails the comparisons)
            _check_slow(node, field, caps)
            return


def _check_slow(node: str, field: str, caps: dict) -> None:
    """:func:`check_caps` cap by cap: raises ``ValueError`` for the first bad cap (in ``caps``'
    order); returns when all are real numbers of watts (of a type outside the fast check's)."""
    for i, c in caps.items():
        if isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Real):
            why = f"not a number of watts (a {type(c).__name__})"
        else:
            try:
                watts = float(c)
            except OverflowError:  # an int beyond any double
                watts = math.inf
            if not math.isfinite(watts):
                why = "not finite"
            elif not watts > 0:
                why = "not above 0 W"
            else:
                continue
        shown = repr(c) if len(repr(c)) <= 40 else repr(c)[:37] + "..."
        raise ValueError(f"plan for node {node!r}: {field} GPU {i!r}: cap_w {shown} is {why}; "
                         f"allowed: a finite int or float > 0 (W)")


def cap_plan(cache: SafeCapsCache, node: str, caps: dict[int, float], safe: dict[int, float], *,
             packed: bool = False, **fields) -> pb.CoordinatorMessage:
    """``CoordinatorMessage(plan=CapPlan(caps=..., safe_caps=..., **fields))`` for ``node``:
    ``caps`` and ``safe`` (GPU index -> W) sorted by index; ``fields`` the plan's scalar fields
    (seq, phase, lease_expiry_s, lease_s, dry_run, term, snapshot_time_s, ...). ``packed`` (an
    agent whose hello says ``packed_plans``): both as packed rows, ``caps_rows`` /
    ``safe_caps_rows`` (:mod:`capctl.plancaps`: 25.6 -> 10.7 us a plan of 8 caps and 8 safe caps
    built and serialized), the cache not used.

    Raises:
        ValueError: a cap of ``caps`` or ``safe`` that is not a finite real number of watts > 0
            (:func:`check_caps`: bool, None, str, NaN, inf, <= 0), before anything is serialized.
        AttributeError, TypeError, ValueError: an unknown field, a bad field value or GPU index
            (protobuf's).
    """
    check_caps(node, "caps", caps)
    check_caps(node, "safe_caps", safe)
    if packed:
        msg = pb.CoordinatorMessage()
        msg.plan.SetInParent()  # a plan even without caps
        if safe:
            msg.plan.safe_caps_rows = plancaps.pack(safe)
    else:
        msg = cache.blank(node, safe)
    plan = msg.plan
    for name, value in fields.items():
        setattr(plan, name, value)
    if caps and packed:
        plan.caps_rows = plancaps.pack(caps)
    elif caps:
        add = plan.caps.add
        for i, c in sorted(caps.items()):
            add(index=i, cap_w=c)
    return msg


def packed_plan(node: str, caps: dict[int, float], safe: dict[int, float], seq: int, phase: str,
                lease_expiry_s: float, lease_s: float, dry_run: bool, term: int,
                snapshot_time_s: float, safe_rows: bytes | None = None) -> pb.CoordinatorMessage:
    """:func:`cap_plan` with ``packed=True`` and these fields (the coordinator's plans to agents
    that read packed caps, :meth:`coordinator.loop.Coordinator.send_plan`), equal to it field for
    field; same checks, same errors, made by one constructor call (module docstring).
    ``safe_rows``: ``safe`` checked and packed already (:func:`packed_rows`), or None (done here).

    Raises:
        ValueError: a cap that is not a finite real number of watts > 0 (:func:`check_caps`).
        TypeError, ValueError: a bad field value (protobuf's).
    """
    check_caps(node, "caps", caps)
    if safe_rows is None:
        check_caps(node, "safe_caps", safe)
        safe_rows = plancaps.pack(safe) if safe else b""
    return pb.CoordinatorMessage(plan=pb.CapPlan(
        seq=seq, phase=phase, lease_expiry_s=lease_expiry_s, lease_s=lease_s, dry_run=dry_run, term=term,
        snapshot_time_s=snapshot_time_s, caps_rows=plancaps.pack(caps) if caps else b"", safe_caps_rows=safe_rows))


_ROW = np.dtype([("index", "<u4"), ("cap_w", "<f8")])
"""One packed cap as numpy writes it: :data:`capctl.plancaps.CAP` (12 bytes, no padding)."""


def packed_rows(by_node: dict[str, dict[int, float]]) -> dict[str, bytes]:
    """``{node: plancaps.pack(caps)}`` for the nodes of ``by_node`` (node -> GPU index -> W) whose
    caps :func:`check_caps` takes and whose indices are ascending, all in one pass of arrays; the
    others are left out (their plans check and pack their caps themselves, with the same errors).
    Every value must be a ``float`` and every index an ``int``, else nothing is returned.

    Why: the failsafe caps of every live node go out each interval; checked and packed per node,
    ~1.6 us a node of 8 GPUs (micro) and 2-3 us within the interval; here ~1 ms for 1,000 nodes
    (measured 7 Dec 2026, 2-core host)."""
    dicts = list(by_node.values())
    indices = list(itertools.chain.from_iterable(dicts))
    values = list(itertools.chain.from_iterable(map(dict.values, dicts)))
    if not set(map(type, values)) <= {float} or not set(map(type, indices)) <= {int}:
        return {}
    try:
        idx = np.array(indices, dtype=np.int64) if indices else np.zeros(0, np.int64)
    except OverflowError:  # an index beyond int64: the per-node path says so
        return {}
    counts = np.fromiter(map(len, dicts), np.int64, len(dicts))
    ends = np.cumsum(counts)
    starts = ends - counts
    caps_w = np.array(values, dtype=float)
    ascending = np.ones(len(idx), bool)
    ascending[1:] = idx[1:] > idx[:-1]
    ascending[starts[counts > 0]] = True  # (a node's first row is not compared with the node before)
    good = (caps_w > 0.0) & (caps_w <= _MAX_W) & (idx >= 0) & (idx <= 0xFFFFFFFF) & ascending  # (NaN: not > 0)
    bad_before = np.concatenate(([0], np.cumsum(~good)))
    keep = bad_before[ends] == bad_before[starts]
    rows = np.empty(len(idx), _ROW)
    rows["index"] = np.where(good, idx, 0)
    rows["cap_w"] = caps_w
    data = rows.tobytes()
    return {name: data[12 * a:12 * b] for name, a, b, ok in zip(by_node, starts.tolist(), ends.tolist(), keep.tolist())
            if ok}
