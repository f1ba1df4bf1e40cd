"""The coordinator's tick grid and report advice (coordinator/tickphase.py) and the agent's report
clock (nodeagent/reportclock.py): pure logic."""

from __future__ import annotations

import math

import pytest

from coordinator import tickphase
from nodeagent.reportclock import ReportClock


def test_leads_are_stable_per_node_and_spread_over_the_window():
    leads = [tickphase.lead_s(f"n{i:04d}", 1.0) for i in range(1000)]
    assert tickphase.lead_s("n0007", 1.0) == leads[7]  # same node, same place (restart, failover)
    assert min(leads) >= tickphase.LEAD_MIN_FRACTION and max(leads) <= tickphase.LEAD_MAX_FRACTION
    # spread: each tenth of the window holds some of the 1,000 nodes, none holds a quarter of them
    width = tickphase.LEAD_MAX_FRACTION - tickphase.LEAD_MIN_FRACTION
    bins = [0] * 10
    for x in leads:
        bins[min(9, int((x - tickphase.LEAD_MIN_FRACTION) / width * 10))] += 1
    assert min(bins) > 50 and max(bins) < 250, bins
    assert tickphase.lead_s("n0007", 10.0) == pytest.approx(10 * leads[7])


def test_advice_lands_the_report_its_lead_before_the_next_grid_tick():
    lead = tickphase.lead_s("nodeA", 1.0)
    # a plan written 0.1 s after the tick at 100.0: the next tick is at 101.0
    advice = tickphase.report_in_s(101.0, 100.1, "nodeA", 1.0)
    assert 100.1 + advice == pytest.approx(101.0 - lead)
    # written after the lead before the next tick, or after it (a slow reconcile): report soon
    assert tickphase.report_in_s(101.0, 101.0 - lead + 0.01, "nodeA", 1.0) == pytest.approx(0.1)
    assert tickphase.report_in_s(101.0, 101.3, "nodeA", 1.0) == pytest.approx(0.1)
    assert tickphase.report_in_s(104.0, 100.0, "nodeA", 1.0) == pytest.approx(2.0)  # never over 2 intervals
    assert tickphase.report_in_s(math.nan, 100.0, "nodeA", 1.0) == 0.0  # loop not running: no advice
    assert tickphase.report_in_s(101.0, 100.0, "nodeA", 0.0) == 0.0


def test_grid_keeps_its_phase_after_an_overrun_and_restarts_after_an_interval_change():
    assert tickphase.next_grid_tick(10.0, 10.002, 1.0) == pytest.approx(11.0)
    # the tick at 10.0 ran 2.5 s late: the missed ticks are skipped, the phase kept
    assert tickphase.next_grid_tick(10.0, 12.5, 1.0) == pytest.approx(13.0)
    # the grid point is more than one (new, shorter) interval ahead: restart one interval from now
    assert tickphase.next_grid_tick(20.0, 10.0, 0.5) == pytest.approx(10.5)
    # reconciles taking 1.6 s at a 1 s interval: the grid stretches to 1.6 s + 5 % from this start
    assert tickphase.next_grid_tick(10.0, 10.6, 1.0, busy_s=1.6) == pytest.approx(10.6 + 1.68)
    assert tickphase.next_grid_tick(10.0, 10.0, 1.0, busy_s=0.4) == pytest.approx(11.0)  # not busy: one interval


def test_report_clock_follows_advice_and_ignores_advice_out_of_bounds():
    rc = ReportClock()
    assert rc.due_mono(5.0) == 5.0  # nothing yet: report at once
    rc.reported(5.0, 1.0)
    assert rc.due_mono(5.1) == pytest.approx(6.0)  # own period
    assert rc.advise(0.7, 5.2, 1.0) and rc.due_mono(5.2) == pytest.approx(5.9)
    for bad in (0.0, -1.0, math.nan, math.inf, 2.5):  # no advice, or more than two intervals
        assert not rc.advise(bad, 5.3, 1.0)
    assert rc.due_mono(5.3) == pytest.approx(5.9) and rc.advised == 1
    rc.reported(5.9, 1.0)
    assert rc.due_mono(6.0) == pytest.approx(6.9)
    # an advice received while a tick runs (after it began) is kept by that tick's report
    assert rc.advise(0.6, 7.0, 1.0)
    rc.reported(6.95, 1.0)
    assert rc.due_mono(7.0) == pytest.approx(7.6)
    rc.report_now(8.0, 0.05)
    assert rc.due_mono(8.0) == pytest.approx(8.05)
