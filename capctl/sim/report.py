"""Tables, JSON and PNG plots of a ``capctl sim`` run (one scenario, several policies).

Throughput is GPU-weighted: the sum over running jobs of (GPUs x synchronous step rate), time
averaged, in GPU-steps per second where 1.0 is one GPU of speed 1 at its maximum clock. The mean
job rate weights every job equally (what the allocator's proportional-fair objective looks at).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

RATIO_BASES = ("oracle", "uniform", "balancer", "utilization")


def ratios(runs: dict) -> dict:
    """``capctl/<policy>`` throughput ratios for the policies present."""
    out = {}
    if "capctl" not in runs:
        return out
    c = runs["capctl"].throughput
    for b in RATIO_BASES:
        if b in runs and runs[b].throughput > 0:
            out[f"capctl/{b}"] = round(c / runs[b].throughput, 4)
    return out


BASELINES = ("uniform", "utilization", "balancer")
"""The policies that need no model of the GPUs: the "best baseline" of :func:`gain_capture`."""


def gain_capture(runs: dict) -> dict | None:
    """Share of the achievable gain capctl captures, on throughput (issue 12, item 8).

    ``(capctl - best) / (oracle - best)`` where ``best`` is the highest throughput among the
    :data:`BASELINES` present. Returns ``{"gain_capture", "best_baseline", "best_baseline_throughput"}``,
    or None without capctl, the oracle or a baseline, or when the oracle does not beat the best
    baseline (no gain to capture: the ratio is undefined).
    """
    base = [b for b in BASELINES if b in runs]
    if "capctl" not in runs or "oracle" not in runs or not base:
        return None
    best = max(base, key=lambda b: runs[b].throughput)
    room = runs["oracle"].throughput - runs[best].throughput
    if room <= 1e-12:
        return None
    return {"gain_capture": round((runs["capctl"].throughput - runs[best].throughput) / room, 4),
            "best_baseline": best, "best_baseline_throughput": round(runs[best].throughput, 4)}


def job_mean_ratios(runs: dict) -> dict:
    """``capctl/<policy>`` ratios of the mean job step rate (every job counts once)."""
    if "capctl" not in runs:
        return {}
    c = _job_mean(runs["capctl"])
    return {f"capctl/{b}": round(c / _job_mean(runs[b]), 4) for b in RATIO_BASES
            if b in runs and _job_mean(runs[b]) > 0}


def _job_mean(run) -> float:
    return float(np.mean(list(run.job_rate.values()))) if run.job_rate else 0.0


def to_json(scn, runs: dict, wall_s: float) -> dict:
    """The ``--json`` object (keys documented in docs/sim.md)."""
    pol = {}
    for name, r in runs.items():
        pol[name] = {
            "throughput": round(r.throughput, 4),
            "job_rate_mean": round(_job_mean(r), 5),
            "thermal_slowdown_fraction": round(r.thermal_slowdown_fraction, 6),
            "max_overshoot_w": round(r.max_overshoot_w, 3) if math.isfinite(r.max_overshoot_w) else None,
            "energy_per_step_j": None if math.isnan(r.energy_per_step_j) else round(r.energy_per_step_j, 2),
            "energy_j": round(r.energy_j, 1),
            "wall_s": round(r.wall_s, 3),
            "jobs": {k: {"gpus": r.job_gpus.get(k), "step_rate": round(v, 5)} for k, v in sorted(r.job_rate.items())},
            **({"extra": r.extra} if r.extra else {}),
        }
    spec = scn.spec
    return {
        "scenario": spec.name,
        "cluster_file": spec.source,
        "policy_file": scn.policy.source,
        "seed": spec.seed,
        "duration_s": spec.duration_s,
        "gpus": scn.topo.n_gpus,
        "jobs": len(scn.jobs),
        "budget_w": scn.policy.budget_w,
        "policies": pol,
        "ratios": ratios(runs),
        "ratios_job_mean": job_mean_ratios(runs),
        "gain_capture": gain_capture(runs),
        "wall_s": round(wall_s, 3),
    }


def _overshoot(value_w: float) -> str:
    """The overshoot column (11 characters): ``-`` when no domain was ever over its limit (the
    value is then <= 0: how far below, -0.0 or -999999300.0 with a huge budget, meant nothing)."""
    return f"{value_w:11.3f}" if value_w > 0 else f"{'-':>11}"


def table(scn, runs: dict, wall_s: float) -> str:
    """Human-readable comparison (one line per policy, then per-job rates and ratios)."""
    spec = scn.spec
    lines = [
        f"scenario {spec.name}: {scn.topo.n_gpus} GPUs ({len(scn.topo.node_names)} node"
        f"{'s' if len(scn.topo.node_names) != 1 else ''} x {spec.gpus_per_node}), "
        f"{len(scn.jobs)} job{'s' if len(scn.jobs) != 1 else ''}, {spec.duration_s:g} s simulated, budget {scn.policy.budget_w:,.0f} W, seed {spec.seed}",
        "",
        f"{'policy':<12} {'throughput':>10} {'capctl/x':>9} {'job mean':>9} {'thermal %':>9} {'overshoot W':>11} "
        f"{'J/step':>8} {'wall s':>7}",
    ]
    cap = runs.get("capctl")
    for name, r in runs.items():
        vs = f"{cap.throughput / r.throughput:9.3f}" if cap and r.throughput > 0 else f"{'-':>9}"
        lines.append(
            f"{name:<12} {r.throughput:10.2f} {vs} {_job_mean(r):9.4f} {100 * r.thermal_slowdown_fraction:9.3f} "
            f"{_overshoot(r.max_overshoot_w)} {r.energy_per_step_j:8.1f} {r.wall_s:7.2f}")
    lines.append("capctl/x: capctl's throughput over the row's; overshoot W: the most the enforced limits of a domain "
                 "(the budget, a rack, a PDU ...) went above its limit (- when never)")
    lost = [f"{n} {r.extra['gpus_lost']}" for n, r in runs.items() if r.extra.get("gpus_lost")]
    if lost:  # (found by a try-out: only --json told; the table said 0 % thermal slowdown)
        lines.append("GPUs lost to thermal shutdown (they stop and keep their last limit; their jobs' rate is 0): "
                     + ", ".join(lost))
    lines.append("")
    lines.append("per-job step rate (relative to uncapped at speed 1; GPUs):")
    names = list(runs)
    lines.append(f"{'job':<9} {'GPUs':>5} " + " ".join(f"{n:>11}" for n in names))
    jobs = sorted({k for r in runs.values() for k in r.job_rate})
    first = next(iter(runs.values()))
    for k in jobs:
        lines.append(f"{k:<9} {first.job_gpus.get(k, 0):5d} "
                     + " ".join(f"{runs[n].job_rate.get(k, float('nan')):11.4f}" for n in names))
    rt = ratios(runs)
    if rt:
        lines.append("")
        lines.append("ratios (throughput): " + ", ".join(f"{k} = {v:.3f}" for k, v in rt.items()))
        lines.append("ratios (mean job rate): " + ", ".join(f"{k} = {v:.3f}" for k, v in job_mean_ratios(runs).items()))
        gc = gain_capture(runs)
        if gc:
            lines.append(f"gain capture (capctl - {gc['best_baseline']}) / (oracle - {gc['best_baseline']}) = "
                         f"{100 * gc['gain_capture']:.1f} %")
    lines.append(f"wall time {wall_s:.2f} s")
    return "\n".join(lines)


def plot(scn, runs: dict, out_dir) -> list[str]:
    """Write the PNGs into ``out_dir`` (created); returns their paths.

    throughput.png (throughput over time per policy), heatmap_<policy>.png (enforced cap and
    temperature per GPU over time), throttling.png (fraction of busy GPUs in thermal slowdown over
    time per policy, plus which GPUs throttle under each policy).
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [_plot_throughput(plt, scn, runs, out)]
    for name, r in runs.items():
        if r.snap_cap_w.size == 0:
            continue
        files.append(_plot_heatmap(plt, scn, name, r, out))
    files.append(_plot_throttling(plt, scn, runs, out))
    return files


def _pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display). Raises UserInputError without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        from capctl.errors import UserInputError

        raise UserInputError("--plot needs matplotlib: pip install 'capctl[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_throughput(plt, scn, runs: dict, out: Path) -> str:
    """Write ``out``/throughput.png: each policy's throughput (GPU-steps/s) over time (min); its path."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, r in runs.items():
        ax.plot(r.series_t_s / 60.0, r.series_throughput, label=name, lw=1.2)
    ax.set_xlabel("time (min)")
    ax.set_ylabel("throughput (GPU-steps/s)")
    ax.set_title(f"{scn.spec.name}: synchronous step throughput per policy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return str(p)


def _plot_heatmap(plt, scn, name: str, r, out: Path) -> str:
    """Write ``out``/heatmap_<name>.png: policy ``name``'s enforced cap (W) and temperature (°C)
    per GPU over time (min), from the run ``r``'s snapshots (``[T, G]``); its path."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    ext = [0, r.snap_t_s[-1] / 60.0, scn.topo.n_gpus, 0]
    im0 = axes[0].imshow(r.snap_cap_w.T, aspect="auto", extent=ext, cmap="viridis",
                         vmin=float(scn.topo.min_cap_w[0]), vmax=float(scn.topo.max_cap_w[0]),
                         interpolation="nearest")
    axes[0].set_title(f"{name}: enforced cap (W)")
    axes[0].set_xlabel("time (min)")
    axes[0].set_ylabel("GPU (node-major)")
    fig.colorbar(im0, ax=axes[0])
    im1 = axes[1].imshow(r.snap_temp_c.T, aspect="auto", extent=ext, cmap="inferno", vmin=20, vmax=95,
                         interpolation="nearest")
    axes[1].set_title(f"{name}: temperature (°C)")
    axes[1].set_xlabel("time (min)")
    fig.colorbar(im1, ax=axes[1])
    fig.tight_layout()
    p = out / f"heatmap_{name}.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return str(p)


def _plot_throttling(plt, scn, runs: dict, out: Path) -> str:
    """Write ``out``/throttling.png: the fraction of busy GPUs in thermal slowdown (%) over time
    (min) per policy, and which GPUs were in it at each snapshot; its path."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 7))
    for name, r in runs.items():
        axes[0].plot(r.series_t_s / 60.0, 100 * r.series_throttled_fraction, label=name, lw=1.2)
    axes[0].set_ylabel("busy GPUs in thermal slowdown (%)")
    axes[0].set_xlabel("time (min)")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    for k, (name, r) in enumerate(runs.items()):
        if r.snap_throttled.size == 0:
            continue
        tt, gg = np.nonzero(r.snap_throttled)
        axes[1].scatter(r.snap_t_s[tt] / 60.0, gg, s=2, label=name, color=f"C{k}")
    axes[1].set_ylabel("GPU in thermal slowdown")
    axes[1].set_xlabel("time (min)")
    axes[1].set_ylim(0, scn.topo.n_gpus)
    axes[0].set_title(f"{scn.spec.name}: thermal slowdown timeline")
    fig.tight_layout()
    p = out / "throttling.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return str(p)
