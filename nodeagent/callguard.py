"""Per-GPU timeouts on NVML calls: :class:`GuardedBackend`, a :class:`~nodeagent.backend.GpuBackend`
around another one (production: :class:`~nodeagent.nvml.NvmlBackend`).

One stalled NVML call (a hung driver call; the simulated fault ``nvml_stall``) must not stop the
node's other GPUs. Every per-GPU call therefore runs on that GPU's own worker thread and the caller
waits at most ``timeout_s``:

* returned in time: its result (or its NVML error) as if called directly;
* not returned in time: :class:`~nodeagent.backend.NvmlStalledError`; the call keeps running on the
  worker (ctypes releases the GIL during a C call, so the other GPUs' workers and the agent go on);
* while a GPU's call is outstanding, every further call on that GPU fails at once with
  :class:`~nodeagent.backend.NvmlStalledError` without reaching NVML: at most one outstanding call
  per GPU and one thread per GPU (no unbounded thread growth), and no cap write is attempted on a
  stalled GPU;
* when the call returns, the GPU recovers: its result is dropped (it is old) and the next call goes
  to NVML again.

:meth:`GuardedBackend.telemetry_all` starts every GPU's read at once and waits for all of them
against one deadline, so a tick costs at most ``timeout_s`` however many GPUs stall. The agent
reports a stalled GPU without a reading in the cap state ``STALLED`` (:mod:`capctl.capstates`): the
coordinator holds and counts it at its last known enforced limit (docs/nodeagent.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from nodeagent.backend import DeviceInfo, GpuBackend, GpuSample, NvmlStalledError, SetResult

LOG = logging.getLogger("capctl.nodeagent.callguard")

DEFAULT_TIMEOUT_S = 0.5
"""Per-GPU NVML call timeout of the agent (s; ``capctl-agent --nvml-timeout-s``). An NVML query
takes microseconds to a few ms on a healthy driver (docs/nodeagent.md, measured costs); 0.5 s keeps
a tick of the default 1-5 s interval on time while tolerating a slow driver."""


class _Call:
    """One call handed to a GPU's worker: its function, and its outcome once it returned."""

    __slots__ = ("operation", "func", "args", "done", "result", "error", "started_mono", "abandoned")

    def __init__(self, operation: str, func: Callable, args: tuple) -> None:
        self.operation = operation
        self.func = func
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.started_mono = time.monotonic()
        self.abandoned = False  # the caller gave up waiting (timed out)


class _Worker:
    """The worker thread of one GPU: runs its calls one at a time (at most one outstanding)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.lock = threading.Lock()
        self.current: _Call | None = None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"nvml-gpu{index}", daemon=True)
        self.thread.start()

    def submit(self, call: _Call) -> _Call | None:
        """Hand ``call`` over; returns the call still outstanding instead when there is one."""
        with self.lock:
            if self.current is not None:
                return self.current
            self.current = call
        self.jobs.put(call)
        return None

    def _run(self) -> None:
        while True:
            call = self.jobs.get()
            if call is None:
                return
            try:
                call.result = call.func(*call.args)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                call.error = err
            with self.lock:
                self.current = None
                abandoned = call.abandoned
            call.done.set()
            if abandoned:
                LOG.warning("GPU %d: NVML call %s returned after %.1f s; the GPU is read again", self.index,
                            call.operation, time.monotonic() - call.started_mono)

    def stop(self) -> None:
        self.jobs.put(None)


class GuardedBackend:
    """A :class:`~nodeagent.backend.GpuBackend` whose per-GPU calls time out (module doc).

    Args:
        inner: the backend doing the calls (open).
        timeout_s: how long a caller waits for one GPU's call (s, > 0).

    Attributes other than the guarded methods (``driver_version``, ``simulated``, ``library_path``,
    ``close``, ``device_count`` ...) are the inner backend's.
    """

    def __init__(self, inner: GpuBackend, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: {timeout_s!r}, need > 0 s")
        self.inner = inner
        self.timeout_s = float(timeout_s)
        self._workers: dict[int, _Worker] = {}
        self._lock = threading.Lock()
        self.stalls = 0  # calls that timed out (capctl_agent_nvml_stalls_total)
        self._known: dict[int, DeviceInfo] = {}  # the last static facts read per GPU

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- the guard -------------------------------------------------------------------------
    def _worker(self, index: int) -> _Worker:
        w = self._workers.get(index)
        if w is None:
            with self._lock:
                w = self._workers.get(index) or _Worker(index)
                self._workers[index] = w
        return w

    def _stalled_error(self, index: int, call: _Call) -> NvmlStalledError:
        age_s = time.monotonic() - call.started_mono
        return NvmlStalledError(
            f"GPU {index}: NVML call {call.operation} has not returned after {age_s:.1f} s (timeout "
            f"{self.timeout_s:g} s): reported without a reading, held at its last enforced limit and not "
            "written until the call returns (a hung driver call: check dmesg for Xid errors and nvidia-smi)",
            gpu_index=index)

    def _start(self, index: int, operation: str, func: Callable, *args) -> _Call:
        """Hand one call of GPU ``index`` to its worker. Raises NvmlStalledError when one is outstanding."""
        call = _Call(operation, func, args)
        busy = self._worker(index).submit(call)
        if busy is not None:
            raise self._stalled_error(index, busy)
        return call

    def _finish(self, index: int, call: _Call, deadline_mono: float):
        """Wait for ``call`` until ``deadline_mono``; its result, its error, or NvmlStalledError."""
        if not call.done.wait(max(0.0, deadline_mono - time.monotonic())):
            worker = self._workers[index]
            with worker.lock:  # the worker clears ``current`` under this lock when the call returns
                outstanding = worker.current is call
                call.abandoned = outstanding
            if outstanding:
                self.stalls += 1
                err = self._stalled_error(index, call)
                LOG.error("%s", err)
                raise err
            call.done.wait()  # it returned just now: its outcome is being handed over
        if call.error is not None:
            raise call.error
        return call.result

    def call(self, index: int, operation: str, func: Callable, *args):
        """Run ``func(*args)`` for GPU ``index`` with the timeout (module doc)."""
        call = self._start(index, operation, func, *args)
        return self._finish(index, call, time.monotonic() + self.timeout_s)

    def stalled(self) -> dict[int, float]:
        """``{index: seconds}`` of the GPUs whose call is outstanding past its timeout."""
        now = time.monotonic()
        out = {}
        for i, w in list(self._workers.items()):
            c = w.current
            if c is not None and c.abandoned:
                out[i] = now - c.started_mono
        return out

    def close(self) -> None:
        """Stop the workers (a stuck one is a daemon thread and ends with the process); close inner."""
        for w in self._workers.values():
            w.stop()
        self.inner.close()

    # -- GpuBackend ------------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        """Static facts of every GPU, each read through its worker (``device(i)``: the inner backend's
        cached facts, re-read only for a GPU whose read failed); a stalled GPU keeps the facts last
        known (they do not change while it hangs)."""
        device = getattr(self.inner, "device", None)
        if device is None:  # a backend without per-GPU facts: its list as it is
            return list(self.inner.devices())
        if not self._known:
            self._known = {d.index: d for d in self.inner.devices()}
        out = []
        for i in sorted(self._known):
            try:
                self._known[i] = self.call(i, "reading device facts", device, i)
            except NvmlStalledError:
                pass
            out.append(self._known[i])
        return out

    def telemetry(self, index: int) -> GpuSample:
        return self.call(index, "reading telemetry", self.inner.telemetry, index)

    def telemetry_all(self) -> list[GpuSample]:
        """One sample per GPU in index order, all read in parallel against one deadline; a stalled
        or failing GPU yields :meth:`GpuSample.failed` (``error_type`` ``NvmlStalledError``)."""
        from nodeagent.backend import NvmlError

        count = self.inner.device_count() if hasattr(self.inner, "device_count") else len(self.inner.devices())
        deadline = time.monotonic() + self.timeout_s
        started: dict[int, _Call | BaseException] = {}
        for i in range(count):
            try:
                started[i] = self._start(i, "reading telemetry", self.inner.telemetry, i)
            except NvmlStalledError as err:
                started[i] = err
        samples = []
        for i in range(count):
            item = started[i]
            try:
                if isinstance(item, BaseException):
                    raise item
                samples.append(self._finish(i, item, deadline))
            except NvmlError as err:
                samples.append(GpuSample.failed(i, err, time.time()))
        return samples

    def clamp_cap_mw(self, index: int, cap_w: float, **kwargs) -> int:
        return self.call(index, "reading the limit constraints",
                         lambda: self.inner.clamp_cap_mw(index, cap_w, **kwargs))

    def get_cap_w(self, index: int) -> float:
        return self.call(index, "nvmlDeviceGetPowerManagementLimit", self.inner.get_cap_w, index)

    def get_enforced_w(self, index: int) -> float:
        return self.call(index, "nvmlDeviceGetEnforcedPowerLimit", self.inner.get_enforced_w, index)

    def set_cap_w(self, index: int, cap_w: float) -> SetResult:
        """Write the cap (W) unless the caller gave up first: the worker reads the limit constraints
        (the first NVML call of a write), and writes only if the caller still waits, so a write
        never lands after the agent reported the GPU STALLED and moved on (only a hang of the set
        call itself, after it started, can still land late; the next reconcile then sees a drift)."""
        def write() -> SetResult:
            self.inner.clamp_cap_mw(index, cap_w)
            if call.abandoned:
                raise self._stalled_error(index, call)
            return self.inner.set_cap_w(index, cap_w)

        call = _Call(f"setting the power limit to {cap_w:g} W", write, ())
        busy = self._worker(index).submit(call)
        if busy is not None:
            raise self._stalled_error(index, busy)
        return self._finish(index, call, time.monotonic() + self.timeout_s)
