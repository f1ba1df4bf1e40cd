"""SIGHUP for the coordinator: reload the policy file (systemd ``ExecReload=kill -HUP $MAINPID``).

The coordinator re-reads the file it runs (:meth:`coordinator.loop.Coordinator.reload_policy`
with no path): a valid policy replaces the current one, an invalid one is logged with its
``file:line:col`` errors and the last good policy stays. systemd is told ``RELOADING=1`` then
``READY=1`` (sd_notify, for ``Type=notify``), and ``capctl_policy_reloads_total{result}`` counts
the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from capctl import sdnotify

log = logging.getLogger("capctl.coordinator")
SHOWN_ERRORS = 5
"""Errors of a refused policy named in the one log line (all of them: ``capctl policy validate``)."""


def refusal_text(reply) -> str:
    """One line for a refused ``ReloadPolicyReply``: its message and the first :data:`SHOWN_ERRORS`
    of its ``file:line:col`` errors (the lines ``capctl policy reload`` prints), with how many more."""
    errors = list(reply.errors)
    more = f" (and {len(errors) - SHOWN_ERRORS} more: capctl policy validate)" if len(errors) > SHOWN_ERRORS else ""
    return f"{reply.message}: {'; '.join(errors[:SHOWN_ERRORS])}{more}"


async def reload_on_hangup(coord, counter=None) -> bool:
    """Reload ``coord``'s policy file; returns True when the new policy is in force.

    ``counter``: optional ``callable(result: str)`` told ``"ok"`` or ``"error"``. Never raises (a
    bad file must not stop the daemon).
    """
    sdnotify.reloading()
    try:
        reply = await coord.reload_policy("")
    except Exception as exc:  # noqa: BLE001 (the daemon keeps running on its last good policy)
        log.error("SIGHUP: policy reload failed (%s: %s); the last good policy stays", type(exc).__name__, exc)
        ok = False
    else:
        ok = bool(reply.ok)
        if ok:
            log.info("SIGHUP: %s", reply.message)
        else:
            log.error("SIGHUP: %s", refusal_text(reply))  # one log line
    if counter is not None:
        counter("ok" if ok else "error")
    sdnotify.ready(f"policy {'reloaded' if ok else 'reload FAILED, last good kept'}")
    return ok


def install(loop: asyncio.AbstractEventLoop, coord, counter=None) -> None:
    """Handle SIGHUP on ``loop`` with :func:`reload_on_hangup` (one reload at a time; a SIGHUP
    during a reload is folded into it)."""
    busy = {"task": None}

    def on_hup() -> None:
        task = busy["task"]
        if task is not None and not task.done():
            return
        busy["task"] = loop.create_task(reload_on_hangup(coord, counter))

    loop.add_signal_handler(signal.SIGHUP, on_hup)
