#!/usr/bin/env bash
# Install Debian packages when missing, for the test setup: apt-install.sh WHO PACKAGE...
# (WHO names the caller in messages). Used by tests/slurmcluster/install.sh and
# tests/etcdcluster/install.sh.
# Idempotent and quiet: does nothing (and no network) when every package is already installed;
# runs `apt-get update` only when a package cannot be found in the local package lists.
# Needs root (the test setup and CI run as root). Never lets a package's maintainer scripts start
# its daemon (no systemd here; the tests start their own).
set -euo pipefail
WHO=${1:?usage: apt-install.sh WHO PACKAGE...}
shift

missing=()
for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$pkg")
    fi
done
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "$WHO: need root to install: ${missing[*]}" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
policy_rc=/usr/sbin/policy-rc.d
own_policy_rc=0
if [ ! -e "$policy_rc" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy_rc"
    chmod 755 "$policy_rc"
    own_policy_rc=1
fi
cleanup() { if [ "$own_policy_rc" -eq 1 ]; then rm -f "$policy_rc"; fi; }
trap cleanup EXIT

apt_update() { apt-get update -q -o DPkg::Lock::Timeout=300 >/dev/null; }
apt_install() {
    apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}" >/dev/null
}

need_update=0
for pkg in "${missing[@]}"; do
    if ! apt-cache show "$pkg" >/dev/null 2>&1; then need_update=1; fi
done
if [ "$need_update" -eq 1 ]; then
    apt_update
fi
if ! apt_install; then
    apt_update
    apt_install
fi
echo "$WHO: installed ${missing[*]}"
