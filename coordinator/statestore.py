"""The interface of the coordinator's admin-state store, which both backends implement:
:class:`coordinator.store.Store` (SQLite, the default) and :class:`coordinator.etcdstore.EtcdStore`
(etcd, for coordinators in high availability). Every method raises
:class:`coordinator.store.StoreError` on failure. A further backend (another record kind, e.g.
finished jobs) adds its methods to both.
"""

from __future__ import annotations

from typing import Protocol


class StateStore(Protocol):
    """What :class:`coordinator.loop.Coordinator` needs of its store (watts, Unix seconds)."""

    path: str
    """Where the state lives, for messages."""

    @property
    def ok(self) -> bool:
        """True when usable."""

    def close(self) -> None: ...

    def get(self, key: str):
        """The JSON value stored under ``key`` (a setting: e.g. the policy file an admin made the
        one in force, ``coordinator.loop.RELOADED_KEY``), or None."""

    def put(self, key: str, value, action: str) -> None:
        """Store the JSON ``value`` under ``key`` (None deletes it), with an audit record ``action``."""

    def budget_override(self) -> dict | None:
        """``{"budget_w", "policy_budget_w", "time_s"}`` or None."""

    def set_budget_override(self, budget_w: float, policy_budget_w: float) -> None: ...

    def clear_budget_override(self) -> None: ...

    def save_nodes(self, nodes: dict[str, dict]) -> None:
        """Replace the node ledger ``{node: {"gpus": {index: [accounted_w, min_cap_w, max_cap_w,
        safe_cap_w]}, "seen_s": t}}``."""

    def load_nodes(self) -> dict[str, dict]: ...
