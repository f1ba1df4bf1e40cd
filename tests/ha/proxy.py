"""A unix-socket forwarder that a test can cut (network loss between one agent and one coordinator).

:meth:`UnixProxy.cut` turns it into a black hole: bytes in flight are dropped and new connections
are accepted but never forwarded, as on a network that silently loses packets (no reset reaches
either side). :meth:`UnixProxy.heal` closes the black-holed connections (their peers see the link
end) and forwards new ones again. Threads with bounded waits; :meth:`close` stops everything.
"""

from __future__ import annotations

import os
import select
import socket
import threading


class UnixProxy:
    """Forward connections of ``listen_path`` to ``target_path`` (both unix sockets)."""

    def __init__(self, listen_path: str, target_path: str) -> None:
        self.listen_path = listen_path
        self.target_path = target_path
        self.cut_now = False
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        if os.path.exists(listen_path):
            os.unlink(listen_path)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(listen_path)
        self._server.listen(64)
        self._server.settimeout(0.1)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="unix-proxy")
        self._thread.start()

    @property
    def address(self) -> str:
        return f"unix:{self.listen_path}"

    def cut(self) -> None:
        self.cut_now = True

    def heal(self) -> None:
        """Forward again; connections opened or carried during the cut are closed."""
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()
        self.cut_now = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._server.close()
        self.heal()
        try:
            os.unlink(self.listen_path)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with self._lock:
                self._conns.append(client)
            if self.cut_now:
                continue  # held open, never forwarded
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(self.target_path)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.append(upstream)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True, name="unix-proxy-pump").start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if not self.cut_now:
                        peers[s].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            a.close()
            b.close()
