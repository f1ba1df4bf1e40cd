"""The agent's error lines for a GPU that fails at every interval (nodeagent/errorlog.py): the first
at ERROR, then at most one a minute with the count of those not logged (or at once for another
error), one INFO line when it clears; and the wording of a failed operation.

An NVML stall logged an ERROR line every second, each a new text (it carries the stall's age):
136 lines in a few minutes; a failed reconcile read said "GPU 2: read to 200.000 W failed" (found
by a try-out).
"""

from __future__ import annotations

import logging
import time

from capctl import capstates
from nodeagent.callguard import GuardedBackend
from tests.nodeagent.test_agent_logic import job_start, make_agent
from tests.nodeagent.test_callguard import TIMEOUT_S, HangingDevice


def _lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and r.name == "capctl.nodeagent.caps"]


def test_a_stalled_gpu_logs_one_error_a_minute_with_the_count_and_one_info_line_when_it_clears(tmp_path, caplog):
    dev = HangingDevice(3)
    guard = GuardedBackend(dev, TIMEOUT_S)
    clock = [1000.0]
    try:
        agent = make_agent(tmp_path, guard)
        agent.caps.errors.clock = lambda: clock[0]  # (the error log's clock: 1 s per interval)
        assert job_start(agent, "J", 0, 1, 2).ok
        agent.tick()
        dev.hang(1)
        with caplog.at_level(logging.INFO, logger="capctl"):
            for _ in range(70):  # 70 intervals of 1 s
                agent.tick()
                clock[0] += 1.0
                time.sleep(0.002)  # (the stall's age in the error text changes)
            assert agent.caps.states()[1] == capstates.STALLED
            errors = _lines(caplog, logging.ERROR)
            assert len(errors) == 2, errors
            assert errors[0].startswith("GPU 1: reading its power limits (to keep the cap at 300.000 W) failed: "
                                        "GPU 1: NVML call ") and "has not returned after" in errors[0]
            assert errors[1].endswith("(and 59 times more in 60 s)"), errors[1]
            assert _lines(caplog, logging.INFO) == []
            dev.release()
            deadline = time.monotonic() + 5.0
            while guard.stalled() and time.monotonic() < deadline:
                time.sleep(0.01)
            clock[0] += 0.5
            for _ in range(3):
                agent.tick()
        assert agent.caps.states()[1] == capstates.OK
        assert len(_lines(caplog, logging.ERROR)) == 2
        infos = [line for line in _lines(caplog, logging.INFO) if "cleared" in line]
        assert infos == ["GPU 1: readable again; its error cleared (first logged 70 s ago, 9 repeat(s) since the "
                         "last line not logged)"], infos
        assert not agent.caps.errors.failing(1)
    finally:
        dev.release()
        for w in guard._workers.values():
            w.stop()


def test_the_same_error_with_other_numbers_is_one_error_and_another_error_is_logged_at_once(caplog):
    from nodeagent import errorlog

    clock = [0.0]
    log = errorlog.GpuErrorLog(logging.getLogger("capctl.nodeagent.caps"), lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="capctl.nodeagent.caps"):
        for age_s in range(1, 31):
            log.error(2, f"GPU 2: NVML call get_cap has not returned after {age_s}.0 s (timeout 2 s)")
            clock[0] += 1.0
        log.error(2, "GPU 2: the GPU is lost")  # another error: at once
        log.error(3, "GPU 3: NVML call get_cap has not returned after 3.0 s (timeout 2 s)")  # another GPU
        clock[0] += 31.0
        log.error(2, "GPU 2: NVML call get_cap has not returned after 62.0 s (timeout 2 s)")
        log.cleared(2, "readable")
        log.cleared(2, "readable")  # nothing logged since: no line
    assert _lines(caplog, logging.ERROR) == [
        "GPU 2: NVML call get_cap has not returned after 1.0 s (timeout 2 s)",
        "GPU 2: the GPU is lost",
        "GPU 3: NVML call get_cap has not returned after 3.0 s (timeout 2 s)",
        "GPU 2: NVML call get_cap has not returned after 62.0 s (timeout 2 s) (and 29 times more in 61 s)",
    ]
    assert _lines(caplog, logging.INFO) == ["GPU 2: readable again; its error cleared (first logged 61 s ago)"]
    assert log.failing(3) and not log.failing(2)
