"""AgentLink client: the node agent's one bidirectional stream to the coordinator.

Protocol (docs/protocol.md): the agent sends ``AgentHello`` first, the coordinator answers
``Welcome``; then telemetry, job events and ``CapAck`` go up, ``CapPlan`` comes down. When the stream
breaks, the link reconnects with bounded exponential backoff (:data:`BACKOFF_MIN_S` doubling up to
``backoff_max_s``, with jitter) and sends a fresh ``AgentHello`` (the agent's current bindings and
last applied plan seq), so the coordinator resyncs.

High availability: ``target`` may list several coordinators (``unix:/a,unix:/b`` or
``h1:7373,h2:7373``). The link then tries them in turn; a standby refuses the stream with
``FAILED_PRECONDITION`` and names the leader (trailing metadata ``capctl-leader``), which is tried
next when it is one of the listed addresses. With several targets, a stream on which the
coordinator has sent nothing for :data:`SILENCE_INTERVALS` intervals (a frozen or partitioned
leader) is dropped, and a coordinator that does not welcome within :data:`HA_WELCOME_TIMEOUT_S` is
left for the next; the agent's callbacks may raise :class:`LeaveCoordinator` (a plan of an older
term) to leave the current one.

The link holds no cap logic: it calls back into the agent (``hello_fn``, ``on_welcome``,
``on_plan`` -> ``CapAck``, ``on_disconnect``).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable

import grpc

log = logging.getLogger("capctl.agent.link")

PROTOCOL_VERSION = "capctl.v1"
BACKOFF_MIN_S = 0.2
"""First reconnect delay in seconds; doubles per failed attempt up to the link's ``backoff_max_s``."""
BACKOFF_MAX_S = 5.0
"""Default ceiling of the reconnect delay in seconds."""
OUTBOX_MAX = 256
"""Bound of queued upstream messages; telemetry is dropped first when full."""
WELCOME_TIMEOUT_S = 10.0
"""A coordinator that does not answer the hello within this many seconds is reconnected to."""

HA_WELCOME_TIMEOUT_S = 1.5
"""With several coordinators listed: the welcome deadline (s) before the next one is tried (a frozen
process still accepts connections into its listen backlog)."""
SILENCE_INTERVALS = 3.0
"""With several coordinators listed: a stream silent for this many intervals is dropped (the leader
sends a plan, at least a lease-renewing hold, every interval)."""
STANDBY_RETRY_S = 0.05
"""With several coordinators listed: the pause (s) before the next round when a standby answered
(its park already spaced the attempts out)."""
LEADER_METADATA_KEY = "capctl-leader"
"""Trailing metadata of a standby's refusal naming the leader (coordinator/ha.py)."""

_CLOSE = object()


class LeaveCoordinator(Exception):
    """Raised by a callback: drop this coordinator's stream and try the next (e.g. an older term)."""


class ProtocolMismatchError(Exception):
    """The coordinator answered with another major protocol version."""


class AgentLinkClient:
    """Keeps the AgentLink stream up in a background thread.

    Args:
        target: gRPC target of the coordinator (``host:port`` or ``unix:/path``).
        hello_fn: returns the ``AgentHello`` to send on each (re)connect.
        on_welcome: called with the ``Welcome``.
        on_plan: called with each ``CapPlan``; returns the ``CapAck`` to send (or ``None``).
        on_disconnect: called (no args) when an established stream ends.
        credentials: optional ``grpc.ChannelCredentials`` (mTLS); insecure channel otherwise.
        channel_options: extra gRPC channel options (e.g. ``grpc.ssl_target_name_override``).
    """

    def __init__(
        self,
        target: str,
        hello_fn: Callable[[], object],
        on_welcome: Callable[[object], None],
        on_plan: Callable[[object], object | None],
        on_disconnect: Callable[[], None] | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: list[tuple[str, object]] | None = None,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        self.target = target
        self.targets = [t.strip() for t in target.split(",") if t.strip()] or [target]
        self.target_now = self.targets[0]
        self._next_target = ""  # a leader named by a standby, tried next
        self._tried = False
        self.hello_fn = hello_fn
        self.on_welcome = on_welcome
        self.on_plan = on_plan
        self.on_disconnect = on_disconnect
        self.credentials = credentials
        self.channel_options = list(channel_options or [])
        self.backoff_max_s = max(BACKOFF_MIN_S, backoff_max_s)
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._outbox: queue.Queue = queue.Queue(maxsize=OUTBOX_MAX)
        self._thread: threading.Thread | None = None
        self._call = None
        self._lock = threading.Lock()
        self.connects = 0  # successful (welcomed) connections
        self.last_error = ""
        self.coordinator_id = ""
        self.interval_s = 1.0  # the coordinator's interval (s), from its Welcome
        self.silence_drops = 0

    # -- public ------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        return self._connected.wait(timeout_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="agent-link", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        self._put(_CLOSE, force=True)
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def send(self, message, *, droppable: bool = False) -> bool:
        """Queue an ``AgentMessage`` for the coordinator; dropped (False) while disconnected.

        ``droppable`` messages (telemetry) are also dropped when the outbox is full.
        """
        if not self._connected.is_set():
            return False
        return self._put(message, force=not droppable)

    # -- internals ---------------------------------------------------------------------------
    def _put(self, item, force: bool) -> bool:
        try:
            self._outbox.put_nowait(item)
            return True
        except queue.Full:
            if not force:
                return False
            try:  # make room: drop the oldest message (telemetry is superseded by newer samples)
                self._outbox.get_nowait()
            except queue.Empty:
                pass
            try:
                self._outbox.put_nowait(item)
                return True
            except queue.Full:
                return False

    def _drain(self) -> None:
        while True:
            try:
                self._outbox.get_nowait()
            except queue.Empty:
                return

    def _requests(self, hello, ended: threading.Event):
        from capctl.v1 import capctl_pb2

        yield capctl_pb2.AgentMessage(hello=hello)
        while not self._stop.is_set() and not ended.is_set():
            try:
                item = self._outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is _CLOSE:
                return
            yield item

    def _run(self) -> None:
        """The link thread: connect, serve one stream, back off, reconnect, until :meth:`stop`."""
        delay = BACKOFF_MIN_S
        logged_error = ""
        options = [("grpc.max_receive_message_length", 8 << 20), ("grpc.keepalive_time_ms", 10000),
                   ("grpc.keepalive_timeout_ms", 5000)] + self.channel_options
        failed_round = 0
        standby_seen = False
        while not self._stop.is_set():
            self.target_now = self._pick_target()
            welcomed = self._connect_once(options)
            if self._stop.is_set():
                return
            failed_round = 0 if welcomed else failed_round + 1
            standby_seen = standby_seen or self.last_error.startswith("FAILED_PRECONDITION")
            if len(self.targets) > 1 and not welcomed and failed_round < len(self.targets):
                continue  # several coordinators: try the next (or the named leader) at once; back off per round
            if standby_seen and not welcomed:
                # a standby answered (it parks a stream up to ~1 s, coordinator/ha.py): an election is
                # under way; come back at once rather than after the growing backoff
                failed_round = 0
                standby_seen = False
                self._stop.wait(STANDBY_RETRY_S)
                continue
            failed_round = 0
            standby_seen = False
            if welcomed:
                log.warning("coordinator link lost (%s); reconnecting", self.last_error)
                logged_error = self.last_error
                delay = BACKOFF_MIN_S
            elif self.last_error != logged_error:
                # log each new reason once (a refused protocol version must be visible), then quietly retry
                logged_error = self.last_error
                level = logging.INFO if self.last_error.startswith(("UNAVAILABLE", "DEADLINE")) else logging.ERROR
                log.log(level, "coordinator %s: %s; retrying (backoff up to %.1f s)", self.target, self.last_error,
                        self.backoff_max_s)
            self._stop.wait(delay * (0.8 + 0.4 * random.random()))
            delay = min(self.backoff_max_s, delay * 2)

    def _pick_target(self) -> str:
        """The coordinator to try now: the leader a standby named, else the next of the list."""
        named, self._next_target = self._next_target, ""
        if named:
            return named
        if not self._tried:
            self._tried = True
            return self.targets[0]
        i = self.targets.index(self.target_now) if self.target_now in self.targets else -1
        return self.targets[(i + 1) % len(self.targets)]

    def _note_leader(self, err) -> None:
        """A standby's refusal names the leader: try it next when it is one of ours."""
        try:
            meta = err.trailing_metadata() or ()
        except Exception:  # noqa: BLE001
            meta = ()
        for key, value in meta:
            if key == LEADER_METADATA_KEY and value in self.targets and value != self.target_now:
                self._next_target = value

    def _connect_once(self, options: list[tuple[str, object]]) -> bool:
        """Open a channel and serve one stream until it ends; record why in ``last_error``.

        Returns True when the coordinator welcomed this stream. Errors of the stream and of the
        callbacks are caught (the link stays alive); none is raised.
        """
        target = self.target_now
        channel = (grpc.secure_channel(target, self.credentials, options=options) if self.credentials
                   else grpc.insecure_channel(target, options=options))
        ended = threading.Event()
        welcomed = threading.Event()
        try:
            self._stream(channel, ended, welcomed)
            if not self._stop.is_set():
                self.last_error = "stream closed by coordinator"
        except grpc.RpcError as err:
            if not self._stop.is_set():
                code = err.code() if hasattr(err, "code") else None
                self.last_error = f"{code.name if code else 'error'}: {err.details() if hasattr(err, 'details') else err}"
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    self._note_leader(err)
        except (ProtocolMismatchError, LeaveCoordinator) as err:
            self.last_error = str(err)
        except Exception as err:  # noqa: BLE001 — keep the link alive whatever the callback did
            self.last_error = f"{type(err).__name__}: {err}"
            log.exception("agent link error")
        finally:
            self._end_stream(channel, ended)
        return welcomed.is_set()

    def _stream(self, channel, ended: threading.Event, welcomed: threading.Event) -> None:
        """Send the hello and handle the coordinator's messages until the stream ends.

        A stream not welcomed within :data:`WELCOME_TIMEOUT_S` seconds is cancelled.

        Raises:
            grpc.RpcError: the stream failed.
            ProtocolMismatchError: the coordinator speaks another major protocol version.
        """
        from capctl.v1 import capctl_pb2, capctl_pb2_grpc

        stub = capctl_pb2_grpc.AgentLinkStub(channel)
        self._drain()
        hello = self.hello_fn()
        call = stub.Connect(self._requests(hello, ended))
        with self._lock:
            self._call = call
        ha = len(self.targets) > 1
        watchdog = threading.Timer(HA_WELCOME_TIMEOUT_S if ha else WELCOME_TIMEOUT_S,
                                   lambda: (not welcomed.is_set()) and call.cancel())
        watchdog.daemon = True
        watchdog.start()
        last_msg = [time.monotonic()]
        if ha:
            threading.Thread(target=self._silence_watch, args=(call, ended, welcomed, last_msg), daemon=True,
                             name="agent-link-silence").start()
        try:
            for msg in call:
                last_msg[0] = time.monotonic()
                kind = msg.WhichOneof("body")
                if kind == "welcome":
                    self._welcomed(msg.welcome, watchdog, welcomed)
                elif kind == "plan" and welcomed.is_set():
                    ack = self.on_plan(msg.plan)
                    if ack is not None:
                        self._put(capctl_pb2.AgentMessage(ack=ack), force=True)
        finally:
            watchdog.cancel()

    def _silence_watch(self, call, ended: threading.Event, welcomed: threading.Event, last_msg: list) -> None:
        """Cancel ``call`` once welcomed and silent for :data:`SILENCE_INTERVALS` intervals (s)."""
        while not ended.wait(0.1) and not self._stop.is_set():
            silence_s = SILENCE_INTERVALS * max(0.1, self.interval_s)
            if welcomed.is_set() and time.monotonic() - last_msg[0] > silence_s:
                self.silence_drops += 1
                log.warning("coordinator %s silent for %.1f s; trying the next", self.target_now, silence_s)
                call.cancel()
                return

    def _welcomed(self, welcome, watchdog: threading.Timer, welcomed: threading.Event) -> None:
        """Take a ``Welcome``: check the protocol version, hand it to the agent, mark connected.

        Raises:
            ProtocolMismatchError: another major protocol version.
        """
        if welcome.protocol_version.split(".")[:2] != PROTOCOL_VERSION.split(".")[:2]:
            raise ProtocolMismatchError(f"coordinator speaks {welcome.protocol_version!r}, "
                                        f"agent {PROTOCOL_VERSION!r}")
        welcomed.set()
        watchdog.cancel()
        self.coordinator_id = welcome.coordinator_id
        if welcome.interval_s > 0:
            self.interval_s = float(welcome.interval_s)
        self.on_welcome(welcome)
        self._connected.set()
        self.connects += 1
        self.last_error = ""
        log.info("connected to coordinator %s (id %s, term %d)", self.target_now, welcome.coordinator_id, welcome.term)

    def _end_stream(self, channel, ended: threading.Event) -> None:
        """Close ``channel``; tell the agent (``on_disconnect``) when the stream had been connected."""
        ended.set()
        with self._lock:
            self._call = None
        was_connected = self._connected.is_set()
        self._connected.clear()
        channel.close()
        if was_connected and self.on_disconnect is not None:
            try:
                self.on_disconnect()
            except Exception:  # noqa: BLE001
                log.exception("on_disconnect failed")
