"""SIGHUP for the node agent: re-read the ``--policy`` file (systemd ``ExecReload=``).

What the agent takes from the policy changes in place: the start cap (``start_cap_w``) and the
policy's failsafe cap (``failsafe.safe_cap_w``). An unreadable or invalid file is logged with its
``file:line:col`` errors and the last good values stay. Without ``--policy`` there is nothing to
reload (logged). systemd is told ``RELOADING=1`` then ``READY=1`` (sd_notify).
"""

from __future__ import annotations

import logging

from capctl import sdnotify
from capctl.errors import CapctlError

log = logging.getLogger("capctl.agent")


def reload_policy(agent, path: str | None, counter=None) -> bool:
    """Apply ``path``'s start cap and failsafe cap to ``agent`` (W); returns True when applied.

    ``counter``: optional ``callable(result)`` told "ok" or "error". Never raises.
    """
    from capctl.policy import load_policy

    if not path:
        log.warning("SIGHUP: no --policy file; nothing to reload")
        return False
    sdnotify.reloading()
    try:
        policy = load_policy(path)
    except (CapctlError, OSError) as err:
        log.error("SIGHUP: policy %s rejected; the last good policy stays:\n%s", path, err)
        ok = False
    else:
        with agent.lock:
            agent.start_cap_w = float(policy.start_cap_w)
            agent.policy_safe_cap_w = policy.failsafe.safe_cap_w
        log.info("SIGHUP: policy %s loaded: start cap %g W, safe cap %s", path, policy.start_cap_w,
                 "none" if policy.failsafe.safe_cap_w is None else f"{policy.failsafe.safe_cap_w:g} W")
        ok = True
    if counter is not None:
        counter("ok" if ok else "error")
    sdnotify.ready(f"policy {'reloaded' if ok else 'reload FAILED, last good kept'}")
    return ok
