"""The coordinator daemon freezes its startup heap (coordinator.daemon.freeze_startup_heap): the
objects alive at start leave the collector's generations (a full collection no longer traverses
them), and cyclic garbage made afterwards is still collected. In a child interpreter: the
collector's state is per process. Not timed."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.coordinator.conftest import REPO

CHILD = r"""
import gc, json
import coordinator.daemon as d, coordinator.loop, coordinator.server
before = len(gc.get_objects())
frozen = d.freeze_startup_heap()
after = len(gc.get_objects())
class Node:
    pass
gc.disable()  # no automatic pass takes them first
for _ in range(500):
    a, b = Node(), Node()
    a.peer, b.peer = b, a  # a reference cycle, garbage once the loop moves on
del a, b
found = gc.collect()
print(json.dumps({"before": before, "frozen": frozen, "count": gc.get_freeze_count(), "after": after, "found": found}))
"""


def test_startup_heap_frozen_and_later_cycles_still_collected():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["frozen"] == r["count"] and r["frozen"] >= 0.9 * r["before"] > 20_000  # the imports' heap
    assert r["after"] < 0.05 * r["before"]  # what a full collection still traverses
    assert r["found"] >= 1000  # 500 cycles of 2 objects: collected
