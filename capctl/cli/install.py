"""``capctl install WHAT DIR``: copy the files shipped in the installed package to DIR.

=============  =================================================================================
WHAT           writes into DIR
=============  =================================================================================
hooks          ``prolog``, ``epilog``, ``healthcheck``, ``epilog_slurmctld`` (mode 0755; slurm.conf
               ``Prolog=DIR/prolog``, ``EpilogSlurmctld=DIR/epilog_slurmctld``),
               each running this installation's interpreter unless hooks.env sets CAPCTL_PYTHON
units          ``capctl-agent.service``, ``capctl-coordinator.service`` with this installation's
               bin directory in ``ExecStart=`` (one prefix; e.g. DIR = /etc/systemd/system)
env            ``agent.env``, ``coordinator.env``: the units' ``EnvironmentFile=`` examples
               (DIR = /etc/capctl; edited ones are kept, see below)
examples       the example policies (``*.yaml``) and, under ``clusters/``, the example clusters of
               ``capctl sim``
completion     bash completion of every capctl command (``--print-completion bash``)
man            man pages (section 1) of every capctl command (``--print-man``)
=============  =================================================================================

Files that exist are replaced (``--no-clobber`` keeps them), except configuration files (``env``):
an edited one is kept and the shipped version is written beside it as ``NAME.new`` (as dpkg does
with conffiles); ``--force`` replaces it. Prints one line per file. Exit 0; 1 when DIR cannot be
written (named with the reason).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from capctl.errors import UserInputError

UNIT_PREFIX = "/opt/capctl/bin"
"""The bin directory the shipped units name (docs/deploy.md: ``python3 -m venv /opt/capctl``);
replaced by the installing environment's own one."""

COMMANDS = ("capctl", "capctl-agent", "capctl-coordinator", "capctl-simgpu")
"""Console scripts of pyproject.toml whose completion and man page ``install`` writes."""

KINDS = ("hooks", "units", "env", "examples", "completion", "man")
CONFIG_KINDS = ("env",)
"""Kinds whose files an admin edits: never replaced when they differ, unless ``--force``."""


def register(subparsers) -> None:
    """Add ``install`` to ``subparsers``."""
    p = subparsers.add_parser("install", help="copy shipped hooks, systemd units, examples, completion or man pages to DIR")
    p.add_argument("what", choices=KINDS, help="which files")
    p.add_argument("dir", metavar="DIR", help="destination directory (created)")
    p.add_argument("--no-clobber", action="store_true", help="keep files that exist")
    p.add_argument("--force", action="store_true", help="replace edited configuration files (env) too")
    p.set_defaults(func=run)


def bin_dir() -> Path:
    """Directory of this installation's console scripts (next to its interpreter)."""
    return Path(sys.executable).parent


def _write(dest: Path, data: bytes, mode: int, no_clobber: bool, config: bool = False, force: bool = False) -> None:
    """Write ``dest``; a configuration file (``config``) that was edited is kept unless ``force``
    and the shipped version goes to ``NAME.new``, which a later plain write removes."""
    if no_clobber and dest.exists():
        print(f"kept {dest}")
        return
    new = dest.with_name(dest.name + ".new")
    if config and not force and dest.exists() and dest.read_bytes() != data:
        _replace(new, data, mode)
        print(f"kept {dest} (edited); the shipped version is in {new} (--force replaces)")
        return
    _replace(dest, data, mode)
    print(f"wrote {dest}")
    if config and new.exists():  # the file now is the shipped one: its waiting copy is stale
        new.unlink()
        print(f"removed {new}")


def _replace(dest: Path, data: bytes, mode: int) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, dest)


def _hooks() -> list[tuple[str, bytes, int]]:
    from capctl.resources import HOOKS, hook_path

    python = str(bin_dir() / "python")
    out = []
    for name in HOOKS:
        text = hook_path(name).read_text()
        marker = 'if [ -z "${CAPCTL_PYTHON:-}" ]; then'
        if marker in text:  # installed copy: this environment's interpreter unless hooks.env names one
            text = text.replace(marker, f': "${{CAPCTL_PYTHON:={python}}}"  # capctl install hooks\n{marker}', 1)
        out.append((name, text.encode(), 0o755))
    return out


def _share(name: str, pattern: str, rewrite, rename=lambda n: n) -> list[tuple[str, bytes, int]]:
    from capctl.resources import share_dir

    root = share_dir(name)
    return [(rename(str(f.relative_to(root))), rewrite(f.read_text()).encode(), 0o644)
            for f in sorted(root.glob(pattern))]


def _generated(option: list[str], suffix: str) -> list[tuple[str, bytes, int]]:
    from capctl import lifeline

    out = []
    for cmd in COMMANDS:
        exe = bin_dir() / cmd
        if not exe.exists():
            continue
        proc = lifeline.Popen([str(exe), *option], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = proc.communicate(timeout=60)
        if proc.returncode != 0:
            print(f"capctl install: skipped {cmd}: {stderr.decode(errors='replace').strip().splitlines()[-1:]}",
                  file=sys.stderr)
            continue
        out.append((f"{cmd}{suffix}", stdout, 0o644))
    return out


def files(what: str) -> list[tuple[str, bytes, int]]:
    """The files of ``what`` (one of :data:`KINDS`): [(relative path, content, mode)]."""
    if what == "hooks":
        return _hooks()
    if what == "units":
        prefix = str(bin_dir())
        return _share("systemd", "*.service", lambda t: t.replace(UNIT_PREFIX, prefix))
    if what == "env":
        return _share("systemd", "*.env", lambda t: t, lambda n: n.removeprefix("capctl-"))
    if what == "examples":
        return (_share("policies", "*.yaml", lambda t: t)
                + _share("clusters", "*.yaml", lambda t: t, lambda n: f"clusters/{n}"))
    if what == "completion":
        return _generated(["--print-completion", "bash"], "")
    return _generated(["--print-man"], ".1")


def run(args: argparse.Namespace) -> int:
    """Write the files of ``args.what`` into ``args.dir``.

    Raises:
        UserInputError: DIR is empty (an unset variable quoted: it wrote into the current directory,
            found by a review) or cannot be created or written (the path and the reason).
    """
    if not args.dir.strip():
        raise UserInputError(f"install {args.what} {args.dir!r}: DIR is empty; give the directory to write "
                             f"into (\".\" for the current one)")
    dest = Path(args.dir)
    try:
        for rel, data, mode in files(args.what):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _write(target, data, mode, args.no_clobber, config=args.what in CONFIG_KINDS, force=args.force)
    except OSError as exc:
        raise UserInputError(f"install {args.what} {dest}: {exc.strerror or exc} ({exc.filename or dest})") from None
    return 0
