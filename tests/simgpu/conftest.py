"""Fixtures for the simulated GPU driver tests: the compiled library, nodes, and real pynvml.

pynvml loads ``libnvidia-ml.so.1`` by soname; we preload our build by absolute path (RTLD_GLOBAL)
so the soname resolves to it, and point it at a node through ``CAPCTL_SIMGPU_NODE`` before each
``nvmlInit``.  Tests that need a second process run pynvml in a subprocess with ``node.env()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from capctl.simgpu.build import REPO_ROOT, library_path
from tests.conftest import require


@pytest.fixture(scope="session")
def simlib() -> str:
    """Absolute path of the built simulated library (required real part)."""
    path = library_path()
    require(path.is_file(), f"simulated NVML library not built at {path} (run 'make build')")
    return str(path.resolve())


@pytest.fixture
def make_node(tmp_path, simlib):
    """Factory: ``make_node(gpus=2, **kwargs)`` -> SimNode in tmp_path (closed at teardown)."""
    from capctl.simgpu.node import SimNode

    nodes = []

    def factory(gpus: int = 2, name: str = "node.state", **kwargs):
        kwargs.setdefault("manual_clock", True)
        node = SimNode.create(tmp_path / name, gpus=gpus, **kwargs)
        nodes.append(node)
        return node

    yield factory
    for n in nodes:
        n.close()


@pytest.fixture
def nvml(simlib, monkeypatch):
    """Real pynvml bound to our library; ``nvml.attach(node)`` inits NVML on that node.

    Every nvmlInit made through ``attach`` is paired with an nvmlShutdown (``nvml.detach()`` or
    teardown); the node is (re)read from ``CAPCTL_SIMGPU_NODE`` when the NVML refcount was 0.
    """
    from capctl.simgpu.node import preload_for_pynvml

    preload_for_pynvml(simlib)
    import pynvml

    inits = []

    def attach(node):
        for k, v in node.env().items():
            monkeypatch.setenv(k, v)
        pynvml.nvmlInit()
        inits.append(1)
        return pynvml

    def detach():
        if inits:
            inits.pop()
            pynvml.nvmlShutdown()

    pynvml.attach = attach
    pynvml.detach = detach
    yield pynvml
    for _ in inits:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    del pynvml.attach, pynvml.detach


def run_pynvml(node, body: str, timeout_s: float = 60.0) -> dict:
    """Run ``body`` in a fresh Python process with pynvml on ``node``; return its JSON ``out``.

    ``body`` sees ``N`` (pynvml, initialised) and must fill the dict ``out``.  pynvml is pointed at
    our library with LD_LIBRARY_PATH, the way any other process would be.
    """
    env = dict(os.environ)
    env.update(node.env())
    lib_dir = os.path.dirname(node.env()["CAPCTL_SIMNVML_LIB"])
    env["LD_LIBRARY_PATH"] = lib_dir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    code = "import json, pynvml as N\nN.nvmlInit()\nout = {}\n" + textwrap.dedent(body) + (
        "\nN.nvmlShutdown()\nprint(json.dumps(out))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=str(REPO_ROOT), capture_output=True,
        text=True, timeout=timeout_s,
    )
    assert res.returncode == 0, f"subprocess failed:\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])
