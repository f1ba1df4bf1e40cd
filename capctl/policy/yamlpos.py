"""Read YAML into plain Python data while keeping the line:col of every key and value.

PyYAML composes the document into nodes that carry start marks; this module turns those nodes into
dicts/lists/scalars (with the safe loader's scalar rules) and records, for each JSON path
(a tuple of keys and list indexes), where its value and its key start. Positions are 1-based.

Bounds (a policy is small; anything bigger is an error, never a hang): at most
:data:`MAX_NODES` YAML nodes after alias expansion and a nesting depth of :data:`MAX_DEPTH`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

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


class _Loader(yaml.SafeLoader):
    """Safe loader; only scalar construction is used."""


def load_with_positions(text: str) -> tuple[object, Positions]:
    """Parse one YAML document; return ``(data, positions)``.

    An empty document gives ``None``. Raises :class:`YamlInputError` for malformed YAML, several
    documents, duplicate keys, non-scalar or non-string keys, recursive aliases, or a document over
    :data:`MAX_NODES` / :data:`MAX_DEPTH`.
    """
    positions = Positions()
    loader = None
    try:
        try:
            loader = _Loader(text)
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


def _build(loader, node, path, positions, counter, active, depth):
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise YamlInputError(f"document too large (more than {MAX_NODES} YAML nodes after expanding aliases)", *_mark(node))
    if depth > MAX_DEPTH:
        raise YamlInputError(f"document nested deeper than {MAX_DEPTH} levels", *_mark(node))
    positions.values.setdefault(path, _mark(node))
    if isinstance(node, yaml.ScalarNode):
        try:
            return loader.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            raise YamlInputError(f"cannot read value: {getattr(err, 'problem', None) or err}", *_mark(node)) from None
        except (ValueError, OverflowError, TypeError) as err:
            shown = node.value if len(node.value) <= 40 else node.value[:37] + "..."
            reason = str(err).split(";")[0]
            raise YamlInputError(f"cannot read value {shown!r}: {reason}", *_mark(node)) from None
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
            try:
                loader.flatten_mapping(node)  # YAML merge keys (<<)
            except yaml.YAMLError as err:
                raise YamlInputError(f"bad merge key: {getattr(err, 'problem', None) or err}", *_mark(node)) from None
            result: dict = {}
            seen: dict = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise YamlInputError("mapping keys must be plain names", *_mark(key_node))
                key = _build(loader, key_node, path + ("\0key",), Positions(), counter, active, depth + 1)
                if not isinstance(key, str):
                    # YAML reads `1:`, `true:`, `null:` as non-strings; policy keys are names.
                    key = key_node.value
                if key in seen:
                    line, col = seen[key]
                    raise YamlInputError(f"duplicate key {key!r} (first at line {line}, col {col})", *_mark(key_node))
                seen[key] = _mark(key_node)
                positions.keys[path + (key,)] = _mark(key_node)
                result[key] = _build(loader, value_node, path + (key,), positions, counter, active, depth + 1)
            return result
    finally:
        active.discard(id(node))
    raise YamlInputError(f"unsupported YAML node {type(node).__name__}", *_mark(node))
