"""Slurm prolog/epilog logic: bind jobs and their GPUs to the local node agent (docs/slurm.md).

- :mod:`slurm.hooks`: ``python -m slurm.hooks prolog|epilog`` (run by ``slurm/prolog``
  and ``slurm/epilog``): one bounded AgentLocal call, fail-open/fail-closed exit status, one log line.
- :mod:`slurm.config`: policy file + environment overrides (timeout, socket, on_unreachable).
- :mod:`slurm.gpus`: ``SLURM_JOB_GPUS`` -> GPU ids (minor numbers / UUIDs / PCI bus ids).
"""
