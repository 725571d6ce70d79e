#!/usr/bin/env bash
# Creates or reuses .venv at the repo root and installs pdgrpc with the extras its tests
# use (EXTRAS below). Idempotent: when nothing the install depends on has changed, it returns in
# well under a second (a stamp file records a hash of the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv_lib.sh

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.pdgrpc-installed
# The optional extras the test suite needs (pyproject.toml says what each one is for).
EXTRAS=test,ucx,plot,etcd,tls,hf,gguf,gateway,zmq
# Everything that changes what gets installed.
inputs_hash=$(cat pyproject.toml scripts/setup.sh scripts/venv_lib.sh $(ls examples/*/pyproject.toml 2>/dev/null) interop/node/package.json interop/node/package-lock.json | sha256sum | cut -d' ' -f1)
# The JavaScript interop client's dependencies (tests/bootstrap/test_interop_node.py);
# only where node and npm exist: without node that test is skipped.
HAVE_NPM=0
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then HAVE_NPM=1; fi

# Debian packages for the multi-host tests (tests/discovery, tests/e2e/test_multihost.py):
# etcd-server (a real etcd) and iproute2 (`ip netns`). Installed only where missing, only as
# root, and only in CI (CI=true) or when asked (PDGRPC_INSTALL_DEBS=1); elsewhere those tests
# skip saying which package to install. Checked on every run, so no stamp covers it.
debs=()
command -v etcd >/dev/null 2>&1 || debs+=(etcd-server)
command -v ip >/dev/null 2>&1 || debs+=(iproute2)
if [ ${#debs[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && { [ "${CI:-}" = true ] || [ "${PDGRPC_INSTALL_DEBS:-}" = 1 ]; } \
  && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing Debian packages ${debs[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${debs[@]}"
fi

if venv_current "$VENV" "$STAMP" "$inputs_hash" \
  && { [ "$HAVE_NPM" = 0 ] || [ -d interop/node/node_modules ]; }; then
  exit 0
fi

venv_with_torch "$PYTHON" "$VENV" setup
echo "setup: installing pdgrpc[$EXTRAS] (editable)"
$PIP install -q -e ".[$EXTRAS]"
# Pinned exactly for the tests (the tls extra asks only for a floor).
$PIP install -q "cryptography==50.0.2"
# Example third-party plugins (each its own tiny package) used by the tests.
for ex in examples/*/; do
  if [ -f "$ex/pyproject.toml" ]; then
    echo "setup: installing example package $ex"
    $PIP install -q -e "$ex"
  fi
done
if [ "$HAVE_NPM" = 1 ]; then
  echo "setup: installing the interop client's npm packages (interop/node)"
  npm ci --prefix interop/node --no-audit --no-fund --loglevel=error
fi
echo "$inputs_hash" > "$STAMP"
echo "setup: done"
