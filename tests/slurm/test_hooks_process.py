"""The hook programs as slurmd runs them (real processes, empty environment, no PATH), without a
cluster: bounded time, fail-open/fail-closed exit status, one log line per run, no traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capctl.errors import UserInputError
from slurm.config import expand_node, load_config
from slurm.gpus import GPU_ID_MINOR, GPU_ID_PCI_BUS_ID, GPU_ID_UUID, parse_job_gpus

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def run_hook(kind: str, tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, float, list[dict]]:
    """Run slurm/<kind> with a slurmd-like environment (no PATH); returns (process, seconds, events)."""
    log = tmp_path / "hooks.log"
    base = {"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "nX", "SLURM_JOB_USER": "alice",
            "SLURM_JOB_PARTITION": "gpu", "CAPCTL_HOOK_LOG": str(log), "CAPCTL_PYTHON": sys.executable,
            "CAPCTL_POLICY": str(tmp_path / "no-policy.yaml"), "CAPCTL_HOOKS_ENV": str(tmp_path / "none.env")}
    base.update({k: str(v) for k, v in env.items()})
    t0 = time.monotonic()
    proc = subprocess.run([str(REPO / "slurm" / kind)], env=base, capture_output=True, text=True, timeout=30,
                          cwd="/")
    elapsed = time.monotonic() - t0
    events = []
    if log.exists():
        for line in log.read_text().splitlines():
            if "{" in line:
                events.append(json.loads(line[line.index("{"):]))
    return proc, elapsed, [e for e in events if e.get("outcome") != "begin"]


def test_agent_unreachable_fail_open_exits_0_quickly(tmp_path):
    proc, elapsed, events = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="0,1",
                                     CAPCTL_AGENT_SOCKET=tmp_path / "agent-%n.sock")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 2.0
    (ev,) = events
    assert ev["outcome"] == "agent-unreachable" and ev["job_id"] == "4242" and ev["node"] == "nX"
    assert ev["socket"] == str(tmp_path / "agent-nX.sock")
    assert ev["gpu_ids"] == ["0", "1"] and ev["gpu_id_kind"] == "minor"
    assert "job=4242" in proc.stderr and "fail-open" in proc.stderr


def test_agent_unreachable_fail_closed_fails_on_purpose(tmp_path):
    for kind in ("prolog", "epilog"):
        proc, _, events = run_hook(kind, tmp_path, SLURM_JOB_GPUS="0", CAPCTL_ON_UNREACHABLE="fail-closed",
                                   CAPCTL_AGENT_SOCKET=tmp_path / "missing.sock")
        assert proc.returncode == 1, (kind, proc.stderr)
        assert events[-1]["outcome"] == "agent-unreachable" and events[-1]["exit"] == 1
        assert "Traceback" not in proc.stderr


def test_hung_agent_is_cut_at_the_bound(tmp_path):
    """An agent socket that accepts connections and never answers: the run ends at timeout_s."""
    path = tmp_path / "hung.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(16)
    try:
        for kind in ("prolog", "epilog"):
            proc, elapsed, events = run_hook(kind, tmp_path, SLURM_JOB_GPUS="3", CAPCTL_AGENT_SOCKET=path,
                                             CAPCTL_HOOK_TIMEOUT_S="1.0")
            assert proc.returncode == 0, proc.stderr
            assert 0.5 < elapsed < 1.6, elapsed
            assert events[-1]["outcome"] in ("agent-unreachable", "timeout"), events[-1]
            assert events[-1]["duration_s"] <= 1.0
    finally:
        srv.close()


def test_bad_gpu_list_and_no_gpus(tmp_path):
    proc, _, events = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="0,banana",
                               CAPCTL_AGENT_SOCKET=tmp_path / "x.sock")
    assert proc.returncode == 0 and events[-1]["outcome"] == "bad-gpus"
    assert "banana" in proc.stderr
    proc, _, events = run_hook("prolog", tmp_path, CAPCTL_AGENT_SOCKET=tmp_path / "x.sock")
    assert proc.returncode == 0 and events[-1]["outcome"] == "no-gpus"


def test_interpreter_missing_fails_open_unless_fail_closed(tmp_path):
    proc, elapsed, _ = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="0", CAPCTL_PYTHON="/nonexistent/python")
    assert proc.returncode == 0
    assert "hook did not run" in proc.stderr and "job=4242" in proc.stderr
    assert "hook did not run" in (tmp_path / "hooks.log").read_text()
    proc, _, _ = run_hook("epilog", tmp_path, CAPCTL_PYTHON="/nonexistent/python", CAPCTL_ON_UNREACHABLE="fail-closed")
    assert proc.returncode == 1


def test_config_file_next_to_slurm_conf(tmp_path):
    """Without CAPCTL_HOOKS_ENV the wrapper reads <dir of SLURM_CONF>/capctl-hooks.env."""
    (tmp_path / "slurm.conf").write_text("")
    (tmp_path / "capctl-hooks.env").write_text(
        f"CAPCTL_AGENT_SOCKET={tmp_path}/from-env-file-%n.sock\nCAPCTL_ON_UNREACHABLE=fail-closed\n")
    log = tmp_path / "hooks.log"
    env = {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n9", "SLURM_JOB_GPUS": "1", "SLURM_CONF": str(tmp_path / "slurm.conf"),
           "CAPCTL_HOOK_LOG": str(log), "CAPCTL_PYTHON": sys.executable, "CAPCTL_POLICY": str(tmp_path / "none.yaml")}
    proc = subprocess.run([str(REPO / "slurm" / "prolog")], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert f"{tmp_path}/from-env-file-n9.sock" in log.read_text()
    # a key of the file replaces the same variable of slurmd's environment (docs/slurm.md)
    env.update(CAPCTL_ON_UNREACHABLE="fail-open", CAPCTL_AGENT_SOCKET=f"{tmp_path}/from-slurmd-%n.sock")
    proc = subprocess.run([str(REPO / "slurm" / "prolog")], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr  # the file's fail-closed
    assert "from-slurmd" not in log.read_text()
    # a CAPCTL_HOOKS_ENV naming a missing file falls through to the next one (docs/slurm.md: "the
    # first found"; found by a try-out: nothing else was tried)
    env["CAPCTL_HOOKS_ENV"] = str(tmp_path / "missing.env")
    proc = subprocess.run([str(REPO / "slurm" / "prolog")], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr  # fail-closed: the file next to slurm.conf was read


def test_parse_job_gpus():
    assert parse_job_gpus("4,5,6,7").ids == ("4", "5", "6", "7")
    assert parse_job_gpus("0-2,5").ids == ("0", "1", "2", "5")
    assert parse_job_gpus("2,2,1").ids == ("2", "1")
    assert parse_job_gpus(None).ids == () and parse_job_gpus("").kind == GPU_ID_MINOR
    u = parse_job_gpus("GPU-0123abcd-0000-1111-2222-333344445555,MIG-aaaa-bbbb")
    assert u.kind == GPU_ID_UUID and len(u.ids) == 2
    p = parse_job_gpus("00000000:18:00.0,3B:00.0")
    assert p.kind == GPU_ID_PCI_BUS_ID and p.ids == ("00000000:18:00.0", "00000000:3B:00.0")
    for bad in ("0,GPU-abc", "x", "5-2", "0-99999"):
        with pytest.raises(UserInputError):
            parse_job_gpus(bad)


def test_config_policy_and_overrides(tmp_path):
    from capctl.policy import DEFAULT_POLICY_YAML

    policy = tmp_path / "p.yaml"
    policy.write_text(DEFAULT_POLICY_YAML.replace("timeout_s: 5", "timeout_s: 3")
                      .replace("on_unreachable: fail-open", "on_unreachable: fail-closed"))
    cfg = load_config({"CAPCTL_POLICY": str(policy), "SLURMD_NODENAME": "node7"})
    assert (cfg.timeout_s, cfg.fail_open, cfg.socket_path, cfg.problems) == (3.0, False, "/run/capctl/agent-node7.sock", [])
    cfg = load_config({"CAPCTL_POLICY": str(policy), "SLURMD_NODENAME": "n", "CAPCTL_HOOK_TIMEOUT_S": "1.5",
                       "CAPCTL_ON_UNREACHABLE": "fail-open", "CAPCTL_AGENT_SOCKET": "/x/%n-%%.sock"})
    assert (cfg.timeout_s, cfg.fail_open, cfg.socket_path) == (1.5, True, "/x/n-%.sock")
    policy.write_text("version: 1\nbudget_w: -3\n")
    cfg = load_config({"CAPCTL_POLICY": str(policy), "SLURMD_NODENAME": "n"})
    assert cfg.fail_open and cfg.timeout_s == 5.0 and cfg.problems and str(policy) in cfg.problems[0]
    assert expand_node("a%nb%%c%x", "N") == "aNb%c%x"


def test_timeout_beyond_the_scripts_outer_bound_is_refused_or_fitted(tmp_path):
    """CAPCTL_HOOK_TIMEOUT_S above 300 s is refused with a problem line (not silently clamped: the
    script's own bound refuses it too); a policy prolog.timeout_s longer than the script's outer
    bound (CAPCTL_HOOK_BOUND_S) is lowered to fit, and the mismatch reported."""
    from capctl.policy import DEFAULT_POLICY_YAML

    cfg = load_config({"SLURMD_NODENAME": "n", "CAPCTL_POLICY": str(tmp_path / "none.yaml"),
                       "CAPCTL_HOOK_TIMEOUT_S": "600"})
    assert cfg.timeout_s == 5.0 and any("CAPCTL_HOOK_TIMEOUT_S='600' ignored" in p for p in cfg.problems)
    policy = tmp_path / "p.yaml"
    policy.write_text(DEFAULT_POLICY_YAML.replace("timeout_s: 5", "timeout_s: 30"))
    cfg = load_config({"SLURMD_NODENAME": "n", "CAPCTL_POLICY": str(policy), "CAPCTL_HOOK_BOUND_S": "7.000"})
    assert cfg.timeout_s == 5.0, cfg
    (problem,) = cfg.problems
    assert "30 s" in problem and "7 s" in problem and "CAPCTL_HOOK_TIMEOUT_S=30" in problem
    cfg = load_config({"SLURMD_NODENAME": "n", "CAPCTL_POLICY": str(policy), "CAPCTL_HOOK_BOUND_S": "32.000"})
    assert (cfg.timeout_s, cfg.problems) == (30.0, [])


def test_policy_timeout_longer_than_the_outer_bound_keeps_fail_closed(tmp_path):
    """A fail-closed policy with prolog.timeout_s 30 s and no CAPCTL_HOOK_TIMEOUT_S: the script's outer
    bound is 7 s. The hook fits inside it and ends by its own timeout under the policy (exit 1, the
    mismatch in the log) instead of being killed at 7 s and counted as "did not run" (exit 0)."""
    from capctl.policy import DEFAULT_POLICY_YAML

    policy = tmp_path / "p.yaml"
    policy.write_text(DEFAULT_POLICY_YAML.replace("timeout_s: 5", "timeout_s: 30")
                      .replace("on_unreachable: fail-open", "on_unreachable: fail-closed"))
    path = tmp_path / "hung.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(16)
    try:
        proc, elapsed, events = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="3", CAPCTL_AGENT_SOCKET=path,
                                         CAPCTL_POLICY=policy)
    finally:
        srv.close()
    assert proc.returncode == 1, proc.stderr
    assert "hook did not run" not in proc.stderr
    assert 4.0 < elapsed < 7.0, elapsed
    assert events[-1]["outcome"] in ("agent-unreachable", "timeout") and events[-1]["timeout_s"] == 5.0
    assert "does not fit" in events[-1]["config_problems"][0]


def test_an_interpreter_that_starts_too_slowly_is_bounded_and_fails_open(tmp_path):
    """The hook's own watchdog starts with the interpreter: the wrapper bounds the whole run
    (CAPCTL_HOOK_TIMEOUT_S + 2 s), so a slow start never outlasts slurmd's PrologEpilogTimeout (a
    killed prolog drains the node) and under fail-open the job runs."""
    slow = tmp_path / "slowpy"
    slow.write_text(f"#!/bin/sh\nsleep 20\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    proc, elapsed, _ = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="0", CAPCTL_PYTHON=slow, CAPCTL_HOOK_TIMEOUT_S="1")
    assert proc.returncode == 0 and elapsed < 8.0, (proc.returncode, elapsed)
    assert "hook did not run" in proc.stderr and "exited 124" in proc.stderr
    proc, elapsed, _ = run_hook("epilog", tmp_path, CAPCTL_PYTHON=slow, CAPCTL_HOOK_TIMEOUT_S="1",
                                CAPCTL_ON_UNREACHABLE="fail-closed")
    assert proc.returncode == 1 and elapsed < 8.0


def test_an_epilog_that_cannot_reach_the_agent_leaves_the_jobs_end_in_its_drop_box(tmp_path):
    from capctl import endedjobs

    sock = tmp_path / "agent-nX.sock"
    proc, _, events = run_hook("epilog", tmp_path, CAPCTL_AGENT_SOCKET=tmp_path / "agent-%n.sock")
    assert proc.returncode == 0 and events[-1]["outcome"] == "agent-unreachable"
    assert endedjobs.waiting(str(sock)) == ["4242"] and events[-1]["left_for_agent"].endswith("agent-nX.sock.ended/4242")
    proc, _, events = run_hook("prolog", tmp_path, SLURM_JOB_ID="4343", SLURM_JOB_GPUS="0",
                               CAPCTL_AGENT_SOCKET=tmp_path / "agent-%n.sock")
    assert events[-1]["outcome"] == "agent-unreachable" and endedjobs.waiting(str(sock)) == ["4242"]  # prologs: none


def test_an_epilog_says_held_when_the_restore_is_held_below_the_pre_job_limit():
    """The agent holds a restore at the coordinator's allowance (coordinator down, or budget left):
    the epilog's line says so instead of "restored 1 GPU(s)" (found by a try-out)."""
    from types import SimpleNamespace

    from capctl.v1 import capctl_pb2
    from slurm import hooks

    class Done(Exception):
        pass

    seen = []

    def finish(outcome, message, failure, **kw):
        seen.append((outcome, message, failure))
        raise Done

    run = SimpleNamespace(finish=finish)
    gpu = capctl_pb2.GpuCapResult(index=0, cap_w=300.0, enforced_w=300.0, ok=True)
    held = ("job 42 ended on n1; held below the pre-job limit by the coordinator's allowance (restored when it "
            "allows): GPU 0 at 300 W of 700 W")
    for message, want in ((held, "unbound; " + held), ("job 42 ended on n1; restored GPUs [0]", "restored 1 GPU(s) and unbound")):
        with pytest.raises(Done):
            hooks._finish_epilog(run, capctl_pb2.JobEndReply(ok=True, message=message, gpus=[gpu]))
        assert seen[-1] == ("unbound", want, False)


def test_a_jobs_end_left_in_the_drop_box_is_taken_by_the_real_agent_after_its_restart(tmp_path):
    """The epilog runs while the agent is down (its restart, a crash): it leaves the job's end in the
    agent's drop box and exits 0; the real agent, started again, ends the job at its next interval:
    unbound, the pre-job limit restored, and the coordinator lists the job as finished."""
    from capctl import endedjobs
    from coordinator.client import AdminClient
    from tests.coordinator.conftest import wait_for
    from tests.support.processes import Cluster

    (tmp_path / "cl").mkdir()
    with Cluster(tmp_path / "cl", {"n1": 2}, budget_w=1400.0, interval_s=0.5) as cl:
        sim, agent = cl.sims["n1"], cl.agent("n1")
        with agent.client() as c:
            assert c.job_start("4242", ["0"], user="alice").ok
        wait_for(lambda: float(sim.read(0)["limit_w"]) < 700.0, 10, "GPU 0 capped for the job")
        agent.stop()
        proc, _, events = run_hook("epilog", tmp_path, SLURMD_NODENAME="n1", CAPCTL_AGENT_SOCKET=agent.socket_path)
        assert proc.returncode == 0 and events[-1]["outcome"] == "agent-unreachable", (proc.stderr, events)
        assert endedjobs.waiting(agent.socket_path) == ["4242"]
        again = cl.start_agent("n1")
        again.wait_ready(30.0, connected=True)
        wait_for(lambda: not again.status().jobs and endedjobs.waiting(again.socket_path) == [], 15,
                 "the job ended by the restarted agent")
        try:
            wait_for(lambda: abs(float(sim.read(0)["limit_w"]) - 700.0) < 0.002, 15, "GPU 0's pre-job limit back")
            with AdminClient(cl.coordinator.admin_address) as admin:
                (rec,) = wait_for(lambda: admin.finished_jobs(job_id="4242"), 15, "job 4242 finished")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nagent log:\n{again.log_tail(40)}\ncoordinator log:\n"
                                 f"{cl.coordinator.log_path.read_text()[-3000:]}") from None
        assert rec.user == "alice" and list(rec.nodes) == ["n1"]


@pytest.mark.parametrize("how", ["bound-before-config", "interpreter-missing"])
def test_an_epilog_that_times_out_early_or_never_runs_still_leaves_the_jobs_end(tmp_path, how):
    """The job's end goes to the agent's drop box also when the bound is reached before the hook
    loaded its configuration, and when the interpreter never ran (the shell wrapper's "hook did not
    run"), as long as the agent's socket is there (found by a try-out: the job stayed bound)."""
    import socket as socketmod

    from capctl import endedjobs

    sock_path = tmp_path / "agent-nX.sock"
    listener = socketmod.socket(socketmod.AF_UNIX)
    listener.bind(str(sock_path))  # an agent's socket that answers nothing (not listening)
    try:
        env = {"CAPCTL_AGENT_SOCKET": tmp_path / "agent-%n.sock"}
        env.update({"CAPCTL_HOOK_TIMEOUT_S": "0.01"} if how == "bound-before-config" else
                   {"CAPCTL_PYTHON": tmp_path / "no-python"})
        proc, _, _ = run_hook("epilog", tmp_path, **env)
    finally:
        listener.close()
    assert proc.returncode == 0, proc.stderr
    assert endedjobs.waiting(str(sock_path)) == ["4242"], (proc.stderr, (tmp_path / "hooks.log").read_text())


# --- found by a review of the hooks (5 Dec 2026): nothing here may drain a node unasked -------


@pytest.mark.parametrize("content", ['CAPCTL_POLICY="/etc/capctl/policy.yaml\n', "if then\n", "X=${UNSET?}\n"])
def test_a_hooks_env_with_a_shell_error_is_skipped_not_fatal(tmp_path, content):
    """dash ends a script at a shell error in a file it reads with ``.``: the wrappers exited 2 at
    once (slurmd drains the node for a failed prolog). The file is tried in a subshell first: the
    run goes on with the defaults and says which file it could not read."""
    bad = tmp_path / "bad.env"
    bad.write_text(content + "CAPCTL_ON_UNREACHABLE=fail-closed\n")
    for kind in ("prolog", "epilog"):
        proc, _, events = run_hook(kind, tmp_path, SLURM_JOB_GPUS="0", CAPCTL_HOOKS_ENV=bad,
                                   CAPCTL_AGENT_SOCKET=tmp_path / "missing.sock")
        assert proc.returncode == 0, (kind, proc.returncode, proc.stderr)  # fail-open: the file was not read
        assert f"{bad} not read: a shell error in it" in proc.stderr
        assert any(f"{bad} not read" in p for p in events[-1]["config_problems"]), events[-1]
    env = {"CAPCTL_HOOKS_ENV": str(bad), "SLURMD_NODENAME": "nX", "CAPCTL_PYTHON": sys.executable,
           "CAPCTL_AGENT_SOCKET": str(tmp_path / "missing.sock"), "CAPCTL_POLICY": str(tmp_path / "none.yaml"),
           "CAPCTL_HOOK_LOG": str(tmp_path / "hooks.log")}
    health = subprocess.run([str(REPO / "slurm" / "healthcheck")], env=env, capture_output=True, text=True,
                            timeout=30, cwd="/")
    assert health.returncode == 1 and "UNHEALTHY: agent not reachable" in health.stdout, health.stderr
    ctld = subprocess.run([str(REPO / "slurm" / "epilog_slurmctld")], env={**env, "SLURM_JOB_ID": "5"},
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert ctld.returncode == 0 and f"{bad} not read" in ctld.stderr


def test_job_data_problems_do_not_fail_closed(tmp_path):
    """Under fail-closed, a job's own bad data (an unparsable GPU list) fails open with a line that
    says why: draining the node would not fix it and a requeued job would drain node after node."""
    proc, _, events = run_hook("prolog", tmp_path, SLURM_JOB_GPUS="N/A", CAPCTL_ON_UNREACHABLE="fail-closed",
                               CAPCTL_AGENT_SOCKET=tmp_path / "missing.sock")
    assert proc.returncode == 0, proc.stderr
    assert events[-1]["outcome"] == "bad-gpus" and events[-1]["exit"] == 0
    assert "fail-closed does not drain the node for it" in proc.stderr


def test_an_epilog_on_a_node_without_an_agent_directory_creates_nothing(tmp_path):
    """No agent deployed (its socket's directory missing): the epilog's end is not left in a drop
    box (it made /run/capctl/ and one file per job); an agent that is down, its directory there,
    still gets it (test above)."""
    sock = tmp_path / "no-such-dir" / "agent.sock"
    proc, _, events = run_hook("epilog", tmp_path, CAPCTL_AGENT_SOCKET=sock)
    assert proc.returncode == 0 and events[-1]["outcome"] == "agent-unreachable"
    assert not (tmp_path / "no-such-dir").exists()
    assert events[-1]["left_for_agent"].startswith("not written: no directory")
    proc, _, _ = run_hook("epilog", tmp_path, CAPCTL_AGENT_SOCKET=sock, CAPCTL_PYTHON="/nonexistent/python")
    assert proc.returncode == 0 and not (tmp_path / "no-such-dir").exists()  # the shell fallback too


def test_a_copy_of_the_prolog_in_a_prolog_d_does_not_run_an_unrelated_interpreter(tmp_path):
    """A copy in a prolog.d/ directory has no hooks.py beside it: ``../../../../bin/python`` (an
    installed package's environment) is not taken for it (it ran whatever python was there)."""
    hook_dir = tmp_path / "a" / "b" / "c" / "d" / "prolog.d"
    hook_dir.mkdir(parents=True)
    marker = tmp_path / "ran"
    fake = tmp_path / "a" / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 3\n")
    fake.chmod(0o755)
    copy = hook_dir / "50-capctl"
    copy.write_text((REPO / "slurm" / "prolog").read_text())
    copy.chmod(0o755)
    env = {"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "nX", "CAPCTL_HOOK_LOG": str(tmp_path / "hooks.log"),
           "CAPCTL_HOOKS_ENV": str(tmp_path / "none.env")}
    proc = subprocess.run([str(copy)], env=env, capture_output=True, text=True, timeout=30, cwd="/")
    assert proc.returncode == 0 and not marker.exists(), proc.stderr


def test_epilog_slurmctld_is_bounded_by_its_wrapper(tmp_path):
    """An interpreter that never finishes: the wrapper ends it at CAPCTL_CTLD_TIMEOUT_S + 2 s and
    exits 0 (it had no outer bound: slurmctld waited)."""
    slow = tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\nexec sleep 60\n")
    slow.chmod(0o755)
    env = {"SLURM_JOB_ID": "9", "CAPCTL_PYTHON": str(slow), "CAPCTL_CTLD_TIMEOUT_S": "1",
           "CAPCTL_HOOK_LOG": str(tmp_path / "hooks.log"), "CAPCTL_HOOKS_ENV": str(tmp_path / "none.env")}
    t0 = time.monotonic()
    proc = subprocess.run([str(REPO / "slurm" / "epilog_slurmctld")], env=env, capture_output=True, text=True,
                          timeout=30, cwd="/")
    assert proc.returncode == 0 and 2.5 < time.monotonic() - t0 < 8.0, (proc.stderr, time.monotonic() - t0)
    assert "hook did not run" in proc.stderr


def test_syslog_lines_never_block_on_a_syslog_that_does_not_read(tmp_path):
    """A syslog socket whose queue is full (a hung journald): the hook's line is dropped at once
    (the syslog module blocked there, holding the log's lock, until slurmd's timeout)."""
    from slurm import hooks

    path = str(tmp_path / "log.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    try:
        assert hooks.send_syslog("capctl-prolog", False, "first", path)
        assert srv.recv(4096).startswith(b"<30>capctl-prolog[")  # daemon.info, the tag and pid
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        filler.setblocking(False)
        try:
            for _ in range(100_000):  # fill the queue (bounded)
                filler.sendto(b"x" * 512, path)
        except BlockingIOError:
            pass
        finally:
            filler.close()
        t0 = time.monotonic()
        assert hooks.send_syslog("capctl-prolog", True, "dropped", path) is False
        assert time.monotonic() - t0 < 0.5
        assert hooks.send_syslog("capctl-prolog", True, "no socket", str(tmp_path / "none")) is False
    finally:
        srv.close()


def test_healthcheck_drains_or_resumes_only_its_own_drain(tmp_path, monkeypatch):
    """``--drain`` sets a drain only on a node with no reason at all and lifts only its own
    (``capctl:``): an admin's ``maintenance`` drain was replaced by ours, then lifted when the agent
    came back (found by a review); a node state it cannot read is left alone."""
    from slurm import health

    calls = []
    monkeypatch.setattr(health, "set_drain", lambda node, reason, t: calls.append(reason) or "did it")
    cases = [  # (healthy, current reason, what is done)
        (False, "", "drain"), (False, "maintenance: PSU swap", None), (False, "capctl: agent down", None),
        (False, health.UNKNOWN, None), (True, "capctl: agent down", "resume"), (True, "maintenance", None),
        (True, "", None), (True, health.UNKNOWN, None)]
    for healthy, current, want in cases:
        calls.clear()
        text = health.drain_action("n1", healthy, "agent not reachable", current, 1.0)
        assert calls == ([] if want is None else ["capctl: agent not reachable" if want == "drain" else None]), (
            healthy, current, calls)
        if current and not current.startswith("capctl:") and not healthy:
            assert "left as it is" in text and current[:20] in text
        if current is health.UNKNOWN:
            assert "node state unknown" in text
    # node_reason: "" without a reason, the reason, UNKNOWN when scontrol fails or names another node
    fake = tmp_path / "scontrol"
    for out, rc, want in (("NodeName=n1 State=IDLE Weight=1\n", 0, ""),
                          ("NodeName=n1 State=IDLE+DRAIN Reason=maintenance: PSU swap [root@2026-12-05T10:00:00]\n", 0,
                           "maintenance: PSU swap"),
                          ("", 1, health.UNKNOWN), ("NodeName=n12 State=IDLE\n", 0, health.UNKNOWN)):
        fake.write_text(f"#!/bin/sh\nprintf '%s' '{out}'\nexit {rc}\n")
        fake.chmod(0o755)
        monkeypatch.setattr(health, "_scontrol", lambda: str(fake))
        assert health.node_reason("n1", 5.0) == want, out


def test_a_fail_open_prolog_says_what_happened_to_the_caps_only_where_it_knows():
    # the coordinator down: the agent applied the start cap (the outcome's text says so); the
    # suffix said "its GPUs keep the caps they have", the opposite (found by a try-out)
    from slurm.hooks import _fail_open_text

    assert _fail_open_text("prolog", "coordinator-unreachable") == " -> fail-open: the job runs"
    assert _fail_open_text("prolog", "agent-unreachable") == " -> fail-open: the job runs, its GPUs keep the caps they have"
    assert _fail_open_text("epilog", "restore-failed") == " -> fail-open"
