"""Watt quantities written by people (``17.9kW``, ``500 mW``), parsed case-correctly.

SI prefixes are case-sensitive: ``mW`` is a milliwatt (1e-3 W), ``MW`` a megawatt (1e6 W). Lower
casing the text first (the old parser) read ``500mW`` as 500 MW. Spellings:

=========================  ==========  ============================================
suffix                     factor (W)  note
=========================  ==========  ============================================
``W``, ``w``               1           no suffix means watts too
``kW``, ``kw``, ``KW``,    1e3         ``K`` is not an SI prefix but cannot mean
``Kw``                                 anything else
``MW``                     1e6
``mW``                     1e-3
``mw``, ``Mw``             —           ambiguous: refused, naming both readings
=========================  ==========  ============================================
"""

from __future__ import annotations

import math
import re

from capctl.errors import UserInputError

WATT_SUFFIXES: dict[str, float] = {"": 1.0, "W": 1.0, "w": 1.0, "kW": 1e3, "kw": 1e3, "KW": 1e3, "Kw": 1e3,
                                   "MW": 1e6, "mW": 1e-3}
"""Accepted suffix -> factor to watts."""

AMBIGUOUS = ("mw", "Mw")
"""Suffixes that could be milli- or mega-watts."""

_TEXT = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*$")


def unit_factor(suffix: str) -> float | None:
    """Factor to watts of ``suffix`` (one of :data:`WATT_SUFFIXES`), else None (ambiguous or unknown)."""
    return WATT_SUFFIXES.get(suffix)


def parse_watts_text(text: str, what: str = "WATTS") -> float:
    """``text`` (a number with an optional suffix of :data:`WATT_SUFFIXES`; ``_`` digit separators
    allowed) in watts.

    Raises:
        UserInputError: not a number with a known suffix, an ambiguous ``mw``/``Mw``, or not finite
            (names ``what``, the text and what is allowed).
    """
    match = _TEXT.match(text.replace("_", ""))
    if match is None:
        raise UserInputError(f"{what} {text!r}: give a number of watts, e.g. 17920, 17.9kW or 1.2MW")
    number, suffix = float(match.group(1)), match.group(2)
    if suffix in AMBIGUOUS:
        raise UserInputError(f"{what} {text!r}: {suffix!r} is ambiguous; write MW for megawatts or mW for milliwatts")
    factor = unit_factor(suffix)
    if factor is None:
        raise UserInputError(f"{what} {text!r}: unknown unit {suffix!r}; allowed W, kW, MW, mW (or none = W)")
    value = number * factor
    if not math.isfinite(value):
        raise UserInputError(f"{what} {text!r}: give a finite number of watts")
    return value
