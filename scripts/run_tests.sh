#!/usr/bin/env bash
# Set-up and the test suite (CUDA tests skip where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@" tests
