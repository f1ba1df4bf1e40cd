"""Process spawning that is safe with gRPC loaded (:mod:`capctl.lifeline`; DEVELOPERS.md, "No fork
with gRPC loaded").

- a SIGKILLed parent leaves no daemon behind, also for daemons it spawned from a worker thread
  that has ended (the case where ``PR_SET_PDEATHSIG`` would have killed them early);
- 200 spawns in a row from a process with live gRPC servers and channels never hang;
- no source file forks or passes a pre-exec callback to subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capctl import lifeline
from tests.support.processes import require_coordinator, require_simulated_gpus
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]

PARENT = r"""
import json, sys, threading, time
from concurrent import futures
from pathlib import Path
import grpc
from grpc_health.v1 import health, health_pb2_grpc
from capctl.demo.processes import start_agent, start_coordinator
from capctl.simgpu.node import SimNode

work = Path(sys.argv[1])
server = grpc.server(futures.ThreadPoolExecutor(2))          # gRPC loaded and serving
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
server.add_insecure_port(f"unix:{work}/health.sock")
server.start()
from tests.support.processes import write_policy
policy = write_policy(work / "policy.yaml", nodes=["n1"], budget_w=1000)
procs = {}
def spawn_coordinator():                                       # from a worker thread that then ends
    procs["coordinator"] = start_coordinator(work, policy)
t = threading.Thread(target=spawn_coordinator); t.start(); t.join()
sim = SimNode.create(work / "sim.state", 2)
procs["agent"] = start_agent(work, "n1", procs["coordinator"].address, sim_env=sim.env())
print(json.dumps({k: p.pid for k, p in procs.items()}), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.integration  # a real coordinator and agent on wall-clock deadlines (one rerun: tests/conftest.py)
def test_sigkill_of_the_parent_leaves_no_daemon_behind(tmp_path):
    require_coordinator()
    require_simulated_gpus()
    parent = lifeline.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, die_with_parent=False)
    try:
        line = parent.stdout.readline()
        assert line, parent.stderr.read()
        pids = json.loads(line)
        # the coordinator outlives the thread that spawned it, and both daemons come up
        wait_for(lambda: (tmp_path / "agent-n1.sock").exists() and (tmp_path / "coordinator-admin.sock").exists(),
                 30, "both daemons serving")
        assert all(_alive(p) for p in pids.values())
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(lambda: not any(_alive(p) for p in pids.values()), 30, f"daemons {pids} gone")
        # they stopped cleanly on their lifeline's SIGTERM: sockets removed
        assert not (tmp_path / "agent-n1.sock").exists() and not (tmp_path / "coordinator-admin.sock").exists()
    finally:
        parent.kill()
        parent.wait(10)


STRESS = r"""
import faulthandler, sys, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from capctl import lifeline

faulthandler.dump_traceback_later(150, exit=True)             # a hang prints every stack, then exits 1
server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
stub = health_pb2_grpc.HealthStub(channel)
stop, calls = threading.Event(), [0]
def hammer():                                                  # RPCs in flight during every spawn
    while not stop.is_set():
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        calls[0] += 1
threads = [threading.Thread(target=hammer) for _ in range(3)]
for t in threads: t.start()
ok = 0
for k in range(200):
    p = lifeline.Popen(["true"] if k % 2 else [sys.executable, "-c", "pass"])
    ok += p.wait(timeout=60) == 0
stop.set()
for t in threads: t.join()
print(ok, calls[0], flush=True)
"""


def test_200_spawns_with_live_grpc_never_hang():
    """With a pre-exec callback (a real fork) the same script runs gRPC's fork handlers ("Other
    threads are currently calling into gRPC, skipping fork() handlers") and 3-4 of the 200 children
    fail; the lifeline's vfork+exec runs none."""
    env = {**os.environ, "GRPC_VERBOSITY": "INFO"}  # gRPC logs when its fork handlers run
    proc = lifeline.Popen([sys.executable, "-c", STRESS], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"spawning hung:\n{err[-6000:]}")
    assert proc.returncode == 0, err[-6000:]
    spawned, rpcs = (int(x) for x in out.split())
    assert spawned == 200 and rpcs > 0
    assert "fork" not in err, err[-3000:]


def test_a_lifeline_child_is_reaped_and_its_pipe_closed():
    p = lifeline.Popen([sys.executable, "-c", "import os, sys; print(os.environ.get('CAPCTL_LIFELINE_FD'))"],
                       stdout=subprocess.PIPE, text=True)
    fd_text, pid_text = p.communicate(timeout=60)[0].strip().split(":")
    assert int(fd_text) >= 3 and int(pid_text) == os.getpid() and p._lifeline_w is None  # released once reaped
    q = lifeline.Popen([sys.executable, "-c", "import os; print(os.environ.get('CAPCTL_LIFELINE_FD'))"],
                       stdout=subprocess.PIPE, text=True, die_with_parent=False)
    assert q.communicate(timeout=60)[0].strip() == "None"


def test_watch_parent_sends_sigterm_when_the_pipe_closes(monkeypatch):
    r, w = os.pipe()
    got = []
    monkeypatch.setattr(os, "getppid", lambda: 4242)  # as if our parent (pid 4242) held the write end
    monkeypatch.setenv(lifeline.LIFELINE_ENV, f"{r}:4242")
    monkeypatch.setattr(lifeline, "KILL_AFTER_S", 3600.0)
    monkeypatch.setattr(os, "kill", lambda pid, sig: got.append((pid, sig)))
    assert lifeline.watch_parent() is True
    assert lifeline.LIFELINE_ENV not in os.environ  # our own children do not inherit it
    time.sleep(0.2)
    assert got == []  # parent still there
    os.close(w)
    wait_for(lambda: got, 10, "SIGTERM on EOF")
    assert got == [(os.getpid(), signal.SIGTERM)]
    with open(__file__) as regular:
        for stale in ("not-a-number", f"{r}:1", f"{regular.fileno()}:4242"):  # malformed; not our parent's; no pipe
            monkeypatch.setenv(lifeline.LIFELINE_ENV, stale)
            assert lifeline.watch_parent() is False, stale


def test_no_source_forks_or_passes_a_pre_exec_callback():
    needles = ("preexec" + "_fn", "os." + "fork(", "os." + "forkpty(")
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        if any(part in (".venv", "build", ".git") for part in path.relative_to(ROOT).parts):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(needle in line for needle in needles):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []


HANG = """
import threading

def test_blocks_in_c():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # blocked in C: pytest-timeout's signal method could not interrupt this
"""


def test_a_hung_test_fails_fast_with_stacks_and_is_named(tmp_path):
    """The suite's own configuration (pyproject.toml: thread method) ends a test blocked in C,
    prints every thread's stack, and leaves the test's id where .ci/run reads it."""
    (tmp_path / "test_hang.py").write_text(HANG)
    current = tmp_path / "current"
    env = {**os.environ, "CAPCTL_TEST_CURRENT_FILE": str(current)}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
                          "-p", "tests.conftest", "-p", "no:cacheprovider", "--timeout", "3", "-q",
                          str(tmp_path / "test_hang.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and time.monotonic() - t0 < 60
    text = out.stdout + out.stderr
    assert "Timeout" in text and "Stack of" in text and "lock.acquire()" in text, text[-3000:]
    assert current.read_text().strip().endswith("test_hang.py::test_blocks_in_c")
