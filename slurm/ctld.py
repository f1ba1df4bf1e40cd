"""Slurm ``EpilogSlurmctld``: write the finished job's GPU energy into its AdminComment, bounded.

Run as ``python -m slurm.ctld`` by the ``slurm/epilog_slurmctld`` wrapper (slurmctld runs it on the
controller host as SlurmUser, with the job's ``SLURM_JOB_ID``, once the job completed). It asks
the coordinator (``Admin.FinishedJobs``, address ``$CAPCTL_COORDINATOR``) for the job's finished
record, waiting for it while the job's node epilogs are still reporting, then runs::

    sacctmgr -i update job where jobid=<id> set AdminComment=capctl:energy_j=<J>,gpu_s=<GPU-s>,capped_s=<GPU-s>

so that ``sacct -j <id> -o AdminComment`` shows it (slurmdbd accounting). ``scontrol update`` cannot
change a job that has finished (Slurm 22.05: "Job has already finished"), and the job's record
may reach slurmdbd a moment after the epilog starts, so the update is retried within the bound;
array tasks are named ``<array job>_<task>`` (as Princeton's jobstats epilog does). Another tool's
AdminComment (read with ``sacct``) is kept: our ``capctl:...`` word replaces an earlier one or is
appended after a space.

Bounded like the node hooks (:mod:`slurm.hooks`): the whole run ends within
``$CAPCTL_CTLD_TIMEOUT_S`` seconds (default :data:`DEFAULT_TIMEOUT_S`, at most
:data:`slurm.config.MAX_TIMEOUT_S`) by a watchdog. Always fail-open: exit status 0 whatever happens
(no coordinator, a job capctl never saw, scontrol failing); every outcome is one log line
(``$CAPCTL_HOOK_LOG``, stderr, syslog). Never a traceback.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time

DEFAULT_TIMEOUT_S = 15.0
"""Default bound of one run (s): node epilogs report within their own bound (5 s by default), and
slurmdbd receives the job's end record within seconds."""
POLL_S = 0.25
"""Wait between two asks for the finished record (s)."""
SCONTROL_RESERVE_S = 3.0
"""Time kept for the accounting calls (s)."""
UNREACHABLE_GIVE_UP_S = 3.0
"""Give up when the coordinator stays unreachable this long (s): a coordinator that is down holds no
record to wait for (a job it never saw)."""
UNKNOWN_GIVE_UP_S = 2.0
"""Give up when the coordinator, reachable, keeps saying it has neither a record nor a running
binding of the job this long (s): a job without GPUs, or one whose prolog bound nothing (it failed,
or the agent was down), has no record to wait for. The margin covers a job end still being relayed
by an agent (within one reporting interval)."""
_OURS = re.compile(r"(^|\s)capctl:\S*")


def comment(job) -> str:
    """The AdminComment word of a ``FinishedJob`` (J, GPU-seconds; one decimal)."""
    return f"capctl:energy_j={job.energy_j:.1f},gpu_s={job.gpu_s:.1f},capped_s={job.capped_s:.1f}"


def merged(existing: str, ours: str) -> str:
    """``existing`` AdminComment with our word replaced, or appended after a space."""
    existing = (existing or "").strip()
    if _OURS.search(existing):
        return _OURS.sub(lambda m: m.group(1) + ours, existing, count=1)
    return f"{existing} {ours}".strip()


def _timeout_s(env: dict) -> float:
    from slurm.config import MAX_TIMEOUT_S

    try:
        t = float(env.get("CAPCTL_CTLD_TIMEOUT_S", "") or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return min(max(t, 1.0), MAX_TIMEOUT_S) if t == t else DEFAULT_TIMEOUT_S


def _finished(run, job_id: str):
    """The job's ``FinishedJob`` from the coordinator, polled until the bound (None: never came)."""
    from capctl.errors import CapctlError, UnreachableError
    from coordinator.client import AdminClient, coordinator_address

    address = coordinator_address()
    last_error = ""
    unreachable_since = unknown_since = None
    while run.remaining_s() > SCONTROL_RESERVE_S:
        asked = time.monotonic()  # a call that times out counts as unreachable from when it was made
        try:
            with AdminClient(address, timeout_s=max(0.2, min(2.0, run.remaining_s() - SCONTROL_RESERVE_S))) as c:
                record, running = c.finished_job(job_id)
            if record is not None:
                return record
            unreachable_since = None
            unknown_since = None if running else (unknown_since or time.monotonic())
            if unknown_since is not None and time.monotonic() - unknown_since >= UNKNOWN_GIVE_UP_S:
                last_error = "the coordinator has no record and no running binding of the job"
                break
        except UnreachableError as err:
            last_error = str(err)
            unreachable_since = unreachable_since or asked
            if time.monotonic() - unreachable_since >= UNREACHABLE_GIVE_UP_S:
                break
        except CapctlError as err:
            last_error = str(err)
        time.sleep(POLL_S)
    run.extra["coordinator_error"] = last_error
    return None


def _command(run, args: list[str]) -> tuple[int, str]:
    """Run a Slurm command (by lifeline.Popen: no fork with gRPC loaded), bounded by the run's
    time; returns (exit status, stdout or stderr)."""
    from capctl import lifeline

    exe = shutil.which(args[0]) or f"/usr/bin/{args[0]}"
    proc = lifeline.Popen([exe, *args[1:]], stdout=-1, stderr=-1, text=True, env=dict(os.environ))
    try:
        out, err = proc.communicate(timeout=max(0.2, run.remaining_s() - 0.3))
    except Exception:  # noqa: BLE001 - timeout: kill it and report
        proc.kill()
        proc.wait()
        return 124, f"{args[0]} timed out"
    return proc.returncode, (out if proc.returncode == 0 else err).strip()


def _run(run) -> None:
    job_id = run.job_id
    if not job_id:
        run.finish("no-job", "SLURM_JOB_ID not set: nothing to do", failure=False)
    job = _finished(run, job_id)
    if job is None:
        run.finish("no-record", "no finished record from the coordinator (a job whose GPUs capctl never bound, "
                   "or the coordinator is unreachable): AdminComment unchanged", failure=False)
    ours = comment(job)
    run.extra.update(energy_j=round(job.energy_j, 1), gpu_s=round(job.gpu_s, 1), capped_s=round(job.capped_s, 1))
    acct_id = accounting_id(run.env)
    rc, out = 1, ""
    while run.remaining_s() > 0.5:
        rc, out = _command(run, ["sacct", "-n", "-P", "-X", "-j", acct_id, "-o", "AdminComment"])
        existing = out.splitlines()[0] if rc == 0 and out else ""
        rc, out = _command(run, ["sacctmgr", "-i", "update", "job", "where", f"jobid={acct_id}", "set",
                                 f"AdminComment={merged(existing, ours)}"])
        if rc == 0 and "modified" in out.lower():
            run.finish("commented", f"AdminComment {ours}", failure=False)
        if "supported accounting_storage" in out:  # no slurmdbd: retrying cannot help
            run.finish("no-accounting", f"sacctmgr: {out[:200]}", failure=True)
        time.sleep(POLL_S)  # the job's record is not in slurmdbd yet
    run.finish("accounting-failed", f"sacctmgr update job exited {rc}: {out[:200]}", failure=True)


def accounting_id(env: dict) -> str:
    """The job's id in the accounting database: ``<array job>_<task>`` for an array task."""
    job_id = env.get("SLURM_JOB_ID", "")
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    return f"{array}_{task}" if array and task and array == job_id else job_id


def main(argv: list[str] | None = None) -> int:
    """Entry point (``python -m slurm.ctld``). Exits the process with 0 (see module doc)."""
    from slurm.hooks import Run, run_guarded

    env = dict(os.environ)
    env["CAPCTL_HOOK_TIMEOUT_S"] = str(_timeout_s(env))
    env["CAPCTL_ON_UNREACHABLE"] = "fail-open"  # an EpilogSlurmctld never fails a job or a node
    return run_guarded(Run("epilog_slurmctld", env), _run)


if __name__ == "__main__":
    sys.exit(main())
