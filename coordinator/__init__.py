"""Coordinator daemon: the reconcile loop on the head node (docs/coordinator.md).

Modules: ``daemon`` (entry point ``capctl-coordinator``), ``server`` (gRPC servicers, admin
identity), ``loop`` (the reconcile loop's I/O and admin operations), ``observe`` (a snapshot of
the observed state at a given time), ``decide`` (the pure decision: observations -> caps and
plans), ``registry`` (observed state from
the agents), ``models`` (online rate-curve and thermal models), ``allocation`` (building and
solving the allocator's problem), ``planner`` (two-phase plans and safe caps, pure), ``store``
(SQLite state), ``view`` (published status), ``metrics`` (Prometheus), ``client`` (AdminClient).
"""
