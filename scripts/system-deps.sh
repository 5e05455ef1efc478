#!/usr/bin/env bash
# Installs the Debian packages the tests run for real, when they are missing.
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "Installing Debian packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
