"""Locate build inputs and outputs of the simulated NVML driver.

The driver (``libnvidia-ml.so.1``) is compiled from ``csrc/simnvml`` against NVIDIA's real
``nvml.h`` shipped in the PyPI package ``nvidia-nvml-dev`` (pinned in pyproject.toml).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""Repository root (the checkout holding ``csrc/`` and ``build/``)."""

LIBRARY_ENV = "CAPCTL_SIMNVML_LIB"
"""Environment variable that overrides the path of the simulated ``libnvidia-ml.so.1``."""


def nvml_include_dir() -> str:
    """Return the directory holding NVIDIA's ``nvml.h`` from the ``nvidia-nvml-dev`` wheel.

    Raises:
        FileNotFoundError: the package is not installed (``pip install nvidia-nvml-dev``).
    """
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    for root in roots:
        for header in sorted(Path(root).glob("*/include/nvml.h")):
            return str(header.parent)
    raise FileNotFoundError(
        "nvml.h not found: install the pinned 'nvidia-nvml-dev' package (make setup)"
    )


def library_path() -> Path:
    """Return the path of the simulated ``libnvidia-ml.so.1`` (``$CAPCTL_SIMNVML_LIB`` or ``build/``).

    The file may not exist yet; ``make build`` creates it.
    """
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return Path(env)
    return REPO_ROOT / "build" / "simnvml" / "libnvidia-ml.so.1"
