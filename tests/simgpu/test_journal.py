"""The enforced-limit journal of the simulated driver and the exact budget checker.

The expected values are computed here by replaying the operations the test performed, one by one,
in a plain Python model; the checker must agree exactly (integer microwatts).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capctl.simgpu.journal import (CAUSE_CHANGED, CAUSE_CREATED, JournalError, check_budget, check_nodes,
                                   read_journal)


@pytest.fixture
def two_nodes(tmp_path, simlib):
    from capctl.simgpu.node import SimNode

    nodes = {}
    for name in ("n1", "n2"):
        (tmp_path / name).mkdir()
        nodes[name] = SimNode.create(tmp_path / name / "node.state", 4, model="H100-SXM", seed=3)
    yield nodes
    for n in nodes.values():
        n.close()


def test_creation_records_every_gpu_and_changes_are_time_ordered(two_nodes):
    n1 = two_nodes["n1"]
    n1.set_limits_w([400.0, 410.0], [0, 1])
    n1.inject(2, "oob_limit", value=350.0)  # the enforced limit moves, the requested one does not
    n1.driver_reload()                     # limits back to the 700 W default: 0, 1 change; 2 stays OOB
    j = read_journal(n1.path.parent)
    r = j.records
    assert j.gpu_count == 4 and j.unjournaled == 0 and j.torn_bytes == 0
    assert list(r["cause"][:4]) == [CAUSE_CREATED] * 4 and list(r["gpu"][:4]) == [0, 1, 2, 3]
    assert list(r["enforced_w"][:4]) == [700.0] * 4
    changes = [(int(g), float(w)) for g, w in zip(r["gpu"][4:], r["enforced_w"][4:])]
    assert changes == [(0, 400.0), (1, 410.0), (2, 350.0), (0, 700.0), (1, 700.0)]
    assert list(r["cause"][4:]) == [CAUSE_CHANGED] * 5
    assert float(r["limit_w"][6]) == 700.0  # GPU 2: requested 700 W, enforced 350 W
    assert all(r["t_ns"][1:] >= r["t_ns"][:-1])
    assert j.created_ns <= int(r["t_ns"][0]) <= time.monotonic_ns()


def test_writes_through_pynvml_in_another_process_are_journaled(two_nodes, simlib):
    """The real NVML setter (pynvml -> our libnvidia-ml.so.1) journals from the agent's process."""
    n2 = two_nodes["n2"]
    script = ("import ctypes, os, pynvml; ctypes.CDLL(os.environ['CAPCTL_SIMNVML_LIB'], mode=ctypes.RTLD_GLOBAL);"
              "pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(3);"
              "pynvml.nvmlDeviceSetPowerManagementLimit(h, 312345); pynvml.nvmlShutdown()")
    before = time.monotonic_ns()
    subprocess.run([sys.executable, "-c", script], env=n2.env(), check=True, timeout=60)
    r = read_journal(n2.path).records
    last = r[-1]
    assert (int(last["gpu"]), float(last["enforced_w"])) == (3, 312.345) and int(last["t_ns"]) > before


def test_checker_exact_max_and_every_interval_over_the_limit(two_nodes):
    n1, n2 = two_nodes["n1"], two_nodes["n2"]
    n1.set_limits_w([400.0] * 4)
    n2.set_limits_w([400.0] * 4)
    t0 = time.monotonic_ns()
    n2.set_limits_w([500.25], [0])   # 3300.25 W: over a 3200 W limit
    n1.set_limits_w([300.0], [0])    # 3200.25 W: still over
    n1.set_limits_w([399.75], [1])   # 3200.00 W: within
    n2.set_limits_w([600.0], [1])    # 3400.00 W: over again
    t1 = time.monotonic_ns()
    res = check_nodes({"n1": n1.path, "n2": n2.path}, 3200.0, since_ns=t0, until_ns=t1)
    assert res.initial_sum_w == 3200.0 and res.max_sum_w == 3400.0 and res.changes == 4
    assert [o.peak_w for o in res.over] == [3300.25, 3400.0]
    assert res.over[1].end_ns == t1 and not res.ok and res.complete
    assert res.over[0].start_ns < res.over[0].end_ns <= res.over[1].start_ns
    # a subset of GPUs, and a window before the changes
    sub = check_nodes({"n1": n1.path, "n2": n2.path}, 1000.0, gpus={"n2": [0, 1]}, since_ns=t0, until_ns=t1)
    assert sub.gpus == 2 and sub.max_sum_w == 1100.25 and [o.peak_w for o in sub.over] == [1100.25]
    assert sub.changes == 2  # n1's changes are not in this selection
    quiet = check_nodes({"n1": n1.path, "n2": n2.path}, 3200.0, since_ns=t0, until_ns=t0)
    assert quiet.ok and quiet.max_sum_w == 3200.0 and quiet.changes == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["n1", "n2"]), st.integers(0, 3),
                              st.integers(200_000, 700_000)), min_size=1, max_size=30),
       limit_w=st.floats(1600.0, 5600.0))
def test_checker_matches_a_replay_of_random_operations(two_nodes, ops, limit_w):
    value = {(n, i): float(two_nodes[n].read(i)["enforced_w"]) for n in two_nodes for i in range(4)}
    t0 = time.monotonic_ns()
    sums, changed = [sum(value.values())], 0
    for node, gpu, mw in ops:
        two_nodes[node].set_limits_w([mw / 1000.0], [gpu])
        changed += value[(node, gpu)] != mw / 1000.0  # setting the same value changes nothing
        value[(node, gpu)] = mw / 1000.0
        sums.append(sum(value.values()))
    t1 = time.monotonic_ns()
    res = check_nodes({n: s.path for n, s in two_nodes.items()}, limit_w, since_ns=t0, until_ns=t1)
    assert res.max_sum_w == pytest.approx(max(sums), abs=1e-6) and res.changes == changed
    runs = sum(1 for k, s in enumerate(sums) if s > limit_w and (k == 0 or sums[k - 1] <= limit_w))
    assert len(res.over) == runs
    assert [o.peak_w for o in res.over] == pytest.approx(_run_peaks(sums, limit_w), abs=1e-6)


def _run_peaks(sums: list[float], limit_w: float) -> list[float]:
    """The peak of every run of consecutive sums above ``limit_w``."""
    peaks: list[float] = []
    inside = False
    for s in sums:
        if s > limit_w:
            peaks[-1:] = [max(peaks[-1], s)] if inside else peaks[-1:] + [s]
            inside = True
        else:
            inside = False
    return peaks


def test_an_incomplete_journal_proves_nothing(two_nodes, tmp_path):
    from capctl.simgpu.node import SimNode

    n1 = two_nodes["n1"]
    journal = n1.journal_path
    with open(journal, "ab") as f:
        f.write(b"\x01\x02\x03")  # a writer killed mid-record
    res = check_nodes({"n1": n1.path}, 5000.0)
    assert not res.complete and not res.ok and "partial record" in res.describe()
    journal.unlink()
    with SimNode.open(n1.path) as again:  # opened without its journal: changes cannot be written
        again.set_limits_w([333.0], [0])
        assert again.journal_errors == 1
    with pytest.raises(JournalError, match="cannot read the enforced-limit journal"):
        read_journal(n1.path)
    missing = n1.path.parent / "no-such-node"  # a typo'd directory: said as such, not as "<dir>.journal"
    with pytest.raises(JournalError, match=r"no-such-node holds no simulated node \(no such file or directory"):
        read_journal(missing)


def test_bad_selection_names_what_is_allowed(two_nodes):
    js = [read_journal(s.path, n) for n, s in two_nodes.items()]
    with pytest.raises(JournalError, match=r"GPU 7 of node n1 asked for; allowed: 0\.\.3"):
        check_budget(js, 100.0, gpus={"n1": [7]})
    with pytest.raises(JournalError, match="node 'n9'"):
        check_budget(js, 100.0, gpus={"n9": [0]})
    with pytest.raises(JournalError, match="unique"):
        check_budget([js[0], js[0]], 100.0)


def test_cli_exit_codes_and_json(two_nodes):
    n1, n2 = two_nodes["n1"], two_nodes["n2"]
    since = time.monotonic_ns()
    n1.set_limits_w([650.0], [0])  # 5550 W in all
    base = [sys.executable, "-m", "capctl.simgpu.cli", "journal", f"a={n1.path.parent}", f"b={n2.path.parent}",
            "--since-ns", str(since)]
    changed_ns = int(read_journal(n1.path).records[-1]["t_ns"])
    over = subprocess.run(base + ["--limit-w", "5560", "--json"], capture_output=True, text=True, timeout=60)
    assert over.returncode == 2, over.stderr
    doc = json.loads(over.stdout)
    assert doc["max_sum_w"] == 5600.0 and doc["initial_sum_w"] == 5600.0 and not doc["ok"] and doc["gpus"] == 8
    assert [(o["start_ns"], o["end_ns"], o["peak_w"]) for o in doc["over"]] == [(since, changed_ns, 5600.0)]
    within = subprocess.run(base + ["--limit-w", "1400", "--gpu", "b:0,1"], capture_output=True, text=True,
                            timeout=60)
    assert within.returncode == 0 and "within" in within.stdout, within.stdout + within.stderr
    bad = subprocess.run(base + ["--gpu", "b0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--gpu 'b0' is invalid" in bad.stderr and "Traceback" not in bad.stderr


def test_bad_limits_and_windows_are_clear_errors(two_nodes):
    js = [read_journal(s.path, n) for n, s in two_nodes.items()]
    for bad in (float("nan"), float("inf"), -5.0, 0.0):
        with pytest.raises(JournalError, match="allowed: a finite number of watts > 0"):
            check_budget(js, bad)
    now = time.monotonic_ns()
    with pytest.raises(JournalError, match="ends .* before it starts"):
        check_budget(js, 100.0, since_ns=now, until_ns=now - 1)
    with pytest.raises(JournalError, match="before the selected GPUs existed"):
        check_budget(js, 100.0, since_ns=0, until_ns=1)
    clipped = check_budget(js, 6000.0, since_ns=0)  # a window opened before creation starts at it
    assert clipped.since_ns == int(js[1].records["t_ns"][0]) and clipped.initial_sum_w == 5600.0


def test_same_named_nodes_are_refused_by_the_cli(two_nodes, tmp_path):
    n1, n2 = two_nodes["n1"], two_nodes["n2"]
    (tmp_path / "other" / "n1").mkdir(parents=True)
    from capctl.simgpu.node import SimNode

    with SimNode.create(tmp_path / "other" / "n1" / "node.state", 2):
        out = subprocess.run([sys.executable, "-m", "capctl.simgpu.cli", "journal", str(n1.path.parent),
                              str(tmp_path / "other" / "n1"), "--limit-w", "1"], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1 and "node name 'n1' is given twice" in out.stderr, out.stderr
    # a state-file path is named for its directory, as the help says
    named = subprocess.run([sys.executable, "-m", "capctl.simgpu.cli", "journal", str(n2.path), "--gpu", "n2:0",
                            "--json"], capture_output=True, text=True, timeout=60)
    assert named.returncode == 0 and json.loads(named.stdout)["gpus"] == 1, named.stderr


def test_a_journal_of_another_node_is_never_written(two_nodes):
    """A node opened while its path holds another node's journal (a node recreated at the same path,
    opened between the renames of the journal and the state file) never appends to that journal:
    the node ids differ, so its changes count as unjournaled."""
    import shutil

    from capctl.simgpu.node import SimNode

    n1, n2 = two_nodes["n1"], two_nodes["n2"]
    with open(n1.journal_path, "rb") as f, open(n1.path, "rb") as g:
        assert f.read(64)[24:40] == g.read(80)[64:80]  # a journal names its node
    shutil.copy(n2.journal_path, n1.journal_path)  # n1's state, n2's journal
    before = n1.journal_path.read_bytes()
    with SimNode.open(n1.path) as again:
        again.set_limits_w([250.0], [0])
        assert again.journal_errors == 1
    assert n1.journal_path.read_bytes() == before
    assert not check_nodes({"n1": n1.path}, 5000.0).complete


def test_a_foreign_write_is_journaled_at_its_own_time(tmp_path, simlib):
    """A foreign writer acts with time alone; its write is stamped when it happened, not when a call
    next touched the GPU."""
    from capctl.simgpu.node import SimNode

    with SimNode.create(tmp_path / "node.state", 2) as node:
        node.set_limits_w([300.0, 300.0])
        t_inject = time.monotonic_ns()
        node.inject(1, "foreign_writer", value=650.0, period_s=0.3)  # writes now, then every 0.3 s
        node.set_limits_w([300.0], [1])  # capctl writes back; the foreign writer wins again at +0.3 s
        time.sleep(0.8)
        node.read(0)  # any call surfaces the write (GPU 0 only: the node flushes every GPU)
        recs = read_journal(node.path).records
        mine = recs[recs["gpu"] == 1]
        back = [int(t) for t, w in zip(mine["t_ns"], mine["enforced_w"]) if w == 650.0]
        assert len(back) == 2  # at injection, and the periodic write after capctl's write-back
        assert 0.25e9 <= back[1] - t_inject <= 0.45e9, (back[1] - t_inject) / 1e9  # ~0.3 s, not ~0.8 s

