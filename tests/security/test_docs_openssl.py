"""docs/security.md's OpenSSL recipe produces certificates capctl accepts with the right roles."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from capctl.security import tls
from tests.conftest import require
from tests.security.conftest import WhoServer, ask

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def _recipe() -> str:
    text = DOC.read_text()
    m = re.search(r"<!-- BEGIN issue-certs -->\s*```sh\n(.*?)```\s*<!-- END issue-certs -->", text, re.S)
    assert m, "docs/security.md lost its issue-certs block"
    return m.group(1)


def test_documented_openssl_recipe_works(tmp_path):
    require(shutil.which("openssl") is not None and shutil.which("bash") is not None, "openssl and bash")
    proc = subprocess.run(["bash", "-c", _recipe()], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("ca", "coordinator", "agent-gpu001", "agent-gpu002", "admin-alice"):
        assert (tmp_path / f"{name}.pem").is_file()
        assert (tmp_path / f"{name}.key").stat().st_mode & 0o077 == 0
    d = tmp_path
    server = WhoServer("127.0.0.1:0", tls.server_credentials(tls.TlsConfig(d / "ca.pem", d / "coordinator.pem",
                                                                          d / "coordinator.key")))
    try:
        target = f"127.0.0.1:{server.port}"
        admin = ask(target, tls.channel_credentials(tls.TlsConfig(d / "ca.pem", d / "admin-alice.pem",
                                                                  d / "admin-alice.key")))
        agent = ask(target, tls.channel_credentials(tls.TlsConfig(d / "ca.pem", d / "agent-gpu002.pem",
                                                                  d / "agent-gpu002.key")))
    finally:
        server.stop()
    assert admin["cn"] == "alice" and admin["roles"] == ["admin"]
    assert agent["cn"] == "gpu002" and agent["dns"] == ["gpu002"] and agent["roles"] == ["agent"]
