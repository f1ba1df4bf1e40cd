"""Watt suffixes are read case-correctly (``mW`` = 1e-3 W, ``MW`` = 1e6 W): a property test over every
suffix and every upper/lower-case spelling of its letters, for ``capctl budget set`` and the policy's
unit hints."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capctl.cli.status import parse_watts
from capctl.errors import UserInputError
from capctl.policy.units import parse_quantity, value_hint
from capctl.wattunits import AMBIGUOUS, WATT_SUFFIXES, parse_watts_text

SI = {"W": 1.0, "kW": 1e3, "MW": 1e6, "mW": 1e-3}
"""The SI spellings and their factors (BIPM SI Brochure, prefixes milli, kilo, mega)."""


def spellings(suffix: str) -> set[str]:
    return {"".join(c) for c in itertools.product(*[(ch.lower(), ch.upper()) for ch in suffix])}


def test_the_table_holds_every_si_spelling_with_its_factor():
    for suffix, factor in SI.items():
        assert WATT_SUFFIXES[suffix] == factor


@given(number=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False), suffix=st.sampled_from(
    sorted(set().union(*(spellings(s) for s in SI)))), space=st.sampled_from(["", " "]))
def test_every_case_spelling_is_its_factor_or_refused(number, suffix, space):
    text = f"{number!r}{space}{suffix}"
    if suffix in AMBIGUOUS:
        with pytest.raises(UserInputError, match="ambiguous; write MW for megawatts or mW for milliwatts"):
            parse_watts_text(text)
        assert parse_quantity(text) is None  # no hint rather than a wrong one
        return
    factor = WATT_SUFFIXES.get(suffix)
    if factor is None:  # e.g. "kw" is fine, but "kM"-like typos cannot occur: letters are W, w, k, K, m, M
        with pytest.raises(UserInputError):
            parse_watts_text(text)
        return
    assert parse_watts_text(text) == pytest.approx(number * factor, rel=1e-12)
    assert parse_quantity(text) == (pytest.approx(number), "_w", factor)
    if suffix in SI:  # the exact SI spelling never changes its meaning with case
        assert factor == SI[suffix]


def test_budget_set_reads_milliwatts_as_milliwatts_and_megawatts_as_megawatts():
    assert parse_watts("1.5MW") == 1.5e6
    assert parse_watts("17.9kW") == pytest.approx(17900.0)
    assert parse_watts("2_000") == 2000.0
    assert parse_watts("500000mW") == 500.0
    with pytest.raises(UserInputError, match=r"WATTS '500mw': 'mw' is ambiguous"):
        parse_watts("500mw")
    with pytest.raises(UserInputError, match="unknown unit 'kWh'"):
        parse_watts("5kWh")


def test_a_policy_value_in_milliwatts_gets_the_milliwatt_hint():
    assert value_hint("budget_w", "500000 mW") == "write the number in watts without a unit: budget_w: 500"
    assert value_hint("budget_w", "2 MW") == "write the number in watts without a unit: budget_w: 2000000"


@pytest.mark.parametrize("text", ["\uff14\uff18\uff10\uff10", "\uff14\uff18\uff10\uff10 kW", "4\u066800", "\u0664800W"])
def test_digits_other_than_ascii_are_refused(text):
    """``capctl budget set ４８００`` (full-width digits) was taken as 4800 W: ``\\d`` and float()
    read any Unicode digit (found by a try-out). ``_`` separators stay allowed (documented)."""
    with pytest.raises(UserInputError) as info:
        parse_watts(text)
    assert str(info.value) == f"WATTS {text!r}: write the number in ASCII digits 0-9, e.g. 17920, 17.9kW or 1.2MW"
    assert parse_watts("4_800") == 4800.0
