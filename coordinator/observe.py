"""Snapshots of the registry and models for the decision step (:mod:`coordinator.decide`).

The only code of the decision path that reads live objects: the registry (event-loop thread) and
the online models (whose rate curves refit lazily under their own clocks). Everything returned is
a value: plain dataclasses and read-only arrays, safe to hand to a worker thread. Time comes in as
``now`` (s, the registry's monotonic clock); nothing here reads a clock.
"""

from __future__ import annotations

import operator

import numpy as np

from coordinator import allocation, decide, gpucolumns, planner


def node_gpus(registry) -> dict[str, int]:
    """Node -> how many GPUs its agent registered (every known node)."""
    return {name: len(node.gpus) for name, node in registry.nodes.items()}


def problem(registry, models, policy, now: float, lease_s: float, ack_memory_s: float) -> decide.Problem:
    """The solve's inputs at ``now`` (s): :func:`coordinator.allocation.build_inputs` (GPUs of stale
    nodes fixed at their accounted caps, W; curves and thermal ceilings from ``models``) plus the
    facts of the configuration alerts. ``lease_s``, ``ack_memory_s``: s."""
    inputs = allocation.build_inputs(registry, models, policy, now, lease_s, ack_memory_s)
    return decide.Problem(policy=policy, inputs=inputs, node_gpus=node_gpus(registry),
                          replacements=registry.replacements(decide.REPLACED_WINDOW_S, now),
                          clock_ahead=clocks_ahead(registry, now, lease_s))


def clocks_ahead(registry, now: float, lease_s: float) -> dict[str, tuple[float, float]]:
    """Node -> (s its agent's clock is ahead of the lease clock, the lease s) of every node that
    reported within the lease (``now``, s) with its clock ahead by at least
    :data:`coordinator.decide.CLOCK_AHEAD_ALERT_FRACTION` of the lease (``NodeObs.clock_ahead_s``)."""
    least = decide.CLOCK_AHEAD_ALERT_FRACTION * lease_s
    return {name: (node.clock_ahead_s, lease_s) for name, node in registry.nodes.items()
            if node.clock_ahead_s >= least and not node.stale(now, lease_s)}


def node_states(registry, now: float, lease_s: float) -> tuple[decide.NodeState, ...]:
    """Every node of ``registry`` at ``now`` (s), sorted by name."""
    have = operator.attrgetter("have_reading")
    return tuple(
        decide.NodeState(name=name, gpus=len(node.gpus), connected=node.session is not None,
                         stale=node.stale(now, lease_s), any_reading=any(map(have, node.gpus.values())),
                         connected_s=node.connected_mono)
        for name, node in sorted(registry.nodes.items())
    )


def gpu_arrays(registry, inputs, now: float, lease_s: float, ack_memory_s: float) -> tuple[planner.PlanArrays, np.ndarray]:
    """What the planner needs of every GPU of ``inputs``, read from ``registry`` at ``now`` (s):
    observed (latest enforced read-back, W), accounted (W), limit constraints (W), live (node
    connected and reporting, GPU not fixed), last safe cap (W); ``desired_w`` is the accounted cap
    (a placeholder). GPUs that left the registry since ``inputs`` are left out. Returns the
    read-only arrays and the position of each GPU in ``inputs.gpus``. When the registry still has
    the topology of ``inputs`` (the usual case), read as columns (:mod:`coordinator.gpucolumns`)."""
    table = registry.gpu_table()
    keys = allocation.columns_of(inputs).keys
    if table.keys is keys or table.keys == keys:
        return _gpu_columns(table, allocation.columns_of(inputs).fixed, now, lease_s, ack_memory_s)
    nodes = registry.nodes
    rows = []
    keys = []
    gone = []  # positions of the GPUs left out
    cur_name = None
    gpumap: dict = {}
    node_live = False
    for p, gi in enumerate(inputs.gpus):  # grouped by node (build_inputs order)
        key = gi.key
        if key[0] != cur_name:
            cur_name = key[0]
            node = nodes.get(cur_name)
            gpumap = node.gpus if node is not None else {}
            node_live = node is not None and node.session is not None and not node.stale(now, lease_s)
        g = gpumap.get(key[1])
        if g is None:
            gone.append(p)
            continue
        acc = g.accounted_w(now, ack_memory_s)
        keys.append(key)
        rows.append((g.enforced_w if g.have_reading else acc, acc, g.min_cap_w, g.max_cap_w,
                     1.0 if (node_live and not gi.fixed) else 0.0, g.safe_cap_w))
    a = np.array(rows, dtype=float).reshape(-1, 6).T.copy()
    live = a[4] > 0.5
    for arr in (a, live):
        arr.setflags(write=False)
    pa = planner.PlanArrays(keys=keys, desired_w=a[1], observed_w=a[0], accounted_w=a[1], min_cap_w=a[2],
                            max_cap_w=a[3], live=live, prev_safe_w=a[5])
    pos = np.arange(len(inputs.gpus), dtype=np.int64)
    return pa, (np.delete(pos, gone) if gone else pos)


def _gpu_columns(table, fixed: np.ndarray, now: float, lease_s: float,
                 ack_memory_s: float) -> tuple[planner.PlanArrays, np.ndarray]:
    """:func:`gpu_arrays` of the registry's GPU slots ``table`` (the problem's GPUs, in order)."""
    c = gpucolumns.gather(table.keys, table.gpus, gpucolumns.ACCOUNTING, table.static)
    problem = gpucolumns.constraints_unusable(c["min_cap_w"], c["max_cap_w"])
    acc = gpucolumns.accounted_w(c, now, ack_memory_s, problem)
    node_live = np.fromiter((n.session is not None and not n.stale(now, lease_s) for n in table.nodes), bool,
                            len(table.nodes))
    live = (node_live[table.node_of] if len(node_live) else np.zeros(0, bool)) & ~fixed
    observed = np.where(c["have_reading"], c["enforced_w"], acc)
    arrays = (observed, acc, c["min_cap_w"], c["max_cap_w"], live, c["safe_cap_w"])
    for arr in arrays:
        arr.setflags(write=False)
    pa = planner.PlanArrays(keys=table.keys, desired_w=acc, observed_w=observed, accounted_w=acc,
                            min_cap_w=arrays[2], max_cap_w=arrays[3], live=live, prev_safe_w=arrays[5])
    return pa, np.arange(len(table.keys), dtype=np.int64)


def fleet_state(registry, inputs, now: float, lease_s: float, ack_memory_s: float, *,
                with_nodes: bool = True) -> decide.FleetState:
    """The registry's accounting at ``now`` (s) for the GPUs of ``inputs`` (see :func:`gpu_arrays`);
    ``with_nodes=False`` leaves the node states out (empty), as phase 2 needs only the GPUs."""
    pa, pos = gpu_arrays(registry, inputs, now, lease_s, ack_memory_s)
    nodes = node_states(registry, now, lease_s) if with_nodes else ()
    return decide.FleetState(now=now, nodes=nodes, gpus=pa, pos=pos)


def observations(registry, problem_: decide.Problem, now: float, *, dry_run: bool, lease_s: float, interval_s: float,
                 ack_memory_s: float, start_s: float, limits_changed: bool = False) -> decide.Observations:
    """:class:`~coordinator.decide.Observations` of ``problem_`` with the fleet read at ``now`` (s);
    ``lease_s``, ``interval_s``, ``ack_memory_s``, ``start_s``: s; ``limits_changed``: see
    :attr:`coordinator.decide.Observations.limits_changed`."""
    return decide.Observations(problem=problem_, state=fleet_state(registry, problem_.inputs, now, lease_s, ack_memory_s),
                               dry_run=dry_run, lease_s=lease_s, interval_s=interval_s, start_s=start_s,
                               limits_changed=limits_changed)


def snapshot(registry, models, policy, now: float, *, dry_run: bool, lease_s: float, interval_s: float,
             ack_memory_s: float, start_s: float) -> decide.Observations:
    """Problem and fleet state read at the same ``now`` (s): the input of :func:`coordinator.decide.decide`."""
    p = problem(registry, models, policy, now, lease_s, ack_memory_s)
    return observations(registry, p, now, dry_run=dry_run, lease_s=lease_s, interval_s=interval_s,
                        ack_memory_s=ack_memory_s, start_s=start_s)
