"""Fixtures of the security tests: a test PKI and a small real gRPC server reporting who called."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest

from capctl.security import tls
from capctl.security.identity import peer_identity
from tests.support.certs import make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """One test PKI for the whole session (EC keys: a few ms each)."""
    return make_pki(tmp_path_factory.mktemp("security"))


class WhoServer:
    """A real gRPC server (sync) with one generic method ``/capctltest.Who/Ask`` answering a JSON
    object: the caller's identity as :func:`peer_identity` sees it and, for each named authorizer,
    how it decided (``decide()``)."""

    METHOD = "/capctltest.Who/Ask"

    def __init__(self, address: str, credentials=None, authorizers: dict | None = None) -> None:
        self.authorizers = authorizers or {}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.method_handlers_generic_handler("capctltest.Who", {
            "Ask": grpc.unary_unary_rpc_method_handler(self._ask, request_deserializer=None, response_serializer=None),
        })
        self.server.add_generic_rpc_handlers((handler,))
        if credentials is not None:
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        self.server.start()

    def _ask(self, request: bytes, context) -> bytes:
        ident = peer_identity(context)
        out = {"transport": ident.transport, "cn": ident.common_name, "dns": list(ident.dns_names),
               "uris": list(ident.uris), "roles": sorted(ident.roles), "verified": ident.verified,
               "decisions": {name: a.decide(context) for name, a in self.authorizers.items()}}
        return json.dumps(out).encode()

    def stop(self) -> None:
        self.server.stop(0).wait(2.0)


def ask(target: str, credentials=None, metadata=(), options=(), timeout_s: float = 3.0) -> dict:
    """Call ``WhoServer`` at ``target``; returns its JSON answer (raises grpc.RpcError)."""
    channel = (grpc.secure_channel(target, credentials, options=list(options)) if credentials is not None
               else grpc.insecure_channel(target))
    with channel:
        call = channel.unary_unary(WhoServer.METHOD, request_serializer=None, response_deserializer=None)
        return json.loads(call(b"", timeout=timeout_s, metadata=tuple(metadata)))


def client_config(pki, issued, server_name: str | None = None) -> tls.TlsConfig:
    return tls.TlsConfig(pki.ca_path, issued.cert_path, issued.key_path, server_name)


@pytest.fixture
def tls_server(pki):
    """Start a TLS WhoServer on 127.0.0.1 (coordinator certificate, client certs required)."""
    started = []

    def start(authorizers: dict | None = None) -> WhoServer:
        creds = tls.server_credentials(client_config(pki, pki.server))
        s = WhoServer("127.0.0.1:0", creds, authorizers)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


UNPRIVILEGED_USER = "capctltest"
"""An ordinary (non-root) account the SO_PEERCRED tests run clients as; created when missing."""


@pytest.fixture(scope="session")
def unprivileged_user():
    """``(name, uid, gid)`` of :data:`UNPRIVILEGED_USER`, created with useradd when missing (as root).

    Needs root (CI runs the tests as root); otherwise skipped locally / failed in CI.
    """
    import os
    import pwd
    import shutil
    import subprocess

    from tests.conftest import require

    require(os.geteuid() == 0, "the SO_PEERCRED tests run as root (to create a user and switch to it)")
    try:
        pw = pwd.getpwnam(UNPRIVILEGED_USER)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        subprocess.run([useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", UNPRIVILEGED_USER], check=True, capture_output=True, timeout=30)
        pw = pwd.getpwnam(UNPRIVILEGED_USER)
    assert pw.pw_uid != 0
    return pw.pw_name, pw.pw_uid, pw.pw_gid


def run_as(user: str, code: str, timeout_s: float = 30.0) -> dict:
    """Run Python ``code`` in a child process that becomes ``user`` before it connects anywhere.

    The child starts as root, imports gRPC and capctl, then drops to the user for good
    (``initgroups``, ``setgid``, ``setuid``: real, effective and saved ids, supplementary groups
    of the account) and checks that it did; only then does ``code`` run. So the kernel's
    SO_PEERCRED reports the unprivileged account, exactly as for a process started by ``runuser``.
    (``runuser -u USER -- python`` needs an interpreter the user may execute; here it may live
    under root's home, so the imports happen before the switch.) ``code`` prints one line
    ``RESULT <json>``; returns it.
    """
    import pwd
    import subprocess
    import sys
    from pathlib import Path

    pw = pwd.getpwnam(user)
    repo = Path(__file__).resolve().parents[2]
    prelude = (
        "import os, json, grpc\n"
        "import nodeagent.local, capctl.errors\n"
        "from capctl.v1 import capctl_pb2, capctl_pb2_grpc\n"
        f"os.initgroups({pw.pw_name!r}, {pw.pw_gid}); os.setgid({pw.pw_gid}); os.setuid({pw.pw_uid})\n"
        f"assert os.getresuid() == ({pw.pw_uid},) * 3 and os.getresgid() == ({pw.pw_gid},) * 3\n"
    )
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1",
           "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    proc = subprocess.run([sys.executable, "-c", prelude + code], env=env, cwd="/",
                          capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"no RESULT from the client run as {user} (exit {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


CLIENT_CODE = r"""
import json, os
from capctl.errors import PermissionDeniedError, UnreachableError, UserInputError
from capctl.agentclient import LocalClient
out = {"uid": os.getuid(), "euid": os.geteuid(), "groups": os.getgroups()}
try:
    with LocalClient({path!r}, timeout_s=5.0) as c:
        {call}
    out["outcome"] = "ok"
except PermissionDeniedError as e:
    out["outcome"], out["message"] = "permission_denied", str(e)
except UnreachableError as e:
    out["outcome"], out["message"] = "unreachable", str(e)
except UserInputError as e:
    out["outcome"], out["message"] = "user_input", str(e)
print("RESULT " + json.dumps(out))
"""


def client_code(socket_path: str, call: str) -> str:
    """Client program for :func:`run_as`: ``call`` uses ``c`` (a LocalClient on ``socket_path``)."""
    return CLIENT_CODE.replace("{path!r}", repr(str(socket_path))).replace("{call}", call)


@pytest.fixture
def open_dir():
    """A fresh directory under /tmp that every user can traverse (0755); removed afterwards."""
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="capctl-sec-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
