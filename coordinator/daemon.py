"""``capctl-coordinator``: the head-node daemon (entry point :func:`main`).

Usage::

    capctl-coordinator --policy FILE --listen ADDR --state-dir DIR [--dry-run]
                       [--admin-socket PATH] [--admin-token-file PATH]
                       [--metrics-port PORT | --metrics-listen HOST:PORT] [--ready-file PATH]
                       [--tls-ca FILE --tls-cert FILE --tls-key FILE | --insecure] [--version]

Signals: SIGTERM/SIGINT stop; SIGHUP reloads the policy file (:mod:`coordinator.hangup`). Under
systemd it reports readiness and reloads through sd_notify (:mod:`capctl.sdnotify`). A TCP
``--listen`` that is not loopback needs TLS unless ``--insecure`` (:mod:`capctl.security.plaintext`).

Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 for a user error (unreadable or invalid
policy, address in use, unusable admin socket path) printed as one ``capctl-coordinator: ...``
message (the policy's ``file:line:col`` errors follow, one a line), 2 for bad flags (argparse).

An unusable ``--state-dir`` at startup (not a directory, cannot be created, not writable) is a user
error (exit 1). A corrupt state database, or one that breaks later, does not stop the daemon: it logs
the error, raises an alert (``capctl status``) and runs on its last good, in-memory state. See
docs/coordinator.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import socket
import stat
import sys
import time

from capctl import lifeline
from capctl.errors import UserInputError, run_for_person

log = logging.getLogger("capctl.coordinator")

DEFAULT_LISTEN = "0.0.0.0:7373"
DEFAULT_STATE_DIR = "/var/lib/capctl"
DEFAULT_ADMIN_SOCKET = "/run/capctl/coordinator.sock"
DEFAULT_POLICY = "/etc/capctl/policy.yaml"
DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_METRICS_PORT = 9464
STOP_TIMEOUT_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    """The daemon's command line."""
    from capctl.progdoc import add_standard_arguments

    p = add_standard_arguments(argparse.ArgumentParser(
        prog="capctl-coordinator",
        description="capctl coordinator: allocates the power budget across GPUs every interval (W, degC, s).",
    ))
    p.add_argument("--policy", default=DEFAULT_POLICY, metavar="FILE", help=f"policy YAML (default {DEFAULT_POLICY})")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="ADDR",
                   help=f"gRPC address for agents and read-only admin: HOST:PORT or unix:PATH (default {DEFAULT_LISTEN}; port 0 = any)")
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR, metavar="DIR",
                   help=f"directory of the state database coordinator.db (default {DEFAULT_STATE_DIR})")
    p.add_argument("--dry-run", action="store_true", help="compute, report and export; apply nothing")
    p.add_argument("--finished-retention-days", type=float, default=30.0, metavar="DAYS",
                   help="keep finished jobs (energy, GPU-seconds, ...) this many days after their end (default 30)")
    p.add_argument("--finished-max-jobs", type=int, default=100_000, metavar="N",
                   help="keep at most N finished jobs, the oldest dropped first (default 100000)")
    p.add_argument("--admin-socket", default=DEFAULT_ADMIN_SOCKET, metavar="PATH",
                   help=f"root-only unix socket (mode 0600) for admin RPCs (default {DEFAULT_ADMIN_SOCKET}; 'none' = off)")
    p.add_argument("--admin-token-file", metavar="PATH",
                   help="file holding a bearer token that grants admin RPCs on --listen (keep it root-only)")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--metrics-port", type=int, metavar="PORT",
                   help=f"Prometheus port on {DEFAULT_METRICS_HOST} (default {DEFAULT_METRICS_PORT}; 0 = any; -1 = off)")
    m.add_argument("--metrics-listen", metavar="HOST:PORT", help="Prometheus address (loopback recommended; 'none' = off)")
    p.add_argument("--status-socket", metavar="PATH",
                   help="unix socket serving read-only status (mode 0660, group coordinator.status_group of the policy)")
    from capctl.security.tls import add_tls_arguments

    add_tls_arguments(p, what="--listen (agents and the CLI then need certificates of that CA)", server=True)
    from capctl.security.plaintext import add_insecure_argument

    add_insecure_argument(p, "--listen")
    from coordinator.hadaemon import add_ha_arguments

    add_ha_arguments(p)
    p.add_argument("--ready-file", metavar="PATH",
                   help="write a JSON file with the bound addresses once serving (for scripts and tests)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _metrics_addr(args) -> tuple[str, int] | None:
    if args.metrics_listen is not None:
        if args.metrics_listen.lower() == "none":
            return None
        host, sep, port = args.metrics_listen.rpartition(":")
        if not sep or not port.isdigit():
            raise UserInputError(f"--metrics-listen {args.metrics_listen!r}: expected HOST:PORT (e.g. 127.0.0.1:9464) or 'none'")
        if int(port) > 65535:
            raise UserInputError(f"--metrics-listen {args.metrics_listen!r}: port {int(port)} out of range; allowed 0..65535")
        return host.strip("[]") or DEFAULT_METRICS_HOST, int(port)
    port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    if port < 0:
        return None
    if port > 65535:
        raise UserInputError(f"--metrics-port {port}: expected 0..65535 (or -1 = off)")
    return DEFAULT_METRICS_HOST, port


def _prepare_unix_socket(path: str, flag: str = "--admin-socket") -> None:
    """Create the socket's directory; remove a stale socket; refuse a live one or a non-socket."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise UserInputError(f"{flag} {path}: cannot create {parent}: {exc.strerror}") from None
    if len(path.encode()) > 100:
        raise UserInputError(f"{flag} {path}: path longer than 100 bytes (unix socket limit)")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise UserInputError(f"{flag} {path}: exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale socket of a dead coordinator
        return
    finally:
        probe.close()
    raise UserInputError(f"{flag} {path}: another process is serving on it (another coordinator?)")


def _unix_socket_server(coord, path: str, flag: str, authorizer, spliced: bool = False):
    """An unstarted gRPC server for ``coord`` on the unix socket ``path`` (created mode 0600
    through the umask), admitting callers by ``authorizer``; ``spliced``: served through a
    :class:`~capctl.security.peercred.CredentialSplice`, so the audit line names the caller's uid.

    Raises:
        UserInputError: the socket cannot be prepared or bound (naming ``flag``).
    """
    from coordinator import server as srv

    _prepare_unix_socket(path, flag)
    old = os.umask(0o177)
    try:
        if spliced:
            from capctl.security.peercred import CredentialSplice

            splice = CredentialSplice(path)
            server, _ = srv.build_server(coord, splice.private_address, authorizer, agent_link=False)
            return _SplicedServer(server, splice, flag)
        server, _ = srv.build_server(coord, "unix:" + path, authorizer, agent_link=False)
    except RuntimeError as exc:
        raise UserInputError(f"{flag}: {exc}") from None
    finally:
        os.umask(old)
    return server


class _SplicedServer:
    """A gRPC aio server behind a :class:`~capctl.security.peercred.CredentialSplice` (the admin
    socket: the audit line names the caller's uid); starts and stops both, delegates the rest."""

    def __init__(self, server, splice, flag: str) -> None:
        self._server = server
        self._splice = splice
        self._flag = flag

    def __getattr__(self, name):
        return getattr(self._server, name)

    async def start(self) -> None:
        """Start the server, then bind the public socket (mode from the umask: 0600).

        Raises:
            UserInputError: the public socket cannot be bound (naming the flag).
        """
        await self._server.start()
        old = os.umask(0o177)
        try:
            self._splice.start()
        except OSError as exc:
            raise UserInputError(f"{self._flag} {self._splice.public_path}: cannot listen: {exc.strerror or exc}") from None
        finally:
            os.umask(old)

    async def stop(self, grace):
        self._splice.stop()
        return await self._server.stop(grace)


def _precheck_listen(address: str, flag: str = "--listen") -> None:
    """Try the address with a plain socket before gRPC does, for a clear reason instead of gRPC's
    "Failed to bind" (and its E... add_port.cc log line).

    Raises:
        UserInputError: ``cannot listen on ADDR: <reason>`` (address already in use, no such directory,
            not a socket, cannot assign requested address, unknown host).
    """
    if address.startswith("unix-abstract:"):
        return
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        reason = _unix_listen_problem(path[2:] if path.startswith("//") else path)
    else:
        reason = _tcp_listen_problem(address)
    if reason is not None:
        raise UserInputError(f"{flag}: cannot listen on {address}: {reason}")


def _unix_listen_problem(path: str) -> str | None:
    """Why gRPC could not listen on the unix socket ``path`` (None when it can: absent, or a stale socket)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"no such directory {parent}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} exists and is not a socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return None  # stale socket file: gRPC replaces it
    finally:
        probe.close()
    return "address already in use (another process is serving on it)"


def _tcp_listen_problem(address: str) -> str | None:
    """Why gRPC could not listen on ``HOST:PORT`` (None when one of its addresses binds, or none resolved)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        return f"unknown host {host!r} ({getattr(exc, 'strerror', None) or exc})"
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                s.bind(sockaddr)
                return None  # bindable (gRPC binds the first address that works)
            except OSError as exc:
                errors.append((exc.strerror or str(exc)).lower())
    return errors[0] if errors else None


def _group_id(field: str, name: str | None) -> int | None:
    """gid of the policy's group ``name``; None when unset or unknown (then logged: the socket
    stays root-only, the safe side)."""
    if not name:
        return None
    import grp

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        log.error("policy %s: group %r does not exist (getent group %s); its socket stays root-only", field, name, name)
        return None


def _check_state_dir(path: str) -> None:
    """At startup the state directory must be usable (created 0700 if missing, a writable directory).

    Raises:
        UserInputError: it cannot be created, is not a directory, or is not writable. (A database that
        breaks later, or a corrupt one, is reported as an alert instead: the daemon keeps running.)
    """
    allowed = "give a writable directory (created 0700 if missing)"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise UserInputError(f"--state-dir {path}: exists and is not a directory; {allowed}") from None
    except OSError as exc:
        raise UserInputError(f"--state-dir {path}: cannot create it ({exc.strerror}); {allowed}") from None
    if not os.path.isdir(path):
        raise UserInputError(f"--state-dir {path}: not a directory; {allowed}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserInputError(f"--state-dir {path}: not writable; {allowed}")
    _lock_state_dir(path)


_STATE_DIR_LOCK: list[int] = []
"""The open descriptor of the held state-directory lock (kept for the life of the process)."""


def _lock_state_dir(path: str) -> None:
    """Take ``path/lock`` (flock, exclusive, released when the process ends, kill -9 included): two
    coordinators sharing one state directory would overwrite each other's budget and node ledger.

    Raises:
        UserInputError: another live process holds it (names its pid from the file).
    """
    import fcntl

    lock = os.path.join(path, "lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise UserInputError(f"--state-dir {path}: cannot open its lock file {lock} ({exc.strerror}); "
                             "give a writable directory (created 0700 if missing)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserInputError(f"--state-dir {path}: in use by another coordinator (pid {holder}, {lock}); "
                             "give each coordinator its own state directory") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _STATE_DIR_LOCK.append(fd)


def _check_addresses(args) -> None:
    """Validate --listen, --admin-socket and --status-socket before binding anything."""
    from capctl.addresses import check_address, check_socket_path

    check_address(args.listen, "--listen", allow_port_zero=True)
    if args.admin_socket not in ("", "none"):
        args.admin_socket = check_socket_path(args.admin_socket, "--admin-socket")
    if args.status_socket not in (None, "", "none"):
        args.status_socket = check_socket_path(args.status_socket, "--status-socket")


def _startup_checks(args):
    """Everything checked before anything binds: addresses, clear text, policy, metrics address,
    state directory (locked), listen address. Returns (policy, metrics address).

    Raises:
        UserInputError, PolicyError: as :func:`serve`.
    """
    from capctl.policy import load_policy
    from capctl.security.plaintext import check_plaintext

    from coordinator import hadaemon

    _check_addresses(args)
    check_plaintext(args.listen, "--listen", tls=any((args.tls_ca, args.tls_cert, args.tls_key)), insecure=args.insecure,
                    log=log)  # incomplete --tls-* flags are refused when the servers are built
    hadaemon.check_flags(args)  # flags first: a bad --etcd-* flag is named even without a policy file
    policy = load_policy(args.policy)  # PolicyError -> exit 1 in main()
    for w in policy.warnings:
        log.warning("%s", w)
    metrics_addr = _metrics_addr(args)
    _check_state_dir(args.state_dir)
    _precheck_listen(args.listen)
    return policy, metrics_addr


def _announce(args, coord, sockets, listening: tuple[str, int], metrics_addr, metrics_port) -> None:
    """Write the ready file and log the one "serving" line (``listening``: address, port)."""
    listen_addr, port = listening
    port = None if listen_addr.startswith("unix") else port  # gRPC says 1 for any unix socket
    metrics_at = f"{metrics_addr[0]}:{metrics_port}" if metrics_port is not None else None
    _write_ready_file(args.ready_file, {
        "pid": os.getpid(), "listen": listen_addr, "port": port, "admin_socket": sockets.admin,
        "metrics": metrics_at, "metrics_port": metrics_port, "coordinator_id": coord.coordinator_id,
        "dry_run": coord.dry_run, "state_dir": args.state_dir, "time_s": time.time(),
    })
    log.info("coordinator %s serving: agents on %s, admin %s, metrics %s, policy %s (budget %g W, interval %g s)%s",
             coord.coordinator_id, listen_addr, f"unix:{sockets.admin}" if sockets.admin else "off",
             metrics_at or "off", getattr(coord, "policy_path", "") or args.policy, coord.policy.budget_w, coord.interval_s,
             ", DRY RUN" if coord.dry_run else "")


async def serve(args) -> int:
    """Run the coordinator until SIGTERM/SIGINT. Returns the exit status (0).

    Raises:
        UserInputError: a bad address, state directory, socket path or TLS/token file (exit 1).
        PolicyError: the policy file is unreadable or invalid (exit 1 in :func:`main`).
    """
    from coordinator.loop import Coordinator
    from coordinator.metrics import Metrics

    policy, metrics_addr = _startup_checks(args)
    from coordinator import hadaemon

    ha = hadaemon.HaSetup.from_args(args, policy)  # None without --etcd-endpoints or policy coordinator.etcd
    store, store_error = ha.store() if ha else _open_store(args.state_dir)
    finished = _open_finished(args, ha)
    metrics = Metrics()
    coord = Coordinator(policy, os.path.abspath(args.policy), store=store, dry_run=args.dry_run,
                        store_error=store_error, metrics=metrics, finished=finished)
    if ha:
        ha.attach(coord)  # a standby until elected: nothing is sent before
    metrics.attach(coord)
    sockets = _Sockets(args)
    # SIGTERM/SIGINT handled before the sockets exist: a stop that lands while the servers start
    # is a clean one (found by a test: a SIGTERM between the admin socket's bind and these handlers
    # ended the process by the default action and left its socket behind, 1 run in ~56)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    servers, listen_addr, port = await _start_servers(coord, args, sockets, policy)
    metrics_port = _serve_metrics(coord, metrics, metrics_addr)
    from coordinator import server as srv

    for s in servers:
        await srv.set_serving(s, True)
    if ha:
        ha.start(coord, listen_addr, asyncio.get_running_loop())
    from coordinator import hangup

    hangup.install(loop, coord, metrics.ops.reloaded)  # SIGHUP: reload the policy, keep the last good one
    _announce(args, coord, sockets, (listen_addr, port), metrics_addr, metrics_port)
    freeze_startup_heap()
    runner = asyncio.ensure_future(coord.run(stop))
    from capctl import sdnotify

    sdnotify.ready(f"serving agents on {listen_addr}")
    await stop.wait()
    sdnotify.stopping()
    if ha:
        await asyncio.to_thread(ha.stop)  # revoke the etcd lease: a standby takes over at once
    await _shut_down(coord, servers, runner)
    metrics.close()
    coord.close_store_io()
    store.close()
    finished.close()
    _remove(sockets.admin, sockets.status, args.ready_file)
    log.info("stopped")
    return 0


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (modules, protobuf descriptors, gRPC, numpy, the
    policy and the servers: ~63,000 objects) out of the cyclic garbage collector's reach
    (``gc.freeze``), so that its full collections in the running daemon no longer traverse them
    (measured: 31 ms of CPU per full collection, this module's imports alone, 1-minute load 1.0;
    full collections hold the event loop for their whole length, :data:`coordinator.loop.GC_THRESHOLDS`).
    Reference counting still frees these objects; only a reference cycle among them that becomes
    garbage later (e.g. of the start policy, after a reload) is kept: bounded by this one heap.

    Returns the number of objects frozen (``gc.get_freeze_count()``).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _remove(*paths: str | None) -> None:
    """Unlink every path given (None and "" skipped; errors ignored)."""
    for path in paths:
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass


def _open_finished(args, ha=None):
    """The finished-job store (coordinator.finished) with the retention flags: in etcd when ``ha`` (a
    :class:`coordinator.hadaemon.HaSetup`) is given, else in ``--state-dir``.

    Raises:
        UserInputError: a non-positive ``--finished-retention-days`` or ``--finished-max-jobs``.
    """
    from coordinator.finished import Retention, open_store

    try:
        retention = Retention(max_age_s=args.finished_retention_days * 86400.0, max_jobs=args.finished_max_jobs)
    except ValueError:
        raise UserInputError(f"--finished-retention-days {args.finished_retention_days!r} / --finished-max-jobs "
                             f"{args.finished_max_jobs!r}: both must be positive") from None
    if ha is not None:
        return ha.finished(retention)
    finished, error = open_store(args.state_dir, retention)
    if error:
        log.error("%s; finished jobs are kept in memory only", error)
    return finished


def _open_store(state_dir: str):
    """The state database of ``state_dir`` and the error met opening it ("" when none): a broken
    database is logged and the daemon runs on in-memory state."""
    from coordinator.store import Store, StoreError

    store = Store(state_dir)
    try:
        store.open()
    except StoreError as exc:
        log.error("%s; running on in-memory state (admin changes will not persist)", exc)
        return store, str(exc)
    return store, ""


class _Sockets:
    """The unix sockets of ``args``: admin (root-only admin RPCs) and status (read-only), None when off."""

    def __init__(self, args) -> None:
        self.admin = None if args.admin_socket in ("", "none") else args.admin_socket
        self.status = args.status_socket if args.status_socket not in (None, "", "none") else None


async def _start_servers(coord, args, sockets: _Sockets, policy) -> tuple[list, str, int]:
    """Build and start the gRPC servers: ``--listen`` (agents, read-only admin; TLS and token from
    ``args``), the admin and status sockets (modes and groups from the policy). Returns (servers,
    the bound listen address, its port).

    Raises:
        UserInputError: an address or socket that cannot be bound, or an unreadable TLS/token file.
    """
    from capctl.security import authz
    from capctl.security import tls as tlsmod
    from coordinator import server as srv

    tls_config = tlsmod.tls_from_args(args)
    credentials = tlsmod.server_credentials(tls_config) if tls_config is not None else None
    token = authz.load_token_file(args.admin_token_file) if args.admin_token_file else None
    tcp_auth = authz.listener_authorizer(tls=credentials is not None, token=token, admin_socket=sockets.admin)
    admin_gid = _group_id("coordinator.admin_group", policy.coordinator.admin_group)
    status_gid = _group_id("coordinator.status_group", policy.coordinator.status_group)
    try:
        listen_server, port = srv.build_server(coord, args.listen, tcp_auth, agent_link=True, credentials=credentials)
    except RuntimeError as exc:
        raise UserInputError(f"--listen: {exc}") from None
    servers = [listen_server]
    listen_addr = args.listen
    if not args.listen.startswith("unix") and port:
        listen_addr = f"{args.listen.rpartition(':')[0]}:{port}"
    bound = [args.listen.partition(":")[2] if args.listen.startswith("unix:") else None]
    try:
        if sockets.admin:
            servers.append(_unix_socket_server(coord, sockets.admin, "--admin-socket",
                                               authz.TrustedTransport(f"the admin socket unix:{sockets.admin}"),
                                               spliced=True))
            bound.append(sockets.admin)
        if sockets.status:
            servers.append(_unix_socket_server(
                coord, sockets.status, "--status-socket",
                authz.NoOne(f"the admin socket (unix:{sockets.admin})" if sockets.admin else "the admin socket")))
        for s in servers:
            await s.start()
    except BaseException:
        _remove(*bound)  # a failed start leaves no socket file of ours behind
        raise
    _socket_modes(sockets, admin_gid, status_gid)
    return servers, listen_addr, port


def _socket_modes(sockets: _Sockets, admin_gid: int | None, status_gid: int | None) -> None:
    """Admin socket 0600 (0660 for the policy's admin group); status socket 0660 for the policy's
    status group, else 0600."""
    if sockets.admin:
        os.chmod(sockets.admin, 0o600)
        if admin_gid is not None and _chown_group(sockets.admin, admin_gid, "coordinator.admin_group"):
            os.chmod(sockets.admin, 0o660)  # policy coordinator.admin_group: its members are admins too
    if sockets.status:
        if status_gid is not None and _chown_group(sockets.status, status_gid, "coordinator.status_group"):
            os.chmod(sockets.status, 0o660)  # policy coordinator.status_group: read-only status
        else:
            os.chmod(sockets.status, 0o600)


def _chown_group(path: str, gid: int, field: str) -> bool:
    """Give ``path`` to group ``gid``; False (logged, the socket stays owner-only: the safe side) when
    not allowed, e.g. an unprivileged coordinator outside that group (systemd: SupplementaryGroups=)."""
    try:
        os.chown(path, -1, gid)
    except OSError as exc:
        log.error("policy %s: cannot give %s to gid %d (%s); it stays owner-only. Under systemd add the group "
                  "with SupplementaryGroups= in a drop-in", field, path, gid, exc.strerror or exc)
        return False
    return True


def _serve_metrics(coord, metrics, metrics_addr: tuple[str, int] | None) -> int | None:
    """Serve Prometheus metrics on ``metrics_addr``; returns the bound port, or None when off or
    when it cannot be bound (then logged and raised as an alert: enforcement goes on)."""
    if metrics_addr is None:
        return None
    try:
        return metrics.serve(*metrics_addr)
    except OSError as exc:  # metrics are not worth stopping the budget enforcement for
        msg = f"metrics on {metrics_addr[0]}:{metrics_addr[1]} not served: {exc.strerror or exc}"
        log.error("%s", msg)
        coord.persistent_alerts["metrics"] = msg
        return None


def _write_ready_file(path: str | None, ready: dict) -> None:
    """Write ``ready`` as JSON to ``path`` atomically (logged, not raised, when it fails)."""
    if not path:
        return
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(ready, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.error("--ready-file %s: %s (serving anyway)", path, exc.strerror or exc)


async def _shut_down(coord, servers: list, runner) -> None:
    """Stop serving, stop the loop (at most :data:`STOP_TIMEOUT_S` s), close every agent stream,
    stop the servers (grace period ``server.GRACE_S`` s)."""
    from coordinator import server as srv

    log.info("shutting down")
    for s in servers:
        await srv.set_serving(s, False)
    runner.cancel()
    try:
        await asyncio.wait_for(runner, STOP_TIMEOUT_S)
    except (asyncio.CancelledError, asyncio.TimeoutError):
        pass
    for node in list(coord.registry.nodes.values()):
        if node.session is not None:
            node.session.close("coordinator shutting down")
    await asyncio.gather(*(s.stop(srv.GRACE_S) for s in servers), return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``capctl-coordinator``; returns the exit status."""
    lifeline.watch_parent()  # started by a test or the demo: stop when that parent dies
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve() handles it: a reload, never an exit
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("grpc").setLevel(logging.WARNING)
    from capctl.security import redact

    redact.install()  # no secrets in logs (bearer tokens, keys)
    return run_for_person("capctl-coordinator", lambda: asyncio.run(serve(args)))


if __name__ == "__main__":
    sys.exit(main())
