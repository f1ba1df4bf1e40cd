"""Fixtures of the node agent tests: simulated nodes and NVML backends on them (real pynvml)."""

from __future__ import annotations

import pytest

from tests.conftest import require
from tests.support.simnodes import LIBRARY_ENV, NODE_ENV, create_node, library_path, sim_library_built


@pytest.fixture
def make_node(tmp_path, monkeypatch):
    """Factory: ``make_node(gpus=8, model="H100-SXM", **overrides)`` -> SimNode, env pointed at it.

    One node per test in-process (the driver maps the node at the first nvmlInit).
    """
    require(sim_library_built(), f"simulated NVML library not built at {library_path()} (make build)")
    nodes = []

    def make(gpus: int = 8, model: str = "H100-SXM", **overrides):
        node = create_node(tmp_path / f"node{len(nodes)}.state", gpus=gpus, model=model, **overrides)
        monkeypatch.setenv(NODE_ENV, str(node.path))
        monkeypatch.setenv(LIBRARY_ENV, str(library_path().resolve()))
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


@pytest.fixture
def open_backend():
    """Factory: ``open_backend(library="simulated")`` -> an open NvmlBackend, closed at teardown."""
    from nodeagent.nvml import NvmlBackend

    import pynvml

    opened = []

    def make(library: str = "simulated", **kwargs):
        ours = sum(b.is_open for b in opened)
        if pynvml._nvmlLib_refcount != ours:
            pytest.fail(
                f"NVML is still initialised {pynvml._nvmlLib_refcount - ours} time(s) by an earlier "
                "test: the simulated driver would keep that test's node (see tests/support/simnodes.py)"
            )
        backend = NvmlBackend(library, **kwargs).open()
        opened.append(backend)
        return backend

    yield make
    for backend in reversed(opened):
        backend.close()


@pytest.fixture
def site_node(make_node, open_backend):
    """8 H100s with default limit 480 W and a site (pre-job) limit of 250 W; (node, backend)."""
    node = make_node(gpus=8, default_limit_w=480.0, pre_job_limit_w=250.0)
    return node, open_backend()


class ManualClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, start_s: float = 1000.0):
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


@pytest.fixture
def clock():
    return ManualClock()
