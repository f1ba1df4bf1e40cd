"""The caller's credentials (``SO_PEERCRED``) on a gRPC server's unix socket, for audit lines.

gRPC's Python server does not expose the credentials of a unix-socket peer, and ``context.peer()``
of such a connection is ``"unix:"`` plus the *client's* bound address (empty for an ordinary
client). :class:`CredentialSplice` serves the public socket itself: for every connection it reads
the kernel's ``SO_PEERCRED`` (pid, uid, gid of the connecting process, socket(7)) and splices the
bytes to the gRPC server's private socket, in a private 0700 directory, from a client socket bound
to ``<private dir>/peer-<uid>-<gid>-<pid>-<n>`` (unlinked once connected). The gRPC handler then
reads the caller back from ``context.peer()`` with :func:`caller_of`, which accepts only names in
a live splice's private directory: nobody but the daemon's user can bind there, so a client cannot
pass itself off as another user by binding a look-alike name elsewhere.

The splice decides nothing: who may connect is still the public socket's file mode (and group).
Connections are bounded (:data:`MAX_CONNECTIONS`) and closed after :data:`CONNECTION_IDLE_S` of
silence; two threads per connection, no fork.
"""

from __future__ import annotations

import itertools
import logging
import os
import pwd
import re
import select
import shutil
import socket
import struct
import threading
from dataclasses import dataclass

from capctl import privdirs

log = logging.getLogger("capctl.security.peercred")

MAX_CONNECTIONS = 32
"""Most connections spliced at once; extra ones are closed at once (admin CLI calls are short)."""
CONNECTION_IDLE_S = 60.0
"""A connection with no traffic for this long is closed (s)."""
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;} (socket(7))
_PEER = re.compile(r"^unix:(?P<dir>/.+)/peer-(?P<uid>\d+)-(?P<gid>\d+)-(?P<pid>\d+)-\d+$")
_LIVE_DIRS: set[str] = set()
"""Private directories of the running splices (the only places :func:`caller_of` trusts)."""


@dataclass(frozen=True)
class PeerCred:
    """Credentials of the process at the other end of a unix socket (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int

    def describe(self) -> str:
        """``"uid 1000 (alice) gid 1000 pid 4242"`` (the user name when the system knows it)."""
        try:
            name = f" ({pwd.getpwuid(self.uid).pw_name})"
        except KeyError:
            name = ""
        return f"uid {self.uid}{name} gid {self.gid} pid {self.pid}"


def peer_cred(sock: socket.socket) -> PeerCred:
    """The ``SO_PEERCRED`` credentials of a connected unix socket (Linux, socket(7)).

    Raises:
        OSError: not a connected unix socket.
    """
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCred(pid=pid, uid=uid, gid=gid)


def caller_of(peer: str) -> PeerCred | None:
    """The caller a :class:`CredentialSplice` recorded in a gRPC ``context.peer()`` string, or None
    (not spliced, or a name outside every live splice's private directory)."""
    m = _PEER.match(peer or "")
    if m is None or m.group("dir") not in _LIVE_DIRS:
        return None
    return PeerCred(pid=int(m.group("pid")), uid=int(m.group("uid")), gid=int(m.group("gid")))


class CredentialSplice:
    """Serve ``public_path`` for a gRPC server bound to :attr:`private_address` (see module docstring).

    Args:
        public_path: the socket clients connect to (created by :meth:`start`, mode from the umask;
            the caller sets mode and group afterwards, and removes a stale file before).
    """

    def __init__(self, public_path: str) -> None:
        self.public_path = str(public_path)
        # $TMPDIR or /tmp (PrivateTmp= under systemd), mode 0700; a killed coordinator's are removed
        self.private_dir = privdirs.make("capctl-peer-")
        self.private_path = os.path.join(self.private_dir, "grpc.sock")
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._n = itertools.count(1)  # next() is atomic under the GIL

    @property
    def private_address(self) -> str:
        """The gRPC address to bind the server to (``unix:<private dir>/grpc.sock``)."""
        return f"unix:{self.private_path}"

    def start(self) -> None:
        """Bind and listen on the public socket; accept in a thread.

        Raises:
            OSError: the public socket cannot be bound.
        """
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.public_path)
        except OSError:
            listener.close()
            raise
        listener.listen(64)
        listener.settimeout(0.5)
        self._listener = listener
        _LIVE_DIRS.add(self.private_dir)
        self._thread = threading.Thread(target=self._accept_loop, name="peercred-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, remove the public socket and the private directory (idempotent)."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.public_path)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(2.0)
            self._thread = None
        _LIVE_DIRS.discard(self.private_dir)
        shutil.rmtree(self.private_dir, ignore_errors=True)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if not self._slots.acquire(blocking=False):
                log.warning("%s: connection closed: %d connections already open", self.public_path, MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="peercred-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            cred = peer_cred(conn)
            name = os.path.join(self.private_dir, f"peer-{cred.uid}-{cred.gid}-{cred.pid}-{next(self._n)}")
            upstream.bind(name)
            try:
                upstream.connect(self.private_path)
            finally:
                os.unlink(name)  # the kernel keeps the address: getpeername() still names the caller
            splice(conn, upstream, self._stop)
        except OSError:
            pass
        finally:
            for s in (conn, upstream):
                try:
                    s.close()
                except OSError:
                    pass
            self._slots.release()


def splice(a: socket.socket, b: socket.socket, stop: threading.Event, idle_s: float = CONNECTION_IDLE_S) -> None:
    """Copy bytes both ways until either side closes, ``idle_s`` seconds of silence, or ``stop``
    (raises OSError from either socket)."""
    socks = [a, b]
    while not stop.is_set():
        ready, _, _ = select.select(socks, [], [], idle_s)
        if not ready:
            return
        for s in ready:
            data = s.recv(65536)
            if not data:
                return
            (b if s is a else a).sendall(data)
