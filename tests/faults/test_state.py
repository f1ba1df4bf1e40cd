"""State faults: a corrupted or truncated agent state file, an unwritable state directory."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from capctl.demo.processes import wait_until
from tests.faults.rig import INTERVAL_S

pytestmark = pytest.mark.faults


def test_job_end_restore_stays_within_domain_limits(rig):
    """The epilog's restore of a pre-job (site) limit above the idle GPU's allowance (here the 700 W
    default) is held at the allowance; the coordinator completes it through its two-phase plan."""
    rig.job_end("200")
    time.sleep(3 * INTERVAL_S)
    rig.sampler.judge_candidates(float("inf"))
    with rig.sampler._lock:
        seen = list(rig.sampler.violations)
        rig.sampler.violations.clear()
    rig.job_start("200", {"n1": [2, 3]})
    rig.wait_settled()
    assert not seen, "\n".join(seen[:6])


def _restart_agent(rig, name, damage):
    caps = rig.enforced(name)
    rig.agents[name].stop()
    damage(rig.agents[name].state_dir)
    agent = rig.start_agent(name)
    agent.wait_ready(20.0, connected=True)
    default = rig.sims[name].read(0)["default_limit_w"]
    after = rig.enforced(name)
    assert all(c < default - 50 for c in after), (caps, after)  # a restart never resets caps to the default
    return agent


@pytest.mark.parametrize("which, how", [
    ("agent-state.json", "garbage"), ("agent-state.json", "truncated"),
    ("caps-state.json", "garbage"), ("caps-state.json", "truncated"),
])
def test_corrupted_state_file_keeps_bindings(rig, which, how):
    def damage(state_dir):
        p = state_dir / which
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\x00\xff{not json" * 10)

    agent = _restart_agent(rig, "n1", damage)
    assert sorted(j.job_id for j in agent.status().jobs) == ["100", "200"]
    assert "Traceback" not in agent.log_tail(200)
    wait_until(rig.bindings_complete, 10.0, 0.05, "bindings at the coordinator after the restart")
    rig.wait_settled()


def test_unwritable_state_directory(rig):
    """Every write into the agent's state directory fails (EISDIR on the temporary files): the
    agent keeps binding jobs and applying caps on its in-memory state and says so in its log."""
    state_dir = rig.agents["n2"].state_dir
    before = {p.name: p.read_bytes() for p in state_dir.iterdir() if p.is_file()}
    for _ in range(50):  # the running agent may recreate its directory in between: retry (bounded)
        shutil.rmtree(state_dir, ignore_errors=True)
        try:
            state_dir.write_text("not a directory")  # nothing can be created below it any more
            break
        except IsADirectoryError:
            continue
    assert state_dir.is_file()
    try:
        rig.job_start("400", {"n2": [2]})  # shares GPU 2 with job 300: a binding, no cap change needed
        rig.job_end("400")
        time.sleep(3 * INTERVAL_S)
        assert rig.agents["n2"].poll() is None
        assert sorted(j.job_id for j in rig.agents["n2"].status().jobs) == ["100", "300"]
        assert "state" in rig.agents["n2"].log_tail(100).lower()
    finally:
        state_dir.unlink()
        state_dir.mkdir(mode=0o700, exist_ok=True)  # the agent may have recreated it already
        for name, data in before.items():
            (state_dir / name).write_bytes(data)
    rig.wait_settled()
    json.loads((state_dir / "caps-state.json").read_text())

