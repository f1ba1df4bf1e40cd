"""gRPC servicers of the coordinator: AgentLink (agents), Admin (the ``capctl`` CLI), health and
reflection. Runs on ``grpc.aio`` in the coordinator's event loop.

Two servers share one :class:`~coordinator.loop.Coordinator`:

* the **listen** server (``--listen ADDR``): AgentLink, read-only Admin (Status, Nodes, Jobs,
  Explain), health, reflection. SetBudget/ReloadPolicy answer ``PERMISSION_DENIED`` unless the
  configured :class:`AdminAuthorizer` accepts the caller (e.g. a token file: ``--admin-token-file``).
* the **admin socket** server (``--admin-socket PATH``, a unix socket created with mode 0600, i.e.
  root-only on a head node where the daemon runs as root): the full Admin service, health and
  reflection. File permissions are the admin identity (:class:`TrustAll`).

With ``--tls-ca/--tls-cert/--tls-key`` the listen server requires client certificates of the
cluster CA (mTLS, :mod:`capctl.security.tls`): an agent's certificate must carry the role
``agent`` and name its node (CN or DNS SAN); admin RPCs accept a certificate with the role
``admin`` (:mod:`capctl.security.authz`, docs/security.md). Input bounds come from
:mod:`capctl.security.limits`.

Bounds: messages in up to :data:`MAX_MESSAGE_BYTES`, out up to :data:`MAX_REPLY_BYTES`; an agent must say hello within
:data:`HELLO_TIMEOUT_S`; at most :data:`MAX_GPUS_PER_NODE` GPUs and :data:`MAX_JOBS_PER_NODE` jobs
per node; each agent's outgoing queue holds :data:`OUT_QUEUE_LEN` messages (a stream that falls
further behind is closed; its node turns stale and counts at its caps).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from capctl.security import limits
from capctl.security.identity import agent_identity_problem, peer_identity
from capctl.v1 import capctl_pb2 as pb
from capctl.v1 import capctl_pb2_grpc as pb_grpc
from capctl.wattunits import format_watts
from coordinator.hangup import refusal_text

log = logging.getLogger("capctl.coordinator.server")

PROTOCOL_VERSION = "capctl.v1"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest message a peer may send this server (bytes): an agent's or an admin's request."""
MAX_REPLY_BYTES = 64 * 1024 * 1024
"""Largest message this server sends (bytes): the status of a large cluster (~160 bytes per GPU:
6 MiB at 40,000 GPUs, measured) went over :data:`MAX_MESSAGE_BYTES` from ~27,000 GPUs on and
``capctl status`` / ``nodes`` / ``jobs`` failed (RESOURCE_EXHAUSTED; found by a review); the same
as the admin client's receive limit (``coordinator.client.CHANNEL_OPTIONS``)."""
HELLO_TIMEOUT_S = 10.0
MAX_GPUS_PER_NODE = 64
MAX_JOBS_PER_NODE = 256
MAX_NAME_LEN = 253
OUT_QUEUE_LEN = 64
GRACE_S = 2.0
"""Seconds in-flight RPCs get on shutdown."""

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_REPLY_BYTES),
    ("grpc.max_concurrent_streams", 4096),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
    ("grpc.max_metadata_size", 16 * 1024),
]


def major_version(version: str) -> str:
    """``"capctl.v1"`` for ``"capctl.v1"``, ``"capctl.v1.3"``; the protocol's major version."""
    return ".".join(version.split(".")[:2])


def finished_request_problem(request) -> str:
    """What is wrong with a ``FinishedJobsRequest``, naming only the field at fault ("" when nothing):
    ``since_s`` must be a Unix time >= 0 (s), ``job_id`` at most :data:`limits.MAX_JOB_ID_LEN`
    characters."""
    if not request.since_s >= 0:  # also NaN
        return f"FinishedJobs: since_s {request.since_s!r} is not allowed; give a Unix time >= 0 (s), 0 for all"
    if len(request.job_id) > limits.MAX_JOB_ID_LEN:
        return (f"FinishedJobs: job_id of {len(request.job_id)} characters is not allowed; "
                f"at most {limits.MAX_JOB_ID_LEN}")
    return ""


def allocatable_under_limits_w(root) -> float | None:
    """Most watts the domain limits below the root let the allocator hand out, or None if unbounded.

    A child domain contributes its ``limit_w`` bounded by what its own children allow; a domain with
    nodes listed directly and no limit of its own is unbounded (None), as is a root listing nodes.

    Args:
        root: the policy's root :class:`capctl.policy.model.Domain` (watts).
    """
    def room(d) -> float | None:
        below: float | None
        if d.nodes:
            below = None
        elif d.children:
            parts = [room(c) for c in d.children]
            below = None if any(p is None for p in parts) else sum(parts)
        else:
            below = None  # a leaf (e.g. kind: node): bounded by its own limit only
        if d.limit_w is None:
            return below
        return d.limit_w if below is None else min(d.limit_w, below)

    if root.nodes or not root.children:
        return None
    parts = [room(c) for c in root.children]
    return None if any(p is None for p in parts) else float(sum(parts))


# ---------------------------------------------------------------------------------------------
# Admin identity

class AdminAuthorizer:
    """Decides whether a caller may use admin RPCs (SetBudget, ReloadPolicy). Hook for mTLS."""

    def allowed(self, context: grpc.aio.ServicerContext) -> bool:
        """True when the caller has an admin identity."""
        raise NotImplementedError

    def describe(self) -> str:
        """What this authorizer accepts, for error messages."""
        return ""


class TrustAll(AdminAuthorizer):
    """Every caller is admin: used on the root-only (mode 0600) admin unix socket."""

    def allowed(self, context) -> bool:
        return True


class DenyAll(AdminAuthorizer):
    """Nobody is admin (the default on the TCP listener)."""

    def __init__(self, admin_socket: str | None) -> None:
        self.admin_socket = admin_socket

    def allowed(self, context) -> bool:
        return False

    def describe(self) -> str:
        where = f"unix:{self.admin_socket}" if self.admin_socket else "the coordinator's admin unix socket"
        return f"admin operations need the root-only admin socket ({where})"


class TokenAuthorizer(AdminAuthorizer):
    """Admin when the call carries metadata ``authorization: Bearer <token>`` equal to the token file.

    The token file (``--admin-token-file``) should be root-only; it is read once at start.
    """

    def __init__(self, token: str, fallback: AdminAuthorizer) -> None:
        self._token = token.strip().encode()
        self.fallback = fallback

    def allowed(self, context) -> bool:
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                if self._token and hmac.compare_digest(value[7:].strip().encode(), self._token):
                    return True
        return self.fallback.allowed(context)

    def describe(self) -> str:
        return "admin operations need the admin token (metadata 'authorization: Bearer ...') or " + (
            self.fallback.describe() or "the admin socket"
        )


# ---------------------------------------------------------------------------------------------
# AgentLink


REFUSED_LOG_EVERY_S = 60.0
"""A stream's refused reports are logged at most once per this many seconds (with a count)."""


class AgentSession:
    """One open AgentLink stream: outgoing queue, plans awaiting acknowledgement."""

    def __init__(self, node: str, peer: str) -> None:
        self.node = node
        self.peer = peer
        self.outq: asyncio.Queue = asyncio.Queue(maxsize=OUT_QUEUE_LEN)
        self.waiters: dict[int, asyncio.Future] = {}
        self.sent: dict[int, tuple] = {}  # seq -> (sent mono, caps {index: W}, phase, telemetry mono)
        self.closed = asyncio.Event()
        self.close_reason = ""
        self._refused_mono = -math.inf  # when a refused report was last logged (time.monotonic)
        self._refused_quiet = 0  # refused reports since, not logged

    def note_refused(self, problem: str, now_mono: float | None = None) -> bool:
        """Log a refused ``NodeTelemetry`` (``problem``: why) at most once per
        :data:`REFUSED_LOG_EVERY_S` per stream, with the count of those not logged since (a bad
        agent sends one a second); returns True when it logged. The node keeps its last readings
        (it turns stale if nothing it sends is taken)."""
        now = time.monotonic() if now_mono is None else now_mono
        if now - self._refused_mono < REFUSED_LOG_EVERY_S:
            self._refused_quiet += 1
            return False
        more = f" ({self._refused_quiet} more refused since the last line)" if self._refused_quiet else ""
        log.warning("agent %s: NodeTelemetry refused, readings not taken: %s%s", self.node, problem, more)
        self._refused_mono, self._refused_quiet = now, 0
        return True

    def send(self, msg: pb.CoordinatorMessage) -> bool:
        """Queue ``msg`` for the agent; closes the session when the agent falls too far behind."""
        if self.closed.is_set():
            return False
        try:
            self.outq.put_nowait(msg)
            return True
        except asyncio.QueueFull:
            self.close(f"agent {self.node} does not read its stream ({OUT_QUEUE_LEN} messages queued)")
            return False

    def close(self, reason: str) -> None:
        """End the stream (the handler returns); pending ack waiters get ``None``."""
        if not self.closed.is_set():
            self.close_reason = reason
            self.closed.set()
            for fut in self.waiters.values():
                if not fut.done():
                    fut.set_result(None)
            self.waiters.clear()


class AgentLinkServicer(pb_grpc.AgentLinkServicer):
    """``capctl.v1.AgentLink``: one bidirectional stream per node agent (docs/protocol.md)."""

    def __init__(self, coord, require_agent_identity: bool = False) -> None:
        self.coord = coord
        self.require_agent_identity = require_agent_identity

    @staticmethod
    def validate_hello(hello: pb.AgentHello) -> str:
        """Return "" if the hello is acceptable, else what is wrong (one line)."""
        problem = limits.validate_hello(hello)  # bounds of capctl.security.limits first
        if problem:
            return problem
        if not hello.node or len(hello.node) > MAX_NAME_LEN or any(c.isspace() for c in hello.node):
            return f"AgentHello.node {hello.node[:64]!r}: need a host name of 1..{MAX_NAME_LEN} characters"
        if len(hello.gpus) > MAX_GPUS_PER_NODE:
            return f"AgentHello.gpus: {len(hello.gpus)} GPUs, at most {MAX_GPUS_PER_NODE} allowed"
        if len(hello.jobs) > MAX_JOBS_PER_NODE:
            return f"AgentHello.jobs: {len(hello.jobs)} jobs, at most {MAX_JOBS_PER_NODE} allowed"
        seen = set()
        for g in hello.gpus:
            if g.index in seen:
                return f"AgentHello.gpus: index {g.index} twice"
            seen.add(g.index)
            vals = (g.min_cap_w, g.max_cap_w, g.default_cap_w, g.slowdown_temp_c)
            if not all(math.isfinite(v) for v in vals):
                return (
                    f"AgentHello.gpus[{g.index}]: min_cap_w={g.min_cap_w} max_cap_w={g.max_cap_w} "
                    f"default_cap_w={g.default_cap_w} slowdown_temp_c={g.slowdown_temp_c}: need finite numbers"
                )
            # limit constraints the device got wrong ((0, 0), min > max, out of bounds) are bad device
            # data, not a bad hello: that GPU is held at its limit (UNSUPPORTED_CONSTRAINTS), the
            # node's other GPUs are controlled (capctl.devicedata)
        return ""

    async def Connect(self, request_iterator, context):  # noqa: N802 (gRPC name)
        coord = self.coord
        if not coord.may_send():  # an HA standby: parked, then the agent goes to the leader (coordinator/ha.py)
            from coordinator import ha

            if await ha.park(coord):
                return await self._serve(context, coord)
            context.set_trailing_metadata(ha.leader_metadata(coord))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, ha.not_leader_message(coord, "AgentLink"))
            return
        await self._serve(context, coord)

    async def _serve(self, context, coord) -> None:
        """One agent's stream: hello, welcome, then its messages until it ends."""
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no AgentHello within {HELLO_TIMEOUT_S:.0f} s")
            return
        if first is grpc.aio.EOF or first is None or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a stream must be AgentHello")
            return
        hello = first.hello
        if major_version(hello.protocol_version) != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {hello.protocol_version[:40]!r} not supported; this coordinator speaks {PROTOCOL_VERSION}",
            )
            return
        problem = self.validate_hello(hello)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        if self.require_agent_identity:
            who = peer_identity(context)
            problem = agent_identity_problem(who, hello.node)
            if problem:
                log.warning("AgentLink from %s refused for node %r: %s", context.peer(), hello.node[:64], problem)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"AgentHello.node {hello.node[:64]!r}: {problem}")
                return
        session = AgentSession(hello.node, context.peer())
        problem = coord.claim_problem(hello, session)
        if problem:
            log.warning("AgentLink from %s refused: %s", context.peer(), problem)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, problem)
            return
        coord.attach(hello, session)
        tasks: list[asyncio.Task] = []
        try:
            await context.write(pb.CoordinatorMessage(welcome=coord.welcome_for(hello.node)))
            tasks = [asyncio.ensure_future(self._read(context, session)),
                     asyncio.ensure_future(self._write(context, session)),
                     asyncio.ensure_future(session.closed.wait())]
            for task in tasks:
                task.add_done_callback(_retrieve)
            done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.warning("agent %s stream: %s: %s", hello.node, type(task.exception()).__name__, task.exception())
        finally:
            # the handler ends (agent gone, stream replaced, shutdown, or the RPC itself cancelled by
            # gRPC): stop the reader and writer and wait for them, so that none outlives its stream.
            # The node is detached even if that wait is cancelled in turn (a second cancellation of
            # the handler): a stream that ended must never stay attached
            try:
                await _stop_tasks(tasks)
            finally:
                session.close(session.close_reason or "stream ended")
                coord.detach(hello.node, session)
                log.info("agent %s disconnected (%s)", hello.node, session.close_reason)

    async def _read(self, context, session: AgentSession) -> None:
        coord = self.coord
        while True:
            try:
                msg = await context.read()
            except (grpc.aio.AioRpcError, grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                session.close_reason = session.close_reason or f"stream closed while reading ({type(exc).__name__})"
                return
            if msg is grpc.aio.EOF or msg is None:
                session.close_reason = "agent closed its stream"
                return
            kind = msg.WhichOneof("body")
            if kind == "telemetry":
                tele = msg.telemetry
                if tele.node and tele.node != session.node:
                    log.warning("telemetry for %r on the stream of %r ignored", tele.node, session.node)
                    continue
                rows, problem = limits.telemetry_rows(tele, session.node)  # decoded once, packed or not
                if problem:
                    session.note_refused(problem)
                    continue
                coord.on_energy(session.node, tele)
                coord.note_report(session.node)
                coord.note_clock(session.node, tele.timestamp_s)
                if coord.registry.on_telemetry(session.node, tele, rows) | coord.first_report(session.node):
                    coord.wake()  # a node's first readings (or its first report on a new HA stream): allocate it now
            elif kind == "ack":
                rows, problem = limits.ack_rows(msg.ack)
                if problem:
                    log.warning("agent %s: CapAck %d ignored: %s", session.node, msg.ack.seq, problem)
                    continue
                coord.on_ack(session, msg.ack, rows)
            elif kind == "job_started":
                problem = limits.validate_binding(msg.job_started.binding, session.node, "JobStarted.binding")
                if problem:
                    log.warning("agent %s: JobStarted ignored: %s", session.node, problem)
                    continue
                coord.registry.on_job_started(session.node, msg.job_started.binding)
                coord.wake()
            elif kind == "job_ended":
                coord.on_job_ended(session.node, msg.job_ended)
                coord.wake()
            elif kind == "hello":
                if msg.hello.node != session.node or self.validate_hello(msg.hello):
                    session.close_reason = "invalid AgentHello inside the stream"
                    return
                coord.attach(msg.hello, session)

    async def _write(self, context, session: AgentSession) -> None:
        coord = self.coord
        while True:
            msg = await session.outq.get()
            if msg.WhichOneof("body") == "plan":  # advised now, not when queued: the wait in the queue is left out
                msg.plan.report_in_s = coord.report_in_s(session.node)
            try:
                await context.write(msg)
            except (grpc.aio.AioRpcError, grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                # the agent went away (stream closed or cancelled): the handler ends and detaches it
                session.close_reason = session.close_reason or f"stream closed while writing ({type(exc).__name__})"
                return


def _retrieve(task: asyncio.Future) -> None:
    """Done-callback marking a stream task's exception as retrieved (the handler reports what
    matters; a task ending with the stream must not log "exception was never retrieved")."""
    if not task.cancelled():
        task.exception()


STOP_TASKS_S = 2.0
"""Bound (s) on waiting for a stream's reader and writer after they were cancelled."""


async def _stop_tasks(tasks: list) -> None:
    """Cancel ``tasks`` and wait (bounded by :data:`STOP_TASKS_S`) until they finished."""
    live = [t for t in tasks if not t.done()]
    for t in live:
        t.cancel()
    if not live:
        return
    # if this wait is cancelled in turn, the tasks still end on their own (already cancelled;
    # their exceptions are retrieved by _retrieve)
    await asyncio.wait(live, timeout=STOP_TASKS_S)


# ---------------------------------------------------------------------------------------------
# Admin


class AdminServicer(pb_grpc.AdminServicer):
    """``capctl.v1.Admin``: status views for everyone; SetBudget/ReloadPolicy for admins only."""

    def __init__(self, coord, authorizer: AdminAuthorizer) -> None:
        self.coord = coord
        self.authorizer = authorizer

    async def _require_admin(self, context, what: str) -> None:
        if not self.coord.may_send():  # an HA standby answers reads only (coordinator/ha.py)
            from coordinator import ha

            context.set_trailing_metadata(ha.leader_metadata(self.coord))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, ha.not_leader_message(self.coord, what))
        decide = getattr(self.authorizer, "decide", None)
        how = decide(context) if decide is not None else ("admin" if self.authorizer.allowed(context) else None)
        if how is None:
            log.warning("%s refused for %s (%s)", what, context.peer(), peer_identity(context).describe())
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{what}: permission denied: {self.authorizer.describe()}"
            )
        log.info("%s by %s (%s)", what, context.peer() or "?", how)  # audit line; never a secret

    async def _status(self):
        """The status reply; the interval's view is built off the event loop when it is not yet
        (a large cluster's takes seconds: ~40 us per GPU, bench/interval_cost.py's ``view``), so
        the loop keeps taking reports and acknowledgements meanwhile (it was built on the loop:
        every ``capctl status`` held the control loop that long; found by a review)."""
        view = getattr(self.coord, "view", None)
        resolve = getattr(view, "resolve", None)
        if resolve is None:  # (a View already built)
            return self.coord.status_reply()
        await asyncio.to_thread(resolve)
        return self.coord.status_reply(view)

    async def Status(self, request, context):  # noqa: N802
        return await self._status()

    async def Nodes(self, request, context):  # noqa: N802
        return await self._status()

    async def Jobs(self, request, context):  # noqa: N802
        return await self._status()

    async def Explain(self, request, context):  # noqa: N802
        reply = await self.coord.explain_async(request.job_id)
        if reply is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"job {request.job_id[:100]!r}: no running job is bound to "
                                "GPUs under that id and no finished one is kept")
        return reply

    async def FinishedJobs(self, request, context):  # noqa: N802
        from coordinator.store import StoreError

        problem = finished_request_problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            return await self.coord.finished_jobs_async(request)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"finished jobs: {exc}")

    async def SetBudget(self, request, context):  # noqa: N802
        await self._require_admin(context, "budget set")
        budget = request.budget_w
        problem = limits.validate_budget(budget)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        reply = await self.coord.set_budget(budget)
        if reply.ok:
            room_w = allocatable_under_limits_w(self.coord.policy.domains)
            if room_w is not None and budget > room_w + 1e-6:
                reply.message += (f"; WARNING: only {format_watts(room_w)} W can be allocated under the domain limits below "
                                  f"the root (the rest of the budget stays unused)")
        return reply

    async def ReloadPolicy(self, request, context):  # noqa: N802
        await self._require_admin(context, "policy reload")
        problem = limits.validate_policy_path(request.path)
        if problem:
            log.warning("policy reload by %s refused: %s", context.peer() or "?", problem)
            self._count_reload("error")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        reply = await self.coord.reload_policy(request.path)
        if not reply.ok:  # the reason, not only the audit line (the CLI gets the same text)
            log.warning("policy reload by %s refused: %s", context.peer() or "?", refusal_text(reply))
        self._count_reload("ok" if reply.ok else "error")
        return reply

    def _count_reload(self, result: str) -> None:
        """``capctl_policy_reloads_total{result}``, as SIGHUP's (it counted SIGHUP only, so the
        alert on failed reloads missed ``capctl policy reload``; found by a try-out)."""
        ops = getattr(getattr(self.coord, "metrics", None), "ops", None)
        if ops is not None:
            ops.reloaded(result)


# ---------------------------------------------------------------------------------------------
# Servers


def build_server(coord, address: str, authorizer: AdminAuthorizer, agent_link: bool,
                 credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """Create (not start) an aio server on ``address`` with Admin, health, reflection (and AgentLink).

    With ``credentials`` (:func:`capctl.security.tls.server_credentials`) the port requires mTLS and
    AgentLink checks that each agent's certificate names its node.

    Returns ``(server, bound_port)``; ``bound_port`` is 0 for unix sockets.
    Raises:
        RuntimeError: the address cannot be bound (message names it).
    """
    server = grpc.aio.server(options=SERVER_OPTIONS, maximum_concurrent_rpcs=8192)
    names = [pb.DESCRIPTOR.services_by_name["Admin"].full_name]
    pb_grpc.add_AdminServicer_to_server(AdminServicer(coord, authorizer), server)
    if agent_link:
        pb_grpc.add_AgentLinkServicer_to_server(AgentLinkServicer(coord, credentials is not None), server)
        names.append(pb.DESCRIPTOR.services_by_name["AgentLink"].full_name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names.append(health.SERVICE_NAME)
    names.append(reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {address}: {exc}") from None
    if port == 0 and not address.startswith("unix"):
        raise RuntimeError(f"cannot listen on {address}: address in use or not available")
    server.health_servicer = health_servicer  # type: ignore[attr-defined]
    server.service_names = names  # type: ignore[attr-defined]
    return server, port


async def set_serving(server: grpc.aio.Server, serving: bool) -> None:
    """Mark every service of ``server`` (and the overall "" service) SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    hs = server.health_servicer  # type: ignore[attr-defined]
    for name in ["", *server.service_names]:  # type: ignore[attr-defined]
        await hs.set(name, status)


def now_s() -> float:
    """Unix time in seconds."""
    return time.time()
