"""A SIGTERM that reaches the coordinator while it starts its servers is a clean stop: exit 0 and
its admin socket removed (found by tests/test_lifeline.py: a SIGTERM between the admin socket's
bind and the signal handlers ended the daemon by the default action, 1 run in ~56, and left the
socket behind; sent the moment the socket appears it did so every time)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capctl import lifeline
from tests.support.processes import require_coordinator

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_as_soon_as_the_admin_socket_exists_is_a_clean_stop(tmp_path):
    require_coordinator()
    for k in range(3):
        d = tmp_path / f"c{k}"
        d.mkdir()
        admin = d / "admin.sock"
        argv = [sys.executable, "-m", "coordinator.daemon", "--policy", str(ROOT / "examples/policies/small-4x8.yaml"),
                "--listen", f"unix:{d}/agents.sock", "--state-dir", str(d / "state"), "--admin-socket", str(admin),
                "--metrics-port", "0", "--log-level", "WARNING"]
        with open(d / "log", "wb") as log:
            proc = lifeline.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 30
                while not admin.exists():  # (a tight poll: the window is the first milliseconds)
                    assert proc.poll() is None and time.monotonic() < deadline, (d / "log").read_text()
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(30)
            finally:
                proc.kill()
                proc.wait(10)
        assert rc == 0 and not admin.exists(), (rc, (d / "log").read_text())
