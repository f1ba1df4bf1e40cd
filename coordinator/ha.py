"""The coordinator's side of high availability: what changes when it is elected or deposed
(:mod:`coordinator.election` decides when), and the answers a standby gives.

- **Elected**: the admin state is re-read from etcd (budget override, node ledger: nodes whose
  agents have not reconnected yet are counted at their last known caps, stale, spent), the startup
  hold starts again (no increase before the known nodes report), and the loop runs at once.
- **Deposed**: every agent stream is closed so that the agents go to the new leader; the loop sends
  nothing more (``Coordinator.may_send``), and agents refuse plans of an older term anyway.
- **Standby**: admin writes are refused with ``FAILED_PRECONDITION`` naming the leader; read-only
  admin calls answer. An agent's AgentLink stream is *parked* for up to :data:`PARK_S` seconds: when
  this standby is elected meanwhile, it is welcomed at once (a failover then costs no reconnect);
  else it is refused the same way, with trailing metadata ``capctl-leader: ADDR`` (the agent goes
  there next).
"""

from __future__ import annotations

import asyncio
import logging

from coordinator.registry import NODE_FORGET_S
from coordinator.store import StoreError

log = logging.getLogger("capctl.coordinator.ha")

LEADER_METADATA_KEY = "capctl-leader"
"""Trailing metadata key of a standby's refusal: the leader's address (agents follow it)."""
PARK_S = 1.0
"""How long (s) a standby holds an agent's new stream in case it is elected meanwhile; below the
agent's welcome deadline with several coordinators (nodeagent.link.HA_WELCOME_TIMEOUT_S)."""


def attach(coord) -> None:
    """Prepare ``coord`` (on its event loop) for parking streams: the event set while it leads;
    check the failover time against the agents' lease (:func:`check_failover_time`)."""
    coord.ha_elected = asyncio.Event()
    check_failover_time(coord)


def check_failover_time(coord) -> str:
    """The alert ``failover`` of ``coord`` (returned; "" when none): its etcd lease TTL (s, from
    ``--etcd-lease-ttl-s`` or the policy) plus two intervals is not shorter than the agents'
    lease (``failsafe.lease_s``): a failover then outlasts the agents' leases and every agent
    falls back to its safe cap. ``capctl policy validate`` warns of this for the policy's own
    ``coordinator.etcd`` block only; a TTL given as a flag was never checked (found by a review).
    Called when HA is attached and at every policy change (reload, takeover)."""
    leadership = getattr(coord, "ha", None)
    ttl_s = getattr(leadership, "ttl_s", None)
    if ttl_s is None:
        return ""
    ttl_s = max(ttl_s, getattr(leadership, "granted_ttl_s", 0) or 0)  # (what etcd granted, once known)
    takeover_s = float(ttl_s) + 2.0 * coord.interval_s
    if coord.lease_s > takeover_s:
        if coord.persistent_alerts.pop("failover", None) is not None:
            log.info("failover time %g s is now shorter than the agents' lease %g s", takeover_s, coord.lease_s)
        return ""
    text = (f"etcd lease TTL {ttl_s:g} s + 2 intervals = {takeover_s:g} s is not shorter than failsafe.lease_s "
            f"{coord.lease_s:g} s: a failover outlasts the agents' lease and every agent falls back to its safe cap; "
            f"lower --etcd-lease-ttl-s (or coordinator.etcd.lease_ttl_s) or raise failsafe.lease_s (docs/ha.md)")
    if coord.persistent_alerts.get("failover") != text:
        log.warning("%s", text)
    coord.persistent_alerts["failover"] = text
    return text


async def park(coord) -> bool:
    """Wait up to :data:`PARK_S` s for ``coord`` to lead; True when it does (bounded wait)."""
    event = getattr(coord, "ha_elected", None)
    if event is None:
        return coord.may_send()
    try:
        await asyncio.wait_for(event.wait(), PARK_S)
    except asyncio.TimeoutError:
        return False
    return coord.may_send()


def not_leader_message(coord, what: str) -> str:
    """Why a standby refuses ``what``, naming the leader (or saying none is known)."""
    ha = coord.ha.describe()
    where = f"the leader is {ha['leader']} (term {ha['term']})" if ha["leader"] else "no leader is elected now"
    return f"{what}: this coordinator ({coord.ha.address}) is a standby; {where}"


def leader_metadata(coord) -> tuple:
    """Trailing metadata of a refusal: ``((LEADER_METADATA_KEY, address),)`` or ``()``."""
    leader = coord.ha.describe()["leader"]
    return ((LEADER_METADATA_KEY, leader),) if leader else ()


def on_change_threadsafe(coord, loop: asyncio.AbstractEventLoop):
    """An ``on_change`` for :class:`~coordinator.election.Leadership` that runs :func:`elected` or
    :func:`deposed` on the coordinator's event loop; the admin state a new leader takes over is
    read in the coordinator's store worker (etcd requests never wait on the event loop)."""
    io = getattr(coord, "store_io", None)

    def on_change(is_leader: bool) -> None:
        read = read_admin_state if is_leader else (lambda _coord: None)
        if io is None:  # no etcd store (tests): read here
            handle(read(coord), is_leader)
            return
        # in the store worker, in order with the other store calls: the election thread goes on
        # with its keep-alives meanwhile, and a deposition never overtakes the election before it
        io.run_threadsafe(read, coord, then=lambda state: handle(state, is_leader))

    def handle(state, is_leader: bool) -> None:
        if is_leader:
            loop.call_soon_threadsafe(elected, coord, state)
        else:
            loop.call_soon_threadsafe(deposed, coord)
    return on_change


def read_admin_state(coord):
    """``(budget override or StoreError, node ledger or StoreError)`` of ``coord``'s store, or None
    without a usable store (blocks on etcd: the election thread calls it)."""
    store = coord.store
    if store is None or not store.ok:
        return None
    try:
        ledger = store.load_nodes()
    except StoreError as exc:
        ledger = exc
    return coord._read_override(), ledger


def _reread_policy(coord) -> None:
    """A new leader reads its policy file again (``coord.policy_path``): a ``capctl policy reload``
    reaches only the leader of its time, so a file changed and reloaded since this coordinator
    started (a lower domain limit) would be lost on failover. A file that does not load now
    keeps the policy parsed before (at start or at a reload here), with an alert naming it."""
    from capctl.policy import PolicyError, load_policy

    path = getattr(coord, "policy_path", "")
    if not path:
        return  # the embedded default: nothing to re-read
    try:
        fresh = load_policy(path)
    except PolicyError as exc:
        why = "; ".join(list(exc.errors)[:3]) or str(exc)
    except Exception as exc:  # noqa: BLE001 (a user file must never stop a takeover)
        why = f"{type(exc).__name__}: {exc}"
    else:
        coord.persistent_alerts.pop("policy", None)
        if fresh != coord.file_policy:
            log.warning("taking over: policy %s changed since it was last read here; the file's new content is used",
                        path)
        coord.file_policy = fresh
        return
    coord.persistent_alerts["policy"] = (f"policy {path} not re-read at takeover ({why}); the policy read at "
                                         "start or at the last reload here stays")
    log.error("%s", coord.persistent_alerts["policy"])


def elected(coord, state=False) -> None:
    """Take over: the policy file read again (:func:`_reread_policy`), admin state from the store
    (``state``: as :func:`read_admin_state` read it, else read here); every node without a stream
    counted at the caps of the ledger the last leader wrote (write-ahead of its increases), one the
    ledger does not name as a policy node never heard of (allocation.unreported_reserve)."""
    if state is False:
        state = read_admin_state(coord)
    _forget_idle_grants(coord)  # (history of an earlier term: stale; found by a review)
    # what the ledger in the store counts is known again only once this term saves it: the value
    # kept from an earlier term may be above what the leaders in between saved, and an increase it
    # covered would skip its write-ahead (Coordinator._write_ahead; found by a review)
    coord._ledger_w = {}
    _reread_policy(coord)
    if state is None:
        coord.policy = coord._apply_override(coord.file_policy, None, read=False)
    else:
        override, ledger = state
        try:
            coord.policy = coord._apply_override(coord.file_policy, override, read=False, takeover=True)
            if isinstance(ledger, StoreError):
                raise ledger
            reg = coord.registry
            # every node without a stream: counted as the last leader left it (its ledger entry),
            # not as this coordinator knew it in an earlier term; one the ledger does not name (etcd
            # lost its data, or the last leader never heard of it) is then a policy node this
            # coordinator knows nothing of: counted at the most it may draw until
            # its agent reports (allocation.unreported_reserve; its old caps here undercounted it:
            # 1.8 W over a 2,800 W budget for 345 ms after etcd was rebuilt empty)
            for name in [n for n, node in reg.nodes.items() if node.session is None]:
                del reg.nodes[name]
            n = reg.restore_ledger(ledger, NODE_FORGET_S, keep=coord.policy.node_names)
            log.info("taking over as leader (term %d): budget %g W; %d node(s) counted at their ledger caps "
                     "until their agents report", coord.term, coord.policy.budget_w, n)
        except StoreError as exc:
            coord.persistent_alerts["store"] = str(exc)
            log.error("taking over: %s", exc)
    coord._start_clock = coord.registry.clock()
    check_failover_time(coord)
    if getattr(coord, "ha_elected", None) is not None:
        coord.ha_elected.set()  # parked agent streams go on now
    # no early interval here: nothing is connected yet; each agent's first report wakes the loop
    # (Coordinator.first_report), and an interval now would only delay that one (MIN_TICK_SPACING)


def deposed(coord) -> None:
    """Step down: close every agent stream (they reconnect to the leader); its view is emptied."""
    if getattr(coord, "ha_elected", None) is not None:
        coord.ha_elected.clear()
    n = 0
    for node in list(coord.registry.nodes.values()):
        if node.session is not None:
            node.session.close("this coordinator is no longer the leader")
            n += 1
    # the view of its last interval as leader would be shown as live (nodes fresh, caps it no longer
    # plans) for as long as it stands by: a standby shows no nodes and names the leader instead
    from coordinator.view import empty_view

    coord.view = empty_view(coord.coordinator_id, coord.policy, coord.policy_path, coord.dry_run)
    coord.persistent_alerts.pop("budget", None)  # (the budget in force is the leader's to say)
    _forget_idle_grants(coord)
    log.warning("deposed: %d agent stream(s) closed; sending nothing more", n)


def _forget_idle_grants(coord) -> None:
    """Drop ``coord``'s idle-grant history (coordinator.idlegrants) at a change of term."""
    idle = getattr(getattr(coord, "models", None), "idle_grants", None)
    if idle is not None:
        idle.clear()
