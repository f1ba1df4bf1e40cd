"""Admin identity: certificate role, root-only token file (constant-time, never shown), admin socket."""

from __future__ import annotations

import logging
import os

import pytest

from capctl.errors import UserInputError
from capctl.security import authz, tls
from capctl.security.authz import (AnyOf, CertRoleAuthorizer, NoOne, Secret, TokenAuthorizer, TrustedTransport,
                                   bearer_metadata, listener_authorizer, load_token_file)
from tests.security.conftest import WhoServer, ask, client_config

TOKEN = "0123456789abcdef0123456789abcdef"


def _token_file(tmp_path, text=TOKEN, mode=0o600):
    p = tmp_path / "admin.token"
    p.write_text(text + "\n")
    os.chmod(p, mode)
    return p


def test_token_file_is_read_and_hidden(tmp_path):
    secret = load_token_file(_token_file(tmp_path))
    assert secret.matches(TOKEN) and not secret.matches(TOKEN[:-1] + "X") and not secret.matches("")
    assert TOKEN not in repr(secret) and TOKEN not in str(secret) and TOKEN not in f"{secret}"
    assert bearer_metadata(secret) == (("authorization", "Bearer " + TOKEN),)
    assert secret == Secret(TOKEN) and secret != TOKEN


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_token_file_readable_by_others_is_refused_without_showing_it(tmp_path, mode):
    p = _token_file(tmp_path, mode=mode)
    with pytest.raises(UserInputError) as err:
        load_token_file(p)
    assert f"mode {mode:04o}" in str(err.value) and f"chmod 600 {p}" in str(err.value)
    assert TOKEN not in str(err.value)


def test_token_file_other_problems(tmp_path):
    with pytest.raises(UserInputError, match="cannot read it"):
        load_token_file(tmp_path / "missing")
    with pytest.raises(UserInputError, match="empty token"):
        load_token_file(_token_file(tmp_path, text="  "))
    with pytest.raises(UserInputError, match="at least 8 printable") as err:
        load_token_file(_token_file(tmp_path, text="short"))
    assert "short" not in str(err.value)
    with pytest.raises(UserInputError, match="at least 8 printable"):
        load_token_file(_token_file(tmp_path, text="has a space in the middle of it"))
    with pytest.raises(UserInputError, match=r"owned by uid \d+; the token file must belong to root"):
        load_token_file(_token_file(tmp_path), owner_uids={12345})
    with pytest.raises(UserInputError, match="not a regular file"):
        load_token_file(tmp_path)


def test_authorizers_on_real_tls_calls(pki, tls_server, tmp_path):
    token = load_token_file(_token_file(tmp_path))
    server = tls_server({"cert": CertRoleAuthorizer(), "token": TokenAuthorizer(token),
                         "listener": listener_authorizer(tls=True, token=token, admin_socket="/run/capctl/c.sock")})
    target = f"127.0.0.1:{server.port}"

    def decisions(issued, metadata=()):
        return ask(target, tls.channel_credentials(client_config(pki, issued)), metadata=metadata)["decisions"]

    admin = decisions(pki.admin)
    assert admin == {"cert": "cert CN=alice roles=admin", "token": None, "listener": "cert CN=alice roles=admin"}
    for issued in (pki.reader, pki.norole, pki.ou_admin, pki.agent("n1")):
        assert decisions(issued) == {"cert": None, "token": None, "listener": None}, issued.name
    with_token = decisions(pki.reader, bearer_metadata(token))
    assert with_token == {"cert": None, "token": "admin token", "listener": "admin token"}
    wrong = decisions(pki.reader, (("authorization", "Bearer " + TOKEN[:-1] + "0"),))
    assert wrong["listener"] is None
    not_bearer = decisions(pki.reader, (("authorization", TOKEN),))
    assert not_bearer["listener"] is None


def test_admin_role_needs_tls_even_with_a_token_less_listener(tmp_path):
    """Over a plaintext transport nobody is admin by certificate; the token still works."""
    token = load_token_file(_token_file(tmp_path))
    sock = tmp_path / "who.sock"
    server = WhoServer(f"unix:{sock}", authorizers={
        "plain": listener_authorizer(tls=False, token=None, admin_socket=None),
        "with_token": listener_authorizer(tls=False, token=token, admin_socket=None),
        "admin_socket": TrustedTransport("unix:/x.sock")})
    try:
        got = ask(f"unix:{sock}")["decisions"]
        with_tok = ask(f"unix:{sock}", metadata=bearer_metadata(token))["decisions"]
    finally:
        server.stop()
    assert got == {"plain": None, "with_token": None, "admin_socket": "via unix:/x.sock"}
    assert with_tok["with_token"] == "admin token" and with_tok["plain"] is None


def test_describe_names_every_way_in():
    a = listener_authorizer(tls=True, token=Secret(TOKEN), admin_socket="/run/capctl/coordinator.sock")
    text = a.describe()
    assert "capctl-role:admin" in text and "admin token" in text and "unix:/run/capctl/coordinator.sock" in text
    assert TOKEN not in text
    assert AnyOf(NoOne()).describe() == "admin operations need the coordinator's admin unix socket"


def test_bearer_parsing_is_bounded():
    md = [("x", "y")] * 100 + [("authorization", "Bearer " + TOKEN)]
    assert authz.bearer_from_metadata(md) is None  # beyond 64 entries: not looked at
    assert authz.bearer_from_metadata([("authorization", "Bearer  abc ")]) == "abc"
    assert authz.bearer_from_metadata(None) is None


def test_token_never_reaches_the_log(tmp_path, caplog):
    from capctl.security.redact import RedactingFilter, redact

    secret = load_token_file(_token_file(tmp_path))
    logger = logging.getLogger("capctl.test.redact")
    caplog.set_level(logging.INFO, logger="capctl.test.redact")
    caplog.handler.addFilter(RedactingFilter())
    logger.info("metadata %s", bearer_metadata(secret))
    logger.info("token=%s", secret.reveal())
    logger.info("secret %r", secret)
    assert caplog.records and TOKEN not in caplog.text
    assert "<redacted>" in caplog.text and "Secret(<hidden>)" in caplog.text
    pem = "x -----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMG\n-----END PRIVATE KEY----- y"
    assert redact(pem) == "x <redacted> y"


def test_redaction_masks_secrets_not_a_yaml_errors_words():
    """``token: found`` is YAML's own error text ("while scanning for the next token: found
    character ..."): it reached the coordinator's log as ``token: <redacted>`` (found by a try-out).
    A value after ``token:`` is masked when it looks like a secret; after ``password:``,
    ``secret:`` and any ``=`` always."""
    from capctl.security.redact import redact

    yaml_error = ("p.yaml:3:1: malformed YAML: while scanning for the next token: found character '\\t' "
                  "that cannot start any token")
    assert redact(yaml_error) == yaml_error
    assert redact("secret: hunter2") == "secret: <redacted>"  # (only token: is relaxed)
    assert redact("password: correcthorse") == "password: <redacted>"
    assert redact("token=abc") == "token=<redacted>"
    assert redact("token: Zx9aQ2LmT0kP-4") == "token: <redacted>"
    assert redact("password: hunter2xyz") == "password: <redacted>"
    assert redact("admin token: " + "q" * 24) == "admin token: <redacted>"
