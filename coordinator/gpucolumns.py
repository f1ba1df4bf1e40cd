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

import collections.abc
import dataclasses
import itertools
import math
import operator

import numpy as np

from capctl import devicedata

COLUMNS: tuple[tuple[str, object], ...] = (
    ("have_reading", bool),
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
)
"""Every gathered ``GpuObs`` field: (name, dtype; ``object`` keeps the Python values as a tuple)."""

ACCOUNTING = ("have_reading", "enforced_w", "cap_w", "min_cap_w", "max_cap_w", "default_cap_w", "last_ack_w",
              "last_ack_mono", "safe_cap_w", "pending")
"""The fields :func:`accounted_w` and the planner read (a cheaper gather after the solve)."""

VIEW_ONLY: tuple[tuple[str, object], ...] = (
    ("uuid", object),
    ("error", object),
    ("energy_j", float),
    ("reading_live", bool),
)
"""``GpuObs`` fields only the published view reads (:func:`view_rows`), gathered by name only."""

_DTYPE = dict(COLUMNS + VIEW_ONLY)

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
    read-back within ack_memory_s)``;
    without a reading its maximum limit (unusable constraints, ``problem``: the highest value it
    reported, at most :data:`capctl.devicedata.MAX_SANE_LIMIT_W`)."""
    value = c["enforced_w"]
    cap = c["cap_w"]
    value = np.where(cap > value, cap, value)  # the request read back (out-of-band limits)
    top = pending_top_w(c["pending"])
    value = np.where(top > value, top, value)
    ack = c["last_ack_w"]
    recent = (now_mono - c["last_ack_mono"]) <= ack_memory_s
    value = np.where(recent & (ack > value), ack, value)
    lo, hi, dflt = c["min_cap_w"], c["max_cap_w"], c["default_cap_w"]
    unread = np.where(problem, np.minimum(np.maximum(np.maximum(lo, hi), dflt), devicedata.MAX_SANE_LIMIT_W), hi)
    return np.where(c["have_reading"], value, unread)


VIEW_FIELDS = ("index", "uuid", "have_reading", "power_w", "enforced_w", "temp_c", "slowdown_temp_c", "sm_clock_mhz",
               "reasons", "min_cap_w", "max_cap_w", "cap_state", "max_sm_clock_mhz", "utilization_pct", "energy_j",
               "error", "reading_live")
"""The ``GpuObs`` fields of a view row (:class:`ViewRows`), in row order."""
_VIEW_GATHER = ("have_reading", "power_w", "enforced_w", "temp_c", "sm_clock_mhz", "utilization_pct", "energy_j",
                "reading_live", "cap_w", "last_ack_w", "last_ack_mono", "min_cap_w", "max_cap_w", "default_cap_w",
                "slowdown_temp_c", "max_sm_clock_mhz", "reasons", "cap_state", "error", "pending")
_BOOL_FIELDS = ("have_reading", "reading_live")
_INT_FIELDS = ("sm_clock_mhz", "max_sm_clock_mhz")
_UUIDS: list = [None, ()]  # [the GpuTable.static dict they were read with, the UUIDs (slot order)]


def view_rows(table, now_mono: float, ack_memory_s: float) -> "ViewRows":
    """The view's rows of the registry's GPU slots ``table`` (``GpuTable``: ``keys``, ``gpus``,
    ``static``) read now: :data:`VIEW_FIELDS` and the accounted cap at ``now_mono`` (s,
    :func:`accounted_w`, ``ack_memory_s`` s) of every GPU, as columns; the row tuples are made when
    the view is built (:class:`ViewRows`). UUIDs (only a hello writes them) are read again only when
    the static columns were (a hello or a replaced record: ``GpuTable.static`` is a new dict).

    Why: one tuple of 17 fields and an ``accounted_w`` call per GPU, every interval, for a view
    built only when read. Measured (7 Dec 2026, bench/interval_cost.py's fleet, 8,000 GPUs,
    ``Coordinator._publish`` best of 21 in one process): caches evicted between calls 2.5-2.8 ->
    2.1-2.2 us a GPU; warm 1.9-2.2 either way (the attribute reads are the cost: ~20 a GPU)."""
    gpus = table.gpus
    static = table.static
    c = gather(table.keys, gpus, _VIEW_GATHER, static)
    if static is not None and _UUIDS[0] is static:
        uuids = _UUIDS[1]
    else:
        uuids = tuple(map(operator.attrgetter("uuid"), gpus))
        if static is not None:
            _UUIDS[:] = [static, uuids]
    acc = accounted_w(c, now_mono, ack_memory_s, constraints_unusable(c["min_cap_w"], c["max_cap_w"]))
    return ViewRows(table.keys, {**c.col, "uuid": uuids}, acc)


class ViewRows:
    """The view's rows of many GPUs, kept as the columns they were read as (:func:`view_rows`):
    ``(fields, accounted W)`` with ``fields`` a tuple of :data:`VIEW_FIELDS` (each value of the
    record's type: bools, ints for the clocks, floats, the objects as they were), made on first use
    (any thread; the columns are never changed). :meth:`span` is a node's sequence of them."""

    def __init__(self, keys: tuple, col: dict, accounted: np.ndarray) -> None:
        self._keys = keys
        self._col = col
        self._acc = accounted
        self._rows: list | None = None

    def rows(self) -> list:
        """Every GPU's ``(fields, accounted W)``, slot order."""
        if self._rows is None:
            col = self._col
            lists = []
            for name in VIEW_FIELDS:
                if name == "index":
                    lists.append([k[1] for k in self._keys])
                    continue
                v = col[name]
                if name in _BOOL_FIELDS:
                    v = np.asarray(v, bool).tolist()
                elif name in _INT_FIELDS:
                    v = np.asarray(v).astype(np.int64).tolist()
                elif isinstance(v, np.ndarray):
                    v = v.tolist()
                lists.append(v)
            self._rows = list(zip(zip(*lists), self._acc.tolist()))
        return self._rows

    def span(self, start: int, end: int) -> "RowSpan":
        """The rows of slots ``start`` to ``end`` (one node's GPUs)."""
        return RowSpan(self, start, end)


class RowSpan(collections.abc.Sequence):
    """Rows ``start:end`` of a :class:`ViewRows` (a node's GPUs), read-only."""

    def __init__(self, rows: ViewRows, start: int, end: int) -> None:
        self._all, self._start, self._end = rows, start, end

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, i):
        return self._all.rows()[self._start:self._end][i]

    def __iter__(self):
        return iter(self._all.rows()[self._start:self._end])
