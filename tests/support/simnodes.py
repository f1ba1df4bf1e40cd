"""Simulated nodes for tests: create a node, point this process or a child process at it.

The simulated driver maps ``$CAPCTL_SIMGPU_NODE`` on the first ``nvmlInit`` of a process (NVML
reference count 0 -> 1), so in-process tests may switch nodes between tests as long as every
backend of the previous test was closed. pynvml keeps one library per process: in-process tests
all use the simulated library; anything needing another library runs in a child process
(:func:`run_python`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from capctl.simgpu.build import LIBRARY_ENV, REPO_ROOT, library_path

NODE_ENV = "CAPCTL_SIMGPU_NODE"


def sim_library_built() -> bool:
    """True when the simulated ``libnvidia-ml.so.1`` exists (``make build``)."""
    return library_path().is_file()


def create_node(path: Path, gpus: int = 8, model: str = "H100-SXM", **kwargs):
    """Create a simulated node (manual clock, seed 0 unless given) at ``path``; return the SimNode."""
    from capctl.simgpu.node import SimNode

    kwargs.setdefault("manual_clock", True)
    kwargs.setdefault("seed", 0)
    return SimNode.create(path, gpus=gpus, model=model, **kwargs)


def child_env(node=None, **extra: str) -> dict[str, str]:
    """Environment for a child process: ours, the node's variables, and ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if node is not None:
        env.update(node.env())
    env.update(extra)
    return env


def run_python(code: str, env: dict[str, str], timeout_s: float = 30.0) -> tuple[int, dict | None, str]:
    """Run ``code`` in a fresh interpreter; it may print one JSON line prefixed ``RESULT ``.

    Returns (exit status, decoded result or None, stderr).
    """
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=str(REPO_ROOT), capture_output=True,
        text=True, timeout=timeout_s,
    )
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    return proc.returncode, result, proc.stderr


__all__ = ["LIBRARY_ENV", "NODE_ENV", "child_env", "create_node", "library_path", "run_python",
           "sim_library_built"]
