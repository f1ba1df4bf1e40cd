"""Which GPUs a Slurm job holds on this node, as ids the node agent maps to NVML devices.

Slurm hands the node prolog/epilog ``SLURM_JOB_GPUS``: with gres.conf ``File=/dev/nvidia[0-7]`` (or
``AutoDetect=nvml``) these are the device numbers of the job's ``/dev/nvidiaN`` files, i.e. the
NVML **minor numbers** (``nvmlDeviceGetMinorNumber``). They are sent to the agent as
``GPU_ID_MINOR``; the agent maps each minor number to its NVML index. UUIDs (``GPU-...``,
``MIG-...``) and PCI bus ids (``00000000:18:00.0``) are recognised too and sent as such.

``CUDA_VISIBLE_DEVICES`` is never used: it is an index into the devices visible *to the job*
(renumbered from 0 under cgroup device constraints, and ordered by CUDA_DEVICE_ORDER) and does not
name a physical GPU. NVML indices are not used either: NVML enumerates by PCI bus id, which need
not follow the minor numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from capctl.errors import UserInputError

GPU_ID_MINOR = 0
GPU_ID_UUID = 1
GPU_ID_PCI_BUS_ID = 2
"""Values of ``capctl.v1.GpuIdKind`` (kept here so this module needs no generated code)."""

KIND_NAMES = {GPU_ID_MINOR: "minor", GPU_ID_UUID: "uuid", GPU_ID_PCI_BUS_ID: "pci_bus_id"}

_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z/-]+$")
_PCI = re.compile(r"^(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")
_MINOR = re.compile(r"^\d+$")
_RANGE = re.compile(r"^(\d+)-(\d+)$")
MAX_RANGE = 4096
"""Largest minor-number range accepted in ``SLURM_JOB_GPUS`` (guards against garbage input)."""


@dataclass(frozen=True)
class JobGpus:
    """GPU ids of one job on this node: ``ids`` (strings, in Slurm's order) of one ``kind``."""

    ids: tuple[str, ...]
    kind: int

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]


def parse_job_gpus(value: str | None) -> JobGpus:
    """Parse ``SLURM_JOB_GPUS`` into :class:`JobGpus`.

    Accepts a comma-separated list of minor numbers (ranges ``a-b`` expanded), of UUIDs or of PCI bus
    ids; ``None``/empty gives no GPUs (kind minor). Duplicates are dropped, order is kept.

    Raises:
        UserInputError: an entry is none of these, or entries of different kinds are mixed.
    """
    if value is None or not value.strip():
        return JobGpus((), GPU_ID_MINOR)
    ids: list[str] = []
    kinds: set[int] = set()
    for raw in value.split(","):
        item = raw.strip()
        if not item:
            continue
        if _MINOR.match(item):
            kinds.add(GPU_ID_MINOR)
            ids.append(str(int(item)))
        elif m := _RANGE.match(item):
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo or hi - lo >= MAX_RANGE:
                raise UserInputError(f"SLURM_JOB_GPUS={value!r}: bad range {item!r}")
            kinds.add(GPU_ID_MINOR)
            ids.extend(str(i) for i in range(lo, hi + 1))
        elif _UUID.match(item):
            kinds.add(GPU_ID_UUID)
            ids.append(item)
        elif _PCI.match(item):
            kinds.add(GPU_ID_PCI_BUS_ID)
            ids.append(item if item.count(":") == 2 else "00000000:" + item)
        else:
            raise UserInputError(
                f"SLURM_JOB_GPUS={value!r}: entry {item!r} is not a minor number, a GPU/MIG UUID "
                "or a PCI bus id"
            )
    if len(kinds) > 1:
        raise UserInputError(f"SLURM_JOB_GPUS={value!r}: mixes minor numbers, UUIDs and PCI bus ids")
    seen: dict[str, None] = {}
    for i in ids:
        seen.setdefault(i, None)
    return JobGpus(tuple(seen), kinds.pop() if kinds else GPU_ID_MINOR)
