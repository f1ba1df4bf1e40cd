"""Cluster files of the what-if simulator (``capctl sim --cluster FILE``): YAML in, :class:`ClusterSpec` out.

A cluster file describes the hardware and the workload of a scenario; the power budget and the
domain tree come from the policy file (the same file the coordinator runs). Every key, its unit
and its default is documented in docs/sim.md; examples/clusters/ holds the shared scenario.

Errors: :class:`ClusterError` (a :class:`capctl.errors.UserInputError`) whose message is
``file:line:col: <field>: <value> ... allowed: ...`` — never a traceback for a bad file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import hostlist

from capctl.errors import UserInputError
from capctl.policy.validate import unknown_key_message
from capctl.policy.yamlpos import Positions, YamlInputError, load_with_positions, read_regular_file

MAX_GPUS = 200_000
"""Largest cluster accepted (GPUs); bigger files are an error, never a hang."""
MAX_FILE_BYTES = 16 * 1024 * 1024
"""Largest cluster file read, bytes (bigger is an error, never a hang)."""


class ClusterError(UserInputError):
    """A bad cluster file; ``str(err)`` is one or more ``file:line:col: message`` lines."""


@dataclass(frozen=True)
class RackSpec:
    """One rack: its nodes (in order, bottom to top) and the inlet range across them (°C)."""

    name: str
    nodes: tuple[str, ...]
    inlet_bottom_c: float
    inlet_top_c: float


@dataclass(frozen=True)
class JobMix:
    """Synthetic workload: job sizes (GPUs, multiples of gpus_per_node), their weights, job
    durations (s, uniform in the range), and the occupancy target (fraction of GPUs in jobs)."""

    sizes_gpus: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    size_weights: tuple[float, ...] = (6.0, 5.0, 4.0, 3.0, 2.0, 1.0)
    duration_s: tuple[float, float] = (900.0, 5400.0)
    occupancy: float = 0.9


@dataclass(frozen=True)
class FixedJob:
    """A job on named nodes, running from t = 0 for ``duration_s`` (a hero run, a reservation);
    the synthetic mix fills the other nodes. Its workload is drawn like the mix's (seeded)."""

    nodes: tuple[str, ...]
    duration_s: float


@dataclass(frozen=True)
class ClusterSpec:
    """A scenario (see docs/sim.md for every field; units in the names).

    ``speed``: None = the simulated driver's own seeded per-GPU step-rate variation (``speed``,
    invisible to NVML), unless ``driver_speed`` is False (``speed: none``: every GPU at speed 1);
    else ``(mean_loss, max_loss)`` to draw it here.
    ``efficiency``: None, or ``(mean_loss, max_loss)``: per-GPU power-efficiency variation (Sinha
    et al. SC'22: same-SKU GPUs need different power for the same clock; 8 % average, up to 22 %
    performance variation). A GPU's clock loss L at a binding cap is drawn as for ``speed``
    (exponential, truncated) and becomes the driver's ``power_factor`` ((1 - L_median) /
    (1 - L))^3 (cube law, relative to the median part), visible to NVML as a lower SM clock.
    ``demand_w``: None, or ``(lo, hi)``: each job's uncapped demand on a median part (W), uniform
    in the range, replacing the demand fitted to its trace (the trace keeps the curve's shape, its
    memory-bound fraction).
    ``curves``: ``"zeus"`` = one workload per Zeus power-sensitive trace, read at run time from
    ``../shared/data/zeus-power-traces`` and scaled to the device's limit constraints;
    ``"default"`` = the allocator's shipped H100 default curve (derived from the same traces).
    """

    source: str
    name: str
    seed: int
    duration_s: float
    step_s: float
    gpu_model: str
    gpus_per_node: int
    racks: tuple[RackSpec, ...]
    swing_amplitude_c: float = 2.0
    swing_period_s: float = 86400.0
    swing_phase_s: float = 0.0
    inlet_update_s: float = 60.0
    speed: tuple[float, float] | None = None
    driver_speed: bool = True
    efficiency: tuple[float, float] | None = None
    hot_gpu_fraction: float = 0.0
    hot_resistance_c_per_w: tuple[float, float] = (0.09, 0.12)  # (parse_cluster: HOT_RESISTANCE_FACTORS x nominal)
    curves: str = "zeus"
    demand_w: tuple[float, float] | None = None
    jobs: JobMix = field(default_factory=JobMix)
    fixed_jobs: tuple[FixedJob, ...] = ()

    @property
    def node_names(self) -> tuple[str, ...]:
        """Every node, rack by rack (the GPU order of the simulation)."""
        return tuple(n for r in self.racks for n in r.nodes)

    @property
    def n_gpus(self) -> int:
        return len(self.node_names) * self.gpus_per_node


_TOP_KEYS = ["name", "seed", "duration_s", "step_s", "gpu_model", "gpus_per_node", "racks",
             "inlet_swing", "inlet_update_s", "gpus", "workload"]
_RACK_KEYS = ["name", "nodes", "inlet_c"]
_SWING_KEYS = ["amplitude_c", "period_s", "phase_s"]
_GPUS_KEYS = ["speed", "efficiency", "hot_fraction", "hot_resistance_c_per_w"]
_SPEED_KEYS = ["mean_loss", "max_loss"]
_WORK_KEYS = ["curves", "demand_w", "jobs", "fixed_jobs"]
_FIXED_KEYS = ["nodes", "duration_s"]
_JOBS_KEYS = ["sizes_gpus", "size_weights", "duration_s", "occupancy"]


class _Reader:
    """Collects ``file:line:col`` errors while reading the parsed YAML."""

    def __init__(self, source: str, pos: Positions) -> None:
        self.source = source
        self.pos = pos
        self.errors: list[str] = []

    def err(self, path: tuple, message: str, key: bool = False) -> None:
        line, col = self.pos.key(path) if key else self.pos.value(path)
        self.errors.append(f"{self.source}:{line}:{col}: {message}")

    def mapping(self, data, path: tuple, known: list[str], what: str) -> dict:
        if not isinstance(data, dict):
            self.err(path, f"{what}: {_show(data)} is invalid; allowed: a mapping with keys {', '.join(known)}")
            return {}
        for k, v in data.items():
            if k not in known:
                self.err(path + (k,), unknown_key_message(k, known, v, what), key=True)
        return data

    def number(self, data: dict, path: tuple, key: str, default, lo=None, hi=None, lo_open=False,
               integer=False, unit=""):
        if key not in data:
            return default
        v = data[key]
        name = _dotted(path + (key,))
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if integer:  # an int as written: 8.0 is refused, as in the policy (it was taken as 8: a review)
            ok = ok and isinstance(v, int)
        rng = []
        show = (lambda x: str(int(x))) if integer else (lambda x: f"{x:g}")  # (the seed's bound read 9.22337e+18)
        if lo is not None:
            rng.append(f"{'>' if lo_open else '>='} {show(lo)}")
        if hi is not None:
            rng.append(f"<= {show(hi)}")
        allowed = f"{'an integer' if integer else 'a number'}{(' ' + unit) if unit else ''}" + (
            f" {' and '.join(rng)}" if rng else "")
        if ok and lo is not None and (v < lo or (lo_open and v <= lo)):
            ok = False
        if ok and hi is not None and v > hi:
            ok = False
        if not ok:
            self.err(path + (key,), f"{name}: {_show(v)} is invalid; allowed: {allowed}{_whole_hint(v, integer)}")
            return default
        return int(v) if integer else float(v)

    def pair(self, data: dict, path: tuple, key: str, default, lo=None, hi=None, unit=""):
        if key not in data:
            return default
        v = data[key]
        name = _dotted(path + (key,))
        good = (isinstance(v, list) and len(v) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
                and v[0] <= v[1]
                and (lo is None or v[0] >= lo) and (hi is None or v[1] <= hi))
        if not good:
            rng = f" within [{lo:g}, {hi:g}]" if lo is not None and hi is not None else ""
            self.err(path + (key,), f"{name}: {_show(v)} is invalid; allowed: [low, high] {unit}{rng} with low <= high")
            return default
        return (float(v[0]), float(v[1]))


def _dotted(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _show(v) -> str:
    """``v`` as a message shows it: YAML's words for null and booleans (not Python's None, True)."""
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
        return "a list"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole_hint(v, integer: bool = True) -> str:
    """`` (write 8: ...)`` when ``v`` (or an item of the list ``v``) is a float with an integral
    value where a whole number belongs, else ``""``."""
    items = v if isinstance(v, list) else [v]
    wrong = next((x for x in items if isinstance(x, float) and math.isfinite(x) and x.is_integer()), None)
    if not integer or wrong is None:
        return ""
    got = f"{wrong!r} is " if isinstance(v, list) else ""
    return f" ({got}written with a decimal point or an exponent; write {int(wrong)})"


def _no_nodes(r, p: tuple, i: int, nodes_raw, nodes: list) -> None:
    """Report rack ``i`` (JSON path ``p``) whose ``nodes`` (``nodes_raw`` as written) name no node
    (``""``, ``[]``: it became an empty rack without a word, found by a review)."""
    if not nodes:
        r.err(p + ("nodes",), f"racks[{i}].nodes: {_show(nodes_raw)} names no node; allowed: a Slurm hostlist "
                              f"such as \"gpu[001-032]\" or a list of names")


def parse_cluster(text: str, source: str = "<string>") -> ClusterSpec:
    """Parse and validate a cluster file's text. Raises :class:`ClusterError` listing every error."""
    r, top = _read_top(text, source)
    head = _top_scalars(r, top, source)
    gpn = head["gpus_per_node"]
    racks, seen_nodes = _racks(r, top)
    n_gpus = len(seen_nodes) * (gpn or 1)
    if n_gpus > MAX_GPUS:
        r.err(("racks",), f"racks: {n_gpus} GPUs; allowed: at most {MAX_GPUS}")
    swing = _inlet_swing(r, top)
    gpus = _gpu_variation(r, top, head["gpu_model"])
    work = _workload(r, top, gpn, n_gpus, seen_nodes, head["gpu_model"])
    if r.errors:
        raise ClusterError("\n".join(r.errors))
    return ClusterSpec(source=source, racks=tuple(racks), **head, **swing, **gpus, **work)


def _read_top(text: str, source: str) -> tuple[_Reader, dict]:
    """The YAML of a cluster file as a :class:`_Reader` (holding the errors so far) and its top-level
    mapping (``{}`` when it is none). Raises :class:`ClusterError` at once for malformed YAML, an
    empty file or a top level that is not a mapping; a missing ``racks`` / ``gpu_model`` is an
    error of the reader."""
    try:
        data, pos = load_with_positions(text)
    except YamlInputError as exc:
        raise ClusterError(f"{source}:{exc.line}:{exc.col}: {exc.message}") from None
    r = _Reader(source, pos)
    if data is None:
        raise ClusterError(f"{source}:1:1: the cluster file is empty; see examples/clusters/shared-64x8.yaml")
    top = r.mapping(data, (), _TOP_KEYS, "the cluster file")
    if not top and r.errors:  # not a mapping (an empty one goes on: its missing keys are named)
        raise ClusterError("\n".join(r.errors))
    for req in ("racks", "gpu_model"):
        if req not in top:
            r.err((), f"missing key {req!r}")
    return r, top


def _top_scalars(r: _Reader, top: dict, source: str) -> dict:
    """The top-level scalars as :class:`ClusterSpec` fields: ``name`` (default: the file's stem),
    ``seed``, ``duration_s`` and ``step_s`` (s), ``gpus_per_node``, ``inlet_update_s`` (s) and
    ``gpu_model`` (the profile's own name). Errors go to ``r``; a bad value keeps its default."""
    name = top.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        r.err(("name",), f"name: {_show(name)} is invalid; allowed: a non-empty string")
        name = "cluster"
    seed = r.number(top, (), "seed", 0, lo=0, hi=2**63 - 1, integer=True)
    duration_s = r.number(top, (), "duration_s", 3600.0, lo=0, hi=30 * 86400.0, lo_open=True, unit="seconds")
    step_s = r.number(top, (), "step_s", 1.0, lo=0.01, hi=60.0, unit="seconds")
    gpn = r.number(top, (), "gpus_per_node", 8, lo=1, hi=64, integer=True)
    inlet_update_s = r.number(top, (), "inlet_update_s", 60.0, lo=0.01, unit="seconds")
    model = _gpu_model(r, top.get("gpu_model", "H100-SXM"))
    return dict(name=name, seed=int(seed), duration_s=duration_s, step_s=step_s, gpu_model=model,
                gpus_per_node=int(gpn), inlet_update_s=inlet_update_s)


def _gpu_model(r: _Reader, model) -> str:
    """The simulated driver's profile name of ``gpu_model`` (as written: ``model``), matched as the
    policy matches it (:func:`capctl.policy.devices.canonical_model`: case and punctuation aside, or
    the NVML name; ``h100_sxm`` was unknown here while the policy took it: a review). An unknown
    model is an error in ``r`` listing the allowed names (``model`` kept as written)."""
    from capctl.policy.devices import canonical_model, model_suggestion
    from capctl.simgpu.profiles import get as get_profile

    try:
        return get_profile(canonical_model(model) or str(model)).name
    except UserInputError as exc:
        guess = model_suggestion(str(model))
        r.err(("gpu_model",), f"gpu_model: {exc}" + (f" (did you mean {guess!r}?)" if guess else ""))
        return model if isinstance(model, str) else str(model)


def _racks(r: _Reader, top: dict) -> tuple[list[RackSpec], dict[str, str]]:
    """``racks``: the valid racks in file order, and the rack of every node (node name -> rack
    name, in file order). Errors go to ``r``; a bad rack is left out (or kept with defaults)."""
    racks: list[RackSpec] = []
    seen_nodes: dict[str, str] = {}
    rack_list = top.get("racks", [])
    if not isinstance(rack_list, list) or not rack_list:
        if "racks" in top:
            r.err(("racks",), f"racks: {_show(rack_list)} is invalid; allowed: a non-empty list of racks")
        rack_list = []
    for i, rd in enumerate(rack_list):
        rack = _rack(r, i, rd, racks, seen_nodes)
        if rack is not None:
            racks.append(rack)
    return racks, seen_nodes


def _rack(r: _Reader, i: int, rd, racks: list[RackSpec], seen_nodes: dict[str, str]) -> RackSpec | None:
    """``racks[i]`` (``rd`` as parsed): its :class:`RackSpec` (inlet range in °C), or None when it
    is no mapping or an empty one. Adds its nodes to ``seen_nodes`` (node -> rack name); ``racks``:
    the racks before it (their names must differ). Errors go to ``r``."""
    p = ("racks", i)
    if rd == {}:  # (it was skipped without a word: found by a review)
        r.err(p, f"racks[{i}]: an empty rack; allowed: a mapping with nodes (a Slurm hostlist or a list of names)")
        return None
    rd = r.mapping(rd, p, _RACK_KEYS, f"racks[{i}]")
    if not rd:
        return None
    rname = rd.get("name", f"rack{i + 1}")
    if not isinstance(rname, str) or not rname:
        r.err(p + ("name",), f"racks[{i}].name: {_show(rname)} is invalid; allowed: a non-empty string")
        rname = f"rack{i + 1}"
    elif any(x.name == rname for x in racks):
        r.err(p + ("name",), f"racks[{i}].name: {rname!r} is already the name of another rack; allowed: a name "
                             f"of its own (plots and tables name racks)")
    nodes = _rack_nodes(r, p, i, rd)
    for n in nodes:
        if n in seen_nodes:
            r.err(p + ("nodes",), f"racks[{i}].nodes: node {n!r} is already in rack {seen_nodes[n]!r}; a node belongs to one rack")
            break
        seen_nodes[n] = rname
    inlet = rd.get("inlet_c", [25.0, 25.0])
    if isinstance(inlet, (int, float)) and not isinstance(inlet, bool):
        inlet = [inlet, inlet]
    lo_hi = r.pair({"inlet_c": inlet}, p, "inlet_c", (25.0, 25.0), lo=-20.0, hi=80.0, unit="°C")  # (as capctl-simgpu init)
    return RackSpec(rname, tuple(nodes), lo_hi[0], lo_hi[1])


def _rack_nodes(r: _Reader, p: tuple, i: int, rd: dict) -> list[str]:
    """The node names of rack ``i`` (mapping ``rd`` at JSON path ``p``): its ``nodes``, a Slurm
    hostlist or a list of names, expanded in order; ``[]`` (with an error in ``r``) when invalid."""
    nodes_raw = rd.get("nodes")
    nodes: list[str] = []
    if isinstance(nodes_raw, str):
        try:
            nodes = list(hostlist.expand_hostlist(nodes_raw))
        except hostlist.BadHostlist as exc:
            r.err(p + ("nodes",), f"racks[{i}].nodes: {nodes_raw!r} is not a valid Slurm hostlist ({exc})")
        else:
            _no_nodes(r, p, i, nodes_raw, nodes)
    elif isinstance(nodes_raw, list) and all(isinstance(x, str) and x for x in nodes_raw):
        nodes = list(nodes_raw)
        _no_nodes(r, p, i, nodes_raw, nodes)
    else:
        r.err(p + ("nodes",) if "nodes" in rd else p,
              f"racks[{i}].nodes: {_show(nodes_raw)} is invalid; allowed: a Slurm hostlist such as \"gpu[001-032]\" or a list of names")
    return nodes


def _inlet_swing(r: _Reader, top: dict) -> dict:
    """``inlet_swing`` as :class:`ClusterSpec` fields: the daily swing's amplitude (°C), period and
    phase (s). Errors go to ``r``; a bad value keeps its default."""
    swing = r.mapping(top.get("inlet_swing", {}), ("inlet_swing",), _SWING_KEYS, "inlet_swing")
    amp = r.number(swing, ("inlet_swing",), "amplitude_c", 2.0, lo=0, hi=30, unit="°C")
    period = r.number(swing, ("inlet_swing",), "period_s", 86400.0, lo=1, lo_open=False, unit="seconds")
    phase = r.number(swing, ("inlet_swing",), "phase_s", 0.0, unit="seconds")
    return dict(swing_amplitude_c=amp, swing_period_s=period, swing_phase_s=phase)


HOT_RESISTANCE_FACTORS = (1.5, 2.0)
"""Default ``gpus.hot_resistance_c_per_w``: these multiples of the model's nominal thermal
resistance (H100 0.06 °C/W: 0.09-0.12, the default before; a fixed 0.09-0.12 made the "hot" GPUs
of an A100 (0.10), V100 (0.13) or A40 (0.15) cooler than the others: found by a try-out)."""


def _gpu_variation(r: _Reader, top: dict, gpu_model: str = "H100-SXM") -> dict:
    """``gpus`` as :class:`ClusterSpec` fields: ``speed`` / ``driver_speed``, ``efficiency``
    (``(mean_loss, max_loss)`` or None), ``hot_gpu_fraction`` and ``hot_resistance_c_per_w``
    (``(lo, hi)``, °C/W; default :data:`HOT_RESISTANCE_FACTORS` x the nominal resistance of
    ``gpu_model``). Errors go to ``r``."""
    gpus = r.mapping(top.get("gpus", {}), ("gpus",), _GPUS_KEYS, "gpus")
    speed = None
    driver_speed = True
    sp = gpus.get("speed", "physics")
    if sp == "none":
        driver_speed = False
    elif sp != "physics":
        speed = _losses(r, gpus, "speed", ("physics", "none"))
    efficiency = None
    if gpus.get("efficiency", "none") != "none":
        efficiency = _losses(r, gpus, "efficiency", ("none",))
    hot_fraction = r.number(gpus, ("gpus",), "hot_fraction", 0.0, lo=0, hi=1)
    hot_r = r.pair(gpus, ("gpus",), "hot_resistance_c_per_w", _default_hot_resistance(gpu_model), lo=0.001, hi=1.0,
                   unit="°C/W")
    return dict(speed=speed, driver_speed=driver_speed, efficiency=efficiency, hot_gpu_fraction=hot_fraction,
                hot_resistance_c_per_w=hot_r)


def _demand_above_idle(r: _Reader, demand: tuple[float, float] | None, gpu_model: str) -> None:
    """An error in ``r`` when ``demand`` (W) starts at or below ``gpu_model``'s idle power: such a
    job draws its idle power whatever its cap, so every policy scores the same (found by a try-out:
    ``demand_w: [20, 30]`` on an A100, 55 W idle, gave 1.000 for every policy without a word)."""
    from capctl.simgpu.profiles import get as get_profile

    if demand is None:
        return
    try:
        idle_w = get_profile(str(gpu_model)).idle_w
    except UserInputError:
        return  # (an unknown model is reported already)
    if demand[0] <= idle_w:
        r.err(("workload", "demand_w"), f"workload.demand_w: [{demand[0]:g}, {demand[1]:g}] W is invalid for "
                                        f"{gpu_model}; allowed: above its idle power, {idle_w:g} W (a job at or "
                                        "below it draws the same under any cap)")


def _default_hot_resistance(gpu_model: str) -> tuple[float, float]:
    """:data:`HOT_RESISTANCE_FACTORS` x the nominal thermal resistance of ``gpu_model`` (°C/W; an
    unknown model, reported elsewhere: the H100's)."""
    from capctl.simgpu.profiles import get as get_profile

    try:
        nominal = get_profile(str(gpu_model)).thermal_resistance_c_per_w
    except UserInputError:
        nominal = get_profile("H100-SXM").thermal_resistance_c_per_w
    return tuple(round(f * nominal, 6) for f in HOT_RESISTANCE_FACTORS)


def _losses(r: _Reader, gpus: dict, key: str, words: tuple[str, ...]) -> tuple[float, float] | None:
    """``gpus.<key>`` (``speed`` or ``efficiency``; ``words``: its other allowed values) as
    ``(mean_loss, max_loss)`` (fractions of the clock), or None when it is no mapping. Errors go
    to ``r`` (``max_loss`` below ``mean_loss``; an efficiency beyond the driver's range)."""
    raw = gpus[key]
    if not isinstance(raw, dict):  # (it named only the mapping: found by a try-out)
        r.err(("gpus", key), f"gpus.{key}: {_show(raw)} is invalid; allowed: {', '.join(words)} or a mapping with "
                             f"keys {', '.join(_SPEED_KEYS)}")
        return None
    spd = r.mapping(raw, ("gpus", key), _SPEED_KEYS, f"gpus.{key}")
    if not spd:
        return None
    before = len(r.errors)
    mean_loss = r.number(spd, ("gpus", key), "mean_loss", 0.08, lo=0, hi=0.5)
    max_loss = r.number(spd, ("gpus", key), "max_loss", 0.22, lo=0, hi=0.9)
    if len(r.errors) > before:  # a value refused above: its default is no value of the file to compare
        return (mean_loss, max_loss)
    if max_loss < mean_loss:
        r.err(("gpus", key, "max_loss"), f"gpus.{key}.max_loss: {max_loss:g} is invalid; allowed: >= mean_loss ({mean_loss:g})")
    elif key == "efficiency":
        _efficiency_in_driver_range(r, mean_loss, max_loss)
    return (mean_loss, max_loss)


def _workload(r: _Reader, top: dict, gpn: int, n_gpus: int, rack_of_node: dict[str, str],
              gpu_model: str = "H100-SXM") -> dict:
    """``workload`` as :class:`ClusterSpec` fields: ``curves``, ``demand_w`` (``(lo, hi)`` W or
    None; above ``gpu_model``'s idle power), ``jobs`` (a :class:`JobMix` for ``gpn`` GPUs per node,
    ``n_gpus`` in all) and ``fixed_jobs`` (on nodes of ``rack_of_node``). Errors go to ``r``."""
    work = r.mapping(top.get("workload", {}), ("workload",), _WORK_KEYS, "workload")
    curves = work.get("curves", "zeus")
    if curves not in ("zeus", "default"):
        r.err(("workload", "curves"), f"workload.curves: {_show(curves)} is invalid; allowed: zeus, default")
        curves = "zeus"
    demand = None
    if "demand_w" in work:
        demand = r.pair(work, ("workload",), "demand_w", (650.0, 700.0), lo=1.0, hi=5000.0, unit="W")
        _demand_above_idle(r, demand, gpu_model)
    jobs = _job_mix(r, work, gpn, n_gpus)
    fixed = _fixed_jobs(r, work.get("fixed_jobs", []), rack_of_node)
    return dict(curves=curves, demand_w=demand, jobs=jobs, fixed_jobs=fixed)


def _job_mix(r: _Reader, work: dict, gpn: int, n_gpus: int) -> JobMix:
    """``workload.jobs`` of ``work`` as a :class:`JobMix` (sizes in GPUs, multiples of ``gpn`` and
    at most ``n_gpus``; durations in s). Errors go to ``r``; a bad value keeps its default."""
    jp = ("workload", "jobs")
    jd = r.mapping(work.get("jobs", {}), jp, _JOBS_KEYS, "workload.jobs")
    mix = JobMix()
    default_sizes = [s for s in mix.sizes_gpus if s <= max(n_gpus, 1) and gpn and s % gpn == 0] or [gpn or 1]
    sizes = _job_sizes(r, jd, default_sizes, gpn, n_gpus)
    weights = jd.get("size_weights", [1.0] * len(sizes) if "sizes_gpus" in jd else
                     [w for s, w in zip(mix.sizes_gpus, mix.size_weights) if s in default_sizes] or [1.0])
    weights = _size_weights(r, weights, len(sizes) if sizes else None)
    dur = r.pair(jd, jp, "duration_s", mix.duration_s, lo=1.0, hi=365 * 86400.0, unit="seconds")
    occ = r.number(jd, jp, "occupancy", mix.occupancy, lo=0, hi=1, lo_open=True)
    return JobMix(tuple(int(s) for s in sizes), tuple(float(w) for w in weights[:len(sizes)]), dur, occ)


SIZE_WEIGHT_RANGE = (1e-6, 1e6)
"""Bounds of each ``workload.jobs.size_weights`` entry (relative frequencies): 1e308 summed to
infinity and the draw failed with a traceback ("Probabilities do not sum to 1": a review)."""


def _size_weights(r: _Reader, weights, count: int | None) -> list[float]:
    """``workload.jobs.size_weights`` (``weights`` as read): one number per size, each within
    :data:`SIZE_WEIGHT_RANGE`; ``count`` sizes (None when ``sizes_gpus`` was refused as empty: only
    the values are checked). When invalid (an error in ``r``), equal weights."""
    lo, hi = SIZE_WEIGHT_RANGE
    good = isinstance(weights, list) and (count is None or len(weights) == count) and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and lo <= w <= hi
        for w in weights)
    if not good:
        many = f"{count} numbers (one per size)" if count is not None else "one number per size"
        r.err(("workload", "jobs", "size_weights"), f"workload.jobs.size_weights: {_show(weights)} is invalid; "
              f"allowed: {many}, each from {lo:g} to {hi:g}")
    return [float(w) for w in weights] if good else [1.0] * (count or 1)


def _job_sizes(r: _Reader, jd: dict, default_sizes: list[int], gpn: int, n_gpus: int) -> list[int]:
    """``workload.jobs.sizes_gpus`` of ``jd`` (default ``default_sizes``): job sizes in GPUs,
    positive multiples of ``gpn``, at most ``n_gpus``. When invalid (an error in ``r``), as many
    sizes of one node as the file gave (so a matching ``size_weights`` draws no second error)."""
    mix = JobMix()
    sizes = jd.get("sizes_gpus", default_sizes)
    if sizes == []:  # (it said "invalid", and size_weights then wanted 6 numbers: a review)
        r.err(("workload", "jobs", "sizes_gpus"), f"workload.jobs.sizes_gpus: [] names no job size; allowed: a "
              f"non-empty list of positive multiples of gpus_per_node ({gpn}), e.g. [{gpn}]")
        return []
    if not (isinstance(sizes, list) and all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                                            and gpn and s % gpn == 0 for s in sizes)):
        r.err(("workload", "jobs", "sizes_gpus"), f"workload.jobs.sizes_gpus: {_show(sizes)} is invalid; allowed: "
              f"a list of positive multiples of gpus_per_node ({gpn}){_whole_hint(sizes)}")
        # keep the file's count for the weights' check (no knock-on error on a matching size_weights)
        sizes = [gpn or 1] * len(sizes) if isinstance(sizes, list) else list(mix.sizes_gpus)
    elif sizes and max(sizes) > n_gpus > 0:
        r.err(("workload", "jobs", "sizes_gpus"), f"workload.jobs.sizes_gpus: {max(sizes)} GPUs is invalid; "
              f"allowed: at most the cluster's {n_gpus} GPUs")
    return sizes


def _fixed_jobs(r: _Reader, raw, rack_of_node: dict[str, str]) -> tuple[FixedJob, ...]:
    """``workload.fixed_jobs``: a list of ``{nodes: HOSTLIST, duration_s: S}``; every node must be
    a node of the racks, in at most one fixed job."""
    p = ("workload", "fixed_jobs")
    if not isinstance(raw, list):
        r.err(p, f"workload.fixed_jobs: {_show(raw)} is invalid; allowed: a list of {{nodes: HOSTLIST, duration_s: S}}")
        return ()
    out = []
    taken: set[str] = set()
    for i, fd in enumerate(raw):
        what = f"workload.fixed_jobs[{i}]"
        fd = r.mapping(fd, p + (i,), _FIXED_KEYS, what)
        if not fd:
            continue
        nodes_raw = fd.get("nodes")
        nodes: list[str] = []
        try:
            nodes = list(hostlist.expand_hostlist(nodes_raw)) if isinstance(nodes_raw, str) and nodes_raw else []
        except hostlist.BadHostlist as exc:
            r.err(p + (i, "nodes"), f"{what}.nodes: {nodes_raw!r} is not a valid Slurm hostlist ({exc})")
            continue
        if not nodes:
            r.err(p + (i, "nodes") if "nodes" in fd else p + (i,),
                  f"{what}.nodes: {_show(nodes_raw)} is invalid; allowed: a Slurm hostlist of the racks' nodes")
            continue
        bad = [n for n in nodes if n not in rack_of_node or n in taken]
        if bad:
            why = "is in no rack" if bad[0] not in rack_of_node else "is already in another fixed job"
            r.err(p + (i, "nodes"), f"{what}.nodes: node {bad[0]!r} {why}; allowed: nodes of the racks, each in one fixed job")
        taken.update(n for n in nodes if n in rack_of_node)
        dur = r.number(fd, p + (i,), "duration_s", None, lo=1.0, hi=365 * 86400.0, unit="seconds")
        if dur is None and "duration_s" not in fd:  # (its own errors too, not only a node clash: a review)
            r.err(p + (i,), f"{what}: missing key 'duration_s'")
        if dur is not None and not bad:
            out.append(FixedJob(tuple(nodes), dur))
    return tuple(out)


POWER_FACTOR_MAX = 5.0
"""The simulated driver's largest ``power_factor`` (csrc/simnvml/state.c, ``RANGE(0.2, 5.0, ...)``)."""


def _efficiency_in_driver_range(r, mean_loss: float, max_loss: float) -> None:
    """``gpus.efficiency`` whose least efficient part would need a ``power_factor`` above the
    driver's :data:`POWER_FACTOR_MAX`: ``((1 - L_median) / (1 - max_loss))^3`` with the median of
    the exponential loss (``mean_loss x ln 2``, truncated at ``max_loss``), as
    :func:`capctl.sim.engine.efficiency_factors` draws them. An error at the field (found by a
    try-out: ``max_loss 0.9`` failed later with "gpu 0: power_factor 185.591 is out of range")."""
    median = min(mean_loss * math.log(2.0), max_loss)
    factor = ((1.0 - median) / (1.0 - max_loss)) ** 3
    if factor > POWER_FACTOR_MAX:
        top = 1.0 - (1.0 - median) / POWER_FACTOR_MAX ** (1.0 / 3.0)
        r.err(("gpus", "efficiency", "max_loss"),
              f"gpus.efficiency.max_loss: {max_loss:g} gives parts that need {factor:.3g} x the median part's "
              f"power for the same clock; allowed: at most {POWER_FACTOR_MAX:g} x, max_loss <= {top:.3f} "
              f"with mean_loss {mean_loss:g}")


def load_cluster(path) -> ClusterSpec:
    """Read and validate a cluster file. Raises :class:`ClusterError` (unreadable file, one that is
    not a regular file or is over :data:`MAX_FILE_BYTES` included)."""
    p = Path(path)
    expected = "expected a cluster YAML file (see examples/clusters/)"
    try:
        raw = read_regular_file(p, MAX_FILE_BYTES)  # a FIFO or device is refused, never waited on
    except FileNotFoundError:
        raise ClusterError(f"{p}: cluster file not found; {expected}") from None
    except IsADirectoryError:
        raise ClusterError(f"{p}: is a directory; {expected}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)  # "Permission denied" -> "permission denied"
        raise ClusterError(f"{p}: cannot read the cluster file: {reason[:1].lower() + reason[1:]}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ClusterError(f"{p}: cluster file larger than {MAX_FILE_BYTES:,} bytes; {expected}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:  # same wording as the policy validator
        line = raw[: err.start].count(b"\n") + 1
        col = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise ClusterError(f"{p}:{line}:{col}: not UTF-8 text (byte 0x{raw[err.start]:02x}); {expected}") from None
    return parse_cluster(text, str(p))
