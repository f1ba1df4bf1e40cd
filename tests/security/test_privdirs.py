"""Private temporary directories of the daemons (capctl.privdirs): a killed daemon's are removed
by the next one to start; a live one's, one being made, an older release's and another user's are
kept."""

from __future__ import annotations

import os
import subprocess
import sys

from capctl import privdirs


def _dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_daemons_directory_is_removed_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (re-read $TMPDIR)
    dead = tmp_path / "capctl-agent-dead"
    dead.mkdir()
    (dead / privdirs.OWNER_FILE).write_text(f"{_dead_pid()}\n")
    (dead / "allowed.sock").write_text("")
    alive = tmp_path / "capctl-agent-alive"
    alive.mkdir()
    (alive / privdirs.OWNER_FILE).write_text(f"{os.getppid()}\n")
    unowned = tmp_path / "capctl-agent-old"  # an older release's, or one being made: no owner file
    unowned.mkdir()
    other = tmp_path / "capctl-peer-dead"  # another prefix: not this daemon's kind
    other.mkdir()
    (other / privdirs.OWNER_FILE).write_text(f"{_dead_pid()}\n")
    made = privdirs.make("capctl-agent-")
    assert not dead.exists() and alive.is_dir() and unowned.is_dir() and other.is_dir()
    assert os.path.dirname(made) == str(tmp_path) and os.stat(made).st_mode & 0o777 == 0o700
    assert int(open(os.path.join(made, privdirs.OWNER_FILE)).read()) == os.getpid()
    assert privdirs.remove_stale("capctl-agent-") == []  # its own directory is kept
    assert privdirs.remove_stale("capctl-peer-") == [str(other)]
