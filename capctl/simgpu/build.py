"""Locate build inputs and outputs of the simulated NVML driver.

The driver (``libnvidia-ml.so.1``) is compiled from ``csrc/simnvml`` against NVIDIA's real
``nvml.h`` shipped in the PyPI package ``nvidia-nvml-dev`` (pinned in pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

from capctl.paths import LIBRARY_ENV, REPO_ROOT, library_path  # noqa: F401 — located in one place


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
