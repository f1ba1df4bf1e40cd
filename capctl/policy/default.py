"""The embedded default policy used by ``capctl demo``: 4 nodes x 8 H100-class GPUs.

Budget: 0.8 x TDP of the 32 GPUs = 0.8 x 32 x 700 W = 17,920 W (H100 SXM5 TDP 700 W, NVIDIA H100
datasheet). Two PDUs of two nodes each, 9,600 W apiece (so a PDU can bind when its nodes' jobs
want more than their share, while both together may exceed the budget: the cluster binds too).
"""

from __future__ import annotations

DEFAULT_POLICY_YAML = """\
# capctl default policy: the demo cluster (4 nodes x 8 H100-class GPUs).
version: 1
budget_w: 17920            # 0.8 x 32 GPUs x 700 W TDP
interval_s: 2
objective: proportional
thermal: {margin_c: 5}
slew_w: null
idle_cap_w: null           # idle GPUs get their pre-job limit back from headroom no running job uses
spread_spare_watts: false  # true: watts no job's pace can use go to running GPUs anyway
start_cap_w: 300
min_cap_w: null            # device minimum (200 W on H100 SXM)
failsafe: {lease_s: 10, safe_cap_w: null}
prolog: {on_unreachable: fail-open, timeout_s: 5}
dry_run: false
weights: {default: 1.0}
domains:
  name: cluster
  kind: cluster
  gpu_model: H100-SXM
  gpus_per_node: 8
  children:
    - {name: pdu-a, kind: pdu, limit_w: 9600, nodes: "node[1-2]"}
    - {name: pdu-b, kind: pdu, limit_w: 9600, nodes: "node[3-4]"}
agent: {socket_path: /run/capctl/agent-%n.sock}
"""
"""YAML text of :data:`capctl.policy.DEFAULT_POLICY` (also a template for new policies)."""
