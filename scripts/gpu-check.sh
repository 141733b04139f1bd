#!/usr/bin/env bash
# The prepared device check (specserve/gpu_check.py): exactness of the sampling core on the GPU, its
# time per verification step, and the draft decode eager vs compiled. Needs PyTorch (CUDA), safetensors
# and scipy; no vLLM, no network. Runs in the repository root; at most a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi  # the lent machine has no .venv
fi
PYTHONUNBUFFERED=1 exec "$PYTHON" -m specserve.gpu_check "$@"
