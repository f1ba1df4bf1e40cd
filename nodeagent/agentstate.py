"""The agent's own state file, ``agent-state.json`` in the state directory (load and save).

It holds what the CapManager's ``caps-state.json`` does not: job metadata (user, partition, account,
qos, start time), the safe caps (W) the coordinator pushed (the boot failsafe needs them before any
coordinator is reachable), the last applied plan seq and the coordinator id. The CapManager's
bindings are authoritative; this file is the second copy that rebinds jobs when the CapManager's
file was corrupt. Nothing here raises: an unreadable file is logged and read as empty, a failed
write is logged and the agent keeps running.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path

from capctl.errors import CapctlError
from nodeagent.caps import CapManager
from nodeagent.lease import MAX_LEASE_S
from nodeagent.messages import finite
from nodeagent.savedstate import atomic_write

log = logging.getLogger("capctl.agent")

STATE_FILE = "agent-state.json"
"""Agent's own state file in the state directory (job metadata, safe caps, last plan seq)."""


def state_path(state_dir: Path) -> Path:
    """The agent state file of ``state_dir``."""
    return Path(state_dir) / STATE_FILE


def read(path: Path) -> dict:
    """The JSON object of ``path``; ``{}`` when it is missing, and (logged) when unreadable."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        log.error("state file %s unreadable (%s); starting from the CapManager's bindings", path, err)
        return {}
    return data


def job_meta(data: dict) -> dict:
    """``{job_id: metadata}`` of a state file's content (``{}`` when malformed)."""
    return data.get("jobs") if isinstance(data.get("jobs"), dict) else {}


MAX_SEQ = 2 ** 63 - 1
"""Largest plan seq and coordinator term taken from the file (the protocol's 64-bit fields)."""
DEFAULT_LEASE_S = 30.0
"""The lease an agent gives itself at start when its file names none (s): the policy's default
``failsafe.lease_s`` (capctl/policy/model.py)."""


def _bad(field: str, value, allowed: str, default) -> None:
    log.error("state file %s: %s %r is not allowed (allowed: %s); using %r", STATE_FILE, field, value, allowed,
              default)


def safe_caps_w(data: dict) -> dict[int, float]:
    """``{index: safe cap W}`` of a state file's content (``{}`` when malformed); a value that is
    no finite watts above 0, or an index outside 0..63, is left out (logged)."""
    safe = data.get("safe_caps_w") if isinstance(data.get("safe_caps_w"), dict) else {}
    out = {}
    for k, v in safe.items():
        try:
            index, watts = int(k), float(v)
        except (TypeError, ValueError, OverflowError):
            index, watts = -1, math.nan
        if 0 <= index < 64 and math.isfinite(watts) and watts > 0:
            out[index] = watts
        else:
            _bad(f"safe_caps_w[{str(k)[:20]!r}]", v, "GPU index 0-63 with finite watts > 0", "none")
    return out


def _count(data: dict, key: str) -> int:
    """An integer field 0..:data:`MAX_SEQ` of the file (0 when missing; logged when out of range:
    a -5 or 1e30 made every hello fail with a traceback, found by a review)."""
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        _bad(key, value, f"an integer 0 to {MAX_SEQ}", 0)
        return 0
    return value


def last_plan_seq(data: dict) -> int:
    """The last applied plan seq of a state file's content (0 when missing or malformed)."""
    return _count(data, "last_plan_seq")


def lease_s(data: dict) -> float:
    """The last lease a plan gave (s), the one the agent gives itself at start
    (:data:`DEFAULT_LEASE_S` when missing; logged when not in (0, :data:`MAX_LEASE_S`])."""
    value = data.get("lease_s", DEFAULT_LEASE_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_LEASE_S:
        _bad("lease_s", value, f"seconds in (0, {MAX_LEASE_S:g}]", DEFAULT_LEASE_S)
        return DEFAULT_LEASE_S
    return float(value)


def rebind(caps: CapManager, meta: dict, bindings: dict[str, list[int]], devices: Iterable[int],
           path: Path) -> None:
    """Bind through ``caps`` every job of ``meta`` that ``bindings`` lacks (the CapManager's file
    was corrupt: two copies, one lost), on those of its GPUs that are in ``devices``.

    A job that cannot be rebound is logged and skipped; nothing is raised.
    """
    known = set(devices)
    from capctl.security.limits import check_job_id

    for job_id, m in meta.items():
        if job_id in bindings or not isinstance(m, dict):
            continue
        if check_job_id(str(job_id)):
            log.error("state file %s: job %r is no Slurm job id: not rebound", path, str(job_id)[:40])
            continue
        try:
            indices = sorted({int(i) for i in m.get("gpu_indices", [])} & known)
        except (TypeError, ValueError):
            continue
        if indices:
            try:
                caps.bind(job_id, indices)
            except CapctlError as err:
                log.error("rebinding job %s from %s failed: %s", job_id, path, err)
                continue
            log.warning("job %s rebound to GPUs %s from %s (the cap state file was corrupt)",
                        job_id, indices, path)


def job_records(bindings: dict[str, list[int]], meta: dict) -> dict[str, dict]:
    """The agent's job records: one per binding, with its metadata from ``meta`` where present
    (``start_time_s``, Unix s, defaults to now)."""
    jobs = {}
    for job_id, indices in bindings.items():
        m = meta.get(job_id) if isinstance(meta.get(job_id), dict) else {}
        jobs[job_id] = {
            "gpu_indices": sorted(indices),
            "user": str(m.get("user", "")), "partition": str(m.get("partition", "")),
            "account": str(m.get("account", "")), "qos": str(m.get("qos", "")),
            "start_time_s": finite(m.get("start_time_s"), time.time()),
        }
    return jobs


def coordinator_term(data: dict) -> int:
    """The newest coordinator term seen (HA fencing, nodeagent/fencing.py); 0 when missing or malformed."""
    return _count(data, "coordinator_term")


def energy(data: dict):
    """The energy meter's snapshot of a state file's content (:meth:`nodeagent.energy.EnergyMeter.snapshot`), or None."""
    return data.get("energy")


def write(path: Path, *, node: str, jobs: dict[str, dict], safe_caps: dict[int, float], plan_seq: int,
          coordinator_id: str, coordinator_term: int = 0, energy: dict | None = None,
          lease_s: float | None = None) -> None:
    """Write the state file atomically (0600); an error is logged, not raised. ``energy``: the
    meter's snapshot (jobs' energy so far and the GPUs' last counter readings)."""
    data = {
        "energy": energy,
        "node": node,
        "jobs": jobs,
        "safe_caps_w": {str(k): v for k, v in safe_caps.items()},
        "last_plan_seq": plan_seq,
        "coordinator_id": coordinator_id,
        "coordinator_term": coordinator_term,
    }
    if lease_s is not None:
        data["lease_s"] = lease_s
    try:
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True).encode("utf-8"))
    except OSError as err:
        log.error("cannot write state file %s: %s", path, err)
