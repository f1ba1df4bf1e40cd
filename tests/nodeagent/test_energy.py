"""Per-job energy of the node agent (nodeagent/energy.py): counter differences charged to the jobs
bound in each interval, shared GPUs split equally, counter resets and unreadable GPUs; and the
agent reading the counters at JobStart, JobEnd and every report (on the pure-Python device)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace as NS

import pytest

from capctl.v1 import capctl_pb2
from nodeagent.energy import EnergyMeter
from tests.nodeagent.puredevice import PureDevice
from tests.nodeagent.test_agent_logic import job_start, make_agent


def s(index, energy_j, t, reasons=(), error=None):
    return NS(index=index, energy_j=energy_j, timestamp_s=t, clocks_event_reasons=reasons, error=error)


def test_a_job_gets_the_counter_differences_of_its_gpus_only():
    m = EnergyMeter()
    m.observe([s(0, 100.0, 0.0), s(1, 50.0, 0.0)], {})
    m.start("A", 0.0, 1)
    m.observe([s(0, 400.0, 1.0, ("SW_POWER_CAP",)), s(1, 80.0, 1.0)], {0: ["A"]})
    m.observe([s(0, 1000.0, 3.0, ("HW_THERMAL_SLOWDOWN",)), s(1, 90.0, 3.0)], {0: ["A"]})
    rec = m.finish("A", 3.0)
    assert rec.energy_j == 900.0 and rec.gpu_s == 3.0 and rec.capped_s == 1.0 and rec.thermal_s == 2.0
    assert rec.power_w == 300.0 and rec.peak_power_w == 300.0 and rec.end_time_s == 3.0 and not m.jobs


def test_a_shared_gpu_is_split_equally_and_never_counted_twice():
    m = EnergyMeter()
    m.observe([s(0, 0.0, 0.0)], {})
    m.start("A", 0.0, 1)
    m.observe([s(0, 300.0, 1.0)], {0: ["A"]})  # A alone
    m.start("B", 1.0, 1)
    m.observe([s(0, 900.0, 2.0)], {0: ["A", "B"]})  # shared: 600 J split
    a, b = m.jobs["A"], m.jobs["B"]
    assert (a.energy_j, b.energy_j) == (600.0, 300.0) and (a.gpu_s, b.gpu_s) == (1.5, 0.5)
    assert a.energy_j + b.energy_j == 900.0


def test_a_counter_reset_charges_the_energy_since_the_reset():
    m = EnergyMeter()
    m.observe([s(0, 5000.0, 0.0)], {})
    m.start("A", 0.0, 1)
    m.observe([s(0, 5300.0, 1.0)], {0: ["A"]})
    m.observe([s(0, 120.0, 2.0)], {0: ["A"]})  # driver reload: the counter restarted at 0
    m.observe([s(0, 420.0, 3.0)], {0: ["A"]})
    rec = m.finish("A", 3.0)
    assert rec.energy_j == 300.0 + 120.0 + 300.0 and rec.resets == 1


def test_unreadable_readings_are_skipped_and_the_gap_charged_later():
    m = EnergyMeter()
    m.observe([s(0, 0.0, 0.0)], {})
    m.start("A", 0.0, 1)
    m.observe([s(0, math.nan, 1.0, error="GPU is lost")], {0: ["A"]})
    m.observe([s(0, math.nan, 1.5)], {0: ["A"]})
    m.observe([s(0, -1.0, 1.7)], {0: ["A"]})
    m.observe([s(0, 700.0, 2.0)], {0: ["A"]})
    assert m.jobs["A"].energy_j == 700.0 and m.jobs["A"].gpu_s == 2.0


def test_the_agent_reads_the_counters_at_job_start_end_and_every_report(tmp_path):
    dev = PureDevice(2)
    agent = make_agent(tmp_path, dev)
    dev.gpus[0].energy_j, dev.gpus[1].energy_j = 1000.0, 2000.0
    agent.tick()  # a report before the job: its energy belongs to nobody
    dev.gpus[0].energy_j += 50.0  # between the last report and JobStart: not the job's
    assert job_start(agent, "J1", 0, 1).ok
    dev.gpus[0].energy_j += 300.0
    dev.gpus[1].energy_j += 200.0
    agent.tick()
    (je,) = agent.link.sent[-1].telemetry.job_energy
    assert je.job_id == "J1" and je.node == "n1" and je.energy_j == 500.0 and je.gpus == 2 and je.end_time_s == 0
    dev.gpus[0].energy_j += 10.0  # after the last report, before JobEnd: the job's
    reply = agent.job_end(capctl_pb2.JobEndRequest(job_id="J1"))
    assert reply.ok
    ended = agent.link.sent[-1].job_ended
    assert ended.job_id == "J1" and ended.energy.energy_j == 510.0 and ended.energy.end_time_s > 0
    agent.tick()
    assert not agent.link.sent[-1].telemetry.job_energy  # nothing left running


def test_two_jobs_on_one_gpu_share_it_at_the_agent(tmp_path):
    dev = PureDevice(1)
    agent = make_agent(tmp_path, dev)
    assert job_start(agent, "A", 0).ok
    dev.gpus[0].energy_j += 100.0
    assert job_start(agent, "B", 0).ok  # A had the GPU alone until now
    dev.gpus[0].energy_j += 100.0
    agent.job_end(capctl_pb2.JobEndRequest(job_id="A"))
    assert agent.link.sent[-1].job_ended.energy.energy_j == pytest.approx(150.0)
    dev.gpus[0].energy_j += 40.0
    agent.job_end(capctl_pb2.JobEndRequest(job_id="B"))
    assert agent.link.sent[-1].job_ended.energy.energy_j == pytest.approx(90.0)


def test_an_ended_jobs_energy_is_sent_again_after_a_reconnect(tmp_path):
    dev = PureDevice(1)
    agent = make_agent(tmp_path, dev)
    assert job_start(agent, "J1", 0).ok
    dev.gpus[0].energy_j += 250.0
    agent.link.connected = False  # the coordinator is away: the link drops what it is given
    agent.job_end(capctl_pb2.JobEndRequest(job_id="J1"))
    agent.tick()
    assert not agent.link.sent[-1].telemetry.job_energy  # no reconnect yet: not repeated
    agent.link.connected = True
    agent.hello()  # reconnect
    agent.tick()
    (je,) = agent.link.sent[-1].telemetry.job_energy
    assert je.job_id == "J1" and je.energy_j == 250.0 and je.end_time_s > 0
    assert je.user == "alice"  # who ran it travels with it: a coordinator that never saw the binding keeps it
    agent.tick()
    assert not agent.link.sent[-1].telemetry.job_energy  # once per reconnect


def test_the_energy_record_keeps_who_ran_the_job_across_a_restart():
    m = EnergyMeter()
    m.start("J", 1000.0, 2, {"user": "alice", "partition": "gpu", "account": "proj", "gpu_indices": [0, 1]})
    m.start("J", 1000.0, 2, {"user": "mallory"})  # idempotent: the first binding's names stay
    m.finish("J", 1010.0)
    m.start("K", 1005.0, 1, {"user": "bob"})
    doc = m.snapshot({})
    doc["jobs"]["K"].pop("partition")  # a state file written before these fields: still read
    back = EnergyMeter()
    back.start("K", 1005.0, 1, {"user": "bob", "partition": "big"})  # from the restored binding
    assert back.restore(doc, {}) == []
    (ended,) = back.kept_ended(1011.0)
    assert (ended.user, ended.partition, ended.account) == ("alice", "gpu", "proj")
    assert back.jobs["K"].user == "bob" and back.jobs["K"].partition == "big"  # the file lacked it: the binding's


def test_ended_records_are_bounded_in_age_and_count():
    from nodeagent import energy

    m = EnergyMeter()
    for i in range(energy.KEEP_ENDED_MAX + 5):
        m.start(f"J{i}", 0.0, 1)
        m.finish(f"J{i}", 1000.0 + i)
    kept = m.kept_ended(1000.0 + energy.KEEP_ENDED_MAX)
    assert len(kept) == energy.KEEP_ENDED_MAX and kept[0].job_id == "J5"
    assert [r.job_id for r in m.kept_ended(1000.0 + energy.KEEP_ENDED_MAX + 4 + energy.KEEP_ENDED_S)] == [
        f"J{energy.KEEP_ENDED_MAX + 4}"]


def _restarted(tmp_path, dev):
    """A new agent on the same state directory and devices, as the daemon starts it (load_state)."""
    agent = make_agent(tmp_path, dev)
    agent.load_state()
    return agent


def test_a_restarted_agent_reports_the_jobs_energy_from_job_start(tmp_path, caplog):
    dev = PureDevice(2)
    agent = make_agent(tmp_path, dev)
    dev.gpus[0].energy_j, dev.gpus[1].energy_j = 1000.0, 2000.0
    agent.tick()
    assert job_start(agent, "J1", 0, 1).ok  # the state file is written here (job start)
    dev.gpus[0].energy_j += 300.0
    dev.gpus[1].energy_j += 200.0
    agent.tick()
    assert agent.link.sent[-1].telemetry.job_energy[0].energy_j == 500.0
    dev.gpus[0].energy_j += 100.0  # the agent crashes now (no stop, no save); the job runs on
    agent = _restarted(tmp_path, dev)
    dev.gpus[1].energy_j += 50.0  # while it was down or since it is back: all the job's
    agent.tick()
    (je,) = agent.link.sent[-1].telemetry.job_energy
    assert je.job_id == "J1" and je.energy_j == 650.0 and je.resets == 0 and je.gpus == 2
    agent.save_state()  # a clean stop saves the latest readings: nothing is charged twice
    agent = _restarted(tmp_path, dev)
    dev.gpus[0].energy_j = 40.0  # driver reload: GPU 0's counter restarted at 0, 40 J since
    dev.gpus[1].energy_j += 10.0
    agent.tick()
    (je,) = agent.link.sent[-1].telemetry.job_energy
    assert je.energy_j == 700.0 and je.resets == 1  # GPU 0's energy between the last reading and the reload: lost
    agent.save_state()
    listed = dev.devices  # another device at index 1: its counter is not the old one's
    dev.devices = lambda: [dataclasses.replace(d, uuid="GPU-replaced") if d.index == 1 else d for d in listed()]
    dev.gpus[1].energy_j = 99999.0
    with caplog.at_level("WARNING", logger="capctl.agent"):
        agent = _restarted(tmp_path, dev)
    assert any("energy.readings.1" in r.getMessage() and "GPU-replaced" in r.getMessage() for r in caplog.records)
    dev.gpus[1].energy_j += 5.0
    agent.tick()  # GPU 1's first reading since: the start of its next interval, not charged
    agent.tick()
    assert agent.link.sent[-1].telemetry.job_energy[0].energy_j == 700.0
    reply = agent.job_end(capctl_pb2.JobEndRequest(job_id="J1"))
    assert reply.ok and agent.link.sent[-1].job_ended.energy.energy_j == 700.0


def test_a_malformed_energy_snapshot_names_the_field_and_keeps_the_rest():
    m = EnergyMeter()
    m.start("A", 10.0, 1)
    m.start("B", 10.0, 1)
    doc = {"readings": {"0": {"energy_j": 500.0, "timestamp_s": 20.0, "uuid": "U0"},
                        "1": {"energy_j": "x", "timestamp_s": 20.0, "uuid": "U1"}},
           "jobs": {"A": {"job_id": "A", "start_time_s": 10.0, "energy_j": 123.0, "gpu_s": 10.0, "capped_s": 0.0,
                          "thermal_s": 0.0, "power_w": 12.3, "peak_power_w": 20.0, "end_time_s": 0.0, "resets": 0,
                          "gpus": 1},
                    "B": {"job_id": "B", "energy_j": -5.0}}}
    problems = m.restore(doc, {0: "U0", 1: "U1"})
    assert any(p.startswith("energy.readings.1: energy_j 'x'") for p in problems), problems
    assert any(p.startswith("energy.jobs.B:") and "energy_j -5.0" in p for p in problems), problems
    assert m.jobs["A"].energy_j == 123.0 and m.jobs["B"].energy_j == 0.0
    m.observe([s(0, 600.0, 21.0)], {0: ["A"]})
    assert m.jobs["A"].energy_j == 223.0
    assert m.restore(None, {}) == [] and m.restore([1], {}) == ["energy: list is not an object"]
