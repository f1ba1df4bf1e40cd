"""``capctl policy validate FILE [--json]`` and ``capctl policy reload [--coordinator ADDR] [FILE]``.

validate: exit 0 when the policy is valid (warnings, if any, on stderr), else one
``file:line:col: message`` line per error on stdout and exit 1. ``--json`` prints one object
``{"file", "ok", "errors": [...], "warnings": [...]}`` instead.

reload: asks the coordinator (``Admin.ReloadPolicy``) to load FILE (made absolute; the path is read
by the coordinator on its host) or, without FILE, to re-read the file it was started with. The
coordinator keeps its last good policy when the new one is invalid; its errors are printed and the
exit status is 1. Unreachable coordinator: exit 3; no admin identity: exit 4 (see capctl.errors).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(subparsers) -> None:
    """Add the ``policy`` command group (``validate``, ``reload``) to ``subparsers``."""
    parser = subparsers.add_parser("policy", help="validate or reload the policy file")
    sub = parser.add_subparsers(dest="policy_command", metavar="ACTION")
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON output (docs/cli.md)")
    parser.set_defaults(func=lambda args: _need_action(parser, args))

    validate = sub.add_parser("validate", help="check a policy file; exit 0 if valid, else print file:line:col errors and exit 1")
    validate.add_argument("file", metavar="FILE", help="policy YAML file")
    validate.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object (file, ok, errors, warnings)")
    validate.add_argument(
        "--device-min-cap",
        metavar="MODEL=WATTS",
        action="append",
        default=[],
        help="minimum cap of a GPU model in watts, overriding the built-in table (repeatable)",
    )
    validate.set_defaults(func=run_validate)

    reload = sub.add_parser("reload", help="make the coordinator load a policy (keeps the last good one on error)")
    reload.add_argument("file", metavar="FILE", nargs="?", help="policy file on the coordinator host (default: its current file)")
    reload.add_argument("--coordinator", metavar="ADDR", default=argparse.SUPPRESS,
                        help="coordinator address (unix:/path or host:port); also accepted before the subcommand")
    reload.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the reply as JSON")
    from capctl.cli.rpc import add_connection_arguments

    add_connection_arguments(reload, suppress=True)
    reload.set_defaults(func=run_reload)


def _need_action(parser, args) -> int:
    from capctl.cli.main import need_action

    return need_action(parser, args, "ACTION")


def _device_map(items: list[str]) -> dict[str, float]:
    from capctl.errors import UserInputError

    out: dict[str, float] = {}
    for item in items:
        model, sep, watts = item.partition("=")
        try:
            value = float(watts)
        except ValueError:
            value = float("nan")
        if not sep or not model or not (value > 0 and value < 1e6):
            raise UserInputError(f"--device-min-cap: {item!r} is not allowed; expected MODEL=WATTS, e.g. H100-SXM=200")
        out[model] = value
    return out


def run_validate(args: argparse.Namespace) -> int:
    """Validate ``args.file``; print the result; return 0 (valid) or 1 (invalid).

    Output: ``FILE: ok`` on stdout when valid; findings inside a file that was read are compiler-style
    ``file:line:col: message`` lines on stderr (errors, then warnings, incl. a coordinator.admin_group
    that does not exist on this host).

    Raises:
        UserInputError: (without --json) the file cannot be read at all: one ``capctl: FILE: ...`` line
            on stderr like every other user error (docs/cli.md).
    """
    from capctl.errors import UserInputError
    from capctl.policy import check_file

    device_min = _device_map(args.device_min_cap)
    report = check_file(args.file, device_min_cap_w=device_min)
    if not args.json and not report.ok and not os.path.isfile(args.file):
        raise UserInputError(report.errors[0] if report.errors else f"{args.file}: cannot read the policy file")
    warnings = (list(report.warnings) + _host_warnings(args.file, report.policy)
                + _device_min_warnings(args.file, report.policy, device_min))
    if args.json:
        out = {"file": args.file, "errors": report.errors, "warnings": warnings}
        if not report.ok:  # the error contract of every --json command (capctl.errors.run_for_person)
            _json_failure(_first_error(report.errors, f"{args.file}: not a valid policy"), out)
        print(json.dumps({"file": args.file, "ok": True, "errors": [], "warnings": warnings}, indent=2))
        return 0
    for line in report.errors + warnings:
        print(line, file=sys.stderr)
    if report.ok:
        print(f"{args.file}: ok")
        return 0
    return 1


def _json_failure(error: str, fields: dict):
    """Raise the ``UserInputError`` whose ``--json`` object carries ``fields`` (one line on stdout,
    ``{"ok": false, ..., "error", "exit_code": 1}``, and the error line on stderr)."""
    from capctl.errors import UserInputError

    err = UserInputError(error)
    err.json_fields = fields
    raise err


def _first_error(errors: list[str], fallback: str) -> str:
    """The ``error`` of a failed ``--json`` reply: its first error line (``file:line:col: message``),
    with a count of the others, or ``fallback`` when there are none."""
    if not errors:
        return fallback
    more = len(errors) - 1
    return errors[0] + (f" (and {more} more error{'s' if more > 1 else ''}; see \"errors\")" if more else "")


def _device_min_warnings(path: str, policy, device_min: dict[str, float]) -> list[str]:
    """Warnings on ``--device-min-cap`` values (W): a model no domain of ``policy`` uses (it was
    taken without a word: a typo checks nothing), a minimum above the model's known maximum cap
    (:data:`capctl.policy.devices.KNOWN_DEVICE_LIMITS_W`; found by a review)."""
    from capctl.policy.devices import device_limits_w

    out = []
    used = {d.gpu_model for d in policy.domains.walk() if d.gpu_model} if policy is not None else None
    norm = lambda m: "".join(ch for ch in m.upper() if ch.isalnum())  # noqa: E731 (devices' matching)
    for model, watts in device_min.items():
        if used is not None and norm(model) not in {norm(u) for u in used}:
            out.append(f"{path}: warning: --device-min-cap {model}={watts:g}: no domain of the policy uses GPU model "
                       f"{model!r} (it uses {', '.join(sorted(used)) or 'none'})")
        high = device_limits_w(model)[1]
        if high is not None and watts > high:
            out.append(f"{path}: warning: --device-min-cap {model}={watts:g}: above the maximum cap {high:g} W of "
                       f"{model}: every GPU of it would be held at its maximum")
    return out


def _host_warnings(path: str, policy) -> list[str]:
    """Warnings that depend on this host, not on the file: a ``coordinator.admin_group`` that does not
    exist here (a coordinator started with it logs an error and leaves its admin socket root-only)."""
    import grp

    group = policy.coordinator.admin_group if policy is not None else None
    if not group:
        return []
    try:
        grp.getgrnam(group)
    except KeyError:
        return [f"{_where(path, ('coordinator', 'admin_group'))}: warning: coordinator.admin_group: group {group!r} "
                "does not exist on this host; create it (groupadd) where the coordinator runs, or the admin socket "
                "stays root-only"]
    return []


def _where(path: str, key: tuple) -> str:
    """``path:line:col`` of the value of ``key`` in the policy file ``path``, as the other warnings
    name theirs (this one had the file only: found by a try-out); ``path`` when it cannot be read."""
    from capctl.policy.yamlpos import load_with_positions

    try:
        with open(path, encoding="utf-8") as f:
            _data, pos = load_with_positions(f.read())
        line, col = pos.value(key)
    except Exception:  # noqa: BLE001 (the file was read and checked already: the position is a nicety)
        return path
    return f"{path}:{line}:{col}"


def run_reload(args: argparse.Namespace) -> int:
    """Call ``Admin.ReloadPolicy`` on the coordinator; return 0 when it took the policy, else 1."""
    from capctl.cli.rpc import admin_client

    path = os.path.abspath(args.file) if args.file else ""
    with admin_client(args.coordinator) as client:
        reply = client.reload_policy(path)
    if args.json:
        out = {"errors": list(reply.errors), "message": reply.message, "path": path}
        if not reply.ok:
            _json_failure(_first_error(list(reply.errors), reply.message or "policy not reloaded"), out)
        print(json.dumps({"ok": True, **out}, indent=2))
        return 0
    if reply.ok:
        print(reply.message or f"policy reloaded{': ' + path if path else ''}")
        return 0
    from capctl.security.limits import printable

    # one line (docs/cli.md), control characters of a path or a message escaped (a path holding a
    # newline was printed as two lines; found by a try-out): the first error, the others counted
    errors = list(reply.errors)
    why = errors[0] if errors else (reply.message or "refused")
    more = len(errors) - 1
    others = (f" (and {more} more error{'s' if more > 1 else ''}: capctl policy validate "
              f"{path or 'FILE'})") if more > 0 else ""
    print(printable(f"capctl: policy not reloaded: {why}{others}; the coordinator keeps its last good policy"),
          file=sys.stderr)
    return 1
