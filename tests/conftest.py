"""Project-wide pytest configuration.

Integration tests need real parts (the simulated NVML driver, Slurm, munge, gRPC). Use
:func:`require` instead of ``pytest.skip``: under CI (``CI=true``) a missing real part fails the test.
Area-specific fixtures live in each ``tests/<area>/conftest.py``; reusable helpers in ``tests/support``.
"""

from __future__ import annotations

import compileall
import os
import signal

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The shared data (Zeus traces) of this checkout, whatever the working directory
# (capctl.allocator.curves.zeus_data_dir reads $CAPCTL_DATA_DIR before the working directory).
os.environ.setdefault("CAPCTL_DATA_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      os.pardir, "shared", "data"))


def require(condition: bool, reason: str) -> None:
    """Skip (locally) or fail (under CI=true) when a real part needed by the test is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required real part missing under CI: {reason}")
    pytest.skip(reason)


CURRENT_TEST_ENV = "CAPCTL_TEST_CURRENT_FILE"
"""When set, the id of the running test is kept in this file (.ci/run names it if the run dies)."""


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILED_PACKAGES = ("capctl", "coordinator", "nodeagent", "tests")
"""The checkout's packages that the daemons, CLIs and helper processes started by the tests import."""


def _compile_the_checkout() -> None:
    """Write the bytecode of the checkout's packages (``__pycache__``, git-ignored) once per run.

    With ``PYTHONDONTWRITEBYTECODE`` set (this CI image sets it) and a clean clone, every one of the
    several hundred Python processes the tests start (coordinators, agents, CLIs) compiled the
    whole of capctl again: ~0.35 s of CPU each on a loaded 2-core host. Python reads existing
    bytecode whatever that variable says, and checks it against the source's mtime, so an edited
    file is compiled afresh. Serial (``workers=1``: no process pool, nothing forked); ~1 s.
    """
    for package in COMPILED_PACKAGES:
        compileall.compile_dir(os.path.join(REPO, package), quiet=2, workers=1)


def pytest_configure(config):
    """Children get SIGINT at its default disposition: a run started in the background by a shell
    without job control (``make test &``, ``(cmd &)``) inherits SIGINT *ignored*, the daemons and the
    demo started from it would then never see Ctrl-C, and the tests that send it
    (tests/demo ``test_demo_ctrl_c_stops_everything``, tests/cli ``test_watch``) would time out
    after 30 s, twice. An ignored disposition survives exec; a handler does not, so the children
    start with the default and Python installs its KeyboardInterrupt handler."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _compile_the_checkout()


def pytest_runtest_logstart(nodeid, location):
    path = os.environ.get(CURRENT_TEST_ENV)
    if path:
        with open(path, "w") as f:  # a test outside the rootdir has no path in its id
            f.write((location[0] + nodeid if nodeid.startswith("::") else nodeid) + "\n")


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get(CURRENT_TEST_ENV)
    if path:
        with open(path, "w") as f:
            f.write("")


def pytest_collection_modifyitems(config, items):
    """Tests with real processes (fault injection, HA, the Slurm cluster, integration) run against
    wall-clock deadlines; on a loaded 2-core host one may miss a deadline by a hair. Each gets one
    rerun (a real failure fails twice and is reported); the rerun is visible in pytest's summary ("R")."""
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        real = any(item.get_closest_marker(m) is not None for m in ("faults", "ha", "slurm", "integration"))
        if real and item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=1))
