"""Validate policy YAML and build :class:`capctl.policy.model.Policy`.

Two stages, both reporting ``file:line:col: message`` (1-based, pointing at the offending key or
value; positions come from PyYAML node marks, see :mod:`capctl.policy.yamlpos`):

1. Structure: the JSON Schema shipped in ``schema.json`` (draft 2020-12, checked with
   ``jsonschema``), plus a scan for NaN/infinity. Error texts are rewritten for people: unknown keys
   get a did-you-mean (``difflib``) or a unit hint (``budget_kw`` -> ``budget_w``), strings with units
   where numbers belong say what to write (``budget_w: "20 kW"`` -> ``budget_w: 20000``).
2. Meaning (only when the structure is valid): budget present, lease longer than the interval, caps
   ordered, caps within known device limits, hostlists valid (python-hostlist), every node in exactly
   one domain, child limits not above their ancestors', limits not below the sum of minimum caps.

Warnings (valid, but probably not what was meant) never make a policy invalid; they are kept in
``Policy.warnings`` and printed by ``capctl policy validate``.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType

import hostlist
import jsonschema

from capctl.addresses import check_address
from capctl.errors import UserInputError
from capctl.policy import model
from capctl.policy.devices import KNOWN_DEVICE_LIMITS_W, KNOWN_NVML_NAMES, device_limits_w, model_suggestion
from capctl.policy.minimums import minimum_w
from capctl.policy.units import UNIT_NAMES, exact_number, format_number, is_finite, split_unit_key, value_hint
from capctl.policy.yamlpos import Positions, YamlInputError, dotted, load_with_positions, read_regular_file

MAX_FILE_BYTES = 16 * 1024 * 1024
"""Largest policy file read, bytes."""

MAX_TOTAL_NODES = 200_000
"""Largest number of nodes a policy may list (12,500-node clusters are the design target)."""

MAX_ERRORS = 200
"""At most this many errors are reported for one file (then one line saying how many more)."""

_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UNIT_WORD = {"W": "watts", "s": "seconds", "C": "degrees C"}
_TYPE_WORD = {"integer": "a whole number", "object": "a mapping", "array": "a list", "string": "a string",
              "boolean": "true or false", "null": "null"}
"""JSON Schema type -> words for an error message ("number" is worded with its unit)."""


class PolicyError(UserInputError):
    """An invalid policy. ``errors``: ``"file:line:col: message"`` lines (at least one);
    ``warnings``: ``"file:line:col: warning: message"`` lines. ``str()`` is the errors, one a line."""

    def __init__(self, errors: list[str], warnings: list[str] | None = None) -> None:
        self.errors = list(errors)
        self.warnings = list(warnings or [])
        super().__init__("\n".join(self.errors))


@dataclass
class Report:
    """Outcome of a check: ``errors`` and ``warnings`` as formatted lines; ``policy`` when valid."""

    source: str
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    policy: model.Policy | None = None

    @property
    def ok(self) -> bool:
        """True when there are no errors."""
        return not self.errors


@functools.cache
def load_schema() -> dict:
    """Return the policy JSON Schema (``capctl/policy/schema.json``) as a dict."""
    return json.loads(resources.files("capctl.policy").joinpath("schema.json").read_text(encoding="utf-8"))


def _is_whole_number(_checker, instance) -> bool:
    """JSON Schema's ``integer`` as the policy reads it: an int written without a decimal point
    (``8``, never ``8.0``: JSON Schema counts 8.0 as an integer, and ``gpus_per_node: 8.0`` was
    taken as 8 without a word while ``version: 1.0`` was refused; found by a review)."""
    return isinstance(instance, int) and not isinstance(instance, bool)


@functools.cache
def _validator() -> jsonschema.Draft202012Validator:
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    base = jsonschema.Draft202012Validator
    strict = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", _is_whole_number))
    return strict(schema)


# --------------------------------------------------------------------------------------------------
# Collecting diagnostics


class _Diag:
    """Accumulates positioned errors and warnings for one source."""

    def __init__(self, source: str, positions: Positions) -> None:
        self.source = source
        self.positions = positions
        self.errors: list[tuple[int, int, str]] = []
        self.warnings: list[tuple[int, int, str]] = []

    def error(self, path, message: str, at_key: bool = False) -> None:
        pos = self.positions.key(path) if at_key else self.positions.value(path)
        self.errors.append((pos[0], pos[1], message))

    def warn(self, path, message: str, at_key: bool = False) -> None:
        pos = self.positions.key(path) if at_key else self.positions.value(path)
        self.warnings.append((pos[0], pos[1], message))

    def lines(self) -> tuple[list[str], list[str]]:
        errors = [f"{self.source}:{l}:{c}: {m}" for l, c, m in sorted(set(self.errors))]
        if len(errors) > MAX_ERRORS:
            errors = errors[:MAX_ERRORS] + [f"{self.source}: ... and {len(errors) - MAX_ERRORS} more errors"]
        warnings = [f"{self.source}:{l}:{c}: warning: {m}" for l, c, m in sorted(set(self.warnings))]
        return errors, warnings[:MAX_ERRORS]


def _show_against(value: object, bound: float, op: str) -> str:
    """:func:`_show` of a number refused for being out of range (``op`` ``bound``), exact where the
    short form would read as allowed: ``1000.0001`` was shown "1000 is not allowed; must be <= 1000"
    and ``1000000000.5`` "1e+09" (found by a try-out)."""
    shown = _show(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return shown
    try:
        back = float(shown)
    except ValueError:
        return shown
    passes = {">=": back >= bound, ">": back > bound, "<=": back <= bound, "<": back < bound}[op]
    return repr(value) if passes else shown


def _show(value: object) -> str:
    """Short, safe rendering of a YAML value for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format_number(value) if math.isfinite(value) else repr(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 10 ** 15 else format_number(value)  # (not 4,000 digits)
    if isinstance(value, str):
        text = value if len(value) <= 60 else value[:57] + "..."
        return repr(text)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__} value"


def _suggest(word: str, choices) -> str | None:
    choices = [str(c) for c in choices]
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered:
        return lowered[word.lower()]
    norm = {c.lower().replace("_", "-"): c for c in choices}
    if word.lower().replace("_", "-").replace(" ", "-") in norm:
        return norm[word.lower().replace("_", "-").replace(" ", "-")]
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def unknown_key_message(key: str, known: list[str], value: object = None, where: str = "") -> str:
    """Message for an unknown ``key`` among ``known`` keys, with a unit hint or a did-you-mean."""
    where = f" in {where}" if where else ""
    head = f"unknown key {key!r}{where}"
    split = split_unit_key(key)
    if split is not None:
        stem, unit, factor = split
        target = stem + unit
        if target in known and target != key:
            text = f"{head}: capctl keys carry the unit {UNIT_NAMES[unit]}; use {target!r}"
            if (isinstance(value, (int, float)) and not isinstance(value, bool) and factor != 1.0
                    and is_finite(value) and is_finite(value * factor)):
                text += f" ({target}: {format_number(value * factor)})"
            return text
    for unit in ("_w", "_s", "_c"):
        target = key.lower() + unit
        if target in known:
            text = f"{head}; did you mean {target!r} ({UNIT_NAMES[unit]})?"
            if isinstance(value, str):
                hint = value_hint(target, value)
                if hint:
                    text += f" {hint}"
            return text
    guess = _suggest(key, known)
    if guess is not None:
        return f"{head}; did you mean {guess!r}?"
    return f"{head}; allowed keys: {', '.join(known)}"


def _expected(types, unit: str | None) -> str:
    if isinstance(types, str):
        types = [types]
    words = []
    for t in types:
        if t == "number":
            words.append(f"a number of {_UNIT_WORD[unit]}" if unit else "a number")
        elif t in _TYPE_WORD:
            words.append(_TYPE_WORD[t])
    return " or ".join(words)


_PATTERN_WORDS = {
    "socket_path": "an absolute path (starting with /)",
    "address": "unix:/absolute/path or host:port",
    "admin_group": "a unix group name",
    "status_group": "a unix group name",
    "endpoints": "http://HOST:PORT or https://HOST:PORT (PORT 1..65535)",
    "prefix": "a key prefix starting with / (letters, digits, _ . / -)",
    "socket_group": "a unix group name",
    "name": "a name of letters, digits and _ . : / -",
}
"""Key -> what its schema ``pattern`` asks for, in words (for a pattern mismatch)."""


def _type_message(err: jsonschema.ValidationError, name: str, unit: str | None, last_key: str) -> str:
    """Message for a ``type`` error at ``name`` (``unit``: the schema's x-unit), with a hint for
    a string where a number of a unit belongs and a note for a boolean given as a number."""
    instance = err.instance
    text = f"{name}: expected {_expected(err.validator_value, unit)}, got {_show(instance)}"
    if isinstance(instance, str):
        hint = value_hint(last_key, instance)
        if hint:
            text += f"; {hint}"
    elif isinstance(instance, bool) and "number" in str(err.validator_value):
        text += " (a boolean is not a number)"
    elif isinstance(instance, bool) and isinstance(err.schema, dict) and err.schema.get("enum"):
        text += (f"; allowed: {', '.join(_show(a) for a in err.schema['enum'])} (YAML reads an unquoted "
                 "yes/no/on/off as a boolean)")
    elif isinstance(err.schema, dict) and err.schema.get("enum"):  # (a number where a word belongs: a review)
        text += f"; allowed: {', '.join(_show(a) for a in err.schema['enum'])}"
    elif isinstance(instance, (int, float)) and "string" in str(err.validator_value):
        text += f" (a number; quote it, \"{_show(instance)}\", if it is a name)"
    elif isinstance(instance, float) and "integer" in str(err.validator_value) and instance.is_integer():
        write = f"; write {int(instance)}" if abs(instance) < 1e15 else ""
        text = (f"{name}: expected {_expected(err.validator_value, unit)}, got {instance!r} (written with a "
                f"decimal point or an exponent{write})")
    return text


def _enum_message(err: jsonschema.ValidationError, name: str) -> str:
    """Message for an ``enum`` error at ``name``: the allowed values, and a did-you-mean for text."""
    instance = err.instance
    allowed = err.validator_value
    text = f"{name}: {_show(instance)} is not allowed; allowed: {', '.join(_show(a) for a in allowed)}"
    if isinstance(instance, str):
        guess = _suggest(instance, allowed)
        if guess is not None:
            text += f" (did you mean {guess!r}?)"
    return text


def _schema_message(err: jsonschema.ValidationError) -> list[tuple[tuple, str, bool]]:
    """Turn one jsonschema error into ``(path, message, at_key)`` items."""
    path = tuple(err.absolute_path)
    name = dotted(path)
    schema = err.schema if isinstance(err.schema, dict) else {}
    unit = schema.get("x-unit")
    instance = err.instance
    kind = err.validator
    last_key = next((p for p in reversed(path) if isinstance(p, str)), "")
    if kind == "additionalProperties" and err.validator_value is False and isinstance(instance, dict):
        known = list(schema.get("properties", {}))
        extras = [k for k in instance if k not in known]
        where = dotted(path) if path else ""
        return [(path + (k,), unknown_key_message(str(k), known, instance[k], where), True) for k in extras]
    if kind == "type":
        return [(path, _type_message(err, name, unit, last_key), False)]
    if kind == "enum":
        return [(path, _enum_message(err, name), False)]
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kind]
        suffix = f" {unit}" if unit else ""
        bound = format_number(float(err.validator_value))
        shown = _show_against(instance, float(err.validator_value), op)
        return [(path, f"{name}: {shown}{suffix} is not allowed; must be {op} {bound}{suffix}", False)]
    if kind == "required":
        missing = [k for k in err.validator_value if isinstance(instance, dict) and k not in instance]
        hint = " (write version: 1)" if missing == ["version"] else ""
        return [(path, f"{name}: missing required key {k!r}{hint}", False) for k in missing]
    if kind == "pattern":
        what = _PATTERN_WORDS.get(last_key, f"text matching {err.validator_value}")
        return [(path, f"{name}: {_show(instance)} is not allowed; expected {what}", False)]
    if kind in ("minLength", "maxLength"):  # (it said "has a length outside maxLength 107": a try-out)
        bound = "at most" if kind == "maxLength" else "at least"
        length = f"{len(instance)} characters, " if isinstance(instance, str) else ""
        return [(path, f"{name}: {_show(instance)} is not allowed ({length}{bound} {err.validator_value} allowed)",
                 False)]
    if kind in ("maxItems", "minItems"):
        bound = "at most" if kind == "maxItems" else "at least"
        count = f"{len(instance)} items, " if isinstance(instance, list) else ""
        return [(path, f"{name}: {count}{bound} {err.validator_value} allowed", False)]
    return [(path, f"{name}: {err.message}", False)]


def _non_finite(data, path=()):
    """Yield paths of NaN/infinite floats anywhere in ``data``."""
    if isinstance(data, float) and not math.isfinite(data):
        yield path
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _non_finite(value, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _non_finite(value, path + (i,))


def _check_structure(data, diag: _Diag) -> None:
    if data is None:
        diag.error((), "empty policy; expected a mapping starting with version: 1")
        return
    bad_numbers = set()
    if isinstance(data, dict) and isinstance(data.get("version"), float):
        # JSON Schema counts 1.0 as an integer; docs/policy.md says the version is one: 1, never 1.0
        bad_numbers.add(("version",))
        diag.error(("version",), f"version: {data['version']!r} is not allowed; the format version is an "
                                 "integer: write version: 1")
    for path in _non_finite(data):
        bad_numbers.add(path)
        diag.error(path, f"{dotted(path)}: {_show(data_at(data, path))} is not allowed; give a finite number")
    found = []
    for err in _validator().iter_errors(data):
        if err.validator == "anyOf" and err.context:
            # domains: null or a domain; report what the domain alternative says.
            found.extend(e for e in err.context if e.validator != "type" or e.validator_value != "null")
        else:
            found.append(err)
    typed = {tuple(err.absolute_path) for err in found if err.validator == "type"}
    for err in found:
        path = tuple(err.absolute_path)
        if path in bad_numbers or (path in typed and err.validator != "type"):
            continue
        for epath, message, at_key in _schema_message(err):
            diag.error(epath, message, at_key=at_key)


def data_at(data, path):
    """Value at ``path`` inside ``data`` (None when absent)."""
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


# --------------------------------------------------------------------------------------------------
# Meaning


@dataclass
class _DomainDraft:
    path: tuple
    name: str
    kind: str
    limit_w: float | None
    gpu_model: str | None
    gpus_per_node: int | None
    nodes: list
    children: list


def _build_domains(data: dict, diag: _Diag, budget_w: float, device_min, device_max) -> model.Domain | None:
    """The checked domain tree of ``data`` (root limit set to ``budget_w`` [W]), or None when it
    lists more than MAX_TOTAL_NODES nodes. Every other problem is reported to ``diag``."""
    raw = data.get("domains") or {"name": "cluster", "kind": "cluster"}
    try:
        draft = _DomainBuilder(diag, device_min, device_max).visit(raw, ("domains",), None, None, 0)
    except _TooMany as too_many:
        diag.error(too_many.path, f"{dotted(too_many.path)}: more than {MAX_TOTAL_NODES} nodes in the policy")
        return None
    root_limit = draft.limit_w if draft.limit_w is not None else budget_w
    _check_limits(diag, draft, None, root_limit, draft.limit_w is not None)
    root = _freeze(draft)
    root = _replace(root, limit_w=float(budget_w))
    return root


class _DomainBuilder:
    """Turns the raw ``domains`` mapping into :class:`_DomainDraft` nodes, reporting to ``diag``.

    Tracks domain names (each used once) and node owners (each node in exactly one domain)
    across the whole tree; raises :class:`_TooMany` past MAX_TOTAL_NODES nodes.
    """

    def __init__(self, diag: _Diag, device_min, device_max) -> None:
        self.diag = diag
        self.device_min, self.device_max = device_min, device_max
        self.names: dict[str, tuple] = {}
        self.owner: dict[str, tuple[str, tuple]] = {}  # node -> (domain name, path of its expression)
        self.total = 0

    def expand(self, expr: str, expr_path: tuple, domain_name: str) -> list[str]:
        """Node names of hostlist ``expr`` (at ``expr_path``) not already listed; [] on an error.

        Raises _TooMany when the policy's node count passes MAX_TOTAL_NODES."""
        diag = self.diag
        text = expr.strip()
        if not text:
            diag.error(expr_path, f"{dotted(expr_path)}: empty hostlist expression; give node names like gpu[001-032]")
            return []
        try:
            names_ = hostlist.expand_hostlist(text, allow_duplicates=True)
        except hostlist.BadHostlist as err:
            limit = f" (at most {hostlist.MAX_SIZE} names per range)" if "too large" in str(err) else ""
            diag.error(expr_path, f"{dotted(expr_path)}: invalid hostlist expression {_show(expr)}: {err}{limit}")
            return []
        except (ValueError, OverflowError, MemoryError, RecursionError) as err:
            diag.error(expr_path, f"{dotted(expr_path)}: invalid hostlist expression {_show(expr)}: {err}")
            return []
        bad = [n for n in names_ if not _NODE_NAME.match(n)]
        if bad:
            diag.error(expr_path, f"{dotted(expr_path)}: {_show(bad[0])} is not a valid node name (letters, digits, . _ -; no spaces)")
            return []
        self.total += len(names_)
        if self.total > MAX_TOTAL_NODES:
            raise _TooMany(expr_path)
        return self._claim(names_, expr_path, domain_name)

    def _claim(self, nodes: list[str], expr_path: tuple, domain_name: str) -> list[str]:
        """Record ``nodes`` as owned by ``domain_name``; report the ones listed before (one error
        per earlier expression). Returns the nodes not listed before, in order."""
        taken: dict[tuple, list[str]] = {}
        fresh = []
        for node in nodes:
            if node in self.owner:
                taken.setdefault(self.owner[node], []).append(node)
            else:
                self.owner[node] = (domain_name, expr_path)
                fresh.append(node)
        for (other, other_path), dup in taken.items():
            line, col = self.diag.positions.value(other_path)
            shown = hostlist.collect_hostlist(dup)
            where = "earlier in this domain" if other == domain_name else f"in domain {other!r}"
            self.diag.error(
                expr_path,
                f"{dotted(expr_path)}: node{'s' if len(dup) > 1 else ''} {shown} already listed {where} "
                f"(line {line}, col {col}); each node belongs to exactly one domain",
            )
        return fresh

    def visit(self, raw_domain: dict, path: tuple, parent_model, parent_gpus, depth: int) -> _DomainDraft:
        """Draft of ``raw_domain`` at ``path`` (``depth`` 0 = root) and, recursively, its children;
        ``gpu_model`` and ``gpus_per_node`` are inherited from the parent when absent or null."""
        name = raw_domain["name"]
        kind = self._name_and_kind(raw_domain, path, depth)
        gpu_model = self._gpu_model(raw_domain, path, parent_model)
        gpus = raw_domain.get("gpus_per_node")
        if gpus is None:  # absent or null: inherited
            gpus = parent_gpus
        raw_nodes = raw_domain.get("nodes")
        nodes = self._nodes(raw_domain, path, kind)
        children = [
            self.visit(child, path + ("children", i), gpu_model, gpus, depth + 1)
            for i, child in enumerate(raw_domain.get("children") or [])
        ]
        if depth > 0 and not raw_nodes and not children and kind != "node":  # (``nodes: []`` too: a review)
            self.diag.warn(path, f"{dotted(path)}: domain {name!r} holds no nodes")
        return _DomainDraft(path, name, kind, raw_domain.get("limit_w"), gpu_model, gpus, nodes, children)

    def _name_and_kind(self, raw_domain: dict, path: tuple, depth: int) -> str:
        """Check the domain's name is unused and its kind allowed here; returns the kind (the root
        defaults to 'cluster'; a missing kind elsewhere is an error, then treated as 'rack')."""
        diag = self.diag
        name = raw_domain["name"]
        if name in self.names:
            line, col = diag.positions.value(self.names[name] + ("name",))
            diag.error(path + ("name",), f"{dotted(path + ('name',))}: domain name {name!r} already used (line {line}, col {col})")
        else:
            self.names[name] = path
        kind = raw_domain.get("kind")
        if kind is None:
            if depth == 0:
                kind = "cluster"
            else:
                diag.error(path, f"{dotted(path)}: domain {name!r} needs a kind; allowed: {', '.join(model.DOMAIN_KINDS[1:])}")
                kind = "rack"
        elif kind == "cluster" and depth > 0:
            diag.error(path + ("kind",), f"{dotted(path + ('kind',))}: only the root domain may be of kind 'cluster'; allowed here: {', '.join(model.DOMAIN_KINDS[1:])}")
        return kind

    def _gpu_model(self, raw_domain: dict, path: tuple, parent_model: str | None) -> str | None:
        """The domain's GPU model (inherited when absent or null); warns on one given here whose
        device limits are unknown."""
        gpu_model = raw_domain.get("gpu_model")
        if gpu_model is None:  # absent or null: inherited
            gpu_model = parent_model
        if "gpu_model" in raw_domain and gpu_model is not None:
            low, high = device_limits_w(gpu_model, self.device_min, self.device_max)
            if low is None and high is None:
                guess = model_suggestion(gpu_model)
                hint = f"; if these are {guess} boards, write gpu_model: {guess}" if guess else ""
                self.diag.warn(
                    path + ("gpu_model",),
                    f"{dotted(path + ('gpu_model',))}: unknown GPU model {gpu_model!r}: device-limit checks skipped "
                    f"(known: {', '.join(KNOWN_DEVICE_LIMITS_W)}, also by their NVML names, e.g. "
                    f"'{next(iter(KNOWN_NVML_NAMES))}'){hint}",
                )
        return gpu_model

    def _nodes(self, raw_domain: dict, path: tuple, kind: str) -> list[str]:
        """The domain's own nodes (hostlist string or list of them); a 'node' domain holds exactly
        one node (its name when ``nodes`` is absent) and no children."""
        diag = self.diag
        name = raw_domain["name"]
        raw_nodes = raw_domain.get("nodes")
        errors_before = len(diag.errors)
        nodes: list[str] = []
        if isinstance(raw_nodes, str):
            nodes = self.expand(raw_nodes, path + ("nodes",), name)
        elif isinstance(raw_nodes, list):
            for i, expr in enumerate(raw_nodes):
                nodes.extend(self.expand(expr, path + ("nodes", i), name))
        if kind == "node":
            if raw_domain.get("children"):
                diag.error(path + ("children",), f"{dotted(path + ('children',))}: a domain of kind 'node' cannot have child domains")
            if raw_nodes is None:
                nodes = self.expand(name, path + ("name",), name)
            elif len(nodes) != 1 and len(diag.errors) == errors_before:
                diag.error(path + ("nodes",), f"{dotted(path + ('nodes',))}: a domain of kind 'node' holds exactly one node, got {len(nodes)}")
        return nodes


def _check_limits(diag: _Diag, d: _DomainDraft, bound: tuple[float, str] | None, root_limit, root_given: bool) -> None:
    """Report child limits [W] above an enclosing domain's ``bound`` (limit, name) and warn where
    the children's limits sum below their parent's. ``root_limit``: the root's effective limit
    (its limit_w, else budget_w); ``root_given``: whether the root has its own limit_w."""
    own = d.limit_w if d.path != ("domains",) else root_limit
    if d.path != ("domains",) and own is not None and bound is not None and own > bound[0]:
        diag.error(
            d.path + ("limit_w",),
            f"{dotted(d.path + ('limit_w',))}: {format_number(own)} W is above the limit of enclosing domain "
            f"{bound[1]!r} ({format_number(bound[0])} W); a child limit must not exceed its parent's",
        )
    if own is not None:
        bound = (own, d.name)
    child_limits = [c.limit_w for c in d.children]
    if d.children and not d.nodes and all(x is not None for x in child_limits) and own is not None:
        total = sum(child_limits)
        if total < own:
            where = d.path + ("limit_w",) if d.path != ("domains",) or root_given else ("budget_w",)
            diag.warn(
                where,
                f"{dotted(where)}: {format_number(own)} W can never be reached: the limits of domain "
                f"{d.name!r}'s children sum to {format_number(total)} W",
            )
    for child in d.children:
        _check_limits(diag, child, bound, root_limit, root_given)


def _freeze(d: _DomainDraft) -> model.Domain:
    """The immutable :class:`model.Domain` tree of draft ``d`` (limits in watts as floats)."""
    return model.Domain(
        name=d.name,
        kind=d.kind,
        limit_w=float(d.limit_w) if d.limit_w is not None else None,
        children=tuple(_freeze(c) for c in d.children),
        nodes=tuple(d.nodes),
        gpu_model=d.gpu_model,
        gpus_per_node=int(d.gpus_per_node) if d.gpus_per_node is not None else None,
    )


class _TooMany(Exception):
    def __init__(self, path: tuple) -> None:
        self.path = path


def _replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def _f(value, default):
    return float(value) if value is not None else default


def _check_meaning(data: dict, diag: _Diag, source: str, device_min, device_max) -> model.Policy | None:
    """Stage 2 (module docstring) on structurally valid ``data``: the Policy, or None with the
    errors reported to ``diag``. ``device_min`` / ``device_max``: GPU model -> watts overrides."""
    domains_raw = data.get("domains") or {}
    root_limit = domains_raw.get("limit_w")
    budget_w = _check_budget(data, diag, root_limit)
    interval_s, lease_s = _check_lease(data, diag)
    min_cap_w = data.get("min_cap_w")
    caps = _check_cap_order(data, diag)

    root = _build_domains(data, diag, float(budget_w), device_min, device_max)
    if root is None:
        return None
    _check_device_limits(data, diag, root, caps, device_min, device_max)
    _check_minimums(data, diag, root, min_cap_w, device_min)
    socket_path = _check_socket_path(data, diag)
    _check_coordinator_address(data, diag)
    _check_etcd(data, diag, interval_s, lease_s)
    if diag.errors:
        return None
    return _make_policy(data, source, budget_w, root, interval_s, lease_s, root_limit, socket_path)


def _check_budget(data: dict, diag: _Diag, root_limit) -> float:
    """The cluster budget [W]: budget_w, else the root domain's limit_w [W] (``root_limit``).

    Reports a missing budget (then 1.0 stands in) and a budget above the root limit."""
    budget_w = data.get("budget_w")
    if budget_w is None and root_limit is None:
        diag.error((), "missing budget_w: the cluster power budget in watts (or give domains.limit_w)")
        budget_w = 1.0
    elif budget_w is None:
        budget_w = root_limit
    elif root_limit is not None and budget_w > root_limit:
        diag.error(
            ("budget_w",),
            f"budget_w: {format_number(budget_w)} W is above the root domain limit_w {format_number(root_limit)} W",
        )
    return budget_w


def _check_lease(data: dict, diag: _Diag) -> tuple[float, float]:
    """(interval_s, lease_s) in seconds with their defaults (5 s; max(30 s, 3 intervals)).

    Reports a lease not longer than the interval; warns on one shorter than two intervals."""
    interval_s = _f(data.get("interval_s"), 5.0)
    failsafe = data.get("failsafe") or {}
    lease_s = _f(failsafe.get("lease_s"), max(30.0, 3 * interval_s))
    lease_path = ("failsafe", "lease_s") if "lease_s" in failsafe else ("interval_s",)
    if lease_s <= interval_s:
        diag.error(
            lease_path,
            f"{dotted(lease_path)}: lease_s {exact_number(lease_s)} s must be longer than interval_s "
            f"{exact_number(interval_s)} s (agents would fall back to their safe cap between two plans)",
        )
    elif lease_s < 2 * interval_s:
        diag.warn(
            lease_path,
            f"{dotted(lease_path)}: lease_s {exact_number(lease_s)} s is less than two intervals "
            f"({exact_number(2 * interval_s)} s): one late plan makes agents fall back",
        )
    return interval_s, lease_s


def _check_cap_order(data: dict, diag: _Diag) -> dict:
    """The policy's caps, JSON path -> watts (None when absent; start_cap_w defaults to 300 W).

    Reports every cap below min_cap_w."""
    min_cap_w = data.get("min_cap_w")
    failsafe = data.get("failsafe") or {}
    caps = {
        ("min_cap_w",): min_cap_w,
        ("start_cap_w",): _f(data.get("start_cap_w"), 300.0),
        ("idle_cap_w",): data.get("idle_cap_w"),
        ("failsafe", "safe_cap_w"): failsafe.get("safe_cap_w"),
    }
    if min_cap_w is not None:
        for path, value in caps.items():
            if path != ("min_cap_w",) and value is not None and value < min_cap_w:
                where = path if data_at(data, path) is not None else ("min_cap_w",)
                diag.error(
                    where,
                    f"{dotted(path)}: {format_number(value)} W is below min_cap_w {format_number(min_cap_w)} W",
                )
    return caps


def _check_device_limits(data: dict, diag: _Diag, root: model.Domain, caps: dict, device_min, device_max) -> None:
    """Check ``caps`` (path -> watts, from :func:`_check_cap_order`) against the device limits of
    every GPU model in the tree: below a minimum or min_cap_w above a maximum is an error, another
    cap above a maximum a warning (agents clamp it)."""
    seen_models = []
    for d in root.walk():
        if d.gpu_model and d.gpu_model not in seen_models:
            seen_models.append(d.gpu_model)
    for gpu_model in seen_models:
        low, high = device_limits_w(gpu_model, device_min, device_max)
        for path, value in caps.items():
            if value is None:
                continue
            where = path if data_at(data, path) is not None else ()
            if low is not None and value < low:
                diag.error(
                    where,
                    f"{dotted(path)}: {format_number(value)} W is below the minimum cap {format_number(low)} W "
                    f"of {gpu_model} (NVML power limit constraints)",
                )
            if high is not None and value > high:
                if path == ("min_cap_w",):
                    diag.error(
                        where,
                        f"min_cap_w: {format_number(value)} W is above the maximum cap {format_number(high)} W of {gpu_model}",
                    )
                else:
                    diag.warn(
                        where,
                        f"{dotted(path)}: {format_number(value)} W is above the maximum cap {format_number(high)} W "
                        f"of {gpu_model}; agents clamp it to {format_number(high)} W",
                    )


def _check_minimums(data: dict, diag: _Diag, root: model.Domain, min_cap_w, device_min) -> None:
    """Report every domain whose limit [W] is below the sum of its GPUs' minimum caps (infeasible)."""
    paths: dict | None = None  # domain name -> its JSON path, built on the first error (once: a
    # search per error made 12,500 bad node limits take 2.5 min, found by a review)
    for d in root.walk():
        limit = d.limit_w
        if limit is None:
            continue
        floor_w = minimum_w(d, min_cap_w, device_min)
        if floor_w is not None and floor_w > limit:
            if d is root:
                where = ("budget_w",) if "budget_w" in data else ("domains", "limit_w")
            else:
                paths = _domain_paths(data) if paths is None else paths
                where = paths.get(d.name, ("domains",)) + ("limit_w",)
            gpus = sum(len(s.nodes) * (s.gpus_per_node or 0) for s in d.walk())
            diag.error(
                where,
                f"{dotted(where)}: {format_number(limit)} W is below the sum of minimum caps of domain "
                f"{d.name!r}: {gpus} GPUs need {format_number(floor_w)} W (deficit {format_number(floor_w - limit)} W)",
            )


def _check_socket_path(data: dict, diag: _Diag) -> str:
    """The agent socket path (default model.DEFAULT_SOCKET_PATH); reports % escapes other than
    %n (node name) and %%."""
    agent = data.get("agent") or {}
    socket_path = agent.get("socket_path", model.DEFAULT_SOCKET_PATH)
    bad_escape = re.search(r"%(?:[^n%]|$)", re.sub(r"%[n%]", "", socket_path))
    if bad_escape:
        diag.error(
            ("agent", "socket_path"),
            f"agent.socket_path: {_show(socket_path)} contains {bad_escape.group(0)!r}; allowed: %n (node name) and %%",
        )
    return socket_path


def _check_coordinator_address(data: dict, diag: _Diag) -> None:
    """Report a ``coordinator.address`` the CLI and the agents would refuse (a port outside
    1..65535, a unix path over 107 bytes): the same rule, :func:`capctl.addresses.check_address`."""
    address = (data.get("coordinator") or {}).get("address")
    if address is None:
        return
    try:
        check_address(address, "coordinator.address")
    except UserInputError as err:
        diag.error(("coordinator", "address"), str(err))


def _check_etcd(data: dict, diag: _Diag, interval_s: float, lease_s: float) -> None:
    """Warn about a ``coordinator.etcd`` block the coordinator would refuse or that makes every
    failover a fallback (docs/ha.md):

    - an ``http://`` member that is not loopback: the coordinator refuses clear text to etcd over
      the network unless started with ``--insecure`` (:func:`coordinator.etcdconn.check_tls`);
    - ``failsafe.lease_s`` (s) not longer than ``lease_ttl_s + 2 x interval_s`` (s): a failover
      takes up to that long, so the agents' leases run out first and they fall back to safe caps.
    """
    from urllib.parse import urlsplit

    from capctl.security.plaintext import is_local

    etcd = (data.get("coordinator") or {}).get("etcd")
    if not etcd:
        return
    for i, raw in enumerate(etcd.get("endpoints") or []):
        try:
            url = urlsplit(str(raw))
            url.port  # noqa: B018 (an unclosed IPv6 bracket, a bad port: ValueError, a traceback before)
        except ValueError as err:
            diag.error(("coordinator", "etcd", "endpoints", i),
                       f"coordinator.etcd.endpoints[{i}]: {raw!r} is no URL ({err}); expected http(s)://HOST:PORT")
            continue
        if url.scheme == "http" and not is_local(url.netloc):
            diag.warn(("coordinator", "etcd", "endpoints", i),
                      f"coordinator.etcd.endpoints[{i}]: {raw!r} is clear text to etcd over the network: the "
                      "coordinator refuses it unless started with --insecure; use https:// members (docs/ha.md)")
    ttl_s = float(etcd.get("lease_ttl_s", model.EtcdPolicy.lease_ttl_s))
    takeover_s = ttl_s + 2 * interval_s
    if lease_s <= takeover_s:
        path = ("coordinator", "etcd", "lease_ttl_s") if "lease_ttl_s" in etcd else ("coordinator", "etcd")
        diag.warn(path, f"coordinator.etcd.lease_ttl_s: {format_number(ttl_s)} s + 2 intervals = "
                        f"{format_number(takeover_s)} s is not shorter than failsafe.lease_s {format_number(lease_s)} s: "
                        "a failover outlasts the agents' lease and every agent falls back to its safe cap")


def _make_policy(data: dict, source: str, budget_w, root: model.Domain, interval_s: float, lease_s: float,
                 root_limit, socket_path: str) -> model.Policy:
    """The :class:`model.Policy` of checked ``data`` with its defaults filled in (watts, seconds)."""
    failsafe = data.get("failsafe") or {}
    agent = data.get("agent") or {}
    weights = data.get("weights") or {}
    thermal = data.get("thermal") or {}
    prolog = data.get("prolog") or {}
    coordinator = data.get("coordinator") or {}
    metrics = data.get("metrics") or {}
    models = data.get("models") or {}
    return model.Policy(
        version=1,
        budget_w=float(budget_w),
        domains=root,
        interval_s=interval_s,
        objective=data.get("objective", "proportional"),
        thermal=model.ThermalPolicy(margin_c=_f(thermal.get("margin_c"), 5.0)),
        slew_w=_f(data.get("slew_w"), None),
        idle_cap_w=_f(data.get("idle_cap_w"), None),
        reserve_pre_job_limits=bool(data.get("reserve_pre_job_limits", False)),
        spread_spare_watts=bool(data.get("spread_spare_watts", False)),
        start_cap_w=_f(data.get("start_cap_w"), 300.0),
        min_cap_w=_f(data.get("min_cap_w"), None),
        failsafe=model.FailsafePolicy(lease_s=lease_s, safe_cap_w=_f(failsafe.get("safe_cap_w"), None)),
        prolog=model.PrologPolicy(
            on_unreachable=prolog.get("on_unreachable", "fail-open"), timeout_s=_f(prolog.get("timeout_s"), 5.0)
        ),
        dry_run=bool(data.get("dry_run", False)),
        weights=model.Weights(
            default=_f(weights.get("default"), 1.0),
            partitions=MappingProxyType({str(k): float(v) for k, v in (weights.get("partitions") or {}).items()}),
            accounts=MappingProxyType({str(k): float(v) for k, v in (weights.get("accounts") or {}).items()}),
            qos=MappingProxyType({str(k): float(v) for k, v in (weights.get("qos") or {}).items()}),
        ),
        agent=model.AgentPolicy(socket_path=socket_path, socket_group=agent.get("socket_group")),
        coordinator=model.CoordinatorPolicy(
            address=coordinator.get("address", model.DEFAULT_COORDINATOR_ADDRESS),
            admin_group=coordinator.get("admin_group"),
            status_group=coordinator.get("status_group"),
            etcd=_etcd_policy(coordinator.get("etcd")),
        ),
        metrics=model.MetricsPolicy(per_gpu_series=metrics.get("per_gpu_series", "auto"),
                                    all_up_to_gpus=int(metrics.get("all_up_to_gpus", 4096))),
        models=model.ModelsPolicy(memory_bound_share=models.get("memory_bound_share", "estimate")),
        budget_ceiling_w=_f(root_limit, None),
        source=source,
    )


def _etcd_policy(etcd: dict | None):
    """``coordinator.etcd`` (validated by the schema) as a :class:`model.EtcdPolicy`, or None."""
    if not etcd:
        return None
    return model.EtcdPolicy(endpoints=tuple(str(e) for e in etcd["endpoints"]), prefix=str(etcd.get("prefix", "/capctl")),
                            lease_ttl_s=int(etcd.get("lease_ttl_s", model.EtcdPolicy.lease_ttl_s)))


def _domain_paths(data: dict) -> dict[str, tuple]:
    """Domain name -> JSON path of the domain of that name in the raw data (the first one met)."""
    out: dict[str, tuple] = {}
    stack = [(("domains",), data.get("domains") or {})]
    while stack:
        path, raw = stack.pop()
        out.setdefault(raw.get("name"), path)
        for i, child in enumerate(raw.get("children") or []):
            stack.append((path + ("children", i), child))
    return out


# --------------------------------------------------------------------------------------------------
# Public entry points


def check_text(
    text: str,
    source: str = "<string>",
    *,
    device_min_cap_w: Mapping[str, float] | None = None,
    device_max_cap_w: Mapping[str, float] | None = None,
) -> Report:
    """Check policy YAML ``text`` (named ``source`` in messages); never raises for bad input.

    ``device_min_cap_w`` / ``device_max_cap_w`` map GPU model -> watts and override
    :data:`capctl.policy.devices.KNOWN_DEVICE_LIMITS_W`.
    """
    report = Report(source=source)
    try:
        data, positions = load_with_positions(text)
    except YamlInputError as err:
        report.errors.append(f"{source}:{err.line}:{err.col}: {err.message}")
        return report
    diag = _Diag(source, positions)
    _check_structure(data, diag)
    policy = None
    if not diag.errors and isinstance(data, dict):
        policy = _check_meaning(data, diag, source, device_min_cap_w, device_max_cap_w)
    report.errors, report.warnings = diag.lines()
    if policy is not None and not report.errors:
        report.policy = _replace(policy, warnings=tuple(report.warnings))
    return report


_CONTROL = re.compile("[\x00-\x1f\x7f]")


def display_name(path) -> str:
    """``path`` as messages name it: its control characters written as escapes (a file name with a
    newline split error lines and the coordinator's log records in two; found by a review)."""
    text = str(path)
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text) if _CONTROL.search(text) else text


def read_policy_text(path) -> str:
    """Read a policy file as UTF-8 text. Raises :class:`PolicyError` (one line) when it cannot:
    missing, unreadable, not a regular file (a directory, FIFO, socket or device), over
    :data:`MAX_FILE_BYTES` or not UTF-8."""
    name = display_name(path)
    try:
        raw = read_regular_file(path, MAX_FILE_BYTES)  # a FIFO or device is refused, never waited on
    except OSError as err:
        raise PolicyError([f"{name}: cannot read the policy file: {err.strerror or err}"]) from None
    except ValueError as err:  # e.g. embedded NUL in the path
        raise PolicyError([f"{name!r}: cannot read the policy file: {err}"]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise PolicyError([f"{name}: policy file larger than {MAX_FILE_BYTES} bytes"])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        col = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise PolicyError([f"{name}:{line}:{col}: not UTF-8 text (byte 0x{raw[err.start]:02x})"]) from None


def check_file(path, **device_limits) -> Report:
    """Like :func:`check_text` for the file at ``path``; unreadable files give one error line."""
    try:
        text = read_policy_text(path)
    except PolicyError as err:
        return Report(source=display_name(path), errors=err.errors)
    return check_text(text, display_name(path), **device_limits)


def parse_policy(
    text: str,
    source: str = "<string>",
    *,
    device_min_cap_w: Mapping[str, float] | None = None,
    device_max_cap_w: Mapping[str, float] | None = None,
) -> model.Policy:
    """Parse and validate policy YAML ``text``.

    Returns:
        the :class:`~capctl.policy.model.Policy` (warnings in ``policy.warnings``).
    Raises:
        PolicyError: with every error as ``"source:line:col: message"``.
    """
    report = check_text(text, source, device_min_cap_w=device_min_cap_w, device_max_cap_w=device_max_cap_w)
    if report.policy is None:
        raise PolicyError(report.errors or [f"{source}: invalid policy"], report.warnings)
    return report.policy


def load_policy(path, **device_limits) -> model.Policy:
    """Read, parse and validate the policy file at ``path`` (str or PathLike).

    Keyword arguments: ``device_min_cap_w`` / ``device_max_cap_w`` as in :func:`parse_policy`.
    Raises:
        PolicyError: unreadable file (one line) or invalid policy (one line per error).
    """
    return parse_policy(read_policy_text(path), display_name(path), **device_limits)


def validate_file(path, **device_limits) -> list[str]:
    """Return the errors of the policy file at ``path`` as ``"file:line:col: message"`` lines
    (empty when valid). Never raises for bad input. Keyword arguments as in :func:`parse_policy`."""
    return check_file(path, **device_limits).errors
