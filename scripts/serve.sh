#!/usr/bin/env bash
# Set up .venv (idempotent) and start the Ray Serve application of serve_config.yaml (or the file given).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/serve run "${1:-serve_config.yaml}"
