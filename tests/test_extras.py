"""Extras by role (pyproject.toml, :mod:`capctl.extras`), checked on every import of the source tree
like tests/test_layering.py: the compute-node part (``capctl-agent``, the Slurm hooks, ``capctl
install``) reaches no module of the head node's solver stack, and every third-party module the
shipped code imports belongs to the core dependencies or to a known extra."""

from __future__ import annotations

import sys
import tomllib

from capctl.extras import EXTRAS_OF_MODULE, extra_for, extras_of
from tests.test_layering import ROOT, external_imports, import_graph, source_modules

CORE_MODULES = {"grpc", "google", "yaml", "jsonschema", "hostlist", "shtab", "build_manpages", "argparse_manpage",
                "cryptography"}
"""Top-level modules of the core dependencies (``[project] dependencies``)."""

AGENT_ROOTS = ("nodeagent.daemon", "slurm.hooks", "slurm.health", "capctl.cli.install", "capctl.agentclient")


def closure(roots) -> set[str]:
    graph = import_graph()
    seen, todo = set(), list(roots)
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph.get(mod, ()))
    return seen


def third_party(modules) -> dict[str, set[str]]:
    """Third-party top-level module -> our modules importing it."""
    files = source_modules()
    out: dict[str, set[str]] = {}
    for mod in modules:
        if mod in files:
            for ext in external_imports(files[mod]):
                top = ext.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in ("capctl", "coordinator", "nodeagent", "slurm"):
                    out.setdefault(top, set()).add(mod)
    return out


def test_the_agent_side_needs_only_the_core_and_the_agent_extra():
    used = third_party(closure(AGENT_ROOTS))
    beyond = {m: sorted(by) for m, by in used.items() if m not in CORE_MODULES and "agent" not in extras_of(m)}
    assert beyond == {}, f"the agent side imports modules of other extras: {beyond}"
    assert "pynvml" in used and "grpc" in used  # the check sees the agent's real imports


def test_every_third_party_import_is_core_or_of_a_declared_extra():
    used = third_party(source_modules())
    unknown = {m: sorted(by)[:3] for m, by in used.items() if m not in CORE_MODULES and extra_for(m) is None}
    assert unknown == {}, "add the module to capctl.extras.EXTRAS_OF_MODULE and pyproject.toml"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {e for es in EXTRAS_OF_MODULE.values() for e in es} <= set(extras)


def test_the_missing_extra_message_names_the_extra():
    from capctl.extras import missing_extra_message

    msg = missing_extra_message("capctl-coordinator", ModuleNotFoundError("No module named 'scipy'", name="scipy.optimize"))
    assert msg == "capctl-coordinator: needs capctl[coordinator] (module scipy is not installed): pip install 'capctl[coordinator]'"
    assert missing_extra_message("capctl", ModuleNotFoundError("x", name="not_ours")) is None
