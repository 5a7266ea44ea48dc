#!/usr/bin/env bash
# What `pip install -r requirements.txt` needs to build on a fresh Debian machine: libvirt-python
# compiles against libvirt's headers (libvirt-dev, found through pkg-config) with gcc and Python's
# headers. Called by `make venv` with the venv's python. Installs what is missing when run as root
# on Debian; otherwise says what to install. Quick when everything is there.
set -euo pipefail
py=${1:?usage: build-deps.sh PYTHON}
"$py" -c "import libvirt" 2>/dev/null && exit 0  # already built into this venv

have_headers() { "$py" -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; }
need=()
command -v pkg-config >/dev/null || need+=(pkg-config)
pkg-config --exists libvirt 2>/dev/null || need+=(libvirt-dev)
command -v gcc >/dev/null || need+=(gcc)
have_headers || need+=("python$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-dev")
[ ${#need[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null; then
  echo "make venv: libvirt-python needs libvirt's headers, pkg-config, gcc and Python's headers (on Debian: ${need[*]})" >&2
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  echo "make venv: libvirt-python needs ${need[*]} to build: run 'sudo apt-get install ${need[*]}' first" >&2
  exit 1
fi
echo "make venv: installing ${need[*]} (to build libvirt-python)"
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
  || { echo "make venv: apt-get install ${need[*]} failed" >&2; exit 1; }
