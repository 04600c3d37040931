#!/usr/bin/env bash
# Set-up and the demo: an eager workload with aoti_eager, cold then warm.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec "$PYTHON" scripts/demo.py "$@"
