"""Addresses people type (coordinator --listen/--admin-socket/--status-socket, agent --coordinator/--socket,
capctl --coordinator): out-of-range ports are refused instead of wrapping modulo 65536, malformed
addresses are usage errors (exit 1) and not "unreachable" (exit 3). Also: an unusable --state-dir at
coordinator start is an error (exit 1), and --coordinator is accepted before the subcommand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from capctl.addresses import check_address, check_socket_path
from capctl.errors import UserInputError
from tests.support.processes import write_policy

REPO = Path(__file__).resolve().parents[2]


def _run(*argv, timeout=60, env=None):
    e = dict(os.environ)
    e.pop("CAPCTL_COORDINATOR", None)
    e.update(env or {})
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=e)


def _one_line(r, prog):
    assert "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"{prog}: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("value", ["127.0.0.1:7373", "localhost:1", "[::1]:65535", "unix:/run/x.sock",
                                   "unix:///run/x.sock", "unix:rel.sock"])
def test_good_addresses_pass(value):
    assert check_address(value, "--coordinator") == value


@pytest.mark.parametrize("value, expect", [
    ("127.0.0.1:99999", "port 99999 out of range; allowed 1..65535"),
    ("127.0.0.1:0", "port 0 out of range; allowed 1..65535"),
    ("127.0.0.1:-1", "is not a number"),
    ("bogus:addr:x", "malformed host 'bogus:addr'"),
    ("unix:", "no socket path after 'unix:'"),
    ("unix://", "no socket path after 'unix:'"),
    ("127.0.0.1", "expected HOST:PORT"),
    (":7373", "expected HOST:PORT"),
    ("", "empty address"),
    ("unix:/" + "x" * 200, "longer than 107 bytes"),
])
def test_bad_addresses_name_flag_value_and_allowed(value, expect):
    with pytest.raises(UserInputError) as e:
        check_address(value, "--coordinator")
    assert str(e.value).startswith("--coordinator ") and expect in str(e.value)


def test_listen_port_zero_allowed_only_for_servers():
    assert check_address("127.0.0.1:0", "--listen", allow_port_zero=True) == "127.0.0.1:0"
    with pytest.raises(UserInputError, match="allowed 0..65535"):
        check_address("127.0.0.1:65536", "--listen", allow_port_zero=True)
    with pytest.raises(UserInputError, match="empty path"):
        check_socket_path("", "--admin-socket")


@pytest.mark.parametrize("args", [["jobs"], ["status", "--json"], ["budget", "set", "1000"], ["policy", "reload"]])
@pytest.mark.parametrize("addr, expect", [("127.0.0.1:99999", "port 99999 out of range"),
                                          ("bogus:addr:x", "malformed host"), ("unix:", "no socket path")])
def test_cli_bad_coordinator_is_exit_1_not_unreachable(args, addr, expect):
    r = _run("-m", "capctl.cli.main", *args, "--coordinator", addr)
    assert r.returncode == 1, r.stderr
    line = _one_line(r, "capctl")
    assert line.startswith(f"capctl: --coordinator {addr!r}") and expect in line and "unreachable" not in line


def test_cli_bad_coordinator_from_environment():
    r = _run("-m", "capctl.cli.main", "nodes", env={"CAPCTL_COORDINATOR": "127.0.0.1:70000"})
    assert r.returncode == 1 and "$CAPCTL_COORDINATOR '127.0.0.1:70000': port 70000" in _one_line(r, "capctl")


def test_cli_coordinator_option_before_subcommand(tmp_path):
    # before the subcommand: used (unreachable socket -> exit 3 naming it), not "invalid choice"
    sock = f"unix:{tmp_path}/none.sock"
    r = _run("-m", "capctl.cli.main", "--coordinator", sock, "nodes")
    assert r.returncode == 3, r.stderr
    assert _one_line(r, "capctl").startswith(f"capctl: coordinator at {sock} unreachable")
    r = _run("-m", "capctl.cli.main", "--coordinator", sock, "--json", "jobs")
    assert r.returncode == 3 and f"coordinator at {sock}" in r.stderr
    # after the subcommand it still wins
    r = _run("-m", "capctl.cli.main", "--coordinator", "unix:/nonexistent/a.sock", "nodes", "--coordinator", sock)
    assert r.returncode == 3 and f"coordinator at {sock}" in r.stderr


def _coordinator(tmp_path, *extra):
    policy = write_policy(tmp_path / "policy.yaml", nodes=["n1"], budget_w=1600.0)
    base = {"--policy": str(policy), "--listen": f"unix:{tmp_path}/c.sock", "--state-dir": str(tmp_path / "state"),
            "--admin-socket": str(tmp_path / "admin.sock"), "--metrics-port": "-1"}
    for flag, value in zip(extra[::2], extra[1::2]):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv]
    return _run("-m", "coordinator.daemon", *argv, timeout=30)


@pytest.mark.parametrize("flag, value, expect", [
    ("--listen", "127.0.0.1:99999", "--listen '127.0.0.1:99999': port 99999 out of range; allowed 0..65535"),
    ("--listen", "bogus:addr:x", "--listen 'bogus:addr:x': malformed host"),
    ("--listen", "unix:", "--listen 'unix:': no socket path"),
    ("--admin-socket", "unix:", "--admin-socket 'unix:': no socket path"),
    ("--status-socket", "/tmp/" + "s" * 120, "--status-socket /tmp/sss"),
])
def test_coordinator_bad_addresses_exit_1(tmp_path, flag, value, expect):
    r = _coordinator(tmp_path, flag, value)
    assert r.returncode == 1, r.stderr
    assert expect in _one_line(r, "capctl-coordinator")


def test_coordinator_unusable_state_dir_exit_1(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for state, expect in ((str(afile), "exists and is not a directory"),
                          ("/proc/nope", "cannot create it"),
                          (str(afile / "sub"), "cannot create it")):
        r = _coordinator(tmp_path, "--state-dir", state)
        assert r.returncode == 1, (state, r.stderr)
        line = _one_line(r, "capctl-coordinator")
        assert line.startswith(f"capctl-coordinator: --state-dir {state}: ") and expect in line
        assert "give a writable directory" in line and "in-memory" not in r.stderr


@pytest.mark.parametrize("flag, value, expect", [
    ("--coordinator", "127.0.0.1:99999", "--coordinator '127.0.0.1:99999': port 99999 out of range"),
    ("--coordinator", "unix:", "--coordinator 'unix:': no socket path"),
    ("--socket", "", "--socket '': empty path"),
])
def test_agent_bad_addresses_exit_1(tmp_path, flag, value, expect):
    args = {"--node": "n1", "--coordinator": "unix:/nonexistent.sock", "--socket": str(tmp_path / "a.sock"),
            "--state-dir": str(tmp_path / "state")}
    args[flag] = value
    r = _run("-m", "nodeagent.daemon", *[x for kv in args.items() for x in kv], timeout=30)
    assert r.returncode == 1, r.stderr
    assert expect in _one_line(r, "capctl-agent")


def test_coordinator_bind_errors_are_clear(tmp_path):
    """The reason, in one line, instead of gRPC's "Failed to bind" and its add_port.cc log line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _coordinator(tmp_path, "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 1 and "add_port.cc" not in r.stderr and "Failed to bind" not in r.stderr, r.stderr
    assert _one_line(r, "capctl-coordinator") == \
        f"capctl-coordinator: --listen: cannot listen on 127.0.0.1:{port}: address already in use"
    r = _coordinator(tmp_path, "--listen", f"unix:{tmp_path}/missing/c.sock")
    assert r.returncode == 1 and "add_port.cc" not in r.stderr, r.stderr
    assert _one_line(r, "capctl-coordinator") == \
        f"capctl-coordinator: --listen: cannot listen on unix:{tmp_path}/missing/c.sock: no such directory {tmp_path}/missing"
    # a unix socket some process serves on is not taken over
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / "live.sock"))
    live.listen()
    try:
        r = _coordinator(tmp_path, "--listen", f"unix:{tmp_path}/live.sock")
        assert r.returncode == 1 and "address already in use" in _one_line(r, "capctl-coordinator")
    finally:
        live.close()


def test_unix_socket_errors_name_the_flag_they_came_from(tmp_path):
    """--status-socket problems are reported as --status-socket, not --admin-socket."""
    from coordinator.daemon import _prepare_unix_socket
    from capctl.errors import UserInputError

    plain = tmp_path / "not-a-socket"
    plain.write_text("x")
    with pytest.raises(UserInputError) as err:
        _prepare_unix_socket(str(plain), "--status-socket")
    assert str(err.value).startswith(f"--status-socket {plain}: exists and is not a socket")
