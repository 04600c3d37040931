#!/usr/bin/env bash
# Set-up and the test suite (CUDA tests skip where there is no GPU). Arguments,
# if any, are pytest's: test files to run instead of the whole suite, options.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec "$PYTHON" -m pytest -q -p no:cacheprovider "${@:-tests}"
