"""Per-job GPU energy of one node, from the devices' total-energy counters (pure; no device access).

Source: NVML ``nvmlDeviceGetTotalEnergyConsumption`` (Volta and later), the energy (mJ, turned
into J by :mod:`nodeagent.nvml`) the GPU used since the driver was last loaded. The agent feeds
:meth:`EnergyMeter.observe` a reading of every GPU at JobStart (before the new binding), at JobEnd
(before the unbinding) and at every report, so a job's energy is a sum of counter differences
taken exactly at its start and end: exact whatever the job's length or the report interval.

Rules (docs/nodeagent.md, "Per-job energy"):

* **Interval.** Between two readings of a GPU the set of jobs bound to it is constant (bindings
  change only right after a reading). The counter difference of that interval is charged to them.
* **Shared GPUs** (MIG instances, several jobs on one GPU): NVML has one energy counter per
  physical GPU and none per MIG instance, so each interval's difference, its seconds, its capped
  and thermal seconds are split *equally* between the jobs bound to the GPU in that interval. The
  shares of a GPU always add up to its counter difference: nothing is counted twice or lost.
* **Counter resets** (driver reload, GPU reset: the counter restarts at 0): a reading below the
  previous one counts as a reset; the interval is charged the new reading (the energy since the
  reset). The energy between the previous reading and the reset is unknown and not charged (at
  most one report interval's worth); :attr:`JobEnergy.resets` counts such intervals.
* **Unreadable GPU** (error sample, no counter: NaN): the GPU's last good reading is kept; the next
  good one charges the whole gap to the jobs bound at that time.
* **Ended jobs** are kept (:data:`KEEP_ENDED_S`, at most :data:`KEEP_ENDED_MAX`) and sent again
  after every reconnect: a ``JobEnded`` sent while the coordinator was unreachable is dropped by the
  link, and the coordinator then finishes the job from the re-sent record.
* **Agent restarts** (:meth:`EnergyMeter.snapshot` / :meth:`EnergyMeter.restore`, kept in the
  agent's state file with the job bindings, written at every job start and end, every 20 plans and
  at a clean stop): the running jobs' records and each GPU's last counter reading come back, so the
  first reading after the restart charges the whole gap (the agent's downtime included) to the
  jobs bound, and a job's energy counts from its start, not from the restart. A reading of a GPU
  whose UUID changed is dropped (another device: its next interval is not charged). A driver
  reload meanwhile (the counter went back) is a reset as above: the energy between the last saved
  reading and the reload is lost (unknown), the rest is kept.
* **Time capped / in thermal slowdown**: the interval's seconds (split as above) count when the
  reading that closes it shows a power-capping / thermal clocks event reason
  (:func:`capctl.reasons.classify`): sampled once per interval.

Units: joules, seconds (``timestamp_s``: Unix time), watts.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from capctl.reasons import classify
from capctl.security.limits import JOB_LABELS, label_or_empty

KEEP_ENDED_S = 3600.0
"""An ended job's final record is kept this long (s) to be sent again after a reconnect."""
KEEP_ENDED_MAX = 1000
"""At most this many ended jobs' records are kept (the oldest dropped first)."""
SNAPSHOT_ENDED_MAX = 100
"""At most this many ended jobs' records (the newest) go into a :meth:`EnergyMeter.snapshot`."""
_NUMBERS = ("start_time_s", "energy_j", "gpu_s", "capped_s", "thermal_s", "power_w", "peak_power_w", "end_time_s")


@dataclasses.dataclass
class JobEnergy:
    """What one job used on this node's GPUs so far (J, GPU-seconds, W, Unix s).

    ``gpu_s``, ``capped_s`` and ``thermal_s`` are GPU-seconds (a 2-GPU job capped for 10 s has
    ``capped_s`` 20), shared GPUs split equally. ``power_w``: mean power of the job's share over
    its latest interval; ``peak_power_w``: the highest such value. ``end_time_s`` is 0 while the
    job runs. ``resets``: intervals with a counter reset (energy of those may be short).
    """

    job_id: str
    start_time_s: float
    energy_j: float = 0.0
    gpu_s: float = 0.0
    capped_s: float = 0.0
    thermal_s: float = 0.0
    power_w: float = 0.0
    peak_power_w: float = 0.0
    end_time_s: float = 0.0
    resets: int = 0
    gpus: int = 0
    user: str = ""
    partition: str = ""
    account: str = ""



class EnergyMeter:
    """Energy accounting of one node: the last counter reading of each GPU and the running jobs'
    :class:`JobEnergy` (see the module docstring for the rules). Not thread safe: the agent calls it
    under its lock."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}  # GPU index -> (counter J, Unix s)
        self.jobs: dict[str, JobEnergy] = {}
        self.ended: collections.OrderedDict[str, JobEnergy] = collections.OrderedDict()

    def observe(self, samples: Iterable, bound: Mapping[int, Sequence[str]]) -> None:
        """Charge every GPU's counter difference since its previous reading to the jobs ``bound``
        to it (``{index: [job_id, ...]}``: the bindings in force since that reading).

        ``samples``: :class:`~nodeagent.backend.GpuSample`-like objects (``index``, ``energy_j``,
        ``timestamp_s``, ``clocks_event_reasons``, ``error``). Never raises for odd readings.
        """
        power: dict[str, float] = {}
        for s in samples:
            e = getattr(s, "energy_j", math.nan)
            t = getattr(s, "timestamp_s", math.nan)
            if getattr(s, "error", None) or not (_finite(e) and e >= 0.0 and _finite(t)):
                continue
            prev = self._last.get(s.index)
            self._last[s.index] = (e, t)
            if prev is None:
                continue
            jobs = [j for j in bound.get(s.index, ()) if j in self.jobs]
            if not jobs:
                continue
            reset = e < prev[0]
            delta_j = e if reset else e - prev[0]
            dt = max(0.0, t - prev[1])
            thermal, capped = classify(tuple(getattr(s, "clocks_event_reasons", ()) or ()))
            share = 1.0 / len(bound.get(s.index, ()) or jobs)
            for job_id in jobs:
                rec = self.jobs[job_id]
                rec.energy_j += delta_j * share
                rec.gpu_s += dt * share
                rec.capped_s += dt * share if capped else 0.0
                rec.thermal_s += dt * share if thermal else 0.0
                rec.resets += 1 if reset else 0
                if dt > 0:
                    power[job_id] = power.get(job_id, 0.0) + delta_j * share / dt
        for job_id, p in power.items():
            rec = self.jobs[job_id]
            rec.power_w = p
            rec.peak_power_w = max(rec.peak_power_w, p)

    def start(self, job_id: str, start_time_s: float, gpus: int, meta: Mapping | None = None) -> JobEnergy:
        """Start (or keep) the record of ``job_id`` (``gpus``: its GPU count on this node; ``meta``:
        its binding's ``user``, ``partition``, ``account``, kept where the record has none); call it
        after the :meth:`observe` that closes the intervals before the job. Idempotent."""
        rec = self.jobs.get(job_id)
        if rec is None:
            rec = self.jobs[job_id] = JobEnergy(job_id=job_id, start_time_s=start_time_s)
        rec.gpus = max(rec.gpus, int(gpus))
        for f in JOB_LABELS:  # who ran it (capctl.security.limits), so a coordinator that never saw
            if not getattr(rec, f) and meta:  # its binding still records them
                setattr(rec, f, label_or_empty(meta.get(f)))
        return rec

    def finish(self, job_id: str, end_time_s: float) -> JobEnergy | None:
        """Close and return the record of ``job_id`` (None when the meter never saw it start);
        call it after the :meth:`observe` that closes the job's last interval."""
        rec = self.jobs.pop(job_id, None)
        if rec is not None:
            rec.end_time_s = end_time_s
            self.ended.pop(job_id, None)
            self.ended[job_id] = rec
            while len(self.ended) > KEEP_ENDED_MAX:
                self.ended.popitem(last=False)
        return rec

    def kept_ended(self, now_s: float) -> list[JobEnergy]:
        """The final records of the jobs ended within :data:`KEEP_ENDED_S` of ``now_s`` (Unix s),
        oldest first (older ones are dropped)."""
        while self.ended and next(iter(self.ended.values())).end_time_s < now_s - KEEP_ENDED_S:
            self.ended.popitem(last=False)
        return list(self.ended.values())

    def running(self) -> list[JobEnergy]:
        """The records of the running jobs, by job id."""
        return [self.jobs[j] for j in sorted(self.jobs)]

    def snapshot(self, uuids: Mapping[int, str]) -> dict:
        """The meter as JSON data for the agent's state file: ``{"readings": {"<index>": {"energy_j",
        "timestamp_s", "uuid"}}, "jobs": {job_id: record}, "ended": {job_id: record}}`` (J, Unix s;
        ``uuids``: index -> the GPU's UUID now; records as :class:`JobEnergy` fields). The records
        and readings are consistent: every record holds the energy up to the readings."""
        ended = list(self.ended.values())[-SNAPSHOT_ENDED_MAX:]
        return {
            "readings": {str(i): {"energy_j": e, "timestamp_s": t, "uuid": uuids.get(i, "")}
                         for i, (e, t) in sorted(self._last.items())},
            "jobs": {j: dataclasses.asdict(r) for j, r in sorted(self.jobs.items())},
            "ended": {r.job_id: dataclasses.asdict(r) for r in ended},
        }

    def restore(self, doc, uuids: Mapping[int, str]) -> list[str]:
        """Take back a :meth:`snapshot` after a restart: the records of the jobs running now (started
        with :meth:`start` from the restored bindings; the others are dropped), the ended ones, and the
        reading of every GPU whose UUID is the same (``uuids``: index -> UUID now). Returns one line
        per entry left out (field, value, why); never raises for a malformed ``doc``."""
        if not isinstance(doc, dict):
            return [] if doc is None else [f"energy: {type(doc).__name__} is not an object"]
        problems: list[str] = []
        readings = doc.get("readings") if isinstance(doc.get("readings"), dict) else {}
        for key, r in readings.items():
            where = f"energy.readings.{key}"
            if not (isinstance(key, str) and key.isdigit() and isinstance(r, dict)):
                problems.append(f"{where}: expected a GPU index with an object")
                continue
            e, t, uuid = r.get("energy_j"), r.get("timestamp_s"), r.get("uuid")
            if not (_number(e) and e >= 0 and _number(t)):
                problems.append(f"{where}: energy_j {e!r}, timestamp_s {t!r}: expected finite numbers, energy >= 0")
            elif uuid != uuids.get(int(key)):
                problems.append(f"{where}: GPU {uuid!r} is now {uuids.get(int(key))!r}: its reading is not used")
            else:
                self._last[int(key)] = (float(e), float(t))
        for part, target in (("jobs", self.jobs), ("ended", None)):
            records = doc.get(part) if isinstance(doc.get(part), dict) else {}
            for job_id, r in records.items():
                rec = _record(job_id, r, f"energy.{part}.{job_id}", problems)
                if rec is None:
                    continue
                if target is None:
                    if job_id not in self.jobs:
                        self.ended[job_id] = rec
                elif job_id in target:
                    rec.gpus = max(rec.gpus, target[job_id].gpus)
                    for f in JOB_LABELS:  # a state file from before these fields: the binding's names
                        if not getattr(rec, f):
                            setattr(rec, f, getattr(target[job_id], f))
                    target[job_id] = rec
        return problems


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _record(job_id, r, where: str, problems: list[str]) -> JobEnergy | None:
    """The :class:`JobEnergy` of snapshot entry ``r`` (None, with a line in ``problems``, when malformed)."""
    if not isinstance(r, dict) or not isinstance(job_id, str) or r.get("job_id") != job_id:
        problems.append(f"{where}: expected the record of job {job_id!r}")
        return None
    bad = [f for f in _NUMBERS if not (_number(r.get(f)) and r.get(f) >= 0)]
    bad += [f for f in ("resets", "gpus") if not (isinstance(r.get(f), int) and not isinstance(r.get(f), bool)
                                                  and r.get(f) >= 0)]
    if bad:
        problems.append(f"{where}: {', '.join(f'{f} {r.get(f)!r}' for f in bad)}: expected numbers >= 0")
        return None
    who = {f: label_or_empty(r.get(f)) for f in JOB_LABELS}  # (absent from older state files)
    return JobEnergy(job_id=job_id, **{f: float(r[f]) for f in _NUMBERS}, resets=int(r["resets"]), gpus=int(r["gpus"]),
                     **who)


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False
