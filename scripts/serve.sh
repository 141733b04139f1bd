#!/usr/bin/env bash
# Set up .venv (idempotent) and start the Ray Serve application of serve_config.yaml (or the file given).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Ray Serve's HTTP proxy answers its own back-pressure (beyond the ingress's max_queued_requests) in
# OpenAI-style JSON (deployment/admission.py). SPECSERVE_API_KEY, when set, is the application's key.
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployment.admission:proxy_middlewares
exec .venv/bin/serve run "${1:-serve_config.yaml}"
