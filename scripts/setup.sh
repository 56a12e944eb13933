#!/usr/bin/env bash
# Create .venv and install hybridtron with what its commands and tests need.
# torch first, pinned to 2.13.0: the CPU wheel this machine class has locally (a looser spec may pull a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e ".[dev]"
