"""Files read by the policy loader (policies, cluster files, device profiles) must be regular files:
a FIFO, socket or device is refused at once, never waited on."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from capctl.policy import PolicyError, load_policy, validate_file
from capctl.sim.cluster import ClusterError, load_cluster
from capctl.simgpu.profiles import ProfileError, load_file


def _within(seconds: float, fn, *args):
    """``fn(*args)`` run in a thread: its exception (or None) when it ends within ``seconds``; fails
    the test when it blocks (then unblocks it by opening a FIFO argument for writing)."""
    outcome: list = []

    def call() -> None:
        try:
            fn(*args)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 (handed to the test)
            outcome.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        try:  # a reader blocked in open() on the FIFO wakes up (and reads EOF)
            os.close(os.open(args[0], os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        worker.join(5)
        pytest.fail(f"{fn.__name__}({args[0]}) blocked for more than {seconds} s")
    return outcome[0]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "p.yaml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("loader,error,expected", [
    (load_policy, PolicyError, "{p}: cannot read the policy file: not a regular file (a FIFO)"),
    (load_cluster, ClusterError, "{p}: cannot read the cluster file: not a regular file (a FIFO)"),
    (load_file, ProfileError, "--profile-file '{p}': cannot read: not a regular file (a FIFO)"),
], ids=["policy", "cluster", "profile"])
def test_loaders_refuse_a_fifo_without_waiting(fifo, loader, error, expected) -> None:
    exc = _within(10, loader, fifo)
    assert isinstance(exc, error), exc
    assert str(exc) == expected.format(p=fifo)


def test_policy_socket_and_device_refused(tmp_path) -> None:
    sock_path = tmp_path / "p.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        assert validate_file(sock_path) == [f"{sock_path}: cannot read the policy file: not a regular file (a socket)"]
    assert _within(10, validate_file, "/dev/zero") is None
    assert validate_file("/dev/zero") == ["/dev/zero: cannot read the policy file: not a regular file (a character device)"]
    assert validate_file(tmp_path) == [f"{tmp_path}: cannot read the policy file: Is a directory"]


def test_read_regular_file_bounds_and_kinds(tmp_path, fifo) -> None:
    from capctl.policy.yamlpos import NotRegularFileError, read_regular_file

    path = tmp_path / "a.yaml"
    path.write_bytes(b"x" * 100)
    assert read_regular_file(path, 10) == b"x" * 11  # max_bytes + 1: the caller tells "too large"
    assert read_regular_file(path, 1000) == b"x" * 100
    with pytest.raises(NotRegularFileError) as info:
        read_regular_file(fifo, 10)
    assert info.value.strerror == "not a regular file (a FIFO)" and info.value.filename == str(fifo)
    with pytest.raises(IsADirectoryError):
        read_regular_file(tmp_path, 10)
    link = tmp_path / "link.yaml"
    link.symlink_to(path)  # a symlink to a regular file is one
    assert read_regular_file(link, 1000) == b"x" * 100


@pytest.mark.parametrize("text,expected", [
    ("{}\n", ["c.yaml:1:1: missing key 'racks'", "c.yaml:1:1: missing key 'gpu_model'"]),
    ("gpu_model: H100-SXM\nracks: [{nodes: 'n[1-4]'}, {}]\n",
     ["c.yaml:2:28: racks[1]: an empty rack; allowed: a mapping with nodes (a Slurm hostlist or a list of names)"]),
    ("gpu_model: H100-SXM\nracks: [{nodes: 'n[1-4]'}, {name: r2, nodes: ''}]\n",
     ["c.yaml:2:46: racks[1].nodes: '' names no node; allowed: a Slurm hostlist such as \"gpu[001-032]\" or a list "
      "of names"]),
    ("gpu_model: H100-SXM\nracks: [{nodes: []}]\n",
     ["c.yaml:2:17: racks[0].nodes: [] names no node; allowed: a Slurm hostlist such as \"gpu[001-032]\" or a "
      "list of names"]),
], ids=["empty-map", "empty-rack", "empty-hostlist", "empty-list"])
def test_cluster_files_without_racks_or_nodes_name_what_is_missing(text, expected) -> None:
    """A cluster file ``{}`` gave an empty error (``capctl: ``), and racks with no nodes were
    skipped or simulated empty without a word (found by a review)."""
    from capctl.sim.cluster import parse_cluster

    with pytest.raises(ClusterError) as err:
        parse_cluster(text, "c.yaml")
    assert str(err.value).splitlines() == expected


def test_a_file_name_with_control_characters_stays_on_one_line(tmp_path) -> None:
    """A policy file named with a newline split its error lines (and the coordinator's log record
    of a refused reload) in two (found by a review): the name is written with escapes."""
    from capctl.policy import PolicyError, load_policy, validate_file

    path = tmp_path / "a\nb.yaml"
    path.write_text("version: 1\nbudget_w: 20000\nfoo: 1\n")
    (err,) = validate_file(path)
    assert err.startswith(f"{tmp_path}/a\\nb.yaml:3:1: unknown key 'foo'") and "\n" not in err
    with pytest.raises(PolicyError) as exc:
        load_policy(tmp_path / "x\x1by.yaml")
    assert str(exc.value) == f"{tmp_path}/x\\x1by.yaml: cannot read the policy file: No such file or directory"
