#!/usr/bin/env bash
# Set-up and the demo: a small model fused with one call, cold process then warm, beside eager and torch.compile.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec "$PYTHON" scripts/demo.py "$@"
