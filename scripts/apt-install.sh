#!/usr/bin/env bash
# apt-get install PACKAGE... (as root) without starting the packages' services: their
# scripts would start daemons (and fail without systemd), so a policy-rc.d refuses while
# this runs (one already there is left as it is). An empty or old package list is
# updated once, then the install is tried again.
set -euo pipefail
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
fi
install=(apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=120 "$@")
export DEBIAN_FRONTEND=noninteractive
"${install[@]}" || { apt-get update -q && "${install[@]}"; }
