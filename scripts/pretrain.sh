#!/usr/bin/env bash
# The main job: installs what it needs, then pretrains the tiny preset on the embedded corpus (the running
# Python's standard library). Extra arguments go to `hybridtron pretrain` (e.g. --resume after an interruption).
# Run again on a finished run, it says the run is complete and where its outputs are.
set -euo pipefail
cd "$(dirname "$0")/.."
already_active=${VIRTUAL_ENV:-}
./scripts/setup.sh
. .venv/bin/activate
hybridtron pretrain --preset tiny --out runs/quickstart "$@"
# This script's shell activated .venv for itself only; say how to get `hybridtron` in the user's own shell.
if [ "$already_active" != "$PWD/.venv" ]; then
  cat <<EOF

\`hybridtron\` is installed in .venv. To use it from this shell: . .venv/bin/activate
(or call it by its path: .venv/bin/hybridtron). Then, for example:
  hybridtron report runs/quickstart
  hybridtron generate --model runs/quickstart/hf --prompt "def parse_args("
EOF
fi
