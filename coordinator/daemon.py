"""``capctl-coordinator``: the head-node daemon (entry point :func:`main`).

Usage::

    capctl-coordinator --policy FILE --listen ADDR --state-dir DIR [--dry-run]
                       [--admin-socket PATH] [--admin-token-file PATH]
                       [--metrics-port PORT | --metrics-listen HOST:PORT] [--ready-file PATH]

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
    p = argparse.ArgumentParser(
        prog="capctl-coordinator",
        description="capctl coordinator: allocates the power budget across GPUs every interval (W, degC, s).",
    )
    p.add_argument("--policy", default=DEFAULT_POLICY, metavar="FILE", help=f"policy YAML (default {DEFAULT_POLICY})")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="ADDR",
                   help=f"gRPC address for agents and read-only admin: HOST:PORT or unix:PATH (default {DEFAULT_LISTEN}; port 0 = any)")
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR, metavar="DIR",
                   help=f"directory of the state database coordinator.db (default {DEFAULT_STATE_DIR})")
    p.add_argument("--dry-run", action="store_true", help="compute, report and export; apply nothing")
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


def _unix_socket_server(coord, path: str, flag: str, authorizer):
    """An unstarted gRPC server for ``coord`` on the unix socket ``path`` (created mode 0600
    through the umask), admitting callers by ``authorizer``.

    Raises:
        UserInputError: the socket cannot be prepared or bound (naming ``flag``).
    """
    from coordinator import server as srv

    _prepare_unix_socket(path, flag)
    old = os.umask(0o177)
    try:
        server, _ = srv.build_server(coord, "unix:" + path, authorizer, agent_link=False)
    except RuntimeError as exc:
        raise UserInputError(f"{flag}: {exc}") from None
    finally:
        os.umask(old)
    return server


def _precheck_listen(address: str, flag: str = "--listen") -> None:
    """Try the address with a plain socket before gRPC does, for a clear reason instead of gRPC's
    "Failed to bind" (and its E... add_port.cc log line).

    Raises:
        UserInputError: ``cannot listen on ADDR: <reason>`` (address already in use, no such directory,
            not a socket, cannot assign requested address, unknown host).
    """
    def fail(reason: str):
        raise UserInputError(f"{flag}: cannot listen on {address}: {reason}")

    if address.startswith("unix-abstract:"):
        return
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            fail(f"no such directory {parent}")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            fail(exc.strerror or str(exc))
        if not stat.S_ISSOCK(st.st_mode):
            fail(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return  # stale socket file: gRPC replaces it
        finally:
            probe.close()
        fail("address already in use (another process is serving on it)")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        fail(f"unknown host {host!r} ({getattr(exc, 'strerror', None) or exc})")
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                s.bind(sockaddr)
                return  # bindable (gRPC binds the first address that works)
            except OSError as exc:
                errors.append((exc.strerror or str(exc)).lower())
    if errors:
        fail(errors[0])


def _local_address(listen: str) -> bool:
    """True for a unix socket or a loopback address (where plaintext gRPC is acceptable)."""
    if listen.startswith("unix"):
        return True
    host = listen.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


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


def _check_addresses(args) -> None:
    """Validate --listen, --admin-socket and --status-socket before binding anything."""
    from capctl.addresses import check_address, check_socket_path

    check_address(args.listen, "--listen", allow_port_zero=True)
    if args.admin_socket not in ("", "none"):
        args.admin_socket = check_socket_path(args.admin_socket, "--admin-socket")
    if args.status_socket not in (None, "", "none"):
        args.status_socket = check_socket_path(args.status_socket, "--status-socket")


async def serve(args) -> int:
    """Run the coordinator until SIGTERM/SIGINT. Returns the exit status."""
    from coordinator import server as srv
    from coordinator.loop import Coordinator
    from coordinator.metrics import Metrics
    from coordinator.store import Store, StoreError
    from capctl.policy import load_policy

    _check_addresses(args)
    policy = load_policy(args.policy)  # PolicyError -> exit 1 in main()
    for w in policy.warnings:
        log.warning("%s", w)
    metrics_addr = _metrics_addr(args)
    _check_state_dir(args.state_dir)
    _precheck_listen(args.listen)
    store = Store(args.state_dir)
    store_error = ""
    try:
        store.open()
    except StoreError as exc:
        store_error = str(exc)
        log.error("%s; running on in-memory state (admin changes will not persist)", exc)
    metrics = Metrics()
    coord = Coordinator(policy, os.path.abspath(args.policy), store=store, dry_run=args.dry_run,
                        store_error=store_error, metrics=metrics)
    metrics.attach(coord)

    from capctl.security import authz
    from capctl.security import tls as tlsmod

    admin_socket = None if args.admin_socket in ("", "none") else args.admin_socket
    status_socket = args.status_socket if args.status_socket not in (None, "", "none") else None
    tls_config = tlsmod.tls_from_args(args)
    credentials = tlsmod.server_credentials(tls_config) if tls_config is not None else None
    token = authz.load_token_file(args.admin_token_file) if args.admin_token_file else None
    tcp_auth = authz.listener_authorizer(tls=credentials is not None, token=token, admin_socket=admin_socket)
    if credentials is None and not _local_address(args.listen):
        log.warning("--listen %s is a network address without TLS: anyone who can reach it may register as an "
                    "agent; give --tls-ca/--tls-cert/--tls-key (docs/security.md)", args.listen)
    admin_gid = _group_id("coordinator.admin_group", policy.coordinator.admin_group)
    status_gid = _group_id("coordinator.status_group", policy.coordinator.status_group)

    servers = []
    try:
        listen_server, port = srv.build_server(coord, args.listen, tcp_auth, agent_link=True, credentials=credentials)
    except RuntimeError as exc:
        raise UserInputError(f"--listen: {exc}") from None
    servers.append(listen_server)
    listen_addr = args.listen
    if not args.listen.startswith("unix") and port:
        host = args.listen.rpartition(":")[0]
        listen_addr = f"{host}:{port}"
    if admin_socket:
        servers.append(_unix_socket_server(coord, admin_socket, "--admin-socket",
                                           authz.TrustedTransport(f"the admin socket unix:{admin_socket}")))
    if status_socket:
        servers.append(_unix_socket_server(
            coord, status_socket, "--status-socket",
            authz.NoOne(f"the admin socket (unix:{admin_socket})" if admin_socket else "the admin socket")))
    for s in servers:
        await s.start()
    if admin_socket:
        os.chmod(admin_socket, 0o600)
        if admin_gid is not None:  # policy coordinator.admin_group: its members are admins too
            os.chown(admin_socket, -1, admin_gid)
            os.chmod(admin_socket, 0o660)
    if status_socket:
        if status_gid is not None:  # policy coordinator.status_group: read-only status
            os.chown(status_socket, -1, status_gid)
            os.chmod(status_socket, 0o660)
        else:
            os.chmod(status_socket, 0o600)
    metrics_port = None
    if metrics_addr is not None:
        try:
            metrics_port = metrics.serve(*metrics_addr)
        except OSError as exc:  # metrics are not worth stopping the budget enforcement for
            msg = f"metrics on {metrics_addr[0]}:{metrics_addr[1]} not served: {exc.strerror or exc}"
            log.error("%s", msg)
            coord.persistent_alerts["metrics"] = msg
    for s in servers:
        await srv.set_serving(s, True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {
        "pid": os.getpid(), "listen": listen_addr, "port": port, "admin_socket": admin_socket,
        "metrics": f"{metrics_addr[0]}:{metrics_port}" if metrics_port is not None else None,
        "metrics_port": metrics_port, "coordinator_id": coord.coordinator_id, "dry_run": coord.dry_run,
        "state_dir": args.state_dir, "time_s": time.time(),
    }
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(ready, f)
            os.replace(tmp, args.ready_file)
        except OSError as exc:
            log.error("--ready-file %s: %s (serving anyway)", args.ready_file, exc.strerror or exc)
    log.info("coordinator %s serving: agents on %s, admin %s, metrics %s, policy %s (budget %g W, interval %g s)%s",
             coord.coordinator_id, listen_addr, f"unix:{admin_socket}" if admin_socket else "off",
             ready["metrics"] or "off", args.policy, coord.policy.budget_w, coord.interval_s,
             ", DRY RUN" if coord.dry_run else "")

    runner = asyncio.ensure_future(coord.run(stop))
    await stop.wait()
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
    metrics.close()
    store.close()
    for path in (admin_socket, status_socket):
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass
    if args.ready_file:
        try:
            os.unlink(args.ready_file)
        except OSError:
            pass
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``capctl-coordinator``; returns the exit status."""
    lifeline.watch_parent()  # started by a test or the demo: stop when that parent dies
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("grpc").setLevel(logging.WARNING)
    from capctl.security import redact

    redact.install()  # no secrets in logs (bearer tokens, keys)
    return run_for_person("capctl-coordinator", lambda: asyncio.run(serve(args)))


if __name__ == "__main__":
    sys.exit(main())
