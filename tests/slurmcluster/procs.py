"""Start and stop the daemons of the test Slurm cluster, recorded by pid in the run directory.

Every process started here gets the environment marker ``CAPCTL_SLURMCLUSTER=<run dir>``; processes
forked below it (slurmstepd, job tasks, hook runs) inherit it. :func:`marked_pids` finds exactly
those processes (by reading ``/proc/<pid>/environ``), so ``down`` can stop everything this cluster
started — and nothing else — even after the process that ran ``up`` has exited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

MARKER = "CAPCTL_SLURMCLUSTER"
"""Environment variable whose value is the run directory of the cluster that started a process."""


def _read_pids(run_dir: Path) -> dict[str, dict]:
    path = run_dir / "pids.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _write_pids(run_dir: Path, pids: dict[str, dict]) -> None:
    tmp = run_dir / "pids.json.tmp"
    tmp.write_text(json.dumps(pids, indent=1, sort_keys=True))
    os.replace(tmp, run_dir / "pids.json")


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks): identifies a pid incarnation."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def alive(pid: int, start_time: str | None = None) -> bool:
    """True when ``pid`` runs (and, if given, is the same incarnation) and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return start_time is None or fields[19] == start_time


def start(run_dir: Path, name: str, argv: list[str], env: dict[str, str], log: Path) -> int:
    """Start ``argv`` in its own session with stdout/stderr to ``log``; record it as ``name``."""
    env = dict(env)
    env[MARKER] = str(run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )
    pids = _read_pids(run_dir)
    pids[name] = {"pid": proc.pid, "start": _start_time(proc.pid), "argv": argv}
    _write_pids(run_dir, pids)
    return proc.pid


def recorded(run_dir: Path) -> dict[str, dict]:
    """Recorded processes ``{name: {"pid", "start", "argv"}}`` (alive or not)."""
    return _read_pids(run_dir)


def running(run_dir: Path, name: str) -> bool:
    """True when the process recorded as ``name`` still runs."""
    rec = _read_pids(run_dir).get(name)
    return bool(rec) and alive(rec["pid"], rec.get("start"))


def stop(run_dir: Path, name: str, timeout_s: float = 5.0, sig: int = signal.SIGTERM) -> None:
    """Stop the process recorded as ``name`` (``sig``, then SIGKILL after ``timeout_s``)."""
    pids = _read_pids(run_dir)
    rec = pids.pop(name, None)
    if rec:
        _terminate([(rec["pid"], rec.get("start"))], timeout_s, sig)
    _write_pids(run_dir, pids)


def _terminate(targets: list[tuple[int, str | None]], timeout_s: float, sig: int = signal.SIGTERM) -> None:
    live = [(p, s) for p, s in targets if alive(p, s)]
    for pid, _ in live:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while live and time.monotonic() < deadline:
        live = [(p, s) for p, s in live if alive(p, s)]
        if live:
            time.sleep(0.05)
    for pid, _ in live:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 2.0
    while live and time.monotonic() < deadline:
        live = [(p, s) for p, s in live if alive(p, s)]
        if live:
            time.sleep(0.02)


def _other_environs():
    """(pid, environment bytes) of every readable process but this one."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            yield int(entry), Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue


def marked_pids(run_dir: Path) -> list[int]:
    """Pids of live processes whose environment carries this cluster's marker."""
    needle = f"{MARKER}={run_dir}\0".encode()
    return [pid for pid, environ in _other_environs() if needle in environ + b"\0"]


def stop_all(run_dir: Path, order: list[str], timeout_s: float = 5.0) -> None:
    """Stop recorded processes in ``order`` (then any others), then every marked leftover."""
    pids = _read_pids(run_dir)
    names = [n for n in order if n in pids] + [n for n in pids if n not in order]
    for name in names:
        stop(run_dir, name, timeout_s)
    leftovers = [(pid, _start_time(pid)) for pid in marked_pids(run_dir)]
    if leftovers:
        _terminate(leftovers, timeout_s)


def send_signal(run_dir: Path, name: str, sig: int) -> int:
    """Send ``sig`` to the process recorded as ``name``; returns its pid.

    Raises:
        ProcessLookupError: no such recorded process running.
    """
    rec = _read_pids(run_dir).get(name)
    if not rec or not alive(rec["pid"], rec.get("start")):
        raise ProcessLookupError(f"{name} is not running")
    os.kill(rec["pid"], sig)
    return rec["pid"]


def stop_orphans(timeout_s: float = 5.0) -> list[int]:
    """Stop marked processes whose cluster run directory no longer exists (a killed test session
    whose temporary directory was since removed); returns their pids. Live clusters are untouched."""
    prefix = f"{MARKER}=".encode()
    orphans = []
    for pid, environ in _other_environs():
        for var in environ.split(b"\0"):
            if var.startswith(prefix):
                run_dir = var[len(prefix):].decode(errors="replace")
                if run_dir and not Path(run_dir).exists():
                    orphans.append(pid)
                break
    if orphans:
        _terminate([(pid, _start_time(pid)) for pid in orphans], timeout_s)
    return orphans
