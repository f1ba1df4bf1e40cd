#!/usr/bin/env bash
# Install Debian's Slurm (slurm-wlm 22.05: slurmctld, slurmd, slurmdbd, client tools), munge and
# mariadb-server (slurmdbd's database: sacct, AdminComment) when missing, through
# tests/support/apt-install.sh (idempotent, no network when installed, needs root, starts no daemon:
# tests/slurmcluster does that).
set -euo pipefail
exec bash "$(dirname "$0")/../support/apt-install.sh" tests/slurmcluster/install.sh \
    slurmctld slurmd slurm-client munge slurmdbd mariadb-server
