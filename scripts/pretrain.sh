#!/usr/bin/env bash
# The main job: installs what it needs, then pretrains the tiny preset on the embedded corpus (the running
# Python's standard library). Extra arguments go to `hybridtron pretrain`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
hybridtron pretrain --preset tiny --out runs/quickstart "$@"
