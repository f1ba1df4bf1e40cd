"""Slurm prolog/epilog logic: bind jobs and their GPUs to the local node agent (docs/slurm.md).

- :mod:`capctl.slurm.hooks`: ``python -m capctl.slurm.hooks prolog|epilog`` (run by ``slurm/prolog``
  and ``slurm/epilog``): one bounded AgentLocal call, fail-open/fail-closed exit status, one log line.
- :mod:`capctl.slurm.config`: policy file + environment overrides (timeout, socket, on_unreachable).
- :mod:`capctl.slurm.gpus`: ``SLURM_JOB_GPUS`` -> GPU ids (minor numbers / UUIDs / PCI bus ids).
"""
