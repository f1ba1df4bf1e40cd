"""mTLS: a TLS listener built with capctl.security.tls accepts only certificates of the cluster CA."""

from __future__ import annotations

import argparse
import os

import grpc
import pytest

from capctl.errors import UserInputError
from capctl.security import tls
from tests.security.conftest import ask, client_config


def test_valid_client_certificates_are_accepted_and_identified(pki, tls_server):
    server = tls_server()
    target = f"127.0.0.1:{server.port}"
    admin = ask(target, tls.channel_credentials(client_config(pki, pki.admin)))
    assert admin["transport"] == "ssl" and admin["verified"] is True
    assert admin["cn"] == "alice" and admin["roles"] == ["admin"]
    agent = ask(target, tls.channel_credentials(client_config(pki, pki.agent("n7"))))
    assert agent["cn"] == "n7" and agent["dns"] == ["n7"] and agent["roles"] == ["agent"]


@pytest.mark.parametrize("who", ["wrong_ca_client", "expired_client"])
def test_certificate_from_another_ca_or_expired_is_refused(pki, tls_server, who):
    server = tls_server()
    issued = getattr(pki, who)
    creds = grpc.ssl_channel_credentials(pki.ca.cert_pem, issued.key_pem, issued.cert_pem)
    with pytest.raises(grpc.RpcError) as err:
        ask(f"127.0.0.1:{server.port}", creds)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_without_certificate_or_without_tls_is_refused(pki, tls_server):
    server = tls_server()
    target = f"127.0.0.1:{server.port}"
    with pytest.raises(grpc.RpcError) as err:
        ask(target, grpc.ssl_channel_credentials(pki.ca.cert_pem))  # server verified, no client cert
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:
        ask(target)  # plaintext against a TLS port
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_refuses_a_server_certificate_of_another_ca(pki):
    from tests.security.conftest import WhoServer

    creds = grpc.ssl_server_credentials([(pki.wrong_ca_server.key_pem, pki.wrong_ca_server.cert_pem)],
                                        root_certificates=pki.ca.cert_pem, require_client_auth=True)
    server = WhoServer("127.0.0.1:0", creds)
    try:
        with pytest.raises(grpc.RpcError) as err:
            ask(f"127.0.0.1:{server.port}", tls.channel_credentials(client_config(pki, pki.admin)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_server_name_override_checks_that_name(pki, tls_server):
    server = tls_server()
    target = f"127.0.0.1:{server.port}"
    cfg_ok = client_config(pki, pki.admin, server_name="localhost")
    assert ask(target, tls.channel_credentials(cfg_ok), options=tls.channel_options(cfg_ok))["cn"] == "alice"
    cfg_bad = client_config(pki, pki.admin, server_name="not-the-coordinator.example")
    with pytest.raises(grpc.RpcError):
        ask(target, tls.channel_credentials(cfg_bad), options=tls.channel_options(cfg_bad))


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    tls.add_tls_arguments(p, what="test")
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_flags_come_all_three_or_none(pki, monkeypatch):
    for var in tls.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    assert tls.tls_from_args(_args()) is None
    cfg = tls.tls_from_args(_args(tls_ca=pki.ca_path, tls_cert=pki.admin.cert_path, tls_key=pki.admin.key_path))
    assert cfg == tls.TlsConfig(pki.ca_path, pki.admin.cert_path, pki.admin.key_path, None)
    with pytest.raises(UserInputError, match=r"missing --tls-cert, --tls-key"):
        tls.tls_from_args(_args(tls_ca=pki.ca_path))
    # environment fallback (CLI)
    monkeypatch.setenv("CAPCTL_TLS_CA", str(pki.ca_path))
    monkeypatch.setenv("CAPCTL_TLS_CERT", str(pki.admin.cert_path))
    with pytest.raises(UserInputError, match=r"missing --tls-key \(or \$CAPCTL_TLS_KEY\)"):
        tls.tls_from_args(_args(), use_env=True)
    monkeypatch.setenv("CAPCTL_TLS_KEY", str(pki.admin.key_path))
    assert tls.tls_from_args(_args(), use_env=True).key_path == pki.admin.key_path
    assert tls.tls_from_args(_args(), use_env=False) is None


def test_bad_files_give_clear_errors(pki, tmp_path):
    ok = tls.TlsConfig(pki.ca_path, pki.admin.cert_path, pki.admin.key_path)
    assert b"PRIVATE KEY" in ok.read().key_pem
    assert "hidden" in repr(ok.read()) and "PRIVATE" not in repr(ok.read())
    missing = tls.TlsConfig(tmp_path / "nope.pem", pki.admin.cert_path, pki.admin.key_path)
    with pytest.raises(UserInputError, match=r"--tls-ca .*nope.pem: cannot read it \(No such file"):
        missing.read()
    swapped = tls.TlsConfig(pki.ca_path, pki.admin.key_path, pki.admin.cert_path)
    with pytest.raises(UserInputError, match=r"--tls-cert .*: no PEM certificate"):
        swapped.read()
    not_key = tls.TlsConfig(pki.ca_path, pki.admin.cert_path, pki.ca_path)
    with pytest.raises(UserInputError, match=r"--tls-key .*: no unencrypted PEM private key"):
        not_key.read()
    loose = tmp_path / "loose.key"
    loose.write_bytes(pki.admin.key_pem)
    os.chmod(loose, 0o644)
    with pytest.raises(UserInputError, match=r"readable by every user \(mode 0644\); run: chmod 600"):
        tls.TlsConfig(pki.ca_path, pki.admin.cert_path, loose).read()
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    with pytest.raises(UserInputError, match="empty file"):
        tls.TlsConfig(empty, pki.admin.cert_path, pki.admin.key_path).read()
    with pytest.raises(UserInputError, match="not a regular file"):
        tls.TlsConfig(tmp_path, pki.admin.cert_path, pki.admin.key_path).read()


def test_files_with_pem_markers_but_no_certificate_or_key_or_a_key_of_another_certificate(pki, tmp_path):
    """Right markers around a body that is no certificate or key, or a key of another certificate:
    each named with its flag and file before any connection (a bad certificate reached gRPC, which
    logged C-core lines and reported the coordinator "unreachable", exit 3; found by a review)."""
    bad = tmp_path / "bad.pem"
    bad.write_bytes(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    badkey = tmp_path / "bad.key"
    badkey.write_bytes(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    os.chmod(badkey, 0o600)
    cases = [(tls.TlsConfig(bad, pki.admin.cert_path, pki.admin.key_path), r"--tls-ca .*bad.pem: not a valid PEM certificate"),
             (tls.TlsConfig(pki.ca_path, bad, pki.admin.key_path), r"--tls-cert .*bad.pem: not a valid PEM certificate"),
             (tls.TlsConfig(pki.ca_path, pki.admin.cert_path, badkey),
              r"--tls-key .*bad.key: not a valid unencrypted PEM private key"),
             (tls.TlsConfig(pki.ca_path, pki.admin.cert_path, pki.wrong_ca_client.key_path),
              r"--tls-key .*: not the private key of --tls-cert .*"),
             ]
    for config, message in cases:
        with pytest.raises(UserInputError, match=message):
            config.read()


def test_commands_that_never_connect_ignore_a_partial_tls_setting(pki, tmp_path):
    """A partial ``$CAPCTL_TLS_*`` setting refused every subcommand, ``policy validate`` and ``sim``
    included (found by a review); it is refused only where a command connects, with a bad file
    named (exit 1, no gRPC log lines)."""
    import subprocess
    import sys

    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nbudget_w: 20000\n")
    env = {**os.environ, "CAPCTL_TLS_CA": str(pki.ca_path)}
    for var in ("CAPCTL_TLS_CERT", "CAPCTL_TLS_KEY"):
        env.pop(var, None)
    run = lambda *argv, **kw: subprocess.run([sys.executable, "-m", "capctl.cli.main", *argv], env={**env, **kw},  # noqa: E731
                                              capture_output=True, text=True, timeout=60)
    ok = run("policy", "validate", str(policy))
    assert ok.returncode == 0 and "p.yaml: ok" in ok.stdout, ok.stderr
    partial = run("status", "--coordinator", "127.0.0.1:1")
    assert partial.returncode == 1 and "TLS needs --tls-ca, --tls-cert and --tls-key together" in partial.stderr
    bad = tmp_path / "bad.pem"
    bad.write_bytes(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    wrong = run("status", "--coordinator", "127.0.0.1:1", CAPCTL_TLS_CA=str(bad), CAPCTL_TLS_CERT=str(pki.admin.cert_path),
                CAPCTL_TLS_KEY=str(pki.admin.key_path))
    assert wrong.returncode == 1 and f"--tls-ca {bad}: not a valid PEM certificate" in wrong.stderr, wrong.stderr
    assert "ssl_transport_security" not in wrong.stderr and "Traceback" not in wrong.stderr


def test_unix_target_detection():
    assert tls.is_unix_target("unix:/run/capctl/coordinator.sock")
    assert tls.is_unix_target("unix:///run/x.sock")
    assert not tls.is_unix_target("127.0.0.1:7373")
