"""``capctl status --watch``: Ctrl-C exits 130 while the coordinator is unreachable (0 after a good
refresh); the refresh period and --hottest are bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from capctl import lifeline
from tests.cli.test_cli_fake_admin import admin  # noqa: F401 — fixture


def _watch(address):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return lifeline.Popen([sys.executable, "-m", "capctl.cli.main", "status", "--watch", "--watch-interval-s", "2",
                             "--coordinator", address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _interrupt_after_output(proc, marker):
    try:
        deadline = time.monotonic() + 30
        line = ""
        while marker not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert marker in line, line
        time.sleep(0.5)  # Ctrl-C while it waits for the next refresh
        proc.send_signal(signal.SIGINT)
        code = proc.wait(20)
        return code, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_while_unreachable_exits_130(tmp_path):
    code, err = _interrupt_after_output(_watch(f"unix:{tmp_path}/none.sock"), "(retrying)")
    assert code == 130 and "Traceback" not in err


def test_ctrl_c_after_good_refresh_exits_0(admin):  # noqa: F811
    _, address = admin
    code, err = _interrupt_after_output(_watch(address), "refreshing every 2 s")
    assert code == 0 and "Traceback" not in err


@pytest.mark.parametrize("args, expect", [
    (["--watch", "--watch-interval-s", "0.001"], "--watch-interval-s 0.001: allowed 0.2..3600 seconds"),
    (["--watch", "--watch-interval-s", "nan"], "--watch-interval-s nan: allowed 0.2..3600 seconds"),
    # echoed as given: 1e400 read as inf was reported "inf" (a try-out); float() reads full-width digits
    (["--watch", "--watch-interval-s", "1e400"], "--watch-interval-s 1e400: allowed 0.2..3600 seconds"),
    (["--watch", "--watch-interval-s", "\uff12"], "--watch-interval-s \uff12: write the seconds in ASCII digits 0-9, "
                                                   "e.g. 2 or 0.5"),
    (["--hottest", "-3"], "--hottest -3: give a count >= 0 (0: none)"),
    # without --watch it was ignored without a word, even out of its range (found by a review)
    (["--watch-interval-s", "2"], "--watch-interval-s 2: only with --watch (it sets how often --watch refreshes); "
                                  "add --watch, or leave it out for one status"),
    (["--watch-interval-s", "0", "--json"], "--watch-interval-s 0: only with --watch (it sets how often --watch "
                                            "refreshes); add --watch, or leave it out for one status"),
    # both were ignored without a word (found by a try-out)
    (["--count", "3"], "--count 3: only with --watch (how many refreshes); add --watch, or leave it out for one "
                       "status"),
    (["--hottest", "3", "--json"], "--hottest 3: only for the text view (--json lists every GPU); leave one of them "
                                   "out"),
])
def test_bad_watch_values(tmp_path, args, expect):
    r = subprocess.run([sys.executable, "-m", "capctl.cli.main", "status", *args, "--coordinator",
                        f"unix:{tmp_path}/none.sock"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr == f"capctl: {expect}\n"


def test_the_no_agent_line_gives_the_watts_held_or_says_none_are():
    """``capctl status``'s line of the policy nodes that never reported: the watts counted for them
    (``held_w``), or, with none (no node reported its limits, no gpus_per_node declared), that
    nothing is held: it said "0 W held ..., each counted at the most it may draw" (a try-out)."""
    from capctl.statusview import render_status, status_dict
    from capctl.v1 import capctl_pb2 as pb

    def line(*held):
        reply = pb.StatusReply(budget_w=3000)
        for k, w in enumerate(held):
            reply.nodes.add(name=f"n{k + 1}", stale=True, last_report_age_s=float("nan"), never_reported=True,
                            held_w=w)
        return next(ln for ln in render_status(status_dict(reply)).splitlines() if ln.startswith("no agent"))

    assert line(1400.0, 1400.0) == ("no agent: n[1-2] (2 nodes of the policy never reported; 2800 W held for them, "
                                    "each counted at the most it may draw until it reports)")
    assert line(0.0) == ("no agent: n1 (1 node of the policy never reported; nothing held for it: no node has "
                         "reported its limits yet and the policy declares no gpus_per_node)")
