#!/usr/bin/env bash
# Install the Debian packages the test suite needs and make sure the services it talks to run.
# Idempotent: installs only what is missing. Needs root (or sudo) when something is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$here/scripts/debian-packages.txt" | grep -v '^$')

missing=()
for pkg in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "test-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# PostgreSQL on 127.0.0.1:5432: the store and API tests run against it as well as SQLite.
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  version="$(ls /etc/postgresql 2>/dev/null | sort -V | tail -1)"
  if [ -n "$version" ]; then
    echo "test-deps: starting PostgreSQL $version"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  fi
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  echo "test-deps: PostgreSQL is not answering on 127.0.0.1:5432; the PostgreSQL tests will" \
       "fail in CI and be skipped elsewhere" >&2
fi

# Node.js (>= 20) and tests/oidc/node_modules: the SSO tests run a real OpenID Connect provider
# (the npm package oidc-provider, pinned by tests/oidc/package-lock.json) on loopback.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "test-deps: installing nodejs npm"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm >/dev/null
fi
node_major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$node_major" -lt 20 ]; then
  echo "test-deps: Node.js $(node --version) is too old for tests/oidc (oidc-provider 9 needs" \
       ">= 20; 22 LTS recommended): install a newer nodejs, e.g. from NodeSource" >&2
fi
oidc="$here/tests/oidc"
if [ ! -f "$oidc/node_modules/.package-lock.json" ] \
   || [ "$oidc/package-lock.json" -nt "$oidc/node_modules/.package-lock.json" ]; then
  echo "test-deps: npm ci in tests/oidc"
  (cd "$oidc" && npm ci --no-audit --no-fund --loglevel=error)
fi

# tests/web/node_modules: axe-core, which the console's browser tests inject into each page
# (pinned by tests/web/package-lock.json).
web="$here/tests/web"
if [ ! -f "$web/node_modules/.package-lock.json" ] \
   || [ "$web/package-lock.json" -nt "$web/node_modules/.package-lock.json" ]; then
  echo "test-deps: npm ci in tests/web"
  (cd "$web" && npm ci --no-audit --no-fund --loglevel=error)
fi
