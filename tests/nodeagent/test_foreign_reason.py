"""A FOREIGN_WRITER GPU always says why (CapManager against the simulated driver, real pynvml).

A try-out: after the foreign writer stopped, ``capctl status`` showed ``! n1 GPU 0: cap state
FOREIGN_WRITER`` with no text for the ~120 s the state lingers, and the detail was empty for ~2 s
around each re-write of the agent (the write cleared the message, the state stayed).
"""

from __future__ import annotations

import re

import pytest

from nodeagent.caps import FOREIGN_WRITER, OK, CapManager

pytestmark = pytest.mark.integration


def _step(clock, node, mgr, desired, n: int) -> list[tuple[str, str]]:
    """``n`` reconciles 1 s apart; [(GPU 0's state, its message)] after each."""
    seen = []
    for _ in range(n):
        clock.advance(1.0)
        node.advance(1.0)
        mgr.reconcile(desired)
        seen.append((mgr.states()[0], mgr.message(0)))
    return seen


def test_a_foreign_writer_state_has_its_reason_while_written_and_after_the_writer_stops(site_node, tmp_path, clock):
    node, backend = site_node
    mgr = CapManager(backend, tmp_path, clock=clock, rewrite_interval_s=30.0)
    desired = {0: 300.0}
    mgr.reconcile(desired)
    node.inject(0, "foreign_writer", 600.0, period_s=5.0)
    live = _step(clock, node, mgr, desired, 70)
    foreign = [m for s, m in live if s == FOREIGN_WRITER]
    assert len(foreign) >= 60 and all(foreign), [m for m in foreign if not m][:3]
    assert any("600.000 W" in m for m in foreign) and all("re-writ" in m for m in foreign)
    node.clear(0, "foreign_writer")
    after = _step(clock, node, mgr, desired, 150)
    lingering = [m for s, m in after if s == FOREIGN_WRITER]
    assert len(lingering) >= 30 and all(lingering), [m for m in lingering if not m][:3]
    # (600 W stays until capctl's next re-write, at most 30 s on: "keeps setting", as while live)
    quiet = [m for m in lingering if "clears after" in m]
    assert len(quiet) >= 60, lingering
    clears = [int(re.search(r"clears after (\d+) s", m).group(1)) for m in quiet]
    assert clears == sorted(clears, reverse=True) and clears[0] >= 110 and clears[-1] <= 1, clears  # a countdown
    assert "set the power limit to 600.000 W" in lingering[-1] and "no foreign write seen since" in lingering[-1]
    assert after[-1] == (OK, "") and node.read(0)["limit_w"] == 300.0


def test_a_restore_held_at_the_allowance_keeps_the_foreign_writer_state_and_reason(site_node, tmp_path, clock):
    """JobEnd of a GPU another process keeps setting: the held restore reported it OK, no text."""
    node, backend = site_node
    mgr = CapManager(backend, tmp_path, clock=clock, rewrite_interval_s=30.0)
    mgr.bind("j", [0])
    mgr.reconcile({0: 200.0})
    node.inject(0, "foreign_writer", 400.0, period_s=2.0)
    seen = _step(clock, node, mgr, {0: 200.0}, 6)
    assert seen[-1][0] == FOREIGN_WRITER, seen
    res = mgr.release("j", ceiling_w={0: 220.0})[0]
    assert res.ok and res.cap_w == pytest.approx(220.0, abs=0.002)
    assert mgr.states()[0] == FOREIGN_WRITER and "400.000 W" in mgr.message(0), (mgr.states(), mgr.message(0))
