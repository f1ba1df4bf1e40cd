"""The coordinator's status as people and scripts see it: protobuf replies -> the stable JSON schema
of ``capctl status --json`` (docs/status-schema.json; fields are only ever added), and the tables
rendered from it. Shared by the CLI (:mod:`capctl.cli.status`) and the demo; pure functions, no I/O.
"""

from __future__ import annotations

import math
import time

from capctl import capstates, reasons

STATUS_SCHEMA_VERSION = 1
"""Version of the ``capctl status --json`` schema (docs/status-schema.json)."""

THROTTLE_THERMAL = reasons.THERMAL_SLOWDOWN  # capctl.reasons: the one definition
THROTTLE_POWER = reasons.POWER_CAPPED


# ----------------------------------------------------------------------------------------------
# protobuf -> plain dicts (the stable JSON schema)

def _num(v: float) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def gpu_dict(g) -> dict:
    """``GpuStatus`` -> dict (docs/status-schema.json ``#/$defs/gpu``). A GPU without a live
    reading (``no_live_reading``: LOST, STALLED, not read yet, ...) has null ``power_w``,
    ``temp_c`` and ``sm_clock_mhz`` and no clocks event reasons: unknown, not its last values."""
    live = not g.no_live_reading
    return {
        "index": int(g.index),
        "uuid": g.uuid,
        "cap_w": _num(g.cap_w),
        "enforced_w": _num(g.enforced_w),
        "power_w": _num(g.power_w) if live else None,
        "temp_c": _num(g.temp_c) if live else None,
        "slowdown_temp_c": _num(g.slowdown_temp_c),
        "sm_clock_mhz": int(g.sm_clock_mhz) if live else None,
        "max_sm_clock_mhz": int(g.max_sm_clock_mhz),
        "clocks_event_reasons": list(g.clocks_event_reasons) if live else [],
        "job_id": ",".join(g.job_ids) or g.job_id,
        "job_ids": list(g.job_ids) or ([g.job_id] if g.job_id else []),
        "min_cap_w": _num(g.min_cap_w),
        "max_cap_w": _num(g.max_cap_w),
        "thermal_ceiling_w": _num(g.thermal_ceiling_w),
        "cap_state": capstates.of(g),
        "node": g.node,
        "detail": g.detail,
        "curve": g.curve,
        "flags": list(g.flags),
        "memory_bound_fraction": (round(g.memory_bound_fraction, 4) if g.HasField("memory_bound_fraction")
                                  else None),
    }


def node_dict(n) -> dict:
    """``NodeStatus`` -> dict (``#/$defs/node``)."""
    return {
        "name": n.name,
        "stale": bool(n.stale),
        "last_report_age_s": _num(n.last_report_age_s),
        "simulated": bool(n.simulated),
        "never_reported": bool(n.never_reported),
        "held_w": _num(n.held_w) or 0.0,
        "gpus": [gpu_dict(g) for g in n.gpus],
    }


def job_dict(j) -> dict:
    """``JobStatus`` -> dict (``#/$defs/job``)."""
    return {
        "job_id": j.job_id,
        "nodes": list(j.nodes),
        "gpus": int(j.gpus),
        "weight": _num(j.weight),
        "predicted_step_rate": _num(j.predicted_step_rate),
        "measured_step_rate": _num(j.measured_step_rate),
        "binding": j.binding,
        "allocated_w": _num(j.allocated_w),
        "energy_j": _num(j.energy_j),
        "user": j.user,
        "partition": j.partition,
        "account": j.account,
    }


def domain_dict(d) -> dict:
    """``DomainStatus`` -> dict (``#/$defs/domain``)."""
    return {
        "name": d.name,
        "kind": d.kind,
        "limit_w": _num(d.limit_w) if d.limit_w > 0 else None,  # (no limit of its own: null, not 0 W)
        "allocated_w": _num(d.allocated_w),
        "enforced_w": _num(d.enforced_w),
        "draw_w": _num(d.draw_w),
        "price_rate_per_w": _num(d.price_rate_per_w),
        "deficit_w": _num(d.deficit_w),
    }


def status_dict(reply) -> dict:
    """``StatusReply`` -> the documented ``capctl status --json`` object (docs/status-schema.json)."""
    return {
        "schema_version": STATUS_SCHEMA_VERSION,
        "coordinator_id": reply.coordinator_id,
        "budget_w": _num(reply.budget_w),
        "allocated_w": _num(reply.allocated_w),
        "enforced_w": _num(reply.enforced_w),
        "draw_w": _num(reply.draw_w),
        "interval_s": _num(reply.interval_s),
        "last_solve_s": _num(reply.last_solve_s),
        "last_solve_time_s": _num(reply.last_solve_time_s),
        "dry_run": bool(reply.dry_run),
        "policy_path": reply.policy_path,
        "alerts": list(reply.alerts),
        "domains": [domain_dict(d) for d in reply.domains],
        "nodes": [node_dict(n) for n in reply.nodes],
        "jobs": [job_dict(j) for j in reply.jobs],
        **({"ha": {"role": reply.ha_role, "leader": reply.leader, "term": int(reply.term),
                   "standbys": list(reply.standbys)}} if reply.ha_role else {}),
    }


def explain_dict(reply) -> dict:
    """``ExplainReply`` -> dict (documented in docs/cli.md)."""
    return {
        "job": job_dict(reply.job),
        "binding": reply.binding,
        "slowest_node": reply.slowest_node,
        "slowest_gpu_index": int(reply.slowest_gpu_index),
        "prices": [{"domain": p.domain, "price_rate_per_w": _num(p.price_rate_per_w)} for p in reply.prices],
        "gpus": [gpu_dict(g) for g in reply.gpus],
        "text": reply.text,
        **({"finished": _finished(reply.finished)} if reply.HasField("finished") else {}),
    }


def _finished(job) -> dict:
    from capctl.finishedview import finished_dict

    return finished_dict(job)


# ----------------------------------------------------------------------------------------------
# tables

def _f(v, fmt: str = "{:.0f}", dash: str = "-") -> str:
    return dash if v is None else fmt.format(v)


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """Plain-text table: columns padded to their widest cell; ``right`` = right-aligned column indices."""
    right = right or set()
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells):
        return "  ".join(c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def _hostlist(names: list[str]) -> str:
    try:
        import hostlist

        return hostlist.collect_hostlist(list(names))
    except Exception:  # noqa: BLE001
        return ",".join(names)


def _short_reasons(reasons: list[str]) -> str:
    if not reasons:
        return "-"
    short = {"SW_POWER_CAP": "pwr", "HW_THERMAL_SLOWDOWN": "HW-THERM", "SW_THERMAL_SLOWDOWN": "SW-THERM",
             "HW_SLOWDOWN": "HW-SLOW", "GPU_IDLE": "idle", "HW_POWER_BRAKE_SLOWDOWN": "BRAKE"}
    return ",".join(short.get(r, r.lower()) for r in reasons)


def render_jobs(d: dict) -> str:
    rows = []
    for j in d["jobs"]:
        rows.append([j["job_id"], _hostlist(j["nodes"]), str(j["gpus"]), _f(j["weight"], "{:g}"),
                     _f(j["predicted_step_rate"], "{:.3f}"), _f(j.get("measured_step_rate") or None, "{:.3f}"),
                     j["binding"] or "-", _f(j["allocated_w"]),
                     _f(None if j["energy_j"] is None else j["energy_j"] / 3.6e6, "{:.3f}"), j["user"] or "-"])
    if not rows:
        return "no jobs"
    # (the predicted and the measured step rate side by side; "RATE" was the predicted one only)
    return table(["JOB", "NODES", "GPUS", "WEIGHT", "PRED RATE", "MEAS RATE", "BINDING", "ALLOC W", "ENERGY kWh",
                  "USER"], rows, right={2, 3, 4, 5, 7, 8})


def render_nodes_summary(d: dict) -> str:
    rows = []
    for n in d["nodes"]:
        gpus = n["gpus"]
        cap = sum(g["cap_w"] or 0 for g in gpus)
        enf = sum(g["enforced_w"] or 0 for g in gpus)
        live = [g["power_w"] for g in gpus if g["power_w"] is not None]
        pwr = sum(live) if live else None  # (a stale node's draw is unknown, not 0 W)
        temps = [g["temp_c"] for g in gpus if g["temp_c"] is not None]
        therm = sum(1 for g in gpus if any(r in THROTTLE_THERMAL for r in g["clocks_event_reasons"]))
        power = sum(1 for g in gpus if any(r in THROTTLE_POWER for r in g["clocks_event_reasons"]))
        jobs = sorted({j for g in gpus for j in g["job_id"].split(",") if j})
        if n.get("never_reported"):  # no agent has said hello: nothing of it is known
            held = n.get("held_w") or 0.0  # counted as its accounted watts (the most it may draw)
            rows.append([n["name"], "NO AGENT", "-", "-", "-", f"{held:.0f}" if held > 0 else "-", "-", "-", "-", "-",
                         "-"])
            continue
        rows.append([n["name"], "STALE" if n["stale"] else "ok", _f(n["last_report_age_s"], "{:.1f}"), str(len(gpus)),
                     f"{cap:.0f}", f"{enf:.0f}", _f(pwr), _f(max(temps) if temps else None, "{:.1f}"),
                     str(therm), str(power), ",".join(jobs) or "-"])
    if not rows:
        return "no nodes"
    return table(["NODE", "STATE", "AGE S", "GPUS", "CAP W", "ENFORCED W", "POWER W", "MAX TEMP C", "THERM GPUS",
                  "PWRCAP GPUS", "JOBS"], rows, right={2, 3, 4, 5, 6, 7, 8, 9})


def render_gpus(d: dict, limit: int | None = None, with_node: bool = True) -> str:
    """One row per GPU (``limit``: only the hottest, by margin to the slowdown temperature; a GPU
    without a temperature reading is not ranked). Unknown values show as "-"."""
    rows = []
    for n in d["nodes"]:
        for g in n["gpus"]:
            if limit is not None and g["temp_c"] is None:
                continue
            margin = (None if g["temp_c"] is None or g["slowdown_temp_c"] is None
                      else g["slowdown_temp_c"] - g["temp_c"])
            rows.append((margin if margin is not None else math.inf, [
                n["name"], str(g["index"]), g["job_id"] or "-", _f(g["cap_w"]), _f(g["enforced_w"]), _f(g["power_w"]),
                _f(g["temp_c"], "{:.1f}"), _f(margin, "{:+.1f}"), _f(g["sm_clock_mhz"], "{:d}"),
                _short_reasons(g["clocks_event_reasons"]), g.get("curve") or "-",
                "+".join([g["cap_state"] or "-"] + list(g.get("flags") or []) + (["NODE_STALE"] if n.get("stale") else []))]))
    if limit is not None:
        rows.sort(key=lambda r: r[0])
        rows = rows[:limit]
    if not rows:
        return "no GPUs"
    # CURVE: the rate curve in use (learned / prior / generic: GpuStatus.curve); it was in --json only (a try-out)
    headers = ["NODE", "GPU", "JOB", "CAP W", "ENF W", "POWER W", "TEMP C", "MARGIN C", "SM MHZ", "REASONS", "CURVE",
               "STATE"]
    if not with_node:
        return table(headers[1:], [r[1][1:] for r in rows], right={0, 2, 3, 4, 5, 6, 7})
    return table(headers, [r[1] for r in rows], right={1, 3, 4, 5, 6, 7, 8})


def render_status(d: dict, *, hottest: int = 5) -> str:
    """The people's view of ``capctl status`` from :func:`status_dict`'s output."""
    age = ""
    if d["last_solve_time_s"]:
        age = f", {max(0.0, time.time() - d['last_solve_time_s']):.0f} s ago"
    head = (f"capctl status — coordinator {d['coordinator_id'] or '?'}, interval {_f(d['interval_s'], '{:g}')} s, "
            f"last solve {_f(None if d['last_solve_s'] is None else d['last_solve_s'] * 1000, '{:.1f}')} ms{age}"
            + ("  [DRY RUN: nothing applied]" if d["dry_run"] else ""))
    budget = d["budget_w"] or 0.0
    pct = (lambda v: f" ({100 * v / budget:.0f}%)" if budget and v is not None else "")
    stale = sum(1 for n in d["nodes"] if n["stale"] and not n.get("never_reported"))
    absent = [n["name"] for n in d["nodes"] if n.get("never_reported")]
    watts = (f"budget {_f(d['budget_w'])} W   allocated {_f(d['allocated_w'])} W{pct(d['allocated_w'])}   "
             f"accounted {_f(d['enforced_w'])} W{pct(d['enforced_w'])}   draw {_f(d['draw_w'])} W{pct(d['draw_w'])}"
             + (f" (live readings only: {stale} stale node{'s' if stale > 1 else ''} not in it)" if stale else ""))
    parts = [head, watts]
    if absent:  # none of their GPUs is known: each counted at the most it may draw
        held_w = sum(n.get("held_w") or 0.0 for n in d["nodes"] if n.get("never_reported"))
        them = "them" if len(absent) > 1 else "it"
        how = (f"{held_w:.0f} W held for {them}, each counted at the most it may draw until it reports" if held_w > 0
               else f"nothing held for {them}: no node has reported its limits yet and the policy declares no "
                    "gpus_per_node")
        parts.append(f"no agent: {_hostlist(absent)} ({len(absent)} node{'s' if len(absent) > 1 else ''} of the "
                     f"policy never reported; {how})")
    if d.get("ha"):
        ha = d["ha"]
        parts.append(f"high availability: this coordinator is {ha['role']}; leader {ha['leader'] or '(none known)'}, "
                     f"term {ha['term']}; standbys {', '.join(ha['standbys']) or '(none)'}")
        if ha["role"] != "leader" and not d["nodes"]:
            to = f"capctl status --coordinator {ha['leader']}" if ha["leader"] else "the leader, once one is elected"
            parts.append(f"a standby holds no agents (they follow the leader): for the cluster's view ask {to}")
    if d["domains"]:
        rows = [[x["name"], x["kind"], _f(x["limit_w"] or None), _f(x["allocated_w"]), _f(x["enforced_w"]), _f(x["draw_w"]),
                 _f(x["price_rate_per_w"], "{:.4g}"), _f(x["deficit_w"]) if x["deficit_w"] else "-"]
                for x in d["domains"]]
        parts += ["", table(["DOMAIN", "KIND", "LIMIT W", "ALLOC W", "ACCT W", "DRAW W", "PRICE/W", "DEFICIT W"], rows,
                            right={2, 3, 4, 5, 6, 7})]
    parts += ["", render_jobs(d), "", render_nodes_summary(d)]
    if any(n["gpus"] for n in d["nodes"]) and hottest:
        parts += ["", "hottest GPUs (margin to slowdown temperature):", render_gpus(d, limit=hottest)]
    if d["alerts"]:
        parts += ["", "alerts:"] + [f"  ! {a}" for a in d["alerts"]]
    return "\n".join(parts)


def render_explain(d: dict) -> str:
    j = d["job"]
    if d.get("finished") and not d["gpus"] and not d["slowest_node"]:
        return d["text"] or f"job {j['job_id']}: finished"  # no live lines (weight 0, allocated 0 W: a try-out)
    lines = [f"job {j['job_id']}: {j['gpus']} GPU(s) on {_hostlist(j['nodes'])}, weight {_f(j['weight'], '{:g}')}, "
             f"allocated {_f(j['allocated_w'])} W, predicted step rate {_f(j['predicted_step_rate'], '{:.3f}')}",
             f"binding constraint: {d['binding'] or j['binding'] or '-'}",
             f"slowest GPU: {d['slowest_node'] or '-'} GPU {d['slowest_gpu_index']}"]
    if d["prices"]:
        lines.append("price of a watt: " + ", ".join(f"{p['domain']} {_f(p['price_rate_per_w'], '{:.4g}')}"
                                                      for p in d["prices"]))
    if d["text"]:
        lines += ["", d["text"]]
    if d["gpus"]:
        nodes = [{"name": g.get("node", ""), "gpus": [g]} for g in d["gpus"]]
        lines += ["", render_gpus({"nodes": nodes}, with_node=any(n["name"] for n in nodes))]
    return "\n".join(lines)
