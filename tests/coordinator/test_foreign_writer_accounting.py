"""Accounting of a GPU under a foreign writer (coordinator.registry.GpuObs.foreign_w): the agent
reports ``FOREIGN_WRITER`` with the other writer's 700 W, then its own rate-limited re-write to
297 W; the GPU keeps counting at 700 W (the foreign writer puts it back within its period) until
its state has been clear for ``FOREIGN_HOLD_S``; the mark never makes it count below its enforced
limit, an expired mark does not come back, and the columns (gpucolumns.accounted_w, the node
ledger) equal ``GpuObs.accounted_w`` on every such record."""

from __future__ import annotations

import numpy as np
import pytest

from capctl import capstates
from capctl.v1 import capctl_pb2 as pb
from coordinator import gpucolumns
from coordinator.gpucolumns import FOREIGN_HOLD_S
from coordinator.loop import ledger_rows
from coordinator.registry import GpuObs, NodeObs, Registry

ACK_MEMORY_S = 2.0
FW, OK = capstates.FOREIGN_WRITER, capstates.OK


class _Rig:
    """One node n1 with two GPUs (200..700 W) on a registry whose clock the test sets (s)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.seq = 0
        self.reg = Registry(clock=lambda: self.now)
        node = NodeObs(name="n1")
        for i in (0, 1):
            node.gpus[i] = GpuObs(node="n1", index=i, min_cap_w=200.0, max_cap_w=700.0, default_cap_w=700.0)
        self.reg.nodes["n1"] = node
        self.gpu = node.gpus[0]

    def _row(self, cap_w: float, enforced_w: float, state: str) -> list:
        return [pb.GpuTelemetry(index=0, power_w=250.0, cap_w=cap_w, enforced_w=enforced_w, temp_c=50.0,
                                sm_clock_mhz=1500, **capstates.wire_fields(state)),
                pb.GpuTelemetry(index=1, power_w=250.0, cap_w=400.0, enforced_w=400.0, temp_c=50.0,
                                sm_clock_mhz=1500, **capstates.wire_fields(OK))]

    def telemetry(self, at_s: float, cap_w: float, state: str, enforced_w: float | None = None) -> None:
        self.now, self.seq = at_s, self.seq + 1
        self.reg.on_telemetry("n1", pb.NodeTelemetry(node="n1", seq=self.seq, gpus=self._row(
            cap_w, cap_w if enforced_w is None else enforced_w, state)))

    def ack(self, at_s: float, cap_w: float, state: str) -> None:
        """The read-back of a plan (the agent's write acknowledged: its own re-write of GPU 0)."""
        self.now, self.seq = at_s, self.seq + 1
        self.reg.on_ack("n1", pb.CapAck(seq=self.seq, ok=True, gpus=self._row(cap_w, cap_w, state)), None)

    def accounted_w(self) -> float:
        """GPU 0's accounted cap (W), checked equal to the columns' and the node ledger's."""
        want = [g.accounted_w(self.now, ACK_MEMORY_S) for g in self.reg.nodes["n1"].gpus.values()]
        table = self.reg.gpu_table()
        c = gpucolumns.gather(table.keys, table.gpus, gpucolumns.ACCOUNTING, table.static)
        got = gpucolumns.accounted_w(c, self.now, ACK_MEMORY_S, gpucolumns.constraints_unusable(
            c["min_cap_w"], c["max_cap_w"]))
        np.testing.assert_array_equal(got, np.array(want))
        _, counted = ledger_rows(self.reg, self.now, ACK_MEMORY_S, {}, {})
        assert [counted[("n1", 0)], counted[("n1", 1)]] == want
        return want[0]


def test_the_agents_rewrite_under_a_foreign_writer_keeps_counting_at_the_writers_limit():
    r = _Rig()
    r.telemetry(1000.0, 297.0, OK)
    assert r.accounted_w() == 297.0
    r.telemetry(1001.0, 700.0, FW)  # the foreign writer's 700 W read back
    assert r.accounted_w() == 700.0
    r.ack(1031.0, 297.0, FW)  # the agent's re-write (once per 30 s), acknowledged
    assert r.gpu.enforced_w == 297.0 and r.accounted_w() == 700.0
    r.telemetry(1034.0, 297.0, FW)  # its telemetry, past the ack memory
    assert r.accounted_w() == 700.0
    r.telemetry(1035.0, 700.0, FW)
    r.telemetry(1061.0, 297.2, FW)  # the next re-write (a 300 W mark would not lower the count)
    assert r.accounted_w() == 700.0
    # the agent's state clears (foreign_window_s quiet): held FOREIGN_HOLD_S more, then dropped
    r.telemetry(1100.0, 297.2, OK)
    assert r.gpu.foreign_clear_mono == 1100.0
    r.telemetry(1100.0 + FOREIGN_HOLD_S, 297.2, OK)
    assert r.accounted_w() == 700.0
    r.now = 1100.0 + FOREIGN_HOLD_S + 0.5
    assert r.accounted_w() == 297.2
    # a new episode after the mark expired: at the maximum limit again
    r.telemetry(1200.0, 450.0, FW)
    assert r.gpu.foreign_w == 700.0 and r.accounted_w() == 700.0


def test_a_foreign_writer_never_read_counts_at_the_maximum_limit():
    """The agent re-writes the GPU as it detects the other writer, often before any report samples
    the foreign value: its first FOREIGN_WRITER reading is capctl's own 297 W. The mark started
    there and the foreign 700 W counted only at the writer's next write (the cluster 3,150 W on
    2,800 W in tests/coordinator/test_foreign_writer_budget.py); it is the maximum limit now."""
    r = _Rig()
    r.telemetry(1000.0, 297.0, OK)
    r.telemetry(1001.0, 297.0, FW)
    assert r.gpu.foreign_w == 700.0 and r.accounted_w() == 700.0


def test_the_mark_is_kept_through_a_short_clear_and_never_counts_below_the_enforced_limit():
    r = _Rig()
    r.telemetry(1000.0, 700.0, FW)
    r.ack(1001.0, 297.0, OK)  # cleared just after the agent's re-write
    assert r.accounted_w() == 700.0
    r.telemetry(1010.0, 297.0, FW)  # FOREIGN_WRITER again within the hold: the mark stays
    assert r.gpu.foreign_w == 700.0 and r.accounted_w() == 700.0
    r.telemetry(1020.0, 297.0, OK)
    r.telemetry(1021.0, 690.0, OK)  # a raise to 690 W while the mark is held
    assert r.accounted_w() == 700.0
    r.now = 1020.0 + FOREIGN_HOLD_S + 1.0
    assert r.accounted_w() == 690.0  # the enforced limit, never less
    # an empty cap state (an older agent: no change) keeps the GPU's state and its mark's clock
    r.telemetry(1100.0, 700.0, FW)
    r.telemetry(1101.0, 300.0, "")
    assert r.gpu.cap_state == FW and r.accounted_w() == 700.0


@pytest.mark.parametrize("state", [capstates.LOST, capstates.STALLED])
def test_a_read_back_without_a_reading_does_not_clear_the_mark(state):
    r = _Rig()
    r.telemetry(1000.0, 700.0, FW)
    r.telemetry(1001.0, 297.0, FW)  # the agent's re-write
    r.telemetry(1002.0, 0.0, state)  # no reading (zeros): nothing learnt, the state is no sign of the writer gone
    r.now = 1002.0 + 10 * FOREIGN_HOLD_S
    assert r.gpu.cap_state == state and r.gpu.enforced_w == 297.0
    assert r.gpu.foreign_clear_mono == float("inf") and r.accounted_w() == 700.0
