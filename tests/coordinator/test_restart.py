"""Coordinator restarts, persistence in the state directory, and user errors at start-up."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from tests.coordinator.conftest import REPO, wait_for, write_policy
from tests.coordinator.fakeagent import FakeAgent, FakeGpu, Ledger

pytestmark = pytest.mark.integration


def test_restart_rebuilds_bindings_from_agents_and_keeps_the_budget(tmp_path, start_coordinator, agents):
    interval = 0.5
    listen = f"unix:{tmp_path / 'agents.sock'}"  # the same address for both incarnations
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1", "n2"], budget_w=3000.0, interval_s=interval)
    first = start_coordinator(policy, listen=listen)
    ledger = Ledger()
    for n in ("n1", "n2"):
        agents.append(FakeAgent(n, listen, [FakeGpu(i) for i in range(4)], ledger, interval_s=interval).start())
    wait_for(lambda: all(a.connected.is_set() for a in agents), 10, "agents connected")
    agents[0].start_job("J1", [0, 1, 2, 3])
    agents[1].start_job("J1", [0, 1])
    agents[1].start_job("J2", [3])
    with first.client() as c:
        wait_for(lambda: len(c.status().jobs) == 2, 10, "jobs visible")
        assert c.set_budget(2500.0).ok
    wait_for(lambda: ledger.total() <= 2500 + 1e-6, 10, "caps within 2500 W")
    first_id = first.info["coordinator_id"]
    assert first.stop() == 0  # SIGTERM: clean shutdown
    assert "Traceback" not in first.log()

    ledger.reset_max()
    second = start_coordinator(policy, listen=listen)
    assert second.info["coordinator_id"] != first_id

    def rebuilt():
        st = second.client().status()
        jobs = {j.job_id: j for j in st.jobs}
        if set(jobs) == {"J1", "J2"} and jobs["J1"].gpus == 6 and jobs["J2"].gpus == 1:
            return st
        return None
    st = wait_for(rebuilt, 10, "bindings rebuilt from the agents")
    elapsed = time.monotonic() - second.ready_mono
    # agents retry every 0.1 s; the coordinator publishes after each interval
    assert elapsed <= 2 * interval + 0.3, f"rebuilt after {elapsed:.2f} s"
    assert st.budget_w == 2500.0  # the admin's budget survived the restart
    assert all(w.coordinator_id == second.info["coordinator_id"] for w in [a.welcomes[-1] for a in agents])
    time.sleep(3 * interval)
    assert ledger.max_sum_w <= 2500 + 1e-6  # the budget held across the restart


def test_corrupt_state_database_reports_and_keeps_running(tmp_path, start_coordinator):
    state = tmp_path / "state"
    state.mkdir()
    (state / "coordinator.db").write_bytes(b"this is not an SQLite database\x00" * 200)
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1600.0)
    coord = start_coordinator(policy, state_dir=state)
    with coord.client() as c:
        st = wait_for(lambda: (s := c.status()) and s.alerts and s, 10, "an alert")
        assert any("state database" in a and "coordinator.db" in a for a in st.alerts)
        r = c.set_budget(1500.0)  # applied on the last good (in-memory) state, loudly not persisted
        assert r.ok and "not persisted" in r.message
        assert c.status().budget_w == 1500.0
    assert coord.proc.poll() is None


def _run(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "coordinator.daemon", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_user_errors_are_one_clean_line(tmp_path):
    common = ["--state-dir", str(tmp_path / "s"), "--admin-socket", str(tmp_path / "a.sock"), "--metrics-port", "-1",
              "--listen", "127.0.0.1:0"]
    r = _run("--policy", str(tmp_path / "missing.yaml"), *common)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "missing.yaml" in r.stderr and r.stderr.startswith("capctl-coordinator: ")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nbudget_w: -5\n")
    r = _run("--policy", str(bad), *common)
    assert r.returncode == 1 and "Traceback" not in r.stderr and f"{bad}:2:" in r.stderr
    r = _run("--policy", str(bad), "--metrics-port", "nope")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    good = write_policy(tmp_path / "good.yaml", nodes=["n1"], budget_w=1600.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run("--policy", str(good), *common[:-2], "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "--listen" in r.stderr


def test_restart_counts_nodes_whose_agents_have_not_reconnected(tmp_path, start_coordinator, agents):
    """The node ledger: after a restart, a node whose agent is not back is held at its last caps
    (stale, spent) instead of being invisible, so the others do not get its watts."""
    interval = 0.25
    listen = f"unix:{tmp_path / 'agents.sock'}"
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1", "n2"], budget_w=3000.0, interval_s=interval)
    first = start_coordinator(policy, listen=listen)
    ledger = Ledger()
    a1 = FakeAgent("n1", listen, [FakeGpu(i) for i in range(4)], ledger, interval_s=interval).start()
    a2 = FakeAgent("n2", listen, [FakeGpu(i) for i in range(4)], ledger, interval_s=interval).start()
    agents += [a1, a2]
    wait_for(lambda: a1.connected.is_set() and a2.connected.is_set(), 10, "agents connected")
    a1.start_job("A", [0, 1])
    a2.start_job("B", [0, 1, 2, 3])
    with first.client() as c:
        wait_for(lambda: c.status().allocated_w > 2990 and ledger.total() > 2990, 10, "allocated")
    time.sleep(4 * interval)
    held = dict(a2.caps())
    a_caps = [a1.caps()[i] for i in (0, 1)]
    a2.stop()  # n2's agent is gone; its GPUs keep their caps
    assert first.stop() == 0
    ledger.reset_max()
    second = start_coordinator(policy, listen=listen)
    with second.client() as c:
        st = wait_for(lambda: (s := c.status()) and len(s.nodes) == 2 and s.jobs and s, 10, "status")
        n2 = next(n for n in st.nodes if n.name == "n2")
        assert n2.stale and [g.enforced_w for g in n2.gpus] == pytest.approx([held[i] for i in range(4)], abs=0.01)
        time.sleep(6 * interval)
    # A did not get n2's watts: n2 is counted at its held caps, so A's caps never rose. (They may come
    # down: the new coordinator starts from prior curves, the learned ones are not persisted.)
    assert all(a1.caps()[i] <= a_caps[k] + 3.0 for k, i in enumerate((0, 1))), (a1.caps(), a_caps)
    assert sum(a1.caps().values()) + sum(held.values()) <= 3000 + 1e-6
    assert ledger.max_sum_w <= 3000 + 1e-6


def test_a_second_coordinator_on_the_same_state_directory_is_refused(tmp_path, start_coordinator):
    """Two coordinators sharing one state directory would overwrite each other's budget and ledger:
    the second is refused with one line naming the first's pid; after the first ends, a new one starts."""
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1600.0)
    first = start_coordinator(policy)
    r = _run("--policy", str(policy), "--state-dir", str(first.state_dir), "--admin-socket", str(tmp_path / "b.sock"),
             "--metrics-port", "-1", "--listen", "127.0.0.1:0")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert f"in use by another coordinator (pid {first.proc.pid}," in r.stderr
    assert first.proc.poll() is None
    # its own state directory but the first's admin socket: refused, and its agent socket (bound
    # before the admin socket failed) is not left behind; the first's sockets are untouched
    own = tmp_path / "own.sock"
    r = _run("--policy", str(policy), "--state-dir", str(tmp_path / "s2"), "--admin-socket", str(first.admin_socket),
             "--metrics-port", "-1", "--listen", f"unix:{own}")
    assert r.returncode == 1 and "another process is serving on it" in r.stderr, r.stderr
    assert not own.exists() and first.admin_socket.exists()
    first.proc.kill()  # kill -9 releases the lock too
    first.proc.wait(10)
    second = start_coordinator(policy, state_dir=first.state_dir)
    assert second.proc.poll() is None


def test_the_ready_file_names_no_port_for_a_unix_socket(tmp_path):
    """gRPC binds a unix socket as "port 1": the ready file says null, a TCP listener its port."""
    from types import SimpleNamespace

    from coordinator import daemon

    coord = SimpleNamespace(coordinator_id="x", dry_run=False, policy=SimpleNamespace(budget_w=1.0), interval_s=1.0)
    for listen, port, want in (("unix:/run/c.sock", 1, None), ("127.0.0.1:7373", 7373, 7373)):
        args = SimpleNamespace(ready_file=str(tmp_path / "ready.json"), state_dir="s", policy="p.yaml")
        daemon._announce(args, coord, SimpleNamespace(admin=None), (listen, port), None, None)
        ready = json.loads((tmp_path / "ready.json").read_text())
        assert ready["listen"] == listen and ready["port"] == want
