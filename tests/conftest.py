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
    global _XDIST_WORKER
    _XDIST_WORKER = hasattr(config, "workerinput")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _compile_the_checkout()


_RUNNING: dict[str, str] = {}
"""Node id -> shown id of the tests running now (several under pytest-xdist: one per worker)."""


_XDIST_WORKER = False
"""Whether this pytest is a pytest-xdist worker (set by :func:`pytest_configure`)."""


def _current_file() -> str:
    """$CAPCTL_TEST_CURRENT_FILE, in the process that sees every test start and finish: pytest
    itself, or the controller under pytest-xdist ("" in its workers, which see only their own)."""
    return "" if _XDIST_WORKER else os.environ.get(CURRENT_TEST_ENV, "")


def _write_running(path: str) -> None:
    with open(path, "w") as f:
        f.write("".join(f"{shown}\n" for shown in _RUNNING.values()))


def pytest_runtest_logstart(nodeid, location):
    """Keep the ids of the running tests in $CAPCTL_TEST_CURRENT_FILE (.ci/run names them if the
    run dies; under pytest-xdist the controller gets every worker's start and finish)."""
    path = _current_file()
    if path:  # a test outside the rootdir has no path in its id
        _RUNNING[nodeid] = location[0] + nodeid if nodeid.startswith("::") else nodeid
        _write_running(path)


def pytest_runtest_logfinish(nodeid, location):
    path = _current_file()
    if path:
        _RUNNING.pop(nodeid, None)
        _write_running(path)


XDIST_SHARED_GROUPS = {"slurm": "slurm-cluster", "ha": "etcd-cluster"}
"""Marker -> the pytest-xdist group of its tests: they share one cluster (the Slurm cluster is
session-scoped, tests/slurm/conftest.py; the etcd cluster module-scoped, tests/ha) and run on one
worker, one after another."""


def _xdist_groups(items) -> None:
    """Under pytest-xdist's ``--dist loadgroup`` (the Makefile's ``make test``): the tests of one
    file run on one worker (its module-scoped fixtures, such as the simulations of tests/sim, are
    set up once), and all the tests of each :data:`XDIST_SHARED_GROUPS` marker on one worker."""
    for item in items:
        group = next((g for m, g in XDIST_SHARED_GROUPS.items() if item.get_closest_marker(m) is not None),
                     item.nodeid.split("::", 1)[0])
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config, items):
    """Tests with real processes (fault injection, HA, the Slurm cluster, integration) run against
    wall-clock deadlines; on a loaded 2-core host one may miss a deadline by a hair. Each gets one
    rerun (a real failure fails twice and is reported); the rerun is visible in pytest's summary ("R").
    Also the pytest-xdist groups (:func:`_xdist_groups`)."""
    if config.pluginmanager.hasplugin("xdist"):
        _xdist_groups(items)
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        real = any(item.get_closest_marker(m) is not None for m in ("faults", "ha", "slurm", "integration"))
        if real and item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=1))


_RERUN_REASONS: list[str] = []
RERUN_REASON_LINES = 25
"""Last lines of each rerun test's first failure shown in the terminal summary (bounded)."""


def pytest_runtest_logreport(report):
    """Keep why a test was rerun (:func:`pytest_collection_modifyitems`): pytest-rerunfailures names
    the rerun tests only, so a flaky test's cause was never seen in CI's output. Under xdist the
    workers' reports reach the controller, which prints them (:func:`pytest_terminal_summary`)."""
    if report.outcome == "rerun" and len(_RERUN_REASONS) < 20:
        text = str(report.longreprtext or "").strip().splitlines()
        _RERUN_REASONS.append(f"{report.nodeid} ({report.when}):\n    " + "\n    ".join(text[-RERUN_REASON_LINES:]))


def pytest_terminal_summary(terminalreporter):
    """Print why each rerun test failed the first time (:func:`pytest_runtest_logreport`)."""
    if _RERUN_REASONS:
        terminalreporter.section("why tests were rerun (first failure, last lines)")
        for reason in _RERUN_REASONS:
            terminalreporter.write_line(reason)
