"""A policy file an admin loads with ``capctl policy reload FILE`` stays in force across coordinator
restarts (persisted in the state database, as a budget override), against a real coordinator
process restarted with its unit's command line (found by a try-out: a restart went back to the
``--policy`` file without a word, and the PDU limit the reload had added was gone: its PDU at
2,211 W on a 1,000 W limit in the simulated driver's journal)."""

from __future__ import annotations

import contextlib
import signal

import pytest

from tests.coordinator.conftest import Coordinator, importlib_ok, require, wait_for, write_policy

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def _running(tmp_path, policy, state, sig=signal.SIGTERM):
    """A real coordinator on ``policy`` with its state in ``state``, and an admin client; stopped
    with ``sig`` at the end (as a unit restarts it: the same command line)."""
    coord = Coordinator(tmp_path, policy, state_dir=state)
    try:
        with coord.client() as c:
            yield coord, c
    finally:
        coord.stop(sig)


def _domains(client) -> dict:
    return {d.name: d.limit_w for d in client.status().domains}


def test_a_reloaded_policy_stays_in_force_across_restarts_and_one_that_no_longer_loads_is_an_alert(tmp_path):
    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    start = write_policy(tmp_path / "start.yaml", nodes=["n1", "n2"], budget_w=3000.0)
    live = write_policy(tmp_path / "live.yaml", nodes=["n1", "n2"], budget_w=3000.0, pdus={"pdu-a": (["n1"], 1000.0)})
    state = tmp_path / "state"
    with _running(tmp_path, start, state, signal.SIGKILL) as (coord, c):
        assert "pdu-a" not in _domains(c)
        r = c.reload_policy(str(live))
        assert r.ok and "WARNING" not in r.message, r.message
        wait_for(lambda: _domains(c).get("pdu-a") == 1000.0, 5, "pdu-a in force")
    with _running(tmp_path, start, state) as (coord, c):  # the unit's command line again
        wait_for(lambda: _domains(c).get("pdu-a") == 1000.0, 5, "pdu-a in force after the restart")
        st = c.status()
        assert st.policy_path == str(live)
        assert not [a for a in st.alerts if "does not load" in a], list(st.alerts)
        assert f"policy {live} in force, loaded by an admin with policy reload" in coord.log()
        r = c.reload_policy()  # without FILE: the file in force, re-read
        assert r.ok and f"policy {live} loaded" in r.message, r.message
    live.write_text(live.read_text().replace("limit_w: 1000", "limit_w: lots"))
    with _running(tmp_path, start, state) as (coord, c):  # the file broken: its version last loaded runs
        wait_for(lambda: _domains(c).get("pdu-a") == 1000.0, 5, "the last loaded version's pdu-a in force")
        st = c.status()
        assert st.policy_path == str(live)
        alerts = [a for a in st.alerts if a.startswith(f"policy {live}")]
        assert len(alerts) == 1 and "does not load now" in alerts[0] and "last loaded is in force" in alerts[0], \
            list(st.alerts)
        assert "limit_w" in alerts[0] and str(start) in alerts[0]  # the file's first error; the way back
        r = c.reload_policy(str(start))  # the start-up file made the one in force: alert gone
        assert r.ok, r.message
        wait_for(lambda: not [a for a in c.status().alerts if a.startswith(f"policy {live}")], 5, "alert cleared")
    with _running(tmp_path, start, state) as (coord, c):
        st = c.status()
        assert st.policy_path == str(start) and not [a for a in st.alerts if "does not load" in a]


def test_a_fallback_keeps_the_admins_budget_and_a_reloaded_start_file_pins_nothing(tmp_path):
    """Try-out findings. A reloaded file that does not load at a restart left the start-up file in
    force, with its own limits (a PDU limit and a lower budget of the reloaded file gone: 2,750 W
    on a 1,500 W PDU), and the admin's budget override was deleted; now the version last loaded
    runs, the override kept. And reloading the start-up file recorded its path, so a later
    ``--policy`` of another file was ignored; now it records nothing."""
    require(importlib_ok(), "generated gRPC code capctl.v1 missing (make build)")
    a = write_policy(tmp_path / "a.yaml", nodes=["n1", "n2"], budget_w=2000.0)
    b = write_policy(tmp_path / "b.yaml", nodes=["n1", "n2"], budget_w=1900.0)
    c_file = write_policy(tmp_path / "c.yaml", nodes=["n1", "n2"], budget_w=1800.0)
    state = tmp_path / "state"
    with _running(tmp_path, a, state) as (coord, c):
        assert c.reload_policy(str(b)).ok
        assert c.set_budget(1700.0).ok
    b.rename(tmp_path / "b.moved")  # (a share not mounted yet at boot)
    with _running(tmp_path, a, state) as (coord, c):
        st = c.status()
        assert st.policy_path == str(b) and st.budget_w == 1700.0, (st.policy_path, st.budget_w)
        assert any("does not load now" in x and "last loaded is in force" in x for x in st.alerts), list(st.alerts)
    (tmp_path / "b.moved").rename(b)
    with _running(tmp_path, a, state) as (coord, c):
        st = c.status()
        assert st.policy_path == str(b) and st.budget_w == 1700.0  # the override, set under b, kept
        assert c.reload_policy(str(a)).ok  # the start-up file: nothing recorded
    with _running(tmp_path, c_file, state) as (coord, c):  # the unit now names another file
        assert c.status().policy_path == str(c_file)
