"""The coordinator's finished jobs (coordinator/finished.py, coordinator/jobenergy.py): both store
backends behind one interface, bounded retention, surviving a reopen, broken files; the agents'
reports summed over a job's nodes; a shared GPU's watts split between its jobs."""

from __future__ import annotations

import time

import pytest

from capctl.v1 import capctl_pb2 as pb
from coordinator.finished import FinishedJob, MemoryFinishedJobs, Retention, SqliteFinishedJobs, open_store
from coordinator.jobenergy import JobEnergyBook
from coordinator.registry import Binding
from coordinator.store import StoreError


def job(job_id: str, end_s: float, energy_j: float = 100.0) -> FinishedJob:
    return FinishedJob(job_id=job_id, nodes=("n1",), gpus=1, start_time_s=end_s - 10, end_time_s=end_s,
                       energy_j=energy_j, gpu_s=10.0)


@pytest.fixture(params=["sqlite", "memory"])
def make_store(request, tmp_path):
    def make(retention=None):
        if request.param == "sqlite":
            return SqliteFinishedJobs(str(tmp_path / "state"), retention)
        return MemoryFinishedJobs(retention)
    return make


def test_both_backends_keep_list_and_replace_jobs(make_store):
    st = make_store()
    now = time.time()
    for i in range(5):
        st.put(job(f"J{i}", now - 100 + i, energy_j=10.0 * i))
    st.put(job("J2", now - 98, energy_j=999.0))  # the same job again replaces it
    assert [j.job_id for j in st.since(0.0)] == ["J4", "J3", "J2", "J1", "J0"]
    assert [j.job_id for j in st.since(now - 97.5)] == ["J4", "J3"]
    assert [j.job_id for j in st.since(0.0, limit=2)] == ["J4", "J3"]
    assert st.get("J2").energy_j == 999.0 and st.get("nope") is None


def test_retention_is_bounded_by_age_and_count(make_store):
    st = make_store(Retention(max_age_s=3600.0, max_jobs=3))
    now = time.time()
    st.put(job("old", now - 7200))
    assert st.get("old") is None  # older than the retention at once
    for i in range(5):
        st.put(job(f"J{i}", now - 10 + i))
    assert [j.job_id for j in st.since(0.0)] == ["J4", "J3", "J2"]


def test_sqlite_finished_jobs_survive_a_reopen_and_bad_rows_are_skipped(tmp_path):
    st = SqliteFinishedJobs(str(tmp_path))
    st.put(job("J1", time.time(), energy_j=123.4))
    st._db.execute("INSERT INTO finished_jobs VALUES ('bad', ?, 'not json')", (time.time(),))
    st.close()
    again = SqliteFinishedJobs(str(tmp_path))
    assert [j.job_id for j in again.since(0.0)] == ["J1"] and again.get("J1").energy_j == 123.4
    again.close()


def test_a_corrupt_database_is_a_clear_error_and_the_daemon_keeps_jobs_in_memory(tmp_path):
    (tmp_path / "finished-jobs.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="finished-jobs.db"):
        SqliteFinishedJobs(str(tmp_path))
    st, err = open_store(str(tmp_path))
    assert isinstance(st, MemoryFinishedJobs) and "finished-jobs.db" in err


def test_retention_refuses_non_positive_bounds():
    with pytest.raises(ValueError, match="positive"):
        Retention(max_age_s=0)
    with pytest.raises(ValueError, match="positive"):
        Retention(max_jobs=0)


def je(job_id, node, energy_j, peak_w, end_s=0.0, start_s=1000.0, gpus=2):
    return pb.JobEnergy(job_id=job_id, node=node, energy_j=energy_j, gpu_s=2 * 10.0, capped_s=3.0, thermal_s=1.0,
                        power_w=peak_w, peak_power_w=peak_w, start_time_s=start_s, end_time_s=end_s, gpus=gpus)


def test_the_book_sums_a_jobs_nodes_and_a_final_report_wins():
    book = JobEnergyBook()
    book.on_telemetry("n1", pb.NodeTelemetry(job_energy=[je("J", "n1", 100.0, 500.0)]))
    book.on_telemetry("n2", pb.NodeTelemetry(job_energy=[je("J", "n2", 50.0, 300.0)]))
    assert book.energy_j() == {"J": 150.0}
    book.on_job_ended("n1", pb.JobEnded(job_id="J", node="n1", energy=je("J", "n1", 120.0, 600.0, end_s=1010.0)))
    book.on_telemetry("n1", pb.NodeTelemetry(job_energy=[je("J", "n1", 110.0, 600.0)]))  # late, older
    book.on_job_ended("n2", pb.JobEnded(job_id="J", node="n2", energy=je("J", "n2", 60.0, 300.0, end_s=1011.0)))
    bindings = [Binding("J", "n1", (0, 1), user="alice", start_time_s=1000.0), Binding("J", "n2", (0, 1))]
    rec = book.finish("J", bindings, end_time_s=2000.0)
    assert rec.energy_j == 180.0 and rec.nodes == ("n1", "n2") and rec.gpus == 4 and rec.user == "alice"
    assert rec.end_time_s == 1011.0 and rec.mean_power_w == pytest.approx(180.0 / 11.0)
    assert rec.peak_power_w == 900.0 and rec.capped_s == 6.0 and rec.gpu_s == 40.0 and rec.complete
    assert not book.jobs


def test_a_job_whose_binding_this_coordinator_never_saw_keeps_its_user_from_the_agents():
    """A job that started and ended while another coordinator led (or none did) has no binding
    here; its agents' energy records name who ran it (found by a try-out: user, partition and
    account were empty in the finished record of every job whose end overlapped a failover)."""
    book = JobEnergyBook()
    rec = je("J", "n2", 60.0, 300.0, end_s=1011.0)
    rec.user, rec.partition, rec.account = "alice", "gpu", "proj"
    book.on_job_ended("n2", pb.JobEnded(job_id="J", node="n2", energy=rec))
    out = book.finish("J", [], end_time_s=2000.0)
    assert (out.user, out.partition, out.account) == ("alice", "gpu", "proj") and out.nodes == ("n2",)
    old = je("K", "n1", 10.0, 100.0, end_s=1011.0)  # an older agent: no names, as before
    book.on_job_ended("n1", pb.JobEnded(job_id="K", node="n1", energy=old))
    assert book.finish("K", [], end_time_s=2000.0).user == ""


def test_a_node_without_a_final_report_makes_the_record_incomplete():
    book = JobEnergyBook()
    book.on_telemetry("n1", pb.NodeTelemetry(job_energy=[je("J", "n1", 100.0, 500.0)]))
    book.on_job_ended("n1", pb.JobEnded(job_id="J", node="n1"))  # an older agent: no energy
    rec = book.finish("J", [Binding("J", "n1", (0,))], end_time_s=1005.0)
    assert rec.energy_j == 100.0 and not rec.complete and rec.end_time_s == 1005.0


def test_a_shared_gpu_counts_once_in_the_jobs_allocated_watts():
    from coordinator.loop import _job_allocated_w, _Tally

    tally = _Tally(accounted={("n1", 0): 400.0, ("n1", 1): 300.0}, sharers={("n1", 0): 2, ("n1", 1): 1})
    desired = {("n1", 0): 600.0}  # GPU 1 is not in the last decision: it still holds its 300 W
    a = _job_allocated_w([("n1", 0), ("n1", 1)], desired, tally)
    b = _job_allocated_w([("n1", 0)], desired, tally)
    assert a == 300.0 + 300.0 and b == 300.0 and a + b == 600.0 + 300.0


def test_bad_energy_reports_are_ignored_with_a_reason():
    from coordinator.jobenergy import problem

    book = JobEnergyBook()
    bad = [pb.JobEnergy(job_id="", energy_j=1.0), pb.JobEnergy(job_id="J", energy_j=float("nan")),
           pb.JobEnergy(job_id="K", gpu_s=-1.0), pb.JobEnergy(job_id="x" * 200)]
    book.on_telemetry("n1", pb.NodeTelemetry(job_energy=bad + [je("OK", "n1", 5.0, 10.0)]))
    assert book.energy_j() == {"OK": 5.0}
    assert "energy_j nan" in problem(bad[1]) and "gpu_s -1.0" in problem(bad[2]) and "1-128" in problem(bad[3])


def test_a_multi_node_jobs_gpus_are_summed_over_its_nodes_and_an_unknown_node_set_is_incomplete():
    """The first node's JobEnded unbinds it; when the last one ends the job only that node's binding
    is left: the GPU count is summed per node from the energy records too (a try-out: 8 GPUs on 2
    nodes shown as 4). Without any binding (the coordinator never saw it) the record is incomplete."""
    book = JobEnergyBook()
    book.on_job_ended("n1", pb.JobEnded(job_id="J", node="n1", energy=je("J", "n1", 100.0, 500.0, end_s=1010.0, gpus=4)))
    book.on_job_ended("n2", pb.JobEnded(job_id="J", node="n2", energy=je("J", "n2", 90.0, 500.0, end_s=1011.0, gpus=4)))
    rec = book.finish("J", [Binding("J", "n2", (0, 1, 2, 3), user="alice")], end_time_s=2000.0)
    assert rec.gpus == 8 and rec.nodes == ("n1", "n2") and rec.complete
    book.on_job_ended("n2", pb.JobEnded(job_id="K", node="n2", energy=je("K", "n2", 90.0, 500.0, end_s=1011.0, gpus=3)))
    rec = book.finish("K", [], end_time_s=2000.0)
    assert rec.gpus == 3 and not rec.complete
