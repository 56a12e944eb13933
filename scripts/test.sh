#!/usr/bin/env bash
# The test suite: installs what it needs (scripts/setup.sh), then runs pytest. Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not slow"` for the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
