"""Leader election of the coordinators through an etcd lease (high availability).

Every coordinator of a site holds one etcd lease of ``ttl_s`` seconds and registers itself under
``<prefix>/members/<id>`` with it (its advertised address). The leader is whoever created
``<prefix>/leader`` (a transaction "create if absent", the key attached to its lease); the key's
create revision is the leader's **term**: etcd revisions only grow, so a later leader always has a
higher term. The term travels in every ``CapPlan`` and ``Welcome``; agents apply plans only from the
newest term they have seen (:mod:`nodeagent.fencing`).

The leader keeps its lease alive every ``ttl_s / 4`` seconds. It may act (send plans, write admin
state) only while :meth:`Leadership.may_send` holds: until ``sent + TTL - margin`` after the last
keep-alive that etcd confirmed, ``sent`` being when that request left (monotonic clock). etcd
counts the TTL from when it handles the request, later than ``sent``, so the leader stops acting
before etcd can let anyone else take the key — even if the process was frozen (SIGSTOP) or cut
off from etcd (no quorum) meanwhile. A coordinator never leads twice under one term: one that finds
the leader key still its own while it does not lead (its lease outlived a step-down) deletes it and
campaigns for a new one. A standby tries to create the key every
:data:`CAMPAIGN_PERIOD_S` seconds, which succeeds as soon as etcd has expired or revoked the old
leader's lease. A coordinator that stops cleanly revokes its lease: the hand-over is then
immediate.

**Terms after etcd lost its data.** Revisions restart when etcd's data is lost (a cluster
rebuilt, a restore from an old snapshot), so a new leader's create revision can be lower than a
term the agents have already seen, and they would refuse its plans for good. The term agents see is
therefore ``create revision + term base``, the base an integer under ``<prefix>/term_base`` (0
when absent), read in the same transaction that creates the leader key. Agents report the newest
term they have seen in their ``AgentHello``; a leader whose term is lower asks
(:meth:`Leadership.want_term_above`) and the election thread raises the base in a transaction fenced
by the leader key, so that its term is one above (at most :data:`MAX_TERM`). The base only grows,
so a later leader still has a higher term than any earlier one: a deposed leader's plans stay
refused.

The election runs in its own thread (HTTP requests with deadlines, :mod:`coordinator.etcdconn`);
it tells the coordinator of each change through ``on_change(elected: bool)``, called in that
thread (the daemon forwards it to its event loop).
"""

from __future__ import annotations

import json
import logging
import threading
import time

from coordinator.etcdconn import EtcdConn, EtcdError, b64

log = logging.getLogger("capctl.coordinator.election")

DEFAULT_TTL_S = 2
"""Default etcd lease TTL of a coordinator, seconds (etcd's floor is 1.5 x its election timeout:
2 s with etcd's default 1 s election timeout; Kubernetes' leader election uses 15 s)."""
SAFETY_MARGIN_S = 0.25
"""A leader stops acting this long (s) before its lease can expire at etcd."""
CAMPAIGN_PERIOD_S = 0.1
"""How often (s) a standby tries to take the leader key."""
MAX_TERM = 2 ** 48
"""Highest term a leader raises its own above (:meth:`Leadership.want_term_above`): a term reported
at or above it is logged and not followed. etcd's revisions (the terms without a base) grow by one
per write: 2^48 is ~900 years of 10,000 writes a second, so no real term comes near it, and one bad
hello cannot use up the protocol's uint64 terms (a raise still leaves ~2^63 above it)."""
ERROR_REPEAT_S = 30.0
"""An etcd failure that lasts is logged again this often (s), with how long it has lasted."""


class Leadership:
    """One coordinator's part in the election (see module docstring).

    Args:
        conn: the etcd cluster.
        prefix: key prefix of this site, e.g. ``/capctl``.
        member_id: this coordinator's id (``Coordinator.coordinator_id``).
        address: the gRPC address agents and the CLI reach this coordinator at.
        ttl_s: lease TTL asked of etcd, whole seconds >= 1.
        on_change: called with True when elected, False when deposed (election thread).
    """

    def __init__(self, conn: EtcdConn, prefix: str, member_id: str, address: str, ttl_s: int = DEFAULT_TTL_S,
                 on_change=None) -> None:
        self.conn = conn
        self.prefix = prefix.rstrip("/") or "/capctl"
        self.member_id = member_id
        self.address = address
        self.ttl_s = max(1, int(ttl_s))
        self.granted_ttl_s = 0  # the TTL etcd granted the last lease (s; it may be more than asked)
        self.on_change = on_change
        self.term = 0  # > 0 while this coordinator leads: the create revision of its leader key
        self.term_base = 0  # added to it in the term agents see (module docstring)
        self.leader = ""  # the leader's address as last read ("" = none known)
        self.leader_term = 0  # the leader's term as agents see it (create revision + base)
        self._wanted_term = 0  # the newest term an agent reported (want_term_above)
        self._bad_base = ""  # the last term base value logged as unreadable
        self.standbys: list[str] = []
        self.error = ""  # the last etcd failure, "" when the last request succeeded
        self._lease_id = 0
        self._deadline_mono = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def leader_key(self) -> str:
        return f"{self.prefix}/leader"

    @property
    def member_key(self) -> str:
        return f"{self.prefix}/members/{self.member_id}"

    @property
    def base_key(self) -> str:
        return f"{self.prefix}/term_base"

    @property
    def plan_term(self) -> int:
        """The term this coordinator's plans and ``Welcome`` carry: its leader key's create revision
        plus the term base (module docstring); 0 while it does not lead."""
        with self._lock:
            return self.term + self.term_base if self.term > 0 else 0

    def want_term_above(self, seen: int) -> bool:
        """An agent has seen coordinator term ``seen``: when it is above this leader's term (the
        agent refuses its plans), the election thread raises the term base (fenced by the leader
        key) so that the term is one above. Thread-safe; returns True when a raise is now wanted
        (False: not leading, ``seen`` at or below the term, or at or beyond :data:`MAX_TERM`, which
        is logged)."""
        seen = int(seen)
        with self._lock:
            if self.term <= 0 or seen <= self.term + self.term_base:
                return False  # (its own term, as every agent that reconnects reports: nothing to do)
            if seen >= MAX_TERM:
                log.error("an agent reports coordinator term %d, at or beyond %d: not followed (it refuses this "
                          "leader's plans until its agent-state.json's coordinator_term is reset)", seen, MAX_TERM)
                return False
            self._wanted_term = max(self._wanted_term, seen)
            return True

    # -- what the coordinator asks ----------------------------------------------------------
    def may_send(self, now_mono: float | None = None) -> bool:
        """True while this coordinator leads and its lease surely still holds at etcd."""
        now = time.monotonic() if now_mono is None else now_mono
        with self._lock:
            return self.term > 0 and now < self._deadline_mono

    def role(self) -> str:
        return "leader" if self.may_send() else "standby"

    def describe(self) -> dict:
        """``{"role", "leader", "term", "standbys"}`` for ``capctl status``."""
        leading = self.may_send()
        with self._lock:
            return {"role": "leader" if leading else "standby",
                    "leader": self.address if leading else self.leader,
                    "term": self.term + self.term_base if leading else self.leader_term,
                    "standbys": list(self.standbys)}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Leadership:
        self._thread = threading.Thread(target=self._run, name="etcd-election", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop campaigning; revoke the lease (the leader key and membership go at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        was = self.term > 0
        with self._lock:
            self.term = 0
            self._deadline_mono = 0.0
            self._wanted_term = 0
        if self._lease_id:
            try:
                self.conn.revoke(self._lease_id)
            except EtcdError as exc:
                log.warning("etcd lease not revoked on stop: %s", exc)
        if was:
            self._notify(False)

    # -- the election thread ----------------------------------------------------------------
    def _run(self) -> None:
        failing_since = logged = 0.0
        while not self._stop.is_set():
            try:
                self._step()
                if self.error:
                    log.info("etcd reachable again after %.0f s", time.monotonic() - failing_since)
                self.error = ""
            except EtcdError as exc:
                now = time.monotonic()
                if not self.error:
                    failing_since = now
                if str(exc) != self.error or now - logged >= ERROR_REPEAT_S:  # a lasting outage is said again
                    lasting = f" (failing for {now - failing_since:.0f} s; this coordinator cannot lead)" if self.error else ""
                    log.warning("%s%s", exc, lasting)
                    logged = now
                self.error = str(exc)
                if self.term == 0 and now - failing_since >= self.ttl_s:
                    self._forget_leader()
            self._check_deadline()
            period = self.ttl_s / 4.0 if self.term > 0 else CAMPAIGN_PERIOD_S
            self._stop.wait(period)

    def _step(self) -> None:
        """One round: keep the lease alive (or get one), campaign when not leading, read the members."""
        if not self._lease_id:
            self._lease_id, granted = self.conn.grant(self.ttl_s)
            self.granted_ttl_s = granted  # (etcd may grant more than asked: its minimum lease TTL)
            self.conn.put(self.member_key, json.dumps({"address": self.address}), self._lease_id)
            log.info("etcd lease %x granted (TTL %d s)", self._lease_id, granted)
        sent = time.monotonic()
        ttl = self.conn.keepalive(self._lease_id)
        if ttl <= 0:
            log.warning("etcd lease %x expired", self._lease_id)
            self._lease_id = 0
            self._lose("its etcd lease expired")
            return
        if self.term > 0:
            kv = self.conn.get(self.leader_key)  # still ours? (an operator may have deleted it)
            if kv is None or kv["create_revision"] != self.term:
                self._lose("the leader key is no longer ours")
                return
            with self._lock:
                self._deadline_mono = sent + min(ttl, self.ttl_s) - SAFETY_MARGIN_S
            self._raise_term()
        else:
            self._campaign(sent, min(ttl, self.ttl_s))
        self._read_members()

    def _campaign(self, sent: float, ttl_s: float) -> None:
        """Create the leader key if absent (attached to our lease); else note who leads."""
        key = b64(self.leader_key)
        value = b64(json.dumps({"id": self.member_id, "address": self.address}))
        base_key = b64(self.base_key)
        r = self.conn.txn(
            compare=[{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            success=[{"request_put": {"key": key, "value": value, "lease": self._lease_id}},
                     {"request_range": {"key": key}}, {"request_range": {"key": base_key}}],
            failure=[{"request_range": {"key": key}}, {"request_range": {"key": base_key}}],
        )
        at = 1 if r.get("succeeded") else 0
        kv = _range_kv(r, at)
        if kv is None:
            return
        base = self._base_of(_range_kv(r, at + 1))
        info = _json(kv.get("value", ""))
        term = int(kv.get("create_revision", 0))
        if not r.get("succeeded") and info.get("id") == self.member_id and int(kv.get("lease", 0)) == self._lease_id:
            self._drop_own_key(term)
            return
        if r.get("succeeded"):
            with self._lock:
                self.term, self.term_base, self._wanted_term = term, base, 0
                self._deadline_mono = sent + ttl_s - SAFETY_MARGIN_S
                self.leader, self.leader_term = self.address, term + base
            log.warning("elected leader: term %d (etcd lease %x, TTL %g s)", term + base, self._lease_id, ttl_s)
            self._notify(True)
        else:
            with self._lock:
                self.leader, self.leader_term = str(info.get("address", "")), term + base

    def _base_of(self, kv: dict | None) -> int:
        """The term base stored in ``kv`` (the ``term_base`` key as read; None: absent, 0). A value
        that is no integer in 0..MAX_TERM is logged and read as 0 (the term is then the create
        revision alone, as before bases existed)."""
        if kv is None:
            return 0
        raw = kv.get("value", b"")
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        try:
            base = int(text)
        except ValueError:
            base = -1
        if not 0 <= base <= MAX_TERM:
            if text != self._bad_base:  # once per value (standbys read it every campaign round)
                self._bad_base = text
                log.error("etcd key %s holds %.40r, not a term base (an integer 0 to %d): read as 0", self.base_key,
                          text, MAX_TERM)
            return 0
        return base

    def _raise_term(self) -> None:
        """Raise the term base so that this leader's term is one above the newest an agent reported
        (:meth:`want_term_above`): one transaction fenced by the leader key (a deposed leader writes
        nothing). Raises EtcdError (the election's loop logs it and retries next round)."""
        with self._lock:
            wanted, term, old = self._wanted_term, self.term, self.term_base
        if term <= 0 or wanted < term + old:
            return
        base = wanted + 1 - term
        leader = b64(self.leader_key)
        r = self.conn.txn(
            compare=[{"key": leader, "result": "EQUAL", "target": "CREATE", "create_revision": term}],
            success=[{"request_put": {"key": b64(self.base_key), "value": b64(str(base))}}],
            failure=[],
        )
        if not r.get("succeeded"):
            return  # the leader key is no longer ours: the next round steps down
        with self._lock:
            if self.term == term:
                self.term_base = max(self.term_base, base)
                self.leader_term = term + self.term_base
        log.warning("term raised %d -> %d: an agent had seen term %d, above this leader's (etcd lost its data? "
                    "its revisions restarted); term base %d in %s", term + old, term + base, wanted, base,
                    self.base_key)

    def _drop_own_key(self, term: int) -> None:
        """The leader key is still ours (our lease outlived a step-down, e.g. etcd lost its quorum
        and kept the lease, or a create whose reply was lost) while we do not lead: delete it (only
        if it is still that key) so that the next campaign creates it anew, with a higher create
        revision. Leading again under the old ``term`` would let a plan delayed from the first
        leadership pass the agents' fence (:mod:`nodeagent.fencing`) in the second."""
        key = b64(self.leader_key)
        r = self.conn.txn(
            compare=[{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": term}],
            success=[{"request_delete_range": {"key": key}}],
            failure=[],
        )
        if r.get("succeeded"):
            log.warning("leader key of term %d still held by this coordinator after it stepped down: deleted, "
                        "campaigning for a new term", term)

    def _forget_leader(self) -> None:
        """etcd has not answered for a lease TTL: the leader last read may be gone (its lease may
        have expired meanwhile), so it is no longer named (found by a try-out: during a quorum
        loss a standby named a leader that had stepped down)."""
        with self._lock:
            self.leader, self.leader_term = "", 0

    def _read_members(self) -> None:
        """The standbys: every registered coordinator's address except the leader's."""
        addresses = {str(_json(kv["value"]).get("address", "")) for kv in self.conn.get_prefix(f"{self.prefix}/members/")}
        with self._lock:
            leader = self.address if self.term > 0 else self.leader
            self.standbys = sorted(a for a in addresses | {self.address} if a and a != leader)

    def _check_deadline(self) -> None:
        """A leader whose lease could have expired at etcd steps down (no keep-alive confirmed in time)."""
        if self.term > 0 and time.monotonic() >= self._deadline_mono:
            self._lose("no etcd keep-alive confirmed within its lease")

    def _lose(self, why: str) -> None:
        with self._lock:
            was = self.term
            self.term = 0
            self._deadline_mono = 0.0
            if was:
                self.leader, self.leader_term = "", was + self.term_base
        if was:
            log.warning("stepping down as leader of term %d: %s", was + self.term_base, why)
            self._notify(False)

    def _notify(self, elected: bool) -> None:
        if self.on_change is not None:
            try:
                self.on_change(elected)
            except Exception:  # noqa: BLE001 (the election must go on)
                log.exception("leadership change handler failed")


def _range_kv(reply: dict, index: int) -> dict | None:
    """The first key-value of the ``request_range`` response at ``index`` of a txn reply (raw JSON)."""
    try:
        kvs = reply["responses"][index]["response_range"].get("kvs") or []
    except (KeyError, IndexError, TypeError):
        return None
    if not kvs:
        return None
    from coordinator.etcdconn import unb64

    kv = dict(kvs[0])
    kv["value"] = unb64(kv.get("value", ""))
    return kv


def _json(raw) -> dict:
    try:
        value = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, UnicodeDecodeError, AttributeError):
        return {}
    return value if isinstance(value, dict) else {}
