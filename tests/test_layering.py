"""Structural rules (DEVELOPERS.md), checked on every import of the source tree: at module level and
inside functions, absolute and relative.

Layers (one way only):

- ``capctl.cli`` -> the coordinator's client API (``coordinator.client``) and the agent client
  (``capctl.agentclient``) -> the protocol (``capctl.v1``);
- ``coordinator`` and ``nodeagent`` never import each other, the CLI, the demo or the simulators;
- ``slurm`` imports only the agent client and shared modules (``slurm.ctld``, the slurmctld epilog,
  also the coordinator's client API ``coordinator.client``);
- only ``nodeagent/nvml.py`` imports ``pynvml``; the allocator is pure (no I/O, networking or
  process modules);
- no import cycle anywhere: neither between modules (also of one package) nor between packages;
- high availability: only ``coordinator/etcdconn.py`` imports the etcd client (``etcd3gw``); the
  election and the etcd store sit below the reconcile loop and the servers (never import them);
  the agent's term fence (``nodeagent/fencing.py``) and the pace loop's clock-step alignment
  (``coordinator/pacealign.py``) are pure (import nothing of ours); the per-GPU NVML call guard
  (``nodeagent/callguard.py``) imports only the backend contract;
- the allocator's interior-point start (``capctl/allocator/interior.py``) is pure numerics
  (imports nothing of ours: the fast path hands it arrays).
- the registry's columns (``coordinator/gpucolumns.py``) import only shared modules (``capctl.*``):
  the registry, the solver inputs and the planner read them, never the other way;
- the memory-bound share estimate (``coordinator/membound.py``) is pure arrays (imports nothing of
  ours: the models hand it NVML's utilization and clock ratios).
- report timing: the agent's report clock (``nodeagent/reportclock.py``) and the coordinator's tick
  grid (``coordinator/tickphase.py``) are pure (import nothing of ours).
- the coordinator's store worker (``coordinator/storeio.py``: store calls off the event loop) runs
  any store's calls: it imports nothing of ours (the stores and the loop import it, never the reverse).

The simulators (``capctl.sim``, ``capctl.demo``) may import the coordinator's modules (the what-if
simulator runs the coordinator's own models and planner): they sit above the daemons, and no
daemon or shared module imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("capctl", "coordinator", "nodeagent", "slurm")
SIMULATORS = ("capctl.sim", "capctl.simgpu", "capctl.demo")
HA_LOWER = ("coordinator.etcdconn", "coordinator.election", "coordinator.etcdstore", "coordinator.etcdfinished",
            "coordinator.statestore")
HA_UPPER = ("coordinator.loop", "coordinator.server", "coordinator.daemon", "coordinator.hadaemon", "coordinator.ha")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Every module of the shipped packages (generated protocol code left out): name -> file."""
    out = {}
    for top in TOP:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "v1" in path.relative_to(ROOT).parts[:2] and path.name != "__init__.py":
                continue
            out[_module_name(path)] = path
    return out


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Modules of ours that ``path`` (module ``name``) imports anywhere in its body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known and "." in t:
                t = t.rpartition(".")[0]
            if t in known and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = source_modules()
    known = set(mods) | {"capctl.v1"}
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def external_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def package_of(module: str, graph: dict[str, set[str]]) -> str:
    """The package holding ``module`` (a package is its own)."""
    if any(m.startswith(module + ".") for m in graph):
        return module
    return module.rpartition(".")[0] or module


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every broken layering rule of ``graph``, one line each."""
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            rule = None
            if _in(mod, "coordinator") and _in(dep, "nodeagent", "slurm", "capctl.cli", *SIMULATORS):
                rule = "the coordinator imports no agent, hook, CLI, demo or simulator code"
            elif _in(mod, "nodeagent") and _in(dep, "coordinator", "slurm", "capctl.cli", *SIMULATORS):
                rule = "the agent imports no coordinator, hook, CLI, demo or simulator code"
            elif _in(mod, "slurm") and _in(dep, "coordinator", "nodeagent", "capctl.cli", *SIMULATORS) and not (
                    mod == "slurm.ctld" and dep == "coordinator.client"):
                rule = ("the Slurm hooks import only the agent client and shared modules (the slurmctld "
                        "epilog, slurm.ctld, also the coordinator's client API)")
            elif _in(mod, "capctl.cli") and _in(dep, "nodeagent", "slurm"):
                rule = "the CLI reaches agents only through the agent client (capctl.agentclient)"
            elif _in(mod, "capctl.cli") and _in(dep, "coordinator") and dep != "coordinator.client":
                rule = "the CLI reaches the coordinator only through its client API (coordinator.client)"
            elif mod in HA_LOWER and _in(dep, *HA_UPPER):
                rule = "the election and the etcd store sit below the loop, the servers and the daemon"
            elif mod == "nodeagent.fencing":
                rule = "the agent's term fence is pure logic (imports nothing of ours)"
            elif mod == "capctl.allocator.interior":
                rule = "the allocator's interior-point start is pure numerics (imports nothing of ours)"
            elif mod == "nodeagent.callguard" and dep != "nodeagent.backend":
                rule = ("the per-GPU NVML call guard wraps any backend: it imports only the backend "
                        "contract (nodeagent.backend)")
            elif mod == "coordinator.gpucolumns" and not _in(dep, "capctl"):
                rule = ("the registry's columns (coordinator/gpucolumns.py) sit below the registry, the "
                        "solver inputs and the planner: they import only shared modules")
            elif mod == "coordinator.storeio":
                rule = "the store worker runs any store's calls: it imports nothing of ours"
            elif mod == "coordinator.membound":
                rule = "the memory-bound share estimate is pure arrays (imports nothing of ours)"
            elif mod in ("nodeagent.reportclock", "coordinator.tickphase"):
                rule = "report timing (the agent's report clock, the coordinator's tick grid) is pure logic (imports nothing of ours)"
            elif mod == "coordinator.pacealign":
                rule = "the clock-step alignment is pure logic on arrays (imports nothing of ours)"
            elif _in(mod, "capctl") and not _in(mod, "capctl.cli", *SIMULATORS) and _in(
                    dep, "coordinator", "nodeagent", "slurm", "capctl.cli", *SIMULATORS):
                rule = "shared modules import no daemon, CLI, demo or simulator code"
            if rule:
                bad.append(f"{mod} -> {dep}: {rule}")
    return bad


def test_the_design_cards_top_level_exists_and_the_old_places_are_gone():
    for top in ("coordinator", "nodeagent", "slurm", "protos", "tests"):
        assert (ROOT / top).is_dir(), top
    for old in ("capctl/coordinator", "capctl/nodeagent", "capctl/slurm"):
        assert not (ROOT / old).exists(), old
    assert (ROOT / "slurm" / "epilog").resolve() == (ROOT / "slurm" / "prolog").resolve()  # one hook script


def test_layers_are_one_way():
    graph = import_graph()
    assert len(graph) > 60 and graph["coordinator.daemon"] and graph["nodeagent.daemon"]
    assert violations(graph) == []


def test_no_import_cycle_between_modules_or_packages():
    graph = import_graph()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    packages: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        p = package_of(mod, graph)
        packages.setdefault(p, set()).update(package_of(d, graph) for d in deps if package_of(d, graph) != p)
    # a subpackage using its parent package's modules (capctl.cli -> capctl.errors, say) is the
    # ordinary direction of a package tree, not a cycle of packages; cycles between modules are
    # checked above on every module, parents included
    for p, deps in packages.items():
        deps.difference_update({q for q in deps if p.startswith(q + ".")})
    assert find_cycle(packages) is None, " -> ".join(find_cycle(packages))


def test_the_checker_sees_back_imports_and_cycles():
    """The rules above can fail: a deliberately added back-import and a cycle are both reported."""
    graph = {k: set(v) for k, v in import_graph().items()}
    graph["nodeagent.caps"].add("coordinator.loop")
    graph["slurm.hooks"].add("nodeagent.daemon")
    graph["nodeagent.nvml"].add("capctl.simgpu.build")
    graph["capctl.cli.main"].add("slurm.hooks")
    graph["capctl.allocator.interior"].add("capctl.allocator.fast")
    bad = violations(graph)
    assert any(b.startswith("capctl.allocator.interior -> capctl.allocator.fast") for b in bad)
    assert any(b.startswith("nodeagent.caps -> coordinator.loop") for b in bad)
    assert any(b.startswith("slurm.hooks -> nodeagent.daemon") for b in bad)
    assert any(b.startswith("nodeagent.nvml -> capctl.simgpu.build") for b in bad)
    assert any(b.startswith("capctl.cli.main -> slurm.hooks") for b in bad)
    graph["capctl.errors"].add("capctl.policy")
    graph["capctl.policy"].add("capctl.errors")
    assert find_cycle(graph) is not None


def test_only_the_nvml_backend_imports_pynvml():
    importers = sorted(str(p.relative_to(ROOT)) for p in source_modules().values()
                       if any(_in(m, "pynvml") for m in external_imports(p)))
    assert importers == ["nodeagent/nvml.py"]


def test_allocator_is_pure():
    forbidden = ("grpc", "socket", "subprocess", "sqlite3", "requests", "urllib", "http", "asyncio", "threading",
                 "pynvml", "coordinator", "nodeagent", "slurm", "capctl.v1")
    offenders = sorted(f"{p.relative_to(ROOT)}: {m}" for name, p in source_modules().items()
                       if _in(name, "capctl.allocator") for m in external_imports(p) if _in(m, *forbidden))
    assert offenders == []


def test_only_etcdconn_imports_the_etcd_client():
    users = []
    for name, path in source_modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m == "etcd3gw" or m.startswith("etcd3gw.") for m in mods):
                users.append(name)
    assert sorted(set(users)) == ["coordinator.etcdconn"]


def test_the_ha_rules_catch_a_wrong_import():
    graph = import_graph()
    graph["coordinator.election"].add("coordinator.loop")
    graph["nodeagent.fencing"].add("nodeagent.caps")
    graph["nodeagent.callguard"].add("nodeagent.nvml")
    graph["nodeagent.reportclock"].add("nodeagent.link")
    graph["coordinator.tickphase"].add("capctl.v1")
    graph["coordinator.storeio"].add("coordinator.etcdstore")
    graph["coordinator.membound"].add("coordinator.registry")
    bad = violations(graph)
    assert any(b.startswith("coordinator.storeio -> coordinator.etcdstore") for b in bad)
    assert any(b.startswith("coordinator.membound -> coordinator.registry") for b in bad)
    assert any(b.startswith("nodeagent.callguard -> nodeagent.nvml") for b in bad)
    assert any(b.startswith("nodeagent.reportclock -> nodeagent.link") for b in bad)
    assert any(b.startswith("coordinator.tickphase -> capctl.v1") for b in bad)
    graph["coordinator.gpucolumns"].add("coordinator.registry")
    bad = violations(graph)
    assert any(b.startswith("coordinator.gpucolumns -> coordinator.registry") for b in bad)
    assert any(b.startswith("coordinator.election -> coordinator.loop") for b in bad)
    assert any(b.startswith("nodeagent.fencing -> nodeagent.caps") for b in bad)


def test_the_clock_step_alignment_stays_pure():
    graph = import_graph()
    assert graph["coordinator.pacealign"] == set()
    graph["coordinator.pacealign"].add("coordinator.paceloop")
    assert any(b.startswith("coordinator.pacealign -> coordinator.paceloop") for b in violations(graph))
