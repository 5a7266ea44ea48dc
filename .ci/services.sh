#!/usr/bin/env bash
# Everything the test suite drives, installed and started if missing: PostgreSQL and Redis on
# loopback, a Docker engine with the job image (.ci/docker.sh), the image registry the tests start,
# libvirtd with QEMU and the guest image (.ci/kvm.sh), Debian's Chromium (.ci/browser.sh). Called
# by `make test` after `make venv` (so by CI too, through .ci/run). Idempotent and quick when all
# is up; installing needs root and apt-get. Fails loudly, naming what could not be started.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '== %s\n' "$*"; }
die() { printf 'services.sh FAILED: %s\n' "$*" >&2; exit 1; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local deadline=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "$what did not come up"
    sleep 0.5
  done
}

apt_install() {  # apt_install PACKAGE...: only what is missing; needs root
  local need=() pkg
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
  [ ${#need[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing ${need[*]}, and apt-get is not there to install them"
  [ "$(id -u)" = 0 ] || die "missing ${need[*]}: run 'sudo apt-get install ${need[*]}' (or make test as root)"
  say "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null || die "apt-get update failed"
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || die "apt-get install ${need[*]} failed"
}

say "PostgreSQL"
command -v pg_isready >/dev/null || apt_install postgresql
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  # No systemd on CI machines: start the cluster directly.
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
wait_for 60 "PostgreSQL on 127.0.0.1:5432" pg_isready -q -h 127.0.0.1 -p 5432
psql -h 127.0.0.1 -U postgres -d postgres -tAc "select 1" >/dev/null \
  || die "cannot connect to PostgreSQL on 127.0.0.1 as postgres (the suite needs trust auth on loopback, or DATABASE_URL with a password)"

say "Redis"
command -v redis-server >/dev/null || apt_install redis-server
if ! redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
fi
wait_for 30 "Redis on 127.0.0.1:6379" sh -c 'redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG'

say "deployment kit tools"
# tests/deploy: systemd-analyze verifies deploy/systemd/*, and Debian's nginx (never started as a
# service here: the test runs its own on loopback) fronts gunicorn; openssl makes its certificate.
command -v systemd-analyze >/dev/null || apt_install systemd
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || apt_install nginx
command -v openssl >/dev/null || apt_install openssl
command -v systemd-analyze >/dev/null || die "systemd-analyze is still missing after installing systemd"
[ -x /usr/sbin/nginx ] || die "nginx is still missing after installing nginx"

say "image registry"
# Private images (tests/registry.py starts one per test module on a free loopback port, with htpasswd
# logins): Debian's docker-registry and apache2-utils' htpasswd. dockerd takes plain HTTP from
# 127.0.0.0/8 (its default insecure range), so no TLS.
command -v docker-registry >/dev/null || apt_install docker-registry
command -v htpasswd >/dev/null || apt_install apache2-utils

# Real sandboxes and the browser the suite drives: each script is idempotent and fails loudly.
for extra in .ci/docker.sh .ci/kvm.sh .ci/browser.sh; do
  say "$extra"
  bash "$extra" || die "$extra failed"
done
