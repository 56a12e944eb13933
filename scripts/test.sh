#!/usr/bin/env bash
# The test suite: installs what it needs (scripts/setup.sh), then runs pytest. Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not slow"` for the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
# The report test renders the HTML page in headless Chromium (Debian's package); install it where we can, alongside
# the Python packages (both mostly wait on downloads and unpacking), and wait for it before the tests start.
chromium_install=
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) &
  chromium_install=$!
fi
# vLLM's venv (.venv-vllm, for tests/with_vllm) installs beside .venv at the same time, into its own directory
./scripts/setup_vllm.sh &
vllm_install=$!
./scripts/setup.sh
if ! wait "$vllm_install"; then
  echo "test: scripts/setup_vllm.sh failed (above); tests/with_vllm will fail (HYBRIDTRON_NO_VLLM=1 skips them)" >&2
fi
if [ -n "$chromium_install" ] && ! wait "$chromium_install"; then
  echo "warning: could not install chromium; the report rendering test will be skipped" >&2
fi
. .venv/bin/activate
# two workers, each module on one of them, the longest modules first (tests/conftest.py); `-n 0` runs everything in
# this process
python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup "$@"
