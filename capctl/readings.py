"""A node's GPU readings as rows: the one decoded form of ``GpuTelemetry`` and ``GpuReadings``.

The agent reports its GPUs in a ``NodeTelemetry`` and a ``CapAck`` either as one ``GpuTelemetry``
message per GPU (every agent before packed readings, and any agent talking to a coordinator whose
``Welcome`` lacks ``packed_readings``) or packed, as one ``GpuReadings``: a fixed binary row per
GPU (:data:`ROW`) and a table of its distinct strings (docs/protocol.md, "Packed readings"). The
coordinator decodes either into the same rows (:func:`rows_of`, :func:`packed_rows`; tuples
indexed by the ``R_*`` constants) and checks them once
(:func:`capctl.security.limits.rows_problem`); the registry records rows, never protobuf fields.

Why: reading one node's report field by field, then its strings again for the bound checks, cost
~35 us per 8-GPU message on the 2-core test host (17 field reads per GPU through the protobuf
runtime), most of the coordinator's per-GPU ingest (issue 12, item 7); the same 8 GPUs packed are
decoded and checked in ~12 us (one ``struct.iter_unpack`` and a string table; measured 5 Dec
2026, 200 bench reports x 20).

Stdlib and protobuf only: the agent (``capctl[agent]``, no numpy) packs with :func:`pack`.

Row (tuple of 18), units as the protocol's: ``(index, power_w, cap_w, enforced_w, temp_c,
sm_clock_mhz, utilization_pct, memory_pct, energy_j, pre_job_cap_w, wire_state, wire_reasons,
wire_job, wire_error, cap_state, reasons, job_id, error)``: the first fourteen are a packed row's
fields as decoded (:data:`ROW`: ``index``, ``sm_clock_mhz`` and the four ``wire_*`` ints;
``memory_pct`` NaN when not reported; ``wire_reasons``, ``wire_job``, ``wire_error`` positions in
the message's string table, 0 in a ``GpuTelemetry``'s row, whose ``wire_state`` is its
``cap_state`` field), then ``cap_state`` the state's name (:mod:`capctl.capstates`; "" unspecified),
``reasons`` a tuple of clocks-event-reason names, ``job_id`` and ``error`` strings. The ``R_*``
constants are positions in a row (the quantities' units are the protocol's, named above).
"""

from __future__ import annotations

import math
import struct

from capctl import capstates

ROW = struct.Struct("<IddddIddddIIII")
"""One packed row (``GpuReadings.rows``): uint32 index, float64 power_w, cap_w, enforced_w, temp_c,
uint32 sm_clock_mhz, float64 utilization_pct, memory_pct, energy_j, pre_job_cap_w, uint32 cap_state,
then uint32 positions in ``GpuReadings.strings`` of the reason set, the job id and the error;
little-endian, no padding (88 bytes)."""
MAX_ROW_BYTES = 1024
"""Largest ``GpuReadings.row_bytes`` accepted (room for fields a newer agent appends)."""
MAX_STRINGS = 3 * 64 + 1
"""Most ``GpuReadings.strings``: "" and three per GPU of the largest node."""
MAX_CACHED_REASONS_CHARS = 32 * 129
"""Longest joined reason set kept in the decoder's memo: the longest set the bound checks accept
(32 names of 128 characters, capctl.security.limits). Longer ones are decoded but not kept, so a
message refused for them leaves nothing behind (found by a review: 1 MiB reason strings, each
distinct, kept ~38 MB per refused message)."""
MAX_CACHED_REASON_NAMES = 32
"""Most names of a reason set kept in the memo: the most the bound checks accept
(``capctl.security.limits.MAX_CLOCK_REASONS``, tested equal). A set of ~4,000 empty names
(separators only) within :data:`MAX_CACHED_REASONS_CHARS` is decoded but not kept (found by a
review: 4,096 such sets, each in a refused message, held 153 MB)."""
REASON_SEP = "\x1f"
"""Joins the clocks-event-reason names of one set in ``GpuReadings.strings`` (U+001F, unit
separator: NVML's reason names are identifiers, :mod:`capctl.reasons`). Two sets have no packed
form: a name containing U+001F (it decodes as two names) and a set of one empty name (it decodes
as no reason); no agent sends either."""

(R_INDEX, R_POWER, R_CAP, R_ENFORCED, R_TEMP, R_CLOCK, R_UTIL, R_MEM, R_ENERGY, R_PRE_JOB, R_WIRE_STATE, R_WIRE_REASONS,
 R_WIRE_JOB, R_WIRE_ERROR, R_STATE, R_REASONS, R_JOB, R_ERROR) = range(18)
"""Positions in a decoded row (module docstring)."""


class _ReasonSets(dict):
    """A reason set as sent (names joined by :data:`REASON_SEP`) -> its tuple of names, filled on
    first use and bounded (a fleet reports a few distinct sets)."""

    def __missing__(self, joined: str) -> tuple:
        names = tuple(joined.split(REASON_SEP)) if joined else ()
        if len(joined) > MAX_CACHED_REASONS_CHARS or len(names) > MAX_CACHED_REASON_NAMES:
            return names  # (not checked yet: a message refused for it must leave nothing held)
        if len(self) >= 4096:
            self.clear()
        self[joined] = names
        return names


_REASON_SETS = _ReasonSets()


def pack(gpus, readings) -> None:
    """Fill ``readings`` (an empty ``GpuReadings``) with the ``GpuTelemetry`` messages ``gpus``:
    the same facts, packed (the agent's encoder; :func:`rows_of` decodes both to equal rows, a
    cap state the protocol does not define, which only a peer from before the enum sends, aside)."""
    strings: dict[str, int] = {"": 0}
    pos = strings.setdefault
    packed = []
    for g in gpus:
        mem = g.utilization_rates.memory_pct if g.HasField("utilization_rates") else math.nan
        state = g.cap_state or capstates.wire_of_name(g.cap_state_name)
        reasons = pos(REASON_SEP.join(g.clocks_event_reasons), len(strings))
        job = pos(g.job_id, len(strings))
        error = pos(g.error, len(strings))
        packed.append(ROW.pack(g.index, g.power_w, g.cap_w, g.enforced_w, g.temp_c, g.sm_clock_mhz, g.utilization_pct,
                               mem, g.energy_j, g.pre_job_cap_w, state, reasons, job, error))
    readings.row_bytes = ROW.size
    readings.rows = b"".join(packed)
    readings.strings.extend(strings)


def fill(part, gpus: list, packed: bool) -> None:
    """Put the ``GpuTelemetry`` messages ``gpus`` into ``part`` (an empty ``NodeTelemetry`` or
    ``CapAck``): packed (:func:`pack` into ``part.readings``, to a coordinator whose ``Welcome``
    asked for it) or one message per GPU (``part.gpus``)."""
    if packed:
        pack(gpus, part.readings)
    else:
        part.gpus.extend(gpus)


def is_packed(part) -> bool:
    """True when ``part`` (a ``NodeTelemetry`` or ``CapAck``) carries packed readings."""
    return part.HasField("readings")


def rows_of(part) -> list[tuple]:
    """The GPU rows of ``part`` (a ``NodeTelemetry`` or ``CapAck``), packed or not. The strings
    are not checked here (:func:`capctl.security.limits.rows_problem`).

    Raises:
        ValueError: packed readings that cannot be decoded (:func:`packed_rows`'s problem).
    """
    if part.HasField("readings"):
        rows, problem = packed_rows(part.readings, "readings", 1 << 16)
        if problem:
            raise ValueError(problem)
        return rows
    state_of = capstates.name_of_wire
    return [(g.index, g.power_w, g.cap_w, g.enforced_w, g.temp_c, g.sm_clock_mhz, g.utilization_pct,
             g.utilization_rates.memory_pct if g.HasField("utilization_rates") else math.nan, g.energy_j,
             g.pre_job_cap_w, g.cap_state, 0, 0, 0, state_of(g.cap_state, g.cap_state_name),
             tuple(g.clocks_event_reasons), g.job_id, g.error)
            for g in part.gpus]


def packed_rows(r, field: str, max_rows: int) -> tuple[list, str]:
    """``(rows, problem)`` of the ``GpuReadings`` ``r``: its decoded rows, or ``[]`` and what makes
    it undecodable: the row size, the byte count, more than ``max_rows`` rows, the string table
    (at most :data:`MAX_STRINGS`, "" first), a row naming a string it does not have. Readings
    (power, temperature, ...) are not judged (a non-finite one is treated as missing, as a
    ``GpuTelemetry``'s), nor the strings' contents and the index range
    (:func:`capctl.security.limits.rows_problem`, as for a ``GpuTelemetry``). ``field``: the
    message's field name for the problem's text."""
    rows, _tails, problem = packed_rows_tails(r, field, max_rows)
    return rows, problem


def packed_rows_tails(r, field: str, max_rows: int) -> tuple[list, dict, str]:
    """:func:`packed_rows` with the rows' distinct string parts: ``(rows, tails, problem)``, where
    ``tails`` maps each distinct ``(wire_state, wire_reasons, wire_job, wire_error)`` of the rows
    to its decoded ``(cap_state, reasons, job_id, error)`` (each row is its 14 packed fields + its
    tail; ``{}`` when ``problem``). A node reports one or two distinct tails: the bound checks judge
    those, not every row (:func:`capctl.security.limits.ack_rows`).

    Why: the bound checks of every row cost ~0.36 us a GPU, most of it spent judging the same
    strings again; with the tails they judge one or two parts a report (~0.19 us a GPU, the
    decode itself unchanged at ~0.55: one dict lookup per row on its packed positions instead of
    four string lookups, ``r.strings[:]`` instead of ``list(r.strings)``; ``limits.telemetry_rows``
    0.91 -> 0.74 us a GPU on bench/interval_cost.py's reports, 7 Dec 2026)."""
    size = r.row_bytes
    if not ROW.size <= size <= MAX_ROW_BYTES:
        return [], {}, f"{field}.row_bytes {size}: need {ROW.size} to {MAX_ROW_BYTES} (capctl.readings.ROW)"
    data = r.rows
    if len(data) % size:
        return [], {}, f"{field}.rows: {len(data)} bytes, not a whole number of {size}-byte rows"
    n = len(data) // size
    if n > max_rows:
        return [], {}, f"{field}: {n} GPUs, at most {max_rows} allowed"
    strs = r.strings[:]
    if not 1 <= len(strs) <= MAX_STRINGS or strs[0]:
        return [], {}, (f"{field}.strings: {len(strs)} strings" + (f", the first {strs[0][:40]!r}" if strs else "")
                        + f"; need 1 to {MAX_STRINGS}, \"\" first")
    recs = (list(ROW.iter_unpack(data)) if size == ROW.size  # (a newer agent's longer rows: their first fields)
            else [ROW.unpack_from(data, k * size) for k in range(n)])
    tails: dict = {}
    known = tails.get
    try:
        return [rec + (known(rec[10:]) or _tail(tails, rec, strs)) for rec in recs], tails, ""
    except IndexError:
        k, col = next((k, c) for k, rec in enumerate(recs) for c in (11, 12, 13) if rec[c] >= len(strs))
        what = {11: "clocks_event_reasons", 12: "job_id", 13: "error"}[col]
        return [], {}, (f"{field}.rows[{k}].{what}: string {recs[k][col]}, need a position in strings "
                        f"(0 to {len(strs) - 1})")


def _tail(tails: dict, rec: tuple, strs: list) -> tuple:
    """The decoded ``(cap_state, reasons, job_id, error)`` of the packed row ``rec`` (its string
    positions in ``strs``), kept in ``tails`` under its four packed ints (:func:`packed_rows_tails`).

    Raises:
        IndexError: a position ``strs`` does not have."""
    tail = tails[rec[10:]] = (capstates.WIRE_NAMES[rec[10]], _REASON_SETS[strs[rec[11]]], strs[rec[12]],
                              strs[rec[13]])
    return tail
