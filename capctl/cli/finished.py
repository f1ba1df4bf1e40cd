"""``capctl jobs --finished [--since T] [--json]``: the finished jobs the coordinator keeps (energy,
GPU-seconds, mean and peak power, time capped, time in thermal slowdown; coordinator/finished.py).

``--since`` takes a Unix time in seconds, an ISO 8601 time (UTC when no offset is given, e.g.
``2026-12-01T14:00``), or an age: a number with ``s``, ``m``, ``h`` or ``d`` (``90m`` = 90 minutes ago).
JSON: ``{"schema_version": 1, "finished_jobs": [{...}, ...]}``, newest first, fields as in
``FinishedJob`` (protos/capctl/v1/capctl.proto; J, W, GPU-seconds, Unix s).
"""

from __future__ import annotations

import datetime
import math
import re
import time

from capctl.errors import UserInputError
from capctl.finishedview import finished_dict

SCHEMA_VERSION = 1
_AGE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([smhd])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now_s: float | None = None) -> float:
    """``--since`` as a Unix time (s, >= 0).

    Raises:
        UserInputError: not a Unix time, ISO 8601 time or age (naming the value and what is allowed),
            or a time before 1970-01-01 (an age older than the Unix epoch, an earlier ISO time).
    """
    since_s = _since_s(text, time.time() if now_s is None else now_s)
    if not since_s >= 0:
        raise UserInputError(f"--since {text.strip()} is before 1970-01-01; give a later time (Unix s >= 0, "
                             "an ISO 8601 time from 1970 on, or a shorter age)")
    return since_s


def _since_s(text: str, now_s: float) -> float:
    raw = (text or "").strip()
    m = _AGE.match(raw)
    if m:
        return now_s - float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    try:
        value = float(raw)
        if math.isfinite(value) and value >= 0:
            return value
    except ValueError:
        pass
    try:
        dt = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise UserInputError(f"--since {text!r}: give a Unix time (s), an ISO 8601 time such as 2026-12-01T14:00 "
                             "(UTC unless an offset is given) or an age such as 90m, 2h, 1d") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.timezone.utc)
    return dt.timestamp()


def render_finished(rows: list[dict]) -> str:
    """The finished-jobs table (newest first)."""
    from capctl.statusview import table

    if not rows:
        return "no finished jobs kept in that time"
    out = []
    for r in rows:
        end = datetime.datetime.fromtimestamp(r["end_time_s"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        wall = r["end_time_s"] - r["start_time_s"] if r["end_time_s"] > r["start_time_s"] > 0 else 0.0
        out.append([r["job_id"] + ("" if r["complete"] else "*"), r["user"] or "-", end, f"{wall:.1f}",
                    str(r["gpus"]), f"{r['energy_j'] / 3.6e6:.3f}", f"{r['gpu_s']:.1f}", f"{r['mean_power_w']:.0f}",
                    f"{r['peak_power_w']:.0f}", f"{r['capped_s']:.1f}", f"{r['thermal_s']:.1f}"])
    # units as `capctl jobs` writes them (energy in kWh; the JSON keeps J); the job's power summed
    # over its GPUs; capped and thermal time in GPU-seconds (CAPPED_S read as the job's wall time,
    # four times longer than it ran on 4 GPUs: found by a review)
    text = table(["JOB", "USER", "ENDED (UTC)", "WALL S", "GPUS", "ENERGY kWh", "GPU S", "JOB MEAN W", "JOB PEAK W",
                  "CAPPED GPU S", "THERMAL GPU S"], out, right={3, 4, 5, 6, 7, 8, 9, 10})
    if any(not r["complete"] for r in rows):
        text += "\n* incomplete: a node did not send its final energy"
    return text


def cmd_jobs_finished(args) -> int:
    """``capctl jobs --finished``: print the kept finished jobs (table or ``--json``)."""
    import json
    import sys

    from capctl.cli.rpc import admin_client

    since_s = parse_since(args.since) if args.since is not None else 0.0
    with admin_client(args.coordinator) as client:
        rows = [finished_dict(j) for j in client.finished_jobs(since_s=since_s)]
    if args.json:
        json.dump({"schema_version": SCHEMA_VERSION, "finished_jobs": rows}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(render_finished(rows))
    return 0
