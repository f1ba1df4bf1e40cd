"""Every command ends quietly when the reader of its stdout has gone (``capctl status | head -1``):
exit status 141, nothing on stderr (no traceback, no "Exception ignored" at exit). The pipe's read
end is closed before the command starts, so every write fails (no race with a real ``head``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

STDOUT_CLOSED_EXIT = 141  # capctl.errors.STDOUT_CLOSED_EXIT: 128 + SIGPIPE
from tests.cli.test_cli_fake_admin import admin  # noqa: F401 (fixture: a fake Admin server)

REPO = Path(__file__).resolve().parents[2]
CAPCTL = [sys.executable, "-m", "capctl.cli.main"]


def run_closed(argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` with stdout a pipe nobody reads any more."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        return subprocess.run(argv, stdout=write_fd, stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    finally:
        os.close(write_fd)


@pytest.mark.parametrize("args", [["status"], ["nodes", "--json"], ["jobs"], ["explain", "11", "--json"],
                                  ["status", "--watch", "--json", "--watch-interval-s", "0.2", "--count", "3"]])
def test_coordinator_commands_exit_141_without_a_traceback(admin, args):  # noqa: F811
    _, address = admin
    r = run_closed([*CAPCTL, *args, "--coordinator", address])
    assert (r.returncode, r.stderr) == (STDOUT_CLOSED_EXIT, "")


@pytest.mark.parametrize("args", [["policy", "validate", "examples/policies/small-4x8.yaml"],
                                  ["policy", "validate", "--json", "examples/policies/small-4x8.yaml"]])
def test_local_commands_exit_141_without_a_traceback(args):
    r = run_closed([*CAPCTL, *args])
    assert (r.returncode, r.stderr) == (STDOUT_CLOSED_EXIT, "")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["budget", "--help"]])
def test_argparse_output_ends_quietly(args):
    r = run_closed([*CAPCTL, *args])  # argparse ignores the failed write itself: exit 0
    assert (r.returncode, r.stderr) == (0, "")


def test_sim_exits_141_without_a_traceback():
    r = run_closed([*CAPCTL, "sim", "--policy", "examples/policies/small-4x8.yaml", "--cluster",
                    "examples/clusters/small-4x8.yaml", "--duration", "5", "--policies", "uniform", "--json"])
    assert (r.returncode, r.stderr) == (STDOUT_CLOSED_EXIT, "")


def test_capctl_simgpu_exits_141_without_a_traceback():
    r = run_closed([sys.executable, "-c", "import sys; from capctl.simgpu.entry import main; sys.exit(main())",
                    "models"])
    assert (r.returncode, r.stderr) == (STDOUT_CLOSED_EXIT, "")


def test_an_open_stdout_is_untouched_and_other_broken_pipes_still_propagate(tmp_path):
    from capctl.errors import quiet_when_stdout_closes

    assert quiet_when_stdout_closes(lambda: 7) == 7

    def other_pipe():  # a pipe that is not stdout: a real error, not a reader who left
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        quiet_when_stdout_closes(other_pipe)
