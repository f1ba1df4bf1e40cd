"""Slurm prolog/epilog logic: bind jobs and their GPUs to the local node agent."""
