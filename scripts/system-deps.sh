#!/usr/bin/env bash
# Installs the Debian packages the tests run for real, when they are missing, and the two
# npm packages the status page's checks run (axe-core in the browser, the Nu HTML Checker).
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
# The containers tier: a real Docker engine (started by the tier when none runs), base images
# made from Debian packages when no container registry answers, and nft to undo Docker's
# netfilter tables when the tier stops the engine it started.
[ -x /usr/sbin/dockerd ] || command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v java >/dev/null 2>&1 || need+=(default-jre-headless)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if [ ${#need[@]} -gt 0 ]; then
    echo "Installing Debian packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# Pinned: tests/app/test_status_page.py finds them under `npm root -g`.
npm_root="$(npm root -g)"
npm_need=()
[ -f "$npm_root/axe-core/axe.min.js" ] || npm_need+=(axe-core@4.14.1)
[ -f "$npm_root/vnu-jar/build/dist/vnu.jar" ] || npm_need+=(vnu-jar@26.9.27)
if [ ${#npm_need[@]} -gt 0 ]; then
    echo "Installing npm packages: ${npm_need[*]}"
    $sudo npm install -g --no-fund --no-audit "${npm_need[@]}" >/dev/null
fi
