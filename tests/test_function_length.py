"""The project's style rule: functions a reader can hold (~60 lines at most).

Every function and method of the shipped packages (``coordinator``, ``nodeagent``, ``capctl`` and
``slurm``; the generated protocol code ``capctl/v1/`` left out) has at most :data:`MAX_CODE_LINES`
code lines: the lines from its ``def`` to its last line, not counting its docstring, blank lines
and comment-only lines. A nested function's lines count toward the function around it too (split
a long function into functions of the module, not into closures).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "nodeagent", "capctl", "slurm")
GENERATED = ROOT / "capctl" / "v1"
MAX_CODE_LINES = 60


def code_lines(src_lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Code lines of ``fn`` (``src_lines``: its module's lines): from its ``def`` to its end, less its
    docstring, blank lines and comment-only lines (decorators are not counted)."""
    body = fn.body
    skip: set[int] = set()
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    count = 0
    for ln in range(fn.lineno, fn.end_lineno + 1):
        if ln in skip:
            continue
        text = src_lines[ln - 1].strip()
        if not text or text.startswith("#"):
            continue
        count += 1
    return count


def long_functions(source: str, limit: int = MAX_CODE_LINES) -> list[tuple[int, int, str]]:
    """``(code lines, line, name)`` of every function of ``source`` over ``limit`` code lines."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = code_lines(lines, node)
            if n > limit:
                out.append((n, node.lineno, node.name))
    return out


def source_files() -> list[Path]:
    """The Python files of :data:`PACKAGES`, generated code left out."""
    out = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if GENERATED in path.parents:
                continue
            out.append(path)
    return out


def test_counting_skips_docstring_blank_and_comment_lines():
    src = textwrap.dedent('''
        def f(x):
            """Doc
            on two lines."""

            # a comment
            y = x + 1  # code with a comment

            return y
    ''')
    fn = ast.parse(src).body[0]
    assert code_lines(src.splitlines(), fn) == 3
    assert long_functions(src, limit=2) == [(3, 2, "f")]
    assert long_functions(src, limit=3) == []


def test_every_function_within_the_limit():
    files = source_files()
    assert len(files) > 50, f"found only {len(files)} source files under {ROOT}"
    offenders = []
    for path in files:
        for n, line, name in long_functions(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(ROOT)}:{line} {name}: {n} code lines")
    assert not offenders, (
        f"functions over {MAX_CODE_LINES} code lines (docstring, blank and comment-only lines not "
        "counted); split them into well-named functions of the module:\n" + "\n".join(sorted(offenders)))
