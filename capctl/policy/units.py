"""Unit hints for policy errors: every policy quantity is a bare number whose unit is in its key.

When someone writes ``budget_w: "20 kW"`` or ``budget_kw: 20`` the validator uses these helpers to
say what to write instead (``budget_w: 20000``). Conversion factors are exact SI prefixes.
"""

from __future__ import annotations

import math
import re

UNIT_SUFFIXES = {
    # key suffix -> (base suffix, factor to the base unit)
    "_w": ("_w", 1.0),
    "_watts": ("_w", 1.0),
    "_watt": ("_w", 1.0),
    "_kw": ("_w", 1e3),
    "_mw": ("_w", 1e6),  # a key can't tell milli from mega; policies never hold milliwatts
    "_s": ("_s", 1.0),
    "_sec": ("_s", 1.0),
    "_secs": ("_s", 1.0),
    "_seconds": ("_s", 1.0),
    "_ms": ("_s", 1e-3),
    "_min": ("_s", 60.0),
    "_minutes": ("_s", 60.0),
    "_h": ("_s", 3600.0),
    "_c": ("_c", 1.0),
    "_degc": ("_c", 1.0),
    "_celsius": ("_c", 1.0),
}
"""Key suffixes people write, mapped to the suffix capctl uses and the factor to its unit."""

_VALUE_UNITS = {
    # unit text (lower case) -> (base key suffix, factor)
    "w": ("_w", 1.0),
    "watt": ("_w", 1.0),
    "watts": ("_w", 1.0),
    "kw": ("_w", 1e3),
    "s": ("_s", 1.0),
    "sec": ("_s", 1.0),
    "secs": ("_s", 1.0),
    "second": ("_s", 1.0),
    "seconds": ("_s", 1.0),
    "ms": ("_s", 1e-3),
    "min": ("_s", 60.0),
    "mins": ("_s", 60.0),
    "minute": ("_s", 60.0),
    "minutes": ("_s", 60.0),
    "h": ("_s", 3600.0),
    "c": ("_c", 1.0),
    "°c": ("_c", 1.0),
    "degc": ("_c", 1.0),
    "°": ("_c", 1.0),
}

_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z°]+)?\s*$")

UNIT_NAMES = {"_w": "watts", "_s": "seconds", "_c": "degrees C"}
"""Human name of the unit of each key suffix."""


def key_unit(key: str) -> str | None:
    """Return the base unit suffix (``_w``, ``_s``, ``_c``) a capctl key ends with, or None."""
    for suffix in ("_w", "_s", "_c"):
        if key.endswith(suffix):
            return suffix
    return None


def split_unit_key(key: str) -> tuple[str, str, float] | None:
    """Split ``budget_kw`` into ``("budget", "_w", 1000.0)``; None when the key has no unit suffix.

    The longest matching suffix wins (``_ms`` before ``_s``). Case-insensitive.
    """
    lower = key.lower()
    for suffix in sorted(UNIT_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix) and len(lower) > len(suffix):
            base, factor = UNIT_SUFFIXES[suffix]
            return lower[: -len(suffix)], base, factor
    return None


def parse_quantity(text: str) -> tuple[float, str | None, float] | None:
    """Parse ``"20 kW"`` into ``(20.0, "_w", 1000.0)``; ``"5"`` into ``(5.0, None, 1.0)``.

    Returns None when the text is not a number with an optional known unit.
    """
    match = _QUANTITY.match(text)
    if not match:
        return None
    number = float(match.group(1))
    if not math.isfinite(number):
        return None
    unit = match.group(2)
    if unit is None:
        return number, None, 1.0
    from capctl.wattunits import AMBIGUOUS, unit_factor

    if unit in AMBIGUOUS:
        return None  # milli or mega: no hint rather than a wrong one
    if unit_factor(unit) is not None:  # watts: SI prefixes are case-sensitive (mW vs MW)
        return number, "_w", unit_factor(unit)
    known = _VALUE_UNITS.get(unit.lower())
    if known is None:
        return None
    return number, known[0], known[1]


def is_finite(value) -> bool:
    """``math.isfinite`` for any real number, an int beyond any double included (False: it has no
    float form; ``math.isfinite`` raised OverflowError on it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def exact_number(value: float) -> str:
    """``value`` with every digit that tells it apart from its neighbours (the shortest text that
    reads back as the same float: ``1.0000001``, ``20000``), for a comparison in a message where
    :func:`format_number`'s 6 digits make two different values read equal ("lease_s 1 s is less
    than two intervals (2 s)" of lease_s 1.0000001; found by a try-out). Non-finite and huge ints:
    as :func:`format_number`."""
    if isinstance(value, int) and not isinstance(value, bool) and not is_finite(value):
        return format_number(value)
    value = float(value)
    if not math.isfinite(value):
        return format_number(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def format_number(value: float) -> str:
    """Format a number the way a person would write it in YAML (``20000``, ``0.5``, ``1e-320``):
    at most 6 significant digits, fewer where fewer read back as ``value`` (a denormal written
    1e-320 is not shown as 9.99989e-321). Total: ``inf``, ``-inf``, ``nan``, and ``about 10^N`` for
    an int beyond any double (a review found both raising OverflowError from a message's hint:
    a traceback for ``budget_w: "1e308 kW"``)."""
    if isinstance(value, int) and not isinstance(value, bool) and not is_finite(value):
        return f"about {'-' if value < 0 else ''}10^{round(math.log10(abs(value)))}"
    if not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    text = f"{value:.6g}"
    shortest = repr(float(value))  # the shortest text that reads back as value
    return shortest if _digits(shortest) < _digits(text) else text


def _digits(text: str) -> int:
    """Significant digits of a number written as ``text`` (``"9.99989e-321"`` -> 6)."""
    return len(text.split("e")[0].lstrip("-").replace(".", "").strip("0"))


def value_hint(key: str, text: str) -> str:
    """Return a hint for a string found where the number ``key`` expects; ``""`` when none fits.

    >>> value_hint("budget_w", "20 kW")
    'write the number in watts without a unit: budget_w: 20000'
    """
    parsed = parse_quantity(text)
    want = key_unit(key)
    if parsed is None or want is None:
        return ""
    number, have, factor = parsed
    if have is not None and have != want:
        return f"{text!r} is not in {UNIT_NAMES[want]}, the unit of {key}"
    if not is_finite(number * factor):
        return f"{text!r} is beyond any number of {UNIT_NAMES[want]} capctl takes"
    return f"write the number in {UNIT_NAMES[want]} without a unit: {key}: {format_number(number * factor)}"
