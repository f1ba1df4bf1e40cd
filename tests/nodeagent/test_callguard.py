"""Per-GPU NVML call timeouts (nodeagent/callguard.py) on a pure-Python device whose GPU 1 hangs.

The hang is a real blocked call (a thread waiting on an event), as a hung driver call blocks the
calling thread; the real-agent test with the simulated ``nvml_stall`` fault is
tests/coordinator/test_device_faults.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from capctl import capstates
from nodeagent.backend import NvmlStalledError
from nodeagent.callguard import GuardedBackend
from tests.nodeagent.puredevice import PureDevice
from tests.nodeagent.test_agent_logic import cap_states, job_start, make_agent, plan

TIMEOUT_S = 0.2


class HangingDevice(PureDevice):
    """A PureDevice whose calls on the GPUs in ``hung`` block until :meth:`release` (counted)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hung: set[int] = set()
        self.calls = {i: 0 for i in range(len(self.gpus))}
        self._released = threading.Event()

    def hang(self, index: int) -> None:
        self._released.clear()
        self.hung.add(index)

    def release(self) -> None:
        self.hung.clear()
        self._released.set()

    def _gpu(self, index, operation):
        self.calls[index] = self.calls.get(index, 0) + 1
        if index in self.hung:
            assert self._released.wait(30.0)
        return super()._gpu(index, operation)


def _workers() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("nvml-gpu"))


@pytest.fixture
def hanging():
    dev = HangingDevice(3)
    guard = GuardedBackend(dev, TIMEOUT_S)
    yield dev, guard
    dev.release()
    guard.close = lambda: None  # PureDevice has no close; stop the workers only
    for w in guard._workers.values():
        w.stop()


def test_a_hung_gpu_times_out_alone_is_refused_at_once_and_recovers(hanging):
    dev, guard = hanging
    before = len(_workers())
    dev.hang(1)
    t0 = time.monotonic()
    samples = guard.telemetry_all()
    took_s = time.monotonic() - t0
    assert TIMEOUT_S <= took_s < TIMEOUT_S + 0.5  # one deadline for all GPUs
    assert [s.ok for s in samples] == [True, False, True]
    assert samples[1].error_type == "NvmlStalledError" and "has not returned" in samples[1].error
    calls = dict(dev.calls)
    for _ in range(20):  # while the call is outstanding: refused at once, nothing reaches the GPU
        t0 = time.monotonic()
        assert not guard.telemetry_all()[1].ok
        with pytest.raises(NvmlStalledError):
            guard.set_cap_w(1, 300.0)
        assert time.monotonic() - t0 < TIMEOUT_S
    assert dev.calls[1] == calls[1] and dev.calls[0] == calls[0] + 20
    assert (1, 300.0) not in dev.writes and guard.stalled().keys() == {1}
    assert len(_workers()) - before == 3  # one thread per GPU, no growth
    assert guard.set_cap_w(0, 350.0).cap_w == 350.0  # the other GPUs are written meanwhile
    assert [d.uuid for d in guard.devices()] == [f"GPU-pure-{i:04d}" for i in range(3)]  # facts last known
    dev.release()
    deadline = time.monotonic() + 5.0
    while guard.stalled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s.ok for s in guard.telemetry_all()] == [True, True, True]


def test_a_write_whose_first_read_hangs_is_never_issued_after_the_timeout(hanging):
    dev, guard = hanging
    dev.hang(2)
    with pytest.raises(NvmlStalledError):
        guard.set_cap_w(2, 650.0)  # blocked in its constraints read
    dev.release()
    deadline = time.monotonic() + 5.0
    while guard.stalled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not guard.stalled() and dev.writes == [] and dev.limit_w(2) == 700.0  # the caller gave up: not written


def test_the_agent_reports_a_hung_gpu_stalled_holds_it_and_answers_the_plan(tmp_path, hanging):
    dev, guard = hanging
    agent = make_agent(tmp_path, guard)
    assert job_start(agent, "J", 0, 1, 2).ok  # the start cap: 300 W on each
    agent.tick()
    dev.hang(1)
    agent.tick()
    msg = agent.link.sent[-1].telemetry
    assert cap_states(msg) == {0: capstates.OK, 1: capstates.STALLED, 2: capstates.OK}
    assert msg.gpus[1].enforced_w == 0.0 and "has not returned" in msg.gpus[1].error  # no reading
    assert msg.gpus[0].enforced_w == 300.0
    writes = len(dev.writes)
    ack = agent.on_plan(plan(1, {0: 400.0, 1: 250.0, 2: 450.0}))
    assert not ack.ok and "GPU 1" in ack.error and "has not returned" in ack.error
    assert dev.writes[writes:] == [(0, 400.0), (2, 450.0)]  # GPU 1 not attempted
    assert {g.index: capctl_state(g) for g in ack.gpus}[1] == capstates.STALLED
    dev.release()
    deadline = time.monotonic() + 5.0
    while guard.stalled() and time.monotonic() < deadline:
        time.sleep(0.01)
    agent.tick()  # recovered: a lower cap of the plan is written now, the report has its reading
    assert dev.limit_w(1) == 250.0
    assert cap_states(agent.link.sent[-1].telemetry)[1] == capstates.OK
    dev.hang(1)
    agent.tick()
    agent.on_plan(plan(2, {0: 400.0, 1: 690.0, 2: 450.0}))  # a raise while stalled: not written later
    dev.release()
    while guard.stalled() and time.monotonic() < deadline + 5.0:
        time.sleep(0.01)
    agent.tick()
    assert dev.limit_w(1) == 250.0 and cap_states(agent.link.sent[-1].telemetry)[1] == capstates.OK


def capctl_state(g) -> str:
    return capstates.of(g)
