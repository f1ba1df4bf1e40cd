"""Lower bounds of power under a policy: the smallest cap of one GPU and the least power a domain
needs (watts). Used by the loader (:mod:`capctl.policy.validate`) and by
:meth:`capctl.policy.model.Policy.with_budget`; it imports neither, so they do not import each other.
"""

from __future__ import annotations

from capctl.policy.devices import device_limits_w


def per_gpu_minimum_w(gpu_model: str | None, min_cap_w: float | None, device_min_cap_w=None) -> float | None:
    """Smallest cap a GPU of ``gpu_model`` can get under the policy: max(policy min, device min)."""
    device_min = device_limits_w(gpu_model, device_min_cap_w)[0] if gpu_model else None
    values = [v for v in (min_cap_w, device_min) if v is not None]
    return max(values) if values else None


def minimum_w(domain, min_cap_w: float | None, device_min_cap_w=None) -> float | None:
    """Lower bound of the GPU power a domain needs: sum over its nodes of gpus_per_node x the
    per-GPU minimum (see :func:`per_gpu_minimum_w`), watts. Nodes whose GPU count or minimum is
    unknown add 0; None when nothing is known.

    ``domain``: a :class:`capctl.policy.model.Domain` (anything with ``walk()`` yielding objects
    with ``nodes``, ``gpus_per_node`` and ``gpu_model``).
    """
    total = 0.0
    known = False
    for sub in domain.walk():
        if not sub.nodes or sub.gpus_per_node is None:
            continue
        per_gpu = per_gpu_minimum_w(sub.gpu_model, min_cap_w, device_min_cap_w)
        if per_gpu is None:
            continue
        known = True
        total += len(sub.nodes) * sub.gpus_per_node * per_gpu
    return total if known else None
