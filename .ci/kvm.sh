#!/usr/bin/env bash
# KVM sandbox for the tests: the libvirt client library and virt-xml-validate (libvirt-python itself is
# in requirements.txt); QEMU, libvirtd (started by hand: there is no systemd) and busybox-static; then
# the guest image (a Debian kernel fetched with `apt-get download` plus a busybox initramfs) in var/kvm.
# Idempotent and fast when already done; fails loudly. Called by .ci/services.sh (make test, after `make venv`).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "kvm.sh: ERROR: $*" >&2; exit 1; }
RUN_DIR=/run/gpuportal-ci
URI=qemu:///system

need=()
for pkg in libvirt-dev pkg-config libvirt-clients libxml2-utils gcc \
           qemu-system-x86 libvirt-daemon-system busybox-static iptables; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "kvm.sh: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null || die "apt-get update failed"
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${need[@]}" >/dev/null \
    || die "apt-get install ${need[*]} failed"
fi
# libvirt-python is pinned in requirements.txt and built by `make venv` (.ci/build-deps.sh).
.venv/bin/python -c "import libvirt" 2>/dev/null || die "libvirt-python is missing from .venv: run make venv"
.venv/bin/python -c "import libvirt; libvirt.open('test:///default').close()" || die "libvirt test driver does not open"

# No udev here: /dev/kvm may be root-only, and then libvirt re-probes QEMU on every call (createXML ~46 s).
if [ -c /dev/kvm ] && [ "$(stat -c %G /dev/kvm)" != kvm ] && getent group kvm >/dev/null; then
  chgrp kvm /dev/kvm && chmod 0660 /dev/kvm || die "cannot give /dev/kvm to group kvm"
fi

# A VM that mounts project volumes runs QEMU as the project's uid/gid, outside libvirt's group: it must be
# able to pass through libvirt's folder to its own per-domain one (each 0750, its QEMU's: docs/sandboxes.md).
if [ -d /var/lib/libvirt/qemu ]; then
  chmod o+x /var/lib/libvirt/qemu || die "cannot let QEMU pass through /var/lib/libvirt/qemu"
fi

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if ! virsh -c "$URI" version >/dev/null 2>&1; then
  mkdir -p "$RUN_DIR"
  if ! running "$RUN_DIR/virtlogd.pid"; then
    LIBVIRT_LOG_OUTPUTS="3:file:$RUN_DIR/virtlogd.log" /usr/sbin/virtlogd -d -p "$RUN_DIR/virtlogd.pid" \
      || die "virtlogd did not start (see $RUN_DIR/virtlogd.log)"
  fi
  if ! running "$RUN_DIR/libvirtd.pid"; then
    echo "kvm.sh: starting libvirtd (the first start probes QEMU: ~15 s)"
    LIBVIRT_LOG_OUTPUTS="3:file:$RUN_DIR/libvirtd.log" /usr/sbin/libvirtd -d -p "$RUN_DIR/libvirtd.pid" \
      || die "libvirtd did not start (see $RUN_DIR/libvirtd.log)"
  fi
  deadline=$((SECONDS + 90))
  until virsh -c "$URI" version >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "libvirtd does not answer on $URI after 90 s (see $RUN_DIR/libvirtd.log)"
    sleep 0.2
  done
fi
virsh -c "$URI" domcapabilities --virttype qemu --arch x86_64 >/dev/null 2>&1 \
  || die "libvirtd on $URI cannot run QEMU guests (virsh domcapabilities --virttype qemu failed)"

.venv/bin/python -m agents.sandbox.kvm_image --out var/kvm >/dev/null || die "building the guest image failed"
echo "kvm.sh: ok (libvirtd on $URI, guest image in var/kvm)"
