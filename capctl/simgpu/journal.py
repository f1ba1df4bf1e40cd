"""The simulated driver's enforced-limit journal, and the exact budget checker built on it.

Every change of a simulated GPU's enforced limit is appended to ``<state file>.journal`` by the
driver itself (csrc/simnvml/state.c, ``capsim_journal_flush``), stamped with ``CLOCK_MONOTONIC``
in nanoseconds while the node lock is held. The journal is therefore in time order, holds every
value any reader could ever have seen, and one clock orders the journals of all nodes on the
machine (the clock of :func:`time.monotonic_ns`). From it :func:`check_budget` computes, for any
set of GPUs on any number of nodes, the exact maximum over time of the sum of their enforced
limits and every interval during which that sum exceeded a limit. This replaces sampling GPUs one
after another, which cannot tell an overshoot from a torn read.

Sums are taken in integer microwatts, so they are exact for every value the driver holds (whole
milliwatts from NVML; arbitrary control-API values to 1 µW).

Format (little-endian, ``simgpu.h``): a 64-byte header (magic ``CAPJRNL1``, version, header
and record sizes, GPU count, node id, creation time) followed by 32-byte records
``(t_ns u64, gpu u32, cause u32, enforced_w f64, limit_w f64)``; cause 0 = the GPU's initial
value at creation, 1 = a change.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capctl.errors import UserInputError

STATE_FILE = "node.state"
"""Name of a node's state file inside its directory (``capctl-simgpu init DIR``)."""
JOURNAL_SUFFIX = ".journal"
"""Appended to the state file's name (``DIR/node.state.journal``)."""
MAGIC = b"CAPJRNL1"
VERSION = 1
HEADER_DTYPE = np.dtype([("magic", "S8"), ("version", "<u4"), ("header_bytes", "<u4"),
                         ("record_bytes", "<u4"), ("gpu_count", "<u4"), ("node_id", "V16"),
                         ("created_ns", "<u8"), ("pad", "<u8", (2,))])
RECORD_DTYPE = np.dtype([("t_ns", "<u8"), ("gpu", "<u4"), ("cause", "<u4"), ("enforced_w", "<f8"),
                         ("limit_w", "<f8")])
CAUSE_CREATED, CAUSE_CHANGED = 0, 1
UW_PER_W = 1_000_000
"""Sums are exact in integer microwatts."""


class JournalError(UserInputError):
    """A journal is missing, not a journal, of another version, or incomplete (names the file)."""


@dataclass(frozen=True)
class NodeJournal:
    """One node's journal.

    Attributes:
        name: the node's name in results (given by the caller, else the directory's name).
        path: the journal file.
        gpu_count: GPUs on the node.
        created_ns: CLOCK_MONOTONIC (ns) when the node was created.
        records: structured array of :data:`RECORD_DTYPE`, in time order.
        unjournaled: changes the driver could not write (``journal_errors`` in the state file's
            header; 0 when the state file is gone). Non-zero makes every check incomplete.
        torn_bytes: bytes of a trailing partial record (a writer killed mid-write); non-zero makes
            every check incomplete.
    """

    name: str
    path: Path
    gpu_count: int
    created_ns: int
    records: np.ndarray
    unjournaled: int = 0
    torn_bytes: int = 0


def node_name_of(path: str | Path) -> str:
    """The default name of a node: its directory's name (for a directory, a state or a journal file)."""
    p = Path(path).absolute()
    return p.name if p.is_dir() else p.parent.name


def journal_path(path: str | Path) -> Path:
    """The journal of ``path``: a node directory, its state file, or the journal itself."""
    p = Path(path)
    if p.name.endswith(JOURNAL_SUFFIX):
        return p
    if p.is_dir():
        p = p / STATE_FILE
    return p.with_name(p.name + JOURNAL_SUFFIX)


STATE_MAGIC = b"CAPSIMv1"
JOURNAL_ERRORS_OFFSET = 80
"""Byte offset of ``capsim_header.journal_errors`` (a static assertion in state.c pins it)."""


def _unjournaled(state_file: Path) -> int:
    """``journal_errors`` from the state file's header (read-only: the checker needs no write
    access); 0 when the state file is gone or is not a node file."""
    try:
        with open(state_file, "rb") as f:
            head = f.read(JOURNAL_ERRORS_OFFSET + 8)
    except OSError:
        return 0
    if len(head) < JOURNAL_ERRORS_OFFSET + 8 or head[:8] != STATE_MAGIC:
        return 0
    return int.from_bytes(head[JOURNAL_ERRORS_OFFSET:], "little")


def read_journal(path: str | Path, name: str | None = None) -> NodeJournal:
    """Read one node's journal (``path``: node directory, state file or journal file).

    Raises:
        JournalError: the file is missing or is not a journal of this version.
    """
    jp = journal_path(path)
    try:
        data = jp.read_bytes()
    except OSError as err:
        p = Path(path)
        if not p.exists():  # as ``fault`` says it: a node directory, state file or journal, not a typo'd path
            raise JournalError(f"{path!s} holds no simulated node (no such file or directory; expected a node "
                               f"directory DIR with DIR/{STATE_FILE}, its state file or its journal)") from None
        raise JournalError(f"cannot read the enforced-limit journal {jp}: {err.strerror}") from None
    if len(data) < HEADER_DTYPE.itemsize or data[:8] != MAGIC:
        raise JournalError(f"{jp} is not an enforced-limit journal (bad magic or too short)")
    hdr = np.frombuffer(data, HEADER_DTYPE, count=1)[0]
    if (int(hdr["version"]) != VERSION or int(hdr["record_bytes"]) != RECORD_DTYPE.itemsize
            or int(hdr["header_bytes"]) != HEADER_DTYPE.itemsize):
        raise JournalError(f"{jp}: journal version {int(hdr['version'])} (record {int(hdr['record_bytes'])} "
                           f"bytes); allowed: version {VERSION} with {RECORD_DTYPE.itemsize}-byte records")
    body = data[HEADER_DTYPE.itemsize:]
    whole = len(body) // RECORD_DTYPE.itemsize * RECORD_DTYPE.itemsize
    records = np.frombuffer(body[:whole], RECORD_DTYPE).copy()
    state_file = jp.with_name(jp.name[: -len(JOURNAL_SUFFIX)])
    node_name = name or node_name_of(jp)
    return NodeJournal(node_name, jp, int(hdr["gpu_count"]), int(hdr["created_ns"]), records,
                       _unjournaled(state_file), len(body) - whole)


@dataclass(frozen=True)
class Overshoot:
    """One interval during which the sum exceeded the limit: ``[start_ns, end_ns)``, its peak (W)."""

    start_ns: int
    end_ns: int
    peak_w: float

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(frozen=True)
class BudgetCheck:
    """Result of :func:`check_budget` over ``[since_ns, until_ns]`` (CLOCK_MONOTONIC ns).

    ``max_sum_w`` is the exact maximum of the sum of the selected GPUs' enforced limits, reached
    first at ``max_at_ns``; ``over`` lists every interval with the sum above ``limit_w``;
    ``problems`` names what makes the journal incomplete (then nothing is proven); ``changes``
    counts the instants at which the sum changed (changes under one lock hold are one instant);
    ``since_ns`` is clipped to when the last selected GPU was created.
    """

    limit_w: float | None
    max_sum_w: float
    max_at_ns: int
    since_ns: int
    until_ns: int
    gpus: int
    changes: int
    over: tuple[Overshoot, ...] = ()
    problems: tuple[str, ...] = ()
    initial_sum_w: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.problems

    @property
    def ok(self) -> bool:
        """Complete, and never above the limit."""
        return self.complete and not self.over

    def describe(self) -> str:
        """One paragraph for a person (and for assertion messages)."""
        span = (self.until_ns - self.since_ns) / 1e9
        text = (f"max sum of enforced limits {self.max_sum_w:.3f} W over {self.gpus} GPUs "
                f"({self.changes} changes in {span:.1f} s)")
        if self.limit_w is not None:
            text += f", limit {self.limit_w:.3f} W: " + ("within" if not self.over else
                                                        f"EXCEEDED in {len(self.over)} interval(s)")
            for o in self.over[:10]:
                text += (f"\n  over from +{(o.start_ns - self.since_ns) / 1e9:.4f} s for "
                         f"{o.duration_s * 1e3:.3f} ms, peak {o.peak_w:.3f} W")
        for p in self.problems:
            text += f"\n  INCOMPLETE: {p}"
        return text

    def to_json(self) -> dict:
        return {"limit_w": self.limit_w, "max_sum_w": self.max_sum_w, "max_at_ns": self.max_at_ns,
                "since_ns": self.since_ns, "until_ns": self.until_ns, "gpus": self.gpus,
                "changes": self.changes, "ok": self.ok, "complete": self.complete,
                "initial_sum_w": self.initial_sum_w, "problems": list(self.problems),
                "over": [{"start_ns": o.start_ns, "end_ns": o.end_ns, "duration_s": o.duration_s,
                          "peak_w": o.peak_w} for o in self.over]}


def _select(journals: Sequence[NodeJournal], gpus: Mapping[str, Iterable[int]] | None):
    """Per selected GPU: its records' times (ns), node numbers and values (µW); their count; the
    problems that make the journals incomplete."""
    names = [j.name for j in journals]
    if len(set(names)) != len(names):
        raise JournalError(f"node names must be unique; got {names}")
    if gpus is not None:
        unknown = sorted(set(gpus) - set(names))
        if unknown:
            raise JournalError(f"GPUs of node {unknown[0]!r} asked for; journals given: {', '.join(names)}")
    ts, nodes_of, vals, problems = [], [], [], []
    key = 0
    for node_no, j in enumerate(journals):
        wanted = range(j.gpu_count) if gpus is None else sorted(set(int(i) for i in gpus.get(j.name, ())))
        for i in wanted:
            if not 0 <= i < j.gpu_count:
                raise JournalError(f"GPU {i} of node {j.name} asked for; allowed: 0..{j.gpu_count - 1}")
            recs = j.records[j.records["gpu"] == i]
            if len(recs) == 0 or recs["cause"][0] != CAUSE_CREATED:
                problems.append(f"{j.path}: GPU {i} has no initial record")
                continue
            ts.append(recs["t_ns"].astype(np.int64))
            vals.append(np.rint(recs["enforced_w"] * UW_PER_W).astype(np.int64))
            nodes_of.append(np.full(len(recs), node_no, np.int64))
            key += 1
        if j.unjournaled:
            problems.append(f"{j.path}: {j.unjournaled} enforced-limit changes were not journaled")
        if j.torn_bytes:
            problems.append(f"{j.path}: {j.torn_bytes} bytes of a partial record at the end")
    return ts, nodes_of, vals, key, problems


def _group_sums(t: np.ndarray, delta: np.ndarray, node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sum after every distinct timestamp (changes stamped alike under one node lock happened
    together). Where two nodes share a nanosecond their order is unknown: the sum is taken with the
    increases first (the worst case), then the group's net result at the next instant."""
    sums = np.cumsum(delta)
    last = np.r_[t[1:] != t[:-1], True]
    gt, gs = t[last], sums[last]
    starts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
    ends = np.r_[starts[1:], len(t)]
    multi = np.flatnonzero(ends - starts > 1)
    mixed = [(int(starts[m]), int(ends[m])) for m in multi if len(set(node[starts[m]:ends[m]].tolist())) > 1]
    if not mixed:
        return gt, gs
    out_t, out_s = list(gt.tolist()), list(gs.tolist())
    for a, b in mixed:  # rare: insert a worst-case instant before the group's net result
        before = int(sums[a - 1]) if a > 0 else 0
        per_node: dict[int, int] = {}
        for x in range(a, b):
            per_node[int(node[x])] = per_node.get(int(node[x]), 0) + int(delta[x])
        worst = before + sum(d for d in per_node.values() if d > 0)
        pos = out_t.index(int(t[a]))
        out_s[pos] = max(worst, out_s[pos])
    return np.asarray(out_t, np.int64), np.asarray(out_s, np.int64)


def check_budget(journals: Sequence[NodeJournal], limit_w: float | None = None,
                 gpus: Mapping[str, Iterable[int]] | None = None, since_ns: int | None = None,
                 until_ns: int | None = None) -> BudgetCheck:
    """Exact maximum over time of the sum of enforced limits, and every interval above ``limit_w``.

    Args:
        journals: from :func:`read_journal`, one per node (unique names).
        limit_w: the domain limit in watts (None: only the maximum).
        gpus: node name -> GPU indices to include (None: every GPU of every journal).
        since_ns, until_ns: CLOCK_MONOTONIC window (:func:`time.monotonic_ns`); the sum in force
            at ``since_ns`` counts. Defaults: when the last selected GPU was created, and now.
    Raises:
        JournalError: unknown node names or GPU indices, or no GPU selected.
    """
    if limit_w is not None and not (math.isfinite(limit_w) and limit_w > 0):
        raise JournalError(f"limit {limit_w!r} W is invalid; allowed: a finite number of watts > 0")
    if since_ns is not None and until_ns is not None and until_ns < since_ns:
        raise JournalError(f"the window ends ({until_ns} ns) before it starts ({since_ns} ns)")
    hi = int(until_ns if until_ns is not None else time.monotonic_ns())  # before reading: nothing later counts
    ts, nodes_of, vals, nkeys, problems = _select(journals, gpus)
    if nkeys == 0:
        raise JournalError("no GPU selected: give journals and GPUs that exist")
    t = np.concatenate(ts)
    v = np.concatenate(vals)
    node = np.concatenate(nodes_of)
    prev = np.concatenate([np.concatenate([[0], x[:-1]]) for x in vals])  # per-key previous value
    order = np.argsort(t, kind="stable")
    t, delta, node = t[order], (v - prev)[order], node[order]
    gt, gs = _group_sums(t, delta, node)
    first_created = max(int(x[0]) for x in ts)
    if hi < first_created:
        raise JournalError(f"the window ends ({hi} ns) before the selected GPUs existed ({first_created} ns)")
    lo = max(first_created, since_ns if since_ns is not None else first_created)
    # the sum in force at lo, then every group inside (lo, hi]
    start = int(np.searchsorted(gt, lo, side="right")) - 1
    inside_end = int(np.searchsorted(gt, hi, side="right"))
    seg_t = np.concatenate([[lo], gt[start + 1:inside_end]])
    seg_s = np.concatenate([[gs[start]], gs[start + 1:inside_end]])
    imax = int(np.argmax(seg_s))
    over: list[Overshoot] = []
    if limit_w is not None:
        above = seg_s > int(round(limit_w * UW_PER_W))
        bounds = np.diff(np.concatenate([[0], above.astype(np.int8), [0]]))
        for a, b in zip(np.flatnonzero(bounds == 1), np.flatnonzero(bounds == -1)):
            end = int(seg_t[b]) if b < len(seg_t) else hi
            over.append(Overshoot(int(seg_t[a]), end, float(seg_s[a:b].max()) / UW_PER_W))
    return BudgetCheck(limit_w, float(seg_s[imax]) / UW_PER_W, int(seg_t[imax]), lo, hi, nkeys,
                       int(len(seg_t) - 1), tuple(over), tuple(problems), float(seg_s[0]) / UW_PER_W)


def check_nodes(paths: Mapping[str, str | Path], limit_w: float | None = None,
                gpus: Mapping[str, Iterable[int]] | None = None, since_ns: int | None = None,
                until_ns: int | None = None) -> BudgetCheck:
    """:func:`check_budget` over the journals of ``paths`` (node name -> directory/state file)."""
    return check_budget([read_journal(p, n) for n, p in paths.items()], limit_w, gpus, since_ns, until_ns)


def main_check(args) -> int:
    """``capctl-simgpu journal``: exit 0 within the limit (or no limit), 2 exceeded, 1 incomplete."""
    paths: dict[str, str] = {}
    for spec in args.nodes:
        name, sep, path = spec.partition("=")
        if not sep or "/" in name or not name:  # a path that holds '=' is a path
            name, path = node_name_of(spec), spec
        if name in paths:
            raise UserInputError(f"node name {name!r} is given twice ({paths[name]}, {path}); "
                                 "name them: NAME=DIR")
        paths[name] = path
    gpus: dict[str, list[int]] | None = None
    if args.gpu:
        gpus = {}
        for spec in args.gpu:
            name, sep, idx = spec.partition(":")
            try:
                if not sep:
                    raise ValueError(spec)
                gpus.setdefault(name, []).extend(int(x) for x in idx.split(","))
            except ValueError:
                raise UserInputError(f"--gpu {spec!r} is invalid; allowed: NODE:I[,J...]") from None
    res = check_nodes(paths, args.limit_w, gpus, args.since_ns, args.until_ns)
    print(json.dumps(res.to_json(), indent=2) if args.json else res.describe())
    if not res.complete:
        return 1
    return 2 if res.over else 0

