#!/usr/bin/env bash
# Make a Docker engine answer on this machine and build the local job image.
# Idempotent: every step checks first. Called from .ci/services.sh (make test) on a fresh Debian 12
# machine as root; no registry is reachable, so the job image is imported from
# Debian's busybox-static rather than pulled.
set -euo pipefail

IMAGE="${GPUPORTAL_JOB_IMAGE:-gpuportal/busybox:latest}"
STATE="${GPUPORTAL_DOCKER_STATE:-/tmp/gpuportal-ci}"
DEADLINE_S="${GPUPORTAL_DOCKER_DEADLINE_S:-60}"

die() { echo "docker.sh: ERROR: $*" >&2; exit 1; }
say() { echo "docker.sh: $*"; }

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
[ -x /bin/busybox ] || need_pkgs+=(busybox-static)
# The egress policy of jobs with network (agents/sandbox/egress.py) is iptables rules.
command -v iptables >/dev/null 2>&1 || need_pkgs+=(iptables)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  say "installing ${need_pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null \
    || die "apt-get update failed"
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${need_pkgs[@]}" >/dev/null \
    || die "apt-get install ${need_pkgs[*]} failed"
fi
command -v docker >/dev/null 2>&1 || die "no docker client after install"

mkdir -p "$STATE"
if ! docker info >/dev/null 2>&1; then
  # No systemd here (policy-rc.d blocks service starts), so start it by hand.
  # No bridge, no iptables: job containers use network none, and we must not
  # touch the host's network configuration.
  say "starting dockerd (log: $STATE/dockerd.log)"
  # --live-restore: job containers survive a dockerd restart (docs/reliability.md F-12).
  nohup dockerd --bridge=none --iptables=false --ip-forward=false --ip-masq=false --live-restore \
    --pidfile "$STATE/dockerd.pid" >"$STATE/dockerd.log" 2>&1 </dev/null &
  dpid=$!
  end=$(( $(date +%s) + DEADLINE_S ))
  until docker info >/dev/null 2>&1; do
    if ! kill -0 "$dpid" 2>/dev/null; then
      tail -n 30 "$STATE/dockerd.log" >&2 || true
      die "dockerd exited during start-up (log above)"
    fi
    if [ "$(date +%s)" -ge "$end" ]; then
      tail -n 30 "$STATE/dockerd.log" >&2 || true
      die "the Docker engine did not answer 'docker info' within ${DEADLINE_S}s"
    fi
    sleep 0.2
  done
fi
say "engine up: $(docker version --format '{{.Server.Version}}' 2>/dev/null)"

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  say "building $IMAGE from busybox-static"
  root=$(mktemp -d "$STATE/bbroot.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  mkdir -p "$root"/{bin,etc,tmp,work,proc,sys,dev}
  cp /bin/busybox "$root/bin/"
  chroot "$root" /bin/busybox --install -s /bin
  printf 'root:x:0:0::/root:/bin/sh\nnobody:x:65534:65534::/work:/bin/sh\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
  chmod 1777 "$root/tmp"
  tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/bin:/bin:/usr/sbin:/sbin' \
    --change 'USER 65534:65534' --change 'WORKDIR /work' --change 'CMD ["sh"]' \
    - "$IMAGE" >/dev/null || die "docker import of $IMAGE failed"
fi
docker run --rm --network none "$IMAGE" /bin/true || die "$IMAGE does not run"
say "ok: $IMAGE ready"
