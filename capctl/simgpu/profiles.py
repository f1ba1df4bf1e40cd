"""Device profiles of the simulated GPUs: the built-in ones, read from the C table in
``csrc/simnvml/physics.c``, and custom ones built from a command line or a YAML/JSON file.

The built-in values and their sources (datasheets, ``nvidia-smi -q`` captures, NVIDIA product
briefs, labelled estimates) are documented next to the table in physics.c and in
docs/simulated-gpus.md; this module only exposes them to Python, it never duplicates them.

A custom profile (:func:`custom`, :func:`parse_option`, :func:`load_file`) starts from a built-in
one (``base``, default H100-SXM) and overrides any of :data:`FIELDS` (a device that matches no
built-in model, e.g. a 200-1,000 W "NVIDIA B200"). Every value is checked against
:data:`FIELDS`' ranges; a bad one raises :class:`ProfileError` naming the option or file:line, the
value and what is allowed. The node stores its profile in its state file (simgpu.h, ABI 5).

Usage::

    from capctl.simgpu import profiles
    profiles.get("H100-SXM").max_limit_w   # 700.0
    [p.name for p in profiles.all_profiles()]
    b200 = profiles.parse_option("name=B200,min_limit_w=200,max_limit_w=1000,default_limit_w=1000")
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capctl.errors import UserInputError
from capctl.simgpu import _lib


@dataclass(frozen=True)
class DeviceProfile:
    """Constants of one GPU model (watts, MHz, degrees C, C/W, seconds).

    ``averaged_power`` is True where NVML reports power as a 1 s average (Ampere and later except
    GA100, per the nvmlDeviceGetPowerUsage reference); ``pci_device_id`` is NVML's combined
    device/vendor id.
    """

    index: int  # in the built-in table; -1 for a custom profile
    name: str
    nvml_name: str
    min_limit_w: float
    max_limit_w: float
    default_limit_w: float
    idle_w: float
    max_sm_clock_mhz: float
    min_sm_clock_mhz: float
    idle_sm_clock_mhz: float
    mem_clock_mhz: float
    max_video_clock_mhz: float
    slowdown_temp_c: float
    shutdown_temp_c: float
    max_operating_temp_c: float
    mem_max_temp_c: float
    thermal_resistance_c_per_w: float
    tau_s: float
    memory_bound_fraction: float
    pci_device_id: int
    architecture: int
    averaged_power: bool


    def to_record(self) -> np.ndarray:
        """This profile as a 1-element ``capsim_profile`` record (the C layout, from its field table)."""
        lib = _lib.load()
        dt = _lib.dtype(lib, 1)
        rec = np.zeros(1, dtype=dt)
        for name in dt.names:
            v = getattr(self, name)
            rec[name] = v.encode() if isinstance(v, str) else v
        return rec


@functools.lru_cache(maxsize=1)
def all_profiles() -> tuple[DeviceProfile, ...]:
    """All device profiles, in the C table's order (index = ``capsim_gpu.profile``).

    Raises:
        capctl.simgpu._lib.LibraryMissingError: the simulated library is not built.
    """
    lib = _lib.load()
    count = ctypes.c_uint()
    ptr = lib.capsim_profiles(ctypes.byref(count))
    dt = _lib.dtype(lib, 1)
    buf = (ctypes.c_char * (dt.itemsize * count.value)).from_address(ptr)
    arr = np.frombuffer(bytes(buf), dtype=dt)
    out = [from_record(rec, i) for i, rec in enumerate(arr)]
    return tuple(out)


def from_record(rec, index: int) -> DeviceProfile:
    """The DeviceProfile of one ``capsim_profile`` record (numpy void of the C layout)."""
    kw = {}
    for name in rec.dtype.names:
        v = rec[name]
        if isinstance(v, bytes):
            v = v.decode()
        elif name == "averaged_power":
            v = bool(v)
        elif np.issubdtype(type(v), np.integer):
            v = int(v)
        else:
            v = float(v)
        kw[name] = v
    return DeviceProfile(index=index, **kw)


def builtin_index(p: DeviceProfile) -> int:
    """Index of the built-in profile equal to ``p`` in every field (its index aside), else -1."""
    return next((b.index for b in all_profiles() if dataclasses.replace(p, index=b.index) == b), -1)


def names() -> list[str]:
    """Model keys accepted by ``SimNode.create(model=...)``."""
    return [p.name for p in all_profiles()]


def get(name: str) -> DeviceProfile:
    """Return the profile called ``name`` (case-insensitive).

    Raises:
        UserInputError: unknown model; the message lists the allowed names.
    """
    for p in all_profiles():
        if p.name.lower() == str(name).lower():
            return p
    raise UserInputError(f"model {name!r} is unknown; allowed: {', '.join(names())}")


class ProfileError(UserInputError):
    """A bad custom device profile: names the option or file:line, the value and what is allowed."""


ARCHITECTURES = {"volta": 5, "turing": 6, "ampere": 7, "ada": 8, "hopper": 9, "blackwell": 10}
"""Names accepted for ``architecture`` and their ``NVML_DEVICE_ARCH_*`` values (nvml.h)."""

_NUM = "number"
FIELDS: dict[str, tuple] = {
    # field: (kind, low, high, what it is); cross-field rules are in _check_relations
    "name": ("text", 1, 31, "capctl model key shown by 'capctl-simgpu show'"),
    "nvml_name": ("text", 1, 63, "what nvmlDeviceGetName returns (default: 'NVIDIA ' + name)"),
    "min_limit_w": (_NUM, 1.0, 5000.0, "minimum of the limit constraints, W"),
    "max_limit_w": (_NUM, 1.0, 5000.0, "maximum of the limit constraints, W"),
    "default_limit_w": (_NUM, 1.0, 5000.0, "default limit, W (within the constraints)"),
    "idle_w": (_NUM, 0.1, 5000.0, "idle / static board power, W (below min_limit_w)"),
    "max_sm_clock_mhz": (_NUM, 100.0, 5000.0, "max SM (boost) clock, MHz"),
    "min_sm_clock_mhz": (_NUM, 15.0, 5000.0, "lowest SM clock under a cap, MHz"),
    "idle_sm_clock_mhz": (_NUM, 0.0, 5000.0, "SM clock when idle, MHz"),
    "mem_clock_mhz": (_NUM, 0.0, 50000.0, "memory clock, MHz"),
    "max_video_clock_mhz": (_NUM, 0.0, 5000.0, "max video clock, MHz"),
    "slowdown_temp_c": (_NUM, 30.0, 149.5, "slowdown temperature, C"),
    "shutdown_temp_c": (_NUM, 30.5, 150.0, "shutdown temperature, C"),
    "max_operating_temp_c": (_NUM, 20.0, 150.0, "max operating temperature, C"),
    "mem_max_temp_c": (_NUM, 20.0, 150.0, "memory max temperature, C"),
    "thermal_resistance_c_per_w": (_NUM, 0.001, 1.0, "nominal thermal resistance, C/W"),
    "tau_s": (_NUM, 0.01, 3600.0, "nominal thermal time constant, s"),
    "memory_bound_fraction": (_NUM, 0.0, 0.99, "default memory-bound share of a step"),
    "pci_device_id": ("int", 0, 0xFFFFFFFF, "(device id << 16) | 0x10DE, e.g. 0x290110DE"),
    "architecture": ("arch", 0, 255, f"NVML_DEVICE_ARCH_* value or one of {', '.join(ARCHITECTURES)}"),
    "averaged_power": ("bool", 0, 1, "true: power readings are a 1 s average (Ampere and later)"),
}
"""Fields of a custom profile: kind, allowed range and meaning (the C driver checks the same
ranges again, csrc/simnvml/physics.c ``capsim_profile_problem``)."""


def _allowed(field: str) -> str:
    kind, lo, hi, what = FIELDS[field]
    if kind == "text":
        return f"text of {lo}..{hi} printable ASCII characters ({what})"
    if kind == "bool":
        return f"true or false, also 1/0 or yes/no ({what})"
    if kind == "arch":
        return what
    return f"{lo:g}..{hi:g} ({what})"


def _shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a megabyte of name stays out of the message)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _convert(field: str, value: object, where: str) -> object:
    """``value`` of ``field`` converted and range-checked. Raises ProfileError naming ``where``."""
    kind, lo, hi, _what = FIELDS[field]

    def bad() -> ProfileError:
        return ProfileError(f"{where}: {field} {_shown(value)} is invalid; allowed: {_allowed(field)}")

    if kind == "text":
        text = str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        if text is None or not lo <= len(text) <= hi or not all(32 <= ord(c) < 127 for c in text):
            raise bad()
        return text
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # the same spellings in a file as on the command line
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad()
    if kind == "arch" and isinstance(value, str) and value.lower() in ARCHITECTURES:
        return ARCHITECTURES[value.lower()]
    if kind in ("int", "arch"):
        try:
            v = int(value, 0) if isinstance(value, str) else value
        except ValueError:
            raise bad() from None
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise bad()
        return v
    try:
        v = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        raise bad() from None
    if not math.isfinite(v) or not lo <= v <= hi:
        raise bad()
    return v


def _check_relations(p: DeviceProfile, where: dict[str, str]) -> None:
    """Cross-field rules of a profile; ``where`` names the origin of each given field."""
    rules = (
        ("min_limit_w", p.min_limit_w <= p.max_limit_w, f"at most max_limit_w ({p.max_limit_w:g} W)"),
        ("default_limit_w", p.min_limit_w <= p.default_limit_w <= p.max_limit_w,
         f"within the limit constraints {p.min_limit_w:g}..{p.max_limit_w:g} W"),
        ("idle_w", p.idle_w < p.min_limit_w, f"below min_limit_w ({p.min_limit_w:g} W)"),
        ("min_sm_clock_mhz", p.min_sm_clock_mhz <= p.max_sm_clock_mhz,
         f"at most max_sm_clock_mhz ({p.max_sm_clock_mhz:g} MHz)"),
        ("idle_sm_clock_mhz", p.idle_sm_clock_mhz <= p.max_sm_clock_mhz,
         f"at most max_sm_clock_mhz ({p.max_sm_clock_mhz:g} MHz)"),
        ("slowdown_temp_c", p.slowdown_temp_c <= p.shutdown_temp_c - 0.5,
         f"at least 0.5 C below shutdown_temp_c ({p.shutdown_temp_c:g} C)"),
    )
    for field, ok, allowed in rules:
        if not ok:
            other = {"min_limit_w": "max_limit_w", "default_limit_w": "min_limit_w", "idle_w": "min_limit_w",
                     "min_sm_clock_mhz": "max_sm_clock_mhz", "idle_sm_clock_mhz": "max_sm_clock_mhz",
                     "slowdown_temp_c": "shutdown_temp_c"}[field]
            # both fields' origins when they differ (a --profile override against a file's line)
            origins = list(dict.fromkeys(o for o in (where.get(field), where.get(other)) if o)) or ["profile"]
            raise ProfileError(f"{' and '.join(origins)}: {field} {getattr(p, field)!r} is invalid; allowed: {allowed}")


def custom(values: dict[str, object], where: dict[str, str] | None = None, base: str | None = None) -> DeviceProfile:
    """A custom profile: built-in ``base`` (or ``values["base"]``; default H100-SXM) with ``values``.

    Args:
        values: field -> value (see :data:`FIELDS`; strings are converted); may hold ``base``.
        where: field -> origin for error messages (an option name or ``file:line``).
        base: the built-in model to start from when ``values`` names none.
    Returns:
        The profile (``index`` -1 unless it equals a built-in one in every field).
    Raises:
        ProfileError: unknown field, a value out of range, or a cross-field rule broken.
    """
    where = dict(where or {})
    values = dict(values)
    base_name = values.pop("base", None) or base or "H100-SXM"
    try:
        prof = get(str(base_name))
    except UserInputError:
        raise ProfileError(f"{where.get('base', 'profile')}: base {base_name!r} is unknown; "
                           f"allowed: {', '.join(names())}") from None
    changes: dict[str, object] = {}
    for field, value in values.items():
        if field not in FIELDS:
            raise ProfileError(f"{where.get(field, 'profile')}: field {field!r} is unknown; allowed: "
                               f"base, {', '.join(FIELDS)}")
        changes[field] = _convert(field, value, where.get(field, "profile"))
    if "name" in changes and "nvml_name" not in changes:
        changes["nvml_name"] = f"NVIDIA {changes['name']}"[:63]
    out = dataclasses.replace(prof, **changes)
    _check_relations(out, where)
    return dataclasses.replace(out, index=builtin_index(out))


def parse_pairs(texts: str | list[str], option: str = "--profile") -> tuple[dict[str, str], dict[str, str]]:
    """``(values, where)`` of ``KEY=VALUE[,KEY=VALUE...]`` text(s) (one per ``--profile`` option).

    Raises:
        ProfileError: a part that is not KEY=VALUE, or a key given twice (names ``option``).
    """
    values: dict[str, str] = {}
    where: dict[str, str] = {}
    for text in [texts] if isinstance(texts, str) else texts:
        for part in (p.strip() for p in text.split(",")):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not part or not eq or not key:
                raise ProfileError(f"{option} {text!r}: {part!r} is not KEY=VALUE; allowed keys: base, "
                                   f"{', '.join(FIELDS)}")
            if key in values:
                raise ProfileError(f"{option}: {key} is given twice")
            values[key] = value.strip().strip('"').strip("'")
            where[key] = f"{option} {key}"
    return values, where


def parse_option(texts: str | list[str], base: str | None = None, option: str = "--profile") -> DeviceProfile:
    """A custom profile from ``KEY=VALUE[,KEY=VALUE...]`` text(s) (:func:`parse_pairs`).

    Raises:
        ProfileError: as :func:`parse_pairs` and :func:`custom`.
    """
    values, where = parse_pairs(texts, option)
    return custom(values, where, base)


MAX_FILE_BYTES = 65536
"""Largest ``--profile-file`` read (bytes): a profile is a mapping of about 25 fields (~1 KB); a
bigger file is refused before it is read (a 45 MB one took 16 s to parse)."""


def load_file(path: str | Path, base: str | None = None, overrides: dict[str, object] | None = None,
              override_where: dict[str, str] | None = None) -> DeviceProfile:
    """A custom profile from a YAML (or JSON) file: a mapping of :data:`FIELDS` (and ``base``).

    ``overrides`` (e.g. from ``--profile``) win over the file's values.

    Raises:
        ProfileError: unreadable file, not a regular file (a FIFO, socket or device), larger than :data:`MAX_FILE_BYTES`, malformed YAML, not a
            mapping (each naming ``file:line``), or as :func:`custom`.
    """
    from capctl.policy.yamlpos import YamlInputError, load_with_positions, read_regular_file

    p = Path(path)
    try:
        raw = read_regular_file(p, MAX_FILE_BYTES)  # a FIFO or device is refused, never waited on
    except (OSError, ValueError) as err:
        raise ProfileError(f"--profile-file {str(p)!r}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    if len(raw) > MAX_FILE_BYTES:
        try:
            size = f"{p.stat().st_size:,} bytes"
        except OSError:
            size = "more bytes"
        raise ProfileError(f"--profile-file {str(p)!r}: {size}; allowed: at most {MAX_FILE_BYTES:,} bytes "
                           "(a device profile is a mapping of about 25 fields)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        col = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise ProfileError(f"{p}:{line}:{col}: not UTF-8 text (byte 0x{raw[err.start]:02x})") from None
    try:
        data, pos = load_with_positions(text, prefixed_ints=True)  # pci_device_id: 0x20B010DE
    except YamlInputError as err:
        raise ProfileError(f"{p}:{err.line}:{err.col}: {err.message}") from None
    if not isinstance(data, dict):
        got = {type(None): "an empty file", list: "a list", str: "text"}.get(type(data), "a single value")
        raise ProfileError(f"{p}:1: a device profile must be a mapping of fields (base, {', '.join(FIELDS)}); "
                           f"got {got}")
    where = {k: f"{p}:{pos.key((k,))[0]}" for k in data}
    values = {k: v for k, v in data.items()}
    values.update(overrides or {})
    where.update(override_where or {})
    return custom(values, where, base)


def __getattr__(attr: str):
    if attr == "PROFILES":
        return all_profiles()
    raise AttributeError(attr)
