#!/usr/bin/env bash
# Browser for the e2e tests (tests/e2e): Debian's Chromium at /usr/bin/chromium, driven by
# Playwright for Python (requirements.txt). `playwright install` cannot download browsers on
# our machines, so Debian's package is the browser. Idempotent; fails loudly. Called from .ci/services.sh (make test).
set -euo pipefail

die() { printf 'browser.sh FAILED: %s\n' "$*" >&2; exit 1; }
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}

if [ ! -x "$CHROMIUM" ]; then
  command -v apt-get >/dev/null || die "$CHROMIUM is missing and apt-get is not available to install it"
  [ "$(id -u)" = 0 ] || die "$CHROMIUM is missing; installing it needs root (apt-get install -y chromium)"
  echo "installing Debian's chromium"
  apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null || die "apt-get install chromium failed"
fi
[ -x "$CHROMIUM" ] || die "$CHROMIUM is still missing after apt-get install chromium"

# It must start headless with the flags the tests use (tests/e2e/conftest.py); without the
# background-networking flags Chromium keeps trying to reach outside hosts.
version=$(timeout 60 "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking \
  --disable-component-update --disable-sync --no-first-run --version 2>&1) || die "$CHROMIUM does not start: $version"
# (Debian's wrapper script may print a harmless shell warning first: keep the version line.)
echo "browser ok: $(printf '%s\n' "$version" | grep -m1 '^Chromium' || printf '%s' "$version")"
