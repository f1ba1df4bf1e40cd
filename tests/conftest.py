"""Project-wide pytest configuration.

Integration tests need real parts (the simulated NVML driver, Slurm, munge, gRPC). Use
:func:`require` instead of ``pytest.skip``: under CI (``CI=true``) a missing real part fails the test.
Area-specific fixtures live in each ``tests/<area>/conftest.py``; reusable helpers in ``tests/support``.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, reason: str) -> None:
    """Skip (locally) or fail (under CI=true) when a real part needed by the test is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required real part missing under CI: {reason}")
    pytest.skip(reason)
