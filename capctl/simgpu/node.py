"""Control API of a simulated GPU node (the state behind the simulated ``libnvidia-ml.so.1``).

A node is one memory-mapped state file (``$CAPCTL_SIMGPU_NODE``) shared by every process that
opens it: the NVML client (pynvml through our library), tests, the workload driver, the CLI.
``SimNode.create(None, ...)`` makes an anonymous in-memory node for the cluster simulator.
All physics lives in C (csrc/simnvml/physics.c); this module only calls it through ctypes.

Units: watts, degrees C, MHz, seconds, joules.  Sources of every model and constant are in
physics.c and docs/simulated-gpus.md (DVFS cube law, step-time model, Sinha et al. SC'22 GPU
variation, first-order thermal RC model, NVML reference for units, reasons and the 1 s power
average).

Example::

    node = SimNode.create("/tmp/n1/node.state", gpus=8, model="H100-SXM", manual_clock=True)
    node.set_load(0, demand_w=650)
    node.advance(30)
    node.read(0)["temp_c"]
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from capctl.simgpu import _lib
from capctl.simgpu._lib import FAULT_CODES, SimDeviceError, SimInputError
from capctl.simgpu.build import LIBRARY_ENV, library_path

NODE_ENV = "CAPCTL_SIMGPU_NODE"
"""Environment variable naming the state file the simulated driver opens on nvmlInit."""

REASON_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""NVML clocks event reason bits (nvml.h ``nvmlClocksEventReason*``) and their names."""

FLAG_LOST = 0x1
FLAG_SET_NO_PERMISSION = 0x2
FLAG_SET_NOT_SUPPORTED = 0x4
FLAG_THROTTLED = 0x8
FLAG_FOREIGN = 0x10
FLAG_BAD_CONSTRAINTS = 0x40  # CAPSIM_F_BAD_CONSTRAINTS
FLAG_CONTINUOUS_CLOCK = 0x80  # CAPSIM_F_CONTINUOUS_CLOCK
FLAG_THERMAL_SHUTDOWN = 0x20

_ORDERED_OVERRIDES = (
    "min_limit_w",
    "max_limit_w",
    "default_limit_w",
    "limit_w",
    "shutdown_temp_c",
    "slowdown_temp_c",
    "max_operating_temp_c",
    "thermal_resistance_c_per_w",
    "tau_s",
    "speed",
    "power_factor",
    "memory_bound_fraction",
    "temp_c",
)
_ALIASES = {"pre_job_limit_w": "limit_w", "site_limit_w": "limit_w"}


def reason_names(bits: int) -> list[str]:
    """Names of the NVML clocks event reason bits set in ``bits`` (unknown bits as hex)."""
    out = [name for bit, name in REASON_BITS.items() if bits & bit]
    rest = bits & ~sum(REASON_BITS)
    if rest:
        out.append(hex(rest))
    return out


def preload_for_pynvml(path: str | os.PathLike | None = None) -> str:
    """Load the simulated library globally so that pynvml's ``CDLL("libnvidia-ml.so.1")`` finds it.

    Must run before pynvml's first ``nvmlInit`` in this process.  Returns the absolute path loaded.
    Raises :class:`capctl.simgpu._lib.LibraryMissingError` when the library is not built.
    """
    p = Path(path) if path else library_path()
    if not p.is_file():
        raise _lib.LibraryMissingError(f"simulated NVML library not found at {p}; run 'make build'")
    resolved = str(p.resolve())
    ctypes.CDLL(resolved, mode=ctypes.RTLD_GLOBAL)
    return resolved


def _per_gpu(name: str, value: Any, n: int) -> list[float]:
    if isinstance(value, (str, bytes)):
        raise SimInputError(f"{name} {value!r} is invalid; allowed: a number or a sequence of {n}")
    if isinstance(value, Sequence) or isinstance(value, np.ndarray):
        vals = list(value)
        if len(vals) != n:
            raise SimInputError(f"{name} has {len(vals)} values; allowed: one value or exactly {n}")
    else:
        vals = [value] * n
    out = []
    for v in vals:
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise SimInputError(f"{name} {v!r} is not a number") from None
        if not math.isfinite(f):
            raise SimInputError(f"{name} {v!r} is invalid; allowed: a finite number")
        out.append(f)
    return out


def _node_profile(lib: ctypes.CDLL, handle: int):
    """The device profile stored in the header of the node ``handle`` (a DeviceProfile)."""
    from capctl.simgpu import profiles

    dt = _lib.dtype(lib, 1)
    raw = bytes((ctypes.c_char * dt.itemsize).from_address(lib.capsim_node_profile(handle)))
    prof = profiles.from_record(np.frombuffer(raw, dtype=dt)[0], -1)
    return dataclasses.replace(prof, index=profiles.builtin_index(prof))


def _create_args(gpus: Any, seed: Any, model: str, profile) -> tuple[int, Any]:
    """The GPU count and device profile of :meth:`SimNode.create` from its ``gpus``, ``seed``,
    ``model`` and ``profile`` arguments (``profile`` None: the built-in ``model``).

    Raises:
        SimInputError: ``gpus`` not an integer >= 1, ``seed`` not an integer >= 0, or ``profile``
            not a DeviceProfile; UserInputError: an unknown ``model``.
    """
    if isinstance(gpus, bool):  # (True made one GPU: found by a review)
        raise SimInputError(f"gpus {gpus!r} is not an integer")
    try:
        n = int(gpus)
    except (TypeError, ValueError):
        raise SimInputError(f"gpus {gpus!r} is not an integer") from None
    if n < 1 or n != gpus:
        raise SimInputError(f"gpus {gpus!r} is invalid; allowed: an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise SimInputError(f"seed {seed!r} is invalid; allowed: an integer >= 0 and < 2**64 (seeds above wrapped)")
    from capctl.simgpu.profiles import DeviceProfile
    from capctl.simgpu.profiles import get as get_profile

    if profile is None:
        profile = get_profile(model)  # clear error with the allowed names
    elif not isinstance(profile, DeviceProfile):
        raise SimInputError(f"profile {profile!r} is invalid; allowed: a capctl.simgpu.profiles.DeviceProfile")
    return n, profile


def _overrides_per_gpu(overrides: dict, n: int) -> dict[str, list[float]]:
    """:meth:`SimNode.create`'s ``overrides`` by canonical name (aliases resolved), one value per GPU
    for ``n`` GPUs. Raises SimInputError: an unknown name, or a value that is not one number or ``n``."""
    unknown = set(overrides) - set(_ORDERED_OVERRIDES) - set(_ALIASES)
    if unknown:
        allowed = ", ".join(sorted(set(_ORDERED_OVERRIDES) | set(_ALIASES)))
        raise SimInputError(
            f"override {sorted(unknown)[0]!r} is unknown; allowed: {allowed}"
        )
    norm: dict[str, list[float]] = {}
    for key, val in overrides.items():
        norm[_ALIASES.get(key, key)] = _per_gpu(key, val, n)
    return norm


def _new_node_path(path: str | os.PathLike | None) -> Path | None:
    """The absolute path of a node state file to create (None: in memory). Raises SimInputError
    when its directory does not exist."""
    p = Path(path).absolute() if path is not None else None
    if p is not None and not p.parent.is_dir():
        raise SimInputError(f"path {str(p)!r} is invalid: directory {str(p.parent)!r} does not exist")
    return p


class SimNode:
    """One simulated node: ``gpu_count`` GPUs in a shared state file (or anonymous memory).

    Thread- and process-safe: every call takes the node's robust process-shared mutex, brings the
    GPUs' physics up to "now" (real monotonic clock, or the node's manual clock) and then acts.
    Errors: :class:`SimInputError` (a ``UserInputError``) for bad arguments, naming the argument,
    the value and what is allowed; :class:`SimDeviceError` (a ``HardwareError``) when an injected
    fault makes the device refuse (``nvml_code`` holds the NVML return code).
    """

    def __init__(self, handle: int, path: Path | None, lib: ctypes.CDLL):
        self._h = handle
        self._lib = lib
        self.path: Path | None = path
        self.gpu_count: int = int(lib.capsim_gpu_count(handle))
        self._dtype = _lib.dtype(lib, 0)
        self.profile = _node_profile(lib, handle)
        """The node's device profile (:class:`capctl.simgpu.profiles.DeviceProfile`; built-in or custom)."""
        self.model: str = self.profile.name
        # a custom profile may carry a built-in name (--profile name=H200 on an H100 base): custom
        # all the same, since it equals no built-in profile in every field (profiles.builtin_index)
        self.custom: bool = self.profile.index < 0

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike | None,
        gpus: int,
        model: str = "H100-SXM",
        inlet_c: float | Sequence[float] = 25.0,
        seed: int = 0,
        manual_clock: bool = False,
        profile=None,
        **overrides: float | Sequence[float],
    ) -> SimNode:
        """Create a node (replacing any file at ``path`` atomically); ``path=None``: in memory.

        Args:
            gpus: number of GPUs (>= 1).
            model: a profile name (:func:`capctl.simgpu.profiles.names`).
            profile: a :class:`capctl.simgpu.profiles.DeviceProfile` (built-in or from
                :func:`capctl.simgpu.profiles.custom` / ``parse_option`` / ``load_file``); replaces
                ``model``. The node stores it in its state file, every process sees that device.
            inlet_c: inlet air temperature, one value or one per GPU (degrees C).
            seed: seeds the per-GPU variation (speed, thermal resistance, time constant).
            manual_clock: True = time moves only through :meth:`advance` (deterministic tests).
            overrides: per-GPU values (scalar or one per GPU): ``thermal_resistance_c_per_w``,
                ``tau_s``, ``speed``, ``power_factor`` (dynamic power at a given clock relative to
                a nominal part, 0.2-5: Sinha et al. SC'22 power-efficiency variation, physics.c),
                ``memory_bound_fraction``, ``min_limit_w``, ``max_limit_w``,
                ``default_limit_w``, ``pre_job_limit_w`` (alias ``site_limit_w``, ``limit_w``: the
                limit in force before any job), ``slowdown_temp_c``, ``shutdown_temp_c``,
                ``max_operating_temp_c``, ``temp_c``.
        Raises:
            SimInputError: unknown model/override, or a value out of range.
        """
        lib = _lib.load()
        n, profile = _create_args(gpus, seed, model, profile)
        inlets = _per_gpu("inlet_c", inlet_c, n)
        norm = _overrides_per_gpu(overrides, n)
        p = _new_node_path(path)
        prec = profile.to_record()
        handle = lib.capsim_create_profile(
            str(p).encode() if p else None, n, prec.ctypes.data, int(bool(manual_clock)),
            seed & 0xFFFFFFFFFFFFFFFF, inlets[0],
        )
        if not handle:
            raise SimInputError(f"cannot create node: {_lib.last_error(lib)}")
        node = cls(handle, p, lib)
        try:
            node._set_start_values(inlets, norm)
        except Exception:
            node.close()
            raise
        return node

    def _set_start_values(self, inlets: list[float], norm: dict[str, list[float]]) -> None:
        """Set a new node's per-GPU inlets (degrees C, ``inlets[0]`` is already set) and overrides
        (``norm``: canonical name -> one value per GPU, set in :data:`_ORDERED_OVERRIDES` order); a
        GPU with no ``temp_c`` override starts at its idle steady state when its thermal resistance
        or inlet differs from the defaults. Raises SimInputError for a value out of range."""
        n = len(inlets)
        for i in range(n):
            if inlets[i] != inlets[0]:
                self._set_param(i, "inlet_c", inlets[i])
        for key in _ORDERED_OVERRIDES:
            if key in norm:
                for i, v in enumerate(norm[key]):
                    self._set_param(i, key, v)
        if "temp_c" not in norm and (
            "thermal_resistance_c_per_w" in norm or any(x != inlets[0] for x in inlets)
        ):
            # start each GPU at its own idle steady state: T = inlet + R * P_idle
            idle_w = self.profile.idle_w
            for i in range(n):
                rec = self._read_record(i)
                self._set_param(
                    i, "temp_c",
                    float(rec["inlet_c"] + rec["thermal_resistance_c_per_w"] * idle_w),
                )

    @classmethod
    def open(cls, path: str | os.PathLike) -> SimNode:
        """Open an existing node state file.

        Raises:
            SimInputError: missing file, not a node file, or a different layout version.
        """
        lib = _lib.load()
        p = Path(path).absolute()
        handle = lib.capsim_open(str(p).encode())
        if not handle:
            raise SimInputError(f"cannot open simulated node: {_lib.last_error(lib)}")
        return cls(handle, p, lib)

    def close(self) -> None:
        """Unmap the node (views from :meth:`state` must not be used afterwards)."""
        if self._h:
            self._lib.capsim_close(self._h)
            self._h = None

    def __enter__(self) -> SimNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def _handle(self) -> int:
        if not self._h:
            raise SimInputError("node is closed")
        return self._h

    def _check(self, rc: int, what: str) -> None:
        _lib.check(self._lib, rc, what)

    def _index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise SimInputError(f"gpu index {index!r} is not an integer")
        if not 0 <= int(index) < self.gpu_count:
            raise SimInputError(
                f"gpu index {index} is out of range; allowed: 0..{self.gpu_count - 1}"
            )
        return int(index)

    def _set_param(self, index: int, name: str, value: float) -> None:
        self._check(
            self._lib.capsim_set_param(self._handle(), self._index(index), name.encode(), float(value)),
            f"gpu {index}",
        )

    def _read_record(self, index: int) -> np.void:
        rec = np.zeros(1, dtype=self._dtype)
        self._check(self._lib.capsim_read(self._handle(), index, rec.ctypes.data), f"gpu {index}")
        return rec[0]

    # --- info --------------------------------------------------------------------------------

    @property
    def manual_clock(self) -> bool:
        """True when time moves only through :meth:`advance`."""
        return bool(self._lib.capsim_manual_clock(self._handle()))

    @property
    def driver_generation(self) -> int:
        """Number of simulated driver reloads since the node was created."""
        return int(self._lib.capsim_driver_generation(self._handle()))

    @property
    def journal_errors(self) -> int:
        """Enforced-limit changes the driver could not append to the journal (0 = complete)."""
        return int(self._lib.capsim_journal_errors(self._handle()))

    @property
    def journal_path(self) -> Path:
        """The node's enforced-limit journal (:mod:`capctl.simgpu.journal`).

        Raises:
            SimInputError: for an anonymous node (it keeps no journal).
        """
        if self.path is None:
            raise SimInputError("an in-memory node (path None) keeps no journal")
        return self.path.with_name(self.path.name + ".journal")

    def env(self) -> dict[str, str]:
        """Environment variables pointing an NVML client (pynvml) at this node.

        Raises:
            SimInputError: for an anonymous node (it has no file another process could open).
        """
        if self.path is None:
            raise SimInputError("an in-memory node (path None) cannot be shared with other processes")
        return {NODE_ENV: str(self.path), LIBRARY_ENV: str(library_path().resolve())}

    def now_s(self) -> float:
        """The node's current time in seconds (manual clock, or CLOCK_MONOTONIC)."""
        out = ctypes.c_double()
        self._check(self._lib.capsim_now(self._handle(), ctypes.byref(out)), "now")
        return out.value

    # --- workload and environment ------------------------------------------------------------

    def set_load(
        self,
        index: int,
        demand_w: float,
        utilization_pct: float = 100.0,
        memory_bound_fraction: float | None = None,
    ) -> None:
        """Set GPU ``index``'s workload: uncapped demand at max SM clock (W; 0 = idle).

        ``memory_bound_fraction`` m (0 <= m < 1) is the share of a step's time (at max clock) that
        does not scale with the SM clock; None keeps the current value.
        """
        m = float("nan") if memory_bound_fraction is None else float(memory_bound_fraction)
        self._check(
            self._lib.capsim_set_load(
                self._handle(), self._index(index), float(demand_w), float(utilization_pct), m
            ),
            f"gpu {index}",
        )

    def set_loads(
        self,
        demand_w: Any,
        utilization_pct: Any = 100.0,
        memory_bound_fraction: Any = None,
        indices: Any = None,
    ) -> None:
        """Vectorized :meth:`set_load` (cluster simulator): arrays (or scalars broadcast) per GPU.

        ``indices`` None means GPUs 0..len(demand_w)-1 (a scalar ``demand_w`` means every GPU).  Everything is validated before anything
        changes; raises :class:`SimInputError` naming the first bad value.
        """
        d = np.asarray(demand_w, dtype=np.float64)
        if d.ndim == 0:  # a scalar applies to every selected GPU (all of them without indices)
            n = self.gpu_count if indices is None else np.atleast_1d(np.asarray(indices)).size
            d = np.full(n, float(d))
        d = np.ascontiguousarray(np.atleast_1d(d))
        u = np.ascontiguousarray(np.broadcast_to(np.asarray(utilization_pct, dtype=np.float64), d.shape))
        m = None
        if memory_bound_fraction is not None:
            m = np.ascontiguousarray(
                np.broadcast_to(np.asarray(memory_bound_fraction, dtype=np.float64), d.shape)
            )
        idx = None
        if indices is not None:
            idx = np.ascontiguousarray(np.atleast_1d(np.asarray(indices, dtype=np.int64)))
            if idx.shape != d.shape:
                raise SimInputError(
                    f"indices has {idx.size} entries but demand_w has {d.size}; they must match"
                )
        elif d.size > self.gpu_count:
            raise SimInputError(f"demand_w has {d.size} entries; allowed: at most {self.gpu_count}")
        self._check(
            self._lib.capsim_set_loads(
                self._handle(), d.ctypes.data, u.ctypes.data,
                None if m is None else m.ctypes.data, None if idx is None else idx.ctypes.data,
                d.size,
            ),
            "set_loads",
        )

    def set_inlet(self, index: int, inlet_c: float) -> None:
        """Set GPU ``index``'s inlet air temperature (degrees C, -20..80)."""
        self._set_param(index, "inlet_c", inlet_c)

    def set_param(self, index: int, name: str, value: float) -> None:
        """Set one per-GPU parameter (see :meth:`create` overrides; ``pre_job_limit_w`` allowed)."""
        self._set_param(index, _ALIASES.get(name, name), value)

    def advance(self, dt_s: float) -> None:
        """Move the manual clock forward by ``dt_s`` seconds and integrate every GPU.

        Raises:
            SimDeviceError: the node follows the real clock (NOT_SUPPORTED).
            SimInputError: ``dt_s`` negative or not finite.
        """
        self._check(self._lib.capsim_advance(self._handle(), float(dt_s)), "advance")

    # --- faults ------------------------------------------------------------------------------

    def _fault(self, fault: str) -> int:
        if fault not in FAULT_CODES:
            raise SimInputError(
                f"fault {fault!r} is unknown; allowed: {', '.join(FAULT_CODES)}"
            )
        return FAULT_CODES[fault]

    def inject(
        self, index: int, fault: str, value: float | None = None, period_s: float = 10.0,
        max_w: float | None = None,
    ) -> None:
        """Inject a fault on GPU ``index``.

        Faults: ``set_no_permission`` / ``set_not_supported`` (limit sets fail with NVML
        NO_PERMISSION / NOT_SUPPORTED), ``gpu_lost`` (every NVML call on the GPU returns
        GPU_IS_LOST), ``oob_limit`` (value W: an out-of-band limit; enforced = min(requested,
        value)), ``foreign_writer`` (value W: another tool sets this limit now and every
        ``period_s`` seconds), ``bad_constraints`` (value W and ``max_w`` W: NVML reports these as
        the limit constraints, any finite values >= 0 such as (0, 0) or min > max; the real ones
        still bind writes), ``stuck_slowdown`` (value: the SM clock is held at this fraction
        0 < f <= 1 of its maximum at any cap, HW slowdown reason set), ``nvml_stall`` (value s:
        every NVML call on the GPU stalls that long, at most 60 s), ``continuous_clock`` (no value;
        a plant rather than a defect: the SM clock follows the cap continuously instead of in
        15 MHz steps, so NVML reports whole MHz off the step grid; for the pace loop's tests).
        """
        code = self._fault(fault)
        if fault in ("oob_limit", "foreign_writer", "stuck_slowdown", "nvml_stall", "bad_constraints") \
                and value is None:
            raise SimInputError(f"fault {fault!r} needs a value")
        if fault == "bad_constraints":
            if max_w is None:
                raise SimInputError("fault 'bad_constraints' needs max_w (the reported maximum limit, W)")
            period_s = float(max_w)
        v = float("nan") if value is None else float(value)
        self._check(
            self._lib.capsim_inject(self._handle(), self._index(index), code, v, float(period_s)),
            f"gpu {index}",
        )

    def clear(self, index: int, fault: str) -> None:
        """Remove a fault injected with :meth:`inject` (``gpu_lost`` also clears a thermal shutdown)."""
        code = self._fault(fault)
        self._check(self._lib.capsim_clear(self._handle(), self._index(index), code), f"gpu {index}")

    def driver_reload(self) -> None:
        """Simulate a driver reload: every limit back to its default, energy counters restart."""
        self._check(self._lib.capsim_driver_reload(self._handle()), "driver reload")

    # --- limits ------------------------------------------------------------------------------

    def set_limits_w(self, values: Any, indices: Any = None) -> None:
        """Set power limits directly (bypassing NVML; for the cluster simulator).

        Args:
            values: limits in W, one per index (or per GPU when ``indices`` is None).
            indices: GPU indices, or None for GPUs 0..len(values)-1.
        Raises:
            SimInputError: a limit outside the GPU's limit constraints or a bad index (the other
                GPUs of the call are still set).
            SimDeviceError: an injected fault refused a set (NO_PERMISSION, NOT_SUPPORTED,
                GPU_IS_LOST); the other GPUs are still set.
        """
        vals = np.ascontiguousarray(np.atleast_1d(np.asarray(values, dtype=np.float64)))
        if indices is None:
            idx_ptr = None
            if vals.size > self.gpu_count:
                raise SimInputError(
                    f"values has {vals.size} entries; allowed: at most {self.gpu_count}"
                )
        else:
            idx = np.ascontiguousarray(np.atleast_1d(np.asarray(indices, dtype=np.int64)))
            if idx.shape != vals.shape:
                raise SimInputError(
                    f"indices has {idx.size} entries but values has {vals.size}; they must match"
                )
            idx_ptr = idx.ctypes.data
        codes = np.zeros(vals.size, dtype=np.int32)
        rc = self._lib.capsim_set_limits(
            self._handle(), vals.ctypes.data, idx_ptr, vals.size, codes.ctypes.data
        )
        self._check(rc, "set_limits_w")

    # --- reads -------------------------------------------------------------------------------

    def read(self, index: int) -> dict[str, Any]:
        """True state of GPU ``index`` now (consistent snapshot under the node lock).

        Keys (units in the names): temp_c, power_w (instantaneous), power_avg_w (what NVML reports
        on averaging devices), sm_clock_mhz, max_sm_clock_mhz, limit_w (requested), enforced_w,
        min_limit_w, max_limit_w, default_limit_w, oob_limit_w (None when unset), slowdown_temp_c,
        shutdown_temp_c, max_operating_temp_c, reasons (NVML bits), reason_names, energy_j,
        progress (work units), rate (steps per unit time relative to max clock, incl. speed),
        speed, power_factor, thermal_resistance_c_per_w, tau_s, inlet_c, demand_w, utilization_pct,
        memory_bound_fraction, lost, thermal_shutdown, throttled, faults (list), set_count,
        model, custom (True for a custom profile, whatever its name), time_s.
        """
        rec = self._read_record(self._index(index))
        out: dict[str, Any] = {}
        for name in self._dtype.names:
            v = rec[name]
            out[name] = int(v) if np.issubdtype(type(v), np.integer) else float(v)
        flags = out["flags"]
        out["model"] = self.profile.name
        out["custom"] = self.custom
        out["reason_names"] = reason_names(out["reasons"])
        out["oob_limit_w"] = out["oob_limit_w"] or None
        out["lost"] = bool(flags & FLAG_LOST)
        out["thermal_shutdown"] = bool(flags & FLAG_THERMAL_SHUTDOWN)
        out["throttled"] = bool(flags & FLAG_THROTTLED)
        faults = []
        if flags & FLAG_SET_NO_PERMISSION:
            faults.append("set_no_permission")
        if flags & FLAG_SET_NOT_SUPPORTED:
            faults.append("set_not_supported")
        if flags & FLAG_LOST:
            faults.append("gpu_lost")
        if out["oob_limit_w"]:
            faults.append("oob_limit")
        if flags & FLAG_FOREIGN:
            faults.append("foreign_writer")
        if flags & FLAG_BAD_CONSTRAINTS:
            faults.append("bad_constraints")
        if out["stuck_clock_fraction"] > 0:
            faults.append("stuck_slowdown")
        if out["stall_s"] > 0:
            faults.append("nvml_stall")
        if flags & FLAG_CONTINUOUS_CLOCK:
            faults.append("continuous_clock")
        out["faults"] = faults
        out["time_s"] = out.pop("t_s")
        return out

    def state(self, sync: bool = True) -> np.ndarray:
        """numpy structured-array VIEW onto the shared GPU records (fields as in :meth:`read`).

        With ``sync`` the physics of every GPU is first brought up to now.  Reads are not locked:
        use for fast vectorized reads; writes through the view bypass validation.  Do not use the
        view after :meth:`close`.
        """
        h = self._handle()
        if sync:
            self._check(self._lib.capsim_sync(h), "sync")
        ptr = self._lib.capsim_gpus(h)
        buf = (ctypes.c_char * (self._dtype.itemsize * self.gpu_count)).from_address(ptr)
        buf._node = self  # the view keeps the node (and its mapping) alive
        arr = np.frombuffer(buf, dtype=self._dtype, count=self.gpu_count)
        return arr

    def sync(self) -> None:
        """Bring every GPU's physics up to now (done by :meth:`state` by default)."""
        self._check(self._lib.capsim_sync(self._handle()), "sync")

    def steady_state(self, index: int, cap_w: Any, thermal: bool = True, quantized: bool = True):
        """Steady-state (rate, power_w, sm_clock_mhz) of GPU ``index``'s current workload at ``cap_w``."""
        return steady_state(self.read(index), cap_w, thermal=thermal, quantized=quantized)


def steady_state(
    params: str | dict[str, Any],
    cap_w: Any,
    *,
    demand_w: float | None = None,
    memory_bound_fraction: float | None = None,
    speed: float | None = None,
    power_factor: float | None = None,
    inlet_c: float | None = None,
    thermal_resistance_c_per_w: float | None = None,
    thermal: bool = True,
    quantized: bool = True,
):
    """The "true curve": steady-state step rate, power and SM clock at enforced limit(s) ``cap_w``.

    Computed by the same C code as the simulator (``capsim_steady_state``).  ``params`` is a model
    name (profile defaults; ``demand_w`` defaults to the model's max limit) or a dict from
    :meth:`SimNode.read` (that GPU's workload and thermal parameters); keyword arguments override.
    With ``thermal`` the result includes thermal slowdown (exact time average over the slowdown
    limit cycle); ``quantized`` uses the 15 MHz clock grid, else the continuous DVFS curve.

    Returns:
        (rate, power_w, sm_clock_mhz): numpy arrays shaped like ``cap_w`` (floats for a scalar).
        ``rate`` is relative to max clock at speed 1 (x ``speed``).
    Raises:
        SimInputError: unknown model or non-finite caps.
    """
    lib = _lib.load()
    from capctl.simgpu.profiles import get as get_profile
    from capctl.simgpu.profiles import names

    if isinstance(params, str):
        prof = get_profile(params)
        rec = _lib.default_record(lib, prof.index)
        if demand_w is None:
            demand_w = prof.max_limit_w
    elif isinstance(params, dict):
        # a dict from SimNode.read carries every field of the record, the device constants
        # included (ABI 5), so a GPU of a custom profile starts from any built-in default
        idx = int(params.get("profile", -1))
        if idx < 0:
            idx = get_profile(params["model"]).index if params.get("model") in names() else 0
        rec = _lib.default_record(lib, idx)
        for name in rec.dtype.names:
            if name in params and params[name] is not None and not isinstance(params[name], list):
                rec[name] = params[name]
        if "time_s" in params:
            rec["t_s"] = params["time_s"]
    else:
        raise SimInputError(f"params {params!r} is invalid; allowed: a model name or a dict from SimNode.read")
    for name, v in (
        ("demand_w", demand_w),
        ("memory_bound_fraction", memory_bound_fraction),
        ("speed", speed),
        ("power_factor", power_factor),
        ("inlet_c", inlet_c),
        ("thermal_resistance_c_per_w", thermal_resistance_c_per_w),
    ):
        if v is not None:
            rec[name] = float(v)
    caps = np.asarray(cap_w, dtype=np.float64)
    scalar = caps.ndim == 0
    flat = np.ascontiguousarray(caps.reshape(-1))
    if not np.all(np.isfinite(flat)):
        raise SimInputError("cap_w contains a non-finite value; allowed: finite watts")
    rate = np.empty_like(flat)
    power = np.empty_like(flat)
    clock = np.empty_like(flat)
    rc = lib.capsim_steady_state(
        rec.ctypes.data, flat.ctypes.data, flat.size, int(bool(thermal)), int(bool(quantized)),
        rate.ctypes.data, power.ctypes.data, clock.ctypes.data,
    )
    if rc != 0:
        raise SimInputError("steady_state: invalid parameters")
    if scalar:
        return float(rate[0]), float(power[0]), float(clock[0])
    return rate.reshape(caps.shape), power.reshape(caps.shape), clock.reshape(caps.shape)


__all__ = [
    "NODE_ENV",
    "REASON_BITS",
    "SimDeviceError",
    "SimInputError",
    "SimNode",
    "preload_for_pynvml",
    "reason_names",
    "steady_state",
]
