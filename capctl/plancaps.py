"""A plan's caps packed: ``CapPlan.caps_rows`` / ``safe_caps_rows`` (docs/protocol.md, "Packed plans").

The coordinator sends every live node one ``CapPlan`` per interval, most with new caps and new
safe caps while loads move. Built as ``repeated CapAssignment`` (one message per GPU and list) a
plan with 8 caps and 8 safe caps cost 25.6 us built and serialized on the 2-core test host; as two
byte strings of fixed rows, 10.7 us (5 Dec 2026, 20,000 plans). An agent that reads them says so
in its ``AgentHello`` (``packed_plans``); the coordinator sends the per-GPU messages to any other.

Row: uint32 GPU index, float64 cap (W), little-endian, 12 bytes (:data:`CAP`), sorted by index.
Stdlib only (the agent, ``capctl[agent]``, decodes with :func:`of_plan`).
"""

from __future__ import annotations

import struct

CAP = struct.Struct("<Id")
"""One packed cap: uint32 GPU index, float64 cap_w (W)."""
MAX_CAPS = 64
"""Most caps in one packed list (NVML's devices per node, capctl.security.limits.MAX_GPUS_PER_NODE)."""


def pack(caps: dict[int, float]) -> bytes:
    """``caps`` (GPU index -> W) as packed rows sorted by index. Values are not judged here
    (the coordinator checks them first, coordinator/planmsg.py ``check_caps``).

    Raises:
        ValueError: an index outside 0..2^32-1 or a cap that is no number (what the per-GPU
            form's protobuf setters raise, so the coordinator's one ``except ValueError`` of a
            node's plan covers both).
    """
    try:
        return b"".join([CAP.pack(i, c) for i, c in sorted(caps.items())])
    except struct.error as err:
        raise ValueError(f"packed caps {caps!r:.200}: {err}") from None


def unpack(data: bytes, field: str) -> tuple[dict[int, float], str]:
    """``(caps, problem)`` of packed rows ``data``: GPU index -> W (a repeated index: its last
    row), or ``{}`` and what is wrong (a size that is not whole 12-byte rows, more than
    :data:`MAX_CAPS` rows), naming ``field``. The values are the receiver's to judge (the agent
    takes only finite watts above 0, caps and safe caps alike, in either form)."""
    if len(data) % CAP.size:
        return {}, f"CapPlan.{field}: {len(data)} bytes, not a whole number of {CAP.size}-byte rows"
    if len(data) > CAP.size * MAX_CAPS:
        return {}, f"CapPlan.{field}: {len(data) // CAP.size} caps, at most {MAX_CAPS} allowed"
    rows = list(CAP.iter_unpack(data))
    caps = dict(rows)
    if len(caps) != len(rows):
        return {}, f"CapPlan.{field}: GPU index {_twice(i for i, _ in rows)} twice; a coordinator names each GPU once"
    return caps, ""


def _twice(indices) -> int:
    """The first GPU index of ``indices`` seen before."""
    seen: set = set()
    return next(i for i in indices if i in seen or seen.add(i))


def of_plan(plan) -> tuple[dict[int, float], dict[int, float], str]:
    """``(caps, safe caps, problem)`` of a ``CapPlan``, GPU index -> W, from either form (the
    per-GPU ``caps`` / ``safe_caps`` or the packed ``caps_rows`` / ``safe_caps_rows``).
    ``problem`` is "" or why the plan cannot be read (packed rows of a bad size, more than
    :data:`MAX_CAPS` caps in either form, a GPU index twice in one list, one list in both forms): then both dicts are empty
    (nothing of such a plan is taken)."""
    for name in ("caps", "safe_caps"):  # the packed lists' bound, the per-GPU ones too (a review:
        # 200,000 per-GPU safe caps were all kept and saved)
        if len(getattr(plan, name)) > MAX_CAPS:
            return {}, {}, f"CapPlan.{name}: {len(getattr(plan, name))} caps, at most {MAX_CAPS} allowed"
    caps = {c.index: c.cap_w for c in plan.caps}
    safe = {c.index: c.cap_w for c in plan.safe_caps}
    for name, got in (("caps", caps), ("safe_caps", safe)):
        listed = getattr(plan, name)
        if len(got) != len(listed):  # the last of a repeated index would win: a plan no coordinator sends
            return {}, {}, (f"CapPlan.{name}: GPU index {_twice(c.index for c in listed)} twice; a coordinator "
                            "names each GPU once")
    for name, into in (("caps_rows", caps), ("safe_caps_rows", safe)):
        data = getattr(plan, name)
        if data:
            if into:
                plain = "caps" if name == "caps_rows" else "safe_caps"
                return {}, {}, f"CapPlan.{name} and CapPlan.{plain} both set: a coordinator sends one form"
            got, problem = unpack(data, name)
            if problem:
                return {}, {}, problem
            into.update(got)
    return caps, safe, ""
