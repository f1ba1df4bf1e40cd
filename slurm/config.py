"""Configuration of the Slurm hooks: policy file plus environment overrides.

Sources, later wins:

1. defaults: fail-open, 5 s bound, socket ``/run/capctl/agent.sock``;
2. the policy file ``$CAPCTL_POLICY`` (default ``/etc/capctl/policy.yaml``): ``prolog.on_unreachable``,
   ``prolog.timeout_s``, ``agent.socket_path`` (``%n`` = node name);
3. environment (normally set in ``hooks.env``, see docs/slurm.md): ``CAPCTL_ON_UNREACHABLE``,
   ``CAPCTL_HOOK_TIMEOUT_S``, ``CAPCTL_AGENT_SOCKET`` (``%n`` allowed).

An unreadable or invalid policy file never stops a hook: the error is reported in
:attr:`HookConfig.problems` and the other sources apply.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field

DEFAULT_POLICY_PATH = "/etc/capctl/policy.yaml"
DEFAULT_SOCKET_PATH = "/run/capctl/agent.sock"
DEFAULT_TIMEOUT_S = 5.0
"""Default bound of one hook run in seconds (same as the policy schema's ``prolog.timeout_s``)."""
MAX_TIMEOUT_S = 300.0
"""Largest accepted bound in seconds (policy schema maximum)."""
DEFAULT_LOG_PATH = "/var/log/capctl/hooks.log"
ON_UNREACHABLE = ("fail-open", "fail-closed")


@dataclass
class HookConfig:
    """Resolved hook settings. ``timeout_s`` in seconds; ``socket_path`` already has ``%n`` expanded."""

    node: str
    socket_path: str = DEFAULT_SOCKET_PATH
    timeout_s: float = DEFAULT_TIMEOUT_S
    on_unreachable: str = "fail-open"
    policy_path: str | None = None
    log_path: str = DEFAULT_LOG_PATH
    problems: list[str] = field(default_factory=list)

    @property
    def fail_open(self) -> bool:
        return self.on_unreachable != "fail-closed"


def expand_node(template: str, node: str) -> str:
    """Replace ``%n`` by ``node`` and ``%%`` by ``%`` in ``template`` (as slurm.conf and the policy)."""
    out, i = [], 0
    while i < len(template):
        if template[i] == "%" and i + 1 < len(template) and template[i + 1] in "n%":
            out.append(node if template[i + 1] == "n" else "%")
            i += 2
        else:
            out.append(template[i])
            i += 1
    return "".join(out)


def node_name(env: dict[str, str]) -> str:
    """Slurm node name: ``SLURMD_NODENAME`` (set by slurmd, also with several slurmd per host), else
    the short host name."""
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def env_timeout_s(env: dict[str, str]) -> float | None:
    """``CAPCTL_HOOK_TIMEOUT_S`` as a float in (0, MAX_TIMEOUT_S], or None if unset/invalid."""
    raw = env.get("CAPCTL_HOOK_TIMEOUT_S")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        return None  # refused, not clamped: the prolog script's own bound refuses it too
    return value


OUTER_MARGIN_S = 2.0
"""Seconds the prolog script's outer ``timeout`` adds to the hook's bound (slurm/prolog)."""


def _fit_outer_bound(cfg: HookConfig, env: dict[str, str]) -> None:
    """Keep ``cfg.timeout_s`` inside the prolog script's outer bound ``CAPCTL_HOOK_BOUND_S`` (s).

    The script kills the hook at that bound, which comes from ``CAPCTL_HOOK_TIMEOUT_S`` only (a shell
    script does not read the YAML policy). A longer policy ``prolog.timeout_s`` would be cut there
    and end as "hook did not run" (fail-open whatever the policy says), so the hook's own bound is
    lowered to fit, and the mismatch is reported in :attr:`HookConfig.problems`.
    """
    try:
        outer_s = float(env.get("CAPCTL_HOOK_BOUND_S", ""))
    except ValueError:
        return
    fit_s = outer_s - OUTER_MARGIN_S
    if math.isfinite(fit_s) and fit_s > 0 and cfg.timeout_s > fit_s:
        cfg.problems.append(f"hook bound {cfg.timeout_s:g} s (policy prolog.timeout_s) does not fit the prolog "
                            f"script's outer bound of {outer_s:g} s: using {fit_s:g} s; set "
                            f"CAPCTL_HOOK_TIMEOUT_S={cfg.timeout_s:g} in hooks.env to match the policy")
        cfg.timeout_s = fit_s


def load_config(env: dict[str, str] | None = None) -> HookConfig:
    """Resolve the hook configuration from the policy file and ``env`` (default ``os.environ``)."""
    env = dict(os.environ if env is None else env)
    node = node_name(env)
    cfg = HookConfig(node=node, log_path=env.get("CAPCTL_HOOK_LOG") or DEFAULT_LOG_PATH)
    socket_template = DEFAULT_SOCKET_PATH

    policy_path = env.get("CAPCTL_POLICY") or DEFAULT_POLICY_PATH
    if os.path.exists(policy_path) or env.get("CAPCTL_POLICY"):
        cfg.policy_path = policy_path
        try:
            from capctl.policy import load_policy

            policy = load_policy(policy_path)
            cfg.on_unreachable = policy.prolog.on_unreachable
            cfg.timeout_s = float(policy.prolog.timeout_s)
            socket_template = policy.agent.socket_path
        except Exception as err:  # noqa: BLE001 - a bad policy must never stop a hook
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            cfg.problems.append(f"policy {policy_path} not used: {first}")

    if env.get("CAPCTL_HOOKS_ENV_PROBLEM"):  # the wrapper could not read its KEY=VALUE file
        cfg.problems.append(env["CAPCTL_HOOKS_ENV_PROBLEM"][:300])
    value = env.get("CAPCTL_ON_UNREACHABLE")
    if value:
        if value in ON_UNREACHABLE:
            cfg.on_unreachable = value
        else:
            cfg.problems.append(f"CAPCTL_ON_UNREACHABLE={value!r} ignored: allowed {', '.join(ON_UNREACHABLE)}")
    timeout = env_timeout_s(env)
    if timeout is not None:
        cfg.timeout_s = timeout
    elif env.get("CAPCTL_HOOK_TIMEOUT_S"):
        cfg.problems.append(f"CAPCTL_HOOK_TIMEOUT_S={env['CAPCTL_HOOK_TIMEOUT_S']!r} ignored: "
                            f"a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    _fit_outer_bound(cfg, env)
    cfg.socket_path = agent_socket_path(env, socket_template)
    return cfg


def agent_socket_path(env: dict[str, str], template: str = DEFAULT_SOCKET_PATH) -> str:
    """The agent's socket: ``$CAPCTL_AGENT_SOCKET``, else ``template`` (the policy's
    ``agent.socket_path``, or the default), ``%n`` expanded to this node's name."""
    return expand_node(env.get("CAPCTL_AGENT_SOCKET") or template, node_name(env))
