#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
