"""The policy's device table (capctl.policy.devices) agrees with the simulated driver's profiles, and a
policy for H200 nodes validates (the model is known to capctl-simgpu and capctl sim)."""

from __future__ import annotations

from capctl.policy import load_policy
from capctl.policy.devices import KNOWN_DEVICE_LIMITS_W, KNOWN_NVML_NAMES, device_limits_w
from capctl.simgpu.build import library_path
from tests.conftest import require


def test_policy_device_table_matches_simgpu_profiles():
    require(library_path().is_file(), "simulated NVML library not built (run 'make build')")
    from capctl.simgpu import profiles

    sim = {p.name: (p.min_limit_w, p.max_limit_w) for p in profiles.PROFILES}
    assert dict(KNOWN_DEVICE_LIMITS_W) == sim
    assert dict(KNOWN_NVML_NAMES) == {p.nvml_name: p.name for p in profiles.PROFILES}  # the names NVML reports


def test_h200_policy_validates(tmp_path):
    assert device_limits_w("H200") == (200.0, 700.0)
    p = tmp_path / "h200.yaml"
    p.write_text("""\
version: 1
budget_w: 4480
interval_s: 2
domains:
  name: cluster
  kind: cluster
  gpu_model: H200
  gpus_per_node: 8
  nodes: "h[1]"
""")
    policy = load_policy(str(p))
    assert policy.budget_w == 4480 and not [w for w in policy.warnings if "H200" in w]
