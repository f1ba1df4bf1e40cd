#!/usr/bin/env bash
# Install Debian's etcd (etcd-server + etcd-client 3.4) when missing, for the coordinator HA tests,
# through tests/support/apt-install.sh (idempotent, no network when installed, needs root, starts
# no daemon: tests/etcdcluster starts its own members).
set -euo pipefail
exec bash "$(dirname "$0")/../support/apt-install.sh" tests/etcdcluster/install.sh etcd-server etcd-client
