"""Store calls off the coordinator's event loop.

The etcd stores (:mod:`coordinator.etcdstore`, :mod:`coordinator.etcdfinished`) make HTTP requests
that may each wait up to their deadline (:data:`coordinator.etcdconn.DEFAULT_TIMEOUT_S` per member,
member after member): on the event loop, one slow or frozen etcd member would stall report
handling, acknowledgements and admin calls for that long. A store that says so (``blocking_io =
True``) has its calls run here instead: one worker thread per coordinator, in submission order (a
write submitted before another lands before it, as on the loop), each call bounded by the store's
own request deadlines. No fork: a plain thread (ground rule: no fork with gRPC loaded).

The SQLite stores answer in microseconds from a local file and keep their thread-bound connection
on the loop (``blocking_io`` False: :func:`blocking` is False for them).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("capctl.coordinator.storeio")


def blocking(store) -> bool:
    """True when ``store``'s calls may block on the network (``store.blocking_io``)."""
    return bool(getattr(store, "blocking_io", False))


class StoreIO:
    """One worker thread running store calls in order (see module docstring).

    :meth:`call` is awaited on the event loop; :meth:`submit` runs a call and hands its outcome to
    a callback on the event loop. :attr:`pending` counts the calls not finished yet.
    """

    def __init__(self, name: str = "store-io") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.pending = 0

    def call(self, fn, *args) -> asyncio.Future:
        """``fn(*args)`` in the worker; an asyncio future of its result (must run on the loop)."""
        loop = asyncio.get_running_loop()
        self.pending += 1
        fut = asyncio.wrap_future(self._pool.submit(fn, *args), loop=loop)
        fut.add_done_callback(self._done)
        return fut

    def submit(self, fn, *args, done=None) -> asyncio.Future:
        """``fn(*args)`` in the worker; ``done(result, error)`` then runs on the loop (``error``: the
        exception raised, else None; an exception in ``done`` is logged)."""
        fut = self.call(fn, *args)
        if done is not None:
            def finished(f: asyncio.Future) -> None:
                if f.cancelled():
                    return
                exc = f.exception()
                try:
                    done(None if exc is not None else f.result(), exc)
                except Exception:  # noqa: BLE001 (a callback error must not stop the loop)
                    log.exception("store call completion failed")
            fut.add_done_callback(finished)
        return fut

    def run_threadsafe(self, fn, *args, then) -> None:
        """From any thread: ``fn(*args)`` in the worker (in order with the other calls), then
        ``then(result)`` in the worker (an exception of either is logged). Not counted in
        :attr:`pending` (a loop-thread count)."""
        def run() -> None:
            try:
                then(fn(*args))
            except Exception:  # noqa: BLE001 (the worker must go on)
                log.exception("store call %s failed", getattr(fn, "__name__", fn))
        try:
            self._pool.submit(run)
        except RuntimeError:  # closed: the daemon is stopping
            log.info("store worker closed: %s not run", getattr(fn, "__name__", fn))

    def _done(self, _fut) -> None:
        self.pending -= 1

    def close(self) -> None:
        """Stop taking calls; those queued are dropped, the running one ends at its deadline."""
        self._pool.shutdown(wait=False, cancel_futures=True)
