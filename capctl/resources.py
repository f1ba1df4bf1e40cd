"""Files shipped inside the installed package, found through :mod:`importlib.resources`.

A wheel carries, under ``capctl/share/`` (copied there by ``setup.py`` while building, from the
source paths of :data:`SOURCES`):

=====================  ==========================================================  ==================
share path             what                                                        source in the repo
=====================  ==========================================================  ==================
``systemd/``           unit files and their env files (``capctl install units``)  ``deploy/systemd``
``policies/``          example policies                                            ``examples/policies``
``clusters/``          example clusters for ``capctl sim``                         ``examples/clusters``
``grafana/``           the Grafana dashboard                                       ``deploy/grafana``
``schema/``            ``status-schema.json`` (``capctl status --json``)            ``docs``
=====================  ==========================================================  ==================

The Slurm hook scripts are package data of :mod:`slurm` (``prolog``, ``epilog``, ``healthcheck``,
``epilog_slurmctld``);
the policy's JSON Schema is ``capctl/policy/schema.json``.

In a source checkout (an editable install) ``capctl/share/`` does not exist and :func:`share_dir`
answers the source directory of :data:`SOURCES` instead; nothing else is ever located relative to
the checkout.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "systemd": ("deploy/systemd", ("*.service", "*.env")),
    "policies": ("examples/policies", ("*.yaml",)),
    "clusters": ("examples/clusters", ("*.yaml",)),
    "grafana": ("deploy/grafana", ("*.json",)),
    "schema": ("docs", ("status-schema.json",)),
}
"""share path -> (source directory relative to the repository root, glob patterns copied)."""

HOOKS = ("prolog", "epilog", "healthcheck", "epilog_slurmctld")
"""The Slurm hook scripts, package data of :mod:`slurm`."""


def share_dir(name: str) -> Path:
    """Directory of the shipped files ``name`` (a key of :data:`SOURCES`).

    Raises:
        KeyError: ``name`` is not a key of :data:`SOURCES`.
        FileNotFoundError: neither the installed copy nor a checkout's source directory exists.
    """
    source = SOURCES[name][0]
    installed = Path(str(importlib.resources.files("capctl"))) / "share" / name
    if installed.is_dir():
        return installed
    checkout = Path(__file__).resolve().parent.parent / source  # editable install of a checkout
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"capctl's shipped files {name!r} are missing from {installed} (reinstall capctl)")


def hook_path(name: str) -> Path:
    """Path of the Slurm hook script ``name`` (one of :data:`HOOKS`) in the installed :mod:`slurm`.

    Raises:
        KeyError: not a hook name.
    """
    if name not in HOOKS:
        raise KeyError(name)
    return Path(str(importlib.resources.files("slurm"))) / name
