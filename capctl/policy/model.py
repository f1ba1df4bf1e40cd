"""The validated policy as frozen dataclasses (units in every name: W, s, °C).

Built only by :mod:`capctl.policy.validate`; every instance satisfies the checks documented in
docs/policy.md (positive finite quantities, each node in exactly one domain, child limits not above
their parent's, lease longer than the interval, ...).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from capctl.errors import UserInputError

DOMAIN_KINDS = ("cluster", "row", "rack", "pdu", "node")
"""Kinds of power domain, outermost first (pdu and rack may nest either way)."""

DEFAULT_SOCKET_PATH = "/run/capctl/agent.sock"
"""Default path of a node agent's local unix socket (one agent per host)."""

DEFAULT_COORDINATOR_ADDRESS = "unix:/run/capctl/coordinator.sock"
"""Default gRPC address of the coordinator (same default as :mod:`capctl.cli.rpc`)."""


@dataclass(frozen=True)
class Domain:
    """One power domain of the tree.

    Attributes:
        name: unique name in the tree.
        kind: one of :data:`DOMAIN_KINDS`.
        limit_w: limit on the sum of GPU caps below this domain, watts; None = no own limit. For
            the root this is the budget in force (``Policy.budget_w``).
        children: child domains.
        nodes: Slurm node names listed directly on this domain (hostlists expanded, file order).
        gpu_model: GPU model of the nodes below (inherited from ancestors), or None.
        gpus_per_node: GPUs per node below (inherited), or None.
    """

    name: str
    kind: str
    limit_w: float | None = None
    children: tuple[Domain, ...] = ()
    nodes: tuple[str, ...] = ()
    gpu_model: str | None = None
    gpus_per_node: int | None = None

    def walk(self) -> Iterator[Domain]:
        """Yield this domain and every descendant, depth first, parents before children."""
        stack = [self]
        while stack:
            domain = stack.pop()
            yield domain
            stack.extend(reversed(domain.children))

    def all_nodes(self) -> tuple[str, ...]:
        """Every node name in this domain and below (depth-first order)."""
        return tuple(node for domain in self.walk() for node in domain.nodes)

    def find(self, name: str) -> Domain:
        """Return the domain called ``name`` in this subtree. Raises KeyError when absent."""
        for domain in self.walk():
            if domain.name == name:
                return domain
        raise KeyError(name)

    def to_dict(self) -> dict:
        """Plain-data form (YAML/JSON-compatible); nodes as one compact hostlist when that keeps
        their order, else as a list of names."""
        import hostlist

        out: dict = {"name": self.name, "kind": self.kind, "limit_w": self.limit_w}
        if self.gpu_model is not None:
            out["gpu_model"] = self.gpu_model
        if self.gpus_per_node is not None:
            out["gpus_per_node"] = self.gpus_per_node
        if self.nodes:
            compact = hostlist.collect_hostlist(list(self.nodes))
            same = tuple(hostlist.expand_hostlist(compact)) == self.nodes
            out["nodes"] = compact if same else list(self.nodes)  # keep the file's order
        if self.children:
            out["children"] = [child.to_dict() for child in self.children]
        return out


@dataclass(frozen=True)
class ThermalPolicy:
    """Thermal headroom: ``margin_c`` °C below the device's slowdown temperature."""

    margin_c: float = 5.0


@dataclass(frozen=True)
class FailsafePolicy:
    """Leases: assignments last ``lease_s`` seconds; then agents fall back to ``safe_cap_w``
    watts (None = the safe cap the coordinator computes and pushes with each plan)."""

    lease_s: float = 30.0
    safe_cap_w: float | None = None


@dataclass(frozen=True)
class PrologPolicy:
    """Slurm hooks: ``on_unreachable`` is ``"fail-open"`` or ``"fail-closed"``; each prolog or
    epilog run is bounded by ``timeout_s`` seconds."""

    on_unreachable: str = "fail-open"
    timeout_s: float = 5.0

    @property
    def fail_open(self) -> bool:
        """True when an unreachable agent/coordinator must not fail the hook."""
        return self.on_unreachable == "fail-open"


@dataclass(frozen=True)
class Weights:
    """Job weights (dimensionless, > 0): the most specific match wins, qos > account > partition >
    default. Mappings are read-only."""

    default: float = 1.0
    partitions: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    accounts: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    qos: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def weight(self, partition: str | None = None, account: str | None = None, qos: str | None = None) -> float:
        """Weight of a job with this partition, account and QOS (see class docstring)."""
        if qos is not None and qos in self.qos:
            return self.qos[qos]
        if account is not None and account in self.accounts:
            return self.accounts[account]
        if partition is not None and partition in self.partitions:
            return self.partitions[partition]
        return self.default


@dataclass(frozen=True)
class AgentPolicy:
    """Node agents: ``socket_path`` (``%n`` = node name), ``socket_group`` (None = root only)."""

    socket_path: str = DEFAULT_SOCKET_PATH
    socket_group: str | None = None


@dataclass(frozen=True)
class EtcdPolicy:
    """High availability on etcd: the members' ``endpoints`` (http(s)://HOST:PORT), the site's key
    ``prefix``, the leader's lease TTL ``lease_ttl_s`` (whole seconds)."""

    endpoints: tuple[str, ...] = ()
    prefix: str = "/capctl"
    lease_ttl_s: int = 2


@dataclass(frozen=True)
class CoordinatorPolicy:
    """Coordinator: gRPC ``address``; ``admin_group`` may run admin operations and
    ``status_group`` read-only status over the unix socket (None = root only); ``etcd`` for
    coordinators in high availability (None = one coordinator)."""

    address: str = DEFAULT_COORDINATOR_ADDRESS
    admin_group: str | None = None
    status_group: str | None = None
    etcd: EtcdPolicy | None = None


PER_GPU_SERIES = ("auto", "all", "flagged", "none")
"""Values of ``metrics.per_gpu_series`` (docs/metrics.md, "Series per GPU")."""


@dataclass(frozen=True)
class MetricsPolicy:
    """The coordinator's Prometheus export: which GPUs get per-GPU series.

    ``per_gpu_series``: ``all`` every GPU; ``flagged`` only GPUs in a cap state other than OK or
    flagged STRAGGLER; ``none`` no GPU (aggregates per cluster, domain, job and cap state stay);
    ``auto`` = ``all`` while the coordinator sees at most ``all_up_to_gpus`` GPUs, else ``flagged``.
    The default bound of 4,096 GPUs keeps a scrape below ~100k series (about 23 per GPU) and ~0.8 s
    of coordinator CPU (~200 us per GPU: bench/scrape_cost.py).
    """

    per_gpu_series: str = "auto"
    all_up_to_gpus: int = 4096

    def mode(self, n_gpus: int) -> str:
        """``all``, ``flagged`` or ``none`` for a cluster of ``n_gpus`` GPUs (``auto`` resolved)."""
        if self.per_gpu_series != "auto":
            return self.per_gpu_series
        return "all" if n_gpus <= self.all_up_to_gpus else "flagged"


MEMORY_BOUND_SHARE = ("estimate", "zero")
"""Values of ``models.memory_bound_share`` (docs/policy.md, ``models``)."""


@dataclass(frozen=True)
class ModelsPolicy:
    """The coordinator's per-GPU models.

    ``memory_bound_share``: ``estimate`` (default) keeps each GPU's memory-bound share of a step
    from NVML's memory utilization and flattens its rate curve by it
    (:mod:`coordinator.membound`); ``zero`` takes every step as compute-bound (share 0, no
    estimate kept): the rate curves are the clock curves (as before issue 12 item 8), e.g. for a
    plant whose memory utilization does not follow the step-time model. (Not ``off``: YAML reads
    an unquoted ``off`` as a boolean.)
    """

    memory_bound_share: str = "estimate"


@dataclass(frozen=True)
class Policy:
    """A validated capctl policy (version 1). See docs/policy.md for every field.

    Attributes:
        version: 1.
        budget_w: cluster budget in force, watts (= ``domains.limit_w``).
        budget_ceiling_w: the root domain's ``limit_w`` from the file (the most ``with_budget``
            accepts), or None.
        interval_s, objective, thermal, slew_w, idle_cap_w, start_cap_w, min_cap_w, failsafe,
        prolog, dry_run, weights, agent, coordinator, metrics, models: as in the YAML (defaults
            filled in).
        domains: root :class:`Domain`.
        source: file the policy came from (``"<string>"``/``"<default>"`` otherwise).
        warnings: ``"file:line:col: warning: ..."`` lines found while validating.
    """

    version: int
    budget_w: float
    domains: Domain
    interval_s: float = 5.0
    objective: str = "proportional"
    thermal: ThermalPolicy = ThermalPolicy()
    slew_w: float | None = None
    idle_cap_w: float | None = None
    reserve_pre_job_limits: bool = False
    spread_spare_watts: bool = False
    start_cap_w: float = 300.0
    min_cap_w: float | None = None
    failsafe: FailsafePolicy = FailsafePolicy()
    prolog: PrologPolicy = PrologPolicy()
    dry_run: bool = False
    weights: Weights = Weights()
    agent: AgentPolicy = AgentPolicy()
    coordinator: CoordinatorPolicy = CoordinatorPolicy()
    metrics: MetricsPolicy = MetricsPolicy()
    models: ModelsPolicy = ModelsPolicy()
    budget_ceiling_w: float | None = None
    source: str = field(default="<string>", compare=False)
    warnings: tuple[str, ...] = field(default=(), compare=False)
    _node_paths: Mapping[str, tuple[Domain, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        paths: dict[str, tuple[Domain, ...]] = {}

        def visit(domain: Domain, prefix: tuple[Domain, ...]) -> None:
            here = prefix + (domain,)
            for node in domain.nodes:
                paths[node] = here
            for child in domain.children:
                visit(child, here)

        visit(self.domains, ())
        object.__setattr__(self, "_node_paths", MappingProxyType(paths))

    # -- helpers -------------------------------------------------------------------------------

    @property
    def node_names(self):
        """Every node name the policy lists (a set-like view: ``in`` is one dict lookup)."""
        return self._node_paths.keys()

    def has_node(self, node: str) -> bool:
        """True when ``node`` is listed in some domain of the policy."""
        return node in self._node_paths

    def domain_path(self, node: str) -> list[Domain]:
        """Domains containing ``node``, root first, ending with the domain that lists it.

        A node the policy does not list (e.g. an agent registering from a new node) is placed
        directly under the root: ``[root]``. It still counts against the cluster budget, never
        against a rack or PDU it might be in; validate the policy to catch that.
        """
        return list(self._node_paths.get(node, (self.domains,)))

    def job_weight(self, partition: str | None = None, account: str | None = None, qos: str | None = None) -> float:
        """Weight of a job: qos > account > partition > default (see :class:`Weights`)."""
        return self.weights.weight(partition=partition, account=account, qos=qos)

    def socket_path(self, node: str) -> str:
        """Path of ``node``'s agent socket: ``agent.socket_path`` with ``%n`` -> node, ``%%`` -> %."""
        template = self.agent.socket_path
        out = []
        i = 0
        while i < len(template):
            if template[i] == "%" and i + 1 < len(template):
                nxt = template[i + 1]
                out.append(node if nxt == "n" else "%" if nxt == "%" else template[i : i + 2])
                i += 2
            else:
                out.append(template[i])
                i += 1
        return "".join(out)

    def to_dict(self) -> dict:
        """Plain-data form with every default filled in; ``parse_policy(yaml.safe_dump(...))``
        gives back an equal policy (warnings and source aside)."""
        root = self.domains.to_dict()
        root["limit_w"] = self.budget_ceiling_w
        return {
            "version": self.version,
            "budget_w": self.budget_w,
            "interval_s": self.interval_s,
            "objective": self.objective,
            "thermal": {"margin_c": self.thermal.margin_c},
            "slew_w": self.slew_w,
            "idle_cap_w": self.idle_cap_w,
            "reserve_pre_job_limits": self.reserve_pre_job_limits,
            "spread_spare_watts": self.spread_spare_watts,
            "start_cap_w": self.start_cap_w,
            "min_cap_w": self.min_cap_w,
            "failsafe": {"lease_s": self.failsafe.lease_s, "safe_cap_w": self.failsafe.safe_cap_w},
            "prolog": {"on_unreachable": self.prolog.on_unreachable, "timeout_s": self.prolog.timeout_s},
            "dry_run": self.dry_run,
            "weights": {
                "default": self.weights.default,
                "partitions": dict(self.weights.partitions),
                "accounts": dict(self.weights.accounts),
                "qos": dict(self.weights.qos),
            },
            "domains": root,
            "agent": {"socket_path": self.agent.socket_path, "socket_group": self.agent.socket_group},
            "coordinator": {
                "address": self.coordinator.address,
                "admin_group": self.coordinator.admin_group,
                "status_group": self.coordinator.status_group,
                "etcd": None if self.coordinator.etcd is None else {
                    "endpoints": list(self.coordinator.etcd.endpoints), "prefix": self.coordinator.etcd.prefix,
                    "lease_ttl_s": self.coordinator.etcd.lease_ttl_s},
            },
            "metrics": {"per_gpu_series": self.metrics.per_gpu_series, "all_up_to_gpus": self.metrics.all_up_to_gpus},
            "models": {"memory_bound_share": self.models.memory_bound_share},
        }

    def with_budget(self, budget_w: float) -> Policy:
        """Return a copy with the cluster budget set to ``budget_w`` watts (root limit included).

        Raises:
            UserInputError: ``budget_w`` not a finite number > 0, above ``budget_ceiling_w``, or
                below the sum of minimum caps of the root when that is known (see
                :func:`capctl.policy.minimums.minimum_w`).
        """
        from capctl.policy.minimums import minimum_w
        from capctl.wattunits import format_watts as fw

        if isinstance(budget_w, bool) or not isinstance(budget_w, (int, float)) or not math.isfinite(budget_w) or budget_w <= 0:
            raise UserInputError(f"budget_w: {budget_w!r} is not allowed; give a finite number of watts > 0")
        budget_w = float(budget_w)
        if self.budget_ceiling_w is not None and budget_w > self.budget_ceiling_w:
            raise UserInputError(
                f"budget_w: {fw(budget_w)} W is above the root domain limit_w {fw(self.budget_ceiling_w)} W of "
                f"{self.source}"
            )
        floor_w = minimum_w(self.domains, self.min_cap_w)
        if floor_w is not None and budget_w < floor_w:
            raise UserInputError(
                f"budget_w: {fw(budget_w)} W is below the sum of minimum caps {fw(floor_w)} W "
                f"(deficit {fw(floor_w - budget_w)} W)"
            )
        return dataclasses.replace(self, budget_w=budget_w, domains=dataclasses.replace(self.domains, limit_w=budget_w))
