"""Slurm ``EpilogSlurmctld``: write the finished job's GPU energy into its AdminComment, bounded.

Run as ``python -m slurm.ctld`` by the ``slurm/epilog_slurmctld`` wrapper (slurmctld runs it on the
controller host as SlurmUser, with the job's ``SLURM_JOB_ID``, once the job completed). It asks
the coordinator (``Admin.FinishedJobs``, address ``$CAPCTL_COORDINATOR``) for the job's finished
record, waiting for it while the job's node epilogs are still reporting, then runs::

    scontrol update JobId=<id> AdminComment=capctl:energy_j=<J>,gpu_s=<GPU-s>,capped_s=<GPU-s>

so that ``sacct -j <id> -o AdminComment`` shows it (with slurmdbd accounting). Another tool's
AdminComment is kept: our ``capctl:...`` word replaces an earlier one or is appended after a space.

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
import signal
import sys
import time

DEFAULT_TIMEOUT_S = 10.0
"""Default bound of one run (s): node epilogs report within their own bound (5 s by default)."""
POLL_S = 0.25
"""Wait between two asks for the finished record (s)."""
SCONTROL_RESERVE_S = 2.0
"""Time kept for the scontrol calls (s)."""
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
    from capctl.errors import CapctlError
    from coordinator.client import AdminClient, coordinator_address

    address = coordinator_address()
    last_error = ""
    while run.remaining_s() > SCONTROL_RESERVE_S:
        try:
            with AdminClient(address, timeout_s=max(0.2, min(2.0, run.remaining_s() - SCONTROL_RESERVE_S))) as c:
                jobs = c.finished_jobs(job_id=job_id)
            if jobs:
                return jobs[0]
        except CapctlError as err:
            last_error = str(err)
        time.sleep(POLL_S)
    run.extra["coordinator_error"] = last_error
    return None


def _scontrol(run, args: list[str]) -> tuple[int, str]:
    """Run scontrol (by lifeline.Popen: no fork with gRPC loaded), bounded by the run's time."""
    from capctl import lifeline

    exe = shutil.which("scontrol") or "/usr/bin/scontrol"
    proc = lifeline.Popen([exe, *args], stdout=-1, stderr=-1, text=True, env=dict(os.environ))
    try:
        out, err = proc.communicate(timeout=max(0.2, run.remaining_s() - 0.3))
    except Exception:  # noqa: BLE001 - timeout: kill it and report
        proc.kill()
        proc.wait()
        return 124, "scontrol timed out"
    return proc.returncode, (out if proc.returncode == 0 else err).strip()


def _run(run) -> None:
    job_id = run.job_id
    if not job_id:
        run.finish("no-job", "SLURM_JOB_ID not set: nothing to do", failure=False)
    job = _finished(run, job_id)
    if job is None:
        run.finish("no-record", "no finished record from the coordinator within the bound (a job without GPUs, "
                   "or the coordinator is unreachable): AdminComment unchanged", failure=False)
    ours = comment(job)
    run.extra.update(energy_j=round(job.energy_j, 1), gpu_s=round(job.gpu_s, 1), capped_s=round(job.capped_s, 1))
    rc, out = _scontrol(run, ["-o", "show", "job", job_id])
    existing = ""
    if rc == 0:
        m = re.search(r"(?:^|\s)AdminComment=(.*?)(?=\s\w+=|$)", out)
        existing = m.group(1) if m and m.group(1) != "(null)" else ""
    rc, out = _scontrol(run, ["update", f"JobId={job_id}", f"AdminComment={merged(existing, ours)}"])
    if rc != 0:
        run.finish("scontrol-failed", f"scontrol update exited {rc}: {out[:200]}", failure=True)
    run.finish("commented", f"AdminComment {ours}", failure=False)


def main(argv: list[str] | None = None) -> int:
    """Entry point (``python -m slurm.ctld``). Exits the process with 0 (see module doc)."""
    from slurm.hooks import Run

    env = dict(os.environ)
    env["CAPCTL_HOOK_TIMEOUT_S"] = str(_timeout_s(env))
    env["CAPCTL_ON_UNREACHABLE"] = "fail-open"  # an EpilogSlurmctld never fails a job or a node
    run = Run("epilog_slurmctld", env)

    def on_signal(signum, _frame):
        run.finish("signalled", f"terminated by signal {signum}", failure=True)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        _run(run)
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - never a traceback from a Slurm hook
        run.finish("internal-error", f"{type(err).__name__}: {err}", failure=True)
    return run.finish("internal-error", "hook ended without an outcome", failure=True)


if __name__ == "__main__":
    sys.exit(main())
