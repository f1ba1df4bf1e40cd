"""Security flags of the daemons and the CLI: clear one-line errors, never a traceback, no secret shown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.processes import write_policy

REPO = Path(__file__).resolve().parents[2]
TOKEN = "c0ffee00" * 4


def _run(module: str, *args, env=None, timeout=30):
    e = {k: v for k, v in os.environ.items() if not k.startswith("CAPCTL_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=e)


def test_coordinator_refuses_partial_tls_and_a_readable_token(tmp_path, pki):
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1600.0)
    common = ["--policy", str(policy), "--state-dir", str(tmp_path / "s"), "--admin-socket", str(tmp_path / "a.sock"),
              "--metrics-port", "-1", "--listen", "127.0.0.1:0"]
    r = _run("coordinator.daemon", *common, "--tls-ca", str(pki.ca_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "missing --tls-cert, --tls-key" in r.stderr and r.stderr.strip().count("\n") == 0
    token = tmp_path / "admin.token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o644)
    r = _run("coordinator.daemon", *common, "--admin-token-file", str(token))
    assert r.returncode == 1 and "mode 0644" in r.stderr and f"chmod 600 {token}" in r.stderr
    assert TOKEN not in r.stderr + r.stdout and "Traceback" not in r.stderr


def test_agent_refuses_partial_tls(tmp_path, pki):
    r = _run("nodeagent.daemon", "--node", "n1", "--coordinator", "127.0.0.1:9", "--socket",
             str(tmp_path / "a.sock"), "--state-dir", str(tmp_path / "s"), "--tls-cert", str(pki.agent("n1").cert_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "--tls-ca" in r.stderr, r.stderr


def test_cli_never_sends_the_token_in_clear_text(tmp_path, pki):
    token = tmp_path / "admin.token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    # a plaintext host:port that is not loopback: refused before any connection is made
    r = _run("capctl.cli.main", "--admin-token-file", str(token), "budget", "set", "1000",
             "--coordinator", "coordinator.invalid:7373")
    assert r.returncode == 1 and "refusing to send the admin token in clear text" in r.stderr, r.stderr
    assert TOKEN not in r.stderr + r.stdout
    r = _run("capctl.cli.main", "status", "--coordinator", "127.0.0.1:9", env={"CAPCTL_TLS_CA": str(pki.ca_path)})
    assert r.returncode == 1 and "missing --tls-cert, --tls-key (or $CAPCTL_TLS_CERT, $CAPCTL_TLS_KEY)" in r.stderr


def test_coordinator_names_a_bad_etcd_flag_before_a_missing_policy(tmp_path):
    """Flags first: with the default policy path missing, a bad --etcd-* flag is the error shown
    (one real run of the daemon; the other flags through its start-up checks in-process)."""
    import pytest

    from capctl.errors import UserInputError
    from capctl.policy import PolicyError
    from coordinator import daemon

    common = ["--policy", str(tmp_path / "missing.yaml"), "--state-dir", str(tmp_path / "s"), "--admin-socket",
              str(tmp_path / "a.sock"), "--metrics-port", "-1", "--listen", "127.0.0.1:0"]
    r = _run("coordinator.daemon", *common, "--etcd-lease-ttl-s", "0")
    assert r.returncode == 1 and "--etcd-lease-ttl-s 0: expected 1..3600" in r.stderr, r.stderr
    assert "missing.yaml" not in r.stderr and "Traceback" not in r.stderr
    for flags, expected in ((["--etcd-prefix", "capctl"], "--etcd-prefix 'capctl': expected a key prefix"),
                            (["--etcd-endpoints", "ftp://h:1"], "--etcd-endpoints"),
                            (["--etcd-endpoints", "http://127.0.0.1:2379", "--etcd-cert", str(tmp_path / "c.pem")],
                             "--etcd-cert and --etcd-key go together")):
        with pytest.raises(UserInputError, match=expected):
            daemon._startup_checks(daemon.build_parser().parse_args(common + flags))
    with pytest.raises(PolicyError, match="missing.yaml"):  # good flags: then the policy error
        daemon._startup_checks(daemon.build_parser().parse_args(common + ["--etcd-lease-ttl-s", "5"]))
