"""Policy files: YAML schema, loading and validation with ``file:line:col`` errors.

Public API (see docs/policy.md for every YAML key, its unit and default)::

    load_policy(path, *, device_min_cap_w=None, device_max_cap_w=None) -> Policy
    parse_policy(text, source="<string>", *, device_min_cap_w=None, device_max_cap_w=None) -> Policy
    validate_file(path, *, device_min_cap_w=None, device_max_cap_w=None) -> list[str]
    check_file(path, ...) / check_text(text, source, ...) -> Report(errors, warnings, policy)
    PolicyError(UserInputError): .errors / .warnings, lines "file:line:col: message"
    DEFAULT_POLICY, DEFAULT_POLICY_YAML: the demo cluster (4 nodes x 8 H100, 17,920 W)
    Policy, Domain, ThermalPolicy, FailsafePolicy, PrologPolicy, Weights, AgentPolicy,
    CoordinatorPolicy, MetricsPolicy, ModelsPolicy: frozen dataclasses
"""

from capctl.policy.default import DEFAULT_POLICY_YAML
from capctl.policy.devices import KNOWN_DEVICE_LIMITS_W, device_limits_w
from capctl.policy.model import (
    DOMAIN_KINDS,
    AgentPolicy,
    CoordinatorPolicy,
    Domain,
    FailsafePolicy,
    MetricsPolicy,
    ModelsPolicy,
    Policy,
    PrologPolicy,
    ThermalPolicy,
    Weights,
)
from capctl.policy.validate import (
    PolicyError,
    Report,
    check_file,
    check_text,
    load_policy,
    load_schema,
    minimum_w,
    parse_policy,
    validate_file,
)

DEFAULT_POLICY: Policy = parse_policy(DEFAULT_POLICY_YAML, "<default>")
"""The demo policy (parsed from :data:`DEFAULT_POLICY_YAML`)."""

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_POLICY_YAML",
    "DOMAIN_KINDS",
    "KNOWN_DEVICE_LIMITS_W",
    "AgentPolicy",
    "CoordinatorPolicy",
    "Domain",
    "FailsafePolicy",
    "MetricsPolicy",
    "ModelsPolicy",
    "Policy",
    "PolicyError",
    "PrologPolicy",
    "Report",
    "ThermalPolicy",
    "Weights",
    "check_file",
    "check_text",
    "device_limits_w",
    "load_policy",
    "load_schema",
    "minimum_w",
    "parse_policy",
    "validate_file",
]
