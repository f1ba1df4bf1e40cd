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

_TEXT = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*$", re.ASCII)
"""A number with a suffix; ASCII digits only (``\\d`` of a str pattern matches full-width ``４８００``
too, and float() reads it: ``capctl budget set ４８００`` was taken as 4800 W; found by a try-out)."""


def unit_factor(suffix: str) -> float | None:
    """Factor to watts of ``suffix`` (one of :data:`WATT_SUFFIXES`), else None (ambiguous or unknown)."""
    return WATT_SUFFIXES.get(suffix)


def parse_watts_text(text: str, what: str = "WATTS") -> float:
    """``text`` (a number with an optional suffix of :data:`WATT_SUFFIXES`; ``_`` digit separators
    allowed) in watts.

    Raises:
        UserInputError: not a number with a known suffix (digits other than ASCII 0-9 included), an
            ambiguous ``mw``/``Mw``, or not finite (names ``what``, the text and what is allowed).
    """
    match = _TEXT.match(text.replace("_", ""))
    if match is None and not text.isascii() and any(ch.isdigit() for ch in text):
        raise UserInputError(f"{what} {text!r}: write the number in ASCII digits 0-9, e.g. 17920, 17.9kW or 1.2MW")
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


def format_watts(watts: float) -> str:
    """Watts for a message, without the unit: plain decimal digits (``20000``, ``612.5``,
    ``1000000000``, ``3500.0000001``), as many as tell the value apart from every other float (the
    shortest text that reads back as the same float), so two different values never print the same.

    No exponent from 1e-4 to below 1e16 W; outside that range the shortest exponent form
    (``1e-300``). ``inf``/``nan`` as Python writes them. Raises nothing for a float or int.
    """
    from decimal import Decimal

    value = float(watts)
    if not math.isfinite(value) or value == 0.0:
        return "0" if value == 0.0 else str(value)
    text = repr(value)  # shortest round-trip digits
    if not 1e-4 <= abs(value) < 1e16:
        return text
    plain = format(Decimal(text), "f")
    return plain[:-2] if plain.endswith(".0") else plain
