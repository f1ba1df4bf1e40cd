"""The ``CapPlan`` messages the coordinator sends (capctl.v1), built cheaply per node.

Every live node gets one plan per interval, most of them holds whose failsafe caps
(``safe_caps``, W) are the same as in the last interval. Building a plan's repeated
``CapAssignment`` fields from Python objects costs ~1 us per GPU (measured, upb protobuf 7.x:
~8 us for a hold with 8 safe caps); so the serialized ``safe_caps`` part of each node's last plan is
kept (:class:`SafeCapsCache`, one entry per node, keyed by its ``(index, cap W)`` pairs) and a
plan is parsed from it (one C call) before its other fields are set: ~1 us a hold. The message is
field for field the one built directly (tests/coordinator/test_planmsg.py).
"""

from __future__ import annotations

from capctl.v1 import capctl_pb2 as pb


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
        if hit is None or hit[0] != key:
            data = pb.CoordinatorMessage(plan=pb.CapPlan(
                safe_caps=[pb.CapAssignment(index=i, cap_w=c) for i, c in sorted(safe.items())])).SerializeToString()
            by_node = self._by_node
            if hit is None and len(by_node) >= self.max_nodes:
                del by_node[next(iter(by_node))]
            hit = by_node[node] = (key, data)
        return pb.CoordinatorMessage.FromString(hit[1])

    def forget(self, node: str) -> None:
        """Drop ``node``'s entry (a forgotten node)."""
        self._by_node.pop(node, None)


def cap_plan(cache: SafeCapsCache, node: str, caps: dict[int, float], safe: dict[int, float],
             **fields) -> pb.CoordinatorMessage:
    """``CoordinatorMessage(plan=CapPlan(caps=..., safe_caps=..., **fields))`` for ``node``:
    ``caps`` and ``safe`` (GPU index -> W) sorted by index; ``fields`` the plan's scalar fields
    (seq, phase, lease_expiry_s, lease_s, dry_run, term, snapshot_time_s, ...). Raises
    AttributeError for an unknown field, TypeError or ValueError for a bad value (protobuf's)."""
    msg = cache.blank(node, safe)
    plan = msg.plan
    for name, value in fields.items():
        setattr(plan, name, value)
    if caps:
        add = plan.caps.add
        for i, c in sorted(caps.items()):
            add(index=i, cap_w=c)
    return msg
