#!/usr/bin/env bash
# Create .venv and install hybridtron with what its commands and tests need.
# torch first, with pip, pinned to 2.13.0: the CPU wheel this machine class has locally (a looser spec may pull a
# CUDA build; uv does not look there). The rest with uv, which resolves and downloads in parallel (22 s against
# pip's 2 min on 2 cores) and keeps the torch installed above, which every requirement admits; pip if uv fails.
# --compile-bytecode as pip does: with PYTHONDONTWRITEBYTECODE set (as here) nothing would ever write the .pyc
# files, and every process would compile its imports again (Ray's workers then timed out starting).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -d .venv ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check uv
if ! UV_NATIVE_TLS=1 uv pip install -q --compile-bytecode -e ".[dev]" --constraint scripts/constraints.txt; then
  echo "setup: uv could not install the requirements; trying pip" >&2
  python -m pip install -q --disable-pip-version-check -e ".[dev]" --constraint scripts/constraints.txt
fi
