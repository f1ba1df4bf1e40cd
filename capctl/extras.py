"""Which optional part of capctl (a pip extra) provides which third-party module.

capctl installs by role (pyproject.toml): the core (protocol, policy) always; ``capctl[agent]`` on
compute nodes, ``capctl[coordinator]`` on the head node, ``capctl[sim]`` for the simulators and the
demo, ``capctl[ha]`` beside ``capctl[coordinator]`` for coordinators in high availability on etcd. A command that needs a module of an extra that is not installed fails with one line naming
that extra (:func:`missing_extra_message`, called by :func:`capctl.errors.run_for_person`) instead
of an ImportError traceback.
"""

from __future__ import annotations

EXTRAS_OF_MODULE: dict[str, tuple[str, ...]] = {
    "pynvml": ("agent",),
    "numpy": ("coordinator",),
    "scipy": ("coordinator",),
    "cvxpy": ("coordinator",),
    "clarabel": ("coordinator",),
    "prometheus_client": ("coordinator", "agent"),
    "grpc_health": ("coordinator",),
    "grpc_reflection": ("coordinator",),
    "matplotlib": ("sim",),
    "etcd3gw": ("ha",),  # coordinators in high availability on etcd (docs/ha.md)
    "requests": ("ha",),  # its HTTP session, configured by coordinator.etcdconn
}
"""Top-level module name -> the extras whose requirements provide it (pyproject.toml); the first is
the one a missing-module message names."""


def extras_of(module: str | None) -> tuple[str, ...]:
    """The extras that provide ``module`` (a dotted name; its top level counts); () when none."""
    if not module:
        return ()
    return EXTRAS_OF_MODULE.get(module.partition(".")[0], ())


def extra_for(module: str | None) -> str | None:
    """The extra a missing ``module`` is reported under (first of :func:`extras_of`), or None."""
    found = extras_of(module)
    return found[0] if found else None


def missing_extra_message(prog: str, exc: ModuleNotFoundError, extra: str | None = None) -> str | None:
    """One line for a person when ``exc`` is a module of one of capctl's extras, else None.
    ``extra``: the extra the command belongs to (``capctl sim``: "sim"), named instead of the
    module's own.

    Example: ``capctl-coordinator: needs capctl[coordinator] (module numpy is not installed):
    pip install 'capctl[coordinator]'``.
    """
    if extra_for(exc.name) is None:
        return None
    extra = extra or extra_for(exc.name)
    return (f"{prog}: needs capctl[{extra}] (module {exc.name.partition('.')[0]} is not installed): "
            f"pip install 'capctl[{extra}]'")
