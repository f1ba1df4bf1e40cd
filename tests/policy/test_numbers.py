"""Numbers in policy files (and every file read with capctl.policy.yamlpos): plain decimals and
YAML 1.2 exponents are read as written; notations YAML 1.1 reads otherwise (octal, base 60, hex)
are refused with file:line:col, the key, the value as written and the decimal to write."""

from __future__ import annotations

import pytest

from capctl.policy import check_text, parse_policy
from capctl.policy.units import format_number
from capctl.policy.yamlpos import YamlInputError, load_with_positions

BASE = "version: 1\nbudget_w: 20000\n"


def only_error(text: str) -> str:
    report = check_text(text, "p.yaml")
    assert report.policy is None and len(report.errors) == 1, report.errors
    return report.errors[0]


@pytest.mark.parametrize("written,expected", [
    ("020000", "p.yaml:2:11: budget_w: 020000 is not allowed: YAML 1.1 reads a leading 0 as octal (8192), "
               "YAML 1.2 as decimal (20000); allowed: a plain decimal number of watts, e.g. 20000"),
    ("1:30", "p.yaml:2:11: budget_w: 1:30 is not allowed: YAML 1.1 reads 1:30 as a base-60 number (90); "
             "allowed: a plain decimal number of watts, e.g. 90"),
    ("0x1000", "p.yaml:2:11: budget_w: 0x1000 is not allowed: a hexadecimal number (0x prefix); "
               "allowed: a plain decimal number of watts, e.g. 4096"),
    ("0o17", "p.yaml:2:11: budget_w: 0o17 is not allowed: an octal number (0o prefix); "
             "allowed: a plain decimal number of watts, e.g. 15"),
    ("0b101", "p.yaml:2:11: budget_w: 0b101 is not allowed: a binary number (0b prefix); "
              "allowed: a plain decimal number of watts, e.g. 5"),
    ("09000", "p.yaml:2:11: budget_w: 09000 is not allowed: YAML 1.1 reads 09000 as text, YAML 1.2 as decimal "
              "(9000); allowed: a plain decimal number of watts, e.g. 9000"),
    ("17_920", "p.yaml:2:11: budget_w: 17_920 is not allowed: YAML 1.1 reads 17_920 as 17920, YAML 1.2 as text "
               "(no _ in YAML 1.2 numbers); allowed: a plain decimal number of watts, e.g. 17920"),
    ("1_500.5", "p.yaml:2:11: budget_w: 1_500.5 is not allowed: YAML 1.1 reads 1_500.5 as 1500.5, YAML 1.2 as "
                "text (no _ in YAML 1.2 numbers); allowed: a plain decimal number of watts, e.g. 1500.5"),
    (".5_0", "p.yaml:2:11: budget_w: .5_0 is not allowed: YAML 1.1 reads .5_0 as 0.5, YAML 1.2 as text (no _ in "
             "YAML 1.2 numbers); allowed: a plain decimal number of watts, e.g. 0.5"),
], ids=["octal", "base60", "hex", "0o", "binary", "leading-zero-not-octal", "underscore", "underscore-float",
        "underscore-dot"])
def test_ambiguous_numbers_refused_with_the_decimal_to_write(written: str, expected: str) -> None:
    assert only_error(f"version: 1\nbudget_w: {written}\n") == expected


def test_ambiguous_number_in_a_nested_key_names_its_path_and_unit() -> None:
    text = BASE + "failsafe:\n  lease_s: 1:30\nslew_w: 0100\n"
    error = only_error(text)  # the first one stops the read
    assert error.startswith("p.yaml:4:12: failsafe.lease_s: 1:30 is not allowed: ")
    assert error.endswith("allowed: a plain decimal number of seconds, e.g. 90")
    error = only_error(BASE + "domains: {name: c, children: [{name: r, kind: rack, limit_w: 0100}]}\n")
    assert error.startswith("p.yaml:3:62: domains.children[0].limit_w: 0100 is not allowed: ")
    assert error.endswith("e.g. 100")


def test_ambiguous_text_where_a_name_belongs_says_to_quote_it() -> None:
    error = only_error(BASE + "domains: {name: 0755, nodes: a1}\n")
    assert error == ('p.yaml:3:17: domains.name: 0755 is not allowed: YAML 1.1 reads a leading 0 as octal (493), '
                     'YAML 1.2 as decimal (755); allowed: text, quoted: "0755"')
    assert parse_policy(BASE + 'domains: {name: "0755", nodes: a1}\n').domains.name == "0755"
    # a count: the decimal to write, no quoting (a quoted count is refused as text; a try-out)
    error = only_error(BASE + "domains: {name: c, nodes: a1, gpus_per_node: 04}\n")
    assert error.endswith("allowed: a plain decimal number, e.g. 4"), error


def test_ambiguous_keys_are_names_as_written() -> None:
    policy = parse_policy(BASE + "weights: {partitions: {0100: 2, 1:30: 3, 0x1f: 4}}\n")
    assert dict(policy.weights.partitions) == {"0100": 2.0, "1:30": 3.0, "0x1f": 4.0}


@pytest.mark.parametrize("written,value_w", [
    ("2e4", 20000.0), ("1.5e3", 1500.0), ("2E+4", 20000.0), ("25e-1", 2.5), (".5e1", 5.0), ("+4000", 4000.0),
    ("20000.0", 20000.0), ("0", 0.0), ("-0.5", -0.5),
])
def test_decimal_and_exponent_numbers_read_as_written(written: str, value_w: float) -> None:
    data, _ = load_with_positions(f"budget_w: {written}\n")
    assert data["budget_w"] == value_w and isinstance(data["budget_w"], (int, float))


def test_exponents_accepted_everywhere_numbers_are_read() -> None:
    policy = parse_policy("version: 1\nbudget_w: 2e4\ninterval_s: 5e-1\nfailsafe: {lease_s: 3e1}\n"
                          "domains: {name: c, children: [{name: r, kind: rack, limit_w: 1.5e4, nodes: a1}]}\n"
                          "weights: {qos: {high: 2e0}}\n")
    assert (policy.budget_w, policy.interval_s, policy.failsafe.lease_s) == (20000.0, 0.5, 30.0)
    assert policy.domains.children[0].limit_w == 15000.0 and policy.weights.qos["high"] == 2.0


def test_quoted_numbers_stay_text() -> None:
    data, _ = load_with_positions('a: "020000"\nb: \'2e4\'\n')
    assert data == {"a": "020000", "b": "2e4"}


def test_overflowing_number_is_refused_as_written() -> None:
    with pytest.raises(YamlInputError) as info:
        load_with_positions("budget_w: 1e999\n")
    assert (info.value.line, info.value.col) == (1, 11)
    assert info.value.message == ("budget_w: 1e999 is not allowed: too large for a number (it reads as "
                                  "infinity); give a finite number")


def test_version_must_be_the_integer_1() -> None:
    assert only_error("version: 1.0\nbudget_w: 20000\n") == (
        "p.yaml:1:10: version: 1.0 is not allowed; the format version is an integer: write version: 1")
    assert parse_policy("version: 1\nbudget_w: 20000\n").version == 1


def test_tiny_numbers_shown_as_written() -> None:
    assert format_number(1e-320) == "1e-320"  # stored as a denormal: was shown as 9.99989e-321
    assert format_number(5e-324) == "5e-324"
    assert (format_number(0.1 + 0.2), format_number(123.456789), format_number(1e20)) == ("0.3", "123.457", "1e+20")
    error = only_error('version: 1\nbudget_w: "1e-320 W"\n')
    assert error.endswith("write the number in watts without a unit: budget_w: 1e-320")


def test_prefixed_integers_only_where_the_reader_takes_them() -> None:
    text = "pci_device_id: 0x20B0_10DE\nmask: 0b101\nmode: 0o17\n"
    data, _ = load_with_positions(text, prefixed_ints=True)  # device profiles: PCI ids in hex
    assert data == {"pci_device_id": 0x20B010DE, "mask": 5, "mode": 15}
    with pytest.raises(YamlInputError) as info:
        load_with_positions(text)
    assert info.value.message.startswith("pci_device_id: 0x20B0_10DE is not allowed: a hexadecimal number")
    for refused in ("0755", "1:30"):  # leading zero and base 60: refused by every reader
        with pytest.raises(YamlInputError):
            load_with_positions(f"n: {refused}\n", prefixed_ints=True)


@pytest.mark.parametrize("text,expected", [
    ('budget_w: "1e308 kW"', "p.yaml:2:11: budget_w: expected a number of watts, got '1e308 kW'; '1e308 kW' is "
                             "beyond any number of watts capctl takes"),
    ("budget_kw: 1e308", "p.yaml:2:1: unknown key 'budget_kw': capctl keys carry the unit watts; use 'budget_w'"),
    ('budget: "1e308 kW"', "p.yaml:2:1: unknown key 'budget'; did you mean 'budget_w' (watts)? '1e308 kW' is "
                           "beyond any number of watts capctl takes"),
    ("budget_kw: 1" + "0" * 400, "p.yaml:2:1: unknown key 'budget_kw': capctl keys carry the unit watts; use 'budget_w'"),
    ("budget_w: 0" + "7" * 400, "p.yaml:2:11: budget_w: 0777777777777777777777777777777777777... (401 characters) "
                                "is not allowed: YAML 1.1 reads a leading 0 as octal (about 10^361), YAML 1.2 as "
                                "decimal (about 10^400); allowed: a plain decimal number of watts"),
    ("budget_w: 0x" + "f" * 300, "p.yaml:2:11: budget_w: 0xfffffffffffffffffffffffffffffffffff... (302 characters) "
                                 "is not allowed: a hexadecimal number (0x prefix); allowed: a plain decimal number "
                                 "of watts"),
    ("budget_w: " + "9" * 400 + ":30", "p.yaml:2:11: budget_w: 9999999999999999999999999999999999999... (403 "
                                       "characters) is not allowed: YAML 1.1 reads 9999999999999999999999999999999999999"
                                       "... (403 characters) as a base-60 number (inf); allowed: a plain decimal "
                                       "number of watts"),
], ids=["unit-string", "unit-key", "near-key", "unit-key-huge-int", "octal-huge", "hex-huge", "base60-huge"])
def test_numbers_beyond_any_double_are_refused_without_a_traceback(text: str, expected: str) -> None:
    """Found by a review: each raised OverflowError from the message's own hint (a traceback from
    ``capctl policy validate``, the coordinator's start and ``policy reload``)."""
    assert only_error(f"version: 1\n{text}\n") == expected


def test_format_number_is_total() -> None:
    assert [format_number(v) for v in (float("inf"), float("-inf"), float("nan"))] == ["inf", "-inf", "nan"]
    assert format_number(10 ** 400) == "about 10^400" and format_number(-(10 ** 400)) == "about -10^400"
    assert format_number(20000.0) == "20000" and format_number(1e20) == "1e+20"


def test_a_document_over_the_node_bound_is_refused_while_it_is_composed(monkeypatch):
    """The node bound holds while the document is composed, not after (a 2 MB flow list of a
    million items took 38 s and 789 MB before it was refused; found by a review): the loader stops
    at the first node past it, with its line and column; alias expansion stays bounded after."""
    from capctl.policy import yamlpos

    monkeypatch.setattr(yamlpos, "MAX_NODES", 1000)
    seen = []
    inner = yamlpos._Loader.compose_node

    def counted(self, parent, index):
        seen.append(1)
        return inner(self, parent, index)

    monkeypatch.setattr(yamlpos._Loader, "compose_node", counted)
    text = "version: 1\nthermal: [" + ",".join(["1"] * 5000) + "]\n"
    with pytest.raises(YamlInputError, match="document too large") as err:
        load_with_positions(text)
    # the mapping, two keys, a value and the list come first: the 1,001st node is item 996
    assert len(seen) == 1001 and (err.value.line, err.value.col) == (2, 11 + 2 * 995)
    # within the raw bound, aliases past it after expansion: refused by the expansion's count
    bomb = "version: 1\na: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n" \
           "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
    with pytest.raises(YamlInputError, match="after expanding aliases"):
        load_with_positions(bomb)


def test_an_explicit_int_tag_does_not_bypass_the_notation_rules() -> None:
    """``budget_w: !!int 0x10`` was read as 16 W (found by a review)."""
    assert only_error("version: 1\nbudget_w: !!int 0x10\n") == (
        "p.yaml:2:11: budget_w: 0x10 is not allowed: a hexadecimal number (0x prefix); allowed: a plain decimal "
        "number of watts, e.g. 16")
    assert check_text("version: 1\nbudget_w: !!int 20000\n", "p.yaml").policy.budget_w == 20000


def test_an_empty_node_list_is_warned_and_a_too_large_range_names_the_bound() -> None:
    text = ("version: 1\nbudget_w: 20000\ndomains:\n  name: c\n  gpu_model: H100-SXM\n  gpus_per_node: 8\n"
            "  children:\n    - {name: r1, kind: rack, nodes: 'a[1-2]'}\n    - {name: r2, kind: rack, nodes: []}\n")
    report = check_text(text, "p.yaml")
    assert "p.yaml:9:7: warning: domains.children[1]: domain 'r2' holds no nodes" in report.warnings, report.warnings
    big = check_text(text.replace("nodes: []", "nodes: 'b[1-150000]'"), "p.yaml")
    assert any("'b[1-150000]': range too large (at most 100000 names per range)" in e for e in big.errors), big.errors


def test_digit_separators_are_refused_everywhere_numbers_are_read() -> None:
    """``budget_w: 1_000`` was read as 1000 (YAML 1.1) where YAML 1.2, the shipped JSON Schema in an
    editor and other tools read the text "1_000" (found by a review): refused like the other notations
    the two versions read differently, also in a nested key, with an explicit tag and in a list."""
    assert only_error(BASE + "failsafe: {lease_s: 1_0}\n").startswith("p.yaml:3:21: failsafe.lease_s: 1_0 is not allowed")
    assert only_error("version: 1\nbudget_w: !!int 20_000\n").endswith("e.g. 20000")
    assert only_error(BASE + "domains: {name: c, nodes: a1, limit_w: 2_0e3}\n").endswith("e.g. 20000")
    with pytest.raises(YamlInputError, match=r"^sizes\[1\]: 1_6 is not allowed"):
        load_with_positions("sizes: [8, 1_6]\n")
    assert load_with_positions('a: "1_000"\nb: x_1\n')[0] == {"a": "1_000", "b": "x_1"}  # text stays text


@pytest.mark.parametrize("text,expected", [
    ("domains: {name: c, nodes: a1, gpus_per_node: 8.0}\n",
     "p.yaml:3:46: domains.gpus_per_node: expected a whole number or null, got 8.0 (written with a decimal point or "
     "an exponent; write 8)"),
    ("metrics: {all_up_to_gpus: 4e3}\n",
     "p.yaml:3:27: metrics.all_up_to_gpus: expected a whole number, got 4000.0 (written with a decimal point or an "
     "exponent; write 4000)"),
    ("coordinator: {etcd: {endpoints: ['http://e1:2379'], lease_ttl_s: 2.0}}\n",
     "p.yaml:3:66: coordinator.etcd.lease_ttl_s: expected a whole number, got 2.0 (written with a decimal point or "
     "an exponent; write 2)"),
    ("domains: {name: c, nodes: a1, gpus_per_node: 8.5}\n",
     "p.yaml:3:46: domains.gpus_per_node: expected a whole number or null, got 8.5"),
], ids=["gpus_per_node", "exponent", "lease_ttl_s", "fraction"])
def test_a_float_where_a_whole_number_belongs_is_refused(text: str, expected: str) -> None:
    """``gpus_per_node: 8.0`` was taken as 8 without a word (JSON Schema counts 8.0 as an integer)
    while ``version: 1.0`` was refused (found by a review): every whole-number key refuses it."""
    assert only_error(BASE + text) == expected
    assert parse_policy(BASE + "domains: {name: c, nodes: a1, gpus_per_node: 8}\n").domains.gpus_per_node == 8


@pytest.mark.parametrize("line,shown", [
    ("weights: {default: 1000.0001}", "weights.default: 1000.0001 is not allowed; must be <= 1000"),
    ("slew_w: 100000.2", "slew_w: 100000.2 W is not allowed; must be <= 100000 W"),
    ("weights: {default: 5000}", "weights.default: 5000 is not allowed; must be <= 1000"),
])
def test_a_value_just_out_of_range_is_shown_as_written_not_rounded_into_range(line: str, shown: str) -> None:
    """Six significant digits showed 1000.0001 as "1000 is not allowed; must be <= 1000" (a try-out)."""
    assert only_error(BASE + line + "\n").endswith(shown)
    assert only_error("version: 1\nbudget_w: 1000000000.5\n").endswith(
        "budget_w: 1000000000.5 W is not allowed; must be <= 1000000000 W")
