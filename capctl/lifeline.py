"""Child processes that die with their parent, started without running code between fork and exec.

Why not a pre-exec callback + ``prctl(PR_SET_PDEATHSIG)``: a callback run in the child between fork
and exec makes :mod:`subprocess` use a real ``fork()``, whose ``pthread_atfork`` handlers gRPC
installs; in a process with gRPC threads they can deadlock (seen: pytest blocked in ``fork`` ->
cygrpc -> futex). Without one, CPython starts the child with ``vfork()`` + ``exec``, which runs no
fork handlers (nor does ``posix_spawn``). And
``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, so a child spawned from a
worker thread would be killed when that thread ends.

The lifeline instead is a pipe: the parent keeps its write end (close-on-exec, so no exec'd child
inherits it; capctl never forks without exec), the child gets the read end through ``pass_fds``
and ``$CAPCTL_LIFELINE_FD`` = ``FD:PARENT_PID``. A grandchild that inherited the variable but not
the pipe ignores it (its parent is another process, or the descriptor is not a pipe). The kernel closes the write end when the parent *process* dies, for any
reason including SIGKILL; the child's watcher thread then reads EOF and sends itself SIGTERM, so
daemons stop cleanly (sockets removed, state saved). Daemons call :func:`watch_parent` first thing
in ``main``; a daemon started any other way (systemd) has no lifeline and is unaffected.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import threading

LIFELINE_ENV = "CAPCTL_LIFELINE_FD"
"""Environment variable ``FD:PARENT_PID``: the read end of the lifeline pipe and who holds the other."""


class Popen(subprocess.Popen):
    """:class:`subprocess.Popen` whose child (a capctl daemon) dies with this process.

    Same arguments as :class:`subprocess.Popen` plus ``die_with_parent`` (default True); never give
    it a pre-exec callback (it forks; a test scans the sources for one). The lifeline's write end is
    closed once the child has been reaped (:meth:`wait` / :meth:`poll`), or when this process exits.
    """

    def __init__(self, args, *, die_with_parent: bool = True, env=None, pass_fds=(), **kwargs):
        self._lifeline_w: int | None = None
        if not die_with_parent:
            super().__init__(args, env=env, pass_fds=pass_fds, **kwargs)
            return
        r, w = os.pipe()  # both ends non-inheritable (PEP 446); pass_fds hands r to this child only
        env = {**(os.environ if env is None else env), LIFELINE_ENV: f"{r}:{os.getpid()}"}
        try:
            super().__init__(args, env=env, pass_fds=(*pass_fds, r), **kwargs)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._lifeline_w = w

    def _release(self) -> None:
        w, self._lifeline_w = self._lifeline_w, None
        if w is not None:
            os.close(w)

    def poll(self):
        rc = super().poll()
        if rc is not None:
            self._release()
        return rc

    def wait(self, timeout=None):
        rc = super().wait(timeout)
        self._release()
        return rc

    def __del__(self, *args, **kwargs):
        # dropped without a wait: release the write end once the child is gone (a live child keeps
        # its lifeline for as long as this process runs)
        if getattr(self, "_lifeline_w", None) is not None and getattr(self, "returncode", 0) is None:
            try:
                self.poll()
            except OSError:
                pass
        super().__del__(*args, **kwargs)


KILL_AFTER_S = 20.0
"""After ``signum``, SIGKILL follows if the process still runs this long (a clean stop takes < 5 s)."""


def watch_parent(signum: int = signal.SIGTERM) -> bool:
    """If this process was started with a lifeline, send ourselves ``signum`` when the parent dies
    (and SIGKILL :data:`KILL_AFTER_S` later if we are still there).

    Removes ``$CAPCTL_LIFELINE_FD`` from the environment (our own children do not inherit it).
    Returns True when a lifeline is watched. A malformed value, a parent other than the one named,
    or a descriptor that is not a pipe is ignored (no lifeline).
    """
    value = os.environ.pop(LIFELINE_ENV, None)
    if not value:
        return False
    try:
        fd_text, _, pid_text = value.partition(":")
        fd, parent = int(fd_text), int(pid_text)
        if parent != os.getppid() or not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False  # inherited from further up, not our parent's pipe
        os.set_inheritable(fd, False)
    except (ValueError, OSError):
        return False

    def watch() -> None:
        try:
            while os.read(fd, 64):  # the parent never writes: only EOF (or an error) returns
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signum)
        threading.Event().wait(KILL_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="capctl-lifeline", daemon=True).start()
    return True
