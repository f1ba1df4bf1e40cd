"""Where capctl's own build outputs are found, for every part that needs them (shared: the node
agent uses it without importing the simulator).

Today this is only the simulated NVML driver (``libnvidia-ml.so.1``, built by ``make build`` from
``csrc/simnvml``); the node agent loads it only when told to (``--nvml-library simulated``).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
"""Repository root of an editable checkout (holding ``csrc/`` and ``build/``). An installed package
ships no simulated driver: there ``$CAPCTL_SIMNVML_LIB`` must name it (the tests set it)."""

LIBRARY_ENV = "CAPCTL_SIMNVML_LIB"
"""Environment variable that overrides the path of the simulated ``libnvidia-ml.so.1``."""


def library_path() -> Path:
    """Return the path of the simulated ``libnvidia-ml.so.1`` (``$CAPCTL_SIMNVML_LIB`` or ``build/``).

    The file may not exist yet; ``make build`` creates it.
    """
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return Path(env)
    return REPO_ROOT / "build" / "simnvml" / "libnvidia-ml.so.1"
