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
import time
from collections.abc import Iterable
from pathlib import Path

from capctl.errors import CapctlError
from nodeagent.caps import CapManager
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


def safe_caps_w(data: dict) -> dict[int, float]:
    """``{index: safe cap W}`` of a state file's content (``{}`` when malformed)."""
    safe = data.get("safe_caps_w") if isinstance(data.get("safe_caps_w"), dict) else {}
    try:
        return {int(k): float(v) for k, v in safe.items()}
    except (TypeError, ValueError):
        return {}


def last_plan_seq(data: dict) -> int:
    """The last applied plan seq of a state file's content (0 when missing or malformed)."""
    try:
        return int(data.get("last_plan_seq", 0))
    except (TypeError, ValueError):
        return 0


def rebind(caps: CapManager, meta: dict, bindings: dict[str, list[int]], devices: Iterable[int],
           path: Path) -> None:
    """Bind through ``caps`` every job of ``meta`` that ``bindings`` lacks (the CapManager's file
    was corrupt: two copies, one lost), on those of its GPUs that are in ``devices``.

    A job that cannot be rebound is logged and skipped; nothing is raised.
    """
    known = set(devices)
    for job_id, m in meta.items():
        if job_id in bindings or not isinstance(m, dict):
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
    try:
        return max(0, int(data.get("coordinator_term", 0)))
    except (TypeError, ValueError):
        return 0


def energy(data: dict):
    """The energy meter's snapshot of a state file's content (:meth:`nodeagent.energy.EnergyMeter.snapshot`), or None."""
    return data.get("energy")


def write(path: Path, *, node: str, jobs: dict[str, dict], safe_caps: dict[int, float], plan_seq: int,
          coordinator_id: str, coordinator_term: int = 0, energy: dict | None = None) -> None:
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
    try:
        atomic_write(path, json.dumps(data, indent=1, sort_keys=True).encode("utf-8"))
    except OSError as err:
        log.error("cannot write state file %s: %s", path, err)
