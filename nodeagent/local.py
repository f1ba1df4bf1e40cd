"""AgentLocal: the node agent's local service for the Slurm hooks, on a root-only unix socket.

Wire format: plain gRPC (``capctl.v1.AgentLocal``) over a unix socket, so any gRPC client works::

    channel = grpc.insecure_channel("unix:/run/capctl/agent.sock")
    capctl_pb2_grpc.AgentLocalStub(channel).JobStart(request, timeout=2.0)

(:class:`capctl.agentclient.LocalClient` wraps exactly that.) gRPC's Python server does not expose the peer's
credentials of a unix-socket connection, so the agent does not let gRPC listen on the public socket
itself. :class:`LocalServer` accepts every connection on the public socket, reads the kernel's
``SO_PEERCRED`` (pid, uid, gid) of the connecting process, decides with :func:`peer_allowed`, and
splices the connection to one of two private gRPC servers (unix sockets in a 0700 directory):

- the real service, for root, the agent's own user, or a member of the configured group;
- a service that answers every call with ``PERMISSION_DENIED`` and a clear message otherwise.

The public socket is created with mode 0600 (0660 and the configured group when one is set), so the
file mode keeps other users out and the ``SO_PEERCRED`` check holds even if the mode is loosened.
Connections are bounded (:data:`MAX_CONNECTIONS`) and each one is closed after
:data:`CONNECTION_IDLE_S` without traffic.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from capctl import privdirs
from capctl.agentclient import DEFAULT_CALL_TIMEOUT_S, LocalClient  # noqa: F401 (the client side, re-exported)
from capctl.errors import UserInputError
from capctl.security.peercred import PeerCred, peer_cred, splice  # noqa: F401 (PeerCred re-exported)

log = logging.getLogger("capctl.agent.local")

MAX_CONNECTIONS = 64
"""Most local connections served at once (each holds two splice threads); extra ones are refused."""

CONNECTION_IDLE_S = 30.0
"""A local connection with no traffic for this long is closed (Slurm hooks make one short call)."""


def supplementary_gids(pid: int) -> set[int]:
    """Supplementary group ids of process ``pid`` from ``/proc/PID/status`` (empty if unreadable)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def peer_allowed(
    cred: PeerCred,
    *,
    agent_uid: int,
    allowed_gid: int | None,
    groups_of: Callable[[int], set[int]] = supplementary_gids,
) -> tuple[bool, str]:
    """Decide whether a local peer may use AgentLocal.

    Allowed: uid 0 (root, what slurmd runs the prolog/epilog as), the agent's own uid, or — when a
    group is configured (``allowed_gid``) — a process whose primary or supplementary group is it.

    Returns:
        ``(allowed, reason)``; ``reason`` names the uid/gid/pid when refused.
    """
    if cred.uid == 0:
        return True, "root"
    if cred.uid == agent_uid:
        return True, "agent user"
    if allowed_gid is not None and (cred.gid == allowed_gid or allowed_gid in groups_of(cred.pid)):
        return True, f"group {allowed_gid}"
    group = f" or group gid {allowed_gid}" if allowed_gid is not None else ""
    return False, (
        f"permission denied: peer uid {cred.uid} gid {cred.gid} pid {cred.pid} is not root"
        f"{group} (SO_PEERCRED check of the capctl agent's local socket)"
    )


def resolve_group(name: str | None) -> int | None:
    """Return the gid of group ``name`` (a name or a number); ``None`` for no group.

    Raises:
        UserInputError: the group does not exist.
    """
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise UserInputError(f"local socket group {name!r} does not exist (getent group {name})") from None


class _DeniedService:
    """Generic handler answering every AgentLocal method with PERMISSION_DENIED."""

    def __init__(self) -> None:
        self.message = "permission denied: not root or the configured group (SO_PEERCRED)"

    def service(self, handler_call_details):  # grpc.GenericRpcHandler protocol
        def deny(request, context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, self.message)

        return grpc.unary_unary_rpc_method_handler(
            deny, request_deserializer=lambda b: b, response_serializer=lambda b: b
        )


def socket_in_use(path: str, timeout_s: float = 1.0) -> tuple[bool, str]:
    """Whether a process is serving on the unix socket ``path`` (by connecting to it).

    Returns:
        ``(True, "pid N")`` when a connection is accepted (the pid from ``SO_PEERCRED``, the listener's
        credentials per socket(7); ``"pid unknown"`` if unavailable), ``(True, reason)`` when it cannot be
        checked (e.g. permission denied: treated as in use), ``(False, reason)`` when nobody listens
        (connection refused: a stale socket file left by a killed process).
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        return False, exc.strerror or str(exc)
    except OSError as exc:
        return True, f"cannot check: {exc.strerror or exc}"
    try:
        try:
            return True, f"pid {peer_cred(s).pid}"
        except OSError:
            return True, "pid unknown"
    finally:
        s.close()


class LocalServer:
    """Serve an ``AgentLocalServicer`` on a unix socket with a real ``SO_PEERCRED`` check.

    Args:
        socket_path: public socket path (created; a stale socket file is replaced, a live one, where
            another process answers, is refused).
        servicer: a ``capctl_pb2_grpc.AgentLocalServicer`` implementation.
        allowed_gid: gid allowed besides root and the agent's own user (``None``: root-only).

    Raises:
        UserInputError: the socket's directory does not exist, the path is not a socket, or another
            process is serving on it.
    """

    def __init__(self, socket_path: str, servicer, allowed_gid: int | None = None) -> None:
        self.socket_path = str(socket_path)
        self.servicer = servicer
        self.allowed_gid = allowed_gid
        self.agent_uid = os.geteuid()
        self._stop = threading.Event()
        self._conns = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._private_dir: str | None = None
        self._servers: list[grpc.Server] = []
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file we bound
        self.refused = 0  # connections refused by the SO_PEERCRED check (for tests and logs)

    def start(self) -> None:
        from capctl.v1 import capctl_pb2_grpc

        parent = Path(self.socket_path).parent
        if not parent.is_dir():
            raise UserInputError(f"--socket {self.socket_path}: directory {parent} does not exist")
        if len(self.socket_path.encode()) > 107:
            raise UserInputError(f"--socket {self.socket_path}: path longer than 107 bytes (unix socket limit)")
        p = Path(self.socket_path)
        if p.exists() or p.is_symlink():
            if not p.is_socket():
                raise UserInputError(f"--socket {self.socket_path}: exists and is not a socket; refusing to replace it")
            live, detail = socket_in_use(self.socket_path)
            if live:
                raise UserInputError(f"--socket: another agent is serving on {self.socket_path}"
                                     f" ({detail}); stop it first")
            p.unlink()  # stale: nobody answers
        self._private_dir = privdirs.make("capctl-agent-")  # mode 0700; a killed agent's are removed
        self._allowed_path = os.path.join(self._private_dir, "allowed.sock")
        self._denied_path = os.path.join(self._private_dir, "denied.sock")
        real = grpc.server(futures.ThreadPoolExecutor(max_workers=4), maximum_concurrent_rpcs=32,
                           options=[("grpc.max_receive_message_length", 1 << 20)])
        capctl_pb2_grpc.add_AgentLocalServicer_to_server(self.servicer, real)
        real.add_insecure_port(f"unix:{self._allowed_path}")
        denied = grpc.server(futures.ThreadPoolExecutor(max_workers=2), maximum_concurrent_rpcs=8,
                             options=[("grpc.max_receive_message_length", 1 << 16)])
        denied.add_generic_rpc_handlers((_DeniedService(),))
        denied.add_insecure_port(f"unix:{self._denied_path}")
        real.start()
        denied.start()
        self._servers = [real, denied]

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        st = os.stat(self.socket_path)
        self._socket_id = (st.st_dev, st.st_ino)
        if self.allowed_gid is not None:
            os.chown(self.socket_path, -1, self.allowed_gid)
            os.chmod(self.socket_path, 0o660)
        else:
            os.chmod(self.socket_path, 0o600)
        listener.listen(64)
        listener.settimeout(0.5)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept_loop, name="agent-local-accept", daemon=True)
        self._thread.start()
        log.info("local service on unix:%s (mode %s, group %s)", self.socket_path,
                 "0660" if self.allowed_gid is not None else "0600",
                 self.allowed_gid if self.allowed_gid is not None else "root only")

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            try:
                cred = peer_cred(conn)
            except OSError:
                conn.close()
                continue
            allowed, reason = peer_allowed(cred, agent_uid=self.agent_uid, allowed_gid=self.allowed_gid)
            if not allowed:
                self.refused += 1
                log.warning("local connection refused: %s", reason)
            if not self._conns.acquire(blocking=False):
                log.warning("local connection dropped: %d connections already open", MAX_CONNECTIONS)
                conn.close()
                continue
            target = self._allowed_path if allowed else self._denied_path
            threading.Thread(target=self._splice, args=(conn, target), name="agent-local-conn", daemon=True).start()

    def _splice(self, conn: socket.socket, target: str) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(target)
            splice(conn, upstream, self._stop, CONNECTION_IDLE_S)
        except OSError:
            pass
        finally:
            for s in (conn, upstream):
                try:
                    s.close()
                except OSError:
                    pass
            self._conns.release()

    def stop(self) -> None:
        """Stop accepting, close the public socket (and unlink it), stop the private servers."""
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        try:
            st = os.stat(self.socket_path)
            # unlink only our own socket file: another process may have replaced it since
            if self._socket_id == (st.st_dev, st.st_ino):
                os.unlink(self.socket_path)
        except OSError:
            pass
        for server in self._servers:
            server.stop(grace=0.5).wait(2.0)
        if self._private_dir:
            for name in ("allowed.sock", "denied.sock", privdirs.OWNER_FILE):
                try:
                    os.unlink(os.path.join(self._private_dir, name))
                except OSError:
                    pass
            try:
                os.rmdir(self._private_dir)
            except OSError:
                pass
