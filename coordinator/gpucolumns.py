"""The registry's per-GPU records as columns: one numpy array per field, one row per GPU slot.

The node agents' messages update :class:`coordinator.registry.GpuObs` records (one per GPU, on the
event loop); once per use an interval reads the fields it needs of every GPU into columns in one
pass (:func:`gather`: one ``operator.attrgetter`` call per GPU, then one array per field), and
everything per GPU after that is array arithmetic (solver inputs, planning, accounting). Slots
are the registry's topology order: nodes sorted by name, GPUs by index
(:meth:`coordinator.registry.Registry.gpu_table`).

:data:`COLUMNS` is the one list of the gathered fields (name, dtype); a new telemetry field is one
more entry there (and in ``GpuObs``). Units are the fields' own: watts (``*_w``), °C (``*_c``),
MHz, %, seconds on the registry's monotonic clock (``*_mono``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator

import numpy as np

from capctl import devicedata

FOREIGN_HOLD_S = 40.0
"""A GPU's foreign-writer mark (``coordinator.registry.GpuObs.foreign_w``, :func:`accounted_w`)
counts until its cap state has been other than ``FOREIGN_WRITER`` for this long (s): the node
agent's default re-write period under a foreign writer (``nodeagent.caps.CapManager``'s
``rewrite_interval_s``, 30 s) plus 10 s for the reports in flight (a few intervals). The agent
itself clears the state only after ``foreign_window_s`` (4 re-write periods) without a foreign
write, so a clear state plus this hold means the other writer is evidently gone."""

COLUMNS: tuple[tuple[str, object], ...] = (
    ("have_reading", bool),
    ("reading_live", bool),
    ("enforced_w", float),
    ("cap_w", float),
    ("min_cap_w", float),
    ("max_cap_w", float),
    ("default_cap_w", float),
    ("last_ack_w", float),
    ("last_ack_mono", float),
    ("safe_cap_w", float),
    ("pending", object),
    ("cap_state", object),
    ("power_w", float),
    ("temp_c", float),
    ("slowdown_temp_c", float),
    ("sm_clock_mhz", float),
    ("max_sm_clock_mhz", float),
    ("reasons", object),
    ("utilization_pct", float),
    ("pre_job_cap_w", float),
    ("sample_enforced_w", float),
    ("sample_mono", float),
    ("slowdown_run", np.int64),
    ("oob_w", float),
    ("oob_mono", float),
    ("foreign_w", float),
    ("foreign_clear_mono", float),
)
"""Every gathered ``GpuObs`` field: (name, dtype; ``object`` keeps the Python values as a tuple)."""

ACCOUNTING = ("have_reading", "enforced_w", "cap_w", "min_cap_w", "max_cap_w", "default_cap_w", "last_ack_w",
              "last_ack_mono", "safe_cap_w", "pending", "foreign_w", "foreign_clear_mono")
"""The fields :func:`accounted_w` and the planner read (a cheaper gather after the solve)."""

_DTYPE = dict(COLUMNS)

STATIC = ("min_cap_w", "max_cap_w", "default_cap_w", "slowdown_temp_c", "max_sm_clock_mhz")
"""The gathered fields only a hello writes (a GPU's limit constraints and device facts): read once
per topology and hello (:meth:`coordinator.registry.Registry.gpu_table`, ``GpuTable.static``)."""


@dataclasses.dataclass(frozen=True)
class Columns:
    """Gathered fields of GPUs ``keys`` (``(node, index)``, slot order): ``col[name]`` is an
    array [G] (object fields: a tuple of G values)."""

    keys: tuple
    col: dict

    def __getitem__(self, name: str):
        return self.col[name]

    def __len__(self) -> int:
        return len(self.keys)


def gather(keys, gpus: list, names=None, static: dict | None = None) -> Columns:
    """The fields ``names`` (default: all of :data:`COLUMNS`) of the ``GpuObs`` records ``gpus``
    (aligned with ``keys``) as columns. ``static``: field -> read-only array [G] of these same
    records (:data:`STATIC`, ``GpuTable.static``), used as they are.

    The numeric fields (float, bool, int) in one pass over the records (one ``operator.attrgetter``
    of them all per record, flattened by ``itertools.chain`` into one ``np.fromiter`` [G x k],
    then one row per field; bools and ints converted back from the float64 values, exact for
    the registry's flags and counters); each object field in a pass of its own (a tuple). The
    records and their values are scattered in memory: one pass of k fields reads each record
    once, k passes read the fleet's records k times (out of cache at 8,000 GPUs). Measured
    (7 Dec 2026, bench/interval_cost.py's fleet, 8,000 GPUs, best of 20): the 14 float fields of
    an interval's gather 1.50 -> 0.78 us per GPU, one pass per field before."""
    names = tuple(n for n, _ in COLUMNS) if names is None else tuple(names)
    n = len(gpus)
    col: dict = {}
    numeric = []
    for name in names:
        if static is not None and name in static:
            col[name] = static[name]
        elif _DTYPE[name] is object:
            col[name] = tuple(map(operator.attrgetter(name), gpus))
        else:
            numeric.append(name)
    if len(numeric) == 1:
        name = numeric[0]
        col[name] = np.fromiter(map(operator.attrgetter(name), gpus), _DTYPE[name], n)
    elif numeric:
        k = len(numeric)
        flat = np.fromiter(itertools.chain.from_iterable(map(operator.attrgetter(*numeric), gpus)), float, n * k)
        block = flat.reshape(n, k).T.copy()  # one contiguous row per field
        for j, name in enumerate(numeric):
            dt = _DTYPE[name]
            col[name] = block[j] if dt is float else block[j].astype(dt)
    return Columns(keys=tuple(keys), col={name: col[name] for name in names})


def constraints_unusable(min_cap_w, max_cap_w) -> np.ndarray:
    """[G] bool: ``capctl.devicedata.constraints_problem(min, max) != ""`` element-wise on arrays
    (W): the same rule (finite, ``MIN_SANE_LIMIT_W <= min <= max <= MAX_SANE_LIMIT_W``, the
    constants of :mod:`capctl.devicedata`) for many GPUs (tested equal)."""
    lo, hi = np.asarray(min_cap_w, float), np.asarray(max_cap_w, float)
    ok = (np.isfinite(lo) & np.isfinite(hi) & (lo <= hi) & (lo >= devicedata.MIN_SANE_LIMIT_W)
          & (hi <= devicedata.MAX_SANE_LIMIT_W))
    return ~ok


def pending_top_w(pending) -> np.ndarray:
    """[G]: the highest cap sent but not acknowledged of each GPU (W; -inf: none)."""
    n = len(pending)
    top = np.full(n, -math.inf)
    if n:  # most GPUs have nothing pending: only the non-empty dicts are visited (C-level truth test)
        busy = np.flatnonzero(np.fromiter(map(bool, pending), bool, n))
        if len(busy):
            top[busy] = [max(pending[i].values()) for i in busy.tolist()]
    return top


def accounted_w(c: Columns, now_mono: float, ack_memory_s: float, problem: np.ndarray) -> np.ndarray:
    """[G] (W): :meth:`coordinator.registry.GpuObs.accounted_w` of every GPU, element-wise equal:
    ``max(enforced read-back, requested limit read back, pending caps, the last acknowledged
    read-back within ack_memory_s, the foreign-writer mark until FOREIGN_HOLD_S after its state
    cleared)``; without a reading its maximum limit (unusable constraints, ``problem``: the highest value it
    reported, at most :data:`capctl.devicedata.MAX_SANE_LIMIT_W`)."""
    value = c["enforced_w"]
    cap = c["cap_w"]
    value = np.where(cap > value, cap, value)  # the request read back (out-of-band limits)
    top = pending_top_w(c["pending"])
    value = np.where(top > value, top, value)
    ack = c["last_ack_w"]
    recent = (now_mono - c["last_ack_mono"]) <= ack_memory_s
    value = np.where(recent & (ack > value), ack, value)
    foreign = c["foreign_w"]  # (NaN: no mark, never greater)
    held = (now_mono - c["foreign_clear_mono"]) <= FOREIGN_HOLD_S
    value = np.where(held & (foreign > value), foreign, value)
    lo, hi, dflt = c["min_cap_w"], c["max_cap_w"], c["default_cap_w"]
    unread = np.where(problem, np.minimum(np.maximum(np.maximum(lo, hi), dflt), devicedata.MAX_SANE_LIMIT_W), hi)
    return np.where(c["have_reading"], value, unread)
