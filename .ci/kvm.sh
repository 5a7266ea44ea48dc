#!/usr/bin/env bash
# libvirt for the KVM sandbox tests: the client library, virt-xml-validate, and libvirt-python
# built into the project's virtualenv. Idempotent; fails loudly. Called by .ci/run after `make venv`.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "kvm.sh: ERROR: $*" >&2; exit 1; }

need=()
for pkg in libvirt-dev pkg-config libvirt-clients libxml2-utils gcc; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "kvm.sh: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null || die "apt-get update failed"
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${need[@]}" >/dev/null \
    || die "apt-get install ${need[*]} failed"
fi
.venv/bin/python -c "import libvirt" 2>/dev/null || .venv/bin/pip install --quiet "libvirt-python==12.8.0" \
  || die "pip install libvirt-python failed"
.venv/bin/python -c "import libvirt; libvirt.open('test:///default').close()" || die "libvirt test driver does not open"
echo "kvm.sh: ok"
