"""Reusable real Slurm test cluster (one slurmctld, several ``slurmd -N nX``, munge, capctl daemons).

Used by ``make slurm-up`` / ``make slurm-down`` (``python -m tests.slurmcluster up|down|status``) and
by the session-scoped pytest fixture in ``tests/slurm/conftest.py``. See :mod:`.cluster`.
"""

from tests.slurmcluster.cluster import DEFAULT_RUN_DIR, ClusterError, SlurmCluster, slurm_installed

__all__ = ["DEFAULT_RUN_DIR", "ClusterError", "SlurmCluster", "slurm_installed"]
