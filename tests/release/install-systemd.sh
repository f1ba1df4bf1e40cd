#!/usr/bin/env bash
# Debian's systemd package (systemd-analyze verify/security for the unit-file tests) and man-db
# (verify resolves Documentation=man:...), installed when missing (root). Nothing is started.
set -euo pipefail
missing=()
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v man >/dev/null || missing+=(man-db)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then echo "install-systemd.sh: need root to install ${missing[*]}" >&2; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
