"""Fencing of coordinator terms (high availability; pure logic, no I/O).

Coordinators in HA elect a leader through etcd (coordinator/election.py); the leader's term (the
create revision of its election key: etcd revisions only grow) comes with every ``CapPlan`` and
``Welcome``. The agent remembers the newest term it has seen and applies a plan only when its term
is that newest one: a deposed or partitioned former leader, whose term is older, can never change
a cap or renew the lease. Term 0 is a coordinator without etcd: accepted while no term was seen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TermFence:
    """The newest coordinator term seen by this agent, and how many plans it refused."""

    newest: int = 0
    refused: int = 0

    def see(self, term: int) -> None:
        """A ``Welcome`` (or an accepted plan) of ``term``: remember it when newer."""
        self.newest = max(self.newest, int(term))

    def admit(self, term: int) -> str:
        """"" when a plan of ``term`` may be applied (and remember the term), else why not."""
        term = int(term)
        if term < self.newest:
            self.refused += 1
            return f"plan of coordinator term {term} refused: term {self.newest} seen (a newer leader)"
        self.newest = term
        return ""
