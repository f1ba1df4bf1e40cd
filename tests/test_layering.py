"""Structural rules from DEVELOPERS.md, checked on the source tree.

- no imports between ``capctl.coordinator``, ``capctl.nodeagent`` and ``capctl.slurm``;
- only ``capctl/nodeagent/nvml.py`` imports ``pynvml``;
- the allocator is pure: it imports no I/O, networking or process modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AREAS = ("coordinator", "nodeagent", "slurm")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
    return out


def _modules(area: str) -> list[Path]:
    return sorted((ROOT / "capctl" / area).rglob("*.py"))


def test_no_imports_between_coordinator_nodeagent_and_slurm():
    crossings = [
        (str(p.relative_to(ROOT)), m)
        for area in AREAS
        for p in _modules(area)
        for m in _imports(p)
        if any(m == f"capctl.{o}" or m.startswith(f"capctl.{o}.") for o in AREAS if o != area)
    ]
    assert crossings == []
    assert len(_modules("coordinator")) > 5 and len(_modules("nodeagent")) > 3 and _modules("slurm")


def test_only_the_nvml_backend_imports_pynvml():
    importers = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "capctl").rglob("*.py")
        if any(m == "pynvml" or m.startswith("pynvml.") for m in _imports(p))
    )
    assert importers == ["capctl/nodeagent/nvml.py"]


def test_allocator_imports_no_io():
    forbidden = ("grpc", "socket", "subprocess", "sqlite3", "requests", "urllib", "http", "asyncio",
                 "threading", "capctl.coordinator", "capctl.nodeagent", "capctl.slurm", "capctl.v1")
    found = [
        (str(p.relative_to(ROOT)), m)
        for p in _modules("allocator")
        for m in _imports(p)
        if any(m == f or m.startswith(f + ".") for f in forbidden)
    ]
    assert found == []
