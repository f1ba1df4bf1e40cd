"""Read YAML into plain Python data while keeping the line:col of every key and value.

PyYAML composes the document into nodes that carry start marks; this module turns those nodes into
dicts/lists/scalars (with the safe loader's scalar rules) and records, for each JSON path
(a tuple of keys and list indexes), where its value and its key start. Positions are 1-based.

Bounds (a policy is small; anything bigger is an error, never a hang): at most
:data:`MAX_NODES` YAML nodes after alias expansion and a nesting depth of :data:`MAX_DEPTH`.

Numbers: YAML 1.1 (PyYAML) silently reads ``020000`` as octal (8192), ``1:30`` as base 60 (90),
``0x1000`` as hexadecimal and ``1_000`` as 1000 (YAML 1.2: the text "1_000"), and ``2e4`` (no dot)
as text. The loader here reads plain decimal integers and YAML 1.2 floats (``2e4``, ``1.5e3``,
``.5``, ``.inf``) and refuses a plain scalar that a person or another YAML version would read
differently (a leading zero, base 60, a ``0x``/``0o``/``0b`` prefix, ``_`` between digits) with an
error naming the key, the value as written and what to write. Quoted text is never a number. :func:`read_regular_file` reads the files these come from.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
from dataclasses import dataclass, field

import yaml

from capctl.policy.units import UNIT_NAMES, format_number, is_finite, key_unit

MAX_NODES = 500_000
"""Largest number of YAML nodes (after alias expansion) accepted in one document."""

MAX_DEPTH = 64
"""Deepest nesting of mappings/sequences accepted."""

Path = tuple
"""A JSON path: tuple of mapping keys (str) and sequence indexes (int)."""


class YamlInputError(Exception):
    """Malformed YAML or a document outside the bounds; ``line``/``col`` are 1-based."""

    def __init__(self, message: str, line: int, col: int) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.col = col


@dataclass
class Positions:
    """Where each path's value (``values``) and key (``keys``) start, as 1-based (line, col)."""

    values: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)

    def value(self, path: Path) -> tuple[int, int]:
        """Position of the value at ``path``, or of its nearest ancestor present in the document."""
        path = tuple(path)
        while path and path not in self.values:
            path = path[:-1]
        return self.values.get(path, (1, 1))

    def key(self, path: Path) -> tuple[int, int]:
        """Position of the key naming ``path`` (falls back to the value's position)."""
        path = tuple(path)
        return self.keys.get(path) or self.value(path)


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"
AMBIGUOUS_NUMBER_TAG = "tag:capctl,2024:ambiguous-number"
"""Tag the loader gives a plain scalar refused as a number (see the module docstring)."""

_KEY = "\0key"
"""Path component under which a mapping key is built (keys are names: taken as written)."""

_DECIMAL_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$")
_DECIMAL_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+[eE][-+]?[0-9]+
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
_AMBIGUOUS_NUMBER = re.compile(r"""^[-+]?(?:0[0-9_]+
    |0[xXoObB][0-9a-fA-F_]+
    |[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?
    |(?=[0-9._]*_)(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?)$""", re.X)
"""Plain scalars refused as numbers: a leading zero, a 0x/0o/0b prefix, base 60, and digits with
``_`` separators (YAML 1.1 reads ``1_000`` as 1000, YAML 1.2 as the text "1_000")."""


class _Loader(yaml.SafeLoader):
    """Safe loader with the number rules of the module docstring; only scalar construction is used."""

    prefixed_ints = False
    """Read 0x/0o/0b integers (see :func:`load_with_positions`)."""
    composed = 0
    """YAML nodes composed so far (:meth:`compose_node`)."""

    def compose_node(self, parent, index):
        """Count each node as it is composed, and stop past :data:`MAX_NODES`: the count after
        alias expansion (:func:`_build`) came only once the whole document was composed, so a
        2 MB flow list of a million items took 38 s and 789 MB before "document too large" (a
        file at the 16 MiB cap: minutes and gigabytes; found by a review)."""
        self.composed += 1
        if self.composed > MAX_NODES:
            mark = self.peek_event().start_mark
            raise YamlInputError(f"document too large (more than {MAX_NODES} YAML nodes)", mark.line + 1,
                                 mark.column + 1)
        return super().compose_node(parent, index)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag not in (INT_TAG, FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(AMBIGUOUS_NUMBER_TAG, _AMBIGUOUS_NUMBER, list("-+0123456789."))
_Loader.add_implicit_resolver(INT_TAG, _DECIMAL_INT, list("-+0123456789"))
_Loader.add_implicit_resolver(FLOAT_TAG, _DECIMAL_FLOAT, list("-+0123456789."))


def dotted(path) -> str:
    """Render a JSON path as ``domains.children[0].limit_w`` (``<policy>`` for the root)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<policy>"


def _meant(text: str) -> tuple[str, float | None]:
    """(why ``text`` (an ambiguous number) is refused, the number its notation stands for or None)."""
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-").replace("_", "")
    try:
        if ":" in digits:
            value = 0.0
            for part in digits.split(":"):
                value = value * 60 + float(part)
            return f"YAML 1.1 reads {text} as a base-60 number ({format_number(sign * value)})", sign * value
        if digits[1:2].isalpha():
            names = {"x": "a hexadecimal", "o": "an octal", "b": "a binary"}
            return f"{names[digits[1].lower()]} number ({digits[:2]} prefix)", sign * int(digits, 0)
        if "_" in text and not (digits[:1] == "0" and digits[1:2].isdigit()):
            value = sign * (int(digits) if digits.isdigit() else float(digits))
            why = f"YAML 1.1 reads {text} as {format_number(value)}, YAML 1.2 as text (no _ in YAML 1.2 numbers)"
            return why, value
        decimal = sign * int(digits)
        if set(digits) <= set("01234567"):
            read = f"a leading 0 as octal ({format_number(sign * int(digits, 8))})"
        else:
            read = f"{text} as text"
        return f"YAML 1.1 reads {read}, YAML 1.2 as decimal ({format_number(decimal)})", decimal
    except (ValueError, KeyError):
        return "not a plain decimal number", None


def ambiguous_number_message(path, text: str) -> str:
    """Message for the plain scalar ``text`` at JSON ``path`` refused as a number (its notation is
    read differently by YAML 1.1, YAML 1.2 and people): names the key, the value as written and what
    is allowed, with the decimal form of what the notation stands for as the example."""
    key = next((p for p in reversed(tuple(path)) if isinstance(p, str)), "")
    unit = key_unit(key)
    why, value = _meant(text)
    shown = text if len(text) <= 40 else f"{text[:37]}... ({len(text)} characters)"
    why = why.replace(text, shown)
    if key in TEXT_KEYS:  # (a name: the number to write was refused as "expected a string", a try-out)
        return f"{dotted(path)}: {shown} is not allowed: {why}; allowed: text, quoted: \"{shown}\""
    allowed = f"a plain decimal number of {UNIT_NAMES[unit]}" if unit else "a plain decimal number"
    example = f", e.g. {format_number(value)}" if value is not None and is_finite(value) else ""
    tail = "" if unit or key in NUMBER_KEYS else f" (or quote it, \"{shown}\", if it is text)"
    return f"{dotted(path)}: {shown} is not allowed: {why}; allowed: {allowed}{example}{tail}"


TEXT_KEYS = frozenset({"name", "kind", "nodes", "gpu_model", "socket_path", "default_qos", "partition", "account"})
"""Keys whose value is text in every file read here (policy, cluster, device profile): an ambiguous
number there is to be quoted, not rewritten."""
NUMBER_KEYS = frozenset({"version", "gpus_per_node", "seed", "all_up_to_gpus", "count", "occupancy"})
"""Keys without a unit suffix whose value is a number: quoting one is no way out."""


def load_with_positions(text: str, *, prefixed_ints: bool = False) -> tuple[object, Positions]:
    """Parse one YAML document; return ``(data, positions)``.

    ``prefixed_ints``: read ``0x``/``0o``/``0b`` integers as the numbers they write (a device
    profile's PCI id) instead of refusing them; a leading zero and base 60 are refused either way.

    An empty document gives ``None``. Raises :class:`YamlInputError` for malformed YAML, several
    documents, duplicate keys, non-scalar or non-string keys, recursive aliases, a number written
    in a notation the module docstring refuses, or a document over :data:`MAX_NODES` / :data:`MAX_DEPTH`.
    """
    positions = Positions()
    loader = None
    try:
        try:
            loader = _Loader(text)
            loader.prefixed_ints = prefixed_ints
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            problem = err.problem or err.context or "malformed YAML"
            if err.context and err.problem:
                problem = f"{err.context}: {err.problem}"
                cm = err.context_mark
                if cm is not None and err.problem_mark is not None and cm.line != err.problem_mark.line:
                    # the mistake is usually where the construct opened (an unclosed "[", a quote)
                    problem = f"{problem} (the construct began at line {cm.line + 1}:{cm.column + 1})"
            raise YamlInputError(f"malformed YAML: {problem}", line, col) from None
        except yaml.reader.ReaderError as err:
            before = text[: err.position]
            line = before.count("\n") + 1
            col = err.position - (before.rfind("\n") + 1) + 1
            raise YamlInputError(f"malformed YAML: character {chr(err.character)!r} is not allowed in YAML text", line, col) from None
        except yaml.YAMLError as err:
            raise YamlInputError(f"malformed YAML: {err}", 1, 1) from None
        except RecursionError:
            raise YamlInputError(f"document nested deeper than {MAX_DEPTH} levels", 1, 1) from None
        if root is None:
            return None, positions
        counter = [0]
        data = _build(loader, root, (), positions, counter, set(), 0)
        return data, positions
    finally:
        if loader is not None:
            loader.dispose()


def _ambiguous(loader, node, path):
    """The value of a plain scalar tagged :data:`AMBIGUOUS_NUMBER_TAG`: a key's text as written, a
    prefixed integer where the loader takes them; raises :class:`YamlInputError` otherwise."""
    if path and path[-1] == _KEY:
        return node.value  # a key is a name (a partition called 0100)
    if loader.prefixed_ints and node.value.lstrip("+-")[1:2].isalpha():
        try:
            return int(node.value.replace("_", ""), 0)
        except ValueError:
            pass
    raise YamlInputError(ambiguous_number_message(path, node.value), *_mark(node))


def _build(loader, node, path, positions, counter, active, depth):
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise YamlInputError(f"document too large (more than {MAX_NODES} YAML nodes after expanding aliases)", *_mark(node))
    if depth > MAX_DEPTH:
        raise YamlInputError(f"document nested deeper than {MAX_DEPTH} levels", *_mark(node))
    positions.values.setdefault(path, _mark(node))
    if isinstance(node, yaml.ScalarNode):
        if node.tag == AMBIGUOUS_NUMBER_TAG or (node.tag in (INT_TAG, FLOAT_TAG)
                                                and _AMBIGUOUS_NUMBER.match(node.value.strip())):
            # (an explicit ``!!int 0x10`` too: it was read as 16, found by a review)
            return _ambiguous(loader, node, path)
        try:
            value = loader.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            raise YamlInputError(f"cannot read value: {getattr(err, 'problem', None) or err}", *_mark(node)) from None
        except (ValueError, OverflowError, TypeError) as err:
            shown = node.value if len(node.value) <= 40 else node.value[:37] + "..."
            reason = str(err).split(";")[0]
            raise YamlInputError(f"cannot read value {shown!r}: {reason}", *_mark(node)) from None
        if isinstance(value, float) and math.isinf(value) and "inf" not in node.value.lower():
            raise YamlInputError(f"{dotted(path)}: {node.value} is not allowed: too large for a number (it reads "
                                 "as infinity); give a finite number", *_mark(node))
        return value
    if id(node) in active:
        raise YamlInputError("recursive YAML alias", *_mark(node))
    active.add(id(node))
    try:
        if isinstance(node, yaml.SequenceNode):
            return [
                _build(loader, item, path + (i,), positions, counter, active, depth + 1)
                for i, item in enumerate(node.value)
            ]
        if isinstance(node, yaml.MappingNode):
            result: dict = {}
            for key_node, value_node in _merged_pairs(node, active):
                key = _build(loader, key_node, path + (_KEY,), Positions(), counter, active, depth + 1)
                if not isinstance(key, str):
                    # YAML reads `1:`, `true:`, `null:` as non-strings; policy keys are names.
                    key = key_node.value
                if key in result:
                    continue  # a merged key (<<) the mapping's own keys or an earlier merged mapping gave
                positions.keys[path + (key,)] = _mark(key_node)
                result[key] = _build(loader, value_node, path + (key,), positions, counter, active, depth + 1)
            return result
    finally:
        active.discard(id(node))
    raise YamlInputError(f"unsupported YAML node {type(node).__name__}", *_mark(node))


MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"


def _merged_pairs(node: yaml.MappingNode, active: set) -> list:
    """The (key node, value node) pairs of mapping ``node`` with its merge key (``<<: *name`` or
    ``<<: [*a, *b]``) resolved, in precedence order: the mapping's own keys, then each merged
    mapping's (its own merges resolved the same way), the first mapping listed first. A key that
    comes again later is overridden (the caller keeps the first), as YAML's merge says.

    Raises :class:`YamlInputError`: a key written twice in one mapping (``<<`` too), a merge of
    something other than mappings, a mapping merging itself. (PyYAML's ``flatten_mapping`` put the
    merged keys first, so every key the mapping overrode was called a duplicate: found by a review.)"""
    own, sources, seen = [], [], {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise YamlInputError("mapping keys must be plain names", *_mark(key_node))
        text = "<<" if key_node.tag == MERGE_TAG else key_node.value
        if text in seen:
            line, col = seen[text]
            raise YamlInputError(f"duplicate key {text!r} (first at line {line}, col {col})", *_mark(key_node))
        seen[text] = _mark(key_node)
        if key_node.tag != MERGE_TAG:
            if key_node.tag == _VALUE_TAG:
                key_node.tag = "tag:yaml.org,2002:str"  # (as PyYAML's flatten_mapping: '=' is a name)
            own.append((key_node, value_node))
            continue
        sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                raise YamlInputError("bad merge key: << takes a mapping or a list of mappings (<<: *name, "
                                     "<<: [*a, *b])", *_mark(source))
    for source in sources:
        if id(source) in active:
            raise YamlInputError("recursive YAML alias (a mapping merges itself)", *_mark(source))
        active.add(id(source))
        try:
            own.extend(_merged_pairs(source, active))
        finally:
            active.discard(id(source))
    return own


class NotRegularFileError(OSError):
    """The path names a FIFO, socket or device, not a regular file; ``strerror`` says which."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _refuse_irregular(mode: int, path) -> None:
    """Raise for anything but a regular file (IsADirectoryError for a directory)."""
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    raise NotRegularFileError(errno.EINVAL, f"not a regular file ({kind})", str(path))


def read_regular_file(path, max_bytes: int) -> bytes:
    """Up to ``max_bytes + 1`` bytes of the regular file at ``path`` (str or PathLike; the caller
    tells a file over ``max_bytes`` by the length).

    Never blocks on a FIFO and never reads a device: ``stat`` refuses those before the open, and the
    file is opened with ``O_NONBLOCK`` and checked again with ``fstat`` (a FIFO swapped in between
    is refused, not waited on).

    Raises:
        IsADirectoryError: a directory.
        NotRegularFileError: a FIFO, socket or device (``strerror``: "not a regular file (a FIFO)").
        OSError: the file cannot be opened or read (``strerror`` from the system).
        ValueError: the path holds a NUL character.
    """
    _refuse_irregular(os.stat(path).st_mode, path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        _refuse_irregular(os.fstat(fd).st_mode, path)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as handle:
            fd = -1  # closed by the file object
            return handle.read(max_bytes + 1)
    finally:
        if fd >= 0:
            os.close(fd)
