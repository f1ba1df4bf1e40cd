"""Peer identity from gRPC's auth_context: CN, DNS SANs, roles from SAN URIs ``capctl-role:*``."""

from __future__ import annotations

from capctl.security import identity as ident_mod
from capctl.security import tls
from capctl.security.identity import PeerIdentity, agent_identity_problem, identity_from_auth_context
from tests.security.conftest import ask, client_config
from tests.support import certs


def test_role_prefix_matches_the_test_pki():
    assert certs.ROLE_URI_PREFIX == ident_mod.ROLE_URI_PREFIX


def test_ou_is_not_a_role_and_no_role_means_none(pki, tls_server):
    server = tls_server()
    target = f"127.0.0.1:{server.port}"
    ou = ask(target, tls.channel_credentials(client_config(pki, pki.ou_admin)))
    assert ou["verified"] and ou["cn"] == "mallory" and ou["roles"] == []
    norole = ask(target, tls.channel_credentials(client_config(pki, pki.norole)))
    assert norole["verified"] and norole["roles"] == []


def test_insecure_transport_has_no_identity(tmp_path):
    from tests.security.conftest import WhoServer

    server = WhoServer(f"unix:{tmp_path / 'who.sock'}")
    try:
        got = ask(f"unix:{tmp_path / 'who.sock'}")
    finally:
        server.stop()
    assert got["transport"] == "insecure" and got["verified"] is False and got["roles"] == [] and got["cn"] == ""


def test_identity_from_auth_context_parsing():
    auth = {"transport_security_type": [b"ssl"], "x509_common_name": [b"n3"], "peer_dns": [b"n3", b"n3.example"],
            "peer_uri": [b"capctl-role:agent", b"capctl-role:ADMIN", b"capctl-role:", b"spiffe://x/y",
                         b"capctl-role:reader"], "x509_subject": [b"CN=n3,O=x"]}
    ident = identity_from_auth_context(auth)
    assert ident.verified and ident.roles == frozenset({"agent", "reader"})  # malformed roles ignored
    assert ident.names() == frozenset({"n3", "n3.example"})
    assert ident.describe() == "cert CN=n3 roles=agent,reader"
    # roles only count on a verified TLS transport
    spoof = identity_from_auth_context({"transport_security_type": [b"insecure"], "peer_uri": [b"capctl-role:admin"]})
    assert spoof.roles == frozenset() and not spoof.verified
    assert identity_from_auth_context(None) == PeerIdentity()
    assert identity_from_auth_context({"peer_uri": [b"\xff" * 5000] * 500}).uris.__len__() == 64


def test_agent_certificate_must_name_the_node():
    agent_n1 = PeerIdentity("ssl", "n1", ("n1",), ("capctl-role:agent",))
    assert agent_identity_problem(agent_n1, "n1") == ""
    assert "not node 'n2'" in agent_identity_problem(agent_n1, "n2")
    admin = PeerIdentity("ssl", "alice", (), ("capctl-role:admin",))
    assert "lacks the agent role" in agent_identity_problem(admin, "alice")
    assert agent_identity_problem(PeerIdentity("insecure"), "n1") == "no verified client certificate"
